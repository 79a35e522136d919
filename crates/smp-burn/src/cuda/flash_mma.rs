//! [`FlashVariant::Mma`](super::FlashVariant::Mma): causal flash attention on tensor cores with
//! register-resident scores, through CubeCL's manual MMA API (`cmma::MmaDefinition`, lowered to
//! PTX `mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}` and `ldmatrix`).
//!
//! Why: the `Cmma` variant uses `wmma` fragments, whose element layout is unspecified, so every
//! score block goes to shared memory for the softmax and comes back as `P`. Here the layout is
//! the documented one of `mma.sync`, so the softmax runs on the accumulator registers and `P`
//! feeds the next product without touching shared memory (FlashAttention-2's structure).
//!
//! # Fragment layouts (m16n8k16, per lane; `g = lane / 4`, `t = lane % 4`)
//!
//! These follow the PTX ISA ("Matrix Fragments for mma.m16n8k16") and CubeCL's
//! `position_of_nth` table for CUDA (`cubecl-cpp`'s `CudaMmaProcessor`), which agree:
//! - accumulator (16 x 8, f32): `Array<Vector<f32, 2>>` of 2; vector 0 holds row `g`,
//!   columns `2t, 2t + 1`; vector 1 holds row `g + 8`, the same columns.
//! - A (16 x 16): `Array<Vector<F, 2>>` of 4: (row `g`, k `2t..`), (row `g + 8`, k `2t..`),
//!   (row `g`, k `2t + 8..`), (row `g + 8`, k `2t + 8..`).
//! - B (16 x 8): `Array<Vector<F, 2>>` of 2: (k `2t..`, column `g`), (k `2t + 8..`, column `g`).
//!
//! Consequences used below:
//! - `ldmatrix.x4` gives lane `l` one register per 8x8 matrix `i` (row addresses from lanes
//!   `8i .. 8i + 8`), holding row `g`, columns `2t, 2t + 1` of that matrix (with `.trans`:
//!   column `g`, rows `2t, 2t + 1`). So Q (A operand, row-major) is one x4 load with lane `l`
//!   pointing at row `l % 16`, column `8 * (l / 16)`; K (B operand of `Q K^T`, stored as
//!   `[key][d]`) is one x4 load per pair of key n-tiles with lane `l` pointing at key
//!   `l % 8 + 8 * (l / 16)`, column `8 * ((l / 8) % 2)`; V (B operand of `P V`, stored as
//!   `[key][d]`) is one transposed x4 load per pair of d n-tiles, addressed like Q.
//! - The accumulators of two adjacent key n-tiles `2j`, `2j + 1` are, vector for vector, the A
//!   fragment of keys `16j .. 16j + 16`: `P` is rounded to the input dtype in registers and used
//!   directly as the A operand of `P V`.
//! - A row of the score block lives in the 4 lanes of one quad (`lane / 4` equal), so the row
//!   max and sum need two `plane_shuffle_xor` steps (masks 1 and 2).
//!
//! [`mma_fragment_probe`] runs exactly these helpers on small integer matrices so that a wrong
//! layout assumption is reported as such (`flash_check` runs it before the Mma checks).
//!
//! # Forward kernel
//!
//! One cube per (query block, query head, batch) with `warps` warps; warp `w` owns `16 *
//! m_tiles` query rows. Q is staged once in shared memory (re-read with `ldmatrix` per key
//! block; keeping it in registers would cost 32 registers per 16 rows at hd 128), K and V blocks
//! of [`MMA_KEYS`] keys are staged per iteration. With `m_tiles == 1` the next K/V block is
//! loaded into registers while the current one is in use (as the Cmma kernels do); with
//! `m_tiles == 2` the accumulators need those registers, so staging is synchronous. Per lane,
//! the registers hold O (`m_tiles * d / 2` f32), S/P (`m_tiles * 32` f32), the running max and
//! sum of its 2 rows per m-tile, and the fragments in flight. The softmax is the usual online
//! one (rescale O and the sum by `exp(m_old - m_new)` every block); scores are masked with a
//! finite `-1e30` only on blocks that cross the diagonal, and warps whose rows are all above a
//! key block skip it.

// Kernel code is expanded by `#[cube]`, which has no `div_ceil` on runtime integers.
#![allow(clippy::manual_div_ceil)]

use std::sync::Mutex;

