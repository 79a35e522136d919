//! RMSNorm forward and backward, and the autodiff op that saves `x` and the f32 inverse rms.
//!
//! The forward is one cube per row. The backward's cubes each own a block of rows and the grid
//! is sized to about one wave, so each cube runs many rows and its partial `dweight` row (f32)
//! is short; a column sum then adds the partial rows in a fixed order. Two backward kernels
//! share the formulas and their order of operations: [`rms_norm_bwd_staged_kernel`] brings the
//! rows into shared memory by `cp.async` (sm_80 and later, rows up to 8,192 bf16 or 4,096
//! f32), [`rms_norm_bwd_pipelined_kernel`] keeps them in registers (every other case).
//!
//! On an H200 at the 7B and 13B widths the staged backward with its column sum reads and
//! writes 3.1-3.4 TB/s as training calls it (adding into the residual stream's gradient).

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::{DType, Shape, Tensor as BurnTensor, TensorPrimitive};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::ir::{BarrierLevel, OpaqueType};
use cubecl::prelude::barrier::{Barrier, copy_async};
use cubecl::prelude::*;

use super::{
    Cube, check_float, check_u32, cube_sum, plane_total_to, planes_total, vector_width, wrap,
};
use crate::cuda::CudaCube;
use crate::cuda::gemm::CudaAutodiff;

/// Vectors each thread of the forward keeps in registers, when the row is long enough: two
/// 16-byte loads in flight per thread.
const ROW_VECTORS_PER_THREAD: usize = 2;
/// Most threads per cube of the row kernels (CUDA's limit).
const ROW_MAX_THREADS: usize = 1024;
/// Most vectors per thread of the row kernels; with scalar loads this allows rows of 16384.
const ROW_MAX_VECTORS_PER_THREAD: usize = 16;
/// Most threads per cube of the pipelined backward while every thread keeps at most eight
/// vectors of a row: 512 threads of one 16-byte vector cover a bf16 row of 4096, and two such
/// cubes fit an SM's registers, so the grid is sized for two cubes per SM. In a sweep on an
/// H200 (64-512 threads, 2-24 cubes per SM) no other shape beat it by more than noise.
const PIPELINED_NORM_THREADS: usize = 512;
/// Column vectors per cube of the column sum: 8 x 16 bytes, one 128-byte line per row.
const COLSUM_LANES: usize = 8;
/// Row groups per cube of the column sum (`8 * 32` = 256 threads): 32 independent 16-byte
/// loads per column line in flight, so the partial sums cost about one memory latency.
const COLSUM_GROUPS: usize = 32;
/// SMs assumed when the runtime does not report them (an H100/H200 has 132).
const DEFAULT_SMS: usize = 132;

// ------------------------------------------------------------------------------------------
// Device side
// ------------------------------------------------------------------------------------------

/// Sum of the lanes of an f32 vector.
#[cube]
fn lane_sum<N: Size>(v: Vector<f32, N>, #[comptime] nv: usize) -> f32 {
    let mut s = f32::new(0.0);
    #[unroll]
    for k in 0..nv {
        s += v[k];
    }
    s
}

/// RMSNorm forward. Cube = one row of `x: [rows, hidden]` (contiguous, read in vectors of `nv`
/// elements; `row_vectors = hidden / nv`); thread `t` owns vectors `t, t + threads, ...`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn rms_norm_fwd_kernel<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    weight: &Tensor<Vector<F, N>>,
    y: &mut Tensor<Vector<F, N>>,
    inv_rms: &mut Tensor<f32>,
    rows: u32,
    row_vectors: u32,
    hidden: f32,
    eps: f32,
    #[comptime] nv: usize,
    #[comptime] vpt: usize,
    #[comptime] threads: usize,
    #[define(F)] _dtype: StorageType,
) {
    let row = CUBE_POS;
    if row >= rows as usize {
        terminate!();
    }
    let t = UNIT_POS as usize;
    let hv = row_vectors as usize;
    let base = row * hv;
    let mut scratch = SharedMemory::<f32>::new(threads);
    let mut xs = Array::<Vector<f32, N>>::new(vpt);
    let mut sq = f32::new(0.0);
    #[unroll]
    for i in 0..vpt {
        let c = i * threads + t;
        let mut v = Vector::<f32, N>::new(f32::new(0.0));
        if c < hv {
            v = Vector::<f32, N>::cast_from(x[base + c]);
        }
        xs[i] = v;
        sq += lane_sum::<N>(v * v, nv);
    }
    let total = cube_sum(sq, &mut scratch);
    // As the reference: 1 / sqrt(mean + eps), all in f32.
    let r = f32::new(1.0) / (total / hidden + eps).sqrt();
    let rv = Vector::<f32, N>::new(r);
    #[unroll]
    for i in 0..vpt {
        let c = i * threads + t;
        if c < hv {
            // The normalized row is rounded to the input dtype before the weight, as the
            // reference's `cast(dtype) * weight`.
            let n = Vector::<f32, N>::cast_from(Vector::<F, N>::cast_from(xs[i] * rv));
            let w = Vector::<f32, N>::cast_from(weight[c]);
            y[base + c] = Vector::<F, N>::cast_from(n * w);
        }
    }
    if t == 0 {
        inv_rms[row] = r;
    }
}

/// As [`cube_sum`], with one barrier instead of two: `scratch` holds two halves of `threads`
/// slots and consecutive calls alternate between them (`half` = 0, 1, 0, ...). A half is written
/// again only two calls later, after every unit has passed the barrier of the call in between,
/// which each unit reaches only after it has read the half: no second barrier is needed.
#[cube]
fn cube_sum_alternating(
    value: f32,
    scratch: &mut SharedMemory<f32>,
    half: usize,
    #[comptime] threads: usize,
) -> f32 {
    let base = half * threads;
    plane_total_to(value, scratch, base);
    sync_cube();
    planes_total(scratch, base)
}

