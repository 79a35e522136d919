//! dQ and the backward's small kernels: the split dQ kernel ([`FlashBackward::Split`]), the
//! fused dQ of the atomic dK/dV kernels (f32-pair atomics, or Hopper's bulk reductions), the
//! conversion of the f32 dQ accumulator to the input dtype, and `delta = rowsum(dO * O)`.
//!
//! The split dQ kernel is shaped like the forward (a cube per query block of `16 * warps` rows,
//! K/V blocks of [`MMA_KEYS`] keys double-buffered by `cp.async`): `S` and `dP = dO V^T` by
//! `mma_abt_strip`, `dS = P (dP - delta)` in registers, `dQ += dS K` by `mma_pv_strip` with K
//! as the "V". 7 products per block pair against 5 with the fused dQ, but no atomics: the only
//! bitwise reproducible backward.
//!
//! [`FlashBackward::Split`]: crate::FlashBackward::Split

use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::barrier::Barrier;
use cubecl::prelude::*;

use super::fragments::{mma_abt_strip, mma_atb_acc, mma_pv_strip, zero_frags};
use super::fwd_mma::MMA_KEYS;
use super::tiles::{copy_kv_async, copy_tile_async};
use super::{BwdArgs, Dims, vector_width};

/// `t[b, h, row]` for this lane's two accumulator rows `row0 + r_lo`, `row0 + r_hi` (0 past
/// the end: with zero Q and dO there, `dS = exp(0) * (0 - 0) = 0`).
#[cube]
#[allow(clippy::too_many_arguments)]
fn lane_rows_f32(
    t: &Tensor<f32>,
    b: usize,
    h: usize,
    row0: usize,
    r_lo: usize,
    r_hi: usize,
    seq: usize,
) -> Array<f32> {
    let mut out = Array::<f32>::new(2usize);
    #[unroll]
    for hh in 0..2usize {
        let mut r = r_lo;
        if hh == 1 {
            r = r_hi;
        }
        let row = row0 + r;
        let mut val = f32::new(0.0);
        if row < seq {
            val = t[b * t.stride(0) + h * t.stride(1) + row * t.stride(2)];
        }
        out[hh] = val;
    }
    out
}

/// One key block of the split dQ kernel for one warp's 16 query rows (first row `row0`, row `wrow`
/// of `qs`/`dos`): `S = Q K^T` and `dP = dO V^T`, `dS = P (dP - delta)` in registers
/// (`lse_r`, `delta_r`: this lane's two rows), then `dQ += dS K` with dS straight from the
/// accumulators as the A operand and K through transposed loads, as V in the forward. The
/// block's first key is `k0`; its K and V rows start at row `krow0` of `ks` and `vs`.
#[cube]
// The comptime `causal_mask` branch stays nested around the runtime one: the outer branch is
// resolved at expansion, the inner one is emitted.
#[allow(clippy::too_many_arguments, clippy::collapsible_if)]
fn dq_block<F: Float, N: Size>(
    qs: &SharedMemory<Vector<F, N>>,
    dos: &SharedMemory<Vector<F, N>>,
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
    lse_r: &Array<f32>,
    delta_r: &Array<f32>,
    scale: f32,
    s_acc: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    dp_acc: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    ds: &mut Array<f32>,
    dq_acc: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    #[comptime] n_tiles: usize,
    #[comptime] d_tiles: usize,
    #[comptime] k_steps: usize,
    #[comptime] ldt: usize,
    #[comptime] nv: usize,
    #[comptime] causal_mask: bool,
) {
    mma_abt_strip::<F, N>(
        qs, wrow, ks, krow0, s_acc, lane, 1usize, n_tiles, k_steps, ldt, nv,
    );
    mma_abt_strip::<F, N>(
        dos, wrow, vs, krow0, dp_acc, lane, 1usize, n_tiles, k_steps, ldt, nv,
    );
    // Only blocks that reach past this warp's first row need the causal mask.
    let masked = k0 + comptime!(8 * n_tiles) > row0 + 1;
    #[unroll]
    for hh in 0..2usize {
        let mut r = r_lo;
        if hh == 1 {
            r = r_hi;
        }
        let row = row0 + r;
        let lse_v = lse_r[hh];
        let delta_v = delta_r[hh];
        #[unroll]
        for nt in 0..n_tiles {
            let s_pair = s_acc.index(nt)[hh];
            let dp_pair = dp_acc.index(nt)[hh];
            #[unroll]
            for e in 0..2usize {
                let mut pe = (s_pair[e] * scale - lse_v).exp();
                if comptime!(causal_mask) {
                    if masked {
                        let key = k0 + 8 * nt + c_lo + e;
                        if key > row {
                            pe = f32::new(0.0);
                        }
                    }
                }
                ds[comptime!((nt * 2 + hh) * 2 + e)] = pe * (dp_pair[e] - delta_v);
            }
        }
    }
    mma_pv_strip::<F, N>(
        ds, ks, krow0, dq_acc, lane, 1usize, n_tiles, d_tiles, ldt, nv,
    );
}