use burn::tensor::DType;
use burn_cubecl::CubeRuntime;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::features::MmaConfig;
use cubecl::ir::{ElemType, FloatKind};
use cubecl::prelude::*;

use super::{load_tile_regs, stage_tile, store_tile_regs, vector_width};

/// Keys per block of the Mma forward's inner loop.
pub const MMA_KEYS: usize = 64;

/// Warps per cube and 16-row m-tiles per warp of the Mma kernels: a cube covers
/// `16 * warps * m_tiles` query rows.
///
/// More rows per warp (`m_tiles = 2`) halves the shared-memory reads of K and V per FLOP but
/// doubles the accumulator registers and turns off the register prefetch of the next K/V block;
/// more warps per cube share one staged K/V block between more rows. Which is fastest is a
/// measurement, hence the knob (`SMP_BURN_FLASH_MMA_TILING`, [`set_mma_tiling`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MmaTiling {
    /// Warps per cube: 4 or 8.
    pub warps: usize,
    /// 16-row tiles per warp: 1 or 2.
    pub m_tiles: usize,
}

impl MmaTiling {
    /// 8 warps of 16 rows (128 query rows per cube): the fastest forward at S = 4096 on an
    /// H200 (175 TFLOP/s, causal hd 128; 4x1 149, 4x2 164, 8x2 161), within 1 % of the best
    /// (8x2) at S = 16384.
    pub const DEFAULT: MmaTiling = MmaTiling {
        warps: 8,
        m_tiles: 1,
    };

    /// Every supported tiling, for benchmarks.
    pub const ALL: [MmaTiling; 4] = [
        MmaTiling {
            warps: 4,
            m_tiles: 1,
        },
        MmaTiling {
            warps: 8,
            m_tiles: 1,
        },
        MmaTiling {
            warps: 4,
            m_tiles: 2,
        },
        MmaTiling {
            warps: 8,
            m_tiles: 2,
        },
    ];

    /// Query rows per cube.
    pub fn rows(&self) -> usize {
        16 * self.warps * self.m_tiles
    }

    /// Parses `WARPSxMTILES`, e.g. `4x1`; `None` for anything unsupported.
    pub fn parse(s: &str) -> Option<MmaTiling> {
        let (w, m) = s.trim().split_once('x')?;
        let tiling = MmaTiling {
            warps: w.parse().ok()?,
            m_tiles: m.parse().ok()?,
        };
        Self::ALL.contains(&tiling).then_some(tiling)
    }
}

impl std::fmt::Display for MmaTiling {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}x{}", self.warps, self.m_tiles)
    }
}

/// Process-wide override of the tiling; `None` means "from the environment".
static TILING_OVERRIDE: Mutex<Option<MmaTiling>> = Mutex::new(None);

/// The tiling the Mma kernels launch with: the last [`set_mma_tiling`], else
/// `SMP_BURN_FLASH_MMA_TILING` (`4x1`, `8x1`, `4x2` or `8x2`), else [`MmaTiling::DEFAULT`].
///
/// # Panics
/// If the environment variable is set to something else (a silent fallback would make a
/// benchmark measure the wrong kernel).
pub fn mma_tiling() -> MmaTiling {
    if let Some(t) = *TILING_OVERRIDE.lock().unwrap_or_else(|e| e.into_inner()) {
        return t;
    }
    match std::env::var("SMP_BURN_FLASH_MMA_TILING") {
        Ok(s) => MmaTiling::parse(&s).unwrap_or_else(|| {
            panic!("SMP_BURN_FLASH_MMA_TILING={s:?}: expected one of 4x1, 8x1, 4x2, 8x2")
        }),
        Err(_) => MmaTiling::DEFAULT,
    }
}

/// Overrides the Mma tiling for this process (`None`: back to the environment / default).
pub fn set_mma_tiling(tiling: Option<MmaTiling>) {
    *TILING_OVERRIDE.lock().unwrap_or_else(|e| e.into_inner()) = tiling;
}

/// Whether the device has `mma.sync` m16n8k16 with `dtype` inputs and f32 accumulators, and
/// `ldmatrix` for `dtype` (CUDA sm_80 and later).
pub fn mma_supported<R: CubeRuntime>(client: &ComputeClient<R>, dtype: DType) -> bool {
    let elem = match dtype {
        DType::BF16 => ElemType::Float(FloatKind::BF16),
        DType::F16 => ElemType::Float(FloatKind::F16),
        _ => return false,
    };
    let features = client.features();
    features.matmul.mma.contains(&MmaConfig {
        a_type: elem.into(),
        b_type: elem.into(),
        cd_type: ElemType::Float(FloatKind::F32).into(),
        m: 16,
        n: 8,
        k: 16,
    }) && features.matmul.ldmatrix.contains(&elem.into())
}