/// RMSNorm backward with the rows in registers. Cube = a block of `rows_per_cube` rows;
/// thread `t` owns vectors `t, t + threads, ...` of each row. For each row, with `r` the saved
/// inverse rms, `dn = dy * weight` and `dot = sum(dn * x)` over the row:
/// `dx = r * dn - r^3 * x * dot / hidden` (plus the gradient already in `dx` with
/// `accumulate`); with `want_dw`, `partial[cube, :]` = the block's sum of `dy * round(x * r)`.
///
/// The row loop is software-pipelined: a thread issues the loads of row `i + 1` (`x`, `dy`,
/// `inv_rms`, raw in registers) right after it has taken row `i` out of those registers, so
/// they are in flight while row `i` is reduced (one barrier, [`cube_sum_alternating`]) and
/// stored. Why: a loop that loads, reduces and stores one row before it issues the next row's
/// loads keeps loads in flight only part of the time (1.35 TB/s on an H200). The loads come
/// before the stores in program order, so the compiler needs no aliasing proof to overlap
/// them. The current row stays raw (input dtype) across the reduction and is converted again
/// after it, and the weight and the partial `dweight` row live in shared memory: both to save
/// registers (64-87 per thread instead of 74-96, 20-30 % faster at h 2048 and 5120).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn rms_norm_bwd_pipelined_kernel<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    weight: &Tensor<Vector<F, N>>,
    dy: &Tensor<Vector<F, N>>,
    inv_rms: &Tensor<f32>,
    dx: &mut Tensor<Vector<F, N>>,
    partial: &mut Tensor<f32>,
    rows: u32,
    row_vectors: u32,
    hidden: f32,
    rows_per_cube: u32,
    #[comptime] nv: usize,
    #[comptime] vpt: usize,
    #[comptime] threads: usize,
    #[comptime] want_dw: bool,
    #[comptime] accumulate: bool,
    #[define(F)] _dtype: StorageType,
) {
    let blk = CUBE_POS;
    let r0 = blk * rows_per_cube as usize;
    // Cubes past the last block (when the grid rounds up) have no rows and no partial row.
    if r0 >= rows as usize {
        terminate!();
    }
    let mut r1 = r0 + rows_per_cube as usize;
    if r1 > rows as usize {
        r1 = rows as usize;
    }
    let t = UNIT_POS as usize;
    let hv = row_vectors as usize;
    let padded = comptime!(vpt * threads);
    let mut scratch = SharedMemory::<f32>::new(comptime!(2 * threads));
    // Each thread only touches its own slots of these, so they need no barrier.
    let mut wsm = SharedMemory::<Vector<f32, N>>::new(padded);
    let mut accm = SharedMemory::<Vector<f32, N>>::new(padded);
    // Raw (input dtype) vectors of the next row, loaded one iteration ahead (with
    // `accumulate`, also the gradient already in `dx`, which this row's result adds to), and
    // of the current row.
    let mut xn = Array::<Vector<F, N>>::new(vpt);
    let mut gn = Array::<Vector<F, N>>::new(vpt);
    let mut an = Array::<Vector<F, N>>::new(vpt);
    let mut xc = Array::<Vector<F, N>>::new(vpt);
    let mut gc = Array::<Vector<F, N>>::new(vpt);
    let mut ac = Array::<Vector<F, N>>::new(vpt);
    #[unroll]
    for i in 0..vpt {
        let c = i * threads + t;
        let mut w = Vector::<f32, N>::new(f32::new(0.0));
        if c < hv {
            w = Vector::<f32, N>::cast_from(weight[c]);
            xn[i] = x[r0 * hv + c];
            gn[i] = dy[r0 * hv + c];
            if comptime!(accumulate) {
                an[i] = dx[r0 * hv + c];
            }
        }
        wsm[c] = w;
        accm[c] = Vector::<f32, N>::new(f32::new(0.0));
    }
    let mut rn = inv_rms[r0];
    for row in r0..r1 {
        let base = row * hv;
        let r = rn;
        let rv = Vector::<f32, N>::new(r);
        #[unroll]
        for i in 0..vpt {
            xc[i] = xn[i];
            gc[i] = gn[i];
            if comptime!(accumulate) {
                ac[i] = an[i];
            }
        }
        // Issue the next row's loads now; they complete while this row is reduced and stored.
        let next = row + 1;
        if next < r1 {
            let nb = next * hv;
            #[unroll]
            for i in 0..vpt {
                let c = i * threads + t;
                if c < hv {
                    xn[i] = x[nb + c];
                    gn[i] = dy[nb + c];
                    if comptime!(accumulate) {
                        an[i] = dx[nb + c];
                    }
                }
            }
            rn = inv_rms[next];
        }
        let mut dot = f32::new(0.0);
        #[unroll]
        for i in 0..vpt {
            let c = i * threads + t;
            // Vectors past the row end hold stale or unset registers: skip them.
            if c < hv {
                let xv = Vector::<f32, N>::cast_from(xc[i]);
                let g = Vector::<f32, N>::cast_from(gc[i]);
                if comptime!(want_dw) {
                    // The weight multiplied the normalized row as rounded in the forward.
                    let n = Vector::<f32, N>::cast_from(Vector::<F, N>::cast_from(xv * rv));
                    accm[c] += g * n;
                }
                dot += lane_sum::<N>(g * wsm[c] * xv, nv);
            }
        }
        let total = cube_sum_alternating(dot, &mut scratch, row % 2, threads);
        let coef = Vector::<f32, N>::new(r * r * r * total / hidden);
        #[unroll]
        for i in 0..vpt {
            let c = i * threads + t;
            if c < hv {
                let xv = Vector::<f32, N>::cast_from(xc[i]);
                let g = Vector::<f32, N>::cast_from(gc[i]);
                let mut v = (g * wsm[c]) * rv - xv * coef;
                if comptime!(accumulate) {
                    v += Vector::<f32, N>::cast_from(ac[i]);
                }
                dx[base + c] = Vector::<F, N>::cast_from(v);
            }
        }
    }
    if comptime!(want_dw) {
        #[unroll]
        for i in 0..vpt {
            let c = i * threads + t;
            if c < hv {
                write_partial_vector::<N>(accm[c], partial, blk, hv, c, nv);
            }
        }
    }
}

