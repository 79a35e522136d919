//! Tensor parallelism with sequence parallelism (Megatron-LM's `mappings.py`), as autodiff ops.
//!
//! With tensor parallelism a transformer layer's column-parallel linears (q/k/v, gate/up) hold a
//! slice of the output features on each of the `tp` ranks and the row-parallel ones (o, down) a
//! slice of the input features, so the row-parallel outputs are partial sums. With *sequence*
//! parallelism the residual stream between those regions is split along the sequence instead of
//! replicated: each rank keeps `[batch, seq / tp, hidden]`, which divides the activation memory
//! of norms, residuals and saved layer inputs by `tp` — what makes long sequences fit. Two
//! conjugate collectives connect the regions:
//!
//! | op | forward | backward |
//! |---|---|---|
//! | [`gather_sequence`] | all-gather along the sequence | reduce-scatter along the sequence |
//! | [`reduce_scatter_sequence`] | reduce-scatter (sum) along the sequence | all-gather along the sequence |
//!
//! Each is a custom op of Burn's autodiff (the backward runs the conjugate collective), so a
//! layer written with them differentiates with a plain `backward()`. Burn has no
//! specialization, so the entry points take any [`AutodiffBackend`] and check with a `TypeId`
//! that it is [`Autodiff`] over the communicator's backend (as [`crate::fast`] does); the ops
//! themselves ([`gather_sequence_autodiff`], ...) are generic over `B: Backend` for
//! `Autodiff<B>`.
//!
//! The collectives of [`TensorComm`] work on flat buffers and concatenate the ranks' chunks, so
//! with a batch of more than one sequence the gathered buffer is `[tp, batch, seq / tp, hidden]`
//! and is permuted to `[batch, seq, hidden]` (and the reverse before a reduce-scatter).
//!
//! A collective that fails inside `backward()` panics with the error (Burn's backward has no
//! error path); in the forward it is an `Err`.

use std::any::TypeId;
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::{
    Tensor, TensorPrimitive,
    backend::{AutodiffBackend, Backend},
};
use collectives::ReduceOp;

use crate::comm::TensorComm;
use crate::error::SmpError;
use crate::fast::same;
use crate::fsdp::CommStats;

/// One rank's tensor-parallel group: the communicator of the mesh's `tensor` axis (ranks that
/// hold the same data-parallel shard and split each layer between them), its degree and this
/// rank's index in it. Cheap to clone (shared state).
#[derive(Debug, Clone)]
pub struct TpContext<IB: Backend> {
    inner: Arc<TpInner<IB>>,
}

#[derive(Debug)]
struct TpInner<IB: Backend> {
    comm: Arc<dyn TensorComm<IB>>,
    stats: Mutex<CommStats>,
}

impl<IB: Backend> TpContext<IB> {
    /// The context of `comm`'s group (the `tensor` axis of the device mesh).
    pub fn new(comm: Arc<dyn TensorComm<IB>>) -> Self {
        Self {
            inner: Arc::new(TpInner {
                comm,
                stats: Mutex::default(),
            }),
        }
    }

    /// Ranks a layer is split across.
    pub fn degree(&self) -> usize {
        self.inner.comm.world_size()
    }

    /// This rank's index in the tensor-parallel group: which slice of each split weight and
    /// which chunk of the sequence it holds.
    pub fn rank(&self) -> usize {
        self.inner.comm.rank()
    }

    /// The communicator of the group.
    pub fn comm(&self) -> &Arc<dyn TensorComm<IB>> {
        &self.inner.comm
    }

    /// `len / degree`, or an error naming `what`, `len` and the degree when it does not divide
    /// (heads, key/value heads, the MLP width, the sequence).
    pub fn split_len(&self, what: &str, len: usize) -> Result<usize, SmpError> {
        split_len(what, len, self.degree())
    }

