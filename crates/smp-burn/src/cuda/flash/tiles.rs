//! Global-to-shared-memory copies of row tiles (one head's rows, all `d` columns): the
//! synchronous copy through registers, `cp.async` into padded row-major tiles (the `mma.sync`
//! kernels read them with `ldmatrix`), and `cp.async` into the 128-byte-swizzled layout the
//! warpgroup MMA reads through descriptors. Rows at or past the sequence end are zero-filled,
//! so that no product ever multiplies garbage.

use cubecl::prelude::barrier::{Barrier, copy_async};
use cubecl::prelude::*;

/// Loads this thread's share of rows `row0 .. row0 + rows` (all `d` columns) of one head into
/// registers, in vectors of `nv` elements (`base_v`, `stride_v` in vectors); rows at or past
/// `seq` read as zeros.
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_tile_regs<F: Float, N: Size>(
    src: &Tensor<Vector<F, N>>,
    base_v: usize,
    stride_v: usize,
    row0: usize,
    seq: usize,
    regs: &mut Array<Vector<F, N>>,
    #[comptime] rows: usize,
    #[comptime] d: usize,
    #[comptime] nv: usize,
    #[comptime] nthreads: usize,
) {
    let t = UNIT_POS as usize;
    let dv = comptime!(d / nv);
    let per_thread = comptime!(rows * d / nv / nthreads);
    #[unroll]
    for i in 0..per_thread {
        let e = i * nthreads + t;
        let r = e / dv;
        let cv = e % dv;
        let gr = row0 + r;
        let mut val = Vector::new(F::new(0.0));
        if gr < seq {
            val = src[base_v + gr * stride_v + cv];
        }
        regs[i] = val;
    }
}

/// Writes registers filled by [`load_tile_regs`] (same `rows`, `d`, `nv`, `nthreads`) into a
/// shared tile of row pitch `ld` elements.
#[cube]
fn store_tile_regs<F: Float, N: Size>(
    regs: &Array<Vector<F, N>>,
    dst: &mut SharedMemory<Vector<F, N>>,
    #[comptime] rows: usize,
    #[comptime] d: usize,
    #[comptime] ld: usize,
    #[comptime] nv: usize,
    #[comptime] nthreads: usize,
) {
    let t = UNIT_POS as usize;
    let dv = comptime!(d / nv);
    let ldv = comptime!(ld / nv);
    let per_thread = comptime!(rows * d / nv / nthreads);
    #[unroll]
    for i in 0..per_thread {
        let e = i * nthreads + t;
        dst[(e / dv) * ldv + e % dv] = regs[i];
    }
}

/// [`load_tile_regs`] then [`store_tile_regs`]: a synchronous copy of a tile into shared memory
/// (the K/V rows a dK/dV cube keeps for its whole life, and the fragment probe's inputs).
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn stage_tile<F: Float, N: Size>(
    src: &Tensor<Vector<F, N>>,
    base_v: usize,
    stride_v: usize,
    row0: usize,
    seq: usize,
    dst: &mut SharedMemory<Vector<F, N>>,
    #[comptime] rows: usize,
    #[comptime] d: usize,
    #[comptime] ld: usize,
    #[comptime] nv: usize,
    #[comptime] nthreads: usize,
) {
    let mut regs = Array::<Vector<F, N>>::new(comptime!(rows * d / nv / nthreads));
    load_tile_regs::<F, N>(
        src, base_v, stride_v, row0, seq, &mut regs, rows, d, nv, nthreads,
    );
    store_tile_regs::<F, N>(&regs, dst, rows, d, ld, nv, nthreads);
}

/// [`stage_tile`] through `cp.async`: issues the copies of rows `row0 .. row0 + rows` (all `d`
/// columns, `nv` elements per copy, `2 * nv` bytes) of one head into rows `dst_row0 ..` of a
/// shared tile of pitch `ld` elements, and zero-fills rows at or past `seq` with ordinary
/// stores. Nothing waits here: the data is there after the caller's
/// `commit_copy_async` + `arrive_and_wait` on a cube barrier (which also orders the stores).
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn copy_tile_async<F: Float, N: Size>(
    src: &Tensor<Vector<F, N>>,
    base_v: usize,
    stride_v: usize,
    row0: usize,
    seq: usize,
    dst: &mut SharedMemory<Vector<F, N>>,
    dst_row0: usize,
    #[comptime] rows: usize,
    #[comptime] d: usize,
    #[comptime] ld: usize,
    #[comptime] nv: usize,
    #[comptime] nthreads: usize,
) {
    let t = UNIT_POS as usize;
    let dv = comptime!(d / nv);
    let ldv = comptime!(ld / nv);
    let per_thread = comptime!(rows * d / nv / nthreads);
    let width = comptime!(nv as u32);
    #[unroll]
    for i in 0..per_thread {
        let e = i * nthreads + t;
        let r = e / dv;
        let cv = e % dv;
        let gr = row0 + r;
        let di = (dst_row0 + r) * ldv + cv;
        if gr < seq {
            let si = base_v + gr * stride_v + cv;
            copy_async::<Vector<F, N>>(
                &src.slice(si, si + 1),
                &mut dst.slice_mut(di, di + 1),
                width,
            );
        } else {
            dst[di] = Vector::new(F::new(0.0));
        }
    }
}