/// Writes one warp's dQ rows (`row0 + r_lo`, `row0 + r_hi`, those before `seq`) times
/// `scale` from the accumulators.
#[cube]
#[allow(clippy::too_many_arguments)]
fn write_dq<F: Float>(
    dq_out: &mut Tensor<F>,
    dq_acc: &Sequence<Array<Vector<f32, Const<2>>>>,
    b: usize,
    h: usize,
    row0: usize,
    r_lo: usize,
    r_hi: usize,
    c_lo: usize,
    seq: usize,
    scale: f32,
    #[comptime] d_tiles: usize,
) {
    let dq_base = b * dq_out.stride(0) + h * dq_out.stride(1);
    #[unroll]
    for hh in 0..2usize {
        let mut r = r_lo;
        if hh == 1 {
            r = r_hi;
        }
        let row = row0 + r;
        if row < seq {
            let rb = dq_base + row * dq_out.stride(2) + c_lo;
            #[unroll]
            for dt in 0..d_tiles {
                let pair = dq_acc.index(dt)[hh];
                dq_out[rb + 8 * dt] = F::cast_from(pair[0] * scale);
                dq_out[rb + 8 * dt + 1] = F::cast_from(pair[1] * scale);
            }
        }
    }
}

/// The split dQ kernel. Cube = (query head, query block from the last, batch); `32 * warps`
/// threads, warp `w` owning query rows `16 w .. 16 w + 16`: the forward's structure with
/// `dS = P (dP - delta)` in place of the softmax ([`dq_block`]). Q and dO and the K/V blocks
/// are copied by `cp.async` (no staging registers; a register prefetch would spend 32 per lane
/// at hd 128), K/V into two halves of their tiles: after the barrier that makes block `i`
/// visible (and that every warp reaches only once done with block `i - 1`), the copy of block
/// `i + 1` into the other half is issued, then block `i` is computed. One cube barrier per
/// block.
#[cube(launch_unchecked, fast_math = FastMath::all())]
#[allow(clippy::too_many_arguments)]
fn flash_bwd_dq_mma_cp<F: Float, N: Size>(
    q: &Tensor<Vector<F, N>>,
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    d_o: &Tensor<Vector<F, N>>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dq_out: &mut Tensor<F>,
    scale: f32,
    seq_len: u32,
    group: u32,
    n_blocks: u32,
    #[comptime] d: usize,
    #[comptime] nv: usize,
    #[comptime] warps: usize,
    #[define(F)] _dtype: StorageType,
) {
    let bq = comptime!(16 * warps);
    let bk = comptime!(MMA_KEYS);
    let nthreads = comptime!(32 * warps);
    let ldt = comptime!(d + 8);
    let n_tiles = comptime!(MMA_KEYS / 8);
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
    let wrow = warp * 16;
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
    let mut dos = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(bq * ldt / nv), 128usize);
    // Two halves of MMA_KEYS rows each.
    let mut ks =
        SharedMemory::<Vector<F, N>>::new_aligned(comptime!(2 * MMA_KEYS * ldt / nv), 128usize);
    let mut vs =
        SharedMemory::<Vector<F, N>>::new_aligned(comptime!(2 * MMA_KEYS * ldt / nv), 128usize);

    // One phase per key block (see flash_bwd_dkdv_mma_cp); created before any copy is issued.
    let bar = Barrier::shared(CUBE_DIM, UNIT_POS == 0);
    // Q, dO and the first K/V block go together: the first barrier covers all four.
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
    copy_tile_async::<F, N>(
        d_o,
        (b * d_o.stride(0) + h * d_o.stride(1)) / nv,
        d_o.stride(2) / nv,
        q0,
        seq,
        &mut dos,
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

    let lse_r = lane_rows_f32(lse, b, h, row0, r_lo, r_hi, seq);
    let delta_r = lane_rows_f32(delta, b, h, row0, r_lo, r_hi, seq);

    let mut dq_acc = zero_frags(d_tiles);
    let mut s_acc = zero_frags(n_tiles);
    let mut dp_acc = zero_frags(n_tiles);
    let mut ds = Array::<f32>::new(comptime!(MMA_KEYS / 2));

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
        // No row of the warp precedes the block's last key: no causal mask (decided per warp,
        // see the forward).
        if k0 + bk <= row0 + 1 {
            dq_block::<F, N>(
                &qs,
                &dos,
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
                &lse_r,
                &delta_r,
                scale,
                &mut s_acc,
                &mut dp_acc,
                &mut ds,
                &mut dq_acc,
                n_tiles,
                d_tiles,
                k_steps,
                ldt,
                nv,
                false,
            );
        } else if k0 < row0 + 16 {
            dq_block::<F, N>(
                &qs,
                &dos,
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
                &lse_r,
                &delta_r,
                scale,
                &mut s_acc,
                &mut dp_acc,
                &mut ds,
                &mut dq_acc,
                n_tiles,
                d_tiles,
                k_steps,
                ldt,
                nv,
                true,
            );
        }
    }

    write_dq::<F>(
        dq_out, &dq_acc, b, h, row0, r_lo, r_hi, c_lo, seq, scale, d_tiles,
    );
}

