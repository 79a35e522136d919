//! The `mma.sync` forward: one cube per (query block, query head, batch) with `warps` warps
//! of `m_tiles` 16-row tiles each ([`FlashForward::Mma8x2`], [`FlashForward::Mma4x2`]), K/V
//! blocks of [`MMA_KEYS`] keys double-buffered by `cp.async`.
//!
//! Q is staged once in shared memory and re-read with `ldmatrix` per key block (keeping it in
//! registers would cost 32 registers per 16 rows at head dim 128). Per lane, the registers hold
//! O (`m_tiles * d / 2` f32), S/P (`m_tiles * 32` f32), the running max and sum of its 2 rows
//! per m-tile, and the fragments in flight. Two m-tiles per warp halve the shared-memory reads
//! of K and V per FLOP; more warps per cube share one staged K/V block between more rows.
//!
//! The softmax is the usual online one (rescale O and the sum by `exp(m_old - m_new)`), except that
//! a warp skips the rescale of O in blocks where none of its rows' maxima grew by more than
//! [`RESCALE_SLACK`](super::RESCALE_SLACK) (a stale maximum cancels in the final division); scores
//! are masked with a finite `-1e30` only in the warps whose rows a block crosses (a warp-uniform
//! choice between two copies of the block code), and warps whose rows are all above a key block
//! skip it. The warpgroup forward (`fwd_wgmma`) runs the same softmax ([`fwd_softmax`]) and output
//! code ([`write_fwd_out`]) on accumulators of the same layout.
//!
//! [`FlashForward::Mma8x2`]: crate::FlashForward::Mma8x2
//! [`FlashForward::Mma4x2`]: crate::FlashForward::Mma4x2

use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::barrier::Barrier;
use cubecl::prelude::*;

use super::Dims;
use super::fragments::{mma_abt_strip, mma_pv_strip, zero_frags};
use super::tiles::{copy_kv_async, copy_tile_async};

/// Keys per block of the `mma.sync` forward and of the split dQ kernel.
pub(super) const MMA_KEYS: usize = 64;

/// `2^x` through `__powf(2, x)` (CubeCL has no `exp2`). The forward keeps its scores, maxima
/// and slack in log2 units for it (the launch scales them by log2(e)), as FlashAttention does,
/// and runs 4-5 % faster than with `exp`. Why is not settled: the PTX holds as many
/// `ex2.approx.f32` as with `exp`, none of them `.ftz`, plus 4 `lg2.approx` outside the loop.
/// The same change gained nothing in the backward, which keeps `exp`.
#[cube]
fn exp2(x: f32) -> f32 {
    f32::new(2.0).powf(x)
}

/// ln(2), to turn the forward's log2-unit maximum into the natural-log `lse`.
const LN_2: f32 = std::f32::consts::LN_2;

/// One key block of the forward for one warp's `16 * m_tiles` query rows (first row `row0`,
/// row `wrow` of `qs`): `S = Q K^T`, the online softmax ([`fwd_softmax`]), then `O += P V`.
/// The block's first key is `k0`; its K and V rows start at row `krow0` of `ks` and `vs` (0, or
/// the second half of the double buffer).
#[cube]
#[allow(clippy::too_many_arguments)]
fn fwd_block<F: Float, N: Size>(
    qs: &SharedMemory<Vector<F, N>>,
    ks: &SharedMemory<Vector<F, N>>,
    vs: &SharedMemory<Vector<F, N>>,
    krow0: usize,
    k0: usize,
    wrow: usize,
    row0: usize,
    lane: usize,
    r_lo: usize,
    r_hi: usize,
    c_lo: usize,
    scale: f32,
    rescale_slack: f32,
    s_acc: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    p: &mut Array<f32>,
    m_run: &mut Array<f32>,
    l_run: &mut Array<f32>,
    o_acc: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    #[comptime] m_tiles: usize,
    #[comptime] n_tiles: usize,
    #[comptime] d_tiles: usize,
    #[comptime] k_steps: usize,
    #[comptime] ldt: usize,
    #[comptime] nv: usize,
    #[comptime] causal_mask: bool,
) {
    mma_abt_strip::<F, N>(
        qs, wrow, ks, krow0, s_acc, lane, m_tiles, n_tiles, k_steps, ldt, nv,
    );
    fwd_softmax(
        s_acc,
        p,
        m_run,
        l_run,
        o_acc,
        k0,
        row0,
        r_lo,
        r_hi,
        c_lo,
        scale,
        rescale_slack,
        m_tiles,
        n_tiles,
        d_tiles,
        causal_mask,
    );
    mma_pv_strip::<F, N>(
        p, vs, krow0, o_acc, lane, m_tiles, n_tiles, d_tiles, ldt, nv,
    );
}

