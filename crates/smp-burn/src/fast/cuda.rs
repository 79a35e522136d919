//! The dispatch to the CUDA fast paths. Each function serves the backends of
//! [`crate::cuda::bridge::CubeInner`] ([`CudaCube`] and Burn's default `burn::backend::Cuda`,
//! with or without autodiff) and returns `None` (or the inputs back) for any other backend,
//! which then takes the reference op. The fused RMSNorm, RoPE and SwiGLU and the in-place
//! gradient sums serve [`CudaCube`] only: under fusion, Burn's own elementwise fusion takes
//! those ops, and a registered gradient is a lazy tensor of fusion's stream.

use std::any::TypeId;
use std::sync::Arc;

use burn::tensor::{DType, Int, Tensor, TensorPrimitive, backend::Backend};

use super::{AdamWState, AdamWUpdate, fast_paths};
use crate::cuda::bridge::{Arg, Cube, CubeFn, CubeInner, FusedCuda, Served, served};
use crate::cuda::gemm::{self, CudaAutodiff};
use crate::cuda::{CudaCube, attention, fused};
use crate::downcast::same;

/// Logs once per backend that the fast paths do not serve it, when its type says it runs on
/// CUDA (CubeCL with other element types, say): such a user expects the fast paths and would
/// otherwise get Burn's stock ops without a word. Other backends (CPU, WGPU) take the
/// reference ops silently, as designed. Under fusion, logs once which ops fusion keeps.
fn note_unserved<B: Backend>() {
    use std::collections::HashSet;
    use std::sync::{Mutex, OnceLock};
    static SEEN: OnceLock<Mutex<HashSet<TypeId>>> = OnceLock::new();
    let name = std::any::type_name::<B>();
    let fused = matches!(served::<B>(), Some(Served::Fused | Served::FusedAutodiff));
    if !fused && (served::<B>().is_some() || !name.contains("Cuda")) {
        return;
    }
    let mut seen = SEEN
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if !seen.insert(TypeId::of::<B>()) {
        return;
    }
    if fused {
        tracing::info!(
            "smp-burn on burn::backend::Cuda (fusion): linear layers, attention, the embedding \
             gradient, the LM-head loss, AdamW and gradient packing run on smp-burn's kernels \
             inside fusion's stream; RMSNorm, RoPE and SwiGLU are left to Burn's fusion, and \
             gradients meeting at a tensor are summed by a separate add (in place only on \
             smp_burn::cuda::CudaCube)"
        );
    } else {
        tracing::warn!(
            "smp-burn: backend {name} gets Burn's stock ops for linear layers (cuBLAS), \
             attention (flash), RMSNorm, RoPE, SwiGLU, the embedding gradient, the LM-head \
             loss's softmax, AdamW and gradient packing: the fast paths serve \
             smp_burn::cuda::CudaCube and burn::backend::Cuda (f32 float elements, i32 ints), \
             with or without Autodiff. Train on one of those for speed."
        );
    }
}

/// Whether `B` is a backend the CUDA fast paths serve, with or without autodiff.
pub(crate) fn is_cuda<B: Backend>() -> bool {
    served::<B>().is_some()
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
    let y: Tensor<B, D> = match served::<B>() {
        Some(Served::CubeAutodiff) => same(gemm::linear_autodiff::<CudaCube, D>(
            same(x.clone()),
            same(w.clone()),
        )),
        Some(Served::FusedAutodiff) => same(gemm::linear_autodiff::<FusedCuda, D>(
            same(x.clone()),
            same(w.clone()),
        )),
        Some(Served::Cube) => same(gemm::linear_plain::<CudaCube, D>(
            same(x.clone()),
            same(w.clone()),
        )),
        Some(Served::Fused) => same(gemm::linear_plain::<FusedCuda, D>(
            same(x.clone()),
            same(w.clone()),
        )),
        None => {
            note_unserved::<B>();
            return None;
        }
    };
    Some(y)
}