// ------------------------------------------------------------------------------------------
// The fused dQ of the atomic dK/dV kernels
// ------------------------------------------------------------------------------------------

/// Offset (in f32 pairs) of the chunk of query block `q0 / bq` of head `h`, batch `b`, in the
/// bulk dQ's accumulator ([`dq_chunk_pos`]): chunks of `bq x d` f32 per (batch, head, query
/// block), in that order.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn dq_chunk_offset(
    b: usize,
    h: usize,
    q0: usize,
    heads_q: usize,
    n_qb: usize,
    #[comptime] bq: usize,
    #[comptime] d: usize,
) -> usize {
    ((b * heads_q + h) * n_qb + q0 / bq) * comptime!(bq * d / 2)
}

/// Where element (`row`, `col`) of a query block's `bq x d` dQ lies in its chunk of the bulk
/// accumulator (f32 units): the order in which [`fused_dq_apply`]'s warps hold it, so that
/// they store it to shared memory without bank conflicts and add it with one bulk reduction
/// each. Warp `w = (row / 16 mt) * wpm + col / cw` owns `16 mt x cw` (`wpm = warps / (bq /
/// 16 mt)`, `cw = d / wpm`) as `mt x cw / 8` fragments `f`, each two halves `hh` (rows `r` and
/// `r + 8`) of 32 lanes' pairs: position `w * 16 mt cw + (f * 64 + hh * 32 + lane) * 2 + e`.
#[cube]
fn dq_chunk_pos(
    row: usize,
    col: usize,
    #[comptime] warps: usize,
    #[comptime] bq: usize,
    #[comptime] d: usize,
    #[comptime] mt: usize,
) -> usize {
    let wpm = comptime!(warps / (bq / (16 * mt)));
    let cw = comptime!(d / wpm);
    let warp = (row / comptime!(16 * mt)) * wpm + col / cw;
    let m = (row % comptime!(16 * mt)) / 16;
    let hh = (row % 16) / 8;
    let lane = (row % 8) * 4 + (col % 8) / 2;
    let f = m * comptime!(cw / 8) + (col % cw) / 8;
    warp * comptime!(16 * mt * cw) + (f * 64 + hh * 32 + lane) * 2 + col % 2
}

/// Whether this build can issue Hopper's bulk asynchronous reduction
/// (`bulk_reduce_add_f32`): with the workspace's `vendor/cubecl-ir` and `vendor/cubecl-cpp`,
/// which add the operation (`build.rs` detects them); not with upstream CubeCL 0.10.
pub const BULK_REDUCE_BUILT: bool = cfg!(cubecl_bulk_reduce);