/// Writes vector `c` of a cube's partial `dweight` row to row `blk` of `partial` (f32,
/// `hv * nv` per row), for the column sum.
#[cube]
fn write_partial_vector<N: Size>(
    a: Vector<f32, N>,
    partial: &mut Tensor<f32>,
    blk: usize,
    hv: usize,
    c: usize,
    #[comptime] nv: usize,
) {
    let out = (blk * hv + c) * nv;
    #[unroll]
    for k in 0..nv {
        partial[out + k] = a[k];
    }
}

/// Issues the `cp.async` copies of rows `row0 .. row0 + group` (those below `r1`) of `src`
/// into slots `dst0 + j * padded ..` of `dst`: thread `t` copies vectors `t, t + threads, ...`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn norm_rows_async<F: Float, N: Size>(
    src: &Tensor<Vector<F, N>>,
    dst: &mut SharedMemory<Vector<F, N>>,
    row0: usize,
    r1: usize,
    hv: usize,
    dst0: usize,
    #[comptime] group: usize,
    #[comptime] vpt: usize,
    #[comptime] threads: usize,
    #[comptime] nv: usize,
) {
    let t = UNIT_POS as usize;
    let padded = comptime!(vpt * threads);
    let width = comptime!(nv as u32);
    #[unroll]
    for j in 0..group {
        let row = row0 + j;
        if row < r1 {
            #[unroll]
            for i in 0..vpt {
                let c = i * threads + t;
                if c < hv {
                    let si = row * hv + c;
                    let di = dst0 + j * padded + c;
                    copy_async::<Vector<F, N>>(
                        &src.slice(si, si + 1),
                        &mut dst.slice_mut(di, di + 1),
                        width,
                    );
                }
            }
        }
    }
}

/// RMSNorm backward with the rows staged in shared memory: the formulas of
/// [`rms_norm_bwd_pipelined_kernel`] in the same order (so bitwise its results where both give
/// a thread the same vectors of a row), with the rows brought in by `cp.async`, `group` rows
/// per stage and two stages, instead of through registers. Cube = a block of `rows_per_cube`
/// rows as there.
///
/// Why: the register-pipelined kernel holds each byte in flight in a register, and CubeCL's
/// generated code needs 64-90 registers for it, so an SM keeps only about 32 KB of loads in
/// flight and the kernel reads at 1.2-1.8 TB/s on an H200. Here the next stage's rows are in
/// flight in shared memory, tracked by one cube barrier, while the current stage is reduced
/// and stored. The weight and the partial `dweight` row live in registers (at most four
/// vectors per thread, so 64 f32 at most) and the stage's rows are reduced together behind one
/// barrier: shared memory then holds only the stages, so an SM runs several cubes. (With both
/// f32 rows in shared memory, 32 KB per cube at h 4096, an SM ran two cubes of four warps and
/// the kernel was latency-bound at 12.5 % occupancy.)
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn rms_norm_bwd_staged_kernel<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    weight: &Tensor<Vector<F, N>>,
    dy: &Tensor<Vector<F, N>>,
    inv_rms: &Tensor<f32>,
    dx: &mut Tensor<Vector<F, N>>,
    partial: &mut Tensor<f32>,
    rows: u32,
    row_vectors: u32,
    hidden: f32,
    rows_per_cube: u32,
    #[comptime] nv: usize,
    #[comptime] vpt: usize,
    #[comptime] threads: usize,
    #[comptime] group: usize,
    #[comptime] want_dw: bool,
    #[comptime] accumulate: bool,
    #[define(F)] _dtype: StorageType,
) {
    let blk = CUBE_POS;
    let r0 = blk * rows_per_cube as usize;
    if r0 >= rows as usize {
        terminate!();
    }
    let mut r1 = r0 + rows_per_cube as usize;
    if r1 > rows as usize {
        r1 = rows as usize;
    }
    let t = UNIT_POS as usize;
    let hv = row_vectors as usize;
    let padded = comptime!(vpt * threads);
    let stage_slots = comptime!(group * vpt * threads);
    // One slot per (row of the stage, plane); a single buffer suffices because every unit
    // reads a stage's totals before it reaches the next stage's barrier.
    let mut scratch = SharedMemory::<f32>::new(comptime!(group * threads));
    let mut xb = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(2 * stage_slots), 128usize);
    let mut gb = SharedMemory::<Vector<F, N>>::new_aligned(comptime!(2 * stage_slots), 128usize);
    let mut ab = SharedMemory::<Vector<F, N>>::new_aligned(
        comptime!(if accumulate { 2 * stage_slots } else { 1 }),
        128usize,
    );
    // One phase per stage; created before any copy is issued.
    let bar = Barrier::shared(CUBE_DIM, UNIT_POS == 0);
    norm_rows_async::<F, N>(x, &mut xb, r0, r1, hv, 0usize, group, vpt, threads, nv);
    norm_rows_async::<F, N>(dy, &mut gb, r0, r1, hv, 0usize, group, vpt, threads, nv);
    if comptime!(accumulate) {
        norm_rows_async::<F, N>(dx, &mut ab, r0, r1, hv, 0usize, group, vpt, threads, nv);
    }
    let mut wr = Array::<Vector<f32, N>>::new(vpt);
    let mut acc = Array::<Vector<f32, N>>::new(vpt);
    #[unroll]
    for i in 0..vpt {
        let c = i * threads + t;
        let mut w = Vector::<f32, N>::new(f32::new(0.0));
        if c < hv {
            w = Vector::<f32, N>::cast_from(weight[c]);
        }
        wr[i] = w;
        acc[i] = Vector::<f32, N>::new(f32::new(0.0));
    }
    // 1 / rms of the next stage's rows, loaded a stage ahead like the rows themselves.
    let mut rn = Array::<f32>::new(group);
    let mut rc = Array::<f32>::new(group);
    let mut dots = Array::<f32>::new(group);
    #[unroll]
    for j in 0..group {
        rn[j] = f32::new(0.0);
        if r0 + j < r1 {
            rn[j] = inv_rms[r0 + j];
        }
    }
    let n_groups = (r1 - r0 + group - 1) / group;
    for k in 0..n_groups {
        let g0 = r0 + k * group;
        let cur = (k % 2) * stage_slots;
        bar.commit_copy_async();
        bar.arrive_and_wait();
        #[unroll]
        for j in 0..group {
            rc[j] = rn[j];
        }
        // Every unit has passed the wait above, so none still reads the other stage.
        if k + 1 < n_groups {
            let g1 = g0 + group;
            let nxt = stage_slots - cur;
            norm_rows_async::<F, N>(x, &mut xb, g1, r1, hv, nxt, group, vpt, threads, nv);
            norm_rows_async::<F, N>(dy, &mut gb, g1, r1, hv, nxt, group, vpt, threads, nv);
            if comptime!(accumulate) {
                norm_rows_async::<F, N>(dx, &mut ab, g1, r1, hv, nxt, group, vpt, threads, nv);
            }
            #[unroll]
            for j in 0..group {
                if g1 + j < r1 {
                    rn[j] = inv_rms[g1 + j];
                }
            }
        }
        // Pass 1 over the stage's rows: the partial dweight and each row's dot product.
        #[unroll]
        for j in 0..group {
            let mut dot = f32::new(0.0);
            if g0 + j < r1 {
                let rv = Vector::<f32, N>::new(rc[j]);
                let sb = cur + j * padded;
                #[unroll]
                for i in 0..vpt {
                    let c = i * threads + t;
                    if c < hv {
                        let xv = Vector::<f32, N>::cast_from(xb[sb + c]);
                        let g = Vector::<f32, N>::cast_from(gb[sb + c]);
                        if comptime!(want_dw) {
                            // The weight multiplied the normalized row as rounded in the
                            // forward.
                            let n = Vector::<f32, N>::cast_from(Vector::<F, N>::cast_from(xv * rv));
                            acc[i] += g * n;
                        }
                        dot += lane_sum::<N>(g * wr[i] * xv, nv);
                    }
                }
            }
            dots[j] = dot;
        }
        cube_sums(&mut dots, &mut scratch, group, threads);
        // Pass 2: dx.
        #[unroll]
        for j in 0..group {
            let row = g0 + j;
            if row < r1 {
                let r = rc[j];
                let rv = Vector::<f32, N>::new(r);
                let coef = Vector::<f32, N>::new(r * r * r * dots[j] / hidden);
                let sb = cur + j * padded;
                #[unroll]
                for i in 0..vpt {
                    let c = i * threads + t;
                    if c < hv {
                        let xv = Vector::<f32, N>::cast_from(xb[sb + c]);
                        let g = Vector::<f32, N>::cast_from(gb[sb + c]);
                        let mut v = (g * wr[i]) * rv - xv * coef;
                        if comptime!(accumulate) {
                            v += Vector::<f32, N>::cast_from(ab[sb + c]);
                        }
                        dx[row * hv + c] = Vector::<F, N>::cast_from(v);
                    }
                }
            }
        }
    }
    if comptime!(want_dw) {
        #[unroll]
        for i in 0..vpt {
            let c = i * threads + t;
            if c < hv {
                write_partial_vector::<N>(acc[i], partial, blk, hv, c, nv);
            }
        }
    }
}

