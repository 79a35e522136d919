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
//! or a comma list such as `gemm,attention,norm`).
//!
//! The fused LM-head loss (`loss`) is the exception to "CUDA only": its chunked autodiff op is
//! written with Burn's tensor ops, so it also serves `NdArray<f32>` (with and without autodiff),
//! where the CPU tests check it against the reference.

use std::any::{Any, TypeId};
use std::sync::atomic::{AtomicU16, Ordering};

use burn::backend::Autodiff;
use burn::tensor::{Int, Tensor, backend::Backend};
use burn_ndarray::NdArray;

use crate::ops;

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

/// Which fast paths are on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FastPaths {
    /// Linear layers through cuBLAS.
    pub gemm: bool,
    /// Causal attention through the flash kernels (bf16/f16, head dim 64 or 128).
    pub attention: bool,
    /// RMSNorm through the fused kernels (forward and backward).
    pub norm: bool,
    /// Rotary embeddings through the fused kernels.
    pub rope: bool,
    /// The SwiGLU gate through the fused kernels.
    pub swiglu: bool,
    /// `ops::linear_cross_entropy` through the chunked LM-head loss (CUDA and NdArray).
    pub loss: bool,
    /// FSDP's AdamW step as one kernel per shard run ([`crate::cuda::adamw`]).
    pub adamw: bool,
    /// FSDP's gradients packed into the flat buffer by one cast-and-copy kernel per parameter
    /// ([`crate::cuda::flat`]) instead of a cast and a `cat`.
    pub flat: bool,
    /// The LM-head loss's softmax statistics and logit gradient through the fused kernels of
    /// [`crate::cuda::xent`] (inside the chunked loss, on CUDA).
    pub xent: bool,
    /// The token embedding's gradient through one deterministic kernel
    /// ([`crate::cuda::embedding`]) instead of Burn's `select_assign`, which ran one thread per
    /// column over every token (1.6 ms per 1.2B-model step on an H200).
    pub embed: bool,
    /// Gradients that meet at one tensor (an input shared by q/k/v or by gate/up, the residual
    /// stream at each norm) are summed by the op whose backward runs second, in its own output
    /// pass (cuBLAS `beta = 1`, the RMSNorm backward kernel) instead of a separate add of Burn's
    /// autodiff ([`crate::cuda::take_grad_for_accumulation`]).
    pub accumulate: bool,
}

/// The path names [`FastPaths::parse`] accepts, in bit order.
const NAMES: [&str; 11] = [
    "gemm",
    "attention",
    "norm",
    "rope",
    "swiglu",
    "loss",
    "adamw",
    "flat",
    "xent",
    "embed",
    "accumulate",
];

impl FastPaths {
    /// Every fast path on.
    pub const ALL: Self = Self {
        gemm: true,
        attention: true,
        norm: true,
        rope: true,
        swiglu: true,
        loss: true,
        adamw: true,
        flat: true,
        xent: true,
        embed: true,
        accumulate: true,
    };
    /// Only the reference ops.
    pub const NONE: Self = Self {
        gemm: false,
        attention: false,
        norm: false,
        rope: false,
        swiglu: false,
        loss: false,
        adamw: false,
        flat: false,
        xent: false,
        embed: false,
        accumulate: false,
    };

    /// Parses `all`, `none` or a comma list of path names (`gemm`, `attention`, `norm`,
    /// `rope`, `swiglu`, `loss`, `adamw`, `flat`, `xent`, `embed`, `accumulate`).
    pub fn parse(s: &str) -> Result<Self, String> {
        match s.trim() {
            "" | "all" => return Ok(Self::ALL),
            "none" => return Ok(Self::NONE),
            _ => {}
        }
        let mut p = Self::NONE;
        for name in s.split(',').map(str::trim) {
            let flag = match name {
                "gemm" => &mut p.gemm,
                "attention" => &mut p.attention,
                "norm" => &mut p.norm,
                "rope" => &mut p.rope,
                "swiglu" => &mut p.swiglu,
                "loss" => &mut p.loss,
                "adamw" => &mut p.adamw,
                "flat" => &mut p.flat,
                "xent" => &mut p.xent,
                "embed" => &mut p.embed,
                "accumulate" => &mut p.accumulate,
                other => {
                    return Err(format!(
                        "unknown fast path {other:?} (known: {}; or all / none)",
                        NAMES.join(", ")
                    ));
                }
            };
            *flag = true;
        }
        Ok(p)
    }

    fn flags(self) -> [bool; 11] {
        [
            self.gemm,
            self.attention,
            self.norm,
            self.rope,
            self.swiglu,
            self.loss,
            self.adamw,
            self.flat,
            self.xent,
            self.embed,
            self.accumulate,
        ]
    }

    /// Bit 0 marks "set"; bit `i + 1` is flag `i` of [`Self::flags`].
    fn bits(self) -> u16 {
        self.flags()
            .iter()
            .enumerate()
            .fold(1, |b, (i, &on)| b | (on as u16) << (i + 1))
    }

    fn from_bits(b: u16) -> Self {
        let on = |i: usize| b & (1 << (i + 1)) != 0;
        Self {
            gemm: on(0),
            attention: on(1),
            norm: on(2),
            rope: on(3),
            swiglu: on(4),
            loss: on(5),
            adamw: on(6),
            flat: on(7),
            xent: on(8),
            embed: on(9),
            accumulate: on(10),
        }
    }
}

/// 0 = not yet read from the environment.
static FLAGS: AtomicU16 = AtomicU16::new(0);

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
pub(crate) fn same<T: 'static, U: 'static>(t: T) -> U {
    *(Box::new(t) as Box<dyn Any>)
        .downcast::<U>()
        .unwrap_or_else(|_| unreachable!("TypeId checked by the caller"))
}