    /// Positions `[rank * seq / tp, (rank + 1) * seq / tp)` of a sequence of `seq` tokens: the
    /// chunk this rank holds between layers.
    pub fn sequence_chunk(&self, seq: usize) -> Result<Range<usize>, SmpError> {
        let local = self.split_len("sequence length", seq)?;
        Ok(self.rank() * local..(self.rank() + 1) * local)
    }

    /// Sum of `t` over the group (gradients of parameters every tp rank holds whole). Plain
    /// tensors, no autodiff.
    pub fn all_reduce_sum(&self, t: Tensor<IB, 1>) -> Result<Tensor<IB, 1>, SmpError> {
        if self.degree() == 1 {
            return Ok(t);
        }
        self.timed(|| self.inner.comm.all_reduce(t, ReduceOp::Sum))
    }

    /// Mean of `t` over the group (a loss each rank computed on its own sequence chunk).
    pub fn all_reduce_mean(&self, t: Tensor<IB, 1>) -> Result<Tensor<IB, 1>, SmpError> {
        if self.degree() == 1 {
            return Ok(t);
        }
        self.timed(|| self.inner.comm.all_reduce(t, ReduceOp::Avg))
    }

    /// Every rank's `t` concatenated in rank order (reassembling split weights for export).
    pub fn all_gather(&self, t: Tensor<IB, 1>) -> Result<Tensor<IB, 1>, SmpError> {
        if self.degree() == 1 {
            return Ok(t);
        }
        self.timed(|| self.inner.comm.all_gather(t))
    }

    /// Time and calls spent in this group's collectives since the last call (and the device
    /// time where the communicator measures it); resets them.
    pub fn take_stats(&self) -> CommStats {
        let mut stats =
            std::mem::take(&mut *self.inner.stats.lock().unwrap_or_else(|p| p.into_inner()));
        match self.inner.comm.take_device_time() {
            Ok(d) => stats.device = d,
            Err(e) => tracing::warn!("timing tensor-parallel collectives: {e}"),
        }
        stats
    }

    fn timed<T>(&self, f: impl FnOnce() -> Result<T, SmpError>) -> Result<T, SmpError> {
        let start = Instant::now();
        let out = f();
        let mut stats = self.inner.stats.lock().unwrap_or_else(|p| p.into_inner());
        stats.wait += start.elapsed();
        stats.calls += 1;
        out
    }
}

/// `len / degree`, or an error naming `what`, `len` and the degree when it does not divide.
pub fn split_len(what: &str, len: usize, degree: usize) -> Result<usize, SmpError> {
    if degree == 0 || !len.is_multiple_of(degree) {
        return Err(SmpError::Config(format!(
            "{what} {len} is not divisible by tensor_parallel_degree {degree}"
        )));
    }
    Ok(len / degree)
}

/// Forward of [`gather_sequence`] on a plain backend: every rank's `[batch, seq / tp, hidden]`
/// chunk, gathered into `[batch, seq, hidden]` (rank `r`'s chunk at positions
/// `[r * seq / tp, (r + 1) * seq / tp)`).
pub fn gather_sequence_plain<B: Backend>(
    x: Tensor<B, 3>,
    tp: &TpContext<B>,
) -> Result<Tensor<B, 3>, SmpError> {
    let degree = tp.degree();
    if degree == 1 {
        return Ok(x);
    }
    let [batch, local, hidden] = x.dims();
    let flat = x.reshape([batch * local * hidden]);
    let full = tp.timed(|| tp.inner.comm.all_gather(flat))?;
    // The collective concatenates rank chunks: [tp, batch, local, hidden].
    let full = full.reshape([degree, batch, local, hidden]);
    Ok(if batch == 1 {
        full.reshape([1, degree * local, hidden])
    } else {
        full.swap_dims(0, 1)
            .reshape([batch, degree * local, hidden])
    })
}

