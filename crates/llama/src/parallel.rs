//! The one place where the Llama model meets the parallel layer (torchtitan's
//! `parallelize_llama`): every unit is wrapped as a [`ShardedUnit`], and a training step walks
//! the units forward and backward, gathering each unit's parameters just before it runs.
//!
//! With activation checkpointing a unit's forward runs without an autodiff graph and only its
//! input is kept; its backward gathers the parameters again, recomputes the forward with a
//! graph and backpropagates the incoming gradient. Without it, each unit's graph (and so its
//! gathered parameters) is kept from the forward to the backward.

use std::ops::Range;

use burn::tensor::{Int, Tensor, backend::AutodiffBackend};
use smp_burn::PendingGather;
use smp_burn::fsdp::{
    AdamW, CommStats, FlatParam, FsdpContext, ShardedUnit, StateKind, clip_factor,
};

use crate::config::LlamaConfig;
use crate::error::Result;
use crate::model::{DecoderLayer, Embedding, LmHead, UnitKind, hf_name};

/// Where initial parameter values come from: `(hf_name, shape, element range) -> values`.
pub type ParamInit<'a> = dyn Fn(&str, &[usize], Range<usize>) -> Result<Vec<f32>> + 'a;

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
    device: B::Device,
    checkpointing: bool,
}

/// Full tensors by Hugging Face name: `(name, shape, fp32 values)`.
pub type NamedTensors = Vec<(String, Vec<usize>, Vec<f32>)>;

/// Per-step numbers the trainer reports.
#[derive(Debug, Clone, Copy)]
pub struct StepStats {
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Time in collectives and calls made.
    pub comm: CommStats,
}