// ------------------------------------------------------------------------------------------
// Fragment helpers (device side). One warp each; `lane` is UNIT_POS_PLANE.
// ------------------------------------------------------------------------------------------

/// `ldmatrix.x4` (optionally `.trans`) from a shared tile of `nv`-element vectors; `elem_off` is
/// the element offset of the 16-byte row this lane supplies (a multiple of 8).
#[cube]
fn ldsm_x4<F: Float, N: Size>(
    smem: &SharedMemory<Vector<F, N>>,
    elem_off: usize,
    #[comptime] nv: usize,
    #[comptime] trans: bool,
) -> Array<Vector<F, Const<2>>> {
    let def = cmma::MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let start = elem_off / nv;
    let len = comptime!(8 / nv);
    def.load_matrix::<Vector<F, N>, Const<2>>(
        &smem.slice(start, start + len),
        cmma::MatrixIdent::A,
        4usize,
        trans,
    )
}

/// Registers `first` and `first + 1` of an x4 load: one B fragment.
#[cube]
fn frag_pair<F: Float>(
    x4: &Array<Vector<F, Const<2>>>,
    #[comptime] first: usize,
) -> Array<Vector<F, Const<2>>> {
    let mut out = Array::<Vector<F, Const<2>>>::new(2usize);
    out[0] = x4[first];
    out[1] = x4[comptime!(first + 1)];
    out
}

/// `n` f32 accumulator fragments (16 x 8 each) set to zero.
#[cube]
fn zero_frags(#[comptime] n: usize) -> Sequence<Array<Vector<f32, Const<2>>>> {
    let mut frags = Sequence::<Array<Vector<f32, Const<2>>>>::new();
    #[unroll]
    for _i in 0..n {
        let mut a = Array::<Vector<f32, Const<2>>>::new(2usize);
        a[0] = Vector::new(f32::new(0.0));
        a[1] = Vector::new(f32::new(0.0));
        frags.push(a);
    }
    frags
}

/// `S = A B^T` for one warp: `A` is `16 * m_tiles` rows of a row-major shared tile starting at
/// row `a_row0` (pitch `ldt`), `B` the `8 * n_tiles` rows of another starting at row 0, both
/// `16 * k_steps` columns wide. Fragment `mt * n_tiles + nt` of `s` receives rows
/// `16 mt .. 16 mt + 16`, columns (rows of B) `8 nt .. 8 nt + 8`; its previous content is
/// overwritten. `n_tiles` must be even.
#[cube]
#[allow(clippy::too_many_arguments)]
fn mma_abt_strip<F: Float, N: Size>(
    a: &SharedMemory<Vector<F, N>>,
    a_row0: usize,
    b: &SharedMemory<Vector<F, N>>,
    s: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    lane: usize,
    #[comptime] m_tiles: usize,
    #[comptime] n_tiles: usize,
    #[comptime] k_steps: usize,
    #[comptime] ldt: usize,
    #[comptime] nv: usize,
) {
    let def = cmma::MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    #[unroll]
    for i in 0..comptime!(m_tiles * n_tiles) {
        let acc = s.index_mut(i);
        acc[0] = Vector::new(f32::new(0.0));
        acc[1] = Vector::new(f32::new(0.0));
    }
    // A: lane l supplies row l % 16, column 8 (l / 16) of the 16x16 sub-tile.
    let a_row = lane % 16;
    let a_col = (lane / 16) * 8;
    // B (rows of the B tile are the n dimension): lane l supplies row l % 8 + 8 (l / 16),
    // column 8 ((l / 8) % 2): matrices (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7),
    // (n 8-15, k 8-15) = b0, b1 of n-tile 2j, then b0, b1 of n-tile 2j + 1.
    let b_row = lane % 8 + (lane / 16) * 8;
    let b_col = ((lane / 8) % 2) * 8;
    #[unroll]
    for kk in 0..k_steps {
        let mut a_frags = Sequence::<Array<Vector<F, Const<2>>>>::new();
        #[unroll]
        for mt in 0..m_tiles {
            a_frags.push(ldsm_x4::<F, N>(
                a,
                (a_row0 + 16 * mt + a_row) * ldt + 16 * kk + a_col,
                nv,
                false,
            ));
        }
        #[unroll]
        for np in 0..comptime!(n_tiles / 2) {
            let b4 = ldsm_x4::<F, N>(b, (16 * np + b_row) * ldt + 16 * kk + b_col, nv, false);
            let b_lo = frag_pair::<F>(&b4, 0usize);
            let b_hi = frag_pair::<F>(&b4, 2usize);
            #[unroll]
            for mt in 0..m_tiles {
                let af = a_frags.index(mt);
                def.execute_inplace(af, &b_lo, s.index_mut(comptime!(mt * n_tiles + 2 * np)));
                def.execute_inplace(af, &b_hi, s.index_mut(comptime!(mt * n_tiles + 2 * np + 1)));
            }
        }
    }
}

