//! The warpgroup-MMA dK/dV kernel ([`FlashBackward::Wgmma`], sm_90): FlashAttention-3's
//! backward shape, two consumer warpgroups of 64 keys (128 keys per cube) and 64-query blocks,
//! every product a `wgmma` ([`super::wgmma`]), dQ added by one bulk reduction per row. On an
//! H200 (causal, head dim 128) 333 / 378 TFLOP/s at B8 S 4k / B2 S 16k, where the `mma.sync`
//! warp grid [`FlashBackward::AtomicGrid`] gives 258 / 290; on an H100 at head dim 64 (B1 S
//! 16k) 285-287 where the per-warp [`FlashBackward::Atomic`] gives 247-249.
//!
//! [`FlashBackward::Wgmma`]: crate::FlashBackward::Wgmma
//! [`FlashBackward::AtomicGrid`]: crate::FlashBackward::AtomicGrid

use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::barrier::{Barrier, copy_async};
use cubecl::prelude::*;

use crate::FlashBackward;

use super::bwd_mma::write_dkdv;
use super::dq::{bulk_reduce_add_f32, dq_chunk_offset};
use super::fragments::{p_fragment, zero_frags};
use super::fwd_wgmma::{assert_tensor_map_strides, fresh_frags, tile_map, wgmma_rs_block};
use super::tiles::{sw128_chunk, tma_tile_pair};
use super::wgmma::{
    SWIZZLE_128B, wgmma_commit_group, wgmma_descriptor, wgmma_descriptor_at, wgmma_fence,
    wgmma_fence_operands, wgmma_ss, wgmma_wait_group,
};
use super::{BwdArgs, head_block_grid};

/// Query rows per block of the warpgroup-MMA dK/dV kernel: the `n` of its `S^T` and `dP^T`.
const WGMMA_BWD_QROWS: usize = 64;

/// Keys per cube of the warpgroup-MMA dK/dV kernel: two warpgroups of 64.
const WGMMA_BWD_KEYS: usize = 128;

/// The dQ accumulator's chunks as [`super::dq::dq_chunk_pos`] lays them out for this kernel:
/// `(warps, query rows per block, m-tiles per warp)`. Warp `w` of warpgroup `g` holds rows
/// `16 (w % 4) ..` of head-dim half `g`, which is chunk warp `2 (w % 4) + g`.
pub(super) const DQ_CHUNKS: (usize, usize, usize) = (8, WGMMA_BWD_QROWS, 1);

/// Which threads copy a block's statistics, one row each: at head dim 64 lanes 0-7 of every
/// warp (rows `8 warp ..`), at head dim 128 threads 0-63 (the first warpgroup's first two
/// warps). At head dim 64 (two cubes per SM) spreading them, with one dQ reduction per row
/// then, made the kernel 1.14x faster on an H100 (S = 16k), at head dim 128 (one cube per SM)
/// 3 % slower.
const fn bookkeeping_spread(d: usize) -> bool {
    d == 64
}

/// This thread's row of [`bookkeeping_spread`]'s assignment; 64 (no row of the block) where it
/// has none.
#[cube]
fn bookkeeping_row(#[comptime] d: usize) -> usize {
    let lane = UNIT_POS_PLANE as usize;
    let t = UNIT_POS as usize;
    let mut row = t;
    if comptime!(bookkeeping_spread(d)) {
        row = comptime!(WGMMA_BWD_QROWS);
        if lane < 8 {
            row = (t / 32) * 8 + lane;
        }
    } else if t >= comptime!(WGMMA_BWD_QROWS) {
        row = comptime!(WGMMA_BWD_QROWS);
    }
    row
}

