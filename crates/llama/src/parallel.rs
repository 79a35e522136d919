//! The one place where the Llama model meets the parallel layer (torchtitan's
//! `parallelize_llama`): every unit is wrapped as a [`ShardedUnit`], and a training step walks
//! the units forward and backward, gathering each unit's parameters just before it runs.
//!
//! With activation checkpointing a unit's forward runs without an autodiff graph and only its
//! input is kept; its backward gathers the parameters again, recomputes the forward with a
//! graph and backpropagates the incoming gradient. Without it, each unit's graph (and so its
//! gathered parameters) is kept from the forward to the backward. With activation offloading
//! (`set_activation_offloading`) that kept input waits in host memory instead
//! ([`smp_burn::offload`]) and comes back a few layers ahead of its backward.
//!
//! With tensor parallelism (a [`TpContext`] of degree `tp` > 1; Megatron-LM's layout with
//! sequence parallelism) each decoder layer is split across the tp ranks as [`tp_split`] says:
//! q/k/v/gate/up are column-parallel (rank `r` holds output rows `[r*out/tp, (r+1)*out/tp)`),
//! o/down row-parallel (input columns `[r*in/tp, ...)`), so each rank holds `heads/tp` query and
//! `kv_heads/tp` key/value heads. Between the split regions the residual stream is this rank's
//! chunk of the sequence, `[batch, seq/tp, hidden]`: the norms run on the chunk,
//! `gather_sequence` enters each region and `reduce_scatter_sequence` leaves it
//! ([`smp_burn::tp`]). The embedding and the head are replicated: each tp rank embeds and scores
//! its own chunk. Each tp rank's units are sharded by FSDP across the ranks with the same tp
//! index (the mesh's `shard` axis), exactly as without tensor parallelism.

use std::marker::PhantomData;
use std::ops::Range;

use burn::module::{Initializer, Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::{
    FloatDType, Int, Tensor, TensorData,
    backend::{AutodiffBackend, Backend},
};
use smp_burn::fsdp::{
    AdamW, CommStats, FlatParam, FsdpContext, ShardedUnit, StateKind, clip_factor,
};
use smp_burn::offload::{HostActivation, offload};
use smp_burn::tp::{self, TpContext};
use smp_burn::{ActivationCheckpointing, PendingGather};

use crate::config::LlamaConfig;
use crate::error::Result;
use crate::model::{DecoderLayer, Embedding, LmHead, SplitRegions, UnitKind, hf_name};

/// Where initial parameter values come from: `(hf_name, shape, element range) -> values`, with
/// the shape and the flat (row-major) range of the FULL parameter, whatever slice of it this
/// rank holds: so one function serves every layout (a seed, a checkpoint written by any number
/// of ranks).
pub type ParamInit<'a> = dyn Fn(&str, &[usize], Range<usize>) -> Result<Vec<f32>> + 'a;

/// How tensor parallelism splits a parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TpSplit {
    /// Every tp rank holds all of it (norm weights, the embedding, the LM head); its gradient
    /// is summed over the tp group, since each rank saw only its chunk of the sequence.
    Replicated,
    /// Column-parallel linear: rank `r` holds output rows `[r*out/tp, (r+1)*out/tp)` of the
    /// `[out, in]` weight.
    Rows,
    /// Row-parallel linear: rank `r` holds input columns `[r*in/tp, (r+1)*in/tp)`.
    Cols,
}

/// The tensor-parallel plan of Llama (Megatron's): q/k/v and gate/up column-parallel, o and
/// down row-parallel, everything else replicated. `path` is the parameter's path in its unit.
pub fn tp_split(unit: UnitKind, path: &str) -> TpSplit {
    match (unit, path) {
        (
            UnitKind::Layer(_),
            "self_attn.q_proj.weight"
            | "self_attn.k_proj.weight"
            | "self_attn.v_proj.weight"
            | "mlp.gate_proj.weight"
            | "mlp.up_proj.weight",
        ) => TpSplit::Rows,
        (UnitKind::Layer(_), "self_attn.o_proj.weight" | "mlp.down_proj.weight") => TpSplit::Cols,
        _ => TpSplit::Replicated,
    }
}

/// This rank's place in the tensor-parallel group, for slicing parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct TpSlice {
    degree: usize,
    rank: usize,
}

/// A Llama model whose units are sharded across a group of ranks (one rank: nothing is split,
/// the same code runs).
#[derive(Debug)]
pub struct ShardedLlama<B: AutodiffBackend> {
    /// The model's shape.
    pub config: LlamaConfig,
    embed: ShardedUnit<B, Embedding<B>>,
    layers: Vec<ShardedUnit<B, DecoderLayer<B>>>,
    head: ShardedUnit<B, LmHead<B>>,
    ctx: FsdpContext<B::InnerBackend>,
    /// The tensor-parallel group; `None` without tensor parallelism (degree 1).
    tp: Option<TpContext<B::InnerBackend>>,
    device: B::Device,
    checkpointing: ActivationCheckpointing,
    /// With activation offloading, the loading horizon (layers ahead of use); `None`: off.
    offloading: Option<usize>,
    /// Bytes the last `forward_backward` moved to host memory (activation offloading).
    offloaded_bytes: usize,
    /// Rotary tables of the last sequence length used. Building them on the host took about
    /// 20 ms per micro-batch at S=4096 (half a million `powf`/`cos`/`sin` calls and a copy to
    /// the device), a sixth of a 1.2B model's step on an H200.
    rope_cache: std::sync::Mutex<Option<RopeTables<B>>>,
}

/// `(seq_len, cos, sin)` as [`smp_burn::ops::rope_tables`] builds them.
type RopeTables<B> = (usize, Tensor<B, 2>, Tensor<B, 2>);

