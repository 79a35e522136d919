//! The training step: forward and backward unit by unit, gathering each unit's parameters just
//! before it runs, then gradient finishing, clipping and the optimizer.
//!
//! With activation checkpointing a block's forward runs without an autodiff graph and only its
//! input is kept; its backward gathers the parameters again, recomputes the forward with a
//! graph and backpropagates the incoming gradient. Without it, the block's graph (and so its
//! gathered parameters) is kept from the forward to the backward. With activation offloading
//! the kept input waits in host memory instead ([`crate::offload`]) and comes back a few blocks
//! ahead of its backward. With selective recomputation a recomputed block also keeps what its
//! attention computed, and its recomputation runs everything else ([`crate::selective`]).
//! With prefetch, a unit's all-gather is started before the previous
//! unit's compute is queued, and in the backward a unit's reduce-scatter runs beside the next
//! unit's backward; every rank issues the same collectives in the same order either way.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::{Int, Tensor, backend::AutodiffBackend};

use super::{
    BlockUnit, Cx, Engine, HeadUnit, LossScale, MicroBatch, StemUnit, StepStats, Tied, scored_count,
};
use crate::PendingGather;
use crate::error::SmpError;
use crate::fsdp::{ExternalParams, FsdpContext, ShardedUnit, clip_factor};
use crate::loss::LossScope;
use crate::offload::{HostActivation, offload};
use crate::selective::{self, AttentionStash};
use crate::tp::{Placement, TpGroup};

/// What the forward keeps of a block for its backward.
enum Saved<B: AutodiffBackend, K> {
    /// The input of a block that recomputes its forward, and what its attention kept under
    /// selective recomputation.
    Input(Tensor<B::InnerBackend, 3>, AttentionStash),
    /// The same, the input in host memory (activation offloading).
    Offloaded(HostActivation<B::InnerBackend, 3>, AttentionStash),
    /// The block's graph.
    Graph {
        module: Box<K>,
        input: Tensor<B, 3>,
        output: Tensor<B, 3>,
    },
}

/// Gives up every parameter's values ([`crate::autodiff::without_values`]) of a module kept
/// only to find its parameters' gradients: the graph holds whatever its backward reads.
struct WithoutValues;

impl<B: AutodiffBackend> ModuleMapper<B> for WithoutValues {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        param.map(crate::autodiff::without_values)
    }
}

/// A unit's full flat parameters: the prefetched gather when there is one, else gathered now.
fn gathered<B: AutodiffBackend, M: Module<B>>(
    prefetched: Option<PendingGather<B::InnerBackend>>,
    unit: &ShardedUnit<B, M>,
    ctx: &FsdpContext<B::InnerBackend>,
) -> Result<Tensor<B::InnerBackend, 1>, SmpError> {
    let pending = match prefetched {
        Some(p) => p,
        None => unit.start_gather(ctx)?,
    };
    pending.wait()
}

/// The tied parameters of `tied` as a unit's assembly takes them.
fn externals<B: AutodiffBackend>(tied: Option<&Tied<B>>, track_grad: bool) -> ExternalParams {
    let mut ext = ExternalParams::default();
    if let Some(t) = tied {
        for p in &t.matrices {
            let v = p.val();
            let v = if track_grad {
                v
            } else {
                Tensor::from_inner(v.inner())
            };
            ext.insert::<B, 2>(p.id, v);
        }
        for p in &t.vectors {
            let v = p.val();
            let v = if track_grad {
                v
            } else {
                Tensor::from_inner(v.inner())
            };
            ext.insert::<B, 1>(p.id, v);
        }
    }
    ext
}

/// Checks the residual stream's shape between units.
fn check_stream(what: &str, dims: [usize; 3], cx: &Cx) -> Result<(), SmpError> {
    let want = [cx.batch(), cx.chunk().len()];
    if dims[..2] != want {
        let hint = if cx.tp().sequence_parallel() {
            format!(
                " (this rank holds positions {:?} of {} under sequence parallelism: a \
                 replicated embedding looks up cx.chunk_of(tokens))",
                cx.chunk(),
                cx.seq_len()
            )
        } else {
            String::new()
        };
        return Err(SmpError::Usage(format!(
            "{what} returned [batch, positions, hidden] = {dims:?}, expected [{}, {}, _]{hint}",
            want[0], want[1]
        )));
    }
    Ok(())
}

