//! The collectives of tensor parallelism as conjugate forward/backward pairs (Megatron-LM's
//! `mappings.py`), each one op of Burn's autodiff, on activations `[batch, seq, hidden]`:
//!
//! | [`Mapping`] | forward | backward | where |
//! |---|---|---|---|
//! | `CopyToTp` | identity | all-reduce (sum) | entering a split region, no sequence parallelism |
//! | `ReduceFromTp` | all-reduce (sum) | identity | leaving it: row-parallel partial sums |
//! | `GatherSequence` | all-gather along the sequence | reduce-scatter along the sequence | entering a split region with sequence parallelism |
//! | `ReduceScatterSequence` | reduce-scatter along the sequence | all-gather along the sequence | leaving it |
//! | `GatherLastDim` | all-gather along the last dimension | this rank's slice of it | full-vocabulary logits for sampling |
//!
//! Why each backward is right: a tensor copied to every rank and used there with each rank's
//! own weight slice has, as its gradient, the sum of the ranks' contributions; a sum formed from
//! every rank's partial passes its gradient unchanged to each partial; a gathered sequence used
//! by every rank with its own weight slice sends each position's summed gradient back to the
//! rank that holds the position; a reduce-scattered partial sum contributed to every position,
//! so each rank needs the gradient of the whole sequence.
//!
//! The public functions take any backend: `Autodiff<IB>` for the mesh's backend `IB` gets the
//! autodiff op, `IB` itself the plain collective (evaluation). The flat collectives concatenate
//! the ranks' chunks, so a batch of several sequences is permuted around them.

use std::any::Any;

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::{Tensor, TensorPrimitive, backend::Backend};
use collectives::ReduceOp;

use super::{TpContext, TpGroup, split_len};
use crate::error::SmpError;

/// One conjugate pair (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mapping {
    /// Forward identity, backward all-reduce.
    CopyToTp,
    /// Forward all-reduce, backward identity.
    ReduceFromTp,
    /// Forward all-gather along the sequence, backward reduce-scatter.
    GatherSequence,
    /// Forward reduce-scatter along the sequence, backward all-gather.
    ReduceScatterSequence,
    /// Forward all-gather along the last dimension, backward split.
    GatherLastDim,
}

/// A collective step on a plain tensor: one direction of a [`Mapping`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    Identity,
    AllReduce,
    GatherSequence,
    ReduceScatterSequence,
    GatherLastDim,
    SplitLastDim,
}

impl Mapping {
    /// The name for messages.
    pub fn name(self) -> &'static str {
        match self {
            Mapping::CopyToTp => "copy_to_tp",
            Mapping::ReduceFromTp => "reduce_from_tp",
            Mapping::GatherSequence => "gather_sequence",
            Mapping::ReduceScatterSequence => "reduce_scatter_sequence",
            Mapping::GatherLastDim => "gather_last_dim",
        }
    }

    fn steps(self) -> (Step, Step) {
        match self {
            Mapping::CopyToTp => (Step::Identity, Step::AllReduce),
            Mapping::ReduceFromTp => (Step::AllReduce, Step::Identity),
            Mapping::GatherSequence => (Step::GatherSequence, Step::ReduceScatterSequence),
            Mapping::ReduceScatterSequence => (Step::ReduceScatterSequence, Step::GatherSequence),
            Mapping::GatherLastDim => (Step::GatherLastDim, Step::SplitLastDim),
        }
    }

    /// The forward output's shape for an input of `dims` over `degree` ranks.
    pub fn output_dims(self, dims: [usize; 3], degree: usize) -> [usize; 3] {
        step_dims(self.steps().0, dims, degree)
    }
}

fn step_dims(step: Step, [b, s, h]: [usize; 3], degree: usize) -> [usize; 3] {
    match step {
        Step::Identity | Step::AllReduce => [b, s, h],
        Step::GatherSequence => [b, s * degree, h],
        Step::ReduceScatterSequence => [b, s / degree.max(1), h],
        Step::GatherLastDim => [b, s, h * degree],
        Step::SplitLastDim => [b, s, h / degree.max(1)],
    }
}