/// Full tensors by Hugging Face name: `(name, shape, fp32 values)`.
pub type NamedTensors = Vec<(String, Vec<usize>, Vec<f32>)>;

/// Per-step numbers the trainer reports.
#[derive(Debug, Clone)]
pub struct StepStats<IB: Backend> {
    /// Global gradient norm before clipping, on the device (one element): reading it is a
    /// host sync, which the trainer defers (`smp_burn::readback`).
    pub grad_norm: Tensor<IB, 1>,
    /// Time in collectives and calls made.
    pub comm: CommStats,
}

impl<IB: Backend> StepStats<IB> {
    /// The gradient norm on the host (waits for the device; NaN if the read fails). Through
    /// `smp_burn::readback`, the trainer's path, so that tests read it the way training does.
    pub fn grad_norm_now(&self) -> f64 {
        smp_burn::readback::read_later(self.grad_norm.clone())
            .and_then(|pending| pending.wait())
            .ok()
            .and_then(|v| v.first().copied())
            .map_or(f64::NAN, f64::from)
    }
}

impl<B: AutodiffBackend> ShardedLlama<B> {
    /// Builds the sharded model; each rank creates only its own chunk of every parameter from
    /// `init`.
    pub fn new(
        config: &LlamaConfig,
        ctx: FsdpContext<B::InnerBackend>,
        device: &B::Device,
        activation_checkpointing: impl Into<ActivationCheckpointing>,
        init: &ParamInit<'_>,
    ) -> Result<Self> {
        Self::with_tensor_parallel(config, ctx, None, device, activation_checkpointing, init)
    }

    /// [`Self::new`] with each decoder layer split across `tp`'s group (tensor and sequence
    /// parallelism, see the module docs); `None` or a group of one rank splits nothing. Each
    /// rank creates only its own FSDP chunk of its own tp slice of every parameter. The heads,
    /// the key/value heads and the MLP width must be divisible by the degree (the error names
    /// them).
    pub fn with_tensor_parallel(
        config: &LlamaConfig,
        ctx: FsdpContext<B::InnerBackend>,
        tp: Option<TpContext<B::InnerBackend>>,
        device: &B::Device,
        activation_checkpointing: impl Into<ActivationCheckpointing>,
        init: &ParamInit<'_>,
    ) -> Result<Self> {
        config.validate()?;
        let tp = tp.filter(|t| t.degree() > 1);
        let slice = tp.as_ref().map(|t| TpSlice {
            degree: t.degree(),
            rank: t.rank(),
        });
        if let Some(s) = slice {
            config.validate_tensor_parallel(s.degree)?;
        }
        if config.tie_word_embeddings {
            return Err(crate::LlamaError::Config(
                "tie_word_embeddings = true is not supported by the sharded trainer yet \
                 (the embedding and the LM head live in different units)"
                    .into(),
            ));
        }
        let inner_device = device.clone();
        let failure = std::cell::RefCell::new(None);
        let unit_init = |kind: UnitKind| unit_initializer(init, kind, slice, &failure);
        let embed = ShardedUnit::new(
            "model.embed_tokens",
            Embedding::template(config, device),
            &ctx,
            &inner_device,
            unit_init(UnitKind::Embedding),
        )?;
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for i in 0..config.num_hidden_layers {
            layers.push(ShardedUnit::new(
                format!("model.layers.{i}"),
                layer_template(config, slice.map_or(1, |s| s.degree), device),
                &ctx,
                &inner_device,
                unit_init(UnitKind::Layer(i)),
            )?);
        }
        let head = ShardedUnit::new(
            "lm_head",
            LmHead::template(config, device),
            &ctx,
            &inner_device,
            unit_init(UnitKind::Head),
        )?;
        if let Some(e) = failure.into_inner() {
            return Err(e);
        }
        Ok(Self {
            config: config.clone(),
            embed,
            layers,
            head,
            ctx,
            tp,
            device: device.clone(),
            checkpointing: activation_checkpointing.into(),
            offloading: None,
            offloaded_bytes: 0,
            rope_cache: std::sync::Mutex::new(None),
        })
    }

    /// Turns activation offloading on (`Some(horizon)`, see
    /// `ParallelConfig::activation_offloading`) or off. The inputs kept by recomputed layers go
    /// to host memory after the layer's forward and come back `horizon` layers ahead of their
    /// backward; the results do not change. Layers that keep their graph are not affected.
    ///
    /// # Errors
    /// A horizon of 0.
    pub fn set_activation_offloading(&mut self, horizon: Option<usize>) -> Result<()> {
        if let Some(h) = horizon {
            smp_burn::config::check_loading_horizon(h)?;
        }
        self.offloading = horizon;
        Ok(())
    }

    /// The last layer before `layer` that recomputes its forward in the backward (the next one
    /// the backward gathers), if any.
    fn recomputed_below(&self, layer: usize) -> Option<usize> {
        (0..layer).rev().find(|&j| self.checkpointing.recomputes(j))
    }

    /// The communication context (shard and replica groups).
    pub fn context(&self) -> &FsdpContext<B::InnerBackend> {
        &self.ctx
    }

    /// The tensor-parallel group, when layers are split (degree > 1).
    pub fn tensor_parallel(&self) -> Option<&TpContext<B::InnerBackend>> {
        self.tp.as_ref()
    }

    fn regions(&self) -> SequenceRegions<B> {
        SequenceRegions {
            tp: self.tp.clone(),
            _backend: PhantomData,
        }
    }

