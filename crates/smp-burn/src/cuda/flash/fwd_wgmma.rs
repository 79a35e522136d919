//! The warpgroup-MMA forward ([`FlashForward::Wgmma`], sm_90): both products as Hopper's
//! `wgmma` ([`super::wgmma`]) instead of per-warp `mma.sync`. Two warpgroups of 64 query rows
//! per cube, 128-key blocks, Q/K/V loaded by the tensor memory accelerator into
//! 128-byte-swizzled shared memory that the `wgmma`s read through descriptors, and the
//! `mma.sync` forward's softmax ([`fwd_softmax`]) and output code on accumulators of the same
//! fragment layout. The two warpgroups share the K/V buffers through per-buffer mbarriers
//! rather than one cube barrier per block, so that they drift apart and one's softmax overlaps
//! the other's MMAs. On an H200 (causal, head dim 128, batch 1) it runs 466-535 TFLOP/s at
//! S = 4k-32k where the `mma.sync` forward [`FlashForward::Mma8x2`] gives 297-361.
//!
//! [`FlashForward::Wgmma`]: crate::FlashForward::Wgmma
//! [`FlashForward::Mma8x2`]: crate::FlashForward::Mma8x2

use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::barrier::Barrier;
use cubecl::prelude::*;

use crate::FlashForward;

use super::fragments::{p_fragment, zero_frags};
use super::fwd_mma::{fwd_softmax, write_fwd_out};
use super::tiles::{tma_tile, tma_tile_pair};
use super::wgmma::{
    SWIZZLE_128B, wgmma_commit_group, wgmma_descriptor, wgmma_descriptor_at, wgmma_fence,
    wgmma_fence_operands, wgmma_rs, wgmma_ss, wgmma_wait_group,
};
use super::{Dims, head_block_grid};

/// Keys per block of the warpgroup-MMA forward: the `n` of its `m64nNk16` score product.
const WGMMA_KEYS: usize = 128;

/// `n` accumulator fragments left uninitialized: a `wgmma` that overwrites them (scale-d 0)
/// comes first, and fresh arrays per block keep the compiler from carrying the previous
/// block's values across the loop (the `wgmma`'s operands are read-write).
#[cube]
pub(super) fn fresh_frags(#[comptime] n: usize) -> Sequence<Array<Vector<f32, Const<2>>>> {
    let mut frags = Sequence::<Array<Vector<f32, Const<2>>>>::new();
    #[unroll]
    for _i in 0..n {
        frags.push(Array::<Vector<f32, Const<2>>>::new(2usize));
    }
    frags
}

/// Issues this warpgroup's `S = Q K^T` for one key block as `d / 16` `wgmma`s reading both
/// operands from the swizzled tiles (`q_wg`: the chunk of the warpgroup's first Q row; `kv0`:
/// the block's K tile) into fresh accumulators, and commits them as one group. Nothing waits.
#[cube]
fn wg_scores<F: Float, N: Size>(
    qs: &SharedMemory<Vector<F, N>>,
    ks: &SharedMemory<Vector<F, N>>,
    q_wg: usize,
    kv0: usize,
    #[comptime] d: usize,
    #[comptime] keys: usize,
) -> Sequence<Array<Vector<f32, Const<2>>>> {
    let bq = comptime!(WGMMA_ROWS);
    let mut s_acc = fresh_frags(comptime!(keys / 8));
    let desc_a0 = wgmma_descriptor(qs, q_wg, 16u32, 1024u32, SWIZZLE_128B);
    let desc_b0 = wgmma_descriptor(ks, kv0, 16u32, 1024u32, SWIZZLE_128B);
    wgmma_fence();
    #[unroll]
    for kk in 0..comptime!(d / 16) {
        // Step kk: 16 columns = 32 bytes into 64-column block kk / 4. K-major operands ignore
        // the leading offset under a swizzle; 8-row atoms are 1024 bytes apart.
        let desc_a = wgmma_descriptor_at(desc_a0, comptime!((kk / 4) * bq * 8 + (kk % 4) * 2));
        let desc_b = wgmma_descriptor_at(desc_b0, comptime!((kk / 4) * keys * 8 + (kk % 4) * 2));
        wgmma_ss::<F>(
            &mut s_acc,
            desc_a,
            desc_b,
            comptime!(keys as u32),
            0u32,
            0u32,
            comptime!(if kk == 0 { 0u32 } else { 1u32 }),
        );
    }
    wgmma_commit_group();
    s_acc
}