/// `O += P V` for one warp: `p` holds the probabilities of `16 * m_tiles` rows by
/// `8 * n_tiles` keys in accumulator order (`((mt * n_tiles + nt) * 2 + h) * 2 + e` is
/// element `e` of vector `h` of fragment (mt, nt)); `V` is a row-major shared tile `[key][d]`
/// (pitch `ldt`). Fragment `mt * d_tiles + dt` of `o` accumulates rows of m-tile `mt`,
/// columns `8 dt .. 8 dt + 8`. P is rounded to `F` here (as in FlashAttention-2).
#[cube]
#[allow(clippy::too_many_arguments)]
fn mma_pv_strip<F: Float, N: Size>(
    p: &Array<f32>,
    v: &SharedMemory<Vector<F, N>>,
    o: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    lane: usize,
    #[comptime] m_tiles: usize,
    #[comptime] n_tiles: usize,
    #[comptime] d_tiles: usize,
    #[comptime] ldt: usize,
    #[comptime] nv: usize,
) {
    let def = cmma::MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    // Transposed V loads: lane l supplies key row l % 16, column 8 (l / 16): matrices (keys
    // 0-7, d 0-7), (keys 8-15, d 0-7), (keys 0-7, d 8-15), (keys 8-15, d 8-15) = b0, b1 of
    // d-tile 2j, then b0, b1 of d-tile 2j + 1.
    let v_row = lane % 16;
    let v_col = (lane / 16) * 8;
    #[unroll]
    for kk in 0..comptime!(n_tiles / 2) {
        // A fragment of keys 16 kk .. 16 kk + 16 = accumulators of key n-tiles 2kk, 2kk + 1:
        // (n-tile 2kk, row g), (2kk, row g + 8), (2kk + 1, row g), (2kk + 1, row g + 8).
        let mut p_frags = Sequence::<Array<Vector<F, Const<2>>>>::new();
        #[unroll]
        for mt in 0..m_tiles {
            let mut pa = Array::<Vector<F, Const<2>>>::new(4usize);
            #[unroll]
            for j in 0..4usize {
                let base = comptime!(((mt * n_tiles + 2 * kk + j / 2) * 2 + j % 2) * 2);
                let mut pv = Vector::<F, Const<2>>::empty();
                pv[0] = F::cast_from(p[base]);
                pv[1] = F::cast_from(p[comptime!(base + 1)]);
                pa[j] = pv;
            }
            p_frags.push(pa);
        }
        #[unroll]
        for dp in 0..comptime!(d_tiles / 2) {
            let b4 = ldsm_x4::<F, N>(v, (16 * kk + v_row) * ldt + 16 * dp + v_col, nv, true);
            let b_lo = frag_pair::<F>(&b4, 0usize);
            let b_hi = frag_pair::<F>(&b4, 2usize);
            #[unroll]
            for mt in 0..m_tiles {
                let pf = p_frags.index(mt);
                def.execute_inplace(pf, &b_lo, o.index_mut(comptime!(mt * d_tiles + 2 * dp)));
                def.execute_inplace(pf, &b_hi, o.index_mut(comptime!(mt * d_tiles + 2 * dp + 1)));
            }
        }
    }
}

// ------------------------------------------------------------------------------------------
// Forward
// ------------------------------------------------------------------------------------------

