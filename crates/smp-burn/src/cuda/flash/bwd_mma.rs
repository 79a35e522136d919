//! The `mma.sync` dK/dV kernels: one cube per (key block, kv head, batch) keeps its K and V
//! rows in shared memory and walks the query heads of its GQA group and their query blocks
//! from the causal start, with Q, dO, lse and delta double-buffered by `cp.async` (one cube
//! barrier per block, no staging registers).
//!
//! Everything is computed transposed (FlashAttention-2's choice), so that no operand needs a
//! transpose: `S^T = K Q^T` and `dP^T = V dO^T` come out of `mma_abt_strip` with keys as rows
//! (K and V are the A operands, Q and dO the B operands exactly as K is in the forward); then
//! `P^T = exp(S^T * scale - lse)` (the causal mask sets `P` to 0) and
//! `dS^T = P^T (dP^T - delta)` are formed in the accumulator registers; then `dV += P^T dO`
//! and `dK += dS^T Q`, the accumulators of `P^T`/`dS^T` being A fragments as `P` is in the
//! forward and dO/Q being B operands through transposed loads as V is in the forward. dK and
//! dV (f32, `d / 2` registers each per lane at hd 128) are written once at the end, dK times
//! `scale`. Queries past the end get `lse = 1e30`, hence `P = 0`.
//!
//! Two warp layouts:
//! - per warp ([`flash_bwd_dkdv_mma_cp`]): warp `w` owns 16 keys by all of the block's queries
//!   and all of the head dim. With [`FlashBackward::Split`] dQ comes from its own kernel
//!   (`dq.rs`); with [`FlashBackward::Atomic`] each block's `dS^T` goes to shared memory and
//!   the cube adds `dQ = dS K` to an f32 accumulator one block later (`fused_dq_apply`).
//! - warp grid ([`flash_bwd_dkdv_mma_grid`], [`FlashBackward::AtomicGrid`]): FlashAttention-2's
//!   layout, warp `w` computing the scores of 32 keys by half the queries and then dK/dV of the
//!   same keys by half the head dim, `P^T` and `dS^T` exchanged through shared memory.
//!
//! [`FlashBackward::Split`]: crate::FlashBackward::Split
//! [`FlashBackward::Atomic`]: crate::FlashBackward::Atomic
//! [`FlashBackward::AtomicGrid`]: crate::FlashBackward::AtomicGrid

use burn::tensor::{DType, Shape};
use burn_cubecl::CubeRuntime;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::barrier::{Barrier, copy_async};
use cubecl::prelude::*;

use super::dq::{dq_m_tiles, fused_dq_apply};
use super::fragments::{mma_ab_acc, mma_abt_strip, mma_pv_strip, store_acc_pairs, zero_frags};
use super::tiles::{copy_tile_async, stage_tile};
use super::{BwdArgs, Dims};

/// Issues the asynchronous copies of the dK/dV kernel's query block at `q0` of head `h`, batch
/// `b`: Q and dO rows into rows `qrow0 ..` of `qs` and `dos`, lse and delta into
/// `lse_s[qrow0 ..]`, `delta_s[qrow0 ..]` (4-byte `cp.async`); past the end `lse = 1e30` (so
/// `P = exp(s - 1e30) = 0` there) and `delta = 0`. The strides come from the tensors' metadata,
/// which the compiler reloads in the loop (about 18 loads per block); passing them as scalar
/// kernel arguments saved the loads but no time, as they hit L1.
#[cube]
#[allow(clippy::too_many_arguments)]
fn copy_qdo_async<F: Float, N: Size>(
    q: &Tensor<Vector<F, N>>,
    d_o: &Tensor<Vector<F, N>>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    qs: &mut SharedMemory<Vector<F, N>>,
    dos: &mut SharedMemory<Vector<F, N>>,
    lse_s: &mut SharedMemory<f32>,
    delta_s: &mut SharedMemory<f32>,
    b: usize,
    h: usize,
    q0: usize,
    seq: usize,
    qrow0: usize,
    #[comptime] bq: usize,
    #[comptime] d: usize,
    #[comptime] ldt: usize,
    #[comptime] nv: usize,
    #[comptime] nthreads: usize,
) {
    let q_off = (b * q.stride(0) + h * q.stride(1)) / nv;
    let q_rs = q.stride(2) / nv;
    let do_off = (b * d_o.stride(0) + h * d_o.stride(1)) / nv;
    let do_rs = d_o.stride(2) / nv;
    let lse_off = b * lse.stride(0) + h * lse.stride(1);
    let lse_rs = lse.stride(2);
    let delta_off = b * delta.stride(0) + h * delta.stride(1);
    let delta_rs = delta.stride(2);
    copy_tile_async::<F, N>(q, q_off, q_rs, q0, seq, qs, qrow0, bq, d, ldt, nv, nthreads);
    copy_tile_async::<F, N>(
        d_o, do_off, do_rs, q0, seq, dos, qrow0, bq, d, ldt, nv, nthreads,
    );
    let t = UNIT_POS as usize;
    let one = comptime!(1u32);
    if t < bq {
        let qi = q0 + t;
        let si = qrow0 + t;
        if qi < seq {
            let li = lse_off + qi * lse_rs;
            let di = delta_off + qi * delta_rs;
            copy_async::<f32>(
                &lse.slice(li, li + 1),
                &mut lse_s.slice_mut(si, si + 1),
                one,
            );
            copy_async::<f32>(
                &delta.slice(di, di + 1),
                &mut delta_s.slice_mut(si, si + 1),
                one,
            );
        } else {
            lse_s[si] = f32::new(1.0e30);
            delta_s[si] = f32::new(0.0);
        }
    }
}