/// Replaces each of `values[0..count]` (one per unit of the cube) by its sum over the cube,
/// behind one barrier, planes summed in the order of [`cube_sum_alternating`] (so bitwise its
/// results). `scratch` holds `count * threads` f32; the caller must not reuse it before every
/// unit has read the sums (a later barrier).
#[cube]
fn cube_sums(
    values: &mut Array<f32>,
    scratch: &mut SharedMemory<f32>,
    #[comptime] count: usize,
    #[comptime] threads: usize,
) {
    #[unroll]
    for j in 0..count {
        plane_total_to(values[j], scratch, j * threads);
    }
    sync_cube();
    #[unroll]
    for j in 0..count {
        values[j] = planes_total(scratch, j * threads);
    }
}

/// `out[c] = sum_b partial[b, c]` in a fixed order, reading `partial` in vectors of `mv` f32
/// (`col_vectors = cols / mv`). Cube = `lanes` consecutive column vectors x `groups` row groups
/// (thread `t`: vector `t % lanes`, group `t / lanes`); group `g` adds rows
/// `g, g + groups, ...` four at a time, then group 0 adds the groups' sums in order.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn column_sum_kernel<F: Float, M: Size>(
    partial: &Tensor<Vector<f32, M>>,
    out: &mut Tensor<F>,
    blocks: u32,
    col_vectors: u32,
    #[comptime] mv: usize,
    #[comptime] lanes: usize,
    #[comptime] groups: usize,
    #[define(F)] _dtype: StorageType,
) {
    let t = UNIT_POS as usize;
    let lane = t % lanes;
    let g = t / lanes;
    let c = CUBE_POS * lanes + lane;
    let nb = blocks as usize;
    let nc = col_vectors as usize;
    let mut sums = SharedMemory::<f32>::new(comptime!(lanes * groups * mv));
    let mut acc = Vector::<f32, M>::new(f32::new(0.0));
    if c < nc {
        // Rows g + k * groups for k < steps.
        let steps = (nb + groups - 1 - g) / groups;
        let quads = steps / 4;
        let mut a0 = Vector::<f32, M>::new(f32::new(0.0));
        let mut a1 = Vector::<f32, M>::new(f32::new(0.0));
        let mut a2 = Vector::<f32, M>::new(f32::new(0.0));
        let mut a3 = Vector::<f32, M>::new(f32::new(0.0));
        for q in 0..quads {
            let b = g + 4 * q * groups;
            a0 += partial[b * nc + c];
            a1 += partial[(b + groups) * nc + c];
            a2 += partial[(b + 2 * groups) * nc + c];
            a3 += partial[(b + 3 * groups) * nc + c];
        }
        for k in quads * 4..steps {
            a0 += partial[(g + k * groups) * nc + c];
        }
        acc = (a0 + a1) + (a2 + a3);
    }
    let slot = (g * lanes + lane) * mv;
    #[unroll]
    for l in 0..mv {
        sums[slot + l] = acc[l];
    }
    sync_cube();
    if g == 0 && c < nc {
        #[unroll]
        for l in 0..mv {
            let mut total = f32::new(0.0);
            #[unroll]
            for i in 0..groups {
                total += sums[(i * lanes + lane) * mv + l];
            }
            out[c * mv + l] = F::cast_from(total);
        }
    }
}

// ------------------------------------------------------------------------------------------
// Host side
// ------------------------------------------------------------------------------------------