/// Whether FP8 linear layers on `B` keep their weights' FP8 copies from the forward for the
/// backward ([`crate::cuda::fp8::keep_weight_copies`]), which then reads nothing of the bf16
/// weights.
pub(crate) fn fp8_weight_copies_kept<B: Backend>() -> bool {
    crate::kernel_config::fp8_recipe().enabled()
        && matches!(served::<B>(), Some(Served::CubeAutodiff))
        && crate::cuda::fp8::weight_copies_kept()
}

/// `x w^T` with FP8 GEMMs ([`crate::cuda::fp8`]) when the installed recipe asks for it and
/// `B` is [`CudaCube`] (with or without autodiff) on an FP8 GPU with bf16 operands of
/// FP8-friendly shapes; `None` means "use [`linear`]". A recipe that cannot be honoured is
/// logged once per reason.
pub(crate) fn linear_fp8<B: Backend, const D: usize>(
    x: &Tensor<B, D>,
    w: &Tensor<B, 2>,
    layer: burn::module::ParamId,
) -> Option<Tensor<B, D>> {
    use crate::cuda::fp8;
    use crate::fp8::Fp8Recipe;
    let layer = match crate::kernel_config::fp8_recipe() {
        Fp8Recipe::Off => return None,
        Fp8Recipe::Tensorwise => None,
        Fp8Recipe::Delayed => Some(layer.val()),
    };
    let served = served::<B>();
    let dims = x.dims();
    let supported = matches!(served, Some(Served::CubeAutodiff | Served::Cube))
        && fp8::fp8_linear_supported(
            x.dtype(),
            w.dtype(),
            dims[..D - 1].iter().product(),
            dims[D - 1],
            w.dims(),
            same::<B::Device, burn_cuda::CudaDevice>(x.device()).index,
        );
    if !supported {
        note_fp8_fallback(x, w);
        return None;
    }
    Some(match served {
        Some(Served::CubeAutodiff) => same(fp8::linear_fp8_autodiff::<D>(
            same(x.clone()),
            same(w.clone()),
            layer,
        )),
        _ => same(fp8::linear_fp8_plain::<D>(
            same(x.clone()),
            same(w.clone()),
            layer,
        )),
    })
}

/// Logs once per backend, dtype and shape why a linear layer stays out of FP8 under an FP8
/// recipe: the user asked for FP8 and must know where it does not apply.
fn note_fp8_fallback<B: Backend, const D: usize>(x: &Tensor<B, D>, w: &Tensor<B, 2>) {
    use std::collections::HashSet;
    use std::sync::{Mutex, OnceLock};
    static SEEN: OnceLock<Mutex<HashSet<String>>> = OnceLock::new();
    let what = format!(
        "{} {:?} x{:?} w{:?}",
        std::any::type_name::<B>(),
        x.dtype(),
        x.dims(),
        w.dims()
    );
    let mut seen = SEEN
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if seen.insert(what.clone()) {
        tracing::warn!(
            "FP8 recipe on, but this linear layer computes in {:?}: {what} (FP8 needs \
             smp_burn::cuda::CudaCube on a GPU of compute capability 8.9+, bf16 operands and \
             every dimension a multiple of 16)",
            x.dtype()
        );
    }
}

/// Whether the attention fast path is on and the flash kernels take these dtypes and shapes.
fn flash_takes_shapes<B: Backend>(q: &Tensor<B, 4>, k: &Tensor<B, 4>, v: &Tensor<B, 4>) -> bool {
    fast_paths().attention
        && q.dtype() == k.dtype()
        && k.dtype() == v.dtype()
        && k.dims() == v.dims()
        && attention::supports(&q.dims(), &k.dims(), q.dtype())
}

/// Whether `q`'s GPU runs the flash kernels: GPUs before sm_80 (no `mma.sync` m16n8k16) take
/// the reference. `B` must be a served CUDA backend.
fn flash_runs_on_device<B: Backend>(q: &Tensor<B, 4>) -> bool {
    attention::device_supports(
        &same::<B::Device, burn_cuda::CudaDevice>(q.device()),
        q.dtype(),
    )
}