/// One query block of the dK/dV kernels for one warp's 16 keys (first key `wk0`, row `wrow`
/// of `ks`/`vs`; see the module doc): `S^T = K Q^T` and `dP^T = V dO^T`, then `P^T` and
/// `dS^T` into `p` and `ds` (accumulator order), then `dV += P^T dO` and `dK += dS^T Q`. The
/// block's first query is `q0`; its Q and dO rows start at row `qrow0` of `qs` and `dos`, its
/// lse and delta at `lse_s[qrow0]`, `delta_s[qrow0]` (`qrow0` is 0, or the second half of a
/// double buffer).
#[cube]
// The comptime `causal_mask` branch stays nested around the runtime one: the outer branch is
// resolved at expansion, the inner one is emitted.
#[allow(clippy::too_many_arguments, clippy::collapsible_if)]
fn dkdv_block<F: Float, N: Size>(
    ks: &SharedMemory<Vector<F, N>>,
    vs: &SharedMemory<Vector<F, N>>,
    qs: &SharedMemory<Vector<F, N>>,
    dos: &SharedMemory<Vector<F, N>>,
    lse_s: &SharedMemory<f32>,
    delta_s: &SharedMemory<f32>,
    qrow0: usize,
    q0: usize,
    wrow: usize,
    wk0: usize,
    lane: usize,
    r_lo: usize,
    r_hi: usize,
    c_lo: usize,
    scale: f32,
    s_acc: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    dp_acc: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    p: &mut Array<f32>,
    ds: &mut Array<f32>,
    dk_acc: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    dv_acc: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    #[comptime] q_tiles: usize,
    #[comptime] d_tiles: usize,
    #[comptime] k_steps: usize,
    #[comptime] ldt: usize,
    #[comptime] nv: usize,
    #[comptime] causal_mask: bool,
) {
    // S^T = K Q^T and dP^T = V dO^T for this warp's 16 keys: rows are keys, columns
    // queries, in the accumulator layout.
    mma_abt_strip::<F, N>(
        ks, wrow, qs, qrow0, s_acc, lane, 1usize, q_tiles, k_steps, ldt, nv,
    );
    mma_abt_strip::<F, N>(
        vs, wrow, dos, qrow0, dp_acc, lane, 1usize, q_tiles, k_steps, ldt, nv,
    );
    // Only blocks where some key follows some query need the causal mask.
    let masked = wk0 + 15 > q0;
    let key_lo = wk0 + r_lo;
    let key_hi = wk0 + r_hi;
    #[unroll]
    for nt in 0..q_tiles {
        let s_frag = s_acc.index(nt);
        let dp_frag = dp_acc.index(nt);
        #[unroll]
        for e in 0..2usize {
            let ql = 8 * nt + c_lo + e;
            let qi = q0 + ql;
            let lse_q = lse_s[qrow0 + ql];
            let delta_q = delta_s[qrow0 + ql];
            #[unroll]
            for hh2 in 0..2usize {
                let mut key = key_lo;
                if hh2 == 1 {
                    key = key_hi;
                }
                let s_pair = s_frag[hh2];
                let dp_pair = dp_frag[hh2];
                let mut pe = (s_pair[e] * scale - lse_q).exp();
                if comptime!(causal_mask) {
                    if masked && key > qi {
                        pe = f32::new(0.0);
                    }
                }
                let idx = comptime!((nt * 2 + hh2) * 2 + e);
                p[idx] = pe;
                ds[idx] = pe * (dp_pair[e] - delta_q);
            }
        }
    }
    // dV += P^T dO and dK += dS^T Q: the accumulators are the A operands.
    mma_pv_strip::<F, N>(
        p, dos, qrow0, dv_acc, lane, 1usize, q_tiles, d_tiles, ldt, nv,
    );
    mma_pv_strip::<F, N>(
        ds, qs, qrow0, dk_acc, lane, 1usize, q_tiles, d_tiles, ldt, nv,
    );
}

/// Writes one warp's dK (times `scale`) and dV rows for keys `wk0 ..` (those before `seq`):
/// each lane its two columns per d-tile of its two key rows per m-tile, `d_tiles` d-tiles from
/// column `col0` on.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn write_dkdv<F: Float>(
    dk: &mut Tensor<F>,
    dv: &mut Tensor<F>,
    dk_acc: &Sequence<Array<Vector<f32, Const<2>>>>,
    dv_acc: &Sequence<Array<Vector<f32, Const<2>>>>,
    b: usize,
    hk: usize,
    wk0: usize,
    r_lo: usize,
    r_hi: usize,
    c_lo: usize,
    col0: usize,
    seq: usize,
    scale: f32,
    #[comptime] d_tiles: usize,
    #[comptime] m_tiles: usize,
) {
    let dk_base = b * dk.stride(0) + hk * dk.stride(1);
    let dv_base = b * dv.stride(0) + hk * dv.stride(1);
    #[unroll]
    for mt in 0..m_tiles {
        #[unroll]
        for hh2 in 0..2usize {
            let mut r = r_lo;
            if hh2 == 1 {
                r = r_hi;
            }
            let key = wk0 + 16 * mt + r;
            if key < seq {
                let kr = dk_base + key * dk.stride(2) + col0 + c_lo;
                let vr = dv_base + key * dv.stride(2) + col0 + c_lo;
                #[unroll]
                for dt in 0..d_tiles {
                    let kp = dk_acc.index(comptime!(mt * d_tiles + dt))[hh2];
                    let vp = dv_acc.index(comptime!(mt * d_tiles + dt))[hh2];
                    dk[kr + 8 * dt] = F::cast_from(kp[0] * scale);
                    dk[kr + 8 * dt + 1] = F::cast_from(kp[1] * scale);
                    dv[vr + 8 * dt] = F::cast_from(vp[0]);
                    dv[vr + 8 * dt + 1] = F::cast_from(vp[1]);
                }
            }
        }
    }
}