/// Threads per cube and vectors per thread of the forward for rows of `row_vectors` vectors.
fn row_layout(row_vectors: usize) -> (usize, usize) {
    let threads = row_vectors
        .div_ceil(ROW_VECTORS_PER_THREAD)
        .next_multiple_of(32)
        .clamp(32, ROW_MAX_THREADS);
    (threads, row_vectors.div_ceil(threads))
}

/// Whether the RMSNorm kernels take rows of `hidden` elements (whatever the vector width).
pub fn rms_norm_supports(hidden: usize) -> bool {
    hidden > 0 && hidden.div_ceil(ROW_MAX_THREADS) <= ROW_MAX_VECTORS_PER_THREAD
}

/// A launch grid of `n` cubes (numbered by `CUBE_POS`) within CUDA's 65535 limit on y.
fn cubes(n: usize) -> CubeCount {
    let x = n.clamp(1, 65_535);
    CubeCount::Static(x as u32, n.div_ceil(x) as u32, 1)
}

/// Threads per cube and vectors per thread of the pipelined RMSNorm backward: as few vectors
/// per thread as [`PIPELINED_NORM_THREADS`] threads allow (one for bf16 rows of up to 4096), at
/// most eight; longer rows (scalar loads of odd sizes) take up to [`ROW_MAX_THREADS`] threads,
/// and at most 16 vectors each, as [`rms_norm_supports`] guarantees.
fn pipelined_norm_layout(row_vectors: usize) -> (usize, usize) {
    let max = if row_vectors > 8 * PIPELINED_NORM_THREADS {
        ROW_MAX_THREADS
    } else {
        PIPELINED_NORM_THREADS
    };
    let threads = row_vectors
        .div_ceil(row_vectors.div_ceil(max))
        .next_multiple_of(32)
        .clamp(32, max);
    (threads, row_vectors.div_ceil(threads))
}

/// Launch shape of [`rms_norm_bwd_staged_kernel`].
#[derive(Clone, Copy, Debug)]
struct StagedNormLayout {
    threads: usize,
    vpt: usize,
    /// Rows per `cp.async` stage.
    group: usize,
    cubes_per_sm: usize,
}

/// Threads per cube of the staged RMSNorm backward: in a sweep on an H200, 128 was the fastest
/// or within noise of it at every Llama width (256 and 512 were up to 2 % and 28 % slower).
const STAGED_NORM_THREADS: usize = 128;

/// Kilobytes of rows per stage of the staged RMSNorm backward: one row per stage at the Llama
/// widths (2,048 and wider), so shared memory admits several cubes per SM.
const STAGED_NORM_STAGE_KIB: usize = 8;

/// Bytes of rows the staged RMSNorm backward's cubes on one SM should have in flight (one
/// stage each): the cube count per SM is this over a stage's bytes, within
/// [`STAGED_NORM_CUBES_PER_SM`]. Why: on an H200 the fastest count (kernel and column sum by
/// device time) at the Llama widths, plain and adding into a gradient, was 4 cubes for 8-12 KB
/// of rows per stage, 3 for 16 KB and 2 for 20-30 KB. More cubes each add a partial dweight
/// row per SM to the column sum (about 1.5 us per 132 rows at h 4096).
const STAGED_NORM_INFLIGHT_PER_SM: usize = 48 * 1024;

/// Cubes per SM of the staged RMSNorm backward, at least and at most: at 4 the kernel's
/// 118-124 registers at 128 threads fill the register file.
const STAGED_NORM_CUBES_PER_SM: std::ops::RangeInclusive<usize> = 2..=4;

/// Vectors of a row one thread of the staged RMSNorm backward owns, at most: the weight and
/// the partial dweight take `2 * nv` f32 registers per vector.
const STAGED_NORM_MAX_VPT: usize = 4;

/// Threads per cube of the staged RMSNorm backward, at most: CubeCL bounds a kernel's
/// registers by its cube size, and at 256 threads a unit may still use 255, which the
/// register-held rows need. Longer rows (over 8,192 bf16 or 4,096 f32) take the pipelined
/// kernel.
const STAGED_NORM_MAX_THREADS: usize = 256;

/// Shared memory one SM offers the cubes of the staged RMSNorm backward (an H100/H200 has
/// 228 KB; a little is reserved per cube).
const STAGED_NORM_SMEM_PER_SM: usize = 220 * 1024;

/// Whether the device runs the staged RMSNorm backward: `cp.async` and cube-level barriers
/// (CUDA sm_80 and later).
fn staged_norm_supported<R: CubeRuntime>(client: &ComputeClient<R>) -> bool {
    let features = client.features();
    features.copy_async && features.supports_type(OpaqueType::Barrier(BarrierLevel::Cube))
}

/// The staged RMSNorm backward's launch shape for rows of `row_vectors` vectors of `nv`
/// elements of `elem_bytes`, or `None` for a row too long for it (then the pipelined kernel
/// runs): [`STAGED_NORM_THREADS`] threads (more where a thread would hold over
/// [`STAGED_NORM_MAX_VPT`] vectors), about [`STAGED_NORM_STAGE_KIB`] KB of rows per stage, and
/// [`STAGED_NORM_INFLIGHT_PER_SM`] over a stage's bytes cubes per SM (within
/// [`STAGED_NORM_CUBES_PER_SM`] and what shared memory allows).
fn staged_norm_layout(
    row_vectors: usize,
    nv: usize,
    elem_bytes: usize,
    accumulate: bool,
) -> Option<StagedNormLayout> {
    if row_vectors == 0 {
        return None;
    }
    // At most `STAGED_NORM_MAX_VPT` vectors per thread (the row loops are unrolled and the
    // thread's weight and dweight slices live in registers), at most a row's worth.
    let threads = STAGED_NORM_THREADS
        .max(
            row_vectors
                .div_ceil(STAGED_NORM_MAX_VPT)
                .next_multiple_of(32),
        )
        .min(row_vectors.next_multiple_of(32));
    if threads > STAGED_NORM_MAX_THREADS {
        return None;
    }
    let vpt = row_vectors.div_ceil(threads);
    let streams = if accumulate { 3 } else { 2 };
    let row_bytes = vpt * threads * nv * elem_bytes;
    let group = (STAGED_NORM_STAGE_KIB * 1024 / (row_bytes * streams)).clamp(1, 8);
    let max_cubes = (STAGED_NORM_INFLIGHT_PER_SM / (group * row_bytes * streams)).clamp(
        *STAGED_NORM_CUBES_PER_SM.start(),
        *STAGED_NORM_CUBES_PER_SM.end(),
    );
    let cubes_per_sm = (STAGED_NORM_SMEM_PER_SM
        / staged_norm_smem(threads, vpt, group, nv, elem_bytes, accumulate))
    .min(max_cubes);
    (cubes_per_sm >= 1).then_some(StagedNormLayout {
        threads,
        vpt,
        group,
        cubes_per_sm,
    })
}