    /// This rank's chunk of the sequence (all of it without tensor parallelism): `[batch,
    /// seq/tp]` of `[batch, seq]` token ids.
    fn sequence_chunk(&self, tokens: Tensor<B, 2, Int>) -> Result<Tensor<B, 2, Int>> {
        match &self.tp {
            None => Ok(tokens),
            Some(tp) => {
                let chunk = tp.sequence_chunk(tokens.dims()[1])?;
                Ok(tokens.narrow(1, chunk.start, chunk.len()))
            }
        }
    }

    /// Sums over the tp group the gradients in `grads` of `module`'s replicated parameters (see
    /// [`TpSplit::Replicated`]): one all-reduce per unit. Nothing without tensor parallelism.
    fn sum_replicated_grads<M: Module<B>>(
        &self,
        module: &M,
        kind: UnitKind,
        grads: &mut B::Gradients,
    ) -> Result<()> {
        let Some(tp) = &self.tp else { return Ok(()) };
        let mut take = ReplicatedGrads::<B> {
            kind,
            path: Vec::new(),
            grads,
            pieces: Vec::new(),
            dtype: self.ctx.reduce_dtype,
            summed: None,
        };
        module.visit(&mut take);
        if take.pieces.is_empty() {
            return Ok(());
        }
        let sizes: Vec<usize> = take.pieces.iter().map(|p| p.dims()[0]).collect();
        let flat = Tensor::cat(std::mem::take(&mut take.pieces), 0);
        let summed = tp.all_reduce_sum(flat)?;
        let mut offset = 0;
        let parts = sizes
            .into_iter()
            .map(|n| {
                offset += n;
                summed.clone().narrow(0, offset - n, n)
            })
            .collect::<Vec<_>>();
        take.summed = Some(parts.into_iter());
        take.path.clear();
        module.visit(&mut take);
        Ok(())
    }

    fn rope(&self, seq: usize) -> (Tensor<B, 2>, Tensor<B, 2>) {
        let mut cache = self.rope_cache.lock().expect("rope cache lock");
        match &*cache {
            Some((len, cos, sin)) if *len == seq => (cos.clone(), sin.clone()),
            _ => {
                let (cos, sin) = smp_burn::ops::rope_tables(
                    seq,
                    self.config.head_dim(),
                    self.config.rope_theta,
                    &self.device,
                );
                *cache = Some((seq, cos.clone(), sin.clone()));
                (cos, sin)
            }
        }
    }