/// Forward, manual MMA. Cube = (query head, query block from the last, batch); `32 * warps`
/// threads; see the module doc.
#[cube(launch_unchecked, fast_math = FastMath::all())]
// `if comptime!(..) { if runtime {..} }` stays nested: the outer branch is resolved at
// expansion, the inner one is emitted.
#[allow(clippy::too_many_arguments, clippy::collapsible_if)]
fn flash_fwd_mma<F: Float, N: Size>(
    q: &Tensor<Vector<F, N>>,
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    o: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    scale: f32,
    seq_len: u32,
    group: u32,
    n_blocks: u32,
    #[comptime] d: usize,
    #[comptime] nv: usize,
    #[comptime] warps: usize,
    #[comptime] m_tiles: usize,
    #[define(F)] _dtype: StorageType,
) {
    let rows_w = comptime!(16 * m_tiles);
    let bq = comptime!(16 * m_tiles * warps);
    let bk = comptime!(MMA_KEYS);
    let nthreads = comptime!(32 * warps);
    let ldt = comptime!(d + 8);
    let n_tiles = comptime!(MMA_KEYS / 8);
    let d_tiles = comptime!(d / 8);
    let k_steps = comptime!(d / 16);
    let prefetch = comptime!(m_tiles == 1);
    let kv_regs = comptime!(MMA_KEYS * d / nv / (32 * warps));

    let seq = seq_len as usize;
    let h = CUBE_POS_X as usize;
    let qb = n_blocks as usize - 1 - CUBE_POS_Y as usize;
    let b = CUBE_POS_Z as usize;
    let hk = h / group as usize;
    let warp = UNIT_POS as usize / 32;
    let lane = UNIT_POS_PLANE as usize;
    let q0 = qb * bq;
    // This warp's first row, within the block and absolute.
    let wrow = warp * rows_w;
    let row0 = q0 + wrow;

    // Where this lane's accumulator elements sit: elements 0/1 in row r_lo, 2/3 in row r_hi,
    // columns c_lo and c_lo + 1 (CubeCL's table; the module doc derives the values).
    let def = cmma::MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let (r_lo, c_lo) = def.position_of_nth(lane as u32, 0u32, cmma::MatrixIdent::Accumulator);
    let (r_hi, _c_hi) = def.position_of_nth(lane as u32, 2u32, cmma::MatrixIdent::Accumulator);
    let r_lo = r_lo as usize;
    let r_hi = r_hi as usize;
    let c_lo = c_lo as usize;

    let q_base = (b * q.stride(0) + h * q.stride(1)) / nv;
    let k_base = (b * k.stride(0) + hk * k.stride(1)) / nv;
    let v_base = (b * v.stride(0) + hk * v.stride(1)) / nv;
    let k_rs = k.stride(2) / nv;
    let v_rs = v.stride(2) / nv;

    let mut qs = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(bq * ldt / nv), 128usize);
    let mut ks =
        SharedMemory::<Vector<F, N>>::new_aligned(comptime!(MMA_KEYS * ldt / nv), 128usize);
    let mut vs =
        SharedMemory::<Vector<F, N>>::new_aligned(comptime!(MMA_KEYS * ldt / nv), 128usize);

    stage_tile::<F, N>(
        q,
        q_base,
        q.stride(2) / nv,
        q0,
        seq,
        &mut qs,
        bq,
        d,
        ldt,
        nv,
        nthreads,
    );

    let mut o_acc = zero_frags(comptime!(m_tiles * d / 8));
    let mut s_acc = zero_frags(comptime!(m_tiles * MMA_KEYS / 8));
    let mut p = Array::<f32>::new(comptime!(m_tiles * MMA_KEYS / 2));
    // Running max (of scaled scores) and this lane's partial running sum, per (m-tile, half).
    let mut m_run = Array::<f32>::new(comptime!(2 * m_tiles));
    let mut l_run = Array::<f32>::new(comptime!(2 * m_tiles));
    #[unroll]
    for i in 0..comptime!(2 * m_tiles) {
        m_run[i] = f32::new(-1.0e30);
        l_run[i] = f32::new(0.0);
    }

    let mut q_end = q0 + bq;
    if seq < q_end {
        q_end = seq;
    }
    let n_kb = (q_end + bk - 1) / bk;

    let mut k_regs = Array::<Vector<F, N>>::new(kv_regs);
    let mut v_regs = Array::<Vector<F, N>>::new(kv_regs);
    if comptime!(prefetch) {
        load_tile_regs::<F, N>(k, k_base, k_rs, 0, seq, &mut k_regs, bk, d, nv, nthreads);
        load_tile_regs::<F, N>(v, v_base, v_rs, 0, seq, &mut v_regs, bk, d, nv, nthreads);
    }

    for kb in 0..n_kb {
        let k0 = kb * bk;
        sync_cube();
        if comptime!(prefetch) {
            store_tile_regs::<F, N>(&k_regs, &mut ks, bk, d, ldt, nv, nthreads);
            store_tile_regs::<F, N>(&v_regs, &mut vs, bk, d, ldt, nv, nthreads);
        } else {
            stage_tile::<F, N>(k, k_base, k_rs, k0, seq, &mut ks, bk, d, ldt, nv, nthreads);
            stage_tile::<F, N>(v, v_base, v_rs, k0, seq, &mut vs, bk, d, ldt, nv, nthreads);
        }
        sync_cube();
        if comptime!(prefetch) {
            if kb + 1 < n_kb {
                load_tile_regs::<F, N>(
                    k,
                    k_base,
                    k_rs,
                    k0 + bk,
                    seq,
                    &mut k_regs,
                    bk,
                    d,
                    nv,
                    nthreads,
                );
                load_tile_regs::<F, N>(
                    v,
                    v_base,
                    v_rs,
                    k0 + bk,
                    seq,
                    &mut v_regs,
                    bk,
                    d,
                    nv,
                    nthreads,
                );
            }
        }

        // Warps whose rows all precede the block see none of its keys (warp-uniform).
        if k0 < row0 + rows_w {
            mma_abt_strip::<F, N>(
                &qs, wrow, &ks, &mut s_acc, lane, m_tiles, n_tiles, k_steps, ldt, nv,
            );
            // Only blocks that reach past this warp's first row need the causal mask.
            let masked = k0 + bk > row0 + 1;
            #[unroll]
            for mt in 0..m_tiles {
                #[unroll]
                for hh in 0..2usize {
                    let mut r = r_lo;
                    if hh == 1 {
                        r = r_hi;
                    }
                    let row = row0 + 16 * mt + r;
                    let si = comptime!(mt * 2 + hh);
                    // Raw scores of this row (scale > 0, so the max commutes with it).
                    let mut mx = f32::new(-1.0e30);
                    #[unroll]
                    for nt in 0..n_tiles {
                        let frag = s_acc.index(comptime!(mt * n_tiles + nt));
                        let pair = frag[hh];
                        #[unroll]
                        for e in 0..2usize {
                            let mut sv = pair[e];
                            if masked {
                                let key = k0 + 8 * nt + c_lo + e;
                                if key > row {
                                    sv = f32::new(-1.0e30);
                                }
                            }
                            p[comptime!(((mt * n_tiles + nt) * 2 + hh) * 2 + e)] = sv;
                            mx = f32::max(mx, sv);
                        }
                    }
                    mx = f32::max(mx, plane_shuffle_xor(mx, 1u32));
                    mx = f32::max(mx, plane_shuffle_xor(mx, 2u32));
                    let m_old = m_run[si];
                    let m_new = f32::max(m_old, mx * scale);
                    let alpha = (m_old - m_new).exp();
                    m_run[si] = m_new;
                    let mut lsum = f32::new(0.0);
                    #[unroll]
                    for j in 0..comptime!(2 * n_tiles) {
                        let idx = comptime!(((mt * n_tiles + j / 2) * 2 + hh) * 2 + j % 2);
                        let pe = (p[idx] * scale - m_new).exp();
                        p[idx] = pe;
                        lsum += pe;
                    }
                    l_run[si] = l_run[si] * alpha + lsum;
                    let alpha_v = Vector::<f32, Const<2>>::new(alpha);
                    #[unroll]
                    for dt in 0..d_tiles {
                        let frag = o_acc.index_mut(comptime!(mt * d_tiles + dt));
                        frag[hh] = frag[hh] * alpha_v;
                    }
                }
            }
            mma_pv_strip::<F, N>(
                &p, &vs, &mut o_acc, lane, m_tiles, n_tiles, d_tiles, ldt, nv,
            );
        }
    }

    // Each lane summed only its own columns: finish the row sums across the quad.
    #[unroll]
    for i in 0..comptime!(2 * m_tiles) {
        let l = l_run[i];
        let l = l + plane_shuffle_xor(l, 1u32);
        l_run[i] = l + plane_shuffle_xor(l, 2u32);
    }
    let o_base = b * o.stride(0) + h * o.stride(1);
    let lse_base = b * lse.stride(0) + h * lse.stride(1);
    #[unroll]
    for mt in 0..m_tiles {
        #[unroll]
        for hh in 0..2usize {
            let mut r = r_lo;
            if hh == 1 {
                r = r_hi;
            }
            let row = row0 + 16 * mt + r;
            let si = comptime!(mt * 2 + hh);
            if row < seq {
                let l = l_run[si];
                let inv = f32::new(1.0) / l;
                let ob = o_base + row * o.stride(2) + c_lo;
                #[unroll]
                for dt in 0..d_tiles {
                    let frag = o_acc.index(comptime!(mt * d_tiles + dt));
                    let pair = frag[hh];
                    o[ob + 8 * dt] = F::cast_from(pair[0] * inv);
                    o[ob + 8 * dt + 1] = F::cast_from(pair[1] * inv);
                }
                if c_lo == 0 {
                    lse[lse_base + row * lse.stride(2)] = m_run[si] + l.ln();
                }
            }
        }
    }
}