/// The online softmax of one key block for one warp's `16 * m_tiles` query rows (first row `row0`),
/// on the scores `s_acc` (in accumulator order, keys from `k0`): writes the block's probabilities
/// to `p` (as [`mma_pv_strip`] takes them), updates the running maxima `m_run` (log2 units) and
/// partial sums `l_run`, and rescales `o_acc` where a maximum grew by more than `rescale_slack`
/// (log2 units; see [`RESCALE_SLACK`](super::RESCALE_SLACK)). The causal mask only on blocks that
/// reach past the warp's first row, and only compiled in with `causal_mask`, which the kernels
/// leave off for blocks no row of the warp reaches past. Shared by the `mma.sync` and the `wgmma`
/// forwards, whose accumulators have the same layout.
#[cube]
// `if comptime!(..) { if runtime {..} }` stays nested: the outer branch is resolved at
// expansion, the inner one is emitted.
#[allow(clippy::too_many_arguments, clippy::collapsible_if)]
pub(super) fn fwd_softmax(
    s_acc: &Sequence<Array<Vector<f32, Const<2>>>>,
    p: &mut Array<f32>,
    m_run: &mut Array<f32>,
    l_run: &mut Array<f32>,
    o_acc: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    k0: usize,
    row0: usize,
    r_lo: usize,
    r_hi: usize,
    c_lo: usize,
    scale: f32,
    rescale_slack: f32,
    #[comptime] m_tiles: usize,
    #[comptime] n_tiles: usize,
    #[comptime] d_tiles: usize,
    #[comptime] causal_mask: bool,
) {
    // Each row's factor waits here until the warp knows whether any of its rows found a
    // maximum larger by more than `rescale_slack` (late in a long row almost none does).
    let mut alphas = Array::<f32>::new(comptime!(2 * m_tiles));
    let mut grew = false;
    // Only blocks that reach past this warp's first row need the causal mask.
    let masked = k0 + comptime!(8 * n_tiles) > row0 + 1;
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
                    if comptime!(causal_mask) {
                        if masked {
                            let key = k0 + 8 * nt + c_lo + e;
                            if key > row {
                                sv = f32::new(-1.0e30);
                            }
                        }
                    }
                    p[comptime!(((mt * n_tiles + nt) * 2 + hh) * 2 + e)] = sv;
                    mx = f32::max(mx, sv);
                }
            }
            mx = f32::max(mx, plane_shuffle_xor(mx, 1u32));
            mx = f32::max(mx, plane_shuffle_xor(mx, 2u32));
            let m_old = m_run[si];
            let mut m_new = f32::max(m_old, mx * scale);
            // A maximum that grew by at most the slack stays stale: the row's probabilities
            // may then reach `exp(slack)`, harmless in f32 and exact once divided by the row
            // sum, which carries the same maximum.
            if m_new <= m_old + rescale_slack {
                m_new = m_old;
            }
            let alpha = exp2(m_old - m_new);
            m_run[si] = m_new;
            let mut lsum = f32::new(0.0);
            #[unroll]
            for j in 0..comptime!(2 * n_tiles) {
                let idx = comptime!(((mt * n_tiles + j / 2) * 2 + hh) * 2 + j % 2);
                let pe = exp2(p[idx] * scale - m_new);
                p[idx] = pe;
                lsum += pe;
            }
            l_run[si] = l_run[si] * alpha + lsum;
            alphas[si] = alpha;
            if m_new > m_old {
                grew = true;
            }
        }
    }
    // Warp-uniform: where no row's maximum moved every factor is exactly 1 (`exp(0)`), so
    // skipping the multiplies changes no value.
    if plane_any(grew) {
        #[unroll]
        for mt in 0..m_tiles {
            #[unroll]
            for hh in 0..2usize {
                let alpha_v = Vector::<f32, Const<2>>::new(alphas[comptime!(mt * 2 + hh)]);
                #[unroll]
                for dt in 0..d_tiles {
                    let frag = o_acc.index_mut(comptime!(mt * d_tiles + dt));
                    frag[hh] = frag[hh] * alpha_v;
                }
            }
        }
    }
}