impl<B, S, K, H> Engine<B, S, K, H>
where
    B: AutodiffBackend,
    S: StemUnit<B>,
    K: BlockUnit<B, Aux = S::Aux>,
    H: HeadUnit<B>,
{
    /// A collective failure or a misuse recorded by a layer since the last check.
    fn check_tp(&self) -> Result<(), SmpError> {
        if let Some(e) = self.mesh.tp().take_failure() {
            return Err(e);
        }
        match TpGroup::take_misuse() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// The blocks' shared inputs for this sequence length (made once per length).
    fn aux(&mut self, cx: &Cx) -> S::Aux {
        match &self.aux {
            Some((len, aux)) if *len == cx.seq_len() => aux.clone(),
            _ => {
                let aux = self.stem.unit.template().aux(cx, &self.device);
                self.aux = Some((cx.seq_len(), aux.clone()));
                aux
            }
        }
    }

    /// The context of a micro-batch of `tokens: [batch, seq]`.
    fn context_of(&self, tokens: &Tensor<B, 2, Int>) -> Result<Cx, SmpError> {
        let [batch, seq] = tokens.dims();
        if batch == 0 || seq == 0 {
            return Err(SmpError::Usage(format!(
                "a micro-batch of [batch, seq] = [{batch}, {seq}] tokens: both must be at least 1"
            )));
        }
        Cx::new(batch, seq, self.mesh.tp())
    }

    /// The context of `micro` after checking that its targets (and documents) fit its tokens.
    fn context_of_micro(&self, micro: &MicroBatch<B>) -> Result<Cx, SmpError> {
        if micro.targets.dims() != micro.tokens.dims() {
            return Err(SmpError::Usage(format!(
                "targets {:?} and tokens {:?} must have the same [batch, seq]",
                micro.targets.dims(),
                micro.tokens.dims()
            )));
        }
        let cx = self.context_of(&micro.tokens)?;
        match &micro.documents {
            Some(documents) => cx.with_documents(documents.clone()),
            None => Ok(cx),
        }
    }

    /// The last block before `block` that recomputes its forward (the next one the backward
    /// gathers), if any.
    fn recomputed_below(&self, block: usize) -> Option<usize> {
        (0..block).rev().find(|&j| self.checkpointing.recomputes(j))
    }

    /// Sums over the tensor-parallel group the gradients in `grads` of `module`'s replicated
    /// parameters: with sequence parallelism each rank applied them to its own positions only.
    /// One all-reduce per unit; nothing without tensor or sequence parallelism.
    fn sum_replicated_grads<M: Module<B>>(
        &self,
        module: &M,
        grads: &mut B::Gradients,
    ) -> Result<(), SmpError> {
        let tp = self.mesh.tp();
        let Some(ctx) = self.mesh.tp_context() else {
            return Ok(());
        };
        if !tp.sequence_parallel() {
            return Ok(());
        }
        let mut take = ReplicatedGrads::<B> {
            placements: &self.placements,
            grads,
            pieces: Vec::new(),
            dtype: self.mesh.fsdp().reduce_dtype,
            summed: None,
        };
        module.visit(&mut take);
        if take.pieces.is_empty() {
            return Ok(());
        }
        let sizes: Vec<usize> = take.pieces.iter().map(|p| p.dims()[0]).collect();
        let flat = Tensor::cat(std::mem::take(&mut take.pieces), 0);
        let summed = ctx.all_reduce_sum(flat)?;
        let mut offset = 0;
        let parts: Vec<_> = sizes
            .into_iter()
            .map(|n| {
                offset += n;
                summed.clone().narrow(0, offset - n, n)
            })
            .collect();
        take.summed = Some(parts.into_iter());
        module.visit(&mut take);
        Ok(())
    }

    /// Forward and backward of one micro-batch of this data-parallel rank (a [`MicroBatch`], or
    /// a `(tokens, targets)` pair of `[batch, seq]`, the same on every tensor-parallel rank).
    /// The loss is multiplied by `loss_scale` before differentiation: `1 / micro-batches` for
    /// accumulation, or [`Self::per_scored_target`] of the step's micro-batches so that
    /// ignored targets do not tilt the mean ([`LossScale`]). With `sync` (the last micro-batch of a step) the gradients are reduced
    /// and added to the shards; without it they are only accumulated locally (FSDP's
    /// `no_sync`) until a later call with `sync`, which [`Self::step`] requires of the last
    /// micro-batch. Under `reduce_every_micro_batch` every call reduces. Returns this rank's loss (the mean over
    /// the whole sequence under tensor parallelism).
    ///
    /// # Errors
    /// A sequence the tensor-parallel degree does not divide (with sequence parallelism), a
    /// unit whose output has the wrong shape, a failed collective.
    pub fn forward_backward(
        &mut self,
        micro: impl Into<MicroBatch<B>>,
        loss_scale: impl Into<LossScale<B::InnerBackend>>,
        sync: bool,
    ) -> Result<Tensor<B::InnerBackend, 1>, SmpError> {
        let micro = micro.into();
        let loss_scale = loss_scale.into();
        let cx = self.context_of_micro(&micro)?;
        let MicroBatch {
            tokens, targets, ..
        } = micro;
        let aux = self.aux(&cx);
        let tp = self.mesh.tp().clone();
        let _active = tp.activate();
        let defer = !(sync || self.reduce_every_micro_batch);
        let ctx = self.mesh.fsdp().clone();
        let prefetch = ctx.prefetch;
        let n = self.blocks.len();
        let mut next_block: Option<PendingGather<B::InnerBackend>> = None;
        let mut next_other: Option<PendingGather<B::InnerBackend>> = None;

        // Tied parameters are gathered once for the whole pass (FSDP2 keeps its root's).
        let tied = match &self.tied {
            Some(t) => Some(t.unit.gather(&ctx, true)?),
            None => None,
        };
        let (tracked, plain) = (
            externals(tied.as_ref(), true),
            externals(tied.as_ref(), false),
        );

        // Stem forward: its input has no gradient, so no graph is kept; it is recomputed in
        // the backward.
        let stem_full = gathered(None, &self.stem.unit, &ctx)?;
        if prefetch && n > 0 {
            next_block = Some(self.blocks[0].unit.start_gather(&ctx)?);
        }
        let stem = self.stem.unit.assemble_with(stem_full, false, &plain);
        let mut x = stem.forward(tokens.clone(), &cx).detach();
        drop(stem);
        self.check_tp()?;
        check_stream("the stem", x.dims(), &cx)?;

        let mut saved: Vec<Saved<B, K>> = Vec::with_capacity(n);
        self.offloaded_bytes = 0;
        let release = crate::fast::fp8_weight_copies_kept::<B>();
        for i in 0..n {
            let full = gathered(next_block.take(), &self.blocks[i].unit, &ctx)?;
            if prefetch {
                if i + 1 < n {
                    next_block = Some(self.blocks[i + 1].unit.start_gather(&ctx)?);
                } else {
                    next_other = Some(self.head.unit.start_gather(&ctx)?);
                }
            }
            let unit = &self.blocks[i].unit;
            if self.checkpointing.recomputes(i) {
                let block = unit.assemble_with(full, false, &plain);
                let forward = || block.forward(x.clone(), &aux, &cx).detach();
                let (y, stash) = if self.selective_recompute {
                    selective::record(forward)
                } else {
                    (forward(), AttentionStash::default())
                };
                if self.offloading.is_some() {
                    let host = offload(x.inner())?;
                    self.offloaded_bytes += host.bytes();
                    saved.push(Saved::Offloaded(host, stash));
                    // The previous block's copy was queued a block's work ago: waiting for it
                    // now frees its device buffer without draining the queue.
                    if let Some(Saved::Offloaded(previous, _)) = saved.iter_mut().rev().nth(1) {
                        previous.settle()?;
                    }
                } else {
                    saved.push(Saved::Input(x.inner(), stash));
                }
                x = y;
            } else {
                // Where the block's backward reads none of its matrices (FP8 layers keep their
                // own FP8 copies), its gathered parameters go once the forward is done: the
                // graph gets its own copies of the vector parameters, the kept module only what
                // finds the gradients, and an unsharded unit gives up its compute copy: 2 bytes per
                // parameter of every kept layer against the FP8 copies' 1.
                let block = if release {
                    unit.assemble_with_own_vectors(full, true, &tracked)
                } else {
                    unit.assemble_with(full, true, &tracked)
                };
                let input = x.require_grad();
                let output = block.forward(input.clone(), &aux, &cx);
                x = Tensor::from_inner(output.clone().inner());
                saved.push(Saved::Graph {
                    module: Box::new(block.map(&mut WithoutValues)),
                    input,
                    output,
                });
                if release {
                    self.blocks[i].unit.release_compute_copy();
                }
            }
            self.check_tp()?;
            check_stream(&format!("block {i}"), x.dims(), &cx)?;
        }

        // Head: loss forward and backward.
        let head_full = gathered(next_other.take(), &self.head.unit, &ctx)?;
        if prefetch {
            // The backward's first gather: the last block that recomputes, else the stem's.
            match self.recomputed_below(n) {
                Some(j) => next_block = Some(self.blocks[j].unit.start_gather(&ctx)?),
                None => next_other = Some(self.stem.unit.start_gather(&ctx)?),
            }
        }
        let head = self.head.unit.assemble_with(head_full, true, &tracked);
        let x = x.require_grad();
        let scored_targets =
            matches!(loss_scale, LossScale::PerScoredTarget(_)).then(|| targets.clone());
        let (loss, scope) = head.loss(x.clone(), targets, &cx).into_parts();
        self.check_tp()?;
        if loss.dims() != [1] {
            return Err(SmpError::Usage(format!(
                "the head's loss has shape {:?}; it must be a one-element mean",
                loss.dims()
            )));
        }
        // A loss over this rank's chunk of the sequence: the micro-batch's loss is the mean of
        // the ranks' (equal-sized) chunks, so each differentiates 1 / tp of its own.
        let chunked = scope == LossScope::Chunk && tp.sequence_parallel();
        let local_loss = loss.clone().inner();
        // Weighted by scored targets, a chunk's loss counts by its own chunk's targets, which
        // also splits the micro-batch's share between the chunks.
        let weight = match (&loss_scale, scored_targets) {
            (LossScale::PerScoredTarget(per_rank), Some(targets)) => {
                let scored = if chunked {
                    cx.chunk_of(targets)
                } else {
                    targets
                };
                // A positive count per rank is at least 1 / dp; a zero one (nothing scored on
                // any rank) leaves every weight 0 rather than NaN.
                let floor = 0.5 / self.mesh.dp_size() as f64;
                Some(scored_count(scored) / per_rank.clone().clamp_min(floor))
            }
            _ => None,
        };
        let mut grads = match (&weight, &loss_scale) {
            (Some(w), _) => (loss * Tensor::<B, 1>::from_inner(w.clone())).backward(),
            (None, LossScale::Constant(c)) => {
                let share = if chunked { tp.degree() as f32 } else { 1.0 };
                (loss * (c / share)).backward()
            }
            (None, LossScale::PerScoredTarget(_)) => unreachable!("weighted above"),
        };
        self.check_tp()?;
        let mut grad = x.grad(&grads).ok_or_else(|| {
            SmpError::Usage("the head's loss does not depend on its input".into())
        })?;
        self.sum_replicated_grads(&head, &mut grads)?;
        self.head
            .unit
            .accumulate_grads(&head, &grads, &ctx, defer)?;
        if let (Some(t), Some(tied), true) = (&mut self.tied, &tied, self.head.uses_tied) {
            t.unit.accumulate_grads(tied, &grads, &ctx, true)?;
        }
        drop((head, grads));

        // Blocks in reverse, propagating the gradient of each block's output to its input.
        for i in (0..n).rev() {
            if let Some(horizon) = self.offloading {
                // Bring back the inputs of this block and the next `horizon - 1` (the top of
                // `saved`), the nearest first, so that each upload is queued ahead of its use.
                let keep = saved.len().saturating_sub(horizon);
                let mut window = saved
                    .drain(keep..)
                    .rev()
                    .map(|entry| match entry {
                        Saved::Offloaded(host, stash) => {
                            host.reload().map(|input| Saved::Input(input, stash))
                        }
                        other => Ok(other),
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                window.reverse();
                saved.extend(window);
            }
            let entry = saved.pop().expect("one saved entry per block");
            let (module, input, output) = match entry {
                Saved::Offloaded(..) => unreachable!("brought back above"),
                Saved::Input(input, stash) => {
                    let full = gathered(next_block.take(), &self.blocks[i].unit, &ctx)?;
                    if prefetch {
                        match self.recomputed_below(i) {
                            Some(j) => next_block = Some(self.blocks[j].unit.start_gather(&ctx)?),
                            None => next_other = Some(self.stem.unit.start_gather(&ctx)?),
                        }
                    }
                    let block = self.blocks[i].unit.assemble_with(full, true, &tracked);
                    let input = Tensor::<B, 3>::from_inner(input).require_grad();
                    let output = if self.selective_recompute {
                        selective::replay(stash, i, || block.forward(input.clone(), &aux, &cx))?
                    } else {
                        block.forward(input.clone(), &aux, &cx)
                    };
                    (block, input, output)
                }
                Saved::Graph {
                    module,
                    input,
                    output,
                } => (*module, input, output),
            };
            let mut grads = crate::autodiff::backward_from(output, grad);
            self.check_tp()?;
            grad = input.grad(&grads).ok_or_else(|| {
                SmpError::Usage(format!("block {i}'s output does not depend on its input"))
            })?;
            self.sum_replicated_grads(&module, &mut grads)?;
            self.blocks[i]
                .unit
                .accumulate_grads(&module, &grads, &ctx, defer)?;
            if let (Some(t), Some(tied), true) = (&mut self.tied, &tied, self.blocks[i].uses_tied) {
                t.unit.accumulate_grads(tied, &grads, &ctx, true)?;
            }
            // With prefetch the unit after this one left its reduce-scatter pending to run
            // beside this block's backward; now that this block's has started, it is finished,
            // so that at most two units' full-size gradients are alive at once.
            if i + 1 < n {
                self.blocks[i + 1].unit.finish_grads(&ctx)?;
            } else {
                self.head.unit.finish_grads(&ctx)?;
            }
        }

        // Stem: recomputed with a graph, its gradient from the first block's.
        let stem_full = gathered(next_other.take(), &self.stem.unit, &ctx)?;
        let stem = self.stem.unit.assemble_with(stem_full, true, &tracked);
        let y = stem.forward(tokens, &cx);
        let mut grads = crate::autodiff::backward_from(y, grad);
        self.check_tp()?;
        self.sum_replicated_grads(&stem, &mut grads)?;
        self.stem
            .unit
            .accumulate_grads(&stem, &grads, &ctx, defer)?;
        if let (Some(t), Some(tied)) = (&mut self.tied, &tied) {
            // The last use: the summed gradient of every use is reduced now (unless deferred).
            t.unit.accumulate_grads(tied, &grads, &ctx, defer)?;
        }
        if n > 0 {
            self.blocks[0].unit.finish_grads(&ctx)?;
        } else {
            self.head.unit.finish_grads(&ctx)?;
        }
        // Nothing is left pending past the call: the gradient is complete when it returns.
        self.stem.unit.finish_grads(&ctx)?;
        if let Some(t) = &mut self.tied {
            t.unit.finish_grads(&ctx)?;
        }
        if let Some(w) = weight {
            let share = local_loss.clone() * w;
            self.weighted_losses
                .push(match (chunked, self.mesh.tp_context()) {
                    (true, Some(tp)) => tp.all_reduce_sum(share)?,
                    _ => share,
                });
        }
        let loss = match (chunked, self.mesh.tp_context()) {
            (true, Some(tp)) => tp.all_reduce_mean(local_loss)?,
            _ => local_loss,
        };
        self.losses.push(loss.clone());
        self.deferred = defer;
        Ok(loss)
    }

    /// Clips the gradient to the builder's `max_grad_norm` (the global norm over every rank's
    /// shards), takes one optimizer step on every shard and clears the gradients.
    ///
    /// # Errors
    /// When no micro-batch ran since the last step, or the last one deferred its gradient
    /// reduction (its gradients would be silently missing); a failed collective.
    pub fn step(&mut self, lr: f64) -> Result<StepStats<B::InnerBackend>, SmpError> {
        if self.losses.is_empty() {
            return Err(SmpError::Usage(
                "step called without a forward_backward since the last step".into(),
            ));
        }
        if self.deferred {
            return Err(SmpError::Usage(
                "the last micro-batch left its gradients unreduced (sync = false): run the \
                 last micro-batch of a step with sync = true"
                    .into(),
            ));
        }
        let ctx = self.mesh.fsdp().clone();
        // `forward_backward` leaves nothing pending; this keeps the order of collectives the
        // same on every rank for any caller.
        self.for_each_unit_result(|u| u.finish_grads(&ctx))?;
        let sq = match self.mesh.tp_context() {
            None => self.sq_sums(None),
            Some(tp) => {
                // Each split slice counts once; a replicated parameter is held whole by every
                // rank of the group (with the same gradient, after the sums), so each counts
                // 1 / tp of it.
                let local = self.sq_sums(Some(1.0 / tp.degree() as f32));
                if local.is_empty() {
                    local
                } else {
                    vec![tp.all_reduce_sum(Tensor::cat(local, 0).sum())?]
                }
            }
        };
        let (scale, grad_norm) = clip_factor(sq, self.max_grad_norm, &ctx)?;
        self.steps += 1;
        let (optimizer, steps) = (self.optimizer.clone(), self.steps);
        self.for_each_unit_result(|u| u.optimizer_step(&optimizer, lr, steps, scale.clone()))?;
        let count = self.losses.len();
        let losses = std::mem::take(&mut self.losses);
        let weighted = std::mem::take(&mut self.weighted_losses);
        let local = if weighted.len() == count {
            Tensor::cat(weighted, 0).sum()
        } else {
            Tensor::cat(losses, 0).sum() / count as f32
        };
        let loss = self.mesh.mean_over_data_parallel(local)?;
        let mut comm = ctx.take_stats();
        if let Some(tp) = self.mesh.tp_context() {
            let t = tp.take_stats();
            comm.wait += t.wait;
            comm.calls += t.calls;
            if let Some(d) = t.device {
                *comm.device.get_or_insert(std::time::Duration::ZERO) += d;
            }
        }
        Ok(StepStats {
            loss,
            grad_norm,
            comm,
        })
    }

    /// One optimizer step over the micro-batches `micro` of this data-parallel rank
    /// ([`MicroBatch`]es or `(tokens, targets)` pairs): gradients accumulate over them and are
    /// reduced once, with the last (after each with `reduce_every_micro_batch`).
    ///
    /// # Errors
    /// No micro-batch, or as [`Self::forward_backward`] and [`Self::step`].
    pub fn train_step(
        &mut self,
        micro: impl IntoIterator<Item = impl Into<MicroBatch<B>>>,
        lr: f64,
    ) -> Result<StepStats<B::InnerBackend>, SmpError> {
        let micro: Vec<_> = micro.into_iter().collect();
        if micro.is_empty() {
            return Err(SmpError::Usage("train_step with no micro-batch".into()));
        }
        let micro: Vec<MicroBatch<B>> = micro.into_iter().map(Into::into).collect();
        let scale = self.per_scored_target(&micro)?;
        let n = micro.len();
        for (i, micro) in micro.into_iter().enumerate() {
            self.forward_backward(micro, scale.clone(), i + 1 == n)?;
        }
        self.step(lr)
    }

    /// The [`LossScale`] that makes a step over `micro` (this data-parallel rank's
    /// micro-batches) the mean over every scored target of the global batch: the scored
    /// targets of `micro`, averaged over the data-parallel ranks (one all-reduce of one
    /// element, on the device). Pass it to [`Self::forward_backward`] for each of them.
    ///
    /// # Errors
    /// No micro-batch, or a failed collective.
    pub fn per_scored_target(
        &self,
        micro: &[MicroBatch<B>],
    ) -> Result<LossScale<B::InnerBackend>, SmpError> {
        let local = micro
            .iter()
            .map(|m| scored_count(m.targets.clone()))
            .reduce(|a, b| a + b)
            .ok_or_else(|| SmpError::Usage("per_scored_target of no micro-batch".into()))?;
        Ok(LossScale::PerScoredTarget(
            self.mesh.mean_over_data_parallel(local)?,
        ))
    }

    /// Per-unit sums of gradient squares; with `replicated_share`, replicated parameters
    /// weighted by it.
    fn sq_sums(&self, replicated_share: Option<f32>) -> Vec<Tensor<B::InnerBackend, 1>> {
        let placements = &self.placements;
        let weight = |p: &crate::fsdp::FlatParam| match (replicated_share, placements.get(&p.id)) {
            (Some(share), Some(Placement::Replicated) | None) => share,
            _ => 1.0,
        };
        let mut out = Vec::new();
        let mut add = |s: Option<Tensor<B::InnerBackend, 1>>| out.extend(s);
        match replicated_share {
            None => {
                add(self.stem.unit.grad_sq_sum());
                self.blocks.iter().for_each(|b| add(b.unit.grad_sq_sum()));
                add(self.head.unit.grad_sq_sum());
                add(self.tied.as_ref().and_then(|t| t.unit.grad_sq_sum()));
            }
            Some(_) => {
                add(self.stem.unit.grad_sq_sum_weighted(&weight));
                self.blocks
                    .iter()
                    .for_each(|b| add(b.unit.grad_sq_sum_weighted(&weight)));
                add(self.head.unit.grad_sq_sum_weighted(&weight));
                add(self
                    .tied
                    .as_ref()
                    .and_then(|t| t.unit.grad_sq_sum_weighted(&weight)));
            }
        }
        out
    }

    /// Mean loss of a micro-batch (this data-parallel rank's, as in [`Self::forward_backward`])
    /// without any autodiff graph, over the scored targets of every data-parallel rank's.
    ///
    /// # Errors
    /// As [`Self::forward_backward`].
    pub fn eval_loss(&mut self, micro: impl Into<MicroBatch<B>>) -> Result<f64, SmpError> {
        let micro = micro.into();
        let cx = self.context_of_micro(&micro)?;
        let MicroBatch {
            tokens, targets, ..
        } = micro;
        let tp = self.mesh.tp().clone();
        let _active = tp.activate();
        let x = self.hidden_states(tokens, &cx)?;
        let ctx = self.mesh.fsdp().clone();
        let tied = self.gather_tied(&ctx)?;
        let head = self
            .head
            .unit
            .gather_with(&ctx, false, &externals(tied.as_ref(), false))?;
        let (loss, scope) = head.loss(x, targets.clone(), &cx).into_parts();
        self.check_tp()?;
        // Each part's mean counts by its scored targets: (loss x count, count), summed over
        // the sequence's chunks and averaged over the data-parallel ranks.
        let chunked = scope == LossScope::Chunk && tp.sequence_parallel();
        let count = scored_count(if chunked {
            cx.chunk_of(targets)
        } else {
            targets
        });
        let mut parts = Tensor::cat(vec![loss.inner() * count.clone(), count], 0);
        if chunked && let Some(tp) = self.mesh.tp_context() {
            parts = tp.all_reduce_sum(parts)?;
        }
        let parts = self
            .mesh
            .mean_over_data_parallel(parts)?
            .into_data()
            .convert::<f64>()
            .to_vec::<f64>()
            .map_err(|e| SmpError::Usage(format!("reading the loss: {e:?}")))?;
        Ok(match parts.as_slice() {
            [_, count] if *count == 0.0 => 0.0,
            [sum, count] => sum / count,
            _ => f64::NAN,
        })
    }

    /// Logits `[batch, seq, vocab]` of `tokens` without any autodiff graph (evaluation and
    /// sampling), the same on every rank. With sequence parallelism a sequence the degree does
    /// not divide (a sampling prompt) is padded at the end: causal models keep the padding from
    /// changing the real positions' logits.
    ///
    /// # Errors
    /// As [`Self::forward_backward`].
    pub fn logits(
        &mut self,
        tokens: Tensor<B, 2, Int>,
    ) -> Result<Tensor<B::InnerBackend, 3>, SmpError> {
        let [batch, seq] = tokens.dims();
        let tp = self.mesh.tp().clone();
        let padded = if tp.sequence_parallel() {
            seq.div_ceil(tp.degree()) * tp.degree()
        } else {
            seq
        };
        let tokens = if padded > seq {
            let pad = Tensor::<B, 2, Int>::zeros([batch, padded - seq], &tokens.device());
            Tensor::cat(vec![tokens, pad], 1)
        } else {
            tokens
        };
        let cx = self.context_of(&tokens)?;
        let _active = tp.activate();
        let x = self.hidden_states(tokens, &cx)?;
        let ctx = self.mesh.fsdp().clone();
        let tied = self.gather_tied(&ctx)?;
        let head = self
            .head
            .unit
            .gather_with(&ctx, false, &externals(tied.as_ref(), false))?;
        let logits = head.logits(x, &cx).inner();
        self.check_tp()?;
        Ok(logits.narrow(1, 0, seq))
    }

    /// The tied parameters, gathered without gradients.
    fn gather_tied(&self, ctx: &FsdpContext<B::InnerBackend>) -> Result<Option<Tied<B>>, SmpError> {
        match &self.tied {
            Some(t) => Ok(Some(t.unit.gather(ctx, false)?)),
            None => Ok(None),
        }
    }

    /// The last block's output for `tokens`, without any graph.
    fn hidden_states(
        &mut self,
        tokens: Tensor<B, 2, Int>,
        cx: &Cx,
    ) -> Result<Tensor<B, 3>, SmpError> {
        let aux = self.aux(cx);
        let ctx = self.mesh.fsdp().clone();
        let tied = self.gather_tied(&ctx)?;
        let plain = externals(tied.as_ref(), false);
        let stem = self.stem.unit.gather_with(&ctx, false, &plain)?;
        let mut x = stem.forward(tokens, cx).detach();
        self.check_tp()?;
        check_stream("the stem", x.dims(), cx)?;
        for (i, b) in self.blocks.iter().enumerate() {
            let block = b.unit.gather_with(&ctx, false, &plain)?;
            x = block.forward(x, &aux, cx).detach();
            self.check_tp()?;
            check_stream(&format!("block {i}"), x.dims(), cx)?;
        }
        Ok(x)
    }

    /// Runs `f` on every unit (stem, blocks, head, tied), in that order on every rank.
    pub(super) fn for_each_unit(&mut self, mut f: impl FnMut(&mut dyn UnitOps<B>)) {
        f(&mut self.stem.unit);
        for b in &mut self.blocks {
            f(&mut b.unit);
        }
        f(&mut self.head.unit);
        if let Some(t) = &mut self.tied {
            f(&mut t.unit);
        }
    }

    /// [`Self::for_each_unit`] stopping at the first error.
    pub(super) fn for_each_unit_result(
        &mut self,
        mut f: impl FnMut(&mut dyn UnitOps<B>) -> Result<(), SmpError>,
    ) -> Result<(), SmpError> {
        let mut result = Ok(());
        self.for_each_unit(|u| {
            if result.is_ok() {
                result = f(u);
            }
        });
        result
    }
}

/// What the engine does with every unit alike, whatever its module type.
pub(super) trait UnitOps<B: AutodiffBackend> {
    fn finish_grads(&mut self, ctx: &FsdpContext<B::InnerBackend>) -> Result<(), SmpError>;
    fn optimizer_step(
        &mut self,
        optimizer: &crate::optim::Optimizer<B::InnerBackend>,
        lr: f64,
        step: u64,
        grad_scale: Tensor<B::InnerBackend, 1>,
    ) -> Result<(), SmpError>;
    fn use_custom_optimizer(&mut self);
}

impl<B: AutodiffBackend, M: Module<B>> UnitOps<B> for ShardedUnit<B, M> {
    fn finish_grads(&mut self, ctx: &FsdpContext<B::InnerBackend>) -> Result<(), SmpError> {
        ShardedUnit::finish_grads(self, ctx)
    }
    fn optimizer_step(
        &mut self,
        optimizer: &crate::optim::Optimizer<B::InnerBackend>,
        lr: f64,
        step: u64,
        grad_scale: Tensor<B::InnerBackend, 1>,
    ) -> Result<(), SmpError> {
        ShardedUnit::optimizer_step(self, optimizer, lr, step, grad_scale)
    }
    fn use_custom_optimizer(&mut self) {
        ShardedUnit::use_custom_optimizer(self)
    }
}

/// Takes (first pass) and puts back summed (second pass, `summed` set) the gradients of a
/// unit's replicated parameters; see `Engine::sum_replicated_grads`.
struct ReplicatedGrads<'a, B: AutodiffBackend> {
    placements: &'a std::collections::HashMap<burn::module::ParamId, Placement>,
    grads: &'a mut B::Gradients,
    pieces: Vec<Tensor<B::InnerBackend, 1>>,
    dtype: burn::tensor::FloatDType,
    summed: Option<std::vec::IntoIter<Tensor<B::InnerBackend, 1>>>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for ReplicatedGrads<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if !matches!(
            self.placements.get(&param.id),
            Some(Placement::Replicated) | None
        ) {
            return;
        }
        let value = param.val();
        let dims = value.dims();
        match &mut self.summed {
            None => {
                let n: usize = dims.iter().product();
                let g = match value.grad_remove(self.grads) {
                    Some(g) => g.reshape([n]),
                    // Unused in this step: a zero gradient, still part of the collective.
                    None => Tensor::zeros([n], &value.device()),
                };
                self.pieces.push(g.cast(self.dtype));
            }
            Some(summed) => {
                let g = summed
                    .next()
                    .expect("one summed piece per replicated parameter");
                value.grad_replace(self.grads, g.reshape(dims));
            }
        }
    }
}