/// Launches the Mma forward into `o`, `lse` (allocated by the caller with the usual shapes).
#[allow(clippy::too_many_arguments)]
pub(super) fn launch_forward<R: CubeRuntime>(
    q: CubeTensor<R>,
    k: CubeTensor<R>,
    v: CubeTensor<R>,
    o: &CubeTensor<R>,
    lse: &CubeTensor<R>,
    scale: f32,
    heads_q: usize,
    batch: usize,
    seq: usize,
    head_dim: usize,
    group: usize,
) {
    assert!(
        scale > 0.0,
        "flash attention (Mma): the softmax scale must be positive, got {scale}"
    );
    let tiling = mma_tiling();
    let client = q.client.clone();
    let dtype = q.dtype;
    let nv = vector_width(&[&q, &k, &v]);
    let n_blocks = seq.div_ceil(tiling.rows()) as u32;
    let count = CubeCount::Static(heads_q as u32, n_blocks, batch as u32);
    // SAFETY: global reads are guarded by `seq` (rows past it are zero-filled in shared
    // memory), writes by `row < seq`; shared indices stay inside the comptime-sized tiles
    // (ldmatrix rows are 16-byte aligned: pitches of d + 8 elements, columns multiples of 8).
    unsafe {
        flash_fwd_mma::launch_unchecked::<R>(
            &client,
            count,
            CubeDim::new_1d(32 * tiling.warps as u32),
            nv,
            q.into_tensor_arg(),
            k.into_tensor_arg(),
            v.into_tensor_arg(),
            o.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            scale,
            seq as u32,
            group as u32,
            n_blocks,
            head_dim,
            nv,
            tiling.warps,
            tiling.m_tiles,
            dtype.into(),
        );
    }
}