/// Adds `bytes` bytes of f32 from `src` (from element `src_offset`) into `dst` (from element
/// `dst_offset`), offsets in units of each buffer's own item type, by one
/// `cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32` (sm_90). Why: the adds happen in L2
/// on behalf of the copy engine, so the issuing warp neither waits for atomics to read their
/// registers nor spends an instruction per pair (the warp-grid kernel's pair atomics cost a fifth
/// of the backward; the bulk reductions make the hd-128 backward 4-6 % faster). One thread issues
/// it; the writes to `src` must first be made visible to the async proxy (`sync_async_proxy_shared`
/// by the writers, then a barrier among them), and `src` must not be written again before
/// `tma_group_commit` and `tma_group_wait_read`. Addresses and `bytes` must be multiples of 16.
#[allow(unused_variables)]
pub(super) fn bulk_reduce_add_f32<S: CubePrimitive, G: CubePrimitive>(
    src: &SharedMemory<S>,
    src_offset: usize,
    dst: &mut Tensor<G>,
    dst_offset: usize,
    bytes: u32,
) {
    panic!("cube functions run only inside kernels")
}

/// The expansion of [`bulk_reduce_add_f32`] (CubeCL's frontend convention: a module of the
/// function's name with an `expand`).
pub(super) mod bulk_reduce_add_f32 {
    use cubecl::prelude::*;

    /// Registers the operation; see [`super::bulk_reduce_add_f32`].
    ///
    /// # Panics
    /// In a build without the vendored CubeCL crates ([`super::BULK_REDUCE_BUILT`] false), where
    /// no kernel is launched with the bulk dQ.
    pub fn expand<S: CubePrimitive, G: CubePrimitive>(
        scope: &mut Scope,
        src: NativeExpand<SharedMemory<S>>,
        src_offset: NativeExpand<usize>,
        dst: NativeExpand<Tensor<G>>,
        dst_offset: NativeExpand<usize>,
        bytes: NativeExpand<u32>,
    ) {
        #[cfg(cubecl_bulk_reduce)]
        scope.register(cubecl::ir::Instruction::new(
            cubecl::ir::TmaOps::BulkReduceAddF32 {
                source: *src.expand,
                offset_source: *src_offset.expand,
                offset_out: *dst_offset.expand,
                bytes: *bytes.expand,
            },
            *dst.expand,
        ));
        #[cfg(not(cubecl_bulk_reduce))]
        {
            let _ = (scope, src, src_offset, dst, dst_offset, bytes);
            panic!(
                "bulk_reduce_add_f32 needs the workspace's vendor/cubecl-ir and vendor/cubecl-cpp"
            );
        }
    }
}