/// Stages the cube's K and V rows `k0 .. k0 + bk` of kv head `hk`, batch `b`, into `ks` and
/// `vs` (a synchronous copy: they stay for the whole cube, and the first block's barrier orders
/// it before their reads). Shared by the `cp.async` dK/dV kernels.
#[cube]
#[allow(clippy::too_many_arguments)]
fn stage_kv<F: Float, N: Size>(
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    ks: &mut SharedMemory<Vector<F, N>>,
    vs: &mut SharedMemory<Vector<F, N>>,
    b: usize,
    hk: usize,
    k0: usize,
    seq: usize,
    #[comptime] bk: usize,
    #[comptime] d: usize,
    #[comptime] ldt: usize,
    #[comptime] nv: usize,
    #[comptime] nthreads: usize,
) {
    stage_tile::<F, N>(
        k,
        (b * k.stride(0) + hk * k.stride(1)) / nv,
        k.stride(2) / nv,
        k0,
        seq,
        ks,
        bk,
        d,
        ldt,
        nv,
        nthreads,
    );
    stage_tile::<F, N>(
        v,
        (b * v.stride(0) + hk * v.stride(1)) / nv,
        v.stride(2) / nv,
        k0,
        seq,
        vs,
        bk,
        d,
        ldt,
        nv,
        nthreads,
    );
}

