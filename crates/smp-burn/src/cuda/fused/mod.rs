//! Fused RMSNorm, SwiGLU and rotary-embedding kernels (forward and backward) in CubeCL, wired
//! into Burn's autodiff: the stand-in for Transformer Engine's fused elementwise kernels.
//!
//! Why: the reference ops in [`crate::ops`] are chains of Burn kernels (RMSNorm: cast, square,
//! mean, add, sqrt, recip, mul, cast, mul; RoPE: two narrows, a neg, a cat, two casts, three
//! products and a sum), each a full pass over the activation, and autodiff keeps their
//! intermediates (RMSNorm keeps an f32 copy of its input) and runs a similar chain backward.
//! These ops are memory-bound, so the figure of merit is bytes moved: here each is one pass
//! forward and one backward, reading the inputs once and writing the outputs once. They also
//! cut the number of ops the host issues, which matters because a Burn training step is bound
//! by the host's issue rate.
//!
//! - RMSNorm ([`rms_norm_forward`], [`rms_norm_backward`]): one cube per row forward; the mean
//!   square is accumulated in f32 (a warp sum, then the warps' partials through shared memory
//!   in a fixed order). The forward saves `x` and the per-row inverse rms (f32). The backward's
//!   cubes each own a block of rows: they write `dx` and one row of per-block `dweight` partial
//!   sums (f32), which a second kernel adds up per column in a fixed order. No atomics: results
//!   are bitwise reproducible.
//! - SwiGLU ([`swiglu_forward`]): `silu(gate) * up` elementwise; the backward writes `dgate`
//!   and `dup` in one pass. All arithmetic in f32.
//! - RoPE ([`rope_apply`], Hugging Face's `rotate_half` layout): each thread rotates a vector
//!   of pairs `(x[j], x[j + d/2])` for several heads at one position. The input may be strided
//!   (the model feeds `reshape + swap_dims` views); only its last dimension must be contiguous,
//!   otherwise it is copied first. The forward's output is contiguous; the backward's `dx` is
//!   written in x's dimension order, so the model's gradient path back to `[B, S, H * D]` needs
//!   no copy.
//!
//! Semantics follow the reference ops, with one rounding fewer where the reference rounds an
//! intermediate to bf16 (for example `silu(gate)` before the product): results agree with the
//! reference to the input dtype's rounding, which `examples/fused_check.rs` checks on the GPU.
//! Inputs are read in vectors of up to 16 bytes where shapes, strides and offsets allow.

// Kernel code is expanded by `#[cube]`, which has no `div_ceil` on runtime integers.
#![allow(clippy::manual_div_ceil)]

mod rms_norm;
mod rope;
mod swiglu;

pub use rms_norm::{
    rms_norm_autodiff, rms_norm_backward, rms_norm_forward, rms_norm_plain, rms_norm_supports,
};
pub use rope::{rope_apply, rope_apply_ordered, rope_autodiff, rope_plain, rope_table};
pub use swiglu::{swiglu_autodiff, swiglu_backward, swiglu_forward, swiglu_plain};

use burn::tensor::{DType, Tensor as BurnTensor, TensorPrimitive};
use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::CudaRuntime;
use cubecl::prelude::*;

use super::device::CudaCube;

type Cube = CubeTensor<CudaRuntime>;

/// Threads per cube of the elementwise kernels (SwiGLU, RoPE) and of the column sum.
const ELEMWISE_THREADS: usize = 256;

// ------------------------------------------------------------------------------------------
// Device side: cube reductions
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

// ------------------------------------------------------------------------------------------
// Host side: checks and launch shapes shared by the ops
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

/// A CubeCL buffer as a float tensor of the plain CUDA backend.
fn wrap<const D: usize>(t: Cube) -> BurnTensor<CudaCube, D> {
    BurnTensor::from_primitive(TensorPrimitive::Float(t))
}
