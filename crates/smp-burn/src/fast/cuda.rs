//! The dispatch to the CUDA fast paths: each function serves [`CudaCube`] (and, where it has an
//! autodiff op, `Autodiff<CudaCube>`) and returns `None` (or the inputs back) for any other
//! backend, which then takes the reference op.

use std::any::TypeId;

use burn::tensor::{DType, Int, Tensor, TensorPrimitive, backend::Backend};

use super::{AdamWState, AdamWUpdate, fast_paths, same};
use crate::cuda::gemm::{self, CudaAutodiff};
use crate::cuda::{CudaCube, attention, fused};

/// Logs once per backend that the fast paths do not serve it, when its type says it runs on
/// CUDA (`burn::backend::Cuda`, which adds Burn's fusion layer, or CubeCL with other element
/// types): such a user expects the fast paths and would otherwise get Burn's stock ops
/// without a word. Other backends (CPU, WGPU) take the reference ops silently, as designed.
fn note_unserved<B: Backend>() {
    use std::collections::HashSet;
    use std::sync::{Mutex, OnceLock};
    static SEEN: OnceLock<Mutex<HashSet<TypeId>>> = OnceLock::new();
    let name = std::any::type_name::<B>();
    if !name.contains("Cuda") {
        return;
    }
    let mut seen = SEEN
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if seen.insert(TypeId::of::<B>()) {
        tracing::warn!(
            "smp-burn: backend {name} gets Burn's stock ops for linear layers (cuBLAS), \
             attention (flash), RMSNorm, RoPE, SwiGLU, the embedding gradient, the LM-head loss's \
             softmax, AdamW and gradient packing: the fast paths serve \
             smp_burn::cuda::CudaCube (Burn's CubeCL CUDA backend, f32 elements, without \
             fusion) and Autodiff over it only, since their kernels take CubeCL buffers that \
             fusion hands out only after draining its queue. Train on CudaCube for speed; NCCL \
             collectives work on either."
        );
    }
}

/// Whether `B` is the backend the CUDA fast paths serve, with or without autodiff.
pub(crate) fn is_cuda<B: Backend>() -> bool {
    let b = TypeId::of::<B>();
    b == TypeId::of::<CudaAutodiff>() || b == TypeId::of::<CudaCube>()
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
        note_unserved::<B>();
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
        note_unserved::<B>();
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
    if TypeId::of::<B>() != TypeId::of::<CudaCube>() {
        note_unserved::<B>();
        return Err(state);
    }
    if !fast_paths().adamw
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