/// The lse and delta of query rows `q0 .. q0 + 64` of head `h` into `lse_s` / `delta_s` from
/// `stat0`, one 4-byte `cp.async` each by the threads of [`bookkeeping_row`] (past the end
/// `lse = 1e30`, so `P = 0`, and `delta = 0`).
#[cube]
#[allow(clippy::too_many_arguments)]
fn copy_stats(
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    lse_s: &mut SharedMemory<f32>,
    delta_s: &mut SharedMemory<f32>,
    b: usize,
    h: usize,
    q0: usize,
    seq: usize,
    stat0: usize,
    #[comptime] d: usize,
) {
    let t = bookkeeping_row(d);
    if t < comptime!(WGMMA_BWD_QROWS) {
        let qi = q0 + t;
        let si = stat0 + t;
        if qi < seq {
            let li = b * lse.stride(0) + h * lse.stride(1) + qi * lse.stride(2);
            let di = b * delta.stride(0) + h * delta.stride(1) + qi * delta.stride(2);
            copy_async::<f32>(
                &lse.slice(li, li + 1),
                &mut lse_s.slice_mut(si, si + 1),
                1u32,
            );
            copy_async::<f32>(
                &delta.slice(di, di + 1),
                &mut delta_s.slice_mut(si, si + 1),
                1u32,
            );
        } else {
            lse_s[si] = f32::new(1.0e30);
            delta_s[si] = f32::new(0.0);
        }
    }
}

/// Issues one warpgroup's `acc = A B^T` for the warpgroup-MMA dK/dV kernel and commits it as
/// one group: A the warpgroup's 64 rows of the 128-row K or V tile (`a_wg`: chunk of its
/// first row), B the 64-row Q or dO tile at chunk `b0`, both K-major and swizzled, contracted
/// over the head dim (`S^T = K Q^T`, `dP^T = V dO^T`). Nothing waits.
#[cube]
fn wgmma_bwd_scores<F: Float, N: Size>(
    acc: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    a: &SharedMemory<Vector<F, N>>,
    b: &SharedMemory<Vector<F, N>>,
    a_wg: usize,
    b0: usize,
    #[comptime] d: usize,
) {
    let bk = comptime!(WGMMA_BWD_KEYS);
    let bq = comptime!(WGMMA_BWD_QROWS);
    let desc_a0 = wgmma_descriptor(a, a_wg, 16u32, 1024u32, SWIZZLE_128B);
    let desc_b0 = wgmma_descriptor(b, b0, 16u32, 1024u32, SWIZZLE_128B);
    wgmma_fence();
    #[unroll]
    for kk in 0..comptime!(d / 16) {
        // Step kk: 16 columns = 32 bytes into 64-column block kk / 4 (as `wg_scores`).
        let desc_a = wgmma_descriptor_at(desc_a0, comptime!((kk / 4) * bk * 8 + (kk % 4) * 2));
        let desc_b = wgmma_descriptor_at(desc_b0, comptime!((kk / 4) * bq * 8 + (kk % 4) * 2));
        wgmma_ss::<F>(
            acc,
            desc_a,
            desc_b,
            comptime!(bq as u32),
            0u32,
            0u32,
            comptime!(if kk == 0 { 0u32 } else { 1u32 }),
        );
    }
    wgmma_commit_group();
}

/// `P^T = exp(S^T scale - lse)` of one warp's 16 keys (from `wk0`) and a block's queries (from
/// `q0`, their lse from `lse_s[stat0 ..]`) into `p`, in accumulator order; with `masked`, 0
/// where the key follows the query.
#[cube]
#[allow(clippy::too_many_arguments)]
fn wgmma_bwd_probs(
    s_acc: &Sequence<Array<Vector<f32, Const<2>>>>,
    p: &mut Array<f32>,
    lse_s: &SharedMemory<f32>,
    stat0: usize,
    q0: usize,
    wk0: usize,
    r_lo: usize,
    r_hi: usize,
    c_lo: usize,
    scale: f32,
    #[comptime] q_tiles: usize,
    #[comptime] masked: bool,
) {
    #[unroll]
    for nt in 0..q_tiles {
        #[unroll]
        for e in 0..2usize {
            let ql = 8 * nt + c_lo + e;
            let lse_q = lse_s[stat0 + ql];
            let s_frag = s_acc.index(nt);
            #[unroll]
            for hh in 0..2usize {
                let mut pe = (s_frag[hh][e] * scale - lse_q).exp();
                if comptime!(masked) {
                    let mut key = wk0 + r_lo;
                    if hh == 1 {
                        key = wk0 + r_hi;
                    }
                    if key > q0 + ql {
                        pe = f32::new(0.0);
                    }
                }
                p[comptime!((nt * 2 + hh) * 2 + e)] = pe;
            }
        }
    }
}