/// Causal grouped-query attention through the flash kernels when `B` is the CUDA backend and
/// the shapes, dtypes and device allow; `None` means "use the reference".
pub(crate) fn causal_attention<B: Backend>(
    q: &Tensor<B, 4>,
    k: &Tensor<B, 4>,
    v: &Tensor<B, 4>,
) -> Option<Tensor<B, 4>> {
    if !flash_takes_shapes(q, k, v) {
        return None;
    }
    let Some(backend) = served::<B>() else {
        note_unserved::<B>();
        return None;
    };
    if !flash_runs_on_device(q) {
        return None;
    }
    let (q, k, v) = (q.clone(), k.clone(), v.clone());
    let o: Tensor<B, 4> = match backend {
        Served::CubeAutodiff => same(attention::causal_attention_autodiff::<CudaCube>(
            same(q),
            same(k),
            same(v),
        )),
        Served::FusedAutodiff => same(attention::causal_attention_autodiff::<FusedCuda>(
            same(q),
            same(k),
            same(v),
        )),
        Served::Cube => same(attention::causal_attention_plain::<CudaCube>(
            same(q),
            same(k),
            same(v),
        )),
        Served::Fused => same(attention::causal_attention_plain::<FusedCuda>(
            same(q),
            same(k),
            same(v),
        )),
    };
    Some(o)
}

/// Causal attention inside packed documents as one op of the CUDA autodiff backends
/// ([`crate::packed_attention`]): each document through the flash kernels where they take the
/// inputs, else through the reference arithmetic; `None` for other backends (the caller cuts the
/// rows with Burn's ops).
pub(crate) fn causal_attention_in_documents<B: Backend>(
    q: &Tensor<B, 4>,
    k: &Tensor<B, 4>,
    v: &Tensor<B, 4>,
    documents: &crate::documents::Documents,
) -> Option<Tensor<B, 4>> {
    /// The op on `Autodiff<I>`, each document through the flash kernels or the reference.
    fn on<B: Backend, I: crate::cuda::bridge::CubeInner>(
        flash: bool,
        q: &Tensor<B, 4>,
        k: &Tensor<B, 4>,
        v: &Tensor<B, 4>,
        documents: &crate::documents::Documents,
    ) -> Tensor<B, 4> {
        use crate::packed_attention::{ReferenceKernel, attention_in_documents};
        let (q, k, v) = (same(q.clone()), same(k.clone()), same(v.clone()));
        same(if flash {
            attention_in_documents::<I, _>(attention::FlashDocuments, q, k, v, documents)
        } else {
            attention_in_documents::<I, _>(ReferenceKernel, q, k, v, documents)
        })
    }
    let backend = served::<B>()?;
    let flash = || flash_takes_shapes(q, k, v) && flash_runs_on_device(q);
    match backend {
        Served::CubeAutodiff => Some(on::<B, CudaCube>(flash(), q, k, v, documents)),
        Served::FusedAutodiff => Some(on::<B, FusedCuda>(flash(), q, k, v, documents)),
        Served::Cube | Served::Fused => None,
    }
}