/// [`fwd_softmax`] of one warp's 16 rows on a `wgmma` score block, with the causal mask only
/// where the block reaches past the warp's first row (decided per warp: no `wgmma` inside).
#[cube]
#[allow(clippy::too_many_arguments)]
fn wg_softmax(
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
    #[comptime] d: usize,
    #[comptime] keys: usize,
) {
    let n_tiles = comptime!(keys / 8);
    let d_tiles = comptime!(d / 8);
    if k0 + keys <= row0 + 1 {
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
            1usize,
            n_tiles,
            d_tiles,
            false,
        );
    } else {
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
            1usize,
            n_tiles,
            d_tiles,
            true,
        );
    }
}

/// Issues one warpgroup's `acc += A B` over `rows` rows of a `rows`-row swizzled tile and
/// commits it as one group: A from registers (`a_frags`, the warp's fragments, 16 rows of the
/// contraction each: the forward's P, the backward's `P^T` or `dS^T`), B the tile at chunk
/// `b0` read transposed (V, dO or Q: `O += P V`, `dV += P^T dO`, `dK += dS^T Q`), `d` wide.
/// Nothing waits; `a_frags` must live until the group completes.
#[cube]
pub(super) fn wgmma_rs_block<F: Float, N: Size>(
    acc: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    a_frags: &Sequence<Array<Vector<F, Const<2>>>>,
    b: &SharedMemory<Vector<F, N>>,
    b0: usize,
    #[comptime] rows: usize,
    #[comptime] d: usize,
) {
    let desc_b0 = wgmma_descriptor(b, b0, comptime!(rows as u32 * 128), 1024u32, SWIZZLE_128B);
    wgmma_fence();
    #[unroll]
    for kk in 0..comptime!(rows / 16) {
        // Rows 16 kk .. 16 kk + 16: two 8-row atoms, 2 KiB into each 64-column block, the
        // blocks `rows` rows (leading offset) apart.
        let desc_b = wgmma_descriptor_at(desc_b0, comptime!(kk * 128));
        wgmma_rs::<F>(
            acc,
            a_frags.index(kk),
            desc_b,
            comptime!(d as u32),
            1u32,
            1u32,
        );
    }
    wgmma_commit_group();
}

/// Issues this warpgroup's `O += P V` for one key block: P (the warp's probabilities, rounded
/// to `F`) from registers, V (tile at chunk `kv0`) read transposed from shared memory; commits
/// one group. Nothing waits; `p`'s fragments must live until the group completes.
#[cube]
fn wg_pv<F: Float, N: Size>(
    p: &Array<f32>,
    vs: &SharedMemory<Vector<F, N>>,
    kv0: usize,
    o_acc: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    #[comptime] d: usize,
    #[comptime] keys: usize,
) {
    let mut p_frags = Sequence::<Array<Vector<F, Const<2>>>>::new();
    #[unroll]
    for kk in 0..comptime!(keys / 16) {
        p_frags.push(p_fragment::<F>(p, 0usize, kk, comptime!(keys / 8)));
    }
    wgmma_fence_operands(o_acc);
    wgmma_rs_block::<F, N>(o_acc, &p_frags, vs, kv0, keys, d);
}