/// The fused dQ of one (key block, query block) pair, FlashAttention-2's scheme: once every
/// warp has stored its `dS^T` rows (keys by queries, as they lie in the accumulators) to `dss`,
/// each warp forms its `16 * mt x d / wpm` tile of `dQ = dS K` from the `dS^T` tile whose
/// first key row is row `dss_row0` of `dss` (0, or `bk` for the second half of a double
/// buffer), all of whose rows the caller has made visible with a cube barrier, and adds it to
/// `dq_acc` (query head `h` of `heads_q`, batch `b`) with f32-pair atomics. dQ's f32 summation
/// order then varies between runs.
///
/// With `bulk`, `dq_acc` is in the chunked fragment order of [`dq_chunk_pos`] instead (one
/// dimension, no rows): the warp stores its tile to its part of `dqs` (`bq x d` f32 for the
/// cube) and adds it with one [`bulk_reduce_add_f32`]. The warp's previous reduction must have
/// read `dqs` by then: its lane 0 waits for that first (a block's work later, it has: the wait
/// costs nothing measurable). The kernel must `tma_group_wait_read(0)` before it ends.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn fused_dq_apply<F: Float, N: Size>(
    dss: &SharedMemory<Vector<F, Const<2>>>,
    dss_row0: usize,
    ks: &SharedMemory<Vector<F, N>>,
    dq_acc: &mut Tensor<Atomic<Vector<f32, Const<2>>>>,
    dqs: &mut SharedMemory<Vector<f32, Const<2>>>,
    b: usize,
    h: usize,
    heads_q: usize,
    q0: usize,
    seq: usize,
    warp: usize,
    lane: usize,
    r_lo: usize,
    r_hi: usize,
    c_lo: usize,
    #[comptime] warps: usize,
    #[comptime] bq: usize,
    #[comptime] d: usize,
    #[comptime] ldt: usize,
    #[comptime] nv: usize,
    #[comptime] mt: usize,
    #[comptime] bulk: bool,
) {
    // Pitch of the dS^T tile (elements): 8 mod 16, so stores and ldmatrix rows hit distinct
    // banks.
    let ldd = comptime!(bq + 8);
    // Warps split the block's `bq x d` dQ into `bq / (16 * mt)` row groups of `16 * mt` rows
    // and `wpm` column slices of `cw` (two m-tiles when that leaves each warp at least two
    // n-tiles, [`dq_m_tiles`]: fewer shared-memory reads per product, see `mma_atb_acc`).
    let wpm = comptime!(warps / (bq / (16 * mt)));
    let cw = comptime!(d / wpm);
    let mq = warp / wpm;
    let c0 = (warp % wpm) * cw;
    let mut dq_frags = zero_frags(comptime!(mt * cw / 8));
    // The half's row offset folds into the column offset: the tile is addressed row * ldd + col.
    mma_atb_acc::<F, Const<2>, N>(
        dss,
        dss_row0 * ldd + 16 * mt * mq,
        ks,
        c0,
        &mut dq_frags,
        lane,
        mt,
        warps,
        comptime!(cw / 8),
        ldd,
        2usize,
        ldt,
        nv,
    );
    if comptime!(bulk) {
        // The warp's part of the chunk: its fragments in order, each as two halves of 32
        // lanes' pairs, so that every store is 256 contiguous bytes (no bank conflicts).
        let frags = comptime!(mt * cw / 8);
        let wbase = warp * comptime!(frags * 64);
        if lane == 0 {
            tma_group_wait_read(0u32);
        }
        sync_plane();
        #[unroll]
        for f in 0..frags {
            #[unroll]
            for hh in 0..2usize {
                dqs[wbase + comptime!(f * 64 + hh * 32) + lane] = dq_frags.index(f)[hh];
            }
        }
        sync_async_proxy_shared();
        sync_plane();
        if lane == 0 {
            let chunk = dq_chunk_offset(b, h, q0, heads_q, (seq + bq - 1) / bq, bq, d);
            bulk_reduce_add_f32(
                dqs,
                wbase,
                dq_acc,
                chunk + wbase,
                comptime!(frags as u32 * 64 * 8),
            );
            tma_group_commit();
        }
    } else {
        let dq_off = b * dq_acc.stride(0) + h * dq_acc.stride(1);
        let dq_rs = dq_acc.stride(2);
        fused_dq_atomics(
            &dq_frags, dq_acc, dq_off, dq_rs, q0, seq, mq, c0, r_lo, r_hi, c_lo, cw, mt,
        );
    }
}

/// The f32-pair atomics of [`fused_dq_apply`] without `bulk`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn fused_dq_atomics(
    dq_frags: &Sequence<Array<Vector<f32, Const<2>>>>,
    dq_acc: &mut Tensor<Atomic<Vector<f32, Const<2>>>>,
    dq_off: usize,
    dq_rs: usize,
    q0: usize,
    seq: usize,
    mq: usize,
    c0: usize,
    r_lo: usize,
    r_hi: usize,
    c_lo: usize,
    #[comptime] cw: usize,
    #[comptime] mt: usize,
) {
    #[unroll]
    for m in 0..mt {
        #[unroll]
        for hh in 0..2usize {
            let mut r = r_lo;
            if hh == 1 {
                r = r_hi;
            }
            let row = q0 + 16 * mt * mq + 16 * m + r;
            if row < seq {
                let rb = dq_off + row * dq_rs + c0 + c_lo;
                #[unroll]
                for j in 0..comptime!(cw / 8) {
                    let pair = dq_frags.index(comptime!(m * (cw / 8) + j))[hh];
                    // One 8-byte atomic per column pair (sm_90 adds f32 pairs natively): half
                    // the atomics of two scalar adds. `rb` is even (even `c0 + c_lo`, even
                    // strides).
                    dq_acc[(rb + 8 * j) / 2].fetch_add(pair);
                }
            }
        }
    }
}