/// Elements `range` of the normal draw with key `key` ([`crate::init::normal_key`]) as an f32
/// tensor drawn on the GPU when `B` is [`CudaCube`] and the `init` fast path is on; `None`
/// means "draw on the host" (fusion's stream takes no operation without an input tensor).
pub(crate) fn normal_init<B: Backend>(
    key: u64,
    std: f32,
    range: std::ops::Range<usize>,
    device: &B::Device,
) -> Option<Tensor<B, 1>> {
    if !fast_paths().init || served::<B>()? != Served::Cube {
        return None;
    }
    let cuda: burn_cuda::CudaDevice = same(device.clone());
    let t = crate::cuda::init::normal(&cuda, key, std, range.start, range.len());
    Some(same(Tensor::<CudaCube, 1>::from_primitive(
        TensorPrimitive::Float(t),
    )))
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
    if !fast_paths().gemm || !gemm::supports(dy.dtype(), w.dtype()) || x.dtype() != w.dtype() {
        return None;
    }
    fn on<B: Backend, I: CubeInner>(
        dy: &Tensor<B, 2>,
        x: &Tensor<B, 2>,
        w: &Tensor<B, 2>,
        want_dx: bool,
        want_dw: bool,
    ) -> (Option<Tensor<B, 2>>, Option<Tensor<B, 2>>) {
        let t = |t: &Tensor<B, 2>| same::<Tensor<B, 2>, Tensor<I, 2>>(t.clone());
        let (dx, dw) = gemm::linear_grads::<I>(
            t(dy),
            want_dw.then(|| t(x)),
            want_dx.then(|| t(w)),
            x.shape(),
        );
        (dx.map(same), dw.map(same))
    }
    match served::<B>() {
        Some(Served::Cube) => Some(on::<B, CudaCube>(dy, x, w, want_dx, want_dw)),
        Some(Served::Fused) => Some(on::<B, FusedCuda>(dy, x, w, want_dx, want_dw)),
        _ => None,
    }
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
    if !fast_paths().embed || !fused_dtype(weight.dtype()) {
        return None;
    }
    let (w, ids) = (weight.clone(), ids.clone());
    match served::<B>() {
        Some(Served::CubeAutodiff) => Some(same(crate::cuda::embedding::embedding_autodiff::<
            CudaCube,
        >(same(w), same(ids)))),
        Some(Served::FusedAutodiff) => Some(same(crate::cuda::embedding::embedding_autodiff::<
            FusedCuda,
        >(same(w), same(ids)))),
        _ => None,
    }
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

/// Runs `f` (a fast path on CubeCL buffers) on the plain served backend `B`; `None` for any
/// other backend.
fn run_plain<B: Backend>(
    name: &'static str,
    args: Vec<Arg<B>>,
    outputs: Vec<(burn::tensor::Shape, DType)>,
    f: CubeFn,
) -> Option<Vec<B::FloatTensorPrimitive>> {
    match served::<B>() {
        Some(Served::Cube) => Some(same(CudaCube::run(name, same(args), outputs, f))),
        Some(Served::Fused) => Some(same(FusedCuda::run(name, same(args), outputs, f))),
        Some(Served::CubeAutodiff | Served::FusedAutodiff) => None,
        None => {
            note_unserved::<B>();
            None
        }
    }
}

fn float<B: Backend, const D: usize>(t: &Tensor<B, D>) -> Arg<B> {
    Arg::Float(t.clone().into_primitive().tensor())
}

fn tensor<B: Backend, const D: usize>(t: B::FloatTensorPrimitive) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

/// Each row's log-sum-exp and loss of `logits` through [`crate::cuda::xent::row_stats`] on a
/// plain CUDA backend; `None` means "use the reference".
pub(crate) fn xent_row_stats<B: Backend>(
    logits: &Tensor<B, 2>,
    targets: &Tensor<B, 1, Int>,
) -> Option<(Tensor<B, 1>, Tensor<B, 1>)> {
    if !fast_paths().xent {
        return None;
    }
    let rows = logits.dims()[0];
    let out = vec![([rows].into(), DType::F32); 2];
    let f: CubeFn = Arc::new(|inputs: Vec<Cube>| {
        let [logits, targets]: [Cube; 2] = inputs.try_into().expect("logits, targets");
        let (lse, loss) = crate::cuda::xent::row_stats(logits, targets);
        vec![lse, loss]
    });
    let args = vec![float(logits), Arg::Int(targets.clone().into_primitive())];
    let [lse, loss]: [_; 2] = run_plain::<B>("smp_burn.xent_row_stats", args, out, f)?
        .try_into()
        .unwrap_or_else(|_| unreachable!("two outputs declared"));
    Some((tensor(lse), tensor(loss)))
}

/// The loss's gradient with respect to the logits, in the logits' dtype, through
/// [`crate::cuda::xent::softmax_grad`] on a plain CUDA backend; `None` means "use the
/// reference".
pub(crate) fn xent_softmax_grad<B: Backend>(
    logits: &Tensor<B, 2>,
    lse: &Tensor<B, 1>,
    targets: &Tensor<B, 1, Int>,
    scale: &Tensor<B, 2>,
) -> Option<Tensor<B, 2>> {
    if !fast_paths().xent {
        return None;
    }
    let out = vec![(logits.shape(), logits.dtype())];
    let f: CubeFn = Arc::new(|inputs: Vec<Cube>| {
        let [logits, lse, targets, scale]: [Cube; 4] = inputs.try_into().expect("four inputs");
        vec![crate::cuda::xent::softmax_grad(logits, lse, targets, scale)]
    });
    let args = vec![
        float(logits),
        float(lse),
        Arg::Int(targets.clone().into_primitive()),
        float(scale),
    ];
    let g = run_plain::<B>("smp_burn.xent_softmax_grad", args, out, f)?.pop()?;
    Some(tensor(g))
}

/// FSDP's AdamW step through the fused kernel on a plain CUDA backend when the master weights
/// are f32 and the moments f32 or bf16, both the same (the gradient may be f32, bf16 or f16). `state` is `[master, exp_avg, exp_avg_sq]`, taken by
/// value so that the kernel can update the buffers in place: a second handle would make it
/// copy each one first (three shard-sized copies per unit and step). With `copy_dtype` the
/// kernel also returns the updated weights in that dtype. `Err(state)` hands the state back:
/// use the reference.
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
    if !matches!(served::<B>(), Some(Served::Cube | Served::Fused)) {
        note_unserved::<B>();
        return Err(state);
    }
    let moment_dtype = state[1].dtype();
    if !fast_paths().adamw
        || [&state[0], grad_scale]
            .iter()
            .any(|t| t.dtype() != DType::F32)
        || !matches!(moment_dtype, DType::F32 | DType::BF16)
        || state[2].dtype() != moment_dtype
        || !fused_dtype(grad.dtype())
        || copy_dtype.is_some_and(|d| !fused_dtype(d))
    {
        return Err(state);
    }
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
    let len = state[0].dims()[0];
    let mut out = vec![
        ([len].into(), DType::F32),
        ([len].into(), moment_dtype),
        ([len].into(), moment_dtype),
    ];
    out.extend(copy_dtype.map(|d| ([len].into(), d)));
    let runs = runs.to_vec();
    let f: CubeFn = Arc::new(move |inputs: Vec<Cube>| {
        let [master, exp_avg, exp_avg_sq, grad, grad_scale]: [Cube; 5] =
            inputs.try_into().expect("five inputs");
        let (m, a, v, copy) = crate::cuda::adamw::adamw_step(
            master, exp_avg, exp_avg_sq, grad, grad_scale, hp, &runs, copy_dtype,
        );
        [m, a, v].into_iter().chain(copy).collect()
    });
    let mut args: Vec<Arg<B>> = state
        .into_iter()
        .map(|t| Arg::Float(t.into_primitive().tensor()))
        .collect();
    args.push(float(grad));
    args.push(float(grad_scale));
    let mut out = run_plain::<B>("smp_burn.adamw", args, out, f)
        .expect("served backend checked above")
        .into_iter();
    let mut next = || tensor::<B, 1>(out.next().expect("declared output"));
    let new_state = [next(), next(), next()];
    let copy = copy_dtype.map(|_| next());
    Ok((new_state, copy))
}

