//! Fused RMSNorm, SwiGLU and rotary-embedding kernels (forward and backward) in CubeCL, wired
//! into Burn's autodiff: the stand-in for Transformer Engine's fused elementwise kernels.
//!
//! Why: the reference ops in [`crate::ops`] are chains of Burn kernels (RMSNorm: cast, square,
//! mean, add, sqrt, recip, mul, cast, mul; RoPE: two narrows, a neg, a cat, two casts, three
//! products and a sum), each a full pass over the activation, and autodiff keeps their
//! intermediates (RMSNorm keeps an f32 copy of its input) and runs a similar chain backward.
//! These ops are memory-bound, so the figure of merit is bytes moved: here each is one pass
//! forward and one backward, reading the inputs once and writing the outputs once. They also
//! cut the number of ops the host issues, which matters because a Burn training step is
//! host-bound (DESIGN.md, "Stock Burn training of a Llama block").
//!
//! - RMSNorm: one cube per row; the mean square is accumulated in f32 (a warp sum, then the
//!   warps' partials through shared memory in a fixed order). The forward saves `x` and the
//!   per-row inverse rms (f32). The backward's cubes each own a block of rows: they write `dx`
//!   and one row of per-block `dweight` partial sums (f32), which a second kernel adds up per
//!   column in a fixed order. No atomics: results are bitwise reproducible. The default
//!   (version-2) backward pipelines its row loop (the next row's loads are issued before the
//!   current row is reduced and stored) and sizes the grid to about one wave of cubes.
//! - SwiGLU: `silu(gate) * up` elementwise; the backward writes `dgate` and `dup` in one pass.
//!   All arithmetic in f32.
//! - RoPE (Hugging Face's `rotate_half` layout): each thread rotates a vector of pairs
//!   `(x[j], x[j + d/2])`. The input may be strided (the model feeds `reshape + swap_dims`
//!   views); only its last dimension must be contiguous, otherwise it is copied first. The
//!   forward's output is contiguous; the backward's `dx` is written in x's dimension order
//!   under `flash::FlashLayout::Bshd` (the default; contiguous under `Bhsd`), so the model's
//!   gradient path back to `[B, S, H * D]` needs no copy. The backward is the transposed rotation, written for general tables
//!   (with Hugging Face's tables, whose two halves are equal, it is the rotation by `-sin`).
//!   The default (version-2) kernel reads the tables in 16-byte vectors once per thread and
//!   applies them to four heads at the same position.
//! - [`legacy_kernels`] (`SMP_BURN_FUSED_LEGACY=1`) selects the previous RMSNorm-backward and
//!   RoPE kernels, for A/B runs.
//!
//! Semantics follow the reference ops, with one rounding fewer where the reference rounds an
//! intermediate to bf16 (for example `silu(gate)` before the product): results agree with the
//! reference to the input dtype's rounding, which `examples/fused_check.rs` checks on the GPU.
//! Inputs are read in vectors of up to 16 bytes where shapes, strides and offsets allow.

// Kernel code is expanded by `#[cube]`, which has no `div_ceil` on runtime integers.
#![allow(clippy::manual_div_ceil)]

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::{DType, Shape, Tensor as BurnTensor, TensorPrimitive};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::{cast, into_contiguous};
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::ops::permute;
use burn_cubecl::tensor::CubeTensor;
use cubecl::calculate_cube_count_elemwise;
use cubecl::cuda::CudaRuntime;
use cubecl::prelude::barrier::{Barrier, copy_async};
use cubecl::prelude::*;
use std::sync::atomic::{AtomicU8, Ordering};

use super::CudaCube;
use super::flash::{FlashLayout, flash_layout};
use super::gemm::CudaAutodiff;

type Cube = CubeTensor<CudaRuntime>;

/// Threads per cube of the elementwise kernels (SwiGLU, RoPE) and of the column sum.
const ELEMWISE_THREADS: usize = 256;
/// Vectors each thread of a row kernel keeps in registers, when the row is long enough: two
/// 16-byte loads in flight per thread and a small register footprint in the backward.
const ROW_VECTORS_PER_THREAD: usize = 2;
/// Most threads per cube of the row kernels (CUDA's limit).
const ROW_MAX_THREADS: usize = 1024;
/// Most vectors per thread of the row kernels; with scalar loads this allows rows of 16384.
const ROW_MAX_VECTORS_PER_THREAD: usize = 16;
/// Cubes the RMSNorm backward aims for (each owns a block of rows and writes one row of
/// partial `dweight` sums): about four per SM of an H100/H200, enough to fill the device
/// while keeping the partial-sum buffer small.
const NORM_BWD_CUBES: usize = 512;
/// Partial-sum rows each column is split over in the column-sum kernel; a cube covers 32
/// columns, so it has `32 * COLSUM_GROUPS` = 256 threads.
const COLSUM_GROUPS: usize = 8;
/// Most threads per cube of the version-2 RMSNorm backward while every thread keeps at most
/// eight vectors of a row: 512 threads of one 16-byte vector cover a bf16 row of 4096, and two
/// such cubes fit an SM's registers, so the grid is sized for two cubes per SM.
const NORM_BWD_V2_THREADS: usize = 512;
/// Column vectors per cube of the version-2 column sum: 8 x 16 bytes, one 128-byte line per row.
const COLSUM_V2_LANES: usize = 8;
/// Row groups per cube of the version-2 column sum (`8 * 32` = 256 threads): 32 independent
/// 16-byte loads per column line in flight.
const COLSUM_V2_GROUPS: usize = 32;
/// Heads each thread of the version-2 RoPE kernel rotates with one read of the tables.
const ROPE_HEADS_PER_THREAD: usize = 4;
/// SMs assumed when the runtime does not report them (an H100/H200 has 132).
const DEFAULT_SMS: usize = 132;

/// `LEGACY` before the environment has been read.
const LEGACY_UNSET: u8 = 2;
/// Whether the legacy kernels run: 0 no, 1 yes, [`LEGACY_UNSET`] not decided yet.
static LEGACY: AtomicU8 = AtomicU8::new(LEGACY_UNSET);

/// Whether the RMSNorm backward and RoPE (forward and backward) run their legacy kernels
/// (`rms_norm_bwd_kernel` with `column_sum_kernel`, `rope_kernel`) instead of the version-2 ones
/// (the default). Decided once, from `SMP_BURN_FUSED_LEGACY=1`, unless
/// [`set_legacy_kernels`] was called first. Kept so that both can be compared (fused_check
/// checks and benchmarks both) until the version-2 kernels have been measured.
pub fn legacy_kernels() -> bool {
    match LEGACY.load(Ordering::Relaxed) {
        0 => false,
        1 => true,
        _ => {
            let on = std::env::var("SMP_BURN_FUSED_LEGACY").is_ok_and(|v| v.trim() == "1");
            LEGACY.store(u8::from(on), Ordering::Relaxed);
            on
        }
    }
}