/// dK and dV, per-warp layout, and with `fused` the dQ as well. Cube = (kv head, key block,
/// batch) with `32 * warps` threads; warp `w` owns keys `16 w .. 16 w + 16` of the block. The
/// query blocks (over the GQA group's heads, flattened into one loop) go through two halves of
/// the Q, dO, lse and delta tiles: after the barrier that makes block `i` visible (and that
/// every warp reaches only once done with block `i - 1`), the copies of block `i + 1` into the
/// other half are issued, then block `i` is computed. The fused dQ keeps the one barrier per
/// block: block `i`'s `dS^T` goes to one of two tiles and its `dQ = dS K` ([`fused_dq_apply`])
/// runs after block `i + 1`'s barrier (the last one after a final barrier). A second barrier
/// per block for an immediate dQ was 2-3 % slower at hd 128.
#[cube(launch_unchecked, fast_math = FastMath::all())]
// `if comptime!(..) { if runtime {..} }` stays nested: the outer branch is resolved at
// expansion, the inner one is emitted.
#[allow(clippy::too_many_arguments, clippy::collapsible_if)]
fn flash_bwd_dkdv_mma_cp<F: Float, N: Size>(
    q: &Tensor<Vector<F, N>>,
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    d_o: &Tensor<Vector<F, N>>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dk: &mut Tensor<F>,
    dv: &mut Tensor<F>,
    dq_acc: &mut Tensor<Atomic<Vector<f32, Const<2>>>>,
    scale: f32,
    seq_len: u32,
    group: u32,
    #[comptime] d: usize,
    #[comptime] nv: usize,
    #[comptime] warps: usize,
    #[comptime] bq: usize,
    #[comptime] fused: bool,
    #[comptime] dq_mt: usize,
    #[comptime] bulk_dq: bool,
    #[define(F)] _dtype: StorageType,
) {
    let bk = comptime!(16 * warps);
    let nthreads = comptime!(32 * warps);
    let ldt = comptime!(d + 8);
    let q_tiles = comptime!(bq / 8);
    let d_tiles = comptime!(d / 8);
    let k_steps = comptime!(d / 16);

    let seq = seq_len as usize;
    let hk = CUBE_POS_X as usize;
    let kb = CUBE_POS_Y as usize;
    let b = CUBE_POS_Z as usize;
    let grp = group as usize;
    let warp = UNIT_POS as usize / 32;
    let lane = UNIT_POS_PLANE as usize;
    let k0 = kb * bk;
    let wrow = warp * 16;
    let wk0 = k0 + wrow;

    let def = cmma::MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let (r_lo, c_lo) = def.position_of_nth(lane as u32, 0u32, cmma::MatrixIdent::Accumulator);
    let (r_hi, _c_hi) = def.position_of_nth(lane as u32, 2u32, cmma::MatrixIdent::Accumulator);
    let r_lo = r_lo as usize;
    let r_hi = r_hi as usize;
    let c_lo = c_lo as usize;

    let mut ks = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(bk * ldt / nv), 128usize);
    let mut vs = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(bk * ldt / nv), 128usize);
    // Two halves of bq rows each.
    let mut qs = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(2 * bq * ldt / nv), 128usize);
    let mut dos = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(2 * bq * ldt / nv), 128usize);
    let mut lse_s = SharedMemory::<f32>::new(comptime!(2 * bq));
    let mut delta_s = SharedMemory::<f32>::new(comptime!(2 * bq));
    // The fused dQ's two dS^T tiles (one per block in flight): pitch `bq + 8`, in element
    // pairs.
    let mut dss = SharedMemory::<Vector<F, Const<2>>>::new_aligned(
        comptime!(if fused { 2 * bk * (bq + 8) / 2 } else { 4 }),
        128usize,
    );
    // The bulk dQ's staging tile (`fused_dq_apply`): `bq x d` f32.
    let mut dqs = SharedMemory::<Vector<f32, Const<2>>>::new_aligned(
        comptime!(if bulk_dq { bq * d / 2 } else { 2 }),
        128usize,
    );
    let heads_q = CUBE_COUNT_X as usize * grp;

    // K and V stay for the whole cube: a synchronous copy, ordered before the first block's
    // reads by the barrier below.
    stage_kv::<F, N>(
        k, v, &mut ks, &mut vs, b, hk, k0, seq, bk, d, ldt, nv, nthreads,
    );
    // Every thread arrives once per block (and its cp.async completions once more, through
    // commit_copy_async), so one phase of the barrier is one block.
    let bar = Barrier::shared(CUBE_DIM, UNIT_POS == 0);

    let mut dk_acc = zero_frags(d_tiles);
    let mut dv_acc = zero_frags(d_tiles);
    let mut s_acc = zero_frags(q_tiles);
    let mut dp_acc = zero_frags(q_tiles);
    let mut p = Array::<f32>::new(comptime!(q_tiles * 4));
    let mut ds = Array::<f32>::new(comptime!(q_tiles * 4));

    let n_qb = (seq + bq - 1) / bq;
    let qb_start = k0 / bq;
    let n_blk = n_qb - qb_start;
    let n_it = grp * n_blk;
    let h_first = hk * grp;
    copy_qdo_async::<F, N>(
        q,
        d_o,
        lse,
        delta,
        &mut qs,
        &mut dos,
        &mut lse_s,
        &mut delta_s,
        b,
        h_first,
        qb_start * bq,
        seq,
        0usize,
        bq,
        d,
        ldt,
        nv,
        nthreads,
    );
    // The block whose dQ is still owed: its first query and its head.
    let mut owed_q0 = 0usize;
    let mut owed_h = 0usize;
    // Iteration `it` is query block `blk` of head `h_first + h_off`, kept as counters: `it /
    // n_blk` and `it % n_blk` by a runtime divisor cost some 15 instructions each per block
    // (three integer divisions in the loop's SASS).
    let mut blk = 0usize;
    let mut h_off = 0usize;
    for it in 0..n_it {
        let q0 = (qb_start + blk) * bq;
        let h = h_first + h_off;
        let qrow0 = (it % 2) * bq;
        bar.commit_copy_async();
        bar.arrive_and_wait();
        let mut next_blk = blk + 1;
        let mut next_h_off = h_off;
        if next_blk == n_blk {
            next_blk = 0;
            next_h_off += 1;
        }
        let nx = it + 1;
        if nx < n_it {
            copy_qdo_async::<F, N>(
                q,
                d_o,
                lse,
                delta,
                &mut qs,
                &mut dos,
                &mut lse_s,
                &mut delta_s,
                b,
                h_first + next_h_off,
                (qb_start + next_blk) * bq,
                seq,
                bq - qrow0,
                bq,
                d,
                ldt,
                nv,
                nthreads,
            );
        }
        if comptime!(fused) {
            // The previous block's dS^T, stored by every warp before this block's barrier.
            if it > 0 {
                fused_dq_apply::<F, N>(
                    &dss,
                    ((it + 1) % 2) * bk,
                    &ks,
                    dq_acc,
                    &mut dqs,
                    b,
                    owed_h,
                    heads_q,
                    owed_q0,
                    seq,
                    warp,
                    lane,
                    r_lo,
                    r_hi,
                    c_lo,
                    warps,
                    bq,
                    d,
                    ldt,
                    nv,
                    dq_mt,
                    bulk_dq,
                );
            }
        }
        // No key of the warp follows the block's first query: no causal mask (decided per
        // warp, see the forward).
        if wk0 + 16 <= q0 + 1 {
            dkdv_block::<F, N>(
                &ks,
                &vs,
                &qs,
                &dos,
                &lse_s,
                &delta_s,
                qrow0,
                q0,
                wrow,
                wk0,
                lane,
                r_lo,
                r_hi,
                c_lo,
                scale,
                &mut s_acc,
                &mut dp_acc,
                &mut p,
                &mut ds,
                &mut dk_acc,
                &mut dv_acc,
                q_tiles,
                d_tiles,
                k_steps,
                ldt,
                nv,
                false,
            );
        } else if wk0 < q0 + bq {
            dkdv_block::<F, N>(
                &ks,
                &vs,
                &qs,
                &dos,
                &lse_s,
                &delta_s,
                qrow0,
                q0,
                wrow,
                wk0,
                lane,
                r_lo,
                r_hi,
                c_lo,
                scale,
                &mut s_acc,
                &mut dp_acc,
                &mut p,
                &mut ds,
                &mut dk_acc,
                &mut dv_acc,
                q_tiles,
                d_tiles,
                k_steps,
                ldt,
                nv,
                true,
            );
        } else if comptime!(fused) {
            // Inactive warps contribute zero rows to the block's dS.
            #[unroll]
            for i in 0..comptime!(q_tiles * 4) {
                ds[i] = f32::new(0.0);
            }
        }
        if comptime!(fused) {
            // Written to this block's half; read after the next barrier (above, or after the
            // loop), rewritten two blocks later, after the barrier that follows those reads.
            store_acc_pairs::<F>(
                &ds,
                &mut dss,
                (it % 2) * bk + wrow,
                r_lo,
                r_hi,
                c_lo,
                comptime!(bq / 8),
                comptime!(bq + 8),
                1usize,
            );
            owed_q0 = q0;
            owed_h = h;
        }
        blk = next_blk;
        h_off = next_h_off;
    }
    if comptime!(fused) {
        if n_it > 0 {
            sync_cube();
            fused_dq_apply::<F, N>(
                &dss,
                ((n_it + 1) % 2) * bk,
                &ks,
                dq_acc,
                &mut dqs,
                b,
                owed_h,
                heads_q,
                owed_q0,
                seq,
                warp,
                lane,
                r_lo,
                r_hi,
                c_lo,
                warps,
                bq,
                d,
                ldt,
                nv,
                dq_mt,
                bulk_dq,
            );
        }
    }

    if comptime!(bulk_dq) {
        // The last reductions read `dqs` until they are done with it; their writes to global
        // memory complete before the kernel does (CUTLASS's TMA-store epilogues wait the same
        // way). Not `tma_group_wait`: CubeCL 0.10 emits it as a libcu++ function that CUDA
        // 13's does not have.
        if lane == 0 {
            tma_group_wait_read(0u32);
        }
    }

    write_dkdv::<F>(
        dk, dv, &dk_acc, &dv_acc, b, hk, wk0, r_lo, r_hi, c_lo, 0usize, seq, scale, d_tiles, 1usize,
    );
}