/// `sum_r weight_r * sum(t[range_r]^2)` (the gradient norm's share of a shard) through one
/// deterministic CubeCL reduction (in f32) on a plain CUDA backend when `t` is f32, bf16 or
/// f16; part of the `adamw` switch, since only the optimizer step uses it. `None` means "use
/// the reference".
pub(crate) fn weighted_sq_sum<B: Backend>(
    t: &Tensor<B, 1>,
    runs: &[(std::ops::Range<usize>, f32)],
) -> Option<Tensor<B, 1>> {
    if !fast_paths().adamw || !fused_dtype(t.dtype()) {
        return None;
    }
    let runs = runs.to_vec();
    let f: CubeFn = Arc::new(move |inputs: Vec<Cube>| {
        let [x]: [Cube; 1] = inputs.try_into().expect("one input");
        vec![crate::cuda::adamw::weighted_sq_sum(x, &runs)]
    });
    let out = vec![([1].into(), DType::F32)];
    let sum = run_plain::<B>("smp_burn.weighted_sq_sum", vec![float(t)], out, f)?.pop()?;
    Some(tensor(sum))
}

/// Whether the packing kernels serve these pieces: the `flat` path is on, `B` is a plain CUDA
/// backend and `dtype` a float type the kernels write.
fn packs_on_cuda<B: Backend>(pieces: &[Tensor<B, 1>], dtype: DType) -> bool {
    fast_paths().flat
        && matches!(served::<B>(), Some(Served::Cube | Served::Fused))
        && !pieces.is_empty()
        && fused_dtype(dtype)
}