/// The end of the forward kernels: finishes the row sums across each quad (every lane summed
/// only its own columns), then writes this warp's rows of `o` (`O / l`, through `o`'s strides,
/// so any layout with a unit last stride and even row strides works) and `lse = m + ln(l)`,
/// for rows before `seq`. Each lane's two adjacent columns go out as one 4-byte store: half
/// the store instructions of element-wise writes, at the end of every cube.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn write_fwd_out<F: Float>(
    o: &mut Tensor<Vector<F, Const<2>>>,
    lse: &mut Tensor<f32>,
    o_acc: &Sequence<Array<Vector<f32, Const<2>>>>,
    m_run: &Array<f32>,
    l_run: &mut Array<f32>,
    b: usize,
    h: usize,
    row0: usize,
    r_lo: usize,
    r_hi: usize,
    c_lo: usize,
    seq: usize,
    #[comptime] m_tiles: usize,
    #[comptime] d_tiles: usize,
) {
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
                // In pairs: `c_lo` and the strides are even.
                let ob = (o_base + row * o.stride(2) + c_lo) / 2;
                #[unroll]
                for dt in 0..d_tiles {
                    let frag = o_acc.index(comptime!(mt * d_tiles + dt));
                    let pair = frag[hh];
                    let mut out = Vector::<F, Const<2>>::empty();
                    out[0] = F::cast_from(pair[0] * inv);
                    out[1] = F::cast_from(pair[1] * inv);
                    o[ob + comptime!(4 * dt)] = out;
                }
                if c_lo == 0 {
                    // The maximum is in log2 units (see `exp2`).
                    lse[lse_base + row * lse.stride(2)] = m_run[si] * LN_2 + l.ln();
                }
            }
        }
    }
}

/// The forward. Cube = (query head, query block from the last, batch), `32 * warps` threads,
/// warp `w` owning rows `16 m_tiles w ..` of the block. Q and the first K/V block are copied
/// by `cp.async` ([`copy_tile_async`]), each later K/V block into the other half of two-block
/// tiles: after the barrier that makes block `i` visible (which every thread reaches only once
/// done with block `i - 1`, the previous user of the other half), the copies of block `i + 1`
/// are issued, then block `i` is computed. So there is one cube barrier per block, no staging
/// registers (a register prefetch would cost 32 per lane at 8 warps, hd 128, where two m-tiles
/// leave none), and the next block's loads are in flight during the whole current block. Costs
/// one more K/V block of shared memory (34 KiB at hd 128).
#[cube(launch_unchecked, fast_math = FastMath::all())]
#[allow(clippy::too_many_arguments)]
fn flash_fwd_mma_cp<F: Float, N: Size>(
    q: &Tensor<Vector<F, N>>,
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    o: &mut Tensor<Vector<F, Const<2>>>,
    lse: &mut Tensor<f32>,
    scale: f32,
    rescale_slack: f32,
    seq_len: u32,
    group: u32,
    n_blocks: u32,
    #[comptime] d: usize,
    #[comptime] nv: usize,
    #[comptime] warps: usize,
    #[comptime] m_tiles: usize,
    #[define(F)] _dtype: StorageType,
) {
    let keys = comptime!(MMA_KEYS);
    let rows_w = comptime!(16 * m_tiles);
    let bq = comptime!(16 * m_tiles * warps);
    let bk = comptime!(keys);
    let nthreads = comptime!(32 * warps);
    let ldt = comptime!(d + 8);
    let n_tiles = comptime!(keys / 8);
    let d_tiles = comptime!(d / 8);
    let k_steps = comptime!(d / 16);

    let seq = seq_len as usize;
    let h = CUBE_POS_X as usize;
    let qb = n_blocks as usize - 1 - CUBE_POS_Y as usize;
    let b = CUBE_POS_Z as usize;
    let hk = h / group as usize;
    let warp = UNIT_POS as usize / 32;
    let lane = UNIT_POS_PLANE as usize;
    let q0 = qb * bq;
    let wrow = warp * rows_w;
    let row0 = q0 + wrow;

    let def = cmma::MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let (r_lo, c_lo) = def.position_of_nth(lane as u32, 0u32, cmma::MatrixIdent::Accumulator);
    let (r_hi, _c_hi) = def.position_of_nth(lane as u32, 2u32, cmma::MatrixIdent::Accumulator);
    let r_lo = r_lo as usize;
    let r_hi = r_hi as usize;
    let c_lo = c_lo as usize;

    let k_base = (b * k.stride(0) + hk * k.stride(1)) / nv;
    let v_base = (b * v.stride(0) + hk * v.stride(1)) / nv;
    let k_rs = k.stride(2) / nv;
    let v_rs = v.stride(2) / nv;

    let mut qs = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(bq * ldt / nv), 128usize);
    // Two halves of `keys` rows each.
    let mut ks =
        SharedMemory::<Vector<F, N>>::new_aligned(comptime!(2 * keys * ldt / nv), 128usize);
    let mut vs =
        SharedMemory::<Vector<F, N>>::new_aligned(comptime!(2 * keys * ldt / nv), 128usize);

    // One phase per key block; created before any copy is issued.
    let bar = Barrier::shared(CUBE_DIM, UNIT_POS == 0);
    // Q and the first K/V block go together: the first barrier covers all three.
    copy_tile_async::<F, N>(
        q,
        (b * q.stride(0) + h * q.stride(1)) / nv,
        q.stride(2) / nv,
        q0,
        seq,
        &mut qs,
        0usize,
        bq,
        d,
        ldt,
        nv,
        nthreads,
    );
    copy_kv_async::<F, N>(
        k, v, k_base, v_base, k_rs, v_rs, 0usize, seq, &mut ks, &mut vs, 0usize, bk, d, ldt, nv,
        nthreads,
    );

    let mut o_acc = zero_frags(comptime!(m_tiles * d / 8));
    let mut s_acc = zero_frags(comptime!(m_tiles * keys / 8));
    let mut p = Array::<f32>::new(comptime!(m_tiles * keys / 2));
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

    for kb in 0..n_kb {
        let k0 = kb * bk;
        let krow0 = (kb % 2) * bk;
        bar.commit_copy_async();
        bar.arrive_and_wait();
        if kb + 1 < n_kb {
            let nrow0 = bk - krow0;
            copy_kv_async::<F, N>(
                k,
                v,
                k_base,
                v_base,
                k_rs,
                v_rs,
                k0 + bk,
                seq,
                &mut ks,
                &mut vs,
                nrow0,
                bk,
                d,
                ldt,
                nv,
                nthreads,
            );
        }
        // Blocks that end at or before the warp's first query (all but the last few of a
        // long row) need no causal mask: a copy of the block code without the mask's compares
        // and selects, which the compiler otherwise predicates into every block (64 ISETP +
        // 64 FSEL per lane and block in the SASS). Decided per warp (the condition is
        // warp-uniform), so that in the cube's diagonal blocks only the warp whose rows the
        // block crosses pays for the mask.
        if k0 + bk <= row0 + 1 {
            fwd_block::<F, N>(
                &qs,
                &ks,
                &vs,
                krow0,
                k0,
                wrow,
                row0,
                lane,
                r_lo,
                r_hi,
                c_lo,
                scale,
                rescale_slack,
                &mut s_acc,
                &mut p,
                &mut m_run,
                &mut l_run,
                &mut o_acc,
                m_tiles,
                n_tiles,
                d_tiles,
                k_steps,
                ldt,
                nv,
                false,
            );
        } else if k0 < row0 + rows_w {
            // Warps whose rows all precede the block see none of its keys (warp-uniform).
            fwd_block::<F, N>(
                &qs,
                &ks,
                &vs,
                krow0,
                k0,
                wrow,
                row0,
                lane,
                r_lo,
                r_hi,
                c_lo,
                scale,
                rescale_slack,
                &mut s_acc,
                &mut p,
                &mut m_run,
                &mut l_run,
                &mut o_acc,
                m_tiles,
                n_tiles,
                d_tiles,
                k_steps,
                ldt,
                nv,
                true,
            );
        }
    }

    write_fwd_out::<F>(
        o, lse, &o_acc, &m_run, &mut l_run, b, h, row0, r_lo, r_hi, c_lo, seq, m_tiles, d_tiles,
    );
}