/// Overrides [`legacy_kernels`] (and the environment) for the rest of the process, for A/B
/// runs in one process.
pub fn set_legacy_kernels(on: bool) {
    LEGACY.store(u8::from(on), Ordering::Relaxed);
}

// ------------------------------------------------------------------------------------------
// Device side
// ------------------------------------------------------------------------------------------

/// Sum of `value` over every unit of the cube, returned to all of them: a plane (warp) sum, then
/// the planes' totals through `scratch` in plane order, so the result is reproducible. Ends with
/// a barrier, so `scratch` may be reused right away.
#[cube]
pub(crate) fn cube_sum(value: f32, scratch: &mut SharedMemory<f32>) -> f32 {
    plane_total_to(value, scratch, 0usize);
    sync_cube();
    let total = planes_total(scratch, 0usize);
    sync_cube();
    total
}

/// The first half of every cube reduction here: this plane's sum of `value`, written by its
/// first unit to `scratch[base + PLANE_POS]`. A barrier must follow before
/// [`planes_total`] reads the slots.
#[cube]
fn plane_total_to(value: f32, scratch: &mut SharedMemory<f32>, base: usize) {
    let plane_total = plane_sum(value);
    if UNIT_POS_PLANE == 0 {
        scratch[base + PLANE_POS as usize] = plane_total;
    }
}

/// The second half: the planes' totals from `scratch[base..]`, added in plane order so that
/// every reduction here gives the same bits for the same values.
#[cube]
fn planes_total(scratch: &SharedMemory<f32>, base: usize) -> f32 {
    let planes = (CUBE_DIM + PLANE_DIM - 1) / PLANE_DIM;
    let mut total = f32::new(0.0);
    for i in 0..planes as usize {
        total += scratch[base + i];
    }
    total
}

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

/// RMSNorm backward. Cube = a block of `rows_per_cube` rows, thread layout as the forward.
/// `dx = r * dn - r^3 * x * sum(dn * x) / hidden` with `dn = dy * weight` and `r` the saved
/// inverse rms; when `want_dw`, `partial[cube, :] = sum over the block of dy * round(x * r)`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn rms_norm_bwd_kernel<F: Float, N: Size>(
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
    #[define(F)] _dtype: StorageType,
) {
    let blk = CUBE_POS;
    let r0 = blk * rows_per_cube as usize;
    // Cubes past the last block (when the grid rounds up) have no rows and no partial row.
    if r0 >= rows as usize {
        terminate!();
    }
    let t = UNIT_POS as usize;
    let hv = row_vectors as usize;
    let mut scratch = SharedMemory::<f32>::new(threads);
    let mut ws = Array::<Vector<f32, N>>::new(vpt);
    let mut acc = Array::<Vector<f32, N>>::new(vpt);
    #[unroll]
    for i in 0..vpt {
        let c = i * threads + t;
        let mut w = Vector::<f32, N>::new(f32::new(0.0));
        if c < hv {
            w = Vector::<f32, N>::cast_from(weight[c]);
        }
        ws[i] = w;
        acc[i] = Vector::<f32, N>::new(f32::new(0.0));
    }
    let mut r1 = r0 + rows_per_cube as usize;
    if r1 > rows as usize {
        r1 = rows as usize;
    }
    let mut xs = Array::<Vector<f32, N>>::new(vpt);
    let mut dns = Array::<Vector<f32, N>>::new(vpt);
    for row in r0..r1 {
        let base = row * hv;
        let r = inv_rms[row];
        let rv = Vector::<f32, N>::new(r);
        let mut dot = f32::new(0.0);
        #[unroll]
        for i in 0..vpt {
            let c = i * threads + t;
            let mut xv = Vector::<f32, N>::new(f32::new(0.0));
            let mut g = Vector::<f32, N>::new(f32::new(0.0));
            if c < hv {
                xv = Vector::<f32, N>::cast_from(x[base + c]);
                g = Vector::<f32, N>::cast_from(dy[base + c]);
            }
            if comptime!(want_dw) {
                // The weight multiplied the normalized row as rounded in the forward.
                let n = Vector::<f32, N>::cast_from(Vector::<F, N>::cast_from(xv * rv));
                acc[i] += g * n;
            }
            let dn = g * ws[i];
            xs[i] = xv;
            dns[i] = dn;
            dot += lane_sum::<N>(dn * xv, nv);
        }
        let total = cube_sum(dot, &mut scratch);
        let coef = Vector::<f32, N>::new(r * r * r * total / hidden);
        #[unroll]
        for i in 0..vpt {
            let c = i * threads + t;
            if c < hv {
                dx[base + c] = Vector::<F, N>::cast_from(dns[i] * rv - xs[i] * coef);
            }
        }
    }
    if comptime!(want_dw) {
        #[unroll]
        for i in 0..vpt {
            let c = i * threads + t;
            if c < hv {
                let out = (blk * hv + c) * nv;
                let a = acc[i];
                #[unroll]
                for k in 0..nv {
                    partial[out + k] = a[k];
                }
            }
        }
    }
}

/// `out[c] = sum_b partial[b, c]` in a fixed order. Cube = 32 consecutive columns x
/// `groups` row groups (thread `t`: column `t % 32`, group `t / 32`); group `g` adds rows
/// `g, g + groups, ...` four at a time, then group 0 adds the groups' sums in order.
#[cube(launch_unchecked)]
fn column_sum_kernel<F: Float>(
    partial: &Tensor<f32>,
    out: &mut Tensor<F>,
    blocks: u32,
    cols: u32,
    #[comptime] groups: usize,
    #[define(F)] _dtype: StorageType,
) {
    let t = UNIT_POS as usize;
    let lane = t % 32;
    let g = t / 32;
    let c = CUBE_POS * 32 + lane;
    let nb = blocks as usize;
    let nc = cols as usize;
    let mut sums = SharedMemory::<f32>::new(comptime!(32 * groups));
    let mut acc = f32::new(0.0);
    if c < nc {
        // Rows g + k * groups for k < steps.
        let steps = (nb + groups - 1 - g) / groups;
        let quads = steps / 4;
        let mut a0 = f32::new(0.0);
        let mut a1 = f32::new(0.0);
        let mut a2 = f32::new(0.0);
        let mut a3 = f32::new(0.0);
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
    sums[g * 32 + lane] = acc;
    sync_cube();
    if g == 0 && c < nc {
        let mut total = f32::new(0.0);
        #[unroll]
        for i in 0..groups {
            total += sums[i * 32 + lane];
        }
        out[c] = F::cast_from(total);
    }
}

/// `out = silu(gate) * up`, elementwise over contiguous tensors read in vectors (`len` vectors).
#[cube(launch_unchecked)]
fn swiglu_fwd_kernel<F: Float, N: Size>(
    gate: &Tensor<Vector<F, N>>,
    up: &Tensor<Vector<F, N>>,
    out: &mut Tensor<Vector<F, N>>,
    len: u32,
    #[define(F)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i < len as usize {
        let g = Vector::<f32, N>::cast_from(gate[i]);
        let u = Vector::<f32, N>::cast_from(up[i]);
        let one = Vector::<f32, N>::new(f32::new(1.0));
        let sig = one / (one + (Vector::<f32, N>::new(f32::new(0.0)) - g).exp());
        out[i] = Vector::<F, N>::cast_from(g * sig * u);
    }
}