    /// Forward and backward of one micro-batch; gradients are added to the shards (or, with
    /// `defer`, kept unreduced until a later call without it). The loss is multiplied by
    /// `loss_scale` before differentiation (1 / micro-batches for accumulation). Returns this
    /// rank's unscaled loss (with tensor parallelism: the mean over the whole sequence, the same
    /// on every rank of the tp group). `tokens` and `targets` are this data-parallel rank's full
    /// `[batch, seq]`; with tensor parallelism each tp rank takes its chunk of both, so `seq`
    /// must be divisible by the degree.
    pub fn forward_backward(
        &mut self,
        tokens: Tensor<B, 2, Int>,
        targets: Tensor<B, 2, Int>,
        loss_scale: f32,
        defer: bool,
    ) -> Result<Tensor<B::InnerBackend, 1>> {
        let [_, seq] = tokens.dims();
        let tokens = self.sequence_chunk(tokens)?;
        let targets = self.sequence_chunk(targets)?;
        // Rotary embeddings are applied inside the split regions, on the gathered sequence.
        let (cos, sin) = self.rope(seq);
        let regions = self.regions();
        let ctx = &self.ctx;

        // With prefetch, a unit's all-gather is started before the previous unit's compute is
        // queued and waited for only when the unit runs, so on CUDA the two overlap; in the
        // backward, a unit's gradient reduce-scatter likewise runs beside the next unit's
        // backward (see the `finish_grads` calls). The order of collectives is the same on every
        // rank either way.
        let prefetch = ctx.prefetch;
        let n = self.layers.len();
        let mut next_layer: Option<PendingGather<B::InnerBackend>> = None;
        let mut next_other: Option<PendingGather<B::InnerBackend>> = None;

        // Forward through the embedding; its input has no gradient, so no graph is needed.
        let embed_full = gathered(None, &self.embed, ctx)?;
        if prefetch && n > 0 {
            next_layer = Some(self.layers[0].start_gather(ctx)?);
        }
        let embed = self.embed.assemble(embed_full, false);
        let mut x = embed.forward(tokens.clone()).detach();
        drop(embed);

        // Layers: either keep only each layer's input (recomputed in the backward) or its whole
        // graph.
        enum Saved<B: AutodiffBackend> {
            Input(Tensor<B::InnerBackend, 3>),
            /// The input of a recomputed layer, in host memory (activation offloading).
            Offloaded(HostActivation<B::InnerBackend, 3>),
            Graph {
                module: Box<DecoderLayer<B>>,
                input: Tensor<B, 3>,
                output: Tensor<B, 3>,
            },
        }
        let mut saved: Vec<Saved<B>> = Vec::with_capacity(n);
        self.offloaded_bytes = 0;
        for (i, unit) in self.layers.iter().enumerate() {
            let full = gathered(next_layer.take(), unit, ctx)?;
            if prefetch {
                if i + 1 < n {
                    next_layer = Some(self.layers[i + 1].start_gather(ctx)?);
                } else {
                    next_other = Some(self.head.start_gather(ctx)?);
                }
            }
            if self.checkpointing.recomputes(i) {
                let layer = unit.assemble(full, false);
                let y = layer
                    .forward_split(x.clone(), cos.clone(), sin.clone(), &regions)?
                    .detach();
                if self.offloading.is_some() {
                    let host = offload(x.inner())?;
                    self.offloaded_bytes += host.bytes();
                    saved.push(Saved::Offloaded(host));
                    // The previous layer's copy was queued a layer's work ago: waiting for it
                    // now frees its device buffer without draining the queue.
                    if let Some(Saved::Offloaded(previous)) = saved.iter_mut().rev().nth(1) {
                        previous.settle()?;
                    }
                } else {
                    saved.push(Saved::Input(x.inner()));
                }
                x = y;
            } else {
                let layer = unit.assemble(full, true);
                let input = x.require_grad();
                let output =
                    layer.forward_split(input.clone(), cos.clone(), sin.clone(), &regions)?;
                x = Tensor::from_inner(output.clone().inner());
                saved.push(Saved::Graph {
                    module: Box::new(layer),
                    input,
                    output,
                });
            }
        }

        // Head: loss forward and backward.
        let head_full = gathered(next_other.take(), &self.head, ctx)?;
        if prefetch {
            // The backward's first gather: the last layer that recomputes, else the
            // embedding's (the only unit the backward gathers when none does).
            match self.recomputed_below(n) {
                Some(j) => next_layer = Some(self.layers[j].start_gather(ctx)?),
                None => next_other = Some(self.embed.start_gather(ctx)?),
            }
        }
        let head = self.head.assemble(head_full, true);
        let x = x.require_grad();
        let loss = head.loss(x.clone(), targets);
        let local_loss = loss.clone().inner();
        // With tensor parallelism each rank's loss is the mean over its chunk of the sequence;
        // the loss of the micro-batch is the mean of the tp ranks' (equal-sized) chunks, so each
        // differentiates 1/tp of its own, and the replicated parameters' gradients are summed.
        let tp_degree = self.tp.as_ref().map_or(1, |t| t.degree());
        let mut grads = (loss * (loss_scale / tp_degree as f32)).backward();
        let mut grad = x
            .grad(&grads)
            .expect("the head's input takes part in the loss");
        self.sum_replicated_grads(&head, UnitKind::Head, &mut grads)?;
        self.head.accumulate_grads(&head, &grads, ctx, defer)?;
        drop((head, grads));

        // Layers in reverse, propagating the gradient of each layer's output to its input.
        for i in (0..n).rev() {
            if let Some(horizon) = self.offloading {
                // Bring back the inputs of this layer and the next `horizon - 1` (the top of
                // `saved`), the nearest first, so that each upload is queued ahead of its use.
                let keep = saved.len().saturating_sub(horizon);
                let mut window = saved
                    .drain(keep..)
                    .rev()
                    .map(|entry| match entry {
                        Saved::Offloaded(host) => host.reload().map(Saved::Input),
                        other => Ok(other),
                    })
                    .collect::<std::result::Result<Vec<_>, _>>()?;
                window.reverse();
                saved.extend(window);
            }
            let saved = saved.pop().expect("one saved entry per layer");
            let (module, input, output) = match saved {
                Saved::Offloaded(_) => unreachable!("brought back above"),
                Saved::Input(input) => {
                    let full = gathered(next_layer.take(), &self.layers[i], ctx)?;
                    if prefetch {
                        match self.recomputed_below(i) {
                            Some(j) => next_layer = Some(self.layers[j].start_gather(ctx)?),
                            None => next_other = Some(self.embed.start_gather(ctx)?),
                        }
                    }
                    let layer = self.layers[i].assemble(full, true);
                    let input = Tensor::<B, 3>::from_inner(input).require_grad();
                    let output =
                        layer.forward_split(input.clone(), cos.clone(), sin.clone(), &regions)?;
                    (layer, input, output)
                }
                Saved::Graph {
                    module,
                    input,
                    output,
                } => (*module, input, output),
            };
            let mut grads = smp_burn::autodiff::backward_from(output, grad);
            grad = input
                .grad(&grads)
                .expect("a layer's input takes part in its output");
            self.sum_replicated_grads(&module, UnitKind::Layer(i), &mut grads)?;
            self.layers[i].accumulate_grads(&module, &grads, ctx, defer)?;
            // With prefetch the unit after this one left its reduce-scatter pending to run
            // beside this layer's backward; now that this layer's has started, it is finished,
            // so that at most two units' full-size gradients are alive at once. A no-op
            // otherwise. Every rank finishes in the same order (the hybrid all-reduce in it is
            // a collective).
            if i + 1 < n {
                self.layers[i + 1].finish_grads(ctx)?;
            } else {
                self.head.finish_grads(ctx)?;
            }
        }

        // Embedding: its gradient is a scatter of the incoming one.
        let embed_full = gathered(next_other.take(), &self.embed, ctx)?;
        let embed = self.embed.assemble(embed_full, true);
        let y = embed.forward(tokens);
        let mut grads = smp_burn::autodiff::backward_from(y, grad);
        self.sum_replicated_grads(&embed, UnitKind::Embedding, &mut grads)?;
        self.embed.accumulate_grads(&embed, &grads, ctx, defer)?;
        if n > 0 {
            self.layers[0].finish_grads(ctx)?;
        } else {
            self.head.finish_grads(ctx)?;
        }
        // Nothing is left pending past the call: the gradient is complete when it returns.
        self.embed.finish_grads(ctx)?;
        match &self.tp {
            Some(tp) => Ok(tp.all_reduce_mean(local_loss)?),
            None => Ok(local_loss),
        }
    }