/// Forward of [`reduce_scatter_sequence`] on a plain backend: the sum of every rank's
/// `[batch, seq, hidden]`, of which this rank keeps positions `[r * seq / tp, (r + 1) * seq /
/// tp)`.
pub fn reduce_scatter_sequence_plain<B: Backend>(
    x: Tensor<B, 3>,
    tp: &TpContext<B>,
) -> Result<Tensor<B, 3>, SmpError> {
    let degree = tp.degree();
    if degree == 1 {
        return Ok(x);
    }
    let [batch, seq, hidden] = x.dims();
    let local = split_len("sequence length", seq, degree)?;
    // Rank chunks must be contiguous for the flat collective: [tp, batch, local, hidden].
    let flat = if batch == 1 {
        x.reshape([seq * hidden])
    } else {
        x.reshape([batch, degree, local, hidden])
            .swap_dims(0, 1)
            .reshape([batch * seq * hidden])
    };
    let part = tp.timed(|| tp.inner.comm.reduce_scatter(flat, ReduceOp::Sum))?;
    Ok(part.reshape([batch, local, hidden]))
}

fn float<B: Backend>(t: B::FloatTensorPrimitive) -> Tensor<B, 3> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

/// Runs a collective inside `backward()`, where an error cannot be returned.
fn in_backward<B: Backend>(
    what: &str,
    r: Result<Tensor<B, 3>, SmpError>,
) -> B::FloatTensorPrimitive {
    match r {
        Ok(t) => t.into_primitive().tensor(),
        Err(e) => panic!("tensor parallelism: {what} in the backward pass failed: {e}"),
    }
}

#[derive(Debug)]
struct GatherSequenceBackward;

impl<B: Backend> Backward<B, 1> for GatherSequenceBackward {
    type State = TpContext<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [parent] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        if let Some(parent) = parent {
            let g = reduce_scatter_sequence_plain(float::<B>(grad), &ops.state);
            grads.register::<B>(
                parent.id,
                in_backward("reduce-scatter of gather_sequence", g),
            );
        }
    }
}

#[derive(Debug)]
struct ReduceScatterSequenceBackward;

impl<B: Backend> Backward<B, 1> for ReduceScatterSequenceBackward {
    type State = TpContext<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [parent] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        if let Some(parent) = parent {
            let g = gather_sequence_plain(float::<B>(grad), &ops.state);
            grads.register::<B>(
                parent.id,
                in_backward("all-gather of reduce_scatter_sequence", g),
            );
        }
    }
}

/// [`gather_sequence`] for `Autodiff<B>`.
pub fn gather_sequence_autodiff<B: Backend>(
    x: Tensor<Autodiff<B>, 3>,
    tp: &TpContext<B>,
) -> Result<Tensor<Autodiff<B>, 3>, SmpError> {
    if tp.degree() == 1 {
        return Ok(x);
    }
    sequence_op(GatherSequenceBackward, x, tp, gather_sequence_plain)
}

/// A sequence collective on a plain backend: [`gather_sequence_plain`] or
/// [`reduce_scatter_sequence_plain`].
type SequenceCollective<B> = fn(Tensor<B, 3>, &TpContext<B>) -> Result<Tensor<B, 3>, SmpError>;

/// Runs `plain` on the inner tensor as one autodiff node whose backward is `op` (the conjugate
/// collective), with the tp context as its state.
fn sequence_op<B: Backend, O: Backward<B, 1, State = TpContext<B>>>(
    op: O,
    x: Tensor<Autodiff<B>, 3>,
    tp: &TpContext<B>,
    plain: SequenceCollective<B>,
) -> Result<Tensor<Autodiff<B>, 3>, SmpError> {
    let x = x.into_primitive().tensor();
    let out = match op
        .prepare::<NoCheckpointing>([x.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let y = plain(float::<B>(x.primitive), tp)?;
            prep.finish(tp.clone(), y.into_primitive().tensor())
        }
        OpsKind::UnTracked(prep) => {
            let y = plain(float::<B>(x.primitive), tp)?;
            prep.finish(y.into_primitive().tensor())
        }
    };
    Ok(Tensor::from_primitive(TensorPrimitive::Float(out)))
}