/// The rest of one key block for this warpgroup once its scores are issued: waits for them,
/// runs [`wg_softmax`], issues [`wg_pv`] (V tile at chunk `kv0`) and waits for it, so that
/// the block's buffers are free and `o_acc` is current when this returns. Waited for at once:
/// leaving `P V` running behind the next block's scores was 10-20 % slower, the `P` registers
/// it reads then having to live on.
#[cube]
#[allow(clippy::too_many_arguments)]
fn wg_finish_block<F: Float, N: Size>(
    s_acc: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    p: &mut Array<f32>,
    m_run: &mut Array<f32>,
    l_run: &mut Array<f32>,
    o_acc: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    vs: &SharedMemory<Vector<F, N>>,
    kv0: usize,
    k0: usize,
    row0: usize,
    r_lo: usize,
    r_hi: usize,
    c_lo: usize,
    scale: f32,
    rescale_slack: f32,
    #[comptime] d: usize,
    #[comptime] keys: usize,
) {
    wgmma_wait_group(0u32);
    wgmma_fence_operands(s_acc);
    wg_softmax(
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
        d,
        keys,
    );
    wg_pv::<F, N>(p, vs, kv0, o_acc, d, keys);
    wgmma_wait_group(0u32);
    wgmma_fence_operands(o_acc);
}

/// Query rows per cube of the warpgroup-MMA forward: two warpgroups of 64.
const WGMMA_ROWS: usize = 128;

