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
use burn::tensor::{DType, Int, Tensor, TensorPrimitive, backend::Backend};
use burn_ndarray::NdArray;

use crate::cuda::gemm::{self, CudaAutodiff};
use crate::cuda::{CudaCube, attention, fused};
use crate::ops;

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

/// The input gradients of a linear layer (`dx = dy w`, `dw = dy^T x`, as requested) through
/// cuBLAS in one ordered batch when `B` is the plain CUDA backend (the chunked loss's backward
/// runs on the inner backend); `None` means "use Burn's matmul".
#[allow(clippy::type_complexity)]
pub(crate) fn linear_grads<B: Backend>(
    dy: &Tensor<B, 2>,
    x: &Tensor<B, 2>,
    w: &Tensor<B, 2>,
    want_dx: bool,
    want_dw: bool,
) -> Option<(Option<Tensor<B, 2>>, Option<Tensor<B, 2>>)> {
    if !fast_paths().gemm
        || TypeId::of::<B>() != TypeId::of::<CudaCube>()
        || !gemm::supports(dy.dtype(), w.dtype())
        || x.dtype() != w.dtype()
    {
        return None;
    }
    let prim = |t: &Tensor<B, 2>| to_cube(t.clone());
    let (dx, dw) = gemm::linear_backward(
        prim(dy),
        want_dw.then(|| prim(x)),
        want_dx.then(|| prim(w)),
        &x.shape(),
        None,
    );
    Some((dx.map(from_cube), dw.map(from_cube)))
}

/// Whether a float dtype is one the fused kernels take.
fn fused_dtype(d: DType) -> bool {
    matches!(d, DType::F32 | DType::F16 | DType::BF16)
}

/// RMSNorm over the last dimension through the fused kernels when `B` is the CUDA backend and
/// the dtypes allow; `None` means "use the reference".
pub(crate) fn rms_norm<B: Backend, const D: usize>(
    x: &Tensor<B, D>,
    w: &Tensor<B, 1>,
    eps: f64,
) -> Option<Tensor<B, D>> {
    let dims = x.dims();
    let hidden = dims[D - 1];
    let rows: usize = dims[..D - 1].iter().product();
    if !fast_paths().norm
        || x.dtype() != w.dtype()
        || !fused_dtype(x.dtype())
        || w.dims() != [hidden]
        || rows == 0
        || !fused::rms_norm_supports(hidden)
    {
        return None;
    }
    let b = TypeId::of::<B>();
    if b == TypeId::of::<CudaAutodiff>() {
        // In its own shape: a reshape in front would make the reshape, not `x`, the op's
        // parent, and the gradient sum at `x` (fast path `accumulate`) could not happen.
        let y = fused::rms_norm_autodiff::<D>(same(x.clone()), same(w.clone()), eps);
        Some(same(y))
    } else if b == TypeId::of::<CudaCube>() {
        let y = fused::rms_norm_plain(
            same(x.clone().reshape([rows, hidden])),
            same(w.clone()),
            eps,
        );
        Some(same::<_, Tensor<B, 2>>(y).reshape(dims))
    } else {
        None
    }
}

/// `silu(gate) * up` through the fused kernels when `B` is the CUDA backend; `None` means "use
/// the reference".
pub(crate) fn swiglu<B: Backend, const D: usize>(
    gate: &Tensor<B, D>,
    up: &Tensor<B, D>,
) -> Option<Tensor<B, D>> {
    if !fast_paths().swiglu
        || gate.dtype() != up.dtype()
        || !fused_dtype(gate.dtype())
        || gate.dims() != up.dims()
        || gate.shape().num_elements() == 0
    {
        return None;
    }
    let b = TypeId::of::<B>();
    if b == TypeId::of::<CudaAutodiff>() {
        Some(same(fused::swiglu_autodiff::<D>(
            same(gate.clone()),
            same(up.clone()),
        )))
    } else if b == TypeId::of::<CudaCube>() {
        Some(same(fused::swiglu_plain::<D>(
            same(gate.clone()),
            same(up.clone()),
        )))
    } else {
        None
    }
}