/// [`reduce_scatter_sequence`] for `Autodiff<B>`.
pub fn reduce_scatter_sequence_autodiff<B: Backend>(
    x: Tensor<Autodiff<B>, 3>,
    tp: &TpContext<B>,
) -> Result<Tensor<Autodiff<B>, 3>, SmpError> {
    if tp.degree() == 1 {
        return Ok(x);
    }
    let seq = x.dims()[1];
    // Checked before the graph node is made, so the error names the sequence.
    split_len("sequence length", seq, tp.degree())?;
    sequence_op(
        ReduceScatterSequenceBackward,
        x,
        tp,
        reduce_scatter_sequence_plain,
    )
}

fn autodiff_only<B: AutodiffBackend>() -> Result<(), SmpError> {
    if TypeId::of::<B>() == TypeId::of::<Autodiff<B::InnerBackend>>() {
        Ok(())
    } else {
        Err(SmpError::Config(format!(
            "tensor parallelism needs Burn's Autodiff<B> backend without checkpointing \
             strategy; got {}",
            std::any::type_name::<B>()
        )))
    }
}

/// All-gather along the sequence: this rank's `[batch, seq / tp, hidden]` chunk to the full
/// `[batch, seq, hidden]`, before a column-parallel linear (which needs every position).
///
/// Backward: reduce-scatter (sum) along the sequence. Every rank used the full sequence with
/// its own slice of the weights, so the gradient of a position is the sum of the ranks'
/// contributions, and each rank keeps its own chunk of positions.
pub fn gather_sequence<B: AutodiffBackend>(
    x: Tensor<B, 3>,
    tp: &TpContext<B::InnerBackend>,
) -> Result<Tensor<B, 3>, SmpError> {
    if tp.degree() == 1 {
        return Ok(x);
    }
    autodiff_only::<B>()?;
    let y = gather_sequence_autodiff::<B::InnerBackend>(same(x), tp)?;
    Ok(same(y))
}