/// Adds the staged dQ of query block `q0 ..` of head `h` (`dqs`, the block's chunk) to its
/// chunk of `dq_acc` with one bulk reduction of `64 d` f32, issued by thread 0 and committed as
/// one group (its `tma_group_wait_read` frees `dqs`). Why one: a bulk reduction is issued on
/// the warp's uniform datapath, one thread after another, so a reduction per row (64 per
/// block) held the issuing warps back at every block.
#[cube]
#[allow(clippy::too_many_arguments)]
fn reduce_dq_chunk(
    dqs: &SharedMemory<Vector<f32, Const<2>>>,
    dq_acc: &mut Tensor<f32>,
    b: usize,
    h: usize,
    heads_q: usize,
    q0: usize,
    seq: usize,
    #[comptime] d: usize,
) {
    if UNIT_POS == 0 {
        let bq = comptime!(WGMMA_BWD_QROWS);
        let chunk = dq_chunk_offset(b, h, q0, heads_q, (seq + bq - 1) / bq, bq, d);
        bulk_reduce_add_f32(
            dqs,
            0usize,
            dq_acc,
            2 * chunk,
            comptime!((bq * d * 4) as u32),
        );
        tma_group_commit();
    }
}

/// dK and dV (and dQ through bulk reductions) on Hopper's warpgroup MMA, head dim 64 or 128. Cube =
/// (block of 128 keys, kv head, batch), the first two swapped in the grid at short sequences
/// (`blocks_fastest` false, see [`super::BLOCKS_FASTEST_FROM_SEQ`]); 256 threads = two warpgroups,
/// warpgroup `w` owning keys `64 w .. 64 w + 64` of the block. K and V are loaded once into
/// swizzled shared memory; the query blocks of 64 rows (every query head of the GQA group, from the
/// causal start) are double buffered. One thread issues each K, V, Q or dO tile as bulk tensor
/// copies of the tensor memory accelerator, completing on an mbarrier by byte count (a "full"
/// barrier per Q/dO buffer); lse and delta stay 4-byte `cp.async` copies behind the cube barrier,
/// their rows not being 16-byte aligned in general (documents start anywhere). Per query block and
/// warpgroup, each product one `wgmma` group, so that the tensor cores run while the warpgroup's
/// threads do the elementwise work:
/// - `S^T = K Q^T`, then `dP^T = V dO^T` (`m64n64k16`, both operands from shared memory);
/// - once `S^T` is done, `P^T = exp(S^T scale - lse)` (0 where the key follows the query);
/// - `dV += P^T dO` (`m64nDk16`, `P^T` from registers as the forward's P, dO read
///   transposed as the forward's V), issued before `dS^T = P^T (dP^T - delta)` is computed;
/// - `dS^T` to shared memory (bf16, swizzled `[key][query]`), a cube barrier, then the block's
///   `dQ = dS K` (`m64n(D/2)k16`: warpgroup `w` the head-dim half `w`, A = `dS^T` read transposed,
///   B = K read transposed) and `dK += dS^T Q`;
/// - once dQ is done (dK still running), dQ staged in the chunk order of
///   [`super::dq::dq_chunk_pos`] (each warp's fragments as contiguous 256-byte stores), which
///   the next block's first barrier publishes and one bulk reduction adds to the block's chunk
///   of `dq_acc` (f32, [`DQ_CHUNKS`]).
///
/// Two cube barriers per block: the first both lands the block's lse and delta and publishes
/// the previous block's staged dQ (and frees a Q/dO buffer for the next load), the second
/// publishes `dS^T`. The tensor loads tie the `cp.async` copies in speed (0-2 %
/// faster on an H200 at S = 4k-32k) with fewer instructions per thread.
///
/// Why this shape: FlashAttention-3's backward (two consumer warpgroups of 64 keys, 64-query
/// blocks). Registers at head dim 128: dK and dV 64 f32 each, `S^T` and `dP^T` 32 each, dQ 32.
#[cube(launch_unchecked, fast_math = FastMath::all())]
#[allow(clippy::too_many_arguments)]
fn flash_bwd_dkdv_wgmma<F: Float, N: Size>(
    q_map: &TensorMap<F, Tiled>,
    k_map: &TensorMap<F, Tiled>,
    v_map: &TensorMap<F, Tiled>,
    do_map: &TensorMap<F, Tiled>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dk: &mut Tensor<F>,
    dv: &mut Tensor<F>,
    dq_acc: &mut Tensor<f32>,
    scale: f32,
    seq_len: u32,
    group: u32,
    #[comptime] d: usize,
    #[comptime] blocks_fastest: bool,
    #[define(F)] _dtype: StorageType,
) {
    let bk = comptime!(WGMMA_BWD_KEYS);
    let bq = comptime!(WGMMA_BWD_QROWS);
    let kv_tile = comptime!(bk * d / 8);
    let q_tile = comptime!(bq * d / 8);
    let q_tiles = comptime!(bq / 8);
    let d_tiles = comptime!(d / 8);

    let seq = seq_len as usize;
    let mut block_pos = CUBE_POS_X as usize;
    let mut hk = CUBE_POS_Y as usize;
    let mut heads_kv = CUBE_COUNT_Y as usize;
    if comptime!(!blocks_fastest) {
        block_pos = CUBE_POS_Y as usize;
        hk = CUBE_POS_X as usize;
        heads_kv = CUBE_COUNT_X as usize;
    }
    let k0 = block_pos * bk;
    let b = CUBE_POS_Z as usize;
    let grp = group as usize;
    let warp = UNIT_POS as usize / 32;
    let wg = warp / 4;
    let lane = UNIT_POS_PLANE as usize;
    // This warp's first key, and its warpgroup's first K/V row (chunk offset of its atom).
    let wk0 = k0 + 16 * warp;
    let kv_wg = sw128_chunk(64 * wg, 0usize, bk);
    // Chunk offset of head-dim column `d / 2` (the second dQ half's first) in row 0 of K.
    let dq_half_chunks = sw128_chunk(0usize, comptime!(d / 16), bk);

    let def = cmma::MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let (r_lo, c_lo) = def.position_of_nth(lane as u32, 0u32, cmma::MatrixIdent::Accumulator);
    let (r_hi, _c_hi) = def.position_of_nth(lane as u32, 2u32, cmma::MatrixIdent::Accumulator);
    let r_lo = r_lo as usize;
    let r_hi = r_hi as usize;
    let c_lo = c_lo as usize;

    let mut ks = SharedMemory::<Vector<F, N>>::new_aligned(kv_tile, 1024usize);
    let mut vs = SharedMemory::<Vector<F, N>>::new_aligned(kv_tile, 1024usize);
    let mut qs = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(2 * q_tile), 1024usize);
    let mut dos = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(2 * q_tile), 1024usize);
    // dS^T as bf16 pairs, `[key][query]` in the swizzled layout (64 queries = one 128-byte
    // column block).
    let mut dss =
        SharedMemory::<Vector<F, Const<2>>>::new_aligned(comptime!(bk * bq / 2), 1024usize);
    let mut dqs =
        SharedMemory::<Vector<f32, Const<2>>>::new_aligned(comptime!(bq * d / 2), 128usize);
    let mut lse_s = SharedMemory::<f32>::new(comptime!(2 * bq));
    let mut delta_s = SharedMemory::<f32>::new(comptime!(2 * bq));

    let leader = UNIT_POS == 0;
    let bar = Barrier::shared(CUBE_DIM, leader);
    let kv_full = Barrier::shared(1u32, leader);
    let full0 = Barrier::shared(1u32, leader);
    let full1 = Barrier::shared(1u32, leader);
    sync_async_proxy_shared();
    if leader {
        tma_tile_pair::<F, N>(
            k_map, v_map, &kv_full, &mut ks, &mut vs, 0usize, b, hk, k0, bk, d,
        );
    }

    let n_qb = (seq + bq - 1) / bq;
    let qb_start = k0 / bq;
    let n_blk = n_qb - qb_start;
    let n_it = grp * n_blk;
    let h_first = hk * grp;
    let heads_q = heads_kv * grp;
    if leader {
        tma_tile_pair::<F, N>(
            q_map,
            do_map,
            &full0,
            &mut qs,
            &mut dos,
            0usize,
            b,
            h_first,
            qb_start * bq,
            bq,
            d,
        );
    }
    copy_stats(
        lse,
        delta,
        &mut lse_s,
        &mut delta_s,
        b,
        h_first,
        qb_start * bq,
        seq,
        0usize,
        d,
    );
    kv_full.wait_parity(0u32);

    let mut dk_acc = zero_frags(d_tiles);
    let mut dv_acc = zero_frags(d_tiles);
    let mut p = Array::<f32>::new(comptime!(bq / 2));
    let mut ds = Array::<f32>::new(comptime!(bq / 2));

    let mut blk = 0usize;
    let mut h_off = 0usize;
    // The previous block's dQ, staged in `dqs` and added at the next block's first
    // barrier (which is also the one the copies of that block wait at).
    let mut staged_q0 = 0usize;
    let mut staged_h = 0usize;
    for it in 0..n_it {
        let q0 = (qb_start + blk) * bq;
        let h = h_first + h_off;
        let buf = it % 2;
        let q_off = buf * q_tile;
        let stat0 = buf * bq;
        // The previous block's dK reads its Q buffer, which the prefetch below refills.
        wgmma_wait_group(0u32);
        wgmma_fence_operands(&mut dk_acc);
        // One barrier: this block's copies have landed and the previous block's dQ is
        // staged (each thread fenced its staging stores before arriving).
        bar.commit_copy_async();
        bar.arrive_and_wait();
        let phase = ((it / 2) % 2) as u32;
        if buf == 0 {
            full0.wait_parity(phase);
        } else {
            full1.wait_parity(phase);
        }
        if it > 0 {
            reduce_dq_chunk(&dqs, dq_acc, b, staged_h, heads_q, staged_q0, seq, d);
        }
        let mut next_blk = blk + 1;
        let mut next_h_off = h_off;
        if next_blk == n_blk {
            next_blk = 0;
            next_h_off += 1;
        }
        if it + 1 < n_it {
            let next_h = h_first + next_h_off;
            let next_q0 = (qb_start + next_blk) * bq;
            let next_off = q_tile - q_off;
            if leader {
                if buf == 0 {
                    tma_tile_pair::<F, N>(
                        q_map, do_map, &full1, &mut qs, &mut dos, next_off, b, next_h, next_q0, bq,
                        d,
                    );
                } else {
                    tma_tile_pair::<F, N>(
                        q_map, do_map, &full0, &mut qs, &mut dos, next_off, b, next_h, next_q0, bq,
                        d,
                    );
                }
            }
            copy_stats(
                lse,
                delta,
                &mut lse_s,
                &mut delta_s,
                b,
                next_h,
                next_q0,
                seq,
                bq - stat0,
                d,
            );
        }

        // S^T = K Q^T and dP^T = V dO^T for this warpgroup's 64 keys, one group each, so that
        // P is computed while dP^T is still running.
        let mut s_acc = fresh_frags(q_tiles);
        let mut dp_acc = fresh_frags(q_tiles);
        wgmma_bwd_scores::<F, N>(&mut s_acc, &ks, &qs, kv_wg, q_off, d);
        wgmma_bwd_scores::<F, N>(&mut dp_acc, &vs, &dos, kv_wg, q_off, d);
        wgmma_wait_group(1u32);
        wgmma_fence_operands(&mut s_acc);

        // P^T: rows are this warp's keys, columns the block's queries (0 where the key
        // follows the query, and for query rows past `seq`, whose lse is huge). The causal
        // mask only where the warp's last key passes the block's first query.
        if wk0 + 16 <= q0 + 1 {
            wgmma_bwd_probs(
                &s_acc, &mut p, &lse_s, stat0, q0, wk0, r_lo, r_hi, c_lo, scale, q_tiles, false,
            );
        } else {
            wgmma_bwd_probs(
                &s_acc, &mut p, &lse_s, stat0, q0, wk0, r_lo, r_hi, c_lo, scale, q_tiles, true,
            );
        }

        // dV += P^T dO (P^T from registers, dO read transposed) runs during dS^T.
        let mut p_frags = Sequence::<Array<Vector<F, Const<2>>>>::new();
        #[unroll]
        for kk in 0..comptime!(bq / 16) {
            p_frags.push(p_fragment::<F>(&p, 0usize, kk, q_tiles));
        }
        wgmma_fence_operands(&mut dv_acc);
        wgmma_rs_block::<F, N>(&mut dv_acc, &p_frags, &dos, q_off, bq, d);
        wgmma_wait_group(1u32);
        wgmma_fence_operands(&mut dp_acc);

        // dS^T = P^T (dP^T - delta).
        #[unroll]
        for nt in 0..q_tiles {
            #[unroll]
            for e in 0..2usize {
                let delta_q = delta_s[stat0 + 8 * nt + c_lo + e];
                let dp_frag = dp_acc.index(nt);
                #[unroll]
                for hh in 0..2usize {
                    let idx = comptime!((nt * 2 + hh) * 2 + e);
                    ds[idx] = p[idx] * (dp_frag[hh][e] - delta_q);
                }
            }
        }
        let mut ds_frags = Sequence::<Array<Vector<F, Const<2>>>>::new();
        #[unroll]
        for kk in 0..comptime!(bq / 16) {
            ds_frags.push(p_fragment::<F>(&ds, 0usize, kk, q_tiles));
        }

        // dS^T to shared memory from its A fragments (already rounded; pair j of fragment
        // kk is query tile 2 kk + j / 2, row lo or hi by j % 2), as 4-byte stores.
        let key_lo = 16 * warp + r_lo;
        let key_hi = 16 * warp + r_hi;
        #[unroll]
        for kk in 0..comptime!(bq / 16) {
            let frag = ds_frags.index(kk);
            #[unroll]
            for j in 0..4usize {
                let mut key = key_lo;
                if comptime!(j % 2 == 1) {
                    key = key_hi;
                }
                let nt = comptime!(2 * kk + j / 2);
                dss[sw128_chunk(key, nt, bk) * 4 + c_lo / 2] = frag[j];
            }
        }
        // The previous block's reduction must have read the staged dQ before it is written
        // again below; the barrier after this publishes dS^T to both warpgroups.
        if UNIT_POS == 0 {
            tma_group_wait_read(0u32);
        }
        sync_async_proxy_shared();
        sync_cube();

        // dQ = dS K for head-dim half `wg` (A = dS^T `[key][query]` read transposed, B = K
        // `[key][d]` read transposed, 16 keys per step), then dK += dS^T Q, which runs on
        // while dQ is staged.
        let mut dq_acc_w = fresh_frags(comptime!(d / 16));
        // Head-dim half `wg` starts `d / 2` columns in: a column block of its own at d 128,
        // 64 bytes into the one block at d 64.
        let desc_ds0 = wgmma_descriptor(
            &dss,
            0usize,
            comptime!(bk as u32 * 128),
            1024u32,
            SWIZZLE_128B,
        );
        let desc_k0 = wgmma_descriptor(
            &ks,
            wg * dq_half_chunks,
            comptime!(bk as u32 * 128),
            1024u32,
            SWIZZLE_128B,
        );
        wgmma_fence();
        #[unroll]
        for kk in 0..comptime!(bk / 16) {
            // Keys 16 kk .. 16 kk + 16: 2 KiB into `dS^T` and into K's column block.
            let desc_ds = wgmma_descriptor_at(desc_ds0, comptime!(kk * 128));
            let desc_k = wgmma_descriptor_at(desc_k0, comptime!(kk * 128));
            wgmma_ss::<F>(
                &mut dq_acc_w,
                desc_ds,
                desc_k,
                comptime!(d as u32 / 2),
                1u32,
                1u32,
                comptime!(if kk == 0 { 0u32 } else { 1u32 }),
            );
        }
        wgmma_commit_group();
        wgmma_fence_operands(&mut dk_acc);
        wgmma_rs_block::<F, N>(&mut dk_acc, &ds_frags, &qs, q_off, bq, d);
        wgmma_wait_group(1u32);
        wgmma_fence_operands(&mut dq_acc_w);
        wgmma_fence_operands(&mut dv_acc);

        // Stage this warp's 16 rows of its warpgroup's dQ half in chunk order (chunk warp
        // `2 (warp % 4) + wg`, 16 x d / 2 f32) for the next barrier's reduction.
        let wbase = (2 * (warp % 4) + wg) * comptime!(4 * d);
        #[unroll]
        for dt in 0..comptime!(d / 16) {
            let frag = dq_acc_w.index(dt);
            dqs[wbase + dt * 64 + lane] = frag[0];
            dqs[wbase + dt * 64 + 32 + lane] = frag[1];
        }
        sync_async_proxy_shared();
        staged_q0 = q0;
        staged_h = h;
        blk = next_blk;
        h_off = next_h_off;
    }
    wgmma_wait_group(0u32);
    wgmma_fence_operands(&mut dk_acc);
    sync_cube();
    reduce_dq_chunk(&dqs, dq_acc, b, staged_h, heads_q, staged_q0, seq, d);
    if UNIT_POS == 0 {
        tma_group_wait_read(0u32);
    }

    write_dkdv::<F>(
        dk, dv, &dk_acc, &dv_acc, b, hk, wk0, r_lo, r_hi, c_lo, 0usize, seq, scale, d_tiles, 1usize,
    );
}