/// The forward on Hopper's warpgroup MMA. Cube = (query block from the last, query head, batch),
/// the first two swapped in the grid at short sequences (`blocks_fastest` false, see
/// [`super::BLOCKS_FASTEST_FROM_SEQ`]); 256 threads = two warpgroups of 64 query rows. Q (once) and
/// each 128-key K/V block are loaded by the tensor memory accelerator into 128-byte-swizzled shared
/// memory, double buffered; each warpgroup issues `S = Q K^T` as `d / 16` `wgmma`s reading both
/// operands from shared memory ([`wg_scores`]), waits, runs the online softmax of the `mma.sync`
/// forward on its registers (same fragment layout, [`wg_softmax`]), and issues `O += P V`
/// ([`wg_pv`]). `N` must be 8 (16-byte chunks).
///
/// Loads: one thread issues each tile as bulk tensor copies (one per 64-column block) that
/// complete on the buffer's "full" mbarrier by byte count; rows past the sequence arrive as
/// zeros. Copying with `cp.async` instead had every thread issue 16 16-byte copies per key
/// block, with their address arithmetic, between its MMAs and its softmax: the tensor loads
/// make the forward 1.09-1.21x faster on an H200 (causal, head dim 128, S = 4k-32k).
///
/// How the two warpgroups share the K/V buffers: a "full" and an "empty" mbarrier per buffer.
/// After issuing its block-`kb` scores, the loading thread waits until both warpgroups have
/// released block `kb - 1` (empty) and loads block `kb + 1` into its buffer; a warpgroup waits
/// only for the block it needs (full) and releases it after its `P V`. So one warpgroup can run
/// up to about a block ahead of the other, and its softmax overlaps the other's `wgmma`s
/// (FlashAttention-3's ping-pong, here left to the warp schedulers). With one cube barrier per
/// block instead, both warpgroups would run their softmax at the same time while the tensor
/// cores idle.
#[cube(launch_unchecked, fast_math = FastMath::all())]
#[allow(clippy::too_many_arguments)]
fn flash_fwd_wgmma<F: Float, N: Size>(
    q_map: &TensorMap<F, Tiled>,
    k_map: &TensorMap<F, Tiled>,
    v_map: &TensorMap<F, Tiled>,
    o: &mut Tensor<Vector<F, Const<2>>>,
    lse: &mut Tensor<f32>,
    scale: f32,
    rescale_slack: f32,
    seq_len: u32,
    group: u32,
    n_blocks: u32,
    #[comptime] d: usize,
    #[comptime] blocks_fastest: bool,
    #[define(F)] _dtype: StorageType,
) {
    let keys = comptime!(WGMMA_KEYS);
    let bq = comptime!(WGMMA_ROWS);
    let chunks = comptime!(d / 8);
    let d_tiles = comptime!(d / 8);
    let kv_tile = comptime!(keys * d / 8);
    let q_bytes = comptime!((WGMMA_ROWS * d * 2) as u32);

    let seq = seq_len as usize;
    let mut block_pos = CUBE_POS_X as usize;
    let mut h = CUBE_POS_Y as usize;
    if comptime!(!blocks_fastest) {
        block_pos = CUBE_POS_Y as usize;
        h = CUBE_POS_X as usize;
    }
    let qb = n_blocks as usize - 1 - block_pos;
    let b = CUBE_POS_Z as usize;
    let hk = h / group as usize;
    let warp = UNIT_POS as usize / 32;
    let lane = UNIT_POS_PLANE as usize;
    let q0 = qb * bq;
    let row0 = q0 + 16 * warp;
    // This warpgroup's 64 rows of Q: chunk offset of its first 8-row atom.
    let q_wg = (warp / 4) * 512;
    let leader = UNIT_POS == 0;

    let def = cmma::MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let (r_lo, c_lo) = def.position_of_nth(lane as u32, 0u32, cmma::MatrixIdent::Accumulator);
    let (r_hi, _c_hi) = def.position_of_nth(lane as u32, 2u32, cmma::MatrixIdent::Accumulator);
    let r_lo = r_lo as usize;
    let r_hi = r_hi as usize;
    let c_lo = c_lo as usize;

    let mut qs = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(bq * chunks), 1024usize);
    let mut ks = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(2 * kv_tile), 1024usize);
    let mut vs = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(2 * kv_tile), 1024usize);

    // "Full" barriers complete on the leader's arrival and the copies' bytes; "empty" ones
    // when every thread has released the buffer.
    let q_full = Barrier::shared(1u32, leader);
    let full0 = Barrier::shared(1u32, leader);
    let full1 = Barrier::shared(1u32, leader);
    let empty0 = Barrier::shared(CUBE_DIM, leader);
    let empty1 = Barrier::shared(CUBE_DIM, leader);
    // The barriers' initialization must be visible to the copy engine.
    sync_async_proxy_shared();
    if leader {
        tma_tile::<F, N>(q_map, &q_full, &mut qs, 0usize, b, h, q0, bq, d);
        let _q = q_full.arrive_and_expect_tx(1u32, q_bytes);
        tma_tile_pair::<F, N>(
            k_map, v_map, &full0, &mut ks, &mut vs, 0usize, b, hk, 0usize, keys, d,
        );
    }

    let mut o_acc = zero_frags(d_tiles);
    let mut p = Array::<f32>::new(comptime!(keys / 2));
    let mut m_run = Array::<f32>::new(2usize);
    let mut l_run = Array::<f32>::new(2usize);
    #[unroll]
    for i in 0..2usize {
        m_run[i] = f32::new(-1.0e30);
        l_run[i] = f32::new(0.0);
    }

    let mut q_end = q0 + bq;
    if seq < q_end {
        q_end = seq;
    }
    // `keys` = `bq` and blocks aligned: every block starts at or before every row of the cube,
    // so no warpgroup ever skips one.
    let n_kb = (q_end + keys - 1) / keys;
    q_full.wait_parity(0u32);

    for kb in 0..n_kb {
        let k0 = kb * keys;
        let stage = kb % 2;
        let kv0 = stage * kv_tile;
        let next = kv_tile - kv0;
        let phase = ((kb / 2) % 2) as u32;
        if stage == 0 {
            full0.wait_parity(phase);
        } else {
            full1.wait_parity(phase);
        }
        let mut s_acc = wg_scores::<F, N>(&qs, &ks, q_wg, kv0, d, keys);
        if leader && kb + 1 < n_kb {
            // The other buffer held block kb - 1: both warpgroups must be done with it.
            if kb >= 1 {
                let released = (((kb - 1) / 2) % 2) as u32;
                if stage == 0 {
                    empty1.wait_parity(released);
                } else {
                    empty0.wait_parity(released);
                }
            }
            if stage == 0 {
                tma_tile_pair::<F, N>(
                    k_map,
                    v_map,
                    &full1,
                    &mut ks,
                    &mut vs,
                    next,
                    b,
                    hk,
                    k0 + keys,
                    keys,
                    d,
                );
            } else {
                tma_tile_pair::<F, N>(
                    k_map,
                    v_map,
                    &full0,
                    &mut ks,
                    &mut vs,
                    next,
                    b,
                    hk,
                    k0 + keys,
                    keys,
                    d,
                );
            }
        }
        wg_finish_block::<F, N>(
            &mut s_acc,
            &mut p,
            &mut m_run,
            &mut l_run,
            &mut o_acc,
            &vs,
            kv0,
            k0,
            row0,
            r_lo,
            r_hi,
            c_lo,
            scale,
            rescale_slack,
            d,
            keys,
        );
        if stage == 0 {
            let _released = empty0.arrive();
        } else {
            let _released = empty1.arrive();
        }
    }

    write_fwd_out::<F>(
        o, lse, &o_acc, &m_run, &mut l_run, b, h, row0, r_lo, r_hi, c_lo, seq, 1usize, d_tiles,
    );
}