/// Reduce-scatter along the sequence: the sum over the tp ranks of their partial
/// `[batch, seq, hidden]` (the output of a row-parallel linear, each rank's product with its
/// slice of the input features), of which this rank keeps its `[batch, seq / tp, hidden]`
/// chunk. `seq` must be divisible by the degree (the error names both).
///
/// Backward: all-gather along the sequence. Each rank's partial sum contributed to every
/// position, so each needs the gradient of the whole sequence.
pub fn reduce_scatter_sequence<B: AutodiffBackend>(
    x: Tensor<B, 3>,
    tp: &TpContext<B::InnerBackend>,
) -> Result<Tensor<B, 3>, SmpError> {
    if tp.degree() == 1 {
        return Ok(x);
    }
    autodiff_only::<B>()?;
    let y = reduce_scatter_sequence_autodiff::<B::InnerBackend>(same(x), tp)?;
    Ok(same(y))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::HostTensorComm;
    use burn::tensor::{Distribution, TensorData};
    use burn_ndarray::NdArray;
    use collectives::{CommOptions, run_on_threads};

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

    fn on_ranks<R: Send>(tp: usize, f: impl Fn(TpContext<Inner>) -> R + Sync) -> Vec<R> {
        run_on_threads(tp, CommOptions::default(), |comm| {
            f(TpContext::new(Arc::new(HostTensorComm::new(comm))))
        })
    }

    /// A sequence-parallel MLP, `y = ((x W1^T) ⊙ (x W1^T)) W2^T` with W1 column-parallel and W2
    /// row-parallel, on 2 and 3 ranks with a batch of 2: the loss, each rank's output chunk and
    /// the gradients of its input chunk and weight slices match the unsplit computation.
    #[test]
    fn sequence_parallel_mlp_matches_unsplit() {
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
        for tp in [2, 3] {
            on_ranks(tp, |ctx| {
                let r = ctx.rank();
                let chunk = ctx.sequence_chunk(seq).unwrap();
                let cols = ctx.split_len("ffn", ffn).unwrap();
                let xl = Tensor::<B, 3>::from_inner(x.clone().slice([0..batch, chunk.clone()]))
                    .require_grad();
                let w1l =
                    Tensor::<B, 2>::from_inner(w1.clone().narrow(0, r * cols, cols)).require_grad();
                let w2l =
                    Tensor::<B, 2>::from_inner(w2.clone().narrow(1, r * cols, cols)).require_grad();
                let full = gather_sequence(xl.clone(), &ctx).unwrap();
                close(full.clone().inner(), x.clone(), "gathered input");
                let a = crate::ops::linear(full, w1l.clone());
                let part = crate::ops::linear(a.clone() * a, w2l.clone());
                let out = reduce_scatter_sequence(part, &ctx).unwrap();
                let what = format!("tp {tp} rank {r}");
                close(
                    out.clone().inner(),
                    y.clone().slice([0..batch, chunk.clone()]),
                    &format!("{what}: output chunk"),
                );
                // Each rank's share of the loss is its own chunk; their sum is the full loss.
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

    /// Each op alone, batch 3: gather's backward sums the ranks' different upstream gradients
    /// (reduce-scatter); reduce-scatter's backward hands every rank the whole gradient.
    #[test]
    fn conjugate_pairs_alone() {
        let (batch, seq, hidden, tp) = (3, 4, 2, 2);
        let x = tensor([batch, seq, hidden], 5);
        let on_rank = |r: usize| tensor::<3>([batch, seq, hidden], 10 + r as u64);
        on_ranks(tp, |ctx| {
            let r = ctx.rank();
            let chunk = ctx.sequence_chunk(seq).unwrap();
            // gather: rank r weighs the gathered sequence with its own c_r.
            let xl = Tensor::<B, 3>::from_inner(x.clone().slice([0..batch, chunk.clone()]))
                .require_grad();
            let full = gather_sequence(xl.clone(), &ctx).unwrap();
            let grads = (full * Tensor::from_inner(on_rank(r))).sum().backward();
            let want = (on_rank(0) + on_rank(1)).slice([0..batch, chunk.clone()]);
            close(xl.grad(&grads).unwrap(), want, "gather backward");
            // reduce-scatter: partial p_r = z_r * a_r, output = chunk of the sum.
            let z = Tensor::<B, 3>::from_inner(on_rank(r)).require_grad();
            let part = z.clone() * Tensor::from_inner(x.clone());
            let out = reduce_scatter_sequence(part, &ctx).unwrap();
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
            // d loss / d z_r = x * d over the whole sequence (every rank's loss part).
            close(
                z.grad(&grads).unwrap(),
                x.clone() * d,
                "reduce-scatter backward",
            );
        });
    }

    /// Without a graph (evaluation) the ops are the plain collectives.
    #[test]
    fn untracked_inputs_take_the_forward_only() {
        let x = Tensor::<Inner, 3>::random([2, 4, 3], Distribution::Default, &Default::default());
        on_ranks(2, |ctx| {
            let chunk = ctx.sequence_chunk(4).unwrap();
            let xl = Tensor::<B, 3>::from_inner(x.clone().slice([0..2, chunk]));
            let full = gather_sequence(xl, &ctx).unwrap();
            close(full.inner(), x.clone(), "gathered");
        });
    }

    #[test]
    fn indivisible_sizes_are_named() {
        on_ranks(2, |ctx| {
            let e = ctx.sequence_chunk(7).unwrap_err().to_string();
            assert!(
                e.contains("sequence length 7") && e.contains("tensor_parallel_degree 2"),
                "{e}"
            );
            let x = Tensor::<B, 3>::zeros([1, 5, 2], &Default::default());
            let e = reduce_scatter_sequence(x, &ctx).unwrap_err().to_string();
            assert!(e.contains("sequence length 5"), "{e}");
            let e = ctx
                .split_len("num_key_value_heads", 3)
                .unwrap_err()
                .to_string();
            assert!(e.contains("num_key_value_heads 3"), "{e}");
        });
    }
}