/// Launches [`flash_bwd_dkdv_wgmma`], its dQ added to `dq_acc` (f32 chunks of [`DQ_CHUNKS`]:
/// `64 d` per batch, query head and 64-query block, rows past the end included).
///
/// # Panics
/// Where the rows are not 16-byte aligned or the head dim is not 64 or 128 (the kernel
/// selection never asks for it there).
pub(super) fn launch<R: CubeRuntime>(args: &BwdArgs<R>, dq_acc: &CubeTensor<R>) {
    let dims = args.dims;
    assert!(
        args.nv == 8 && matches!(dims.head_dim, 64 | 128),
        "flash attention: backward {} needs 16-byte rows and head dim 64 or 128; got vectors \
         of {} at head dim {}",
        FlashBackward::Wgmma.name(),
        args.nv,
        dims.head_dim
    );
    assert_tensor_map_strides(
        FlashBackward::Wgmma.name(),
        [&args.q, &args.k, &args.v, &args.d_o],
    );
    let (count, blocks_fastest) = head_block_grid(
        dims.heads_kv,
        dims.seq.div_ceil(WGMMA_BWD_KEYS),
        dims.batch,
        dims.seq,
    );
    // SAFETY: the tensor maps bound every tile load (zeros past the end) and lse/delta reads
    // are guarded by `seq`; writes by `key < seq`; the swizzled tiles are 1024-byte aligned and
    // `sw128_chunk` stays inside them; each bulk reduction adds one block's staged dQ chunk
    // (`64 d` f32) at its 16-byte aligned place in `dq_acc`, which holds a chunk for every
    // (batch, query head, query block).
    unsafe {
        flash_bwd_dkdv_wgmma::launch_unchecked::<R>(
            &args.q.client,
            count,
            CubeDim::new_1d(256),
            args.nv,
            tile_map(args.q.clone(), WGMMA_BWD_QROWS),
            tile_map(args.k.clone(), WGMMA_BWD_KEYS),
            tile_map(args.v.clone(), WGMMA_BWD_KEYS),
            tile_map(args.d_o.clone(), WGMMA_BWD_QROWS),
            args.lse.clone().into_tensor_arg(),
            args.delta.clone().into_tensor_arg(),
            args.dk.clone().into_tensor_arg(),
            args.dv.clone().into_tensor_arg(),
            dq_acc.clone().into_tensor_arg(),
            args.scale,
            dims.seq as u32,
            dims.group() as u32,
            dims.head_dim,
            blocks_fastest,
            args.q.dtype.into(),
        );
    }
}