/// M-tiles per warp of the fused dQ ([`fused_dq_apply`]) of `warps` warps, `bq`-query blocks
/// and head dim `d`: 2 when the block's rows split into whole 32-row groups and each warp
/// keeps at least two 8-column n-tiles (two m-tiles share each loaded B fragment), else 1.
pub(super) fn dq_m_tiles(warps: usize, bq: usize, d: usize) -> usize {
    let fits =
        bq.is_multiple_of(32) && warps.is_multiple_of(bq / 32) && d / (warps / (bq / 32)) >= 16;
    if fits { 2 } else { 1 }
}

// ------------------------------------------------------------------------------------------
// Element-wise kernels
// ------------------------------------------------------------------------------------------

/// Threads per cube of [`flash_dq_convert`].
const CONVERT_THREADS: usize = 256;

/// `dq = dq_acc * scale` rounded to `F`, element-wise over the flat buffers of `len` vectors
/// of `N` (dense, with the same strides, so any shared layout): the last step of the fused dQ
/// with the pair atomics.
#[cube(launch_unchecked)]
fn flash_dq_convert<F: Float, N: Size>(
    dq_acc: &Tensor<Vector<f32, N>>,
    dq: &mut Tensor<Vector<F, N>>,
    scale: f32,
    len: u32,
    #[define(F)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i < len as usize {
        dq[i] = Vector::<F, N>::cast_from(dq_acc[i] * Vector::new(scale));
    }
}

/// `dq = dq_acc * scale` rounded to `F` from the bulk dQ's chunked accumulator
/// ([`dq_chunk_pos`]; its rows past `seq` are padding and skipped), one thread per vector of
/// `nv` adjacent columns of one row of `dq` (`[B, H, S, D]` through its strides, `len`
/// vectors). Why vectors: a row's 8 columns from a multiple of 8 lie next to each other in the
/// chunk, so a thread reads them with `nv / mv` loads of `mv` f32 and writes one vector, and
/// the index arithmetic (divisions by the runtime `seq` and `heads`) is paid once per vector.
/// One thread per element ran at 1.0 TB/s, compute-bound on that arithmetic: 0.79 ms, 5.5 % of
/// the hd-128 backward at B8 S 4k on an H200.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn flash_dq_convert_chunks<F: Float, N: Size, M: Size>(
    dq_acc: &Tensor<Vector<f32, M>>,
    dq: &mut Tensor<Vector<F, N>>,
    scale: f32,
    len: u32,
    heads: u32,
    seq_len: u32,
    #[comptime] warps: usize,
    #[comptime] bq: usize,
    #[comptime] d: usize,
    #[comptime] mt: usize,
    #[comptime] nv: usize,
    #[comptime] mv: usize,
    #[define(F)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i < len as usize {
        let seq = seq_len as usize;
        let vectors = comptime!(d / nv);
        let col = (i % vectors) * nv;
        let t = i / vectors;
        let row = t % seq;
        let bh = t / seq;
        let h = bh % heads as usize;
        let b = bh / heads as usize;
        let n_qb = (seq + bq - 1) / bq;
        let src = ((bh * n_qb + row / bq) * comptime!(bq * d)
            + dq_chunk_pos(row % bq, col, warps, bq, d, mt))
            / mv;
        let mut out = Vector::<F, N>::empty();
        #[unroll]
        for j in 0..comptime!(nv / mv) {
            let a = dq_acc[src + j];
            #[unroll]
            for e in 0..mv {
                out[j * mv + e] = F::cast_from(a[e] * scale);
            }
        }
        dq[(b * dq.stride(0) + h * dq.stride(1) + row * dq.stride(2) + col) / nv] = out;
    }
}