/// SwiGLU backward: `dgate = dout * up * s * (1 + gate * (1 - s))` with `s = sigmoid(gate)`,
/// `dup = dout * silu(gate)`, in f32, one pass.
#[cube(launch_unchecked)]
fn swiglu_bwd_kernel<F: Float, N: Size>(
    gate: &Tensor<Vector<F, N>>,
    up: &Tensor<Vector<F, N>>,
    d_out: &Tensor<Vector<F, N>>,
    d_gate: &mut Tensor<Vector<F, N>>,
    d_up: &mut Tensor<Vector<F, N>>,
    len: u32,
    #[define(F)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i < len as usize {
        let g = Vector::<f32, N>::cast_from(gate[i]);
        let u = Vector::<f32, N>::cast_from(up[i]);
        let d = Vector::<f32, N>::cast_from(d_out[i]);
        let one = Vector::<f32, N>::new(f32::new(1.0));
        let sig = one / (one + (Vector::<f32, N>::new(f32::new(0.0)) - g).exp());
        let silu = g * sig;
        d_gate[i] = Vector::<F, N>::cast_from(d * u * sig * (one + g * (one - sig)));
        d_up[i] = Vector::<F, N>::cast_from(d * silu);
    }
}

/// Rotary embedding over `x: [batch, heads, seq, d]` (any strides, unit last stride, read in
/// vectors of `nv`; `half_vectors = d / 2 / nv`) with f32 tables `cos`, `sin: [seq, d]`
/// (contiguous). Thread = one vector of pairs `(x1, x2) = (x[j..], x[d/2 + j..])`:
/// forward `y1 = x1 cos1 - x2 sin1`, `y2 = x2 cos2 + x1 sin2`; backward (the transpose)
/// `y1 = x1 cos1 + x2 sin2`, `y2 = x2 cos2 - x1 sin1`. `out` may have any strides with a unit
/// last one (divisible by `nv`), like `x`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn rope_kernel<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    cos: &Tensor<f32>,
    sin: &Tensor<f32>,
    out: &mut Tensor<Vector<F, N>>,
    total: u32,
    heads: u32,
    seq: u32,
    half_vectors: u32,
    #[comptime] nv: usize,
    #[comptime] backward: bool,
    #[define(F)] _dtype: StorageType,
) {
    let pos = ABSOLUTE_POS;
    if pos < total as usize {
        let hv = half_vectors as usize;
        let j = pos % hv;
        let row = pos / hv;
        let s = row % seq as usize;
        let bh = row / seq as usize;
        let h = bh % heads as usize;
        let b = bh / heads as usize;
        let xb = (b * x.stride(0) + h * x.stride(1) + s * x.stride(2)) / nv;
        let x1 = Vector::<f32, N>::cast_from(x[xb + j]);
        let x2 = Vector::<f32, N>::cast_from(x[xb + hv + j]);
        let half = hv * nv;
        let tb = s * 2 * half + j * nv;
        let mut c1 = Vector::<f32, N>::empty();
        let mut c2 = Vector::<f32, N>::empty();
        let mut s1 = Vector::<f32, N>::empty();
        let mut s2 = Vector::<f32, N>::empty();
        #[unroll]
        for k in 0..nv {
            c1[k] = cos[tb + k];
            c2[k] = cos[tb + half + k];
            s1[k] = sin[tb + k];
            s2[k] = sin[tb + half + k];
        }
        let ob = (b * out.stride(0) + h * out.stride(1) + s * out.stride(2)) / nv;
        if comptime!(backward) {
            out[ob + j] = Vector::<F, N>::cast_from(x1 * c1 + x2 * s2);
            out[ob + hv + j] = Vector::<F, N>::cast_from(x2 * c2 - x1 * s1);
        } else {
            out[ob + j] = Vector::<F, N>::cast_from(x1 * c1 - x2 * s1);
            out[ob + hv + j] = Vector::<F, N>::cast_from(x2 * c2 + x1 * s2);
        }
    }
}

// --- Version 2 of the RMSNorm backward and of RoPE (the default; see `legacy_kernels`) -----

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

/// RMSNorm backward, version 2: the formulas of [`rms_norm_bwd_kernel`], with the row loop
/// software-pipelined. Why: the legacy kernel loads a row, reduces it (two barriers) and stores
/// it before it issues the next row's loads, so each cube has loads in flight only part of the
/// time (1.35 TB/s on an H200). Here a thread issues the loads of row `i + 1` (`x`, `dy`,
/// `inv_rms`, raw in registers) right after it has taken row `i` out of those registers, so they
/// are in flight while row `i` is reduced (one barrier, [`cube_sum_alternating`]) and stored.
/// The loads come before the stores in program order, so the compiler needs no aliasing proof
/// to overlap them. The current row stays raw (input dtype) across the reduction and is
/// converted again after it, and the weight and the partial `dweight` row live in shared
/// memory: both to save registers (calls DH, DI: 64-87 instead of 74-96, 20-30 % faster at
/// h 2048 and 5120). Now the fallback of [`rms_norm_bwd_staged_kernel`] for rows too long to
/// stage. Cube = a block of `rows_per_cube` rows, thread `t` owns vectors
/// `t, t + threads, ...` of each row; the host sizes the grid to about one wave, so the
/// block's partial `dweight` row (f32) is short.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn rms_norm_bwd_v2_kernel<F: Float, N: Size>(
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

/// RMSNorm backward, staged: the formulas of [`rms_norm_bwd_v2_kernel`] in the same order (so
/// bitwise its results where both give a thread the same vectors of a row), with the rows
/// brought into shared memory by `cp.async`, `group` rows per stage and two stages, instead of
/// through registers. Why: the register-pipelined kernel holds each byte
/// in flight in a register, and CubeCL's generated code needs 64-90 registers for it, so an SM
/// keeps only about 32 KB of loads in flight and the kernel reads at 1.2-1.8 TB/s (calls DH,
/// DI). Here the next stage's rows are in flight in shared memory, tracked by one cube
/// barrier, while the current stage is reduced and stored.
/// Cube = a block of `rows_per_cube` rows as in the version-2 kernel. The weight and the
/// partial `dweight` row live in registers (at most four vectors per thread, so 64 f32 at
/// most) and the stage's rows are reduced together behind one barrier: shared memory then
/// holds only the stages, so an SM runs several cubes. Why: with both f32 rows in shared
/// memory (32 KB per cube at h 4096) an SM ran two cubes of four warps and the kernel was
/// latency-bound at 12.5 % occupancy (call DO).
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

