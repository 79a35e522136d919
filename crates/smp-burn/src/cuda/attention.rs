//! Causal flash attention ([`super::flash`]) as a differentiable op of Burn's autodiff.
//!
//! The reference path (`ops::causal_attention`) keeps the `seq x seq` scores and probabilities
//! of every head in memory and runs a dozen elementwise passes over them; at S=4096 that is the
//! bulk of a Llama step. Here the forward saves only the output and the per-row log-sum-exp, and
//! the backward recomputes the probabilities block by block.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use std::sync::{Arc, Mutex};

use burn::backend::Autodiff;
use burn::tensor::{DType, Shape, Tensor, TensorPrimitive};
use burn_cuda::CudaDevice;
use cubecl::Runtime;
use cubecl::cuda::CudaRuntime;

use super::bridge::{Arg, Cube, CubeFn, CubeInner};
use super::device::cuda_compute_capability;
use super::flash::{self, flash_backward, flash_forward, mma_async_supported, mma_supported};
use crate::packed_attention::DocumentKernel;
use crate::selective;

/// Whether the flash kernels take these inputs: half-precision floats, head dim 64 or 128,
/// equal query and key lengths, whole groups of query heads per key/value head.
pub fn supports(q: &[usize; 4], k: &[usize; 4], dtype: DType) -> bool {
    matches!(dtype, DType::BF16 | DType::F16)
        && matches!(q[3], 64 | 128)
        && q[3] == k[3]
        && q[0] == k[0]
        && q[2] == k[2]
        && k[1] > 0
        && q[1].is_multiple_of(k[1])
}

/// Whether CUDA device `device` runs the flash kernels on `dtype` inputs: `mma.sync` m16n8k16,
/// `ldmatrix` and `cp.async` (sm_80 and later). Elsewhere attention takes the reference ops.
/// Asked once per device and dtype.
pub fn device_supports(device: &CudaDevice, dtype: DType) -> bool {
    static KNOWN: Mutex<Vec<(usize, DType, bool)>> = Mutex::new(Vec::new());
    let mut known = KNOWN.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(&(_, _, yes)) = known
        .iter()
        .find(|(index, d, _)| *index == device.index && *d == dtype)
    {
        return yes;
    }
    let client = CudaRuntime::client(device);
    let yes = mma_supported(&client, dtype) && mma_async_supported(&client);
    known.push((device.index, dtype, yes));
    yes
}

fn scale(head_dim: usize) -> f32 {
    1.0 / (head_dim as f32).sqrt()
}

#[derive(Debug)]
struct FlashAttentionBackward;

/// The per-row log-sum-exp the forward keeps for the backward (f32).
fn lse_shape(batch: usize, heads: usize, seq: usize) -> Shape {
    Shape::new([batch, heads, seq])
}

/// The forward on backend `I`: the output and the per-row log-sum-exp.
fn forward_on<I: CubeInner>(
    q: I::FloatTensorPrimitive,
    k: I::FloatTensorPrimitive,
    v: I::FloatTensorPrimitive,
    scale: f32,
) -> (I::FloatTensorPrimitive, I::FloatTensorPrimitive) {
    use burn::tensor::TensorMetadata;
    let shape = q.shape();
    let dtype = q.dtype();
    let [b, h, s] = [shape[0], shape[1], shape[2]];
    let outputs = vec![(shape, dtype), (lse_shape(b, h, s), DType::F32)];
    let f: CubeFn = Arc::new(move |inputs: Vec<Cube>| {
        let [q, k, v]: [Cube; 3] = inputs.try_into().expect("q, k, v");
        let (o, lse) = flash_forward(q, k, v, scale);
        vec![o, lse]
    });
    let args = vec![Arg::Float(q), Arg::Float(k), Arg::Float(v)];
    let [o, lse]: [I::FloatTensorPrimitive; 2] = I::run("smp_burn.flash_forward", args, outputs, f)
        .try_into()
        .unwrap_or_else(|_| unreachable!("two outputs declared"));
    (o, lse)
}

