//! Cross-entropy over a vocabulary split across the tensor-parallel group (Megatron-LM's
//! `vocab_parallel_cross_entropy`, fused with the LM head's GEMM and chunked over tokens as
//! [`crate::ops::linear_cross_entropy_chunked`] is).
//!
//! Rank `r` holds rows `[r * v / tp, (r + 1) * v / tp)` of the `[v, hidden]` head and scores
//! every position of the gathered sequence against them only. Per token it keeps the
//! log-sum-exp of its own logits and the target's logit where the target is one of its words;
//! two all-reduces of those per-token vectors (a maximum, then one sum of both) give the
//! log-sum-exp over the whole vocabulary and the target logit, hence the loss, the same on every
//! rank. No rank ever holds more than one chunk of its own logits. The backward recomputes each
//! chunk's logits and forms `softmax - onehot` with the global log-sum-exp; the gradient of the
//! gathered input is a partial sum per rank, which the backward of [`super::TpGroup::enter`]
//! sums.

use std::any::Any;

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::{DType, IndexingUpdateOp, Int, Tensor, TensorPrimitive, backend::Backend};
use collectives::ReduceOp;

use super::{Gathered, TpContext};
use crate::error::SmpError;
use crate::loss::Loss;
use crate::ops;

/// `(x [batch, seq, hidden], weight [v / tp, hidden], targets [batch, seq])`, boxed with their
/// backend erased.
pub(crate) type BoxedArgs = (Box<dyn Any>, Box<dyn Any>, Box<dyn Any>);

/// The mean next-token cross-entropy of the logits `x W^T` over the whole vocabulary, where
/// `weight` is this rank's `[vocab / tp, hidden]` rows of the LM head (a vocab-parallel
/// embedding's table, for tied embeddings) and `targets` the whole `[batch, seq]` (the same on
/// every rank). The loss covers the whole sequence and is the same on every rank of the group
/// ([`Loss::over_sequence`]); positions whose target is [`ops::IGNORE_INDEX`] are left out.
///
/// At degree 1 this is [`ops::linear_cross_entropy`], with its fast paths.
///
/// # Panics
/// On mismatched shapes (they are the model's, not the data's).
pub fn vocab_parallel_cross_entropy<B: Backend>(
    x: &Gathered<B>,
    weight: Tensor<B, 2>,
    targets: Tensor<B, 2, Int>,
) -> Loss<B> {
    let tp = x.group();
    tp.check();
    let [batch, seq, hidden] = x.dims();
    assert!(
        targets.dims() == [batch, seq] && weight.dims()[1] == hidden,
        "vocab_parallel_cross_entropy: x {:?}, weight {:?} and targets {:?} do not match \
         ([batch, seq, hidden], [vocab / tp, hidden], [batch, seq])",
        x.dims(),
        weight.dims(),
        targets.dims()
    );
    if tp.degree() == 1 {
        let flat = x.tensor().clone().reshape([batch * seq, hidden]);
        let loss = ops::linear_cross_entropy(flat, weight, targets.reshape([batch * seq]));
        return Loss::over_sequence(loss);
    }
    let device = weight.device();
    let args: BoxedArgs = (
        Box::new(x.tensor().clone()),
        Box::new(weight),
        Box::new(targets),
    );
    match tp.vocab_cross_entropy(args) {
        Ok(out) => match out.downcast::<Tensor<B, 1>>() {
            Ok(loss) => return Loss::over_sequence(*loss),
            Err(_) => tp.poison("vocab_parallel_cross_entropy: wrong output backend".into()),
        },
        Err(Some(e)) => tp.poison(e.to_string()),
        Err(None) => unreachable!("degree > 1 has a context"),
    }
    Loss::over_sequence(Tensor::zeros([1], &device))
}

/// [`super::ErasedTp::vocab_cross_entropy`]: the plain forward on `IB`, the autodiff op on
/// `Autodiff<IB>`; other backends' tensors are handed back.
pub(super) fn apply_erased<IB: Backend>(
    tp: &TpContext<IB>,
    (x, w, t): BoxedArgs,
) -> Result<Result<Box<dyn Any>, SmpError>, BoxedArgs> {
    let x = match x.downcast::<Tensor<IB, 3>>() {
        Ok(x) => {
            let w = w.downcast::<Tensor<IB, 2>>();
            let t = t.downcast::<Tensor<IB, 2, Int>>();
            return match (w, t) {
                (Ok(w), Ok(t)) => Ok(forward(tp, flat(*x), *w, flat_targets(*t), false)
                    .map(|(loss, _)| Box::new(loss) as Box<dyn Any>)),
                (w, t) => Err((x, any(w), any(t))),
            };
        }
        Err(x) => x,
    };
    let x = match x.downcast::<Tensor<Autodiff<IB>, 3>>() {
        Ok(x) => x,
        Err(x) => return Err((x, w, t)),
    };
    let w = w.downcast::<Tensor<Autodiff<IB>, 2>>();
    let t = t.downcast::<Tensor<Autodiff<IB>, 2, Int>>();
    match (w, t) {
        (Ok(w), Ok(t)) => Ok(autodiff(tp, *x, *w, *t).map(|l| Box::new(l) as Box<dyn Any>)),
        (w, t) => Err((x, any(w), any(t))),
    }
}