/// `out[c] = sum_b partial[b, c]` in a fixed order, version 2: reads `partial` in vectors of
/// `mv` f32 (`col_vectors = cols / mv`). Cube = `lanes` consecutive column vectors x `groups`
/// row groups (thread `t`: vector `t % lanes`, group `t / lanes`); group `g` adds rows
/// `g, g + groups, ...` four at a time, then group 0 adds the groups' sums in order. Why: more
/// and wider loads in flight than [`column_sum_kernel`] (32 groups of 16-byte loads), so the
/// partial sums cost about one memory latency, not one per four rows.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn column_sum_v2_kernel<F: Float, M: Size>(
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

/// Rotary embedding, version 2: the formulas and layouts of [`rope_kernel`] (`x` and `out` any
/// strides with a unit last stride, in vectors of `nv`),
/// with two changes. Why: the legacy kernel reads the four table chunks as `4 * nv` scalar loads
/// per thread (32 for bf16) for one head, so its loads are mostly table traffic (1.2-1.4 TB/s on
/// an H200). Here the tables are read in vectors of `mv` f32 (16 bytes), once per thread, and
/// reused for `hpt` heads at the same position (all heads share a position's angles). And all of
/// a thread's `x` loads are issued before any store, so they are in flight together.
/// Thread = vector `j` of pairs, position `(b, s)`, heads `hg * hpt ..` (clamped to `heads`);
/// `total = batch * seq * head_groups * half_vectors`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn rope_v2_kernel<F: Float, N: Size, M: Size>(
    x: &Tensor<Vector<F, N>>,
    cos: &Tensor<Vector<f32, M>>,
    sin: &Tensor<Vector<f32, M>>,
    out: &mut Tensor<Vector<F, N>>,
    total: u32,
    heads: u32,
    seq: u32,
    half_vectors: u32,
    head_groups: u32,
    #[comptime] nv: usize,
    #[comptime] mv: usize,
    #[comptime] hpt: usize,
    #[comptime] backward: bool,
    #[define(F)] _dtype: StorageType,
) {
    let pos = ABSOLUTE_POS;
    if pos >= total as usize {
        terminate!();
    }
    let hv = half_vectors as usize;
    let j = pos % hv;
    let rest = pos / hv;
    let hg = rest % head_groups as usize;
    let bs = rest / head_groups as usize;
    let s = bs % seq as usize;
    let b = bs / seq as usize;
    let nh = heads as usize;
    // The heads' loads first (raw), so that they are all in flight at once.
    let xb = (b * x.stride(0) + s * x.stride(2)) / nv + j;
    let hs = x.stride(1) / nv;
    let mut x1s = Array::<Vector<F, N>>::new(hpt);
    let mut x2s = Array::<Vector<F, N>>::new(hpt);
    #[unroll]
    for k in 0..hpt {
        let h = hg * hpt + k;
        if h < nh {
            let xi = xb + h * hs;
            x1s[k] = x[xi];
            x2s[k] = x[xi + hv];
        }
    }
    // Table row `s`, elements `j * nv ..` of each half, as `nv / mv` vectors of `mv`.
    let half = hv * nv;
    let tb = (s * 2 * half + j * nv) / mv;
    let th = half / mv;
    let mut c1 = Vector::<f32, N>::empty();
    let mut c2 = Vector::<f32, N>::empty();
    let mut s1 = Vector::<f32, N>::empty();
    let mut s2 = Vector::<f32, N>::empty();
    #[unroll]
    for q in 0..comptime!(nv / mv) {
        let ca = cos[tb + q];
        let cb = cos[tb + th + q];
        let sa = sin[tb + q];
        let sb = sin[tb + th + q];
        #[unroll]
        for l in 0..mv {
            c1[q * mv + l] = ca[l];
            c2[q * mv + l] = cb[l];
            s1[q * mv + l] = sa[l];
            s2[q * mv + l] = sb[l];
        }
    }
    // Output vector of (b, h, s, j), through `out`'s strides (contiguous, or x's dimension
    // order for the backward; see `rope_apply_ordered`).
    let ob = (b * out.stride(0) + s * out.stride(2)) / nv + j;
    let head_vectors = out.stride(1) / nv;
    #[unroll]
    for k in 0..hpt {
        let h = hg * hpt + k;
        if h < nh {
            let x1 = Vector::<f32, N>::cast_from(x1s[k]);
            let x2 = Vector::<f32, N>::cast_from(x2s[k]);
            let oi = ob + h * head_vectors;
            if comptime!(backward) {
                out[oi] = Vector::<F, N>::cast_from(x1 * c1 + x2 * s2);
                out[oi + hv] = Vector::<F, N>::cast_from(x2 * c2 - x1 * s1);
            } else {
                out[oi] = Vector::<F, N>::cast_from(x1 * c1 - x2 * s1);
                out[oi + hv] = Vector::<F, N>::cast_from(x2 * c2 + x1 * s2);
            }
        }
    }
}

// ------------------------------------------------------------------------------------------
// Host side
// ------------------------------------------------------------------------------------------

fn check_float(op: &str, t: &CubeTensor<impl CubeRuntime>) {
    assert!(
        matches!(t.dtype, DType::F32 | DType::F16 | DType::BF16),
        "{op}: unsupported dtype {:?} (f32, f16 or bf16)",
        t.dtype
    );
}

/// The widest vector (elements) that the device loads in one instruction and in which every
/// tensor can be read: `run` (the contiguous extent each vector must stay inside) and every
/// stride but the last divisible by it, and each buffer's start aligned to it.
fn vector_width<R: CubeRuntime>(tensors: &[&CubeTensor<R>], run: usize) -> usize {
    let first = tensors[0];
    first
        .client
        .io_optimized_vector_sizes(first.dtype.size())
        .find(|&w| {
            run.is_multiple_of(w)
                && tensors.iter().all(|t| {
                    let strides = t.meta.strides();
                    let rank = strides.len();
                    let bytes = (w * t.dtype.size()) as u64;
                    strides[rank - 1] == 1
                        && (0..rank - 1).all(|i| strides[i].is_multiple_of(w))
                        && t.handle.offset_start.unwrap_or(0).is_multiple_of(bytes)
                })
        })
        .unwrap_or(1)
}

/// Every index fits the kernels' 32-bit scalars and Burn's 32-bit addressing.
fn check_u32(op: &str, t: &CubeTensor<impl CubeRuntime>) {
    assert!(
        t.required_address_type() == AddressType::U32 && t.meta.num_elements() < u32::MAX as usize,
        "{op}: tensor {:?} is too large for 32-bit indexing",
        t.meta.shape()
    );
}

/// A kernel's thread count fits its 32-bit `total` argument.
fn check_u32_count(op: &str, n: usize) {
    assert!(
        n < u32::MAX as usize,
        "{op}: {n} threads are too many for 32-bit indexing"
    );
}

/// Threads per cube and vectors per thread of a row kernel for rows of `row_vectors` vectors.
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