/// The backward on backend `I`: `[dq, dk, dv]` from the forward's inputs, output and
/// log-sum-exp and the output gradient.
fn backward_on<I: CubeInner>(
    q: I::FloatTensorPrimitive,
    k: I::FloatTensorPrimitive,
    v: I::FloatTensorPrimitive,
    o: I::FloatTensorPrimitive,
    lse: I::FloatTensorPrimitive,
    d_o: I::FloatTensorPrimitive,
    scale: f32,
) -> Vec<I::FloatTensorPrimitive> {
    use burn::tensor::TensorMetadata;
    let outputs = vec![
        (q.shape(), q.dtype()),
        (k.shape(), k.dtype()),
        (v.shape(), v.dtype()),
    ];
    let f: CubeFn = Arc::new(move |inputs: Vec<Cube>| {
        let [q, k, v, o, lse, d_o]: [Cube; 6] = inputs.try_into().expect("six inputs");
        let (dq, dk, dv) = flash_backward(q, k, v, o, lse, d_o, scale);
        vec![dq, dk, dv]
    });
    let args = [q, k, v, o, lse, d_o].into_iter().map(Arg::Float).collect();
    I::run("smp_burn.flash_backward", args, outputs, f)
}

/// One packed document's attention through the flash kernels
/// ([`crate::ops::causal_attention_in_documents`] on the CUDA autodiff backends).
#[derive(Debug, Clone, Copy)]
pub(crate) struct FlashDocuments;

impl<I: CubeInner> DocumentKernel<I> for FlashDocuments {
    fn forward(
        &self,
        q: Tensor<I, 4>,
        k: Tensor<I, 4>,
        v: Tensor<I, 4>,
    ) -> (Tensor<I, 4>, Option<Tensor<I, 3>>) {
        let s = scale(q.dims()[3]);
        let (o, lse) = forward_on::<I>(
            q.into_primitive().tensor(),
            k.into_primitive().tensor(),
            v.into_primitive().tensor(),
            s,
        );
        (
            Tensor::from_primitive(TensorPrimitive::Float(o)),
            Some(Tensor::from_primitive(TensorPrimitive::Float(lse))),
        )
    }

    fn backward(
        &self,
        q: Tensor<I, 4>,
        k: Tensor<I, 4>,
        v: Tensor<I, 4>,
        o: Tensor<I, 4>,
        stats: Option<Tensor<I, 3>>,
        d_o: Tensor<I, 4>,
    ) -> [Tensor<I, 4>; 3] {
        let s = scale(q.dims()[3]);
        let lse = stats.expect("the flash forward keeps the log-sum-exp");
        let grads = backward_on::<I>(
            q.into_primitive().tensor(),
            k.into_primitive().tensor(),
            v.into_primitive().tensor(),
            o.into_primitive().tensor(),
            lse.into_primitive().tensor(),
            d_o.into_primitive().tensor(),
            s,
        );
        let [dq, dk, dv]: [I::FloatTensorPrimitive; 3] = grads
            .try_into()
            .unwrap_or_else(|_| unreachable!("three outputs declared"));
        [dq, dk, dv].map(|g| Tensor::from_primitive(TensorPrimitive::Float(g)))
    }
}

impl<I: CubeInner> Backward<I, 3> for FlashAttentionBackward {
    type State = (
        I::FloatTensorPrimitive,
        I::FloatTensorPrimitive,
        I::FloatTensorPrimitive,
        I::FloatTensorPrimitive,
        I::FloatTensorPrimitive,
        f32,
    );

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let [node_q, node_k, node_v] = ops.parents;
        let d_o = grads.consume::<I>(&ops.node);
        let (q, k, v, o, lse, scale) = ops.state;
        let grads_qkv = backward_on::<I>(q, k, v, o, lse, d_o, scale);
        for (node, grad) in [node_q, node_k, node_v].into_iter().zip(grads_qkv) {
            if let Some(node) = node {
                grads.register::<I>(node.id, grad);
            }
        }
    }
}