/// The scores of one query block for one warp of the warp-grid dK/dV kernel
/// ([`flash_bwd_dkdv_mma_grid`]): `S^T = K Q^T` and `dP^T = V dO^T` for its 32 keys (rows
/// `krow ..` of `ks`/`vs`, first key `wk0`) by its `bq / 2` queries (columns `qcol ..` of the
/// block, whose first query is `q0` and whose Q/dO rows start at row `qrow0` of `qs`/`dos`),
/// then `P^T` and `dS^T` on the accumulators, stored to rows `krow ..`, columns `qcol ..` of
/// the shared `pts` and `dss` tiles (pitch `bq + 8`) for the cube's products.
#[cube]
// The comptime `causal_mask` branch stays nested around the runtime one: the outer branch is
// resolved at expansion, the inner one is emitted.
#[allow(clippy::too_many_arguments, clippy::collapsible_if)]
fn dkdv_grid_scores<F: Float, N: Size>(
    ks: &SharedMemory<Vector<F, N>>,
    vs: &SharedMemory<Vector<F, N>>,
    qs: &SharedMemory<Vector<F, N>>,
    dos: &SharedMemory<Vector<F, N>>,
    lse_s: &SharedMemory<f32>,
    delta_s: &SharedMemory<f32>,
    pts: &mut SharedMemory<Vector<F, Const<2>>>,
    dss: &mut SharedMemory<Vector<F, Const<2>>>,
    qrow0: usize,
    q0: usize,
    krow: usize,
    wk0: usize,
    qcol: usize,
    lane: usize,
    r_lo: usize,
    r_hi: usize,
    c_lo: usize,
    scale: f32,
    s_acc: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    dp_acc: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    p: &mut Array<f32>,
    ds: &mut Array<f32>,
    #[comptime] q_tiles: usize,
    #[comptime] k_steps: usize,
    #[comptime] ldt: usize,
    #[comptime] nv: usize,
    #[comptime] ldp: usize,
    #[comptime] causal_mask: bool,
) {
    mma_abt_strip::<F, N>(
        ks,
        krow,
        qs,
        qrow0 + qcol,
        s_acc,
        lane,
        2usize,
        q_tiles,
        k_steps,
        ldt,
        nv,
    );
    mma_abt_strip::<F, N>(
        vs,
        krow,
        dos,
        qrow0 + qcol,
        dp_acc,
        lane,
        2usize,
        q_tiles,
        k_steps,
        ldt,
        nv,
    );
    #[unroll]
    for nt in 0..q_tiles {
        #[unroll]
        for e in 0..2usize {
            let ql = qcol + 8 * nt + c_lo + e;
            let qi = q0 + ql;
            let lse_q = lse_s[qrow0 + ql];
            let delta_q = delta_s[qrow0 + ql];
            #[unroll]
            for mt in 0..2usize {
                let s_frag = s_acc.index(comptime!(mt * q_tiles + nt));
                let dp_frag = dp_acc.index(comptime!(mt * q_tiles + nt));
                #[unroll]
                for hh2 in 0..2usize {
                    let mut key = wk0 + 16 * mt + r_lo;
                    if hh2 == 1 {
                        key = wk0 + 16 * mt + r_hi;
                    }
                    let s_pair = s_frag[hh2];
                    let dp_pair = dp_frag[hh2];
                    let mut pe = (s_pair[e] * scale - lse_q).exp();
                    if comptime!(causal_mask) {
                        if key > qi {
                            pe = f32::new(0.0);
                        }
                    }
                    let idx = comptime!(((mt * q_tiles + nt) * 2 + hh2) * 2 + e);
                    p[idx] = pe;
                    ds[idx] = pe * (dp_pair[e] - delta_q);
                }
            }
        }
    }
    store_acc_pairs::<F>(p, pts, krow, r_lo, r_hi, qcol + c_lo, q_tiles, ldp, 2usize);
    store_acc_pairs::<F>(ds, dss, krow, r_lo, r_hi, qcol + c_lo, q_tiles, ldp, 2usize);
}

