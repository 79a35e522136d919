//! Dispatch from the reference ops in [`crate::ops`] to the fast CUDA paths.
//!
//! The model code calls `ops::linear` (and friends) for any Burn backend. When the backend is
//! the one the fast paths serve ([`crate::cuda::CudaCube`], with or without autodiff) and the
//! path is switched on, the op runs through cuBLAS / our kernels instead of Burn's stock ops.
//! Rust has no specialization, so the check is a `TypeId` comparison: it keeps the model generic
//! over every backend (CPU tests, other GPUs) without a backend-extension trait bound on every
//! user of the model.
//!
//! Every fast path can be switched off, for A/B runs and for bisecting a wrong result: with
//! [`set_fast_paths`] or the environment variable `SMP_BURN_FAST` (`all`, the default; `none`;
//! or a comma list such as `gemm,attention`).

use std::any::{Any, TypeId};
use std::sync::atomic::{AtomicU8, Ordering};

use burn::tensor::{Tensor, backend::Backend};

use crate::cuda::gemm::{self, CudaAutodiff};
use crate::cuda::{CudaCube, attention};

/// Which fast paths are on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FastPaths {
    /// Linear layers through cuBLAS.
    pub gemm: bool,
    /// Causal attention through the flash kernels (bf16/f16, head dim 64 or 128).
    pub attention: bool,
}

impl FastPaths {
    /// Every fast path on.
    pub const ALL: Self = Self {
        gemm: true,
        attention: true,
    };
    /// Only the reference ops.
    pub const NONE: Self = Self {
        gemm: false,
        attention: false,
    };

    /// Parses `all`, `none` or a comma list of path names (`gemm`, `attention`).
    pub fn parse(s: &str) -> Result<Self, String> {
        match s.trim() {
            "" | "all" => return Ok(Self::ALL),
            "none" => return Ok(Self::NONE),
            _ => {}
        }
        let mut p = Self::NONE;
        for name in s.split(',').map(str::trim) {
            match name {
                "gemm" => p.gemm = true,
                "attention" => p.attention = true,
                other => {
                    return Err(format!(
                        "unknown fast path {other:?} (known: gemm, attention; or all / none)"
                    ));
                }
            }
        }
        Ok(p)
    }

    fn bits(self) -> u8 {
        1 | (self.gemm as u8) << 1 | (self.attention as u8) << 2
    }

    fn from_bits(b: u8) -> Self {
        Self {
            gemm: b & 2 != 0,
            attention: b & 4 != 0,
        }
    }
}

/// 0 = not yet read from the environment.
static FLAGS: AtomicU8 = AtomicU8::new(0);

/// The fast paths in force (from [`set_fast_paths`], else `SMP_BURN_FAST`, else all).
pub fn fast_paths() -> FastPaths {
    let b = FLAGS.load(Ordering::Relaxed);
    if b != 0 {
        return FastPaths::from_bits(b);
    }
    let p = match std::env::var("SMP_BURN_FAST") {
        Ok(v) => FastPaths::parse(&v).unwrap_or_else(|e| {
            tracing::warn!("SMP_BURN_FAST: {e}; using all fast paths");
            FastPaths::ALL
        }),
        Err(_) => FastPaths::ALL,
    };
    FLAGS.store(p.bits(), Ordering::Relaxed);
    p
}

/// Switches fast paths on or off for the whole process.
pub fn set_fast_paths(p: FastPaths) {
    FLAGS.store(p.bits(), Ordering::Relaxed);
}

/// Moves a value to another type that the caller proved identical with `TypeId`.
fn same<T: 'static, U: 'static>(t: T) -> U {
    *(Box::new(t) as Box<dyn Any>)
        .downcast::<U>()
        .unwrap_or_else(|_| unreachable!("TypeId checked by the caller"))
}

/// `x w^T` through cuBLAS when `B` is the CUDA backend and the dtypes allow; `None` means
/// "use the reference".
pub(crate) fn linear<B: Backend, const D: usize>(
    x: &Tensor<B, D>,
    w: &Tensor<B, 2>,
) -> Option<Tensor<B, D>> {
    if !fast_paths().gemm || !gemm::supports(x.dtype(), w.dtype()) {
        return None;
    }
    let b = TypeId::of::<B>();
    if b == TypeId::of::<CudaAutodiff>() {
        let y = gemm::linear_autodiff::<D>(same(x.clone()), same(w.clone()));
        Some(same(y))
    } else if b == TypeId::of::<CudaCube>() {
        let y = gemm::linear_plain::<D>(same(x.clone()), same(w.clone()));
        Some(same(y))
    } else {
        None
    }
}

/// Causal grouped-query attention through the flash kernels when `B` is the CUDA backend and
/// the shapes and dtypes allow; `None` means "use the reference".
pub(crate) fn causal_attention<B: Backend>(
    q: &Tensor<B, 4>,
    k: &Tensor<B, 4>,
    v: &Tensor<B, 4>,
) -> Option<Tensor<B, 4>> {
    if !fast_paths().attention
        || q.dtype() != k.dtype()
        || k.dtype() != v.dtype()
        || k.dims() != v.dims()
        || !attention::supports(&q.dims(), &k.dims(), q.dtype())
    {
        return None;
    }
    let b = TypeId::of::<B>();
    if b == TypeId::of::<CudaAutodiff>() {
        let o =
            attention::causal_attention_autodiff(same(q.clone()), same(k.clone()), same(v.clone()));
        Some(same(o))
    } else if b == TypeId::of::<CudaCube>() {
        let o =
            attention::causal_attention_plain(same(q.clone()), same(k.clone()), same(v.clone()));
        Some(same(o))
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_switches() {
        assert_eq!(FastPaths::parse("all").unwrap(), FastPaths::ALL);
        assert_eq!(FastPaths::parse("none").unwrap(), FastPaths::NONE);
        assert_eq!(FastPaths::parse("gemm,attention").unwrap(), FastPaths::ALL);
        let only_gemm = FastPaths::parse("gemm").unwrap();
        assert!(only_gemm.gemm && !only_gemm.attention);
        assert_eq!(FastPaths::from_bits(only_gemm.bits()), only_gemm);
        let e = FastPaths::parse("gemm,flash2").unwrap_err();
        assert!(e.contains("flash2"), "{e}");
    }

    #[test]
    fn cpu_backends_take_the_reference() {
        type B = burn_ndarray::NdArray<f32>;
        let dev = Default::default();
        let x = Tensor::<B, 2>::ones([2, 3], &dev);
        let w = Tensor::<B, 2>::ones([4, 3], &dev);
        assert!(linear(&x, &w).is_none());
    }
}