/// Causal grouped-query attention (`q: [batch, heads, seq, head_dim]`, `k`/`v` with
/// `kv_heads` heads) through the flash kernels on an autodiff CUDA backend. Under selective
/// recomputation ([`crate::selective`]) a layer's forward keeps the output and statistics and
/// its recomputation takes them back instead of running the forward kernel again.
pub fn causal_attention_autodiff<I: CubeInner>(
    q: Tensor<Autodiff<I>, 4>,
    k: Tensor<Autodiff<I>, 4>,
    v: Tensor<Autodiff<I>, 4>,
) -> Tensor<Autodiff<I>, 4> {
    use burn::tensor::TensorMetadata;
    // What a selectively recomputed layer keeps of its attention: the output and the per-row
    // log-sum-exp, all the flash backward needs besides q, k and v.
    type Kept<I> = (
        <I as burn::tensor::backend::BackendTypes>::FloatTensorPrimitive,
        <I as burn::tensor::backend::BackendTypes>::FloatTensorPrimitive,
    );
    let s = scale(q.dims()[3]);
    let (q, k, v) = (
        q.into_primitive().tensor(),
        k.into_primitive().tensor(),
        v.into_primitive().tensor(),
    );
    let out = match FlashAttentionBackward
        .prepare::<NoCheckpointing>([q.node.clone(), k.node.clone(), v.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            // A layer recomputed selectively takes the output and statistics its forward kept.
            let kept = selective::take::<Kept<I>>().filter(|(o, _)| {
                let fits = o.shape() == q.primitive.shape();
                if !fits {
                    selective::mismatch();
                }
                fits
            });
            let (o, lse) = kept.unwrap_or_else(|| {
                forward_on::<I>(
                    q.primitive.clone(),
                    k.primitive.clone(),
                    v.primitive.clone(),
                    s,
                )
            });
            prep.finish(
                (q.primitive, k.primitive, v.primitive, o.clone(), lse, s),
                o,
            )
        }
        OpsKind::UnTracked(prep) => {
            let (o, lse) = forward_on::<I>(q.primitive, k.primitive, v.primitive, s);
            if selective::recording() {
                selective::keep::<Kept<I>>((o.clone(), lse));
            }
            prep.finish(o)
        }
    };
    Tensor::from_primitive(TensorPrimitive::Float(out))
}

/// Causal grouped-query attention through the flash kernels on a plain CUDA backend
/// (evaluation, sampling).
pub fn causal_attention_plain<I: CubeInner>(
    q: Tensor<I, 4>,
    k: Tensor<I, 4>,
    v: Tensor<I, 4>,
) -> Tensor<I, 4> {
    let s = scale(q.dims()[3]);
    let (o, _) = forward_on::<I>(
        q.into_primitive().tensor(),
        k.into_primitive().tensor(),
        v.into_primitive().tensor(),
        s,
    );
    Tensor::from_primitive(TensorPrimitive::Float(o))
}

/// The attention kernels that run at `head_dim` on CUDA device 0, for the trainer's log: the
/// forward and backward kernels ([`crate::KernelConfig`]'s, else the device's defaults), and
/// whether the backward's dQ is bitwise reproducible. Why: the defaults on sm_90 sum dQ with
/// atomics or bulk reductions (faster, run-to-run rounding differences, as PyTorch's flash
/// backward), and a user comparing two runs' losses should see that up front; and which
/// kernels run depends on the device and the build.
pub fn attention_summary(head_dim: usize) -> String {
    // The driver's compute capability, not a CubeCL client: a client would open a context on
    // GPU 0 in every process of a multi-process launch. CubeCL reports f32-pair atomics
    // (`flash::pair_atomics_supported`) and TMA (`flash::wgmma_supported`) from sm_90 on.
    let sm90 = cuda_compute_capability(0).is_some_and(|(major, _)| major >= 9);
    let config = crate::KernelConfig::current();
    // Contiguous bf16 attention inputs at head dim 64 or 128 have the 16-byte rows the
    // warpgroup kernels need.
    let forward = config
        .flash_forward
        .unwrap_or_else(|| flash::default_forward(head_dim, flash::WGMMA_BUILT && sm90));
    let backward = flash::choose_backward(
        config.flash_backward,
        config.deterministic,
        head_dim,
        true,
        sm90,
        flash::WGMMA_BUILT && flash::BULK_REDUCE_BUILT && sm90,
    );
    // Hopper's copy engine comes with sm_90, as the pair atomics do.
    let bulk = backward == crate::FlashBackward::Wgmma || (flash::BULK_REDUCE_BUILT && sm90);
    let reproducible = if backward.deterministic() {
        "deterministic"
    } else if bulk {
        "dQ summed by bulk asynchronous reductions, not bitwise reproducible; \
         SMP_BURN_KERNELS=deterministic for the deterministic kernels"
    } else {
        "dQ summed with atomics, not bitwise reproducible; SMP_BURN_KERNELS=deterministic \
         for the deterministic kernels"
    };
    format!(
        "attention (head dim {head_dim}): forward {}; backward {}, {reproducible}",
        forward.name(),
        backward.name()
    )
}
