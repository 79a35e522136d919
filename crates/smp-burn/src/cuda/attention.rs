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
use burn::tensor::{DType, Tensor, TensorPrimitive};
use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::CudaRuntime;

use super::CudaCube;
use super::flash::{flash_backward, flash_forward};
use super::gemm::CudaAutodiff;

type Cube = CubeTensor<CudaRuntime>;

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

fn scale(head_dim: usize) -> f32 {
    1.0 / (head_dim as f32).sqrt()
}

#[derive(Debug)]
struct FlashAttentionBackward;

impl Backward<CudaCube, 3> for FlashAttentionBackward {
    /// q, k, v, output, log-sum-exp, scale.
    type State = (Cube, Cube, Cube, Cube, Cube, f32);

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let [node_q, node_k, node_v] = ops.parents;
        let d_o = grads.consume::<CudaCube>(&ops.node);
        let (q, k, v, o, lse, scale) = ops.state;
        let (dq, dk, dv) = flash_backward(q, k, v, o, lse, d_o, scale);
        for (node, grad) in [(node_q, dq), (node_k, dk), (node_v, dv)] {
            if let Some(node) = node {
                grads.register::<CudaCube>(node.id, grad);
            }
        }
    }
}

/// Causal attention `softmax(q k^T / sqrt(d)) v` with grouped-query heads, through the flash
/// kernels; differentiable in q, k and v. Shapes as `ops::causal_attention`.
pub fn causal_attention_autodiff(
    q: Tensor<CudaAutodiff, 4>,
    k: Tensor<CudaAutodiff, 4>,
    v: Tensor<CudaAutodiff, 4>,
) -> Tensor<CudaAutodiff, 4> {
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
            let (o, lse) = flash_forward(
                q.primitive.clone(),
                k.primitive.clone(),
                v.primitive.clone(),
                s,
            );
            prep.finish(
                (q.primitive, k.primitive, v.primitive, o.clone(), lse, s),
                o,
            )
        }
        OpsKind::UnTracked(prep) => {
            prep.finish(flash_forward(q.primitive, k.primitive, v.primitive, s).0)
        }
    };
    Tensor::from_primitive(TensorPrimitive::Float(out))
}

/// [`causal_attention_autodiff`]'s forward on the plain backend (evaluation, sampling).
pub fn causal_attention_plain(
    q: Tensor<CudaCube, 4>,
    k: Tensor<CudaCube, 4>,
    v: Tensor<CudaCube, 4>,
) -> Tensor<CudaCube, 4> {
    let s = scale(q.dims()[3]);
    let (o, _) = flash_forward(
        q.into_primitive().tensor(),
        k.into_primitive().tensor(),
        v.into_primitive().tensor(),
        s,
    );
    Tensor::from_primitive(TensorPrimitive::Float(o))
}