/// `delta = rowsum(dO * O)` in f32 with `tpr` adjacent lanes per row: each lane reads
/// `d / nv / tpr` vectors of `nv` elements of O and dO (16-byte loads at `nv = 8`; a row's
/// lanes read it contiguously, so a warp's loads coalesce, where one thread per row strides by
/// a whole row), then the row's lanes add their partial sums with `plane_shuffle_xor`. Lanes
/// past the last row take part in the shuffles with zeros.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn flash_delta<F: Float, N: Size>(
    o: &Tensor<Vector<F, N>>,
    d_o: &Tensor<Vector<F, N>>,
    delta: &mut Tensor<f32>,
    seq_len: u32,
    heads: u32,
    total_rows: u32,
    #[comptime] d: usize,
    #[comptime] nv: usize,
    #[comptime] tpr: usize,
    #[define(F)] _dtype: StorageType,
) {
    let per_lane = comptime!(d / nv / tpr);
    let pos = ABSOLUTE_POS / tpr;
    let sub = UNIT_POS as usize % tpr;
    let in_range = pos < total_rows as usize;
    let seq = seq_len as usize;
    let i = pos % seq;
    let bh = pos / seq;
    let h = bh % heads as usize;
    let b = bh / heads as usize;
    let mut acc = f32::new(0.0);
    if in_range {
        let ob = (b * o.stride(0) + h * o.stride(1) + i * o.stride(2)) / nv;
        let gb = (b * d_o.stride(0) + h * d_o.stride(1) + i * d_o.stride(2)) / nv;
        #[unroll]
        for j in 0..per_lane {
            let c = j * tpr + sub;
            let ov = o[ob + c];
            let gv = d_o[gb + c];
            #[unroll]
            for e in 0..nv {
                acc += f32::cast_from(ov[e]) * f32::cast_from(gv[e]);
            }
        }
    }
    #[unroll]
    for step in 0..comptime!(tpr.trailing_zeros() as usize) {
        acc += plane_shuffle_xor(acc, comptime!(1u32 << step));
    }
    if in_range && sub == 0 {
        delta[b * delta.stride(0) + h * delta.stride(1) + i * delta.stride(2)] = acc;
    }
}

/// Threads per cube of [`flash_delta`].
const DELTA_THREADS: usize = 256;

/// Lanes per row of [`flash_delta`]: 8 (two 16-byte vectors each at hd 128), fewer when a row
/// has fewer vectors.
const DELTA_LANES: usize = 8;

/// Launches [`flash_delta`]: `delta [B, Hq, S]` (f32) `= rowsum(d_o * o)` for `o`, `d_o` of
/// `shape` `[B, Hq, S, D]` (last dimension contiguous, as `prepare` leaves them).
pub(super) fn launch_delta<R: CubeRuntime>(
    o: CubeTensor<R>,
    d_o: &CubeTensor<R>,
    delta: &CubeTensor<R>,
    shape: [usize; 4],
) {
    let [batch, heads, seq, head_dim] = shape;
    let nv = vector_width(&[&o, d_o]);
    let vectors = head_dim / nv;
    assert!(
        vectors.is_power_of_two(),
        "flash attention delta: {head_dim} columns in vectors of {nv}"
    );
    let tpr = vectors.min(DELTA_LANES);
    let total_rows = batch * heads * seq;
    assert!(
        total_rows * tpr <= u32::MAX as usize,
        "flash attention backward: too many rows ({total_rows})"
    );
    let client = o.client.clone();
    let dtype = o.dtype;
    // SAFETY: reads are guarded by `pos < total_rows` and stay within a row of `head_dim`
    // elements (`per_lane * tpr * nv = head_dim`); the write by the same guard.
    unsafe {
        flash_delta::launch_unchecked::<R>(
            &client,
            CubeCount::Static((total_rows * tpr).div_ceil(DELTA_THREADS) as u32, 1, 1),
            CubeDim::new_1d(DELTA_THREADS as u32),
            nv,
            o.into_tensor_arg(),
            d_o.clone().into_tensor_arg(),
            delta.clone().into_tensor_arg(),
            seq as u32,
            heads as u32,
            total_rows as u32,
            head_dim,
            nv,
            tpr,
            dtype.into(),
        );
    }
}

/// Launches [`flash_bwd_dq_mma_cp`] with `warps` warps of 16 query rows, writing `dq`.
pub(super) fn launch_split<R: CubeRuntime>(args: &BwdArgs<R>, dq: &CubeTensor<R>, warps: usize) {
    let dims = args.dims;
    let n_blocks = dims.seq.div_ceil(16 * warps) as u32;
    let count = CubeCount::Static(dims.heads_q as u32, n_blocks, dims.batch as u32);
    // SAFETY: global reads are guarded by `seq` (rows past it are zero-filled in shared
    // memory), writes by `row < seq`; shared indices stay inside the comptime-sized tiles
    // (ldmatrix rows are 16-byte aligned: pitches of d + 8 elements, columns multiples of 8).
    // The cp.async copies are `2 * nv` bytes at `nv`-aligned global offsets (`vector_width`,
    // at least 2) and 16-byte aligned shared rows.
    unsafe {
        flash_bwd_dq_mma_cp::launch_unchecked::<R>(
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
            dq.clone().into_tensor_arg(),
            args.scale,
            dims.seq as u32,
            dims.group() as u32,
            n_blocks,
            dims.head_dim,
            args.nv,
            warps,
            args.q.dtype.into(),
        );
    }
}