    /// Clips the gradient to `max_norm` (global norm over every rank's shards), takes one AdamW
    /// step on every shard and clears the gradients. `step` counts from 1.
    pub fn optimizer_step(
        &mut self,
        opt: &AdamW,
        lr: f64,
        step: u64,
        max_norm: Option<f64>,
    ) -> Result<StepStats<B::InnerBackend>> {
        // `forward_backward` leaves no reduce pending; this keeps the gradients complete even
        // for a caller that drives the units another way (a no-op otherwise).
        self.finish_grads()?;
        let sq: Vec<_> = match &self.tp {
            None => self
                .units_mut_iter()
                .filter_map(|u| u.grad_sq_sum())
                .collect(),
            Some(tp) => {
                // Each split slice counts once per rank that holds it (once); a replicated
                // parameter is held whole by every tp rank, so each counts 1/tp of it.
                let share = 1.0 / tp.degree() as f32;
                let local: Vec<_> = self
                    .units_mut_iter()
                    .filter_map(|u| u.grad_sq_sum_weighted(share))
                    .collect();
                if local.is_empty() {
                    local
                } else {
                    vec![tp.all_reduce_sum(Tensor::cat(local, 0).sum())?]
                }
            }
        };
        let (scale, grad_norm) = clip_factor(sq, max_norm, &self.ctx)?;
        self.embed.adamw_step(opt, lr, step, scale.clone());
        for l in &mut self.layers {
            l.adamw_step(opt, lr, step, scale.clone());
        }
        self.head.adamw_step(opt, lr, step, scale);
        let mut comm = self.ctx.take_stats();
        if let Some(tp) = &self.tp {
            let t = tp.take_stats();
            comm.wait += t.wait;
            comm.calls += t.calls;
            if let Some(d) = t.device {
                *comm.device.get_or_insert(std::time::Duration::ZERO) += d;
            }
        }
        Ok(StepStats { grad_norm, comm })
    }

    /// Finishes every unit's pending gradient reduce-scatter (see
    /// [`ShardedUnit::finish_grads`]), in the same unit order on every rank.
    fn finish_grads(&mut self) -> Result<()> {
        let ctx = &self.ctx;
        self.embed.finish_grads(ctx)?;
        for l in &mut self.layers {
            l.finish_grads(ctx)?;
        }
        self.head.finish_grads(ctx)?;
        Ok(())
    }

    fn units_mut_iter(&self) -> impl Iterator<Item = UnitRef<'_, B>> {
        std::iter::once(UnitRef::Embed(&self.embed))
            .chain(self.layers.iter().map(UnitRef::Layer))
            .chain(std::iter::once(UnitRef::Head(&self.head)))
    }

    /// Logits `[batch, seq, vocab]` without any autodiff graph (evaluation and sampling); the
    /// same on every rank. With tensor parallelism a sequence whose length the degree does not
    /// divide (a sampling prompt) is padded at the end: causal attention keeps the padding from
    /// changing the real positions' logits.
    pub fn logits(&self, tokens: Tensor<B, 2, Int>) -> Result<Tensor<B::InnerBackend, 3>> {
        let [batch, seq] = tokens.dims();
        let head = |x: Tensor<B, 3>| -> Result<_> {
            Ok(self.head.gather(&self.ctx, false)?.logits(x).inner())
        };
        let Some(tp) = &self.tp else {
            return head(self.hidden_states(tokens, seq)?);
        };
        let padded = seq.div_ceil(tp.degree()) * tp.degree();
        let tokens = if padded > seq {
            let pad = Tensor::<B, 2, Int>::zeros([batch, padded - seq], &tokens.device());
            Tensor::cat(vec![tokens, pad], 1)
        } else {
            tokens
        };
        let x = self.hidden_states(self.sequence_chunk(tokens)?, padded)?;
        let x = tp::gather_sequence::<B>(x, tp)?;
        Ok(head(x)?.narrow(1, 0, seq))
    }

    /// Mean cross-entropy without any autodiff graph over this data-parallel rank's batch
    /// (with tensor parallelism: over all chunks of the sequence), averaged over the
    /// data-parallel ranks.
    pub fn eval_loss(&self, tokens: Tensor<B, 2, Int>, targets: Tensor<B, 2, Int>) -> Result<f64> {
        let seq = tokens.dims()[1];
        let x = self.hidden_states(self.sequence_chunk(tokens)?, seq)?;
        let head = self.head.gather(&self.ctx, false)?;
        let mut loss = head.loss(x, self.sequence_chunk(targets)?).inner();
        if let Some(tp) = &self.tp {
            loss = tp.all_reduce_mean(loss)?;
        }
        let loss = self.ctx.mean_over_data_parallel(loss)?;
        Ok(loss.into_scalar().elem_f64())
    }

    /// The last layer's output for this rank's chunk `tokens` of a sequence of `seq` tokens.
    fn hidden_states(&self, tokens: Tensor<B, 2, Int>, seq: usize) -> Result<Tensor<B, 3>> {
        let (cos, sin) = self.rope(seq);
        let regions = self.regions();
        let embed = self.embed.gather(&self.ctx, false)?;
        let mut x = embed.forward(tokens).detach();
        for unit in &self.layers {
            let layer = unit.gather(&self.ctx, false)?;
            x = layer
                .forward_split(x, cos.clone(), sin.clone(), &regions)?
                .detach();
        }
        Ok(x)
    }

    /// Every parameter's (or optimizer moment's) full fp32 values under its Hugging Face name.
    /// With tensor parallelism the split parameters' slices are gathered over the tp group and
    /// joined along their split dimension, so the result (and so every checkpoint and export)
    /// is the same as a run without it. Collective: every rank must call it.
    pub fn gather_named(&self, which: StateKind) -> Result<NamedTensors> {
        let mut out = Vec::new();
        let mut add = |kind: UnitKind, items: Vec<(FlatParam, Vec<f32>)>| -> Result<()> {
            let items = self.join_tp_slices(kind, items)?;
            out.extend(
                items
                    .into_iter()
                    .map(|(p, v)| (hf_name(kind, &p.name), p.shape, v)),
            );
            Ok(())
        };
        add(
            UnitKind::Embedding,
            self.embed.gather_full_f32(&self.ctx, which)?,
        )?;
        for (i, l) in self.layers.iter().enumerate() {
            add(UnitKind::Layer(i), l.gather_full_f32(&self.ctx, which)?)?;
        }
        add(UnitKind::Head, self.head.gather_full_f32(&self.ctx, which)?)?;
        Ok(out)
    }

    /// One unit's parameters with their tp slices (this rank's, as FSDP gathered them) replaced
    /// by the full tensors: one all-gather over the tp group of every split parameter of the
    /// unit, then rank `r`'s rows (column-parallel) or columns (row-parallel) put in place.
    fn join_tp_slices(
        &self,
        kind: UnitKind,
        mut items: Vec<(FlatParam, Vec<f32>)>,
    ) -> Result<Vec<(FlatParam, Vec<f32>)>> {
        let Some(tp) = &self.tp else {
            return Ok(items);
        };
        let split: Vec<(usize, TpSplit)> = items
            .iter()
            .enumerate()
            .map(|(i, (p, _))| (i, tp_split(kind, &p.name)))
            .filter(|(_, s)| *s != TpSplit::Replicated)
            .collect();
        if split.is_empty() {
            return Ok(items);
        }
        let mut local = Vec::new();
        for (i, _) in &split {
            local.extend_from_slice(&items[*i].1);
        }
        let per_rank = local.len();
        let t = Tensor::<B::InnerBackend, 1>::from_data(
            TensorData::new(local, [per_rank]),
            &self.device,
        );
        let all: Vec<f32> = tp
            .all_gather(t)?
            .into_data()
            .convert::<f32>()
            .to_vec()
            .map_err(|e| crate::LlamaError::Config(format!("reading gathered slices: {e:?}")))?;
        let degree = tp.degree();
        let mut offset = 0;
        for (i, how) in split {
            let (p, values) = &mut items[i];
            let slices: Vec<&[f32]> = (0..degree)
                .map(|r| &all[r * per_rank + offset..r * per_rank + offset + p.numel])
                .collect();
            offset += p.numel;
            *values = join_slices(&slices, &p.shape, how);
            p.shape = full_shape(&p.shape, how, degree);
            p.numel *= degree;
        }
        Ok(items)
    }

    /// Overwrites `kind` (weights or an AdamW moment) on every unit from full named values:
    /// loads a checkpoint written with any number of ranks, with or without tensor
    /// parallelism (each rank reads only its own slice).
    pub fn load_state(&mut self, kind: StateKind, init: &ParamInit<'_>) -> Result<()> {
        let failure = std::cell::RefCell::new(None);
        let slice = self.tp.as_ref().map(|t| TpSlice {
            degree: t.degree(),
            rank: t.rank(),
        });
        let unit_init = |unit: UnitKind| unit_initializer(init, unit, slice, &failure);
        self.embed
            .load_state(kind, unit_init(UnitKind::Embedding))?;
        for (i, l) in self.layers.iter_mut().enumerate() {
            l.load_state(kind, unit_init(UnitKind::Layer(i)))?;
        }
        self.head.load_state(kind, unit_init(UnitKind::Head))?;
        match failure.into_inner() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Bytes of parameter, gradient and optimizer state this rank holds.
    pub fn state_bytes(&self) -> usize {
        self.units_mut_iter().map(|u| u.state_bytes()).sum()
    }

    /// Bytes of activations the last [`Self::forward_backward`] kept in host memory instead of
    /// on the device (0 without activation offloading): one input per recomputed layer, this
    /// rank's `[batch, seq / tp, hidden]` in the compute dtype.
    pub fn offloaded_bytes(&self) -> usize {
        self.offloaded_bytes
    }
}