/// The token embedding with [`crate::cuda::embedding`]'s gradient when `B` is the autodiff
/// CUDA backend; `None` means "use the reference" (on the plain backend the forward is the
/// same gather either way).
pub(crate) fn embedding<B: Backend>(
    weight: &Tensor<B, 2>,
    ids: &Tensor<B, 2, Int>,
) -> Option<Tensor<B, 3>> {
    if !fast_paths().embed
        || !fused_dtype(weight.dtype())
        || TypeId::of::<B>() != TypeId::of::<CudaAutodiff>()
    {
        return None;
    }
    Some(same(crate::cuda::embedding::embedding_autodiff(
        same(weight.clone()),
        same(ids.clone()),
    )))
}

/// Rotary embeddings through the fused kernels when `B` is the CUDA backend, the tables are
/// constants (not differentiated) and the shapes match; `None` means "use the reference".
pub(crate) fn rope<B: Backend>(
    x: &Tensor<B, 4>,
    cos: &Tensor<B, 2>,
    sin: &Tensor<B, 2>,
) -> Option<Tensor<B, 4>> {
    let [_, _, seq, head_dim] = x.dims();
    if !fast_paths().rope
        || !fused_dtype(x.dtype())
        || !fused_dtype(cos.dtype())
        || !fused_dtype(sin.dtype())
        || cos.dims() != [seq, head_dim]
        || sin.dims() != [seq, head_dim]
        || !head_dim.is_multiple_of(2)
        || x.shape().num_elements() == 0
        || cos.is_require_grad()
        || sin.is_require_grad()
    {
        return None;
    }
    let b = TypeId::of::<B>();
    if b == TypeId::of::<CudaAutodiff>() {
        let inner = |t: &Tensor<B, 2>| same::<_, Tensor<CudaAutodiff, 2>>(t.clone()).inner();
        let y = fused::rope_autodiff(same(x.clone()), inner(cos), inner(sin));
        Some(same(y))
    } else if b == TypeId::of::<CudaCube>() {
        let y = fused::rope_plain(same(x.clone()), same(cos.clone()), same(sin.clone()));
        Some(same(y))
    } else {
        None
    }
}

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
    let served = [
        TypeId::of::<CudaAutodiff>(),
        TypeId::of::<CudaCube>(),
        TypeId::of::<Autodiff<NdArray<f32>>>(),
        TypeId::of::<NdArray<f32>>(),
    ];
    if !fast_paths().loss || tokens == 0 || x.dtype() != w.dtype() || !served.contains(&b) {
        return None;
    }
    let on_cuda = b == TypeId::of::<CudaAutodiff>() || b == TypeId::of::<CudaCube>();
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
    on::<B, CudaCube>(x, w, targets, chunk_tokens)
        .or_else(|| on::<B, NdArray<f32>>(x, w, targets, chunk_tokens))
}

/// Each row's log-sum-exp and loss of `logits` through [`crate::cuda::xent::row_stats`] when
/// `B` is the CUDA backend; `None` means "use the reference".
pub(crate) fn xent_row_stats<B: Backend>(
    logits: &Tensor<B, 2>,
    targets: &Tensor<B, 1, Int>,
) -> Option<(Tensor<B, 1>, Tensor<B, 1>)> {
    if !fast_paths().xent || TypeId::of::<B>() != TypeId::of::<CudaCube>() {
        return None;
    }
    let (lse, loss) = crate::cuda::xent::row_stats(to_cube(logits.clone()), int_to_cube(targets));
    Some((from_cube(lse), from_cube(loss)))
}