/// dK and dV with FlashAttention-2's warp grid, `cp.async` double buffering of Q/dO/lse/delta
/// as in [`flash_bwd_dkdv_mma_cp`], and the fused dQ. Why: the per-warp layout of
/// [`flash_bwd_dkdv_mma_cp`] (16 keys by all `bq` queries per warp) reads all of Q and dO from
/// shared memory twice per warp, and that kernel is bound by shared-memory bandwidth (L1/TEX
/// 80 %, tensor pipe 39 % at hd 128); the grid needs about a fifth fewer shared loads per block.
/// Here warp `w` owns key group `w / 2` (32 keys) and query half `w % 2` for the scores, and
/// the same 32 keys by column half `w % 2` of dK and dV. The warps exchange `P^T` and `dS^T`
/// through shared memory (`pts`, `dss`), which costs a second cube barrier per block: per
/// block, barrier (Q/dO of this block visible, the previous block's reads done), issue the
/// next block's copies, scores ([`dkdv_grid_scores`]), barrier, `dV += P^T dO` and
/// `dK += dS^T Q` ([`mma_ab_acc`]), then the block's `dQ = dS K` ([`fused_dq_apply`]) from
/// the same `dss`, which the next block rewrites only after its first barrier. Deferring the
/// dQ by a block, so that the products wait only for their key group's two warps (an mbarrier
/// per group) instead of the second cube barrier, ran 2-4 % slower.
#[cube(launch_unchecked, fast_math = FastMath::all())]
// `if comptime!(..) { if runtime {..} }` stays nested: the outer branch is resolved at
// expansion, the inner one is emitted.
#[allow(clippy::too_many_arguments, clippy::collapsible_if)]
fn flash_bwd_dkdv_mma_grid<F: Float, N: Size>(
    q: &Tensor<Vector<F, N>>,
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    d_o: &Tensor<Vector<F, N>>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dk: &mut Tensor<F>,
    dv: &mut Tensor<F>,
    dq_acc: &mut Tensor<Atomic<Vector<f32, Const<2>>>>,
    scale: f32,
    seq_len: u32,
    group: u32,
    #[comptime] d: usize,
    #[comptime] nv: usize,
    #[comptime] warps: usize,
    #[comptime] bq: usize,
    #[comptime] dq_mt: usize,
    #[comptime] bulk_dq: bool,
    #[define(F)] _dtype: StorageType,
) {
    let bk = comptime!(16 * warps);
    let nthreads = comptime!(32 * warps);
    let ldt = comptime!(d + 8);
    // Pitch of the P^T and dS^T tiles: 8 mod 16 elements, so stores and ldmatrix rows hit
    // distinct banks (as the fused dQ's tile).
    let ldp = comptime!(bq + 8);
    // Query n-tiles of a warp's S^T (its half of the block's queries).
    let q_tiles = comptime!(bq / 16);
    // Column n-tiles of a warp's dK/dV (its half of the head dim).
    let d_tiles = comptime!(d / 16);
    let k_steps = comptime!(d / 16);
    let bq_steps = comptime!(bq / 16);

    let seq = seq_len as usize;
    let hk = CUBE_POS_X as usize;
    let kb = CUBE_POS_Y as usize;
    let b = CUBE_POS_Z as usize;
    let grp = group as usize;
    let warp = UNIT_POS as usize / 32;
    let lane = UNIT_POS_PLANE as usize;
    let k0 = kb * bk;
    let krow = (warp / 2) * 32;
    let wk0 = k0 + krow;
    let qcol = (warp % 2) * comptime!(bq / 2);
    let col0 = (warp % 2) * comptime!(d / 2);

    let def = cmma::MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let (r_lo, c_lo) = def.position_of_nth(lane as u32, 0u32, cmma::MatrixIdent::Accumulator);
    let (r_hi, _c_hi) = def.position_of_nth(lane as u32, 2u32, cmma::MatrixIdent::Accumulator);
    let r_lo = r_lo as usize;
    let r_hi = r_hi as usize;
    let c_lo = c_lo as usize;

    let mut ks = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(bk * ldt / nv), 128usize);
    let mut vs = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(bk * ldt / nv), 128usize);
    // Two halves of bq rows each.
    let mut qs = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(2 * bq * ldt / nv), 128usize);
    let mut dos = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(2 * bq * ldt / nv), 128usize);
    let mut lse_s = SharedMemory::<f32>::new(comptime!(2 * bq));
    let mut delta_s = SharedMemory::<f32>::new(comptime!(2 * bq));
    let mut pts =
        SharedMemory::<Vector<F, Const<2>>>::new_aligned(comptime!(bk * ldp / 2), 128usize);
    let mut dss =
        SharedMemory::<Vector<F, Const<2>>>::new_aligned(comptime!(bk * ldp / 2), 128usize);
    // The bulk dQ's staging tile (`fused_dq_apply`): the block's `bq x d` f32.
    let mut dqs = SharedMemory::<Vector<f32, Const<2>>>::new_aligned(
        comptime!(if bulk_dq { bq * d / 2 } else { 2 }),
        128usize,
    );
    let heads_q = CUBE_COUNT_X as usize * grp;

    stage_kv::<F, N>(
        k, v, &mut ks, &mut vs, b, hk, k0, seq, bk, d, ldt, nv, nthreads,
    );
    // One phase per block, as in `flash_bwd_dkdv_mma_cp`.
    let bar = Barrier::shared(CUBE_DIM, UNIT_POS == 0);

    let mut dk_acc = zero_frags(comptime!(2 * d_tiles));
    let mut dv_acc = zero_frags(comptime!(2 * d_tiles));
    let mut s_acc = zero_frags(comptime!(2 * q_tiles));
    let mut dp_acc = zero_frags(comptime!(2 * q_tiles));
    let mut p = Array::<f32>::new(comptime!(2 * q_tiles * 4));
    let mut ds = Array::<f32>::new(comptime!(2 * q_tiles * 4));

    let n_qb = (seq + bq - 1) / bq;
    let qb_start = k0 / bq;
    let n_blk = n_qb - qb_start;
    let n_it = grp * n_blk;
    let h_first = hk * grp;
    copy_qdo_async::<F, N>(
        q,
        d_o,
        lse,
        delta,
        &mut qs,
        &mut dos,
        &mut lse_s,
        &mut delta_s,
        b,
        h_first,
        qb_start * bq,
        seq,
        0usize,
        bq,
        d,
        ldt,
        nv,
        nthreads,
    );
    // Query block `blk` of head `h_first + h_off`, as counters (see `flash_bwd_dkdv_mma_cp`).
    let mut blk = 0usize;
    let mut h_off = 0usize;
    for it in 0..n_it {
        let q0 = (qb_start + blk) * bq;
        let h = h_first + h_off;
        let qrow0 = (it % 2) * bq;
        bar.commit_copy_async();
        bar.arrive_and_wait();
        let mut next_blk = blk + 1;
        let mut next_h_off = h_off;
        if next_blk == n_blk {
            next_blk = 0;
            next_h_off += 1;
        }
        let nx = it + 1;
        if nx < n_it {
            copy_qdo_async::<F, N>(
                q,
                d_o,
                lse,
                delta,
                &mut qs,
                &mut dos,
                &mut lse_s,
                &mut delta_s,
                b,
                h_first + next_h_off,
                (qb_start + next_blk) * bq,
                seq,
                bq - qrow0,
                bq,
                d,
                ldt,
                nv,
                nthreads,
            );
        }
        // The warp's first query; the mask only where one of its keys follows it.
        let wq0 = q0 + qcol;
        if wk0 + 32 <= wq0 + 1 {
            dkdv_grid_scores::<F, N>(
                &ks,
                &vs,
                &qs,
                &dos,
                &lse_s,
                &delta_s,
                &mut pts,
                &mut dss,
                qrow0,
                q0,
                krow,
                wk0,
                qcol,
                lane,
                r_lo,
                r_hi,
                c_lo,
                scale,
                &mut s_acc,
                &mut dp_acc,
                &mut p,
                &mut ds,
                q_tiles,
                k_steps,
                ldt,
                nv,
                ldp,
                false,
            );
        } else if wk0 < wq0 + comptime!(bq / 2) {
            dkdv_grid_scores::<F, N>(
                &ks,
                &vs,
                &qs,
                &dos,
                &lse_s,
                &delta_s,
                &mut pts,
                &mut dss,
                qrow0,
                q0,
                krow,
                wk0,
                qcol,
                lane,
                r_lo,
                r_hi,
                c_lo,
                scale,
                &mut s_acc,
                &mut dp_acc,
                &mut p,
                &mut ds,
                q_tiles,
                k_steps,
                ldt,
                nv,
                ldp,
                true,
            );
        } else {
            // Every key follows every query of the warp's half: zero rows for the products
            // of the other warps that read them.
            #[unroll]
            for i in 0..comptime!(2 * q_tiles * 4) {
                p[i] = f32::new(0.0);
            }
            store_acc_pairs::<F>(
                &p,
                &mut pts,
                krow,
                r_lo,
                r_hi,
                qcol + c_lo,
                q_tiles,
                ldp,
                2usize,
            );
            store_acc_pairs::<F>(
                &p,
                &mut dss,
                krow,
                r_lo,
                r_hi,
                qcol + c_lo,
                q_tiles,
                ldp,
                2usize,
            );
        }
        sync_cube();
        // Skipped where every key of the group follows every query of the block (all of its
        // P^T and dS^T rows are zero).
        if wk0 < q0 + bq {
            mma_ab_acc::<F, Const<2>, N>(
                &pts,
                krow,
                &dos,
                qrow0,
                col0,
                &mut dv_acc,
                lane,
                2usize,
                bq_steps,
                d_tiles,
                ldp,
                2usize,
                ldt,
                nv,
            );
            mma_ab_acc::<F, Const<2>, N>(
                &dss,
                krow,
                &qs,
                qrow0,
                col0,
                &mut dk_acc,
                lane,
                2usize,
                bq_steps,
                d_tiles,
                ldp,
                2usize,
                ldt,
                nv,
            );
        }
        fused_dq_apply::<F, N>(
            &dss, 0usize, &ks, dq_acc, &mut dqs, b, h, heads_q, q0, seq, warp, lane, r_lo, r_hi,
            c_lo, warps, bq, d, ldt, nv, dq_mt, bulk_dq,
        );
        blk = next_blk;
        h_off = next_h_off;
    }
    if comptime!(bulk_dq) {
        // The last reductions read `dqs` until they are done with it; their writes to global
        // memory complete before the kernel does (CUTLASS's TMA-store epilogues wait the same
        // way). Not `tma_group_wait`: CubeCL 0.10 emits it as a libcu++ function that CUDA
        // 13's does not have.
        if lane == 0 {
            tma_group_wait_read(0u32);
        }
    }

    write_dkdv::<F>(
        dk, dv, &dk_acc, &dv_acc, b, hk, wk0, r_lo, r_hi, c_lo, col0, seq, scale, d_tiles, 2usize,
    );
}