enum UnitRef<'a, B: AutodiffBackend> {
    Embed(&'a ShardedUnit<B, Embedding<B>>),
    Layer(&'a ShardedUnit<B, DecoderLayer<B>>),
    Head(&'a ShardedUnit<B, LmHead<B>>),
}

impl<B: AutodiffBackend> UnitRef<'_, B> {
    fn grad_sq_sum(&self) -> Option<Tensor<B::InnerBackend, 1>> {
        match self {
            UnitRef::Embed(u) => u.grad_sq_sum(),
            UnitRef::Layer(u) => u.grad_sq_sum(),
            UnitRef::Head(u) => u.grad_sq_sum(),
        }
    }
    /// Sum of squares with replicated parameters weighted by `share` (1/tp), split ones by 1.
    fn grad_sq_sum_weighted(&self, share: f32) -> Option<Tensor<B::InnerBackend, 1>> {
        let weight = |kind: UnitKind| {
            move |p: &FlatParam| match tp_split(kind, &p.name) {
                TpSplit::Replicated => share,
                TpSplit::Rows | TpSplit::Cols => 1.0,
            }
        };
        match self {
            UnitRef::Embed(u) => u.grad_sq_sum_weighted(&weight(UnitKind::Embedding)),
            // The weights depend on the path only, not on the layer index.
            UnitRef::Layer(u) => u.grad_sq_sum_weighted(&weight(UnitKind::Layer(0))),
            UnitRef::Head(u) => u.grad_sq_sum_weighted(&weight(UnitKind::Head)),
        }
    }
    fn state_bytes(&self) -> usize {
        match self {
            UnitRef::Embed(u) => u.state_bytes(),
            UnitRef::Layer(u) => u.state_bytes(),
            UnitRef::Head(u) => u.state_bytes(),
        }
    }
}

trait ElemF64 {
    fn elem_f64(self) -> f64;
}
impl<E: burn::tensor::ElementConversion> ElemF64 for E {
    fn elem_f64(self) -> f64 {
        self.elem::<f64>()
    }
}

/// A unit's full flat parameters: the prefetched gather when there is one, else gathered now.
fn gathered<B: AutodiffBackend, M: burn::module::Module<B>>(
    prefetched: Option<PendingGather<B::InnerBackend>>,
    unit: &ShardedUnit<B, M>,
    ctx: &FsdpContext<B::InnerBackend>,
) -> Result<Tensor<B::InnerBackend, 1>> {
    let pending = match prefetched {
        Some(p) => p,
        None => unit.start_gather(ctx)?,
    };
    Ok(pending.wait()?)
}

/// Adapts a model-level [`ParamInit`] to one unit's infallible initializer: the first error is
/// kept in `failure` (and zeros returned) because `ShardedUnit` takes a plain closure; the
/// caller reports it once every unit is built. With tensor parallelism (`tp`) the unit's
/// parameters are this rank's slices, and their elements are read from the full parameter.
fn unit_initializer<'a>(
    init: &'a ParamInit<'_>,
    kind: UnitKind,
    tp: Option<TpSlice>,
    failure: &'a std::cell::RefCell<Option<crate::LlamaError>>,
) -> impl Fn(&FlatParam, Range<usize>) -> Vec<f32> + 'a {
    move |p, range| {
        let name = hf_name(kind, &p.name);
        let values = match tp.map(|t| (t, tp_split(kind, &p.name))) {
            None | Some((_, TpSplit::Replicated)) => init(&name, &p.shape, range.clone()),
            Some((t, how)) => read_slice(init, &name, &p.shape, how, t, range.clone()),
        };
        match values {
            Ok(v) => v,
            Err(e) => {
                failure.borrow_mut().get_or_insert(e);
                vec![0.0; range.len()]
            }
        }
    }
}