fn any<T: 'static>(r: Result<Box<T>, Box<dyn Any>>) -> Box<dyn Any> {
    match r {
        Ok(t) => t,
        Err(t) => t,
    }
}

fn flat<B: Backend>(x: Tensor<B, 3>) -> Tensor<B, 2> {
    let [batch, seq, hidden] = x.dims();
    x.reshape([batch * seq, hidden])
}

fn flat_targets<B: Backend>(t: Tensor<B, 2, Int>) -> Tensor<B, 1, Int> {
    let [batch, seq] = t.dims();
    t.reshape([batch * seq])
}

/// Tokens per chunk: each chunk's f32 logits of this rank's rows within the loss's budget.
fn chunk_tokens(local_vocab: usize) -> usize {
    ops::default_loss_chunk_tokens(local_vocab)
}

/// This rank's targets as local row indices (0 for the others' words) and whether each is one
/// of its words (1.0 / 0.0, f32).
fn local_targets<B: Backend>(
    targets: Tensor<B, 1, Int>,
    start: usize,
    rows: usize,
) -> (Tensor<B, 1, Int>, Tensor<B, 1>) {
    let start = start as i64;
    let mine = targets
        .clone()
        .greater_equal_elem(start)
        .bool_and(targets.clone().lower_elem(start + rows as i64));
    let local = targets
        .sub_scalar(start)
        .mask_fill(mine.clone().bool_not(), 0);
    (local, mine.float().cast(DType::F32))
}

/// The loss (`[1]`, f32) and, when `keep`, the per-token global log-sum-exp for the backward.
fn forward<B: Backend>(
    tp: &TpContext<B>,
    x: Tensor<B, 2>,
    w: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    keep: bool,
) -> Result<(Tensor<B, 1>, Option<Tensor<B, 1>>), SmpError> {
    let [tokens, _] = x.dims();
    let rows = w.dims()[0];
    // An ignored (negative) target is no rank's word; its position is left out of the mean.
    let (_, scored, divisor) = ops::scored_targets(targets.clone());
    let (local, mine) = local_targets(targets, tp.rank() * rows, rows);
    let step = chunk_tokens(rows);
    let mut lses = Vec::new();
    let mut picked = Vec::new();
    for start in (0..tokens).step_by(step.max(1)) {
        let len = step.min(tokens - start);
        let logits = ops::linear(x.clone().narrow(0, start, len), w.clone()).cast(DType::F32);
        let t = local.clone().narrow(0, start, len).reshape([len, 1]);
        let max = logits.clone().max_dim(1);
        let lse = (logits.clone() - max.clone()).exp().sum_dim(1).log() + max;
        lses.push(lse.reshape([len]));
        picked.push(logits.gather(1, t).reshape([len]));
    }
    let lse_local = Tensor::cat(lses, 0);
    let picked = Tensor::cat(picked, 0) * mine;
    // The log-sum-exp over all words: max over ranks, then one sum of the rescaled partial sums
    // together with the target logits (each held by exactly one rank).
    let max = tp.all_reduce(lse_local.clone(), ReduceOp::Max)?;
    let rescaled = (lse_local - max.clone()).exp();
    let sums = tp.all_reduce(Tensor::cat(vec![rescaled, picked], 0), ReduceOp::Sum)?;
    let lse = sums.clone().narrow(0, 0, tokens).log() + max;
    let target = sums.narrow(0, tokens, tokens);
    let loss = ops::repeatable_sum((lse.clone() - target) * scored).div(divisor);
    Ok((loss, keep.then_some(lse)))
}

fn float<B: Backend, const D: usize>(p: B::FloatTensorPrimitive) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(p))
}

#[derive(Debug)]
struct VocabParallelBackward;