/// Runs one collective step on a plain tensor.
fn run_step<IB: Backend>(
    step: Step,
    x: Tensor<IB, 3>,
    tp: &TpContext<IB>,
) -> Result<Tensor<IB, 3>, SmpError> {
    let degree = tp.degree();
    if degree == 1 {
        return Ok(x);
    }
    let [batch, seq, hidden] = x.dims();
    match step {
        Step::Identity => Ok(x),
        Step::AllReduce => {
            let flat = x.reshape([batch * seq * hidden]);
            let sum = tp.timed(|| tp.comm().all_reduce(flat, ReduceOp::Sum))?;
            Ok(sum.reshape([batch, seq, hidden]))
        }
        Step::GatherSequence => {
            let flat = x.reshape([batch * seq * hidden]);
            let full = tp.timed(|| tp.comm().all_gather(flat))?;
            // The collective concatenates rank chunks: [tp, batch, local, hidden].
            let full = full.reshape([degree, batch, seq, hidden]);
            Ok(if batch == 1 {
                full.reshape([1, degree * seq, hidden])
            } else {
                full.swap_dims(0, 1).reshape([batch, degree * seq, hidden])
            })
        }
        Step::ReduceScatterSequence => {
            let local = split_len("sequence length", seq, degree)?;
            // Rank chunks must be contiguous for the flat collective: [tp, batch, local, hidden].
            let flat = if batch == 1 {
                x.reshape([seq * hidden])
            } else {
                x.reshape([batch, degree, local, hidden])
                    .swap_dims(0, 1)
                    .reshape([batch * seq * hidden])
            };
            let part = tp.timed(|| tp.comm().reduce_scatter(flat, ReduceOp::Sum))?;
            Ok(part.reshape([batch, local, hidden]))
        }
        Step::GatherLastDim => {
            let flat = x.reshape([batch * seq * hidden]);
            let full = tp.timed(|| tp.comm().all_gather(flat))?;
            // [tp, batch, seq, hidden] -> [batch, seq, tp, hidden] -> [batch, seq, tp * hidden].
            Ok(full
                .reshape([degree, batch * seq, hidden])
                .swap_dims(0, 1)
                .reshape([batch, seq, degree * hidden]))
        }
        Step::SplitLastDim => {
            let local = split_len("last dimension", hidden, degree)?;
            Ok(x.narrow(2, tp.rank() * local, local))
        }
    }
}

fn float<B: Backend>(t: B::FloatTensorPrimitive) -> Tensor<B, 3> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

/// The backward half of a mapping: runs `step` on the incoming gradient.
#[derive(Debug)]
struct MappingBackward {
    step: Step,
    name: &'static str,
}

impl<B: Backend> Backward<B, 1> for MappingBackward {
    /// The group and the input's shape (the gradient's shape after the step).
    type State = (TpContext<B>, [usize; 3]);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [parent] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let Some(parent) = parent else { return };
        let (tp, input_dims) = ops.state;
        let g = float::<B>(grad);
        let (device, dtype) = (g.device(), g.dtype());
        // Burn's backward has no error path: record the failure, hand on zeros, and let the
        // engine report it after the pass.
        let g = run_step(self.step, g, &tp).unwrap_or_else(|e| {
            tp.poison(&format!("{} in the backward pass", self.name), e);
            Tensor::zeros(input_dims, (&device, dtype))
        });
        grads.register::<B>(parent.id, g.into_primitive().tensor());
    }
}

/// `mapping` as one autodiff op over `Autodiff<IB>`.
fn apply_autodiff<IB: Backend>(
    mapping: Mapping,
    x: Tensor<Autodiff<IB>, 3>,
    tp: &TpContext<IB>,
) -> Result<Tensor<Autodiff<IB>, 3>, SmpError> {
    let (forward, backward) = mapping.steps();
    let dims = x.dims();
    let x = x.into_primitive().tensor();
    let op = MappingBackward {
        step: backward,
        name: mapping.name(),
    };
    let out = match op
        .prepare::<NoCheckpointing>([x.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let y = run_step(forward, float::<IB>(x.primitive), tp)?;
            prep.finish((tp.clone(), dims), y.into_primitive().tensor())
        }
        OpsKind::UnTracked(prep) => {
            let y = run_step(forward, float::<IB>(x.primitive), tp)?;
            prep.finish(y.into_primitive().tensor())
        }
    };
    Ok(Tensor::from_primitive(TensorPrimitive::Float(out)))
}