/// The number of elements of `dims`' dQ, which the conversions index with 32 bits.
fn dq_len(dims: Dims) -> usize {
    let len = dims.batch * dims.heads_q * dims.seq * dims.head_dim;
    assert!(
        len <= u32::MAX as usize,
        "flash attention backward: dQ too large ({len} elements)"
    );
    len
}

/// Launches [`flash_dq_convert`]: `dq = dq_acc * scale` from an accumulator in dq's layout.
pub(super) fn launch_convert<R: CubeRuntime>(
    dq_acc: CubeTensor<R>,
    dq: &CubeTensor<R>,
    scale: f32,
    dims: Dims,
) {
    // 16-byte f32 loads at most.
    let nv = vector_width(&[dq]).min(4);
    let vectors = dq_len(dims) / nv;
    // SAFETY: both tensors are dense buffers of `len` elements with the same strides (dq's
    // layout), multiples of `nv` (`vector_width`); the kernel guards `i < vectors`.
    unsafe {
        flash_dq_convert::launch_unchecked::<R>(
            &dq.client,
            CubeCount::Static(vectors.div_ceil(CONVERT_THREADS) as u32, 1, 1),
            CubeDim::new_1d(CONVERT_THREADS as u32),
            nv,
            dq_acc.into_tensor_arg(),
            dq.clone().into_tensor_arg(),
            scale,
            vectors as u32,
            dq.dtype.into(),
        );
    }
}

/// Launches [`flash_dq_convert_chunks`]: `dq = dq_acc * scale` from the bulk reductions'
/// chunks of a dK/dV kernel with `warps` warps, `bq`-query blocks and `m_tiles` m-tiles per
/// warp ([`dq_chunk_pos`]).
#[allow(clippy::too_many_arguments)]
pub(super) fn launch_convert_chunks<R: CubeRuntime>(
    dq_acc: CubeTensor<R>,
    dq: &CubeTensor<R>,
    scale: f32,
    dims: Dims,
    warps: usize,
    bq: usize,
    m_tiles: usize,
) {
    // A row's columns are adjacent in the chunk only within 8 (`dq_chunk_pos`).
    let nv = vector_width(&[dq]).min(8);
    let mv = nv.min(4);
    let vectors = dq_len(dims) / nv;
    // SAFETY: `dq_acc` holds every chunk of `dq`'s (batch, head, query block), so
    // `dq_chunk_pos` stays inside it (its `nv` columns from a multiple of `nv` are adjacent
    // there, `mv`-aligned); `dq` is written through its strides (multiples of `nv`,
    // `vector_width`) for the `vectors` vectors of its shape; the kernel guards `i < vectors`.
    unsafe {
        flash_dq_convert_chunks::launch_unchecked::<R>(
            &dq.client,
            CubeCount::Static(vectors.div_ceil(CONVERT_THREADS) as u32, 1, 1),
            CubeDim::new_1d(CONVERT_THREADS as u32),
            nv,
            mv,
            dq_acc.into_tensor_arg(),
            dq.clone().into_tensor_arg(),
            scale,
            vectors as u32,
            dims.heads_q as u32,
            dims.seq as u32,
            warps,
            bq,
            dims.head_dim,
            m_tiles,
            nv,
            mv,
            dq.dtype.into(),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The atomic dK/dV kernels (8 warps, 64-query blocks) split their fused dQ into whole
    /// warps' slices of an even number of n-tiles at both head dims, with two m-tiles.
    #[test]
    fn fused_dq_slices_fit_the_atomic_kernels() {
        let (warps, bq) = (8, 64);
        for d in [64, 128] {
            let mt = dq_m_tiles(warps, bq, d);
            assert_eq!(mt, 2, "d {d}");
            let groups = bq / (16 * mt);
            assert_eq!(warps % groups, 0, "d {d}");
            let cols = d / (warps / groups);
            assert_eq!(cols % 16, 0, "d {d}: {cols} columns per warp");
        }
        assert_eq!(dq_m_tiles(8, 32, 64), 1);
    }
}