/// The tiled tensor map [`flash_fwd_wgmma`] reads `t` (`[B, H, S, D]`, any strides with
/// contiguous rows) through: `[1, 1, rows, 64]` boxes, 128-byte swizzle, zeros past the end.
pub(super) fn tile_map<R: CubeRuntime>(t: CubeTensor<R>, rows: usize) -> TensorMapArg<R, Tiled> {
    let dtype: StorageType = t.dtype.into();
    TensorMapArg::new(
        TiledArgs {
            tile_size: vec![1, 1, rows, 64].into(),
        },
        t.into_tensor_arg(),
        dtype,
    )
    .with_swizzle(TensorMapSwizzle::B128)
}

/// Panics, naming `kernel`, where a tensor's batch, head or row stride is not a whole number
/// of 16-byte chunks: the tensor memory accelerator's rule for the maps of [`tile_map`] (two-byte
/// elements).
pub(super) fn assert_tensor_map_strides<R: CubeRuntime, const T: usize>(
    kernel: &str,
    tensors: [&CubeTensor<R>; T],
) {
    for t in tensors {
        assert!(
            t.meta.strides()[..3].iter().all(|s| s * 2 % 16 == 0),
            "flash attention: {kernel} loads tiles through tensor maps, which need strides of \
             whole 16-byte chunks; got {:?}",
            t.meta.strides()
        );
    }
}

/// Launches [`flash_fwd_wgmma`] into `o` and `lse` (as `fwd_mma::launch`).
///
/// # Panics
/// Where the rows are not 16-byte aligned (`nv` 8), the head dim is not 64 or 128 (the kernel
/// loads 64-column blocks), or a stride is not a multiple of 16 bytes (the tensor memory
/// accelerator's rule).
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
) {
    let head_dim = dims.head_dim;
    assert!(
        nv == 8 && matches!(head_dim, 64 | 128),
        "flash attention: forward {} loads 64-column boxes of head dim 64 or 128; got vectors \
         of {nv} elements at head dim {head_dim}",
        FlashForward::Wgmma.name()
    );
    assert_tensor_map_strides(FlashForward::Wgmma.name(), [&q, &k, &v]);
    let client = q.client.clone();
    let dtype = q.dtype;
    let n_blocks = dims.seq.div_ceil(WGMMA_ROWS) as u32;
    let (count, blocks_fastest) =
        head_block_grid(dims.heads_q, n_blocks as usize, dims.batch, dims.seq);
    // SAFETY: the tensor maps bound every copy (zeros past the end); the swizzled tiles are
    // 1024-byte aligned, as the 128-byte swizzle needs, and each box fills one 64-column block.
    unsafe {
        flash_fwd_wgmma::launch_unchecked::<R>(
            &client,
            count,
            CubeDim::new_1d(256),
            nv,
            tile_map(q, WGMMA_ROWS),
            tile_map(k, WGMMA_KEYS),
            tile_map(v, WGMMA_KEYS),
            o.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            scale_log2,
            slack_log2,
            dims.seq as u32,
            dims.group() as u32,
            n_blocks,
            head_dim,
            blocks_fastest,
            dtype.into(),
        );
    }
}