impl<B: Backend> Backward<B, 2> for VocabParallelBackward {
    /// x `[tokens, hidden]`, this rank's weight rows, targets `[tokens]`, the global per-token
    /// log-sum-exp, the group (for this rank's first row).
    type State = (
        B::FloatTensorPrimitive,
        B::FloatTensorPrimitive,
        B::IntTensorPrimitive,
        B::FloatTensorPrimitive,
        TpContext<B>,
    );

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x, node_w] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (x, w, targets, lse, tp) = ops.state;
        let (x, w): (Tensor<B, 2>, Tensor<B, 2>) = (float(x), float(w));
        let targets = Tensor::<B, 1, Int>::from_primitive(targets);
        let lse: Tensor<B, 1> = float(lse);
        let [tokens, _] = x.dims();
        let rows = w.dims()[0];
        let (dtype, x_dtype, device) = (w.dtype(), x.dtype(), x.device());
        let (_, scored, divisor) = ops::scored_targets(targets.clone());
        let (local, mine) = local_targets(targets, tp.rank() * rows, rows);
        let scale = (float::<B, 1>(grad).cast(DType::F32) / divisor).reshape([1, 1]);
        let step = chunk_tokens(rows).max(1);
        let n_chunks = tokens.div_ceil(step);
        let accumulate_f32 = n_chunks > 1 && dtype != DType::F32;
        let mut dxs = Vec::with_capacity(n_chunks);
        let mut dw: Option<Tensor<B, 2>> = None;
        for start in (0..tokens).step_by(step) {
            let len = step.min(tokens - start);
            let xc = x.clone().narrow(0, start, len);
            let logits = ops::linear(xc.clone(), w.clone()).cast(DType::F32);
            let lse_c = lse.clone().narrow(0, start, len).reshape([len, 1]);
            let t = local.clone().narrow(0, start, len).reshape([len, 1]);
            let minus = mine.clone().narrow(0, start, len).reshape([len, 1]).neg();
            let row_scale = scored.clone().narrow(0, start, len).reshape([len, 1]) * scale.clone();
            let g = (logits - lse_c)
                .exp()
                .scatter(1, t, minus, IndexingUpdateOp::Add)
                .mul(row_scale)
                .cast(dtype);
            let (dx_c, dw_c) = ops::linear_grads(g, xc, w.clone(), node_x.is_some(), true);
            if let Some(d) = dx_c {
                dxs.push(d);
            }
            if let Some(d) = dw_c {
                let d = if accumulate_f32 {
                    d.cast(DType::F32)
                } else {
                    d
                };
                dw = Some(match dw {
                    None => d,
                    Some(acc) => acc + d,
                });
            }
        }
        if let Some(node) = node_x {
            let dx = if dxs.len() == 1 {
                dxs.pop().expect("one chunk")
            } else if dxs.is_empty() {
                Tensor::zeros([tokens, x.dims()[1]], (&device, x_dtype))
            } else {
                Tensor::cat(dxs, 0)
            };
            grads.register::<B>(node.id, dx.cast(x_dtype).into_primitive().tensor());
        }
        if let (Some(node), Some(dw)) = (node_w, dw) {
            grads.register::<B>(node.id, dw.cast(dtype).into_primitive().tensor());
        }
    }
}