/// Shared memory of one cube of the staged RMSNorm backward: two stages of `group` rows per
/// stream and the reduction scratch.
fn staged_norm_smem(
    threads: usize,
    vpt: usize,
    group: usize,
    nv: usize,
    elem_bytes: usize,
    accumulate: bool,
) -> usize {
    let streams = if accumulate { 3 } else { 2 };
    2 * group * vpt * threads * nv * elem_bytes * streams + group * threads * 4
}

/// The device's SM count, or [`DEFAULT_SMS`].
fn sm_count<R: CubeRuntime>(client: &ComputeClient<R>) -> usize {
    client
        .properties()
        .hardware
        .num_streaming_multiprocessors
        .map_or(DEFAULT_SMS, |n| (n as usize).max(1))
}

fn rms_norm_dims<R: CubeRuntime>(x: &CubeTensor<R>, weight: &CubeTensor<R>) -> (usize, usize) {
    let shape = x.meta.shape();
    assert!(
        shape.num_dims() == 2,
        "rms_norm: x must be [rows, hidden], got {shape:?}"
    );
    let (rows, hidden) = (shape[0], shape[1]);
    assert!(
        weight.meta.shape().as_slice() == [hidden],
        "rms_norm: weight {:?} does not match x {shape:?}",
        weight.meta.shape()
    );
    assert!(
        x.dtype == weight.dtype,
        "rms_norm: x ({:?}) and weight ({:?}) dtypes differ",
        x.dtype,
        weight.dtype
    );
    check_float("rms_norm", x);
    assert!(
        rms_norm_supports(hidden),
        "rms_norm: hidden size {hidden} is outside the kernels' range"
    );
    x.assert_is_on_same_device(weight);
    (rows, hidden)
}

/// RMSNorm forward of `x: [rows, hidden]` with `weight: [hidden]` (same float dtype).
///
/// Returns `(y, inv_rms)`: `y = round(x * inv_rms) * weight` in x's dtype and the per-row
/// `inv_rms = 1 / sqrt(mean(x^2) + eps)` in f32 (`[rows]`), which the backward needs.
///
/// # Panics
/// On mismatched shapes or dtypes (an autodiff op has no error channel).
pub fn rms_norm_forward<R: CubeRuntime>(
    x: CubeTensor<R>,
    weight: CubeTensor<R>,
    eps: f64,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let (rows, hidden) = rms_norm_dims(&x, &weight);
    let (x, weight) = (into_contiguous(x), into_contiguous(weight));
    check_u32("rms_norm", &x);
    let client = x.client.clone();
    let y = empty_device_contiguous_dtype(
        client.clone(),
        x.device.clone(),
        x.meta.shape().clone(),
        x.dtype,
    );
    let inv_rms = empty_device_contiguous_dtype(
        client.clone(),
        x.device.clone(),
        Shape::new([rows]),
        DType::F32,
    );
    if rows == 0 {
        return (y, inv_rms);
    }
    let nv = vector_width(&[&x, &weight, &y], hidden);
    let row_vectors = hidden / nv;
    let (threads, vpt) = row_layout(row_vectors);
    let dtype = x.dtype;
    // SAFETY: one cube per row (cubes past `rows` exit first); vector indices stay below
    // `rows * row_vectors`, the weight's `row_vectors` and `rows` for `inv_rms`; shared memory
    // holds one value per thread, at least one per plane.
    unsafe {
        rms_norm_fwd_kernel::launch_unchecked::<R>(
            &client,
            cubes(rows),
            CubeDim::new_1d(threads as u32),
            nv,
            x.into_tensor_arg(),
            weight.into_tensor_arg(),
            y.clone().into_tensor_arg(),
            inv_rms.clone().into_tensor_arg(),
            rows as u32,
            row_vectors as u32,
            hidden as f32,
            eps as f32,
            nv,
            vpt,
            threads,
            dtype.into(),
        );
    }
    (y, inv_rms)
}