/// Threads per cube and vectors per thread of the version-2 RMSNorm backward: as few vectors per
/// thread as [`NORM_BWD_V2_THREADS`] threads allow (one for bf16 rows of up to 4096), at most
/// eight; longer rows (scalar loads of odd sizes) take up to [`ROW_MAX_THREADS`] threads, and
/// at most 16 vectors each, as [`rms_norm_supports`] guarantees.
fn row_layout_bwd_v2(row_vectors: usize) -> (usize, usize) {
    let preferred = norm_bwd_tuning().map_or(NORM_BWD_V2_THREADS, |(threads, _)| threads);
    let max = if row_vectors > 8 * preferred {
        ROW_MAX_THREADS
    } else {
        preferred
    };
    let threads = row_vectors
        .div_ceil(row_vectors.div_ceil(max))
        .next_multiple_of(32)
        .clamp(32, max);
    (threads, row_vectors.div_ceil(threads))
}

/// `SMP_BURN_NORM_BWD=threads,cubes_per_sm` (for tuning sweeps, read once): the largest cube of
/// the version-2 RMSNorm backward (a multiple of 32 up to 1024; rows longer than eight vectors
/// per thread still take more) and the cubes per SM its grid is sized for. Unset or malformed:
/// [`NORM_BWD_V2_THREADS`] and `1024 / threads` (at least 2) cubes per SM, which no other
/// setting beat by more than noise in a sweep on an H200 (docs/performance.md, call CD).
fn norm_bwd_tuning() -> Option<(usize, usize)> {
    static TUNING: std::sync::OnceLock<Option<(usize, usize)>> = std::sync::OnceLock::new();
    *TUNING.get_or_init(|| {
        let v = std::env::var("SMP_BURN_NORM_BWD").ok()?;
        let (t, c) = v.split_once(',')?;
        let threads = t
            .trim()
            .parse::<usize>()
            .ok()?
            .next_multiple_of(32)
            .clamp(32, 1024);
        let cubes = c.trim().parse::<usize>().ok()?.clamp(1, 64);
        Some((threads, cubes))
    })
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

/// Threads per cube of the staged RMSNorm backward: in call DJ's sweep 128 was the fastest or
/// within noise of it at every Llama width (256 and 512 were up to 2 % and 28 % slower).
const STAGED_NORM_THREADS: usize = 128;

/// Kilobytes of rows per stage of the staged RMSNorm backward, by default: one row per stage
/// at the Llama widths (2,048 and wider), so shared memory admits several cubes per SM.
const STAGED_NORM_STAGE_KIB: usize = 8;

/// Bytes of rows the staged RMSNorm backward's cubes on one SM should have in flight (one
/// stage each): the default cube count per SM is this over a stage's bytes, within
/// [`STAGED_NORM_CUBES_PER_SM`]. Why: in calls DQ-DS the fastest count (kernel and column sum
/// by device time) at the Llama widths, plain and adding into a gradient, was 4 cubes for
/// 8-12 KB of rows per stage, 3 for 16 KB and 2 for 20-30 KB. More cubes each add a partial
/// dweight row per SM to the column sum (about 1.5 us per 132 rows at h 4096).
const STAGED_NORM_INFLIGHT_PER_SM: usize = 48 * 1024;

/// Cubes per SM of the staged RMSNorm backward by default, at least and at most: at 4 the
/// kernel's 118-124 registers at 128 threads fill the register file (call DQ).
const STAGED_NORM_CUBES_PER_SM: std::ops::RangeInclusive<usize> = 2..=4;

/// Vectors of a row one thread of the staged RMSNorm backward owns, at most: the weight and
/// the partial dweight take `2 * nv` f32 registers per vector.
const STAGED_NORM_MAX_VPT: usize = 4;

/// Threads per cube of the staged RMSNorm backward, at most: CubeCL bounds a kernel's
/// registers by its cube size, and at 256 threads a unit may still use 255, which the
/// register-held rows need. Longer rows (over 8,192 bf16 or 4,096 f32) take the version-2
/// kernel.
const STAGED_NORM_MAX_THREADS: usize = 256;

/// Shared memory one SM offers the cubes of the staged RMSNorm backward (an H100/H200 has
/// 228 KB; a little is reserved per cube).
const STAGED_NORM_SMEM_PER_SM: usize = 220 * 1024;

/// The staged RMSNorm backward's launch shape for rows of `row_vectors` vectors of `nv`
/// elements of `elem_bytes`, or `None` where it does not apply (turned off, or a row too long
/// for two stages in shared memory): then the version-2 kernel runs. Defaults:
/// [`STAGED_NORM_THREADS`] threads (more where a thread would hold over
/// [`STAGED_NORM_MAX_VPT`] vectors), about [`STAGED_NORM_STAGE_KIB`] KB of rows per stage, and
/// [`STAGED_NORM_INFLIGHT_PER_SM`] over a stage's bytes cubes per SM (within
/// [`STAGED_NORM_CUBES_PER_SM`] and what shared memory allows).
/// `SMP_BURN_NORM_BWD_STAGED=0` turns it off; `=threads,stage_kib,cubes_per_sm` sets the shape
/// (read once, for tuning sweeps).
fn norm_bwd_staged_layout(
    row_vectors: usize,
    nv: usize,
    elem_bytes: usize,
    accumulate: bool,
) -> Option<StagedNormLayout> {
    // `None`: turned off; unset or malformed: the defaults (cubes per SM `None`: by the bytes
    // in flight).
    type Shape = (usize, usize, Option<usize>);
    static SHAPE: std::sync::OnceLock<Option<Shape>> = std::sync::OnceLock::new();
    let shape = *SHAPE.get_or_init(|| {
        let default = (STAGED_NORM_THREADS, STAGED_NORM_STAGE_KIB, None);
        let Ok(v) = std::env::var("SMP_BURN_NORM_BWD_STAGED") else {
            return Some(default);
        };
        if v.trim() == "0" {
            return None;
        }
        let mut it = v.split(',').map(|p| p.trim().parse::<usize>().ok());
        let Some(Some(threads)) = it.next() else {
            return Some(default);
        };
        let kib = it.next().flatten().unwrap_or(default.1).clamp(1, 96);
        let cubes = it.next().flatten().map(|c| c.clamp(1, 16));
        Some((
            threads
                .next_multiple_of(32)
                .clamp(32, STAGED_NORM_MAX_THREADS),
            kib,
            cubes,
        ))
    });
    let (threads, stage_kib, max_cubes) = shape?;
    if row_vectors == 0 {
        return None;
    }
    // At most `STAGED_NORM_MAX_VPT` vectors per thread (the row loops are unrolled and the
    // thread's weight and dweight slices live in registers), at most a row's worth.
    let threads = threads
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
    let group = (stage_kib * 1024 / (row_bytes * streams)).clamp(1, 8);
    let max_cubes = max_cubes.unwrap_or_else(|| {
        (STAGED_NORM_INFLIGHT_PER_SM / (group * row_bytes * streams)).clamp(
            *STAGED_NORM_CUBES_PER_SM.start(),
            *STAGED_NORM_CUBES_PER_SM.end(),
        )
    });
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
/// contiguous buffer shaped as `x` that no other tensor holds; not with the legacy kernel),
/// `dx` is added into it, the sum rounded once, and returned.
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
            assert!(
                !legacy_kernels(),
                "rms_norm backward: the legacy kernel does not accumulate"
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
    let legacy = legacy_kernels();
    let staged = (!legacy && super::flash::flash_mma::mma_async_supported(&client))
        .then(|| norm_bwd_staged_layout(row_vectors, nv, dtype.size(), accumulate))
        .flatten();
    let (threads, vpt) = match staged {
        Some(layout) => (layout.threads, layout.vpt),
        None if legacy => row_layout(row_vectors),
        None => row_layout_bwd_v2(row_vectors),
    };
    // Legacy: a fixed ~512 blocks. Version 2: about one wave of cubes (two per SM at 512
    // threads, more for smaller cubes), so each cube's pipeline runs over many rows and the
    // partial sums stay small (about 256 rows of `hidden` f32 on an H200).
    let target_blocks = if let Some(layout) = staged {
        sm_count(&client) * layout.cubes_per_sm
    } else if legacy {
        NORM_BWD_CUBES
    } else {
        let per_sm = norm_bwd_tuning().map_or((1024 / threads).max(2), |(_, cubes)| cubes);
        sm_count(&client) * per_sm
    };
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
        // SAFETY: as the version-2 launch; the copies stay inside the rows of the cube's block
        // and inside the stage buffers (`group` rows of `vpt * threads` vectors each).
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
    } else if legacy {
        // SAFETY: cube `b` reads rows `b * rows_per_cube ..` clamped to `rows`; vector indices
        // stay inside the row; `partial` has `blocks * hidden` elements when written.
        unsafe {
            rms_norm_bwd_kernel::launch_unchecked::<R>(
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
                dtype.into(),
            );
        }
    } else {
        // SAFETY: as the legacy launch: cube `b` owns rows `b * rows_per_cube ..` clamped to
        // `rows` (the prefetch reads row `i + 1` only when it is below that clamp); vector
        // indices stay inside the row; shared memory holds two halves of one value per thread.
        unsafe {
            rms_norm_bwd_v2_kernel::launch_unchecked::<R>(
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
        if legacy {
            // SAFETY: one thread per (column, group); columns past `hidden` only write shared
            // memory; rows stay below `blocks`.
            unsafe {
                column_sum_kernel::launch_unchecked::<R>(
                    &client,
                    CubeCount::Static(hidden.div_ceil(32) as u32, 1, 1),
                    CubeDim::new_1d((32 * COLSUM_GROUPS) as u32),
                    partial.into_tensor_arg(),
                    dw.clone().into_tensor_arg(),
                    blocks as u32,
                    hidden as u32,
                    COLSUM_GROUPS,
                    dtype.into(),
                );
            }
        } else {
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
                column_sum_v2_kernel::launch_unchecked::<R>(
                    &client,
                    CubeCount::Static(col_vectors.div_ceil(COLSUM_V2_LANES) as u32, 1, 1),
                    CubeDim::new_1d((COLSUM_V2_LANES * COLSUM_V2_GROUPS) as u32),
                    mv,
                    partial.into_tensor_arg(),
                    dw.clone().into_tensor_arg(),
                    blocks as u32,
                    col_vectors as u32,
                    mv,
                    COLSUM_V2_LANES,
                    COLSUM_V2_GROUPS,
                    dtype.into(),
                );
            }
        }
        dw
    });
    (dx, dw)
}

fn check_same<R: CubeRuntime>(op: &str, a: &CubeTensor<R>, b: &CubeTensor<R>) {
    assert!(
        a.meta.shape() == b.meta.shape() && a.dtype == b.dtype,
        "{op}: operands differ: {:?} {:?} vs {:?} {:?}",
        a.meta.shape(),
        a.dtype,
        b.meta.shape(),
        b.dtype
    );
    check_float(op, a);
    a.assert_is_on_same_device(b);
}

/// Vector width, vector count and launch grid of an elementwise kernel over contiguous tensors.
fn elementwise_launch<R: CubeRuntime>(tensors: &[&CubeTensor<R>]) -> (usize, usize, CubeCount) {
    let shape = tensors[0].meta.shape();
    let last = shape[shape.num_dims() - 1];
    let nv = vector_width(tensors, last);
    let len = shape.num_elements() / nv;
    let count = calculate_cube_count_elemwise(
        &tensors[0].client,
        len,
        CubeDim::new_1d(ELEMWISE_THREADS as u32),
    );
    (nv, len, count)
}

/// `silu(gate) * up` in one pass (f32 arithmetic, one rounding to the inputs' dtype).
///
/// # Panics
/// On mismatched shapes or dtypes.
pub fn swiglu_forward<R: CubeRuntime>(gate: CubeTensor<R>, up: CubeTensor<R>) -> CubeTensor<R> {
    check_same("swiglu", &gate, &up);
    let (gate, up) = (into_contiguous(gate), into_contiguous(up));
    check_u32("swiglu", &gate);
    let out = empty_device_contiguous_dtype(
        gate.client.clone(),
        gate.device.clone(),
        gate.meta.shape().clone(),
        gate.dtype,
    );
    let (nv, len, count) = elementwise_launch(&[&gate, &up, &out]);
    if len == 0 {
        return out;
    }
    let (client, dtype) = (gate.client.clone(), gate.dtype);
    // SAFETY: the kernel guards `i < len`, the vector count of every (contiguous) operand.
    unsafe {
        swiglu_fwd_kernel::launch_unchecked::<R>(
            &client,
            count,
            CubeDim::new_1d(ELEMWISE_THREADS as u32),
            nv,
            gate.into_tensor_arg(),
            up.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            len as u32,
            dtype.into(),
        );
    }
    out
}

/// The gradients `(dgate, dup)` of [`swiglu_forward`] for the upstream `d_out`, in one pass.
///
/// # Panics
/// On mismatched shapes or dtypes.
pub fn swiglu_backward<R: CubeRuntime>(
    gate: CubeTensor<R>,
    up: CubeTensor<R>,
    d_out: CubeTensor<R>,
) -> (CubeTensor<R>, CubeTensor<R>) {
    check_same("swiglu backward", &gate, &up);
    check_same("swiglu backward", &gate, &d_out);
    let (gate, up, d_out) = (
        into_contiguous(gate),
        into_contiguous(up),
        into_contiguous(d_out),
    );
    check_u32("swiglu backward", &gate);
    let alloc = || {
        empty_device_contiguous_dtype(
            gate.client.clone(),
            gate.device.clone(),
            gate.meta.shape().clone(),
            gate.dtype,
        )
    };
    let (d_gate, d_up) = (alloc(), alloc());
    let (nv, len, count) = elementwise_launch(&[&gate, &up, &d_out, &d_gate, &d_up]);
    if len == 0 {
        return (d_gate, d_up);
    }
    let (client, dtype) = (gate.client.clone(), gate.dtype);
    // SAFETY: as swiglu_forward.
    unsafe {
        swiglu_bwd_kernel::launch_unchecked::<R>(
            &client,
            count,
            CubeDim::new_1d(ELEMWISE_THREADS as u32),
            nv,
            gate.into_tensor_arg(),
            up.into_tensor_arg(),
            d_out.into_tensor_arg(),
            d_gate.clone().into_tensor_arg(),
            d_up.clone().into_tensor_arg(),
            len as u32,
            dtype.into(),
        );
    }
    (d_gate, d_up)
}

/// A rotary table as the kernel reads it: f32, contiguous, `[seq, head_dim]`.
pub fn rope_table<R: CubeRuntime>(t: CubeTensor<R>) -> CubeTensor<R> {
    check_float("rope table", &t);
    into_contiguous(cast(t, DType::F32))
}

/// Rotary embedding (`backward = false`) or its transpose (`backward = true`, the gradient
/// with respect to the input) of `x: [batch, heads, seq, head_dim]`, with tables from
/// [`rope_table`]. `x` may have any strides; the result is contiguous, in x's dtype.
///
/// # Panics
/// On shapes that do not match or an odd head dim.
pub fn rope_apply<R: CubeRuntime>(
    x: CubeTensor<R>,
    cos: &CubeTensor<R>,
    sin: &CubeTensor<R>,
    backward: bool,
) -> CubeTensor<R> {
    rope_apply_ordered(x, cos, sin, backward, None)
}

/// The order of the dimensions of a tensor with `strides` from outermost to innermost (largest
/// stride first; ties keep the logical order), when the last dimension is the innermost;
/// `None` otherwise (then a contiguous result is as good as any).
fn dim_order(strides: &[usize]) -> Option<Vec<usize>> {
    let n = strides.len();
    let mut order: Vec<usize> = (0..n).collect();
    // Stable: equal strides (size-1 dimensions) keep their logical order.
    order.sort_by(|&a, &b| strides[b].cmp(&strides[a]));
    (order.last() == Some(&(n - 1))).then_some(order)
}

/// An uninitialized dense tensor of `shape` whose dimensions lie in memory in `order`
/// (outermost first; [`dim_order`]): a contiguous allocation of the permuted shape, viewed back
/// as `shape` by permuting its metadata.
fn empty_ordered<R: CubeRuntime>(
    client: &ComputeClient<R>,
    device: &R::Device,
    shape: &Shape,
    order: &[usize],
    dtype: DType,
) -> CubeTensor<R> {
    let mem_shape = Shape::from(order.iter().map(|&i| shape[i]).collect::<Vec<_>>());
    let t = empty_device_contiguous_dtype(client.clone(), device.clone(), mem_shape, dtype);
    // Memory dimension p holds logical dimension order[p]; logical dimension j is memory
    // dimension inv[j].
    let mut inv = vec![0usize; order.len()];
    for (p, &j) in order.iter().enumerate() {
        inv[j] = p;
    }
    permute(t, &inv)
}

/// [`rope_apply`] with the result's memory order chosen: `like = Some(strides)` gives it the
/// dimension order of a tensor with those strides (dense; contiguous when the last dimension
/// is not the innermost there), `None` a contiguous result.
///
/// Why: the RoPE backward's input `x` is the model's `[B, S, H, D]` projection viewed as
/// `[B, H, S, D]` (swapped strides). A contiguous `dx` makes the gradient's way back
/// (`swap_dims(1, 2)` + `reshape` to `[B, S, H * D]`) a copy kernel per tensor and layer; `dx`
/// in x's order makes it a view.
///
/// # Panics
/// As [`rope_apply`], and if `like` does not have 4 strides.
pub fn rope_apply_ordered<R: CubeRuntime>(
    x: CubeTensor<R>,
    cos: &CubeTensor<R>,
    sin: &CubeTensor<R>,
    backward: bool,
    like: Option<&[usize]>,
) -> CubeTensor<R> {
    let shape = x.meta.shape().clone();
    assert!(
        shape.num_dims() == 4,
        "rope: x must be [batch, heads, seq, head_dim], got {shape:?}"
    );
    let (heads, seq, d) = (shape[1], shape[2], shape[3]);
    assert!(
        d.is_multiple_of(2)
            && cos.meta.shape().as_slice() == [seq, d]
            && sin.meta.shape().as_slice() == [seq, d]
            && cos.dtype == DType::F32
            && sin.dtype == DType::F32
            && cos.is_contiguous()
            && sin.is_contiguous(),
        "rope: x {shape:?} needs an even head dim and contiguous f32 tables [seq, head_dim] \
         (rope_table), got cos {:?} {:?}, sin {:?} {:?}",
        cos.meta.shape(),
        cos.dtype,
        sin.meta.shape(),
        sin.dtype
    );
    check_float("rope", &x);
    x.assert_is_on_same_device(cos);
    let x = if x.meta.strides()[3] != 1 {
        into_contiguous(x)
    } else {
        x
    };
    check_u32("rope", &x);
    if let Some(like) = like {
        assert!(
            like.len() == 4,
            "rope: `like` needs 4 strides, got {like:?}"
        );
    }
    let out = match like.and_then(dim_order) {
        Some(order) => empty_ordered(&x.client, &x.device, &shape, &order, x.dtype),
        None => empty_device_contiguous_dtype(
            x.client.clone(),
            x.device.clone(),
            shape.clone(),
            x.dtype,
        ),
    };
    let half = d / 2;
    let nv = vector_width(&[&x, &out], half);
    let half_vectors = half / nv;
    let (client, dtype) = (x.client.clone(), x.dtype);
    if legacy_kernels() {
        let total = shape.num_elements() / 2 / nv;
        if total == 0 {
            return out;
        }
        let count =
            calculate_cube_count_elemwise(&client, total, CubeDim::new_1d(ELEMWISE_THREADS as u32));
        // SAFETY: the kernel guards `pos < total`; (batch, head, position) come from the
        // checked shape, the strides from the tensor, so every index stays inside `x`, `out`
        // and the tables.
        unsafe {
            rope_kernel::launch_unchecked::<R>(
                &client,
                count,
                CubeDim::new_1d(ELEMWISE_THREADS as u32),
                nv,
                x.into_tensor_arg(),
                cos.clone().into_tensor_arg(),
                sin.clone().into_tensor_arg(),
                out.clone().into_tensor_arg(),
                total as u32,
                heads as u32,
                seq as u32,
                half_vectors as u32,
                nv,
                backward,
                dtype.into(),
            );
        }
        return out;
    }
    // Tables in vectors of at most 16 bytes that divide x's vector (so a thread's `nv` angles
    // are whole table vectors); the tables are contiguous, so only their offsets can forbid it.
    let mv = vector_width(&[cos, sin], nv).min(4);
    let head_groups = heads.div_ceil(ROPE_HEADS_PER_THREAD);
    let total = shape[0] * seq * head_groups * half_vectors;
    if total == 0 {
        return out;
    }
    check_u32_count("rope", total);
    let count =
        calculate_cube_count_elemwise(&client, total, CubeDim::new_1d(ELEMWISE_THREADS as u32));
    // SAFETY: the kernel guards `pos < total` and `head < heads`; (batch, position, head) come
    // from the checked shape, the strides from the tensor (all but the last divisible by `nv`,
    // which `vector_width` checked), so every index stays inside `x`, `out` and the tables,
    // whose vectors of `mv` divide `nv` and the table row.
    unsafe {
        rope_v2_kernel::launch_unchecked::<R>(
            &client,
            count,
            CubeDim::new_1d(ELEMWISE_THREADS as u32),
            nv,
            mv,
            x.into_tensor_arg(),
            cos.clone().into_tensor_arg(),
            sin.clone().into_tensor_arg(),
            out.clone().into_tensor_arg(),
            total as u32,
            heads as u32,
            seq as u32,
            half_vectors as u32,
            head_groups as u32,
            nv,
            mv,
            ROPE_HEADS_PER_THREAD,
            backward,
            dtype.into(),
        );
    }
    out
}

// ------------------------------------------------------------------------------------------
// Autodiff ops on the CUDA backend
// ------------------------------------------------------------------------------------------

fn wrap<const D: usize>(t: Cube) -> BurnTensor<CudaCube, D> {
    BurnTensor::from_primitive(TensorPrimitive::Float(t))
}

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
        let dx_into = if legacy_kernels() {
            None
        } else {
            super::take_grad_for_accumulation(&ops, 0, grads, &dy, &ops.state.3).map(as_rows)
        };
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

#[derive(Debug)]
struct SwigluBackward;

impl Backward<CudaCube, 2> for SwigluBackward {
    /// gate, up.
    type State = (Cube, Cube);

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let [node_gate, node_up] = ops.parents;
        let d_out = grads.consume::<CudaCube>(&ops.node);
        let (gate, up) = ops.state;
        let (d_gate, d_up) = swiglu_backward(gate, up, d_out);
        if let Some(node) = node_gate {
            grads.register::<CudaCube>(node.id, d_gate);
        }
        if let Some(node) = node_up {
            grads.register::<CudaCube>(node.id, d_up);
        }
    }
}

