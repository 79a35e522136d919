//! Backpropagating a gradient that arrives from outside the autodiff graph.
//!
//! Pipeline- and FSDP-style training runs the backward one unit at a time: a unit's output
//! gradient comes from the next unit's backward, not from a loss in the same graph. Burn 0.21
//! only offers `Tensor::backward()` on a scalar, so the usual trick is
//! `(output * grad).sum().backward()`, which costs an elementwise product, a full reduction and
//! their backward kernels for nothing: on an H200, Burn's full `sum` of a 4096 x 2048 tensor
//! took 2.0 ms, 48 ms of a 1.2B-parameter model's step. [`backward_from`] instead seeds the
//! backward with `grad` directly through a custom autodiff op whose forward is a one-element
//! zero and whose backward hands `grad` to `output`.

use std::any::TypeId;

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorPrimitive};
use burn_ndarray::NdArray;

use crate::downcast::same;

/// Hands the gradient kept in its state to its only parent, ignoring the seed it receives.
#[derive(Debug)]
struct SeedGradient;

impl<B: Backend> Backward<B, 1> for SeedGradient {
    type State = B::FloatTensorPrimitive;

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        // The root's own gradient (a one-element 1) is not needed.
        let _ = grads.consume::<B>(&ops.node);
        if let [Some(parent)] = ops.parents {
            grads.register::<B>(parent.id, ops.state);
        }
    }
}

/// A scalar whose backward gives `output` the gradient `grad`.
fn seeded<I: Backend, const D: usize>(
    output: Tensor<Autodiff<I>, D>,
    grad: Tensor<I, D>,
) -> Tensor<Autodiff<I>, 1> {
    let zero = Tensor::<I, 1>::zeros([1], &grad.device())
        .into_primitive()
        .tensor();
    let out = output.into_primitive().tensor();
    let node = out.node.clone();
    let t = match SeedGradient
        .prepare::<NoCheckpointing>([node])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(grad.into_primitive().tensor(), zero),
        OpsKind::UnTracked(prep) => prep.finish(zero),
    };
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

/// Runs the backward of the graph that produced `output` as if the loss's gradient with respect
/// to `output` were `grad` (same shape), and returns the gradients of its leaves.
///
/// Seeds the graph directly on the backends this crate can name (CUDA's
/// [`CudaCube`](crate::cuda::CudaCube) and
/// `NdArray<f32>`, each under `Autodiff`); elsewhere it falls back to
/// `(output * grad).sum().backward()`, which gives the same gradients at the cost of a
/// product and a reduction.
pub fn backward_from<B: AutodiffBackend, const D: usize>(
    output: Tensor<B, D>,
    grad: Tensor<B::InnerBackend, D>,
) -> B::Gradients {
    /// The seeded backward on `Autodiff<I>`, or the inputs back when `B` is another backend.
    /// Takes `grad` by value: the seed must be its only holder, so that the first op whose
    /// gradient meets it (a residual add's other branch) may add into it in place.
    #[allow(clippy::type_complexity)]
    fn on<B: AutodiffBackend, I: Backend, const D: usize>(
        output: Tensor<B, D>,
        grad: Tensor<B::InnerBackend, D>,
    ) -> Result<B::Gradients, (Tensor<B, D>, Tensor<B::InnerBackend, D>)> {
        if TypeId::of::<B>() != TypeId::of::<Autodiff<I>>() {
            return Err((output, grad));
        }
        let grads: Gradients = seeded::<I, D>(same(output), same(grad)).backward();
        Ok(same(grads))
    }
    #[cfg(feature = "cuda")]
    let (output, grad) = match on::<B, crate::cuda::CudaCube, D>(output, grad)
        .or_else(|(output, grad)| on::<B, crate::cuda::bridge::FusedCuda, D>(output, grad))
    {
        Ok(grads) => return grads,
        Err(back) => back,
    };
    on::<B, NdArray<f32>, D>(output, grad)
        .unwrap_or_else(|(output, grad)| (output * Tensor::from_inner(grad)).sum().backward())
}