/// RMSNorm backward: from the forward's `x`, `weight` and `inv_rms` and the upstream `dy`,
/// returns `dx` (x's dtype) and, when `want_dw`, `dweight` (the weight's dtype), summed over
/// rows in f32 through per-block partial sums (deterministic, no atomics). With `dx_into` (a
/// contiguous buffer shaped as `x` that no other tensor holds), `dx` is added into it, the sum
/// rounded once, and returned.
///
/// # Panics
/// As [`rms_norm_forward`].
pub fn rms_norm_backward<R: CubeRuntime>(
    x: CubeTensor<R>,
    weight: CubeTensor<R>,
    inv_rms: CubeTensor<R>,
    dy: CubeTensor<R>,
    want_dw: bool,
    dx_into: Option<CubeTensor<R>>,
) -> (CubeTensor<R>, Option<CubeTensor<R>>) {
    let (rows, hidden) = rms_norm_dims(&x, &weight);
    assert!(
        dy.meta.shape() == x.meta.shape() && dy.dtype == x.dtype,
        "rms_norm backward: dy {:?} {:?} must match x {:?} {:?}",
        dy.meta.shape(),
        dy.dtype,
        x.meta.shape(),
        x.dtype
    );
    assert!(
        inv_rms.meta.shape().as_slice() == [rows] && inv_rms.dtype == DType::F32,
        "rms_norm backward: inv_rms must be f32 [{rows}], got {:?} {:?}",
        inv_rms.meta.shape(),
        inv_rms.dtype
    );
    let (x, weight) = (into_contiguous(x), into_contiguous(weight));
    let (dy, inv_rms) = (into_contiguous(dy), into_contiguous(inv_rms));
    check_u32("rms_norm backward", &x);
    let client = x.client.clone();
    let device = x.device.clone();
    let dtype = x.dtype;
    let accumulate = dx_into.is_some();
    let dx = match dx_into {
        Some(acc) => {
            assert!(
                acc.meta.shape() == x.meta.shape() && acc.is_contiguous() && acc.dtype == dtype,
                "rms_norm backward: accumulator {:?} {:?} does not match x {:?} {dtype:?}",
                acc.meta.shape(),
                acc.dtype,
                x.meta.shape()
            );
            acc
        }
        None => empty_device_contiguous_dtype(
            client.clone(),
            device.clone(),
            x.meta.shape().clone(),
            dtype,
        ),
    };
    let alloc_dw = || {
        empty_device_contiguous_dtype(client.clone(), device.clone(), Shape::new([hidden]), dtype)
    };
    if rows == 0 {
        let dw = want_dw.then(|| {
            burn_cubecl::ops::numeric::zeros_client(
                client.clone(),
                device.clone(),
                Shape::new([hidden]),
                dtype,
            )
        });
        return (dx, dw);
    }
    let nv = vector_width(&[&x, &weight, &dy, &dx], hidden);
    let row_vectors = hidden / nv;
    let staged = staged_norm_supported(&client)
        .then(|| staged_norm_layout(row_vectors, nv, dtype.size(), accumulate))
        .flatten();
    let (threads, vpt, cubes_per_sm) = match staged {
        Some(layout) => (layout.threads, layout.vpt, layout.cubes_per_sm),
        None => {
            let (threads, vpt) = pipelined_norm_layout(row_vectors);
            // Two cubes per SM at 512 threads, more for smaller cubes.
            (threads, vpt, (1024 / threads).max(2))
        }
    };
    // About one wave of cubes, so each cube's pipeline runs over many rows and the partial
    // sums stay small (a few hundred rows of `hidden` f32).
    let target_blocks = sm_count(&client) * cubes_per_sm;
    let rows_per_cube = rows.div_ceil(target_blocks);
    let blocks = rows.div_ceil(rows_per_cube);
    let partial = empty_device_contiguous_dtype(
        client.clone(),
        device.clone(),
        if want_dw {
            Shape::new([blocks, hidden])
        } else {
            Shape::new([1])
        },
        DType::F32,
    );
    if let Some(layout) = staged {
        // SAFETY: as the pipelined launch below; the copies stay inside the rows of the cube's
        // block and inside the stage buffers (`group` rows of `vpt * threads` vectors each).
        unsafe {
            rms_norm_bwd_staged_kernel::launch_unchecked::<R>(
                &client,
                cubes(blocks),
                CubeDim::new_1d(threads as u32),
                nv,
                x.into_tensor_arg(),
                weight.into_tensor_arg(),
                dy.into_tensor_arg(),
                inv_rms.into_tensor_arg(),
                dx.clone().into_tensor_arg(),
                partial.clone().into_tensor_arg(),
                rows as u32,
                row_vectors as u32,
                hidden as f32,
                rows_per_cube as u32,
                nv,
                vpt,
                threads,
                layout.group,
                want_dw,
                accumulate,
                dtype.into(),
            );
        }
    } else {
        // SAFETY: cube `b` owns rows `b * rows_per_cube ..` clamped to `rows` (the prefetch
        // reads row `i + 1` only when it is below that clamp); vector indices stay inside the
        // row; `partial` has `blocks * hidden` elements when written; shared memory holds two
        // halves of one value per thread.
        unsafe {
            rms_norm_bwd_pipelined_kernel::launch_unchecked::<R>(
                &client,
                cubes(blocks),
                CubeDim::new_1d(threads as u32),
                nv,
                x.into_tensor_arg(),
                weight.into_tensor_arg(),
                dy.into_tensor_arg(),
                inv_rms.into_tensor_arg(),
                dx.clone().into_tensor_arg(),
                partial.clone().into_tensor_arg(),
                rows as u32,
                row_vectors as u32,
                hidden as f32,
                rows_per_cube as u32,
                nv,
                vpt,
                threads,
                want_dw,
                accumulate,
                dtype.into(),
            );
        }
    }
    let dw = want_dw.then(|| {
        let dw = alloc_dw();
        // `partial` is freshly allocated and contiguous, so any width dividing a row works.
        let mv = [4usize, 2, 1]
            .into_iter()
            .find(|w| hidden.is_multiple_of(*w))
            .unwrap_or(1);
        let col_vectors = hidden / mv;
        // SAFETY: one thread per (column vector, group); column vectors past `col_vectors`
        // only write shared memory; rows stay below `blocks`; `dw` has `col_vectors * mv`
        // elements.
        unsafe {
            column_sum_kernel::launch_unchecked::<R>(
                &client,
                CubeCount::Static(col_vectors.div_ceil(COLSUM_LANES) as u32, 1, 1),
                CubeDim::new_1d((COLSUM_LANES * COLSUM_GROUPS) as u32),
                mv,
                partial.into_tensor_arg(),
                dw.clone().into_tensor_arg(),
                blocks as u32,
                col_vectors as u32,
                mv,
                COLSUM_LANES,
                COLSUM_GROUPS,
                dtype.into(),
            );
        }
        dw
    });
    (dx, dw)
}

// ------------------------------------------------------------------------------------------
// Autodiff op on the CUDA backend
// ------------------------------------------------------------------------------------------

#[derive(Debug)]
struct RmsNormBackward;

/// `t` as `[rows, hidden]` (a metadata change for the contiguous tensors the model passes).
fn as_rows(t: Cube) -> Cube {
    let dims = t.meta.shape().as_slice().to_vec();
    let hidden = *dims.last().expect("a tensor with a last dimension");
    let rows = dims[..dims.len() - 1].iter().product::<usize>();
    burn_cubecl::ops::reshape(t, Shape::new([rows, hidden]))
}