/// The loss's gradient with respect to the logits, in the logits' dtype, through
/// [`crate::cuda::xent::softmax_grad`] when `B` is the CUDA backend; `None` means "use the
/// reference".
pub(crate) fn xent_softmax_grad<B: Backend>(
    logits: &Tensor<B, 2>,
    lse: &Tensor<B, 1>,
    targets: &Tensor<B, 1, Int>,
    scale: &Tensor<B, 2>,
) -> Option<Tensor<B, 2>> {
    if !fast_paths().xent || TypeId::of::<B>() != TypeId::of::<CudaCube>() {
        return None;
    }
    let g = crate::cuda::xent::softmax_grad(
        to_cube(logits.clone()),
        to_cube(lse.clone()),
        int_to_cube(targets),
        to_cube(scale.clone()),
    );
    Some(from_cube(g))
}

/// The CubeCL tensor behind an int tensor of `B`, which the caller proved to be [`CudaCube`].
fn int_to_cube<B: Backend, const D: usize>(
    t: &Tensor<B, D, Int>,
) -> burn_cubecl::tensor::CubeTensor<cubecl::cuda::CudaRuntime> {
    same::<Tensor<B, D, Int>, Tensor<CudaCube, D, Int>>(t.clone()).into_primitive()
}

/// `[master, exp_avg, exp_avg_sq]` of a shard.
pub(crate) type AdamWState<B> = [Tensor<B, 1>; 3];

/// The updated state and, when asked for, the weights in the compute dtype.
pub(crate) type AdamWUpdate<B> = (AdamWState<B>, Option<Tensor<B, 1>>);

/// FSDP's AdamW step through the fused kernel when `B` is the CUDA backend and the state is
/// f32 (the gradient may be f32, bf16 or f16). `state` is `[master, exp_avg, exp_avg_sq]`,
/// taken by value so that the kernel can update the buffers in place: a second handle would
/// make it copy each one first (three shard-sized copies per unit and step). With `copy_dtype` the kernel also returns the updated weights in
/// that dtype. `Err(state)` hands the state back: use the reference.
#[allow(clippy::too_many_arguments)]
pub(crate) fn adamw_step<B: Backend>(
    state: AdamWState<B>,
    grad: &Tensor<B, 1>,
    grad_scale: &Tensor<B, 1>,
    opt: &crate::optim::AdamW,
    lr: f64,
    step: u64,
    runs: &[(std::ops::Range<usize>, crate::optim::RunRates)],
    copy_dtype: Option<DType>,
) -> Result<AdamWUpdate<B>, AdamWState<B>> {
    if !fast_paths().adamw
        || TypeId::of::<B>() != TypeId::of::<CudaCube>()
        || state
            .iter()
            .chain([grad_scale])
            .any(|t| t.dtype() != DType::F32)
        || !fused_dtype(grad.dtype())
        || copy_dtype.is_some_and(|d| !fused_dtype(d))
    {
        return Err(state);
    }
    let [master, exp_avg, exp_avg_sq] = state.map(to_cube);
    let (inv_bias1, inv_bias2) = (
        1.0 / (1.0 - opt.beta1.powi(step as i32)),
        1.0 / (1.0 - opt.beta2.powi(step as i32)),
    );
    let hp = crate::cuda::adamw::AdamWStep {
        lr: lr as f32,
        beta1: opt.beta1 as f32,
        beta2: opt.beta2 as f32,
        eps: opt.eps as f32,
        inv_bias1: inv_bias1 as f32,
        inv_bias2: inv_bias2 as f32,
    };
    let (m, a, v, copy) = crate::cuda::adamw::adamw_step(
        master,
        exp_avg,
        exp_avg_sq,
        to_cube(grad.clone()),
        to_cube(grad_scale.clone()),
        hp,
        runs,
        copy_dtype,
    );
    Ok(([m, a, v].map(from_cube), copy.map(from_cube)))
}

/// `sum_r weight_r * sum(t[range_r]^2)` (the gradient norm's share of a shard) through one
/// deterministic CubeCL reduction (in f32) when `B` is the CUDA backend and `t` is f32, bf16 or
/// f16; part of the `adamw` switch, since only the optimizer step uses it. `None` means "use the reference".
pub(crate) fn weighted_sq_sum<B: Backend>(
    t: &Tensor<B, 1>,
    runs: &[(std::ops::Range<usize>, f32)],
) -> Option<Tensor<B, 1>> {
    if !fast_paths().adamw
        || TypeId::of::<B>() != TypeId::of::<CudaCube>()
        || !fused_dtype(t.dtype())
    {
        return None;
    }
    let x = to_cube(t.clone());
    Some(from_cube(crate::cuda::adamw::weighted_sq_sum(x, runs)))
}