/// [`super::ErasedTp::apply`]: the box holds a `Tensor<IB, 3>` (plain forward) or a
/// `Tensor<Autodiff<IB>, 3>` (the autodiff op); anything else is handed back.
pub(super) fn apply_erased<IB: Backend>(
    tp: &TpContext<IB>,
    mapping: Mapping,
    x: Box<dyn Any>,
) -> Result<Result<Box<dyn Any>, SmpError>, Box<dyn Any>> {
    let x = match x.downcast::<Tensor<IB, 3>>() {
        Ok(t) => {
            let out = run_step(mapping.steps().0, *t, tp);
            return Ok(out.map(|y| Box::new(y) as Box<dyn Any>));
        }
        Err(x) => x,
    };
    match x.downcast::<Tensor<Autodiff<IB>, 3>>() {
        Ok(t) => Ok(apply_autodiff(mapping, *t, tp).map(|y| Box::new(y) as Box<dyn Any>)),
        Err(x) => Err(x),
    }
}

/// Identity forward, all-reduce (sum) backward: the input of column-parallel layers without
/// sequence parallelism. Identity at degree 1.
pub fn copy_to_tp<B: Backend>(x: Tensor<B, 3>, tp: &TpGroup) -> Tensor<B, 3> {
    tp.apply(Mapping::CopyToTp, x)
}

/// All-reduce (sum) forward, identity backward: the partial sums of a row-parallel layer
/// without sequence parallelism. Identity at degree 1.
pub fn reduce_from_tp<B: Backend>(x: Tensor<B, 3>, tp: &TpGroup) -> Tensor<B, 3> {
    tp.apply(Mapping::ReduceFromTp, x)
}

/// All-gather along the sequence forward, reduce-scatter backward: this rank's `[batch, seq /
/// tp, hidden]` chunk to the full `[batch, seq, hidden]` (rank `r`'s chunk at positions
/// `[r * seq / tp, (r + 1) * seq / tp)`). Identity at degree 1.
pub fn gather_sequence<B: Backend>(x: Tensor<B, 3>, tp: &TpGroup) -> Tensor<B, 3> {
    tp.apply(Mapping::GatherSequence, x)
}

/// Reduce-scatter along the sequence forward, all-gather backward: the sum over the ranks of
/// their partial `[batch, seq, hidden]`, of which this rank keeps its `[batch, seq / tp,
/// hidden]` chunk. Identity at degree 1.
pub fn reduce_scatter_sequence<B: Backend>(x: Tensor<B, 3>, tp: &TpGroup) -> Tensor<B, 3> {
    tp.apply(Mapping::ReduceScatterSequence, x)
}