/// Launches [`flash_bwd_dkdv_mma_cp`] with `warps` warps and 64-query blocks: with `dq_acc` the
/// fused dQ into it (by bulk reductions into its chunks with `bulk`, else by f32-pair atomics
/// into dq's layout), without it dK and dV alone.
pub(super) fn launch_per_warp<R: CubeRuntime>(
    args: &BwdArgs<R>,
    dq_acc: Option<&CubeTensor<R>>,
    warps: usize,
    bulk: bool,
) {
    let bq = 64;
    let dims = args.dims;
    let fused = dq_acc.is_some();
    let dq_mt = if fused {
        dq_m_tiles(warps, bq, dims.head_dim)
    } else {
        1
    };
    // A 1-element placeholder without the fused dQ: the kernel's comptime `fused` removes
    // every access to it.
    let dq_acc = dq_acc.cloned().unwrap_or_else(|| {
        empty_device_contiguous_dtype::<R>(
            args.q.client.clone(),
            args.q.device.clone(),
            Shape::new([1usize]),
            DType::F32,
        )
    });
    let client = &args.q.client;
    let count = kv_blocks(dims, 16 * warps);
    // SAFETY: global reads are guarded by `seq` (rows past it are zero-filled in shared
    // memory), writes and atomics by `row < seq` / `key < seq`; shared indices stay inside the
    // comptime-sized tiles (ldmatrix rows are 16-byte aligned: pitches of d + 8 and bq + 8
    // elements, columns multiples of 8). The cp.async copies are `2 * nv` bytes at
    // `nv`-aligned global offsets (`vector_width`, at least 2) and 16-byte aligned shared
    // rows; the bulk reductions add whole chunks of `dq_acc`.
    unsafe {
        flash_bwd_dkdv_mma_cp::launch_unchecked::<R>(
            client,
            count,
            CubeDim::new_1d(32 * warps as u32),
            args.nv,
            args.q.clone().into_tensor_arg(),
            args.k.clone().into_tensor_arg(),
            args.v.clone().into_tensor_arg(),
            args.d_o.clone().into_tensor_arg(),
            args.lse.clone().into_tensor_arg(),
            args.delta.clone().into_tensor_arg(),
            args.dk.clone().into_tensor_arg(),
            args.dv.clone().into_tensor_arg(),
            dq_acc.into_tensor_arg(),
            args.scale,
            dims.seq as u32,
            dims.group() as u32,
            dims.head_dim,
            args.nv,
            warps,
            bq,
            fused,
            dq_mt,
            bulk,
            args.q.dtype.into(),
        );
    }
}