/// `silu(gate) * up` through the fused kernels on the autodiff CUDA backend; differentiable in
/// both. Saves the two inputs (which the reference keeps too) and nothing else.
pub fn swiglu_autodiff<const D: usize>(
    gate: BurnTensor<CudaAutodiff, D>,
    up: BurnTensor<CudaAutodiff, D>,
) -> BurnTensor<CudaAutodiff, D> {
    let gate = gate.into_primitive().tensor();
    let up = up.into_primitive().tensor();
    let out = match SwigluBackward
        .prepare::<NoCheckpointing>([gate.node.clone(), up.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let y = swiglu_forward(gate.primitive.clone(), up.primitive.clone());
            prep.finish((gate.primitive, up.primitive), y)
        }
        OpsKind::UnTracked(prep) => prep.finish(swiglu_forward(gate.primitive, up.primitive)),
    };
    BurnTensor::from_primitive(TensorPrimitive::Float(out))
}

/// [`swiglu_autodiff`]'s forward on the plain backend.
pub fn swiglu_plain<const D: usize>(
    gate: BurnTensor<CudaCube, D>,
    up: BurnTensor<CudaCube, D>,
) -> BurnTensor<CudaCube, D> {
    wrap(swiglu_forward(
        gate.into_primitive().tensor(),
        up.into_primitive().tensor(),
    ))
}