/// All-gather along the last dimension forward, this rank's slice backward: the full
/// `[batch, seq, tp * n]` from every rank's `[batch, seq, n]` (vocab-parallel logits to the
/// whole vocabulary). Identity at degree 1.
pub fn gather_last_dim<B: Backend>(x: Tensor<B, 3>, tp: &TpGroup) -> Tensor<B, 3> {
    tp.apply(Mapping::GatherLastDim, x)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::HostTensorComm;
    use burn::tensor::{Distribution, TensorData};
    use burn_ndarray::NdArray;
    use collectives::{CommOptions, run_on_threads};
    use std::sync::Arc;

    type Inner = NdArray<f32>;
    type B = Autodiff<Inner>;

    fn tensor<const D: usize>(shape: [usize; D], seed: u64) -> Tensor<Inner, D> {
        // Deterministic values without the backend's RNG (each rank must see the same ones).
        let n: usize = shape.iter().product();
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let v: Vec<f32> = (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x % 2001) as f32 / 1000.0 - 1.0
            })
            .collect();
        Tensor::from_data(TensorData::new(v, shape), &Default::default())
    }

    fn close<const D: usize>(a: Tensor<Inner, D>, b: Tensor<Inner, D>, what: &str) {
        assert_eq!(a.dims(), b.dims(), "{what}: shapes");
        let a = a.into_data().to_vec::<f32>().unwrap();
        let b = b.into_data().to_vec::<f32>().unwrap();
        let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            // Sums over ranks in another order than the unsplit matmul: f32 rounding only.
            assert!((x - y).abs() <= 1e-5 * scale, "{what}[{i}]: {x} vs {y}");
        }
    }

    fn on_ranks<R: Send>(tp: usize, sp: bool, f: impl Fn(TpGroup) -> R + Sync) -> Vec<R> {
        run_on_threads(tp, CommOptions::default(), |comm| {
            f(TpGroup::new(TpContext::<Inner>::new(
                Arc::new(HostTensorComm::new(comm)),
                sp,
            )))
        })
    }

    /// A tensor-parallel MLP, `y = ((x W1^T) ⊙ (x W1^T)) W2^T` with W1 column-parallel and W2
    /// row-parallel, on 2 and 3 ranks with a batch of 2, with and without sequence parallelism:
    /// the output, and the gradients of the input and of each rank's weight slices match the
    /// unsplit computation.
    #[test]
    fn split_mlp_matches_unsplit() {
        let (batch, seq, hidden, ffn) = (2, 6, 4, 6);
        let x = tensor([batch, seq, hidden], 1);
        let w1 = tensor([ffn, hidden], 2);
        let w2 = tensor([hidden, ffn], 3);
        let probe = tensor([batch, seq, hidden], 4);
        // Unsplit reference.
        let (xr, w1r, w2r) = (
            Tensor::<B, 3>::from_inner(x.clone()).require_grad(),
            Tensor::<B, 2>::from_inner(w1.clone()).require_grad(),
            Tensor::<B, 2>::from_inner(w2.clone()).require_grad(),
        );
        let a = crate::ops::linear(xr.clone(), w1r.clone());
        let y = crate::ops::linear(a.clone() * a, w2r.clone());
        let loss = (y.clone() * Tensor::from_inner(probe.clone())).sum();
        let grads = loss.backward();
        let (gx, gw1, gw2) = (
            xr.grad(&grads).unwrap(),
            w1r.grad(&grads).unwrap(),
            w2r.grad(&grads).unwrap(),
        );
        let y = y.inner();
        for (tp, sp) in [(2, true), (3, true), (2, false), (3, false)] {
            on_ranks(tp, sp, |group| {
                let r = group.rank();
                let chunk = group.sequence_chunk(seq).unwrap();
                let cols = group.split_len("ffn", ffn).unwrap();
                let xl = Tensor::<B, 3>::from_inner(x.clone().slice([0..batch, chunk.clone()]))
                    .require_grad();
                let w1l =
                    Tensor::<B, 2>::from_inner(w1.clone().narrow(0, r * cols, cols)).require_grad();
                let w2l =
                    Tensor::<B, 2>::from_inner(w2.clone().narrow(1, r * cols, cols)).require_grad();
                let full = group.enter(xl.clone());
                close(full.tensor().clone().inner(), x.clone(), "gathered input");
                let a = crate::ops::linear(full.tensor().clone(), w1l.clone());
                let part = crate::ops::linear(a.clone() * a, w2l.clone());
                let out = if sp {
                    reduce_scatter_sequence(part, &group)
                } else {
                    reduce_from_tp(part, &group)
                };
                assert!(group.take_failure().is_none());
                let what = format!("tp {tp} sp {sp} rank {r}");
                close(
                    out.clone().inner(),
                    y.clone().slice([0..batch, chunk.clone()]),
                    &format!("{what}: output chunk"),
                );
                // With sequence parallelism each rank's share of the loss is its own chunk and
                // their sum is the full loss; without it every rank holds the whole loss.
                let local = (out
                    * Tensor::from_inner(probe.clone().slice([0..batch, chunk.clone()])))
                .sum();
                let grads = local.backward();
                close(
                    xl.grad(&grads).unwrap(),
                    gx.clone().slice([0..batch, chunk]),
                    &format!("{what}: input gradient"),
                );
                close(
                    w1l.grad(&grads).unwrap(),
                    gw1.clone().narrow(0, r * cols, cols),
                    &format!("{what}: column-parallel weight gradient"),
                );
                close(
                    w2l.grad(&grads).unwrap(),
                    gw2.clone().narrow(1, r * cols, cols),
                    &format!("{what}: row-parallel weight gradient"),
                );
            });
        }
    }

    /// Each sequence op alone, batch 3: gather's backward sums the ranks' different upstream
    /// gradients (reduce-scatter); reduce-scatter's backward hands every rank the whole
    /// gradient.
    #[test]
    fn sequence_pairs_alone() {
        let (batch, seq, hidden, tp) = (3, 4, 2, 2);
        let x = tensor([batch, seq, hidden], 5);
        let on_rank = |r: usize| tensor::<3>([batch, seq, hidden], 10 + r as u64);
        on_ranks(tp, true, |group| {
            let r = group.rank();
            let chunk = group.sequence_chunk(seq).unwrap();
            let xl = Tensor::<B, 3>::from_inner(x.clone().slice([0..batch, chunk.clone()]))
                .require_grad();
            let full = gather_sequence(xl.clone(), &group);
            let grads = (full * Tensor::from_inner(on_rank(r))).sum().backward();
            let want = (on_rank(0) + on_rank(1)).slice([0..batch, chunk.clone()]);
            close(xl.grad(&grads).unwrap(), want, "gather backward");
            let z = Tensor::<B, 3>::from_inner(on_rank(r)).require_grad();
            let part = z.clone() * Tensor::from_inner(x.clone());
            let out = reduce_scatter_sequence(part, &group);
            let sum = (on_rank(0) + on_rank(1)) * x.clone();
            close(
                out.clone().inner(),
                sum.slice([0..batch, chunk.clone()]),
                "reduce-scatter forward",
            );
            let d = tensor::<3>([batch, seq, hidden], 20);
            let grads = (out * Tensor::from_inner(d.clone().slice([0..batch, chunk])))
                .sum()
                .backward();
            close(
                z.grad(&grads).unwrap(),
                x.clone() * d,
                "reduce-scatter backward",
            );
        });
    }

    /// The last-dimension pair: the forward concatenates the ranks' slices in rank order; the
    /// backward hands each rank its own slice of the gradient.
    #[test]
    fn last_dim_pair() {
        let full = tensor([2, 3, 6], 7);
        let d = tensor([2, 3, 6], 8);
        on_ranks(3, true, |group| {
            let r = group.rank();
            let local = Tensor::<B, 3>::from_inner(full.clone().narrow(2, 2 * r, 2)).require_grad();
            let gathered = gather_last_dim(local.clone(), &group);
            close(gathered.clone().inner(), full.clone(), "gathered");
            let grads = (gathered * Tensor::from_inner(d.clone())).sum().backward();
            close(
                local.grad(&grads).unwrap(),
                d.clone().narrow(2, 2 * r, 2),
                "split gradient",
            );
        });
    }

    /// Without a graph (evaluation) the ops are the plain collectives, on the inner backend too.
    #[test]
    fn untracked_and_inner_inputs_take_the_forward_only() {
        let x = Tensor::<Inner, 3>::random([2, 4, 3], Distribution::Default, &Default::default());
        on_ranks(2, true, |group| {
            let chunk = group.sequence_chunk(4).unwrap();
            let xl = Tensor::<B, 3>::from_inner(x.clone().slice([0..2, chunk.clone()]));
            close(gather_sequence(xl, &group).inner(), x.clone(), "autodiff");
            let xi = x.clone().slice([0..2, chunk]);
            close(gather_sequence(xi, &group), x.clone(), "inner");
        });
    }

    /// A failed collective (an indivisible sequence) is recorded, not panicked, and the op
    /// yields zeros of the expected shape.
    #[test]
    fn failures_are_recorded_and_named() {
        on_ranks(2, true, |group| {
            let e = group.sequence_chunk(7).unwrap_err().to_string();
            assert!(
                e.contains("sequence length 7") && e.contains("tensor_parallel_degree 2"),
                "{e}"
            );
            let x = Tensor::<B, 3>::zeros([1, 5, 2], &Default::default());
            let y = reduce_scatter_sequence(x, &group);
            assert_eq!(y.dims(), [1, 2, 2]);
            let e = group.take_failure().expect("recorded").to_string();
            assert!(e.contains("sequence length 5"), "{e}");
            assert!(group.take_failure().is_none(), "taken once");
            let e = group
                .split_len("num_key_value_heads", 3)
                .unwrap_err()
                .to_string();
            assert!(e.contains("num_key_value_heads 3"), "{e}");
        });
    }
}