/// `[master, exp_avg, exp_avg_sq]` of a shard.
pub(crate) type AdamWState<B> = [Tensor<B, 1>; 3];

/// The updated state and, when asked for, the weights in the compute dtype.
pub(crate) type AdamWUpdate<B> = (AdamWState<B>, Option<Tensor<B, 1>>);

/// `ops::linear_cross_entropy` through the chunked loss ([`ops::linear_cross_entropy_chunked`]
/// with [`ops::default_loss_chunk_tokens`], or on CUDA with the fused softmax
/// [`ops::loss_chunk_tokens`] at the logits' own size) on the backends it was checked on: the
/// CUDA backend and `NdArray<f32>`, each with and without autodiff. `None` means "use the
/// reference".
pub(crate) fn linear_cross_entropy<B: Backend>(
    x: &Tensor<B, 2>,
    w: &Tensor<B, 2>,
    targets: &Tensor<B, 1, Int>,
) -> Option<Tensor<B, 1>> {
    let [tokens, _] = x.dims();
    let [vocab, _] = w.dims();
    let b = TypeId::of::<B>();
    let on_ndarray =
        b == TypeId::of::<Autodiff<NdArray<f32>>>() || b == TypeId::of::<NdArray<f32>>();
    let on_cuda = is_cuda::<B>();
    if !fast_paths().loss || tokens == 0 || x.dtype() != w.dtype() || !(on_cuda || on_ndarray) {
        return None;
    }
    let chunk_tokens = if on_cuda && fast_paths().xent {
        ops::loss_chunk_tokens(vocab, x.dtype().size())
    } else {
        ops::default_loss_chunk_tokens(vocab)
    };
    Some(ops::linear_cross_entropy_chunked(
        x.clone(),
        w.clone(),
        targets.clone(),
        chunk_tokens,
    ))
}

/// The chunked loss as one autodiff op ([`ops::linear_cross_entropy_autodiff`]) when `B` is
/// `Autodiff<I>` for an inner backend `I` we can name: the CUDA backend or `NdArray<f32>`. Rust
/// cannot name the inner backend of an arbitrary `B`, hence the list.
pub(crate) fn lce_autodiff<B: Backend>(
    x: &Tensor<B, 2>,
    w: &Tensor<B, 2>,
    targets: &Tensor<B, 1, Int>,
    chunk_tokens: usize,
) -> Option<Tensor<B, 1>> {
    fn on<B: Backend, I: Backend>(
        x: &Tensor<B, 2>,
        w: &Tensor<B, 2>,
        targets: &Tensor<B, 1, Int>,
        chunk_tokens: usize,
    ) -> Option<Tensor<B, 1>> {
        (TypeId::of::<B>() == TypeId::of::<Autodiff<I>>()).then(|| {
            same(ops::linear_cross_entropy_autodiff::<I>(
                same(x.clone()),
                same(w.clone()),
                same(targets.clone()),
                chunk_tokens,
            ))
        })
    }
    #[cfg(feature = "cuda")]
    if let Some(loss) = on::<B, crate::cuda::CudaCube>(x, w, targets, chunk_tokens)
        .or_else(|| on::<B, crate::cuda::bridge::FusedCuda>(x, w, targets, chunk_tokens))
    {
        return Some(loss);
    }
    on::<B, NdArray<f32>>(x, w, targets, chunk_tokens)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_switches() {
        assert_eq!(FastPaths::parse("all").unwrap(), FastPaths::ALL);
        assert_eq!(FastPaths::parse("none").unwrap(), FastPaths::NONE);
        assert_eq!(
            FastPaths::parse(
                "gemm, attention,norm,rope,swiglu,loss,adamw,flat,xent,embed,accumulate"
            )
            .unwrap(),
            FastPaths::ALL
        );
        let only_gemm = FastPaths::parse("gemm").unwrap();
        assert!(only_gemm.gemm && !only_gemm.attention && !only_gemm.loss);
        assert_eq!(FastPaths::from_bits(only_gemm.bits()), only_gemm);
        let some = FastPaths::parse("norm,loss").unwrap();
        assert_eq!(
            some,
            FastPaths {
                norm: true,
                loss: true,
                ..FastPaths::NONE
            }
        );
        // Every single switch survives the round trip through the atomic's bits.
        for name in NAMES {
            let p = FastPaths::parse(name).unwrap();
            assert_eq!(p.flags().iter().filter(|&&on| on).count(), 1, "{name}");
            assert_eq!(FastPaths::from_bits(p.bits()), p, "{name}");
        }
        for p in [FastPaths::ALL, FastPaths::NONE] {
            assert_eq!(FastPaths::from_bits(p.bits()), p);
        }
        let e = FastPaths::parse("gemm,flash2").unwrap_err();
        assert!(e.contains("flash2") && e.contains("swiglu"), "{e}");
    }

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

    #[test]
    fn chunked_loss_op_serves_autodiff_ndarray_only() {
        type B = burn_ndarray::NdArray<f32>;
        let dev = Default::default();
        let t = Tensor::<B, 1, Int>::from_ints([0, 2], &dev);
        let x = Tensor::<B, 2>::ones([2, 3], &dev);
        let w = Tensor::<B, 2>::ones([4, 3], &dev);
        // The plain backend has no autodiff op; its chunked forward is called directly.
        assert!(lce_autodiff(&x, &w, &t, 1).is_none());
        type Ad = Autodiff<B>;
        let xa = Tensor::<Ad, 2>::from_inner(x).require_grad();
        let wa = Tensor::<Ad, 2>::from_inner(w).require_grad();
        let ta = Tensor::<Ad, 1, Int>::from_inner(t);
        assert!(lce_autodiff(&xa, &wa, &ta, 1).is_some());
    }
}