/// Launches [`flash_fwd_mma_cp`] with `warps` warps of `m_tiles` m-tiles into `o` (any strides
/// with a unit last one and even others) and `lse`, with the scale and the rescale slack in
/// log2 units.
#[allow(clippy::too_many_arguments)]
pub(super) fn launch<R: CubeRuntime>(
    q: CubeTensor<R>,
    k: CubeTensor<R>,
    v: CubeTensor<R>,
    o: &CubeTensor<R>,
    lse: &CubeTensor<R>,
    scale_log2: f32,
    slack_log2: f32,
    dims: Dims,
    nv: usize,
    warps: usize,
    m_tiles: usize,
) {
    let client = q.client.clone();
    let dtype = q.dtype;
    let n_blocks = dims.seq.div_ceil(16 * warps * m_tiles) as u32;
    let count = CubeCount::Static(dims.heads_q as u32, n_blocks, dims.batch as u32);
    // SAFETY: global reads are guarded by `seq` (rows past it are zero-filled in shared
    // memory), writes by `row < seq`; shared indices stay inside the comptime-sized tiles
    // (ldmatrix rows are 16-byte aligned: pitches of d + 8 elements, columns multiples of 8).
    // The cp.async copies are `2 * nv` bytes at `nv`-aligned global offsets (`vector_width`,
    // at least 2) and 16-byte aligned shared rows; `o`'s pair writes are aligned (its strides
    // are even: `alloc_bshd` of an even head dim).
    unsafe {
        flash_fwd_mma_cp::launch_unchecked::<R>(
            &client,
            count,
            CubeDim::new_1d(32 * warps as u32),
            nv,
            q.into_tensor_arg(),
            k.into_tensor_arg(),
            v.into_tensor_arg(),
            o.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            scale_log2,
            slack_log2,
            dims.seq as u32,
            dims.group() as u32,
            n_blocks,
            dims.head_dim,
            nv,
            warps,
            m_tiles,
            dtype.into(),
        );
    }
}