#[derive(Debug)]
struct RopeBackward;

impl Backward<CudaCube, 1> for RopeBackward {
    /// The f32 tables and x's strides (`dx` is written in x's dimension order under
    /// [`FlashLayout::Bshd`]; see [`rope_apply_ordered`]).
    type State = (Cube, Cube, [usize; 4]);

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let [node_x] = ops.parents;
        let dy = grads.consume::<CudaCube>(&ops.node);
        let (cos, sin, x_strides) = ops.state;
        if let Some(node) = node_x {
            // The same switch as the flash kernels' output layout: both remove the copies
            // around the model's `swap_dims(1, 2)` + `reshape`, and A/B runs flip them together.
            let like = (flash_layout() == FlashLayout::Bshd).then_some(&x_strides[..]);
            grads.register::<CudaCube>(node.id, rope_apply_ordered(dy, &cos, &sin, true, like));
        }
    }
}

/// Rotary embedding of `x: [batch, heads, seq, head_dim]` through the fused kernels on the
/// autodiff CUDA backend; differentiable in `x` (the tables are constants). Saves only the
/// tables.
pub fn rope_autodiff(
    x: BurnTensor<CudaAutodiff, 4>,
    cos: BurnTensor<CudaCube, 2>,
    sin: BurnTensor<CudaCube, 2>,
) -> BurnTensor<CudaAutodiff, 4> {
    let cos = rope_table(cos.into_primitive().tensor());
    let sin = rope_table(sin.into_primitive().tensor());
    let x = x.into_primitive().tensor();
    let out = match RopeBackward
        .prepare::<NoCheckpointing>([x.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let st = x.primitive.meta.strides();
            let x_strides = [st[0], st[1], st[2], st[3]];
            let y = rope_apply(x.primitive, &cos, &sin, false);
            prep.finish((cos, sin, x_strides), y)
        }
        OpsKind::UnTracked(prep) => prep.finish(rope_apply(x.primitive, &cos, &sin, false)),
    };
    BurnTensor::from_primitive(TensorPrimitive::Float(out))
}