/// Launches [`flash_bwd_dkdv_mma_grid`] with `warps` warps and 64-query blocks, the fused dQ
/// into `dq_acc` (as [`launch_per_warp`]).
pub(super) fn launch_grid<R: CubeRuntime>(
    args: &BwdArgs<R>,
    dq_acc: &CubeTensor<R>,
    warps: usize,
    bulk: bool,
) {
    let bq = 64;
    let dims = args.dims;
    let count = kv_blocks(dims, 16 * warps);
    // SAFETY: as in `launch_per_warp`; the P^T and dS^T tiles are indexed inside their
    // comptime sizes (rows of the cube's keys, columns of one query block).
    unsafe {
        flash_bwd_dkdv_mma_grid::launch_unchecked::<R>(
            &args.q.client,
            count,
            CubeDim::new_1d(32 * warps as u32),
            args.nv,
            args.q.clone().into_tensor_arg(),
            args.k.clone().into_tensor_arg(),
            args.v.clone().into_tensor_arg(),
            args.d_o.clone().into_tensor_arg(),
            args.lse.clone().into_tensor_arg(),
            args.delta.clone().into_tensor_arg(),
            args.dk.clone().into_tensor_arg(),
            args.dv.clone().into_tensor_arg(),
            dq_acc.clone().into_tensor_arg(),
            args.scale,
            dims.seq as u32,
            dims.group() as u32,
            dims.head_dim,
            args.nv,
            warps,
            bq,
            dq_m_tiles(warps, bq, dims.head_dim),
            bulk,
            args.q.dtype.into(),
        );
    }
}

/// The dK/dV grid: one cube per (kv head, block of `keys` keys, batch).
pub(super) fn kv_blocks(dims: Dims, keys: usize) -> CubeCount {
    CubeCount::Static(
        dims.heads_kv as u32,
        dims.seq.div_ceil(keys) as u32,
        dims.batch as u32,
    )
}