/// One flat tensor of `dtype` and `total` elements holding `pieces` back to back, then zeros,
/// through one cast-and-copy kernel per piece on a plain CUDA backend; `Err(pieces)` hands
/// them back for the reference (`cast` + `cat`).
pub(crate) fn pack<B: Backend>(
    pieces: Vec<Tensor<B, 1>>,
    total: usize,
    dtype: DType,
) -> Result<Tensor<B, 1>, Vec<Tensor<B, 1>>> {
    if !packs_on_cuda::<B>(&pieces, dtype) {
        return Err(pieces);
    }
    let f: CubeFn =
        Arc::new(move |inputs: Vec<Cube>| vec![crate::cuda::flat::pack(inputs, total, dtype)]);
    let args = pieces.iter().map(float).collect();
    let out = vec![([total].into(), dtype)];
    let flat = run_plain::<B>("smp_burn.pack", args, out, f)
        .and_then(|mut v| v.pop())
        .expect("served backend checked above");
    Ok(tensor(flat))
}

/// `acc` (a flat f32 gradient, taken by value so that the kernel can add in place) plus each
/// piece at its offset ([`crate::cuda::flat::pack_add`]) on a plain CUDA backend;
/// `Err((pieces, acc))` hands both back for the reference.
#[allow(clippy::type_complexity)]
pub(crate) fn pack_add<B: Backend>(
    pieces: Vec<(usize, Tensor<B, 1>)>,
    acc: Tensor<B, 1>,
) -> Result<Tensor<B, 1>, (Vec<(usize, Tensor<B, 1>)>, Tensor<B, 1>)> {
    let (offsets, tensors): (Vec<usize>, Vec<Tensor<B, 1>>) = pieces.into_iter().unzip();
    if !packs_on_cuda::<B>(&tensors, DType::F32) || acc.dtype() != DType::F32 {
        return Err((offsets.into_iter().zip(tensors).collect(), acc));
    }
    let total = acc.dims()[0];
    let f: CubeFn = Arc::new(move |mut inputs: Vec<Cube>| {
        let acc = inputs.pop().expect("the sum comes last");
        let pieces = offsets.iter().copied().zip(inputs).collect();
        vec![crate::cuda::flat::pack_add(pieces, acc)]
    });
    let mut args: Vec<Arg<B>> = tensors.iter().map(float).collect();
    drop(tensors);
    args.push(Arg::Float(acc.into_primitive().tensor()));
    let out = vec![([total].into(), DType::F32)];
    let sum = run_plain::<B>("smp_burn.pack_add", args, out, f)
        .and_then(|mut v| v.pop())
        .expect("served backend checked above");
    Ok(tensor(sum))
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
    let sizes: Vec<usize> = pieces.iter().map(|p| p.dims()[0]).collect();
    let (ranges, slots) = crate::cuda::flat::sq_partial_ranges(&sizes);
    let f: CubeFn = Arc::new(move |inputs: Vec<Cube>| {
        let (flat, (partials, _)) = crate::cuda::flat::pack_with_sq_sums(inputs, total, dtype);
        vec![flat, partials]
    });
    let args = pieces.iter().map(float).collect();
    let out = vec![([total].into(), dtype), ([slots.max(1)].into(), DType::F32)];
    let [flat, partials]: [_; 2] = run_plain::<B>("smp_burn.pack_with_sq_sums", args, out, f)
        .expect("served backend checked above")
        .try_into()
        .unwrap_or_else(|_| unreachable!("two outputs declared"));
    Ok((tensor(flat), tensor(partials), ranges))
}