/// [`rope_autodiff`]'s forward on the plain backend.
pub fn rope_plain(
    x: BurnTensor<CudaCube, 4>,
    cos: BurnTensor<CudaCube, 2>,
    sin: BurnTensor<CudaCube, 2>,
) -> BurnTensor<CudaCube, 4> {
    let cos = rope_table(cos.into_primitive().tensor());
    let sin = rope_table(sin.into_primitive().tensor());
    wrap(rope_apply(x.into_primitive().tensor(), &cos, &sin, false))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The default cubes per SM of the staged RMSNorm backward at the Llama widths (bf16) are
    /// the ones calls DQ-DS measured fastest: about 48 KB of rows in flight per SM.
    #[test]
    fn staged_norm_cubes_follow_bytes_in_flight() {
        if std::env::var_os("SMP_BURN_NORM_BWD_STAGED").is_some() {
            return;
        }
        for (hidden, accumulate, cubes) in [
            (2048, false, 4),
            (2048, true, 4),
            (4096, false, 3),
            (4096, true, 2),
            (5120, false, 2),
            (5120, true, 2),
        ] {
            let l = norm_bwd_staged_layout(hidden / 8, 8, 2, accumulate).unwrap();
            assert_eq!(
                (l.group, l.cubes_per_sm),
                (1, cubes),
                "hidden {hidden}, adding {accumulate}: {l:?}"
            );
        }
    }

    /// The staged RMSNorm backward's shape keeps every thread's row slice short (the loops are
    /// unrolled), covers the row, and fits its two stages plus the f32 rows into an SM's
    /// shared memory; rows too long for that fall back to the register kernel.
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
                let Some(l) = norm_bwd_staged_layout(row_vectors, nv, elem_bytes, accumulate)
                else {
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
}