/// The full shape of a parameter whose tp slice has shape `local`.
fn full_shape(local: &[usize], how: TpSplit, degree: usize) -> Vec<usize> {
    let mut full = local.to_vec();
    match how {
        TpSplit::Replicated => {}
        TpSplit::Rows => full[0] *= degree,
        TpSplit::Cols => full[1] *= degree,
    }
    full
}

/// Elements `range` (flat, row-major) of rank `t.rank`'s slice (shape `local`) of a split
/// `[out, in]` parameter, read from the full parameter through `init`. A column-parallel slice
/// is contiguous in the full tensor (one read); a row-parallel slice is a strided block, read
/// row by row.
fn read_slice(
    init: &ParamInit<'_>,
    name: &str,
    local: &[usize],
    how: TpSplit,
    t: TpSlice,
    range: Range<usize>,
) -> Result<Vec<f32>> {
    let full = full_shape(local, how, t.degree);
    let (rows, cols) = (local[0], local[1]);
    match how {
        TpSplit::Replicated => init(name, local, range),
        TpSplit::Rows => {
            let first = t.rank * rows * cols;
            init(name, &full, first + range.start..first + range.end)
        }
        TpSplit::Cols => {
            let (full_cols, first_col) = (cols * t.degree, t.rank * cols);
            let mut out = Vec::with_capacity(range.len());
            let mut i = range.start;
            while i < range.end {
                let (row, col) = (i / cols, i % cols);
                let n = (cols - col).min(range.end - i);
                let start = row * full_cols + first_col + col;
                out.extend(init(name, &full, start..start + n)?);
                i += n;
            }
            Ok(out)
        }
    }
}

/// The full `[out, in]` values of a split parameter from its `degree` slices (in rank order),
/// each of shape `local`.
fn join_slices(slices: &[&[f32]], local: &[usize], how: TpSplit) -> Vec<f32> {
    match how {
        TpSplit::Replicated => slices[0].to_vec(),
        TpSplit::Rows => slices.concat(),
        TpSplit::Cols => {
            let cols = local[1];
            let mut out = Vec::with_capacity(slices.len() * slices[0].len());
            for row in 0..local[0] {
                for s in slices {
                    out.extend_from_slice(&s[row * cols..(row + 1) * cols]);
                }
            }
            out
        }
    }
}

/// A decoder layer's lazy template with the shapes of one rank's tp slices (the full layer
/// when `tp` is 1): split dimensions divided by `tp` as [`tp_split`] says, and `tp` times fewer
/// heads. The caller has checked divisibility ([`LlamaConfig::validate_tensor_parallel`]).
fn layer_template<B: Backend>(
    config: &LlamaConfig,
    tp: usize,
    device: &B::Device,
) -> DecoderLayer<B> {
    struct Local<'a, B: Backend> {
        path: Vec<String>,
        tp: usize,
        device: &'a B::Device,
    }
    impl<B: Backend> ModuleMapper<B> for Local<'_, B> {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.pop();
        }
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let how = tp_split(UnitKind::Layer(0), &self.path.join("."));
            if how == TpSplit::Replicated {
                return param;
            }
            let mut dims: [usize; D] = param
                .lazy_shape()
                .to_vec()
                .try_into()
                .expect("a parameter's rank is D");
            match how {
                TpSplit::Rows => dims[0] /= self.tp,
                _ => dims[1] /= self.tp,
            }
            // The full-size lazy value is dropped without ever being created.
            Initializer::Zeros.init(dims, self.device)
        }
    }
    let full = DecoderLayer::template(config, device);
    if tp == 1 {
        return full;
    }
    let mut layer = full.map(&mut Local {
        path: Vec::new(),
        tp,
        device,
    });
    layer.self_attn.num_heads /= tp;
    layer.self_attn.num_kv_heads /= tp;
    layer
}