/// Whether the packing kernels serve these pieces: the `flat` path is on, `B` is the CUDA
/// backend and `dtype` a float type the kernels write.
fn packs_on_cuda<B: Backend>(pieces: &[Tensor<B, 1>], dtype: DType) -> bool {
    fast_paths().flat
        && TypeId::of::<B>() == TypeId::of::<CudaCube>()
        && !pieces.is_empty()
        && fused_dtype(dtype)
}

/// One flat tensor of `dtype` and `total` elements holding `pieces` back to back, then zeros,
/// through one cast-and-copy kernel per piece when `B` is the CUDA backend; `Err(pieces)` hands
/// them back for the reference (`cast` + `cat`).
pub(crate) fn pack<B: Backend>(
    pieces: Vec<Tensor<B, 1>>,
    total: usize,
    dtype: DType,
) -> Result<Tensor<B, 1>, Vec<Tensor<B, 1>>> {
    if !packs_on_cuda::<B>(&pieces, dtype) {
        return Err(pieces);
    }
    let cubes = pieces.into_iter().map(to_cube).collect();
    Ok(from_cube(crate::cuda::flat::pack(cubes, total, dtype)))
}

/// [`pack`] with the sum of squares of each piece's packed values, as f32 partial sums and a
/// range of them per piece ([`crate::cuda::flat::pack_with_sq_sums`]); reduce ranges with
/// [`weighted_sum`]. `Err(pieces)` as [`pack`].
#[allow(clippy::type_complexity)]
pub(crate) fn pack_with_sq_sums<B: Backend>(
    pieces: Vec<Tensor<B, 1>>,
    total: usize,
    dtype: DType,
) -> Result<(Tensor<B, 1>, Tensor<B, 1>, Vec<std::ops::Range<usize>>), Vec<Tensor<B, 1>>> {
    if !packs_on_cuda::<B>(&pieces, dtype) {
        return Err(pieces);
    }
    let cubes = pieces.into_iter().map(to_cube).collect();
    let (flat, (partials, ranges)) = crate::cuda::flat::pack_with_sq_sums(cubes, total, dtype);
    Ok((from_cube(flat), from_cube(partials), ranges))
}

/// `sum_r weight_r * sum(t[range_r])` through the CubeCL reduction when `B` is the CUDA
/// backend (for [`pack_with_sq_sums`]'s partials, which only exist there); `None` otherwise.
pub(crate) fn weighted_sum<B: Backend>(
    t: &Tensor<B, 1>,
    runs: &[(std::ops::Range<usize>, f32)],
) -> Option<Tensor<B, 1>> {
    if TypeId::of::<B>() != TypeId::of::<CudaCube>() || t.dtype() != DType::F32 {
        return None;
    }
    let x = to_cube(t.clone());
    Some(from_cube(crate::cuda::adamw::weighted_sum(x, runs)))
}

/// The CubeCL tensor under a float tensor of `B`, which the caller proved to be [`CudaCube`].
fn to_cube<B: Backend, const D: usize>(
    t: Tensor<B, D>,
) -> burn_cubecl::tensor::CubeTensor<cubecl::cuda::CudaRuntime> {
    same::<Tensor<B, D>, Tensor<CudaCube, D>>(t)
        .into_primitive()
        .tensor()
}

/// A CUDA kernel's output as a tensor of `B`, which the caller proved to be [`CudaCube`].
fn from_cube<B: Backend, const D: usize>(
    t: burn_cubecl::tensor::CubeTensor<cubecl::cuda::CudaRuntime>,
) -> Tensor<B, D> {
    same(Tensor::<CudaCube, D>::from_primitive(
        TensorPrimitive::Float(t),
    ))
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
