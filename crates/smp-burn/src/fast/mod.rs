//! Dispatch from the reference ops in [`crate::ops`] to the fast CUDA paths.
//!
//! The model code calls `ops::linear` (and friends) for any Burn backend. When the backend is
//! the one the fast paths serve ([`crate::cuda::CudaCube`], with or without autodiff) and the
//! path is switched on, the op runs through cuBLAS / our kernels instead of Burn's stock ops.
//! Rust has no specialization, so the check is a `TypeId` comparison: it keeps the model generic
//! over every backend (CPU tests, other GPUs) without a backend-extension trait bound on every
//! user of the model.
//!
//! Every fast path can be switched off, for A/B runs and for bisecting a wrong result, through
//! [`crate::KernelConfig::fast_paths`] (in code, or `fast=gemm+attention` in its environment
//! variable).
//!
//! The fused LM-head loss (`loss`) is the exception to "CUDA only": its chunked autodiff op is
//! written with Burn's tensor ops, so it also serves `NdArray<f32>` (with and without autodiff),
//! where the CPU tests check it against the reference.

use burn::tensor::Tensor;

// The CUDA dispatch; a build without the `cuda` feature has none, and every op takes the
// reference (or, for the loss, the chunked op on NdArray).
#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "cuda")]
pub(crate) use cuda::*;
#[cfg(not(feature = "cuda"))]
mod cpu_only;
#[cfg(not(feature = "cuda"))]
pub(crate) use cpu_only::*;

pub use crate::kernel_config::{FastPaths, fast_paths};

/// `[master, exp_avg, exp_avg_sq]` of a shard.
pub(crate) type AdamWState<B> = [Tensor<B, 1>; 3];

/// The updated state and, when asked for, the weights in the compute dtype.
pub(crate) type AdamWUpdate<B> = (AdamWState<B>, Option<Tensor<B, 1>>);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_backends_take_the_reference() {
        type B = burn_ndarray::NdArray<f32>;
        let dev = Default::default();
        let x = Tensor::<B, 2>::ones([2, 3], &dev);
        let w = Tensor::<B, 2>::ones([4, 3], &dev);
        assert!(linear(&x, &w).is_none());
        let w1 = Tensor::<B, 1>::ones([3], &dev);
        assert!(rms_norm(&x, &w1, 1e-6).is_none());
        assert!(swiglu(&x, &x).is_none());
        let x4 = Tensor::<B, 4>::ones([1, 2, 3, 4], &dev);
        let table = Tensor::<B, 2>::ones([3, 4], &dev);
        assert!(rope(&x4, &table, &table).is_none());
    }
}