/// The boundaries of a decoder layer's split regions under sequence parallelism:
/// `gather_sequence` on entry, `reduce_scatter_sequence` on exit; the identity without tensor
/// parallelism.
struct SequenceRegions<B: AutodiffBackend> {
    /// A clone of the model's (shared state), so that the regions do not borrow the model
    /// while its units take their gradients.
    tp: Option<TpContext<B::InnerBackend>>,
    _backend: PhantomData<B>,
}

impl<B: AutodiffBackend> SplitRegions<B> for SequenceRegions<B> {
    fn enter(&self, x: Tensor<B, 3>) -> Result<Tensor<B, 3>> {
        match &self.tp {
            Some(tp) => Ok(tp::gather_sequence(x, tp)?),
            None => Ok(x),
        }
    }
    fn exit(&self, x: Tensor<B, 3>) -> Result<Tensor<B, 3>> {
        match &self.tp {
            Some(tp) => Ok(tp::reduce_scatter_sequence(x, tp)?),
            None => Ok(x),
        }
    }
}

/// Takes (first pass) and puts back summed (second pass, `summed` set) the gradients of a
/// unit's replicated parameters; see `ShardedLlama::sum_replicated_grads`.
struct ReplicatedGrads<'a, B: AutodiffBackend> {
    kind: UnitKind,
    path: Vec<String>,
    grads: &'a mut B::Gradients,
    pieces: Vec<Tensor<B::InnerBackend, 1>>,
    dtype: FloatDType,
    summed: Option<std::vec::IntoIter<Tensor<B::InnerBackend, 1>>>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for ReplicatedGrads<'_, B> {
    fn enter_module(&mut self, name: &str, _: &str) {
        self.path.push(name.to_string());
    }
    fn exit_module(&mut self, _: &str, _: &str) {
        self.path.pop();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if tp_split(self.kind, &self.path.join(".")) != TpSplit::Replicated {
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

/// Deterministic initialization from a seed (see [`smp_burn::init`]): any rank can produce
/// any slice of any parameter.
pub fn seeded_init(seed: u64) -> impl Fn(&str, &[usize], Range<usize>) -> Result<Vec<f32>> {
    move |name, shape, range| {
        Ok(smp_burn::init::init_values(
            seed,
            name,
            crate::model::init_rule(shape),
            range,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A full `[rows, cols]` parameter whose element `i` has the value `i`.
    fn index_init(name: &str, shape: &[usize], range: Range<usize>) -> Result<Vec<f32>> {
        assert_eq!(name, "w");
        assert!(
            range.end <= shape.iter().product(),
            "{range:?} of {shape:?}"
        );
        Ok(range.map(|i| i as f32).collect())
    }

    /// Reading any element range of any rank's slice gives that slice's elements of the full
    /// parameter, and joining every rank's slice gives the full parameter back, for both split
    /// kinds, an odd degree and ranges that start and end mid-row.
    #[test]
    fn slices_read_and_join_exactly() {
        let (rows, cols) = (6, 12);
        let full: Vec<f32> = (0..rows * cols).map(|i| i as f32).collect();
        for degree in [1, 2, 3] {
            for how in [TpSplit::Rows, TpSplit::Cols] {
                let local = match how {
                    TpSplit::Rows => [rows / degree, cols],
                    _ => [rows, cols / degree],
                };
                let n = local[0] * local[1];
                let mut slices = Vec::new();
                for rank in 0..degree {
                    let t = TpSlice { degree, rank };
                    let whole = read_slice(&index_init, "w", &local, how, t, 0..n).unwrap();
                    // The slice is what slicing the full matrix gives.
                    let want: Vec<f32> = (0..n)
                        .map(|i| {
                            let (r, c) = (i / local[1], i % local[1]);
                            match how {
                                TpSplit::Rows => full[(rank * local[0] + r) * cols + c],
                                _ => full[r * cols + rank * local[1] + c],
                            }
                        })
                        .collect();
                    assert_eq!(whole, want, "{how:?} degree {degree} rank {rank}");
                    for range in [1..n - 1, 3..3 + local[1], n / 2..n] {
                        let part = read_slice(&index_init, "w", &local, how, t, range.clone());
                        assert_eq!(part.unwrap(), want[range.clone()].to_vec(), "{range:?}");
                    }
                    slices.push(whole);
                }
                let refs: Vec<&[f32]> = slices.iter().map(Vec::as_slice).collect();
                assert_eq!(join_slices(&refs, &local, how), full, "{how:?} {degree}");
                assert_eq!(full_shape(&local, how, degree), vec![rows, cols]);
            }
        }
    }

    /// The split template's shapes are the full ones divided along the dimension `tp_split`
    /// names, with a tp-th of the heads.
    #[test]
    fn split_template_follows_the_plan() {
        use smp_burn::fsdp::FlatLayout;
        type B = burn::backend::Autodiff<burn_ndarray::NdArray<f32>>;
        let config = LlamaConfig::preset("tiny").unwrap();
        let device = Default::default();
        let full = FlatLayout::of::<B, _>(&layer_template::<B>(&config, 1, &device), 1);
        let split = layer_template::<B>(&config, 2, &device);
        assert_eq!(split.self_attn.num_heads, 2);
        assert_eq!(split.self_attn.num_kv_heads, 1);
        let split = FlatLayout::of::<B, _>(&split, 1);
        for (f, s) in full.params.iter().zip(&split.params) {
            assert_eq!(f.name, s.name);
            let how = tp_split(UnitKind::Layer(0), &s.name);
            assert_eq!(full_shape(&s.shape, how, 2), f.shape, "{}", s.name);
        }
        let split_count = split
            .params
            .iter()
            .filter(|p| tp_split(UnitKind::Layer(3), &p.name) != TpSplit::Replicated)
            .count();
        assert_eq!(split_count, 7, "q, k, v, o, gate, up, down");
    }
}