// ------------------------------------------------------------------------------------------
// Fragment probe
// ------------------------------------------------------------------------------------------

/// One warp runs the forward's fragment helpers on 16x16 inputs: `s = a k^T` through
/// [`mma_abt_strip`] (two key n-tiles), then `o = s v` through [`mma_pv_strip`] with `s` as
/// `P`; both written out through the accumulator layout the forward uses for O.
#[cube(launch_unchecked)]
fn mma_probe_kernel<F: Float, N: Size>(
    a: &Tensor<Vector<F, N>>,
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    s_out: &mut Tensor<f32>,
    o_out: &mut Tensor<f32>,
    pos_out: &mut Tensor<u32>,
    #[define(F)] _dtype: StorageType,
) {
    let ldt = comptime!(24usize);
    let lane = UNIT_POS_PLANE as usize;
    let mut as_ = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(16usize * 24), 128usize);
    let mut ks = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(16usize * 24), 128usize);
    let mut vs = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(16usize * 24), 128usize);
    stage_tile::<F, N>(
        a, 0usize, 16usize, 0usize, 16usize, &mut as_, 16usize, 16usize, ldt, 1usize, 32usize,
    );
    stage_tile::<F, N>(
        k, 0usize, 16usize, 0usize, 16usize, &mut ks, 16usize, 16usize, ldt, 1usize, 32usize,
    );
    stage_tile::<F, N>(
        v, 0usize, 16usize, 0usize, 16usize, &mut vs, 16usize, 16usize, ldt, 1usize, 32usize,
    );
    sync_cube();

    let def = cmma::MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let (r_lo, c_lo) = def.position_of_nth(lane as u32, 0u32, cmma::MatrixIdent::Accumulator);
    let (r_hi, _c_hi) = def.position_of_nth(lane as u32, 2u32, cmma::MatrixIdent::Accumulator);
    // The quad reductions assume r_lo = lane / 4, r_hi = r_lo + 8, c_lo = 2 (lane % 4).
    pos_out[lane * 3] = r_lo;
    pos_out[lane * 3 + 1] = r_hi;
    pos_out[lane * 3 + 2] = c_lo;

    let mut s_acc = zero_frags(2usize);
    mma_abt_strip::<F, N>(
        &as_, 0usize, &ks, &mut s_acc, lane, 1usize, 2usize, 1usize, ldt, 1usize,
    );
    let mut p = Array::<f32>::new(8usize);
    #[unroll]
    for nt in 0..2usize {
        let frag = s_acc.index(nt);
        #[unroll]
        for hh in 0..2usize {
            let pair = frag[hh];
            let mut r = r_lo as usize;
            if hh == 1 {
                r = r_hi as usize;
            }
            #[unroll]
            for e in 0..2usize {
                let val = pair[e];
                p[comptime!((nt * 2 + hh) * 2 + e)] = val;
                s_out[r * 16 + 8 * nt + c_lo as usize + e] = val;
            }
        }
    }
    let mut o_acc = zero_frags(2usize);
    mma_pv_strip::<F, N>(
        &p, &vs, &mut o_acc, lane, 1usize, 2usize, 2usize, ldt, 1usize,
    );
    #[unroll]
    for dt in 0..2usize {
        let frag = o_acc.index(dt);
        #[unroll]
        for hh in 0..2usize {
            let pair = frag[hh];
            let mut r = r_lo as usize;
            if hh == 1 {
                r = r_hi as usize;
            }
            #[unroll]
            for e in 0..2usize {
                o_out[r * 16 + 8 * dt + c_lo as usize + e] = pair[e];
            }
        }
    }
}