impl<B: AutodiffBackend> ShardedLlama<B> {
    /// Builds the sharded model; each rank creates only its own chunk of every parameter from
    /// `init`.
    pub fn new(
        config: &LlamaConfig,
        ctx: FsdpContext<B::InnerBackend>,
        device: &B::Device,
        activation_checkpointing: bool,
        init: &ParamInit<'_>,
    ) -> Result<Self> {
        config.validate()?;
        if config.tie_word_embeddings {
            return Err(crate::LlamaError::Config(
                "tie_word_embeddings = true is not supported by the sharded trainer yet \
                 (the embedding and the LM head live in different units)"
                    .into(),
            ));
        }
        let inner_device = device.clone();
        let failure = std::cell::RefCell::new(None);
        let unit_init = |kind: UnitKind| unit_initializer(init, kind, &failure);
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
                DecoderLayer::template(config, device),
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
            device: device.clone(),
            checkpointing: activation_checkpointing,
        })
    }

    /// The communication context (shard and replica groups).
    pub fn context(&self) -> &FsdpContext<B::InnerBackend> {
        &self.ctx
    }

    fn rope(&self, seq: usize) -> (Tensor<B, 2>, Tensor<B, 2>) {
        smp_burn::ops::rope_tables(
            seq,
            self.config.head_dim(),
            self.config.rope_theta,
            &self.device,
        )
    }

    /// Forward and backward of one micro-batch; gradients are added to the shards (or, with
    /// `defer`, kept unreduced until a later call without it). The loss is multiplied by
    /// `loss_scale` before differentiation (1 / micro-batches for accumulation). Returns this
    /// rank's unscaled loss.
    pub fn forward_backward(
        &mut self,
        tokens: Tensor<B, 2, Int>,
        targets: Tensor<B, 2, Int>,
        loss_scale: f32,
        defer: bool,
    ) -> Result<Tensor<B::InnerBackend, 1>> {
        let [_, seq] = tokens.dims();
        let (cos, sin) = self.rope(seq);
        let ctx = &self.ctx;

        // With prefetch, a unit's all-gather is started before the previous unit's compute is
        // queued and waited for only when the unit runs, so on CUDA the two overlap. The order
        // of collectives is the same on every rank either way.
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

        // Layers: either keep only each layer's input (checkpointing) or its whole graph.
        enum Saved<B: AutodiffBackend> {
            Input(Tensor<B::InnerBackend, 3>),
            Graph {
                module: Box<DecoderLayer<B>>,
                input: Tensor<B, 3>,
                output: Tensor<B, 3>,
            },
        }
        let mut saved: Vec<Saved<B>> = Vec::with_capacity(n);
        for (i, unit) in self.layers.iter().enumerate() {
            let full = gathered(next_layer.take(), unit, ctx)?;
            if prefetch {
                if i + 1 < n {
                    next_layer = Some(self.layers[i + 1].start_gather(ctx)?);
                } else {
                    next_other = Some(self.head.start_gather(ctx)?);
                }
            }
            if self.checkpointing {
                let layer = unit.assemble(full, false);
                let y = layer.forward(x.clone(), cos.clone(), sin.clone()).detach();
                saved.push(Saved::Input(x.inner()));
                x = y;
            } else {
                let layer = unit.assemble(full, true);
                let input = x.require_grad();
                let output = layer.forward(input.clone(), cos.clone(), sin.clone());
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
            // The backward's first gather: the last layer's (recomputed with checkpointing),
            // else the embedding's (the only unit the backward gathers without it).
            if self.checkpointing && n > 0 {
                next_layer = Some(self.layers[n - 1].start_gather(ctx)?);
            } else {
                next_other = Some(self.embed.start_gather(ctx)?);
            }
        }
        let head = self.head.assemble(head_full, true);
        let x = x.require_grad();
        let loss = head.loss(x.clone(), targets);
        let local_loss = loss.clone().inner();
        let grads = (loss * loss_scale).backward();
        let mut grad = x
            .grad(&grads)
            .expect("the head's input takes part in the loss");
        self.head.accumulate_grads(&head, &grads, ctx, defer)?;
        drop((head, grads));

        // Layers in reverse, propagating the gradient of each layer's output to its input.
        for i in (0..n).rev() {
            let saved = saved.pop().expect("one saved entry per layer");
            let (module, input, output) = match saved {
                Saved::Input(input) => {
                    let full = gathered(next_layer.take(), &self.layers[i], ctx)?;
                    if prefetch {
                        if i > 0 {
                            next_layer = Some(self.layers[i - 1].start_gather(ctx)?);
                        } else {
                            next_other = Some(self.embed.start_gather(ctx)?);
                        }
                    }
                    let layer = self.layers[i].assemble(full, true);
                    let input = Tensor::<B, 3>::from_inner(input).require_grad();
                    let output = layer.forward(input.clone(), cos.clone(), sin.clone());
                    (layer, input, output)
                }
                Saved::Graph {
                    module,
                    input,
                    output,
                } => (*module, input, output),
            };
            let grads = (output * Tensor::from_inner(grad)).sum().backward();
            grad = input
                .grad(&grads)
                .expect("a layer's input takes part in its output");
            self.layers[i].accumulate_grads(&module, &grads, ctx, defer)?;
        }

        // Embedding: its gradient is a scatter of the incoming one.
        let embed_full = gathered(next_other.take(), &self.embed, ctx)?;
        let embed = self.embed.assemble(embed_full, true);
        let y = embed.forward(tokens);
        let grads = (y * Tensor::from_inner(grad)).sum().backward();
        self.embed.accumulate_grads(&embed, &grads, ctx, defer)?;
        Ok(local_loss)
    }

    /// Clips the gradient to `max_norm` (global norm over every rank's shards), takes one AdamW
    /// step on every shard and clears the gradients. `step` counts from 1.
    pub fn optimizer_step(
        &mut self,
        opt: &AdamW,
        lr: f64,
        step: u64,
        max_norm: Option<f64>,
    ) -> Result<StepStats> {
        let sq: Vec<_> = self
            .units_mut_iter()
            .filter_map(|u| u.grad_sq_sum())
            .collect();
        let (scale, grad_norm) = clip_factor(sq, max_norm, &self.ctx)?;
        self.embed.adamw_step(opt, lr, step, scale.clone());
        for l in &mut self.layers {
            l.adamw_step(opt, lr, step, scale.clone());
        }
        self.head.adamw_step(opt, lr, step, scale);
        Ok(StepStats {
            grad_norm,
            comm: self.ctx.take_stats(),
        })
    }

    fn units_mut_iter(&self) -> impl Iterator<Item = UnitRef<'_, B>> {
        std::iter::once(UnitRef::Embed(&self.embed))
            .chain(self.layers.iter().map(UnitRef::Layer))
            .chain(std::iter::once(UnitRef::Head(&self.head)))
    }

    /// Logits `[batch, seq, vocab]` without any autodiff graph (evaluation and sampling).
    pub fn logits(&self, tokens: Tensor<B, 2, Int>) -> Result<Tensor<B::InnerBackend, 3>> {
        let x = self.hidden_states(tokens)?;
        let head = self.head.gather(&self.ctx, false)?;
        Ok(head.logits(x).inner())
    }

    /// Mean cross-entropy without any autodiff graph; this rank's batch only.
    pub fn eval_loss(&self, tokens: Tensor<B, 2, Int>, targets: Tensor<B, 2, Int>) -> Result<f64> {
        let x = self.hidden_states(tokens)?;
        let head = self.head.gather(&self.ctx, false)?;
        let loss = head.loss(x, targets).inner();
        let loss = self.ctx.mean_over_data_parallel(loss)?;
        Ok(loss.into_scalar().elem_f64())
    }

    fn hidden_states(&self, tokens: Tensor<B, 2, Int>) -> Result<Tensor<B, 3>> {
        let [_, seq] = tokens.dims();
        let (cos, sin) = self.rope(seq);
        let embed = self.embed.gather(&self.ctx, false)?;
        let mut x = embed.forward(tokens).detach();
        for unit in &self.layers {
            let layer = unit.gather(&self.ctx, false)?;
            x = layer.forward(x, cos.clone(), sin.clone()).detach();
        }
        Ok(x)
    }

    /// Every parameter's (or optimizer moment's) full fp32 values under its Hugging Face name.
    /// Collective: every rank of the shard group must call it.
    pub fn gather_named(&self, which: StateKind) -> Result<NamedTensors> {
        let mut out = Vec::new();
        let mut add = |kind: UnitKind, items: Vec<(FlatParam, Vec<f32>)>| {
            out.extend(
                items
                    .into_iter()
                    .map(|(p, v)| (hf_name(kind, &p.name), p.shape, v)),
            );
        };
        add(
            UnitKind::Embedding,
            self.embed.gather_full_f32(&self.ctx, which)?,
        );
        for (i, l) in self.layers.iter().enumerate() {
            add(UnitKind::Layer(i), l.gather_full_f32(&self.ctx, which)?);
        }
        add(UnitKind::Head, self.head.gather_full_f32(&self.ctx, which)?);
        Ok(out)
    }

    /// Overwrites `kind` (weights or an AdamW moment) on every unit from full named values:
    /// loads a checkpoint written with any number of ranks.
    pub fn load_state(&mut self, kind: StateKind, init: &ParamInit<'_>) -> Result<()> {
        let failure = std::cell::RefCell::new(None);
        let unit_init = |unit: UnitKind| unit_initializer(init, unit, &failure);
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
/// caller reports it once every unit is built.
fn unit_initializer<'a>(
    init: &'a ParamInit<'_>,
    kind: UnitKind,
    failure: &'a std::cell::RefCell<Option<crate::LlamaError>>,
) -> impl Fn(&FlatParam, Range<usize>) -> Vec<f32> + 'a {
    move |p, range| match init(&hf_name(kind, &p.name), &p.shape, range.clone()) {
        Ok(v) => v,
        Err(e) => {
            failure.borrow_mut().get_or_insert(e);
            vec![0.0; range.len()]
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