impl Backward<CudaCube, 2> for RmsNormBackward {
    /// x (as `[rows, hidden]`), weight, per-row inverse rms (f32), x's own shape.
    type State = (Cube, Cube, Cube, Shape);

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let dy = as_rows(grads.consume::<CudaCube>(&ops.node));
        // `dx` adds into the residual stream's gradient registered so far (the skip
        // connection's, whose add ran its backward first) instead of a separate add. The op
        // takes `x` in its own shape so that this parent is the residual stream itself, not a
        // reshape of it.
        let dx_into =
            crate::cuda::accumulate::take_grad_for_accumulation(&ops, 0, grads, &dy, &ops.state.3)
                .map(as_rows);
        let [node_x, node_w] = ops.parents;
        let (x, w, inv_rms, x_shape) = ops.state;
        let (dx, dw) = rms_norm_backward(x, w, inv_rms, dy, node_w.is_some(), dx_into);
        if let Some(node) = node_x {
            grads.register::<CudaCube>(node.id, burn_cubecl::ops::reshape(dx, x_shape));
        }
        if let (Some(node), Some(dw)) = (node_w, dw) {
            grads.register::<CudaCube>(node.id, dw);
        }
    }
}

/// RMSNorm over the last dimension of `x` through the fused kernels on the autodiff CUDA
/// backend; differentiable in `x` and `weight`. Saves `x` and the f32 inverse rms per row.
pub fn rms_norm_autodiff<const D: usize>(
    x: BurnTensor<CudaAutodiff, D>,
    weight: BurnTensor<CudaAutodiff, 1>,
    eps: f64,
) -> BurnTensor<CudaAutodiff, D> {
    let x = x.into_primitive().tensor();
    let w = weight.into_primitive().tensor();
    let shape = x.primitive.meta.shape().clone();
    let rows = as_rows(x.primitive.clone());
    let out = match RmsNormBackward
        .prepare::<NoCheckpointing>([x.node.clone(), w.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let (y, inv_rms) = rms_norm_forward(rows.clone(), w.primitive.clone(), eps);
            let y = burn_cubecl::ops::reshape(y, shape.clone());
            prep.finish((rows, w.primitive, inv_rms, shape), y)
        }
        OpsKind::UnTracked(prep) => {
            let (y, _) = rms_norm_forward(rows, w.primitive, eps);
            prep.finish(burn_cubecl::ops::reshape(y, shape))
        }
    };
    BurnTensor::from_primitive(TensorPrimitive::Float(out))
}

/// [`rms_norm_autodiff`]'s forward on the plain backend (evaluation, sampling).
pub fn rms_norm_plain(
    x: BurnTensor<CudaCube, 2>,
    weight: BurnTensor<CudaCube, 1>,
    eps: f64,
) -> BurnTensor<CudaCube, 2> {
    let (y, _) = rms_norm_forward(
        x.into_primitive().tensor(),
        weight.into_primitive().tensor(),
        eps,
    );
    wrap(y)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The staged RMSNorm backward's cubes per SM at the Llama widths (bf16) are the counts
    /// measured fastest on an H200: about 48 KB of rows in flight per SM.
    #[test]
    fn staged_norm_cubes_follow_bytes_in_flight() {
        for (hidden, accumulate, cubes) in [
            (2048, false, 4),
            (2048, true, 4),
            (4096, false, 3),
            (4096, true, 2),
            (5120, false, 2),
            (5120, true, 2),
        ] {
            let l = staged_norm_layout(hidden / 8, 8, 2, accumulate).unwrap();
            assert_eq!(
                (l.group, l.cubes_per_sm),
                (1, cubes),
                "hidden {hidden}, adding {accumulate}: {l:?}"
            );
        }
    }

    /// The staged RMSNorm backward's shape keeps every thread's row slice short (the loops are
    /// unrolled), covers the row, and fits its two stages plus the f32 rows into an SM's
    /// shared memory; rows too long for that fall back to the pipelined kernel.
    #[test]
    fn staged_norm_layout_fits_shared_memory() {
        for (hidden, elem_bytes) in [(2048, 2), (4096, 2), (5120, 2), (8192, 2), (1000, 2)]
            .into_iter()
            .chain([(4096, 4), (1000, 4), (16384, 4), (3, 4)])
        {
            let nv = [16 / elem_bytes, 4, 2, 1]
                .into_iter()
                .find(|w| hidden % w == 0)
                .unwrap();
            let row_vectors = hidden / nv;
            for accumulate in [false, true] {
                let Some(l) = staged_norm_layout(row_vectors, nv, elem_bytes, accumulate) else {
                    assert!(
                        row_vectors > STAGED_NORM_MAX_THREADS * STAGED_NORM_MAX_VPT,
                        "hidden {hidden} x {elem_bytes} B fell back though short"
                    );
                    continue;
                };
                assert!(
                    l.threads % 32 == 0 && l.threads <= STAGED_NORM_MAX_THREADS,
                    "{l:?}"
                );
                assert!(
                    l.vpt <= STAGED_NORM_MAX_VPT && l.vpt * l.threads >= row_vectors,
                    "{l:?}"
                );
                assert!((1..=8).contains(&l.group) && l.cubes_per_sm >= 1, "{l:?}");
                let smem = staged_norm_smem(l.threads, l.vpt, l.group, nv, elem_bytes, accumulate);
                assert!(
                    smem * l.cubes_per_sm <= STAGED_NORM_SMEM_PER_SM,
                    "hidden {hidden}: {smem} B x {} cubes",
                    l.cubes_per_sm
                );
            }
        }
    }

    /// The pipelined backward's shape covers the row with at most eight vectors per thread up
    /// to [`PIPELINED_NORM_THREADS`] threads, and at most 16 beyond, as `rms_norm_supports`
    /// promises.
    #[test]
    fn pipelined_norm_layout_covers_the_row() {
        for row_vectors in [1, 31, 256, 512, 4096, 4097, 16384] {
            let (threads, vpt) = pipelined_norm_layout(row_vectors);
            assert!(
                threads % 32 == 0 && threads <= ROW_MAX_THREADS,
                "{row_vectors}"
            );
            assert!(threads * vpt >= row_vectors, "{row_vectors}");
            assert!(vpt <= ROW_MAX_VECTORS_PER_THREAD, "{row_vectors}: {vpt}");
        }
    }
}