/// Runs the Mma fragment helpers on 16x16 bf16/f16 matrices `a`, `k`, `v` (contiguous,
/// `[16, 16]`) and returns `(s, o, pos)`: `s = a k^T` and `o = s v` in f32 (with `s` rounded to
/// the input dtype first, as `P` is in the forward), and `pos [32, 3]` (u32): per lane, the row
/// of its accumulator elements 0/1, the row of elements 2/3, and the column of element 0, as
/// CubeCL's `position_of_nth` reports them (expected `lane / 4`, `lane / 4 + 8`,
/// `2 (lane % 4)`, which the row reductions rely on). With small integer inputs every value is
/// exact, so any difference from the host product means a fragment-layout assumption is wrong.
pub fn mma_fragment_probe<R: CubeRuntime>(
    a: CubeTensor<R>,
    k: CubeTensor<R>,
    v: CubeTensor<R>,
) -> (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>) {
    for (name, t) in [("a", &a), ("k", &k), ("v", &v)] {
        let shape = t.meta.shape();
        assert!(
            shape.num_dims() == 2 && shape[0] == 16 && shape[1] == 16 && t.is_contiguous(),
            "mma_fragment_probe: {name} must be a contiguous [16, 16] tensor, got {shape:?}"
        );
    }
    assert!(
        mma_supported(&a.client, a.dtype),
        "mma_fragment_probe: no m16n8k16 mma/ldmatrix for {:?} on this device",
        a.dtype
    );
    let client = a.client.clone();
    let device = a.device.clone();
    let dtype = a.dtype;
    let out = || {
        empty_device_contiguous_dtype::<R>(
            client.clone(),
            device.clone(),
            [16usize, 16].into(),
            DType::F32,
        )
    };
    let (s, o) = (out(), out());
    let pos = empty_device_contiguous_dtype::<R>(
        client.clone(),
        device.clone(),
        [32usize, 3].into(),
        DType::U32,
    );
    // SAFETY: fixed 16x16 shapes checked above; one warp.
    unsafe {
        mma_probe_kernel::launch_unchecked::<R>(
            &client,
            CubeCount::Static(1, 1, 1),
            CubeDim::new_1d(32),
            1,
            a.into_tensor_arg(),
            k.into_tensor_arg(),
            v.into_tensor_arg(),
            s.clone().into_tensor_arg(),
            o.clone().into_tensor_arg(),
            pos.clone().into_tensor_arg(),
            dtype.into(),
        );
    }
    (s, o, pos)
}