/// `sum_r weight_r * sum(t[range_r])` through the CubeCL reduction on a plain CUDA backend
/// (for [`pack_with_sq_sums`]'s partials, which only exist there); `None` otherwise.
pub(crate) fn weighted_sum<B: Backend>(
    t: &Tensor<B, 1>,
    runs: &[(std::ops::Range<usize>, f32)],
) -> Option<Tensor<B, 1>> {
    if t.dtype() != DType::F32 {
        return None;
    }
    let runs = runs.to_vec();
    let f: CubeFn = Arc::new(move |inputs: Vec<Cube>| {
        let [x]: [Cube; 1] = inputs.try_into().expect("one input");
        vec![crate::cuda::adamw::weighted_sum(x, &runs)]
    });
    let out = vec![([1].into(), DType::F32)];
    let sum = run_plain::<B>("smp_burn.weighted_sum", vec![float(t)], out, f)?.pop()?;
    Some(tensor(sum))
}

/// The autodiff node of `t` where `B` is [`CudaAutodiff`].
fn cuda_autodiff_node<B: Backend, const D: usize>(
    t: &Tensor<B, D>,
) -> Option<burn::backend::autodiff::NodeId> {
    if TypeId::of::<B>() != TypeId::of::<CudaAutodiff>() {
        return None;
    }
    let t: Tensor<CudaAutodiff, D> = same(t.clone());
    Some(t.into_primitive().tensor().node.id)
}

/// Makes the gradient GEMM of the weight `param` (an autodiff leaf) add into elements
/// `offset..` of `sum` (an f32 gradient sum over micro-batches) instead of returning a gradient
/// ([`crate::cuda::accumulate::add_weight_grad_into`]), on [`CudaAutodiff`] with the `gemm` and
/// `accumulate` paths on; nothing elsewhere.
pub(crate) fn add_weight_grad_into<B: Backend, IB: Backend, const D: usize>(
    param: &Tensor<B, D>,
    sum: &Tensor<IB, 1>,
    offset: usize,
    owner: u64,
) {
    let paths = fast_paths();
    if !(paths.gemm && paths.accumulate)
        || sum.dtype() != DType::F32
        || TypeId::of::<IB>() != TypeId::of::<CudaCube>()
    {
        return;
    }
    let Some(node) = cuda_autodiff_node(param) else {
        return;
    };
    let sum: Tensor<CudaCube, 1> = same(sum.clone());
    let numel = param.shape().num_elements();
    crate::cuda::accumulate::add_weight_grad_into(
        node,
        sum.into_primitive().tensor(),
        offset,
        numel,
        owner,
    );
}

/// Whether a GEMM added the gradient of `param` into the sum [`add_weight_grad_into`] gave it;
/// forgets that target.
pub(crate) fn weight_grad_added<B: Backend, const D: usize>(param: &Tensor<B, D>) -> bool {
    cuda_autodiff_node(param).is_some_and(crate::cuda::accumulate::weight_grad_added)
}

/// Forgets every weight-gradient target of FSDP unit `owner`.
pub(crate) fn forget_weight_grad_targets(owner: u64) {
    crate::cuda::accumulate::forget_weight_grad_targets(owner);
}