/// [`copy_tile_async`] of the same key rows of K and V (one head each) into their shared
/// tiles: the forward and the split dQ kernel stage both for every key block.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn copy_kv_async<F: Float, N: Size>(
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    k_base: usize,
    v_base: usize,
    k_stride: usize,
    v_stride: usize,
    row0: usize,
    seq: usize,
    ks: &mut SharedMemory<Vector<F, N>>,
    vs: &mut SharedMemory<Vector<F, N>>,
    dst_row0: usize,
    #[comptime] rows: usize,
    #[comptime] d: usize,
    #[comptime] ld: usize,
    #[comptime] nv: usize,
    #[comptime] nthreads: usize,
) {
    copy_tile_async::<F, N>(
        k, k_base, k_stride, row0, seq, ks, dst_row0, rows, d, ld, nv, nthreads,
    );
    copy_tile_async::<F, N>(
        v, v_base, v_stride, row0, seq, vs, dst_row0, rows, d, ld, nv, nthreads,
    );
}

/// Position, in 16-byte chunks, of chunk `c` of row `r` of a `rows`-row tile in the layout
/// `wgmma` reads with the 128-byte swizzle ([`super::wgmma::SWIZZLE_128B`]): 64-element
/// column blocks one after the other (`rows` 128-byte rows each), and within a row the chunk
/// index XOR the row's position in its 8-row atom. Why swizzled: a warpgroup's tensor cores
/// read 8 rows of one 16-byte column at a time, which this spreads over all 32 banks.
#[cube]
pub(super) fn sw128_chunk(r: usize, c: usize, #[comptime] rows: usize) -> usize {
    (c / 8) * comptime!(rows * 8) + r * 8 + ((c % 8) ^ (r % 8))
}

/// Rows `row0 .. row0 + rows` of head `h` of batch `b` of the `[B, H, S, D]` tensor behind
/// `map` (a tiled tensor map of `[1, 1, rows, 64]` boxes with the 128-byte swizzle) into the
/// tile at chunk `dst0` of `dst`, in the layout of [`sw128_chunk`]: one bulk tensor copy per
/// 64-column block, completing on `bar` (which must expect `rows * d * 2` bytes). Rows past the
/// tensor's end arrive as zeros. One thread issues it.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn tma_tile<F: Float, N: Size>(
    map: &TensorMap<F, Tiled>,
    bar: &Barrier,
    dst: &mut SharedMemory<Vector<F, N>>,
    dst0: usize,
    b: usize,
    h: usize,
    row0: usize,
    #[comptime] rows: usize,
    #[comptime] d: usize,
) {
    #[unroll]
    for blk in 0..comptime!(d / 64) {
        let off = dst0 + blk * comptime!(rows * 8);
        let mut tile = dst.slice_mut(off, off + comptime!(rows * 8));
        bar.tma_load_4d::<F, Vector<F, N>>(
            map,
            &mut tile,
            b as i32,
            h as i32,
            row0 as i32,
            (blk * 64) as i32,
        );
    }
}

/// Two tiles of `rows` rows at `row0` of head `h`, batch `b` ([`tma_tile`] each: K and V, or Q
/// and dO) into chunk `dst0` of `dst_a` and `dst_b`, and the leader's arrival on `bar`
/// expecting both tiles' bytes, so that `bar` completes once both have landed. One thread
/// issues it.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn tma_tile_pair<F: Float, N: Size>(
    map_a: &TensorMap<F, Tiled>,
    map_b: &TensorMap<F, Tiled>,
    bar: &Barrier,
    dst_a: &mut SharedMemory<Vector<F, N>>,
    dst_b: &mut SharedMemory<Vector<F, N>>,
    dst0: usize,
    b: usize,
    h: usize,
    row0: usize,
    #[comptime] rows: usize,
    #[comptime] d: usize,
) {
    tma_tile::<F, N>(map_a, bar, dst_a, dst0, b, h, row0, rows, d);
    tma_tile::<F, N>(map_b, bar, dst_b, dst0, b, h, row0, rows, d);
    let _pair = bar.arrive_and_expect_tx(1u32, comptime!((2 * rows * d * 2) as u32));
}