/// The loss as one op of Burn's autodiff over `Autodiff<IB>` (`x` is 3-D, flattened here).
fn autodiff<IB: Backend>(
    tp: &TpContext<IB>,
    x: Tensor<Autodiff<IB>, 3>,
    w: Tensor<Autodiff<IB>, 2>,
    targets: Tensor<Autodiff<IB>, 2, Int>,
) -> Result<Tensor<Autodiff<IB>, 1>, SmpError> {
    let targets = flat_targets(Tensor::<IB, 2, Int>::from_primitive(
        targets.into_primitive(),
    ));
    let x = flat(x).into_primitive().tensor();
    let w = w.into_primitive().tensor();
    let prep = <VocabParallelBackward as Backward<IB, 2>>::prepare::<NoCheckpointing>(
        VocabParallelBackward,
        [x.node.clone(), w.node.clone()],
    );
    let out = match prep.compute_bound().stateful() {
        OpsKind::Tracked(prep) => {
            let (loss, lse) = forward(
                tp,
                float(x.primitive.clone()),
                float(w.primitive.clone()),
                targets.clone(),
                true,
            )?;
            let lse = lse.expect("kept for the backward");
            prep.finish(
                (
                    x.primitive,
                    w.primitive,
                    targets.into_primitive(),
                    lse.into_primitive().tensor(),
                    tp.clone(),
                ),
                loss.into_primitive().tensor(),
            )
        }
        OpsKind::UnTracked(prep) => {
            let (loss, _) = forward(tp, float(x.primitive), float(w.primitive), targets, false)?;
            prep.finish(loss.into_primitive().tensor())
        }
    };
    Ok(Tensor::from_primitive(TensorPrimitive::Float(out)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::HostTensorComm;
    use crate::tp::TpGroup;
    use burn::tensor::TensorData;
    use burn_ndarray::NdArray;
    use collectives::{CommOptions, run_on_threads};
    use std::sync::Arc;

    type Inner = NdArray<f32>;
    type B = Autodiff<Inner>;

    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x % 2001) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    /// The vocab-parallel loss and the gradients of the input and of each rank's rows equal the
    /// replicated cross-entropy of the full logits, on 2 and 4 ranks, with and without sequence
    /// parallelism (the gathered input's gradient summed by `enter`'s backward).
    #[test]
    fn equals_the_replicated_loss() {
        let (batch, seq, hidden, vocab) = (2, 4, 3, 8);
        let dev = Default::default();
        let x = Tensor::<Inner, 3>::from_data(
            TensorData::new(values(batch * seq * hidden, 1), [batch, seq, hidden]),
            &dev,
        );
        let w = Tensor::<Inner, 2>::from_data(
            TensorData::new(values(vocab * hidden, 2), [vocab, hidden]),
            &dev,
        );
        let ids: Vec<i64> = (0..batch * seq)
            .map(|i| ((i * 5 + 3) % vocab) as i64)
            .collect();
        // The second set leaves two positions unscored (one per row, one in each half of the
        // sequence so both sequence-parallel chunks hold one).
        let mut ignored = ids.clone();
        ignored[1] = ops::IGNORE_INDEX;
        ignored[seq + 2] = ops::IGNORE_INDEX;
        for ids in [ids, ignored] {
            let targets =
                Tensor::<Inner, 2, Int>::from_data(TensorData::new(ids, [batch, seq]), &dev);
            // Reference: full logits, replicated loss.
            let (xr, wr) = (
                Tensor::<B, 3>::from_inner(x.clone()).require_grad(),
                Tensor::<B, 2>::from_inner(w.clone()).require_grad(),
            );
            let logits = ops::linear(xr.clone().reshape([batch * seq, hidden]), wr.clone());
            let loss = ops::cross_entropy(
                logits,
                Tensor::from_inner(targets.clone()).reshape([batch * seq]),
            );
            let want = loss.clone().into_scalar();
            let grads = loss.backward();
            let (gx, gw) = (xr.grad(&grads).unwrap(), wr.grad(&grads).unwrap());
            for (tp, sp) in [(2, true), (4, true), (2, false)] {
                run_on_threads(tp, CommOptions::default(), |comm| {
                    let group = TpGroup::new(TpContext::<Inner>::new(
                        Arc::new(HostTensorComm::new(comm)),
                        sp,
                    ));
                    let r = group.rank();
                    let rows = vocab / tp;
                    let chunk = group.sequence_chunk(seq).unwrap();
                    let xl = Tensor::<B, 3>::from_inner(x.clone().slice([0..batch, chunk.clone()]))
                        .require_grad();
                    let wl = Tensor::<B, 2>::from_inner(w.clone().narrow(0, r * rows, rows))
                        .require_grad();
                    let gathered = group.enter(xl.clone());
                    let loss = vocab_parallel_cross_entropy(
                        &gathered,
                        wl.clone(),
                        Tensor::from_inner(targets.clone()),
                    );
                    assert_eq!(loss.scope(), crate::loss::LossScope::Sequence);
                    let got = loss.value().clone().into_scalar();
                    assert!((got - want).abs() < 1e-5, "tp {tp}: loss {got} vs {want}");
                    let grads = loss.value().clone().backward();
                    assert!(group.take_failure().is_none());
                    let close = |a: Tensor<Inner, 3>, b: Tensor<Inner, 3>, what: &str| {
                        let (a, b) = (a.into_data().to_vec::<f32>().unwrap(), b.into_data());
                        for (x, y) in a.iter().zip(b.to_vec::<f32>().unwrap()) {
                            assert!((x - y).abs() < 1e-5, "tp {tp} sp {sp} {what}: {x} vs {y}");
                        }
                    };
                    close(
                        xl.grad(&grads).unwrap(),
                        gx.clone().slice([0..batch, chunk]),
                        "input gradient",
                    );
                    close(
                        wl.grad(&grads).unwrap().unsqueeze(),
                        gw.clone().narrow(0, r * rows, rows).unsqueeze(),
                        "weight gradient",
                    );
                });
            }
        }
    }
}
