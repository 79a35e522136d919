//! `mma.sync` m16n8k16 fragments in registers: `ldmatrix` loads, the products the kernels are
//! built from, and a probe that checks the layout assumptions on the device.
//!
//! The products go through CubeCL's manual MMA API (`cmma::MmaDefinition`, lowered to PTX
//! `mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}` and `ldmatrix`). Unlike `wmma`, whose
//! fragment layout is unspecified, the layout of `mma.sync` is documented, so the kernels run
//! the softmax on the accumulator registers and feed `P` to the next product without a trip
//! through shared memory (FlashAttention-2's structure).
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
//! Consequences the kernels rely on:
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
//! - A stored accumulator tile read back with a transposed `ldmatrix` is the A operand of the
//!   transposed product ([`mma_atb_acc`]): how the backward forms `dQ = dS K` from `dS^T`.
//!
//! [`mma_fragment_probe`] runs exactly these helpers on small integer matrices so that a wrong
//! layout assumption is reported as such (`flash_check` runs it before its attention checks).

use burn::tensor::DType;
use burn_cubecl::CubeRuntime;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::select::mma_supported;
use super::tiles::stage_tile;

/// `ldmatrix.x4` (optionally `.trans`) from a shared tile of `nv`-element vectors: the 16-byte
/// row this lane supplies starts at element `base + offset`, both multiples of `nv`. Why two
/// parts: callers pass the lane's runtime offset, the same for every call of an unrolled loop,
/// as `base` and the loop's part as the comptime `offset`, so each load's index is one
/// loop-invariant value plus a constant, which the compiler folds into the instruction's
/// immediate. A single runtime `(base + offset) / nv` cost a shift and address arithmetic per
/// load (about 500 integer instructions per block pair in the dK/dV kernel).
#[cube]
fn ldsm_x4<F: Float, N: Size>(
    smem: &SharedMemory<Vector<F, N>>,
    base: usize,
    #[comptime] offset: usize,
    #[comptime] nv: usize,
    #[comptime] trans: bool,
) -> Array<Vector<F, Const<2>>> {
    let def = cmma::MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let start = base / nv + comptime!(offset / nv);
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
pub(super) fn zero_frags(#[comptime] n: usize) -> Sequence<Array<Vector<f32, Const<2>>>> {
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
/// row `a_row0` (pitch `ldt`), `B` the `8 * n_tiles` rows of another starting at row `b_row0`
/// (a multiple of 8: 0, or the second half of a double buffer), both
/// `16 * k_steps` columns wide. Fragment `mt * n_tiles + nt` of `s` receives rows
/// `16 mt .. 16 mt + 16`, columns (rows of B) `8 nt .. 8 nt + 8`; its previous content is
/// overwritten. `n_tiles` must be even.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn mma_abt_strip<F: Float, N: Size>(
    a: &SharedMemory<Vector<F, N>>,
    a_row0: usize,
    b: &SharedMemory<Vector<F, N>>,
    b_row0: usize,
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
    let a_base = (a_row0 + a_row) * ldt + a_col;
    let b_base = (b_row0 + b_row) * ldt + b_col;
    #[unroll]
    for kk in 0..k_steps {
        let mut a_frags = Sequence::<Array<Vector<F, Const<2>>>>::new();
        #[unroll]
        for mt in 0..m_tiles {
            a_frags.push(ldsm_x4::<F, N>(
                a,
                a_base,
                comptime!(16 * mt * ldt + 16 * kk),
                nv,
                false,
            ));
        }
        #[unroll]
        for np in 0..comptime!(n_tiles / 2) {
            let b4 = ldsm_x4::<F, N>(b, b_base, comptime!(16 * np * ldt + 16 * kk), nv, false);
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

/// `O += P V` for one warp: `p` holds the probabilities of `16 * m_tiles` rows by `8 * n_tiles`
/// keys in accumulator order (`((mt * n_tiles + nt) * 2 + h) * 2 + e` is element `e` of vector `h`
/// of fragment (mt, nt)); `V` is a row-major shared tile `[key][d]` (pitch `ldt`) whose key 0 is
/// row `v_row0` (a multiple of 8). Fragment `mt * d_tiles + dt` of `o` accumulates rows of m-tile
/// `mt`, columns `8 dt .. 8 dt + 8`. P is rounded to `F` here (as in FlashAttention-2).
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn mma_pv_strip<F: Float, N: Size>(
    p: &Array<f32>,
    v: &SharedMemory<Vector<F, N>>,
    v_row0: usize,
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
    let v_base = (v_row0 + v_row) * ldt + v_col;
    #[unroll]
    for kk in 0..comptime!(n_tiles / 2) {
        // A fragment of keys 16 kk .. 16 kk + 16 = accumulators of key n-tiles 2kk, 2kk + 1:
        // (n-tile 2kk, row g), (2kk, row g + 8), (2kk + 1, row g), (2kk + 1, row g + 8).
        let mut p_frags = Sequence::<Array<Vector<F, Const<2>>>>::new();
        #[unroll]
        for mt in 0..m_tiles {
            p_frags.push(p_fragment::<F>(p, mt, kk, n_tiles));
        }
        #[unroll]
        for dp in 0..comptime!(d_tiles / 2) {
            let b4 = ldsm_x4::<F, N>(v, v_base, comptime!(16 * kk * ldt + 16 * dp), nv, true);
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

/// The A fragment (`m16n8k16`, four pairs) of m-tile `mt` and keys `16 kk .. 16 kk + 16` of
/// the probabilities `p` (accumulator order, `n_tiles` key tiles), rounded to `F`: the
/// accumulators of key tiles `2 kk` and `2 kk + 1` are, in that order, rows g, g + 8 of the A
/// operand's first and second 8 columns.
#[cube]
pub(super) fn p_fragment<F: Float>(
    p: &Array<f32>,
    #[comptime] mt: usize,
    #[comptime] kk: usize,
    #[comptime] n_tiles: usize,
) -> Array<Vector<F, Const<2>>> {
    let mut pa = Array::<Vector<F, Const<2>>>::new(4usize);
    #[unroll]
    for j in 0..4usize {
        let base = comptime!(((mt * n_tiles + 2 * kk + j / 2) * 2 + j % 2) * 2);
        let mut pv = Vector::<F, Const<2>>::empty();
        pv[0] = F::cast_from(p[base]);
        pv[1] = F::cast_from(p[comptime!(base + 1)]);
        pa[j] = pv;
    }
    pa
}

/// Writes one warp's `16 * m_tiles x 8 * n_tiles` block, held in accumulator order in `vals`
/// (as `p` of [`mma_pv_strip`]), rounded to `F`, into rows `row0 ..` of a shared tile of
/// element pairs with pitch `ld` elements, from column `c_lo` on (the lane's accumulator column
/// plus the block's first column): each lane stores its two adjacent columns as one 32-bit
/// word (bank-conflict-free when `ld` is 8 modulo 16, as `inner + 8` is: the 8 rows of a store
/// then start on banks 4 apart).
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn store_acc_pairs<F: Float>(
    vals: &Array<f32>,
    dst: &mut SharedMemory<Vector<F, Const<2>>>,
    row0: usize,
    r_lo: usize,
    r_hi: usize,
    c_lo: usize,
    #[comptime] n_tiles: usize,
    #[comptime] ld: usize,
    #[comptime] m_tiles: usize,
) {
    #[unroll]
    for hh in 0..2usize {
        let mut r = r_lo;
        if hh == 1 {
            r = r_hi;
        }
        // In pairs: `c_lo` and `ld` are even (see `ldsm_x4` for why the constant is split off).
        let base = ((row0 + r) * ld + c_lo) / 2;
        #[unroll]
        for mt in 0..m_tiles {
            #[unroll]
            for nt in 0..n_tiles {
                let idx = comptime!(((mt * n_tiles + nt) * 2 + hh) * 2);
                let mut pair = Vector::<F, Const<2>>::empty();
                pair[0] = F::cast_from(vals[idx]);
                pair[1] = F::cast_from(vals[comptime!(idx + 1)]);
                dst[base + comptime!((16 * mt * ld + 8 * nt) / 2)] = pair;
            }
        }
    }
}

/// `acc += X^T B` for one warp, where `X` is stored `[k][m]` (pitch `ldx`, element pairs) and
/// the product takes its columns `m0 .. m0 + 16 * m_tiles` (so `X^T` gives `m_tiles` 16-row A
/// operands), `B` is a row-major `[k][n]` tile (pitch `ldb`) read from column `b_col0` on; `k`
/// runs over `16 * k_steps` rows of both. Fragment `mt * n_tiles + nt` of `acc` receives rows
/// `16 mt ..` and columns `b_col0 + 8 nt ..`. `n_tiles` must be even. Two m-tiles share each
/// loaded B fragment, so a warp's shared-memory reads per product fall by a fifth at `n_tiles`
/// 4 against one m-tile at 8. This is how the dK/dV kernel forms `dQ = dS K` from its `dS^T`
/// (stored as it lies in the accumulators: keys by queries) without a transposing store.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn mma_atb_acc<F: Float, NX: Size, N: Size>(
    x: &SharedMemory<Vector<F, NX>>,
    m0: usize,
    b: &SharedMemory<Vector<F, N>>,
    b_col0: usize,
    acc: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    lane: usize,
    #[comptime] m_tiles: usize,
    #[comptime] k_steps: usize,
    #[comptime] n_tiles: usize,
    #[comptime] ldx: usize,
    #[comptime] nvx: usize,
    #[comptime] ldb: usize,
    #[comptime] nvb: usize,
) {
    // Transposed loads of X: lane l supplies k row l % 8 + 8 (l / 16), m column 8 ((l / 8) %
    // 2): stored blocks (k 0-7, m 0-7), (k 0-7, m 8-15), (k 8-15, m 0-7), (k 8-15, m 8-15),
    // which transposed are a0 (m 0-7, k 0-7), a1 (m 8-15, k 0-7), a2 (m 0-7, k 8-15), a3
    // (m 8-15, k 8-15) of the A fragment.
    let x_base = (lane % 8 + (lane / 16) * 8) * ldx + m0 + ((lane / 8) % 2) * 8;
    mma_acc_core::<F, NX, N>(
        x, x_base, b, 0usize, b_col0, acc, lane, true, m_tiles, k_steps, n_tiles, ldx, nvx, ldb,
        nvb,
    );
}

/// `acc += A B` for one warp, where `A` is a row-major `[m][k]` shared tile of element pairs
/// (pitch `lda`) whose rows `a_row0 .. a_row0 + 16 * m_tiles` the product takes, and `B` a
/// row-major `[k][n]` tile (pitch `ldb`) read from row `b_row0` and column `b_col0` on; `k`
/// runs over `16 * k_steps` columns of A and rows of B. Fragment `mt * n_tiles + nt` of `acc`
/// receives rows `16 mt ..` and columns `b_col0 + 8 nt ..`. `n_tiles` must be even. The
/// warp-grid dK/dV kernel forms `dV += P^T dO` and `dK += dS^T Q` this way from the `P^T` and
/// `dS^T` tiles its warps share: A by plain `ldmatrix` (as in [`mma_abt_strip`]), B by
/// transposed ones (as V in [`mma_pv_strip`]).
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn mma_ab_acc<F: Float, NA: Size, N: Size>(
    a: &SharedMemory<Vector<F, NA>>,
    a_row0: usize,
    b: &SharedMemory<Vector<F, N>>,
    b_row0: usize,
    b_col0: usize,
    acc: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    lane: usize,
    #[comptime] m_tiles: usize,
    #[comptime] k_steps: usize,
    #[comptime] n_tiles: usize,
    #[comptime] lda: usize,
    #[comptime] nva: usize,
    #[comptime] ldb: usize,
    #[comptime] nvb: usize,
) {
    // Plain loads of A, as in `mma_abt_strip`.
    let a_base = (a_row0 + lane % 16) * lda + (lane / 16) * 8;
    mma_acc_core::<F, NA, N>(
        a, a_base, b, b_row0, b_col0, acc, lane, false, m_tiles, k_steps, n_tiles, lda, nva, ldb,
        nvb,
    );
}

/// The loop of [`mma_atb_acc`] and [`mma_ab_acc`]: `acc += A B` with this lane's `ldmatrix`
/// row of A at `a_base` (transposed loads of a `[k][m]` tile with `a_trans`, plain loads of an
/// `[m][k]` tile without) and B a row-major `[k][n]` tile read from row `b_row0`, column
/// `b_col0` on by transposed loads (lane l supplies k row l % 16, column 8 (l / 16), as V in
/// [`mma_pv_strip`]). Two m-tiles share each loaded B fragment.
#[cube]
#[allow(clippy::too_many_arguments)]
fn mma_acc_core<F: Float, NA: Size, N: Size>(
    a: &SharedMemory<Vector<F, NA>>,
    a_base: usize,
    b: &SharedMemory<Vector<F, N>>,
    b_row0: usize,
    b_col0: usize,
    acc: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    lane: usize,
    #[comptime] a_trans: bool,
    #[comptime] m_tiles: usize,
    #[comptime] k_steps: usize,
    #[comptime] n_tiles: usize,
    #[comptime] lda: usize,
    #[comptime] nva: usize,
    #[comptime] ldb: usize,
    #[comptime] nvb: usize,
) {
    let def = cmma::MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let b_base = (b_row0 + lane % 16) * ldb + b_col0 + (lane / 16) * 8;
    #[unroll]
    for kk in 0..k_steps {
        let mut a_frags = Sequence::<Array<Vector<F, Const<2>>>>::new();
        #[unroll]
        for mt in 0..m_tiles {
            let offset = comptime!(if a_trans {
                16 * kk * lda + 16 * mt
            } else {
                16 * mt * lda + 16 * kk
            });
            a_frags.push(ldsm_x4::<F, NA>(a, a_base, offset, nva, a_trans));
        }
        #[unroll]
        for np in 0..comptime!(n_tiles / 2) {
            let b4 = ldsm_x4::<F, N>(b, b_base, comptime!(16 * kk * ldb + 16 * np), nvb, true);
            let b_lo = frag_pair::<F>(&b4, 0usize);
            let b_hi = frag_pair::<F>(&b4, 2usize);
            #[unroll]
            for mt in 0..m_tiles {
                let af = a_frags.index(mt);
                def.execute_inplace(af, &b_lo, acc.index_mut(comptime!(mt * n_tiles + 2 * np)));
                def.execute_inplace(
                    af,
                    &b_hi,
                    acc.index_mut(comptime!(mt * n_tiles + 2 * np + 1)),
                );
            }
        }
    }
}

// ------------------------------------------------------------------------------------------
// Fragment probe
// ------------------------------------------------------------------------------------------

/// One warp runs the kernels' fragment helpers on 16x16 inputs: `s = a k^T` through
/// [`mma_abt_strip`] (two key n-tiles), then `o = s v` through [`mma_pv_strip`] with `s` as
/// `P`, and `t = s^T v` the way the fused backward forms `dQ = dS K` from `dS^T`: `s` stored
/// as it lies through [`store_acc_pairs`], then [`mma_atb_acc`] (transposed `ldmatrix` of the
/// stored tile as the A operand). All written out through the accumulator layout the kernels
/// use for their outputs.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn mma_probe_kernel<F: Float, N: Size>(
    a: &Tensor<Vector<F, N>>,
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    s_out: &mut Tensor<f32>,
    o_out: &mut Tensor<f32>,
    t_out: &mut Tensor<f32>,
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
        &as_, 0usize, &ks, 0usize, &mut s_acc, lane, 1usize, 2usize, 1usize, ldt, 1usize,
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
        &p, &vs, 0usize, &mut o_acc, lane, 1usize, 2usize, 2usize, ldt, 1usize,
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

    // t = s^T v: s (rows m, columns k of the product) stored as it lies, read back transposed.
    let mut xs =
        SharedMemory::<Vector<F, Const<2>>>::new_aligned(comptime!(16usize * 24 / 2), 128usize);
    store_acc_pairs::<F>(
        &p,
        &mut xs,
        0usize,
        r_lo as usize,
        r_hi as usize,
        c_lo as usize,
        2usize,
        ldt,
        1usize,
    );
    sync_cube();
    let mut t_acc = zero_frags(2usize);
    mma_atb_acc::<F, Const<2>, N>(
        &xs, 0usize, &vs, 0usize, &mut t_acc, lane, 1usize, 1usize, 2usize, ldt, 2usize, ldt,
        1usize,
    );
    #[unroll]
    for dt in 0..2usize {
        let frag = t_acc.index(dt);
        #[unroll]
        for hh in 0..2usize {
            let pair = frag[hh];
            let mut r = r_lo as usize;
            if hh == 1 {
                r = r_hi as usize;
            }
            #[unroll]
            for e in 0..2usize {
                t_out[r * 16 + 8 * dt + c_lo as usize + e] = pair[e];
            }
        }
    }
}

/// Runs the kernels' fragment helpers on 16x16 bf16/f16 matrices `a`, `k`, `v` (contiguous
/// `[16, 16]`) and returns `(s, o, t, pos)`: `s = a k^T`, `o = s v` and `t = s^T v` in f32
/// (with `s` rounded to the input dtype first, as `P` and `dS` are in the kernels; `t` goes
/// through shared memory and transposed `ldmatrix` as the fused backward's `dQ = dS K` does),
/// and `pos [32, 3]` (u32): per lane, the row of its accumulator elements 0/1, the row of
/// elements 2/3, and the column of element 0, as CubeCL's `position_of_nth` reports them
/// (expected `lane / 4`, `lane / 4 + 8`, `2 (lane % 4)`, which the row reductions rely on).
/// With small integer inputs every value is exact, so any difference from the host product
/// means a fragment-layout assumption is wrong.
pub fn mma_fragment_probe<R: CubeRuntime>(
    a: CubeTensor<R>,
    k: CubeTensor<R>,
    v: CubeTensor<R>,
) -> (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>, CubeTensor<R>) {
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
    let (s, o, t) = (out(), out(), out());
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
            t.clone().into_tensor_arg(),
            pos.clone().into_tensor_arg(),
            dtype.into(),
        );
    }
    (s, o, t, pos)
}