/// `t` with its values given up: the same autodiff node, shape and dtype, its storage a
/// broadcast of one uninitialized element. A module kept only to find its parameters'
/// gradients (which go by node) then no longer holds the buffer its parameters were views of,
/// so that buffer is freed once nothing in the graph reads it either. Backends other than
/// Burn's `Autodiff` get `t` back unchanged.
pub(crate) fn without_values<B: AutodiffBackend, const D: usize>(t: Tensor<B, D>) -> Tensor<B, D> {
    if TypeId::of::<B>() != TypeId::of::<Autodiff<B::InnerBackend>>() {
        return t;
    }
    let t: Tensor<Autodiff<B::InnerBackend>, D> = same(t);
    match t.into_primitive() {
        TensorPrimitive::Float(mut tracked) => {
            tracked.primitive = no_storage::<B::InnerBackend>(&tracked.primitive);
            same(Tensor::<Autodiff<B::InnerBackend>, D>::from_primitive(
                TensorPrimitive::Float(tracked),
            ))
        }
        quantized => same(Tensor::<Autodiff<B::InnerBackend>, D>::from_primitive(
            quantized,
        )),
    }
}

/// A tensor shaped like `t` whose every element is one uninitialized value (on CUDA a zero
/// stride view of a one-element buffer; backends without strided views may fill it).
fn no_storage<I: Backend>(t: &I::FloatTensorPrimitive) -> I::FloatTensorPrimitive {
    use burn::tensor::{FloatDType, Shape, TensorMetadata};
    let shape = t.shape();
    let one = I::float_empty(
        Shape::from(vec![1; shape.num_dims()]),
        &I::float_device(t),
        FloatDType::from(t.dtype()),
    );
    I::float_expand(one, shape)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Distribution;

    type I = NdArray<f32>;
    type A = Autodiff<I>;

    /// The seeded backward gives the same leaf gradients as the sum trick, for a graph with a
    /// leaf used twice (gradients must add) and a leaf that needs no gradient.
    #[test]
    fn seeded_backward_matches_the_sum_trick() {
        let dev = Default::default();
        let x0 = Tensor::<I, 2>::random([3, 5], Distribution::Default, &dev);
        let w0 = Tensor::<I, 2>::random([5, 4], Distribution::Default, &dev);
        let g = Tensor::<I, 2>::random([3, 4], Distribution::Default, &dev);
        let run = |seed: bool| {
            let x = Tensor::<A, 2>::from_inner(x0.clone()).require_grad();
            let w = Tensor::<A, 2>::from_inner(w0.clone()).require_grad();
            let c = Tensor::<A, 2>::from_inner(x0.clone()); // no gradient wanted
            let y = (x.clone() * c).matmul(w.clone()) + x.clone().matmul(w.clone()).tanh();
            let grads = if seed {
                backward_from(y, g.clone())
            } else {
                (y * Tensor::from_inner(g.clone())).sum().backward()
            };
            let v = |t: Tensor<I, 2>| t.into_data().to_vec::<f32>().unwrap();
            (v(x.grad(&grads).unwrap()), v(w.grad(&grads).unwrap()))
        };
        let (a, b) = (run(true), run(false));
        for (p, q) in a.0.iter().chain(&a.1).zip(b.0.iter().chain(&b.1)) {
            assert!((p - q).abs() <= 1e-5 * (1.0 + q.abs()), "{p} vs {q}");
        }
    }

    /// A tensor that gave up its values still finds (and replaces) its gradient, keeps its
    /// shape, and no longer holds its values.
    #[test]
    fn without_values_keeps_the_node_not_the_values() {
        let dev = Default::default();
        let x = Tensor::<A, 2>::random([3, 5], Distribution::Default, &dev);
        let w =
            Tensor::<A, 2>::random([5, 4], Distribution::Uniform(1.0, 2.0), &dev).require_grad();
        let mut grads = x.matmul(w.clone()).sum().backward();
        let stand_in = without_values(w.clone());
        assert_eq!(stand_in.dims(), [5, 4]);
        assert!(stand_in.is_require_grad());
        let v = |t: Tensor<I, 2>| t.into_data().to_vec::<f32>().unwrap();
        assert_eq!(
            v(stand_in.grad(&grads).unwrap()),
            v(w.grad(&grads).unwrap())
        );
        assert!(
            v(stand_in.clone().inner()).iter().all(|&e| e < 1.0),
            "the stand-in still holds the values (all in [1, 2))"
        );
        stand_in.grad_replace(&mut grads, Tensor::zeros([5, 4], &dev));
        assert!(v(w.grad(&grads).unwrap()).iter().all(|&e| e == 0.0));
    }
}
