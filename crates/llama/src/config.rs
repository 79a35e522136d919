//! Model shapes: Llama 2 presets and any shape read from a Hugging Face `config.json`.

use serde::{Deserialize, Serialize};

use smp_burn::Precision;
use smp_burn::fsdp::MomentDtype;

use crate::error::{LlamaError, Result};

/// The shape of a Llama model. Field names follow Hugging Face's `LlamaConfig` so that a
/// `config.json` maps onto it without a table of special cases.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LlamaConfig {
    /// Tokens in the vocabulary (embedding rows and LM-head outputs).
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the SwiGLU MLP's inner layer.
    pub intermediate_size: usize,
    /// Number of transformer blocks.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads; fewer than query heads means grouped-query attention (70B uses 8).
    pub num_key_value_heads: usize,
    /// Longest sequence the rotary tables are built for.
    pub max_position_embeddings: usize,
    /// Epsilon inside RMSNorm.
    pub rms_norm_eps: f64,
    /// Base of the rotary embedding frequencies.
    pub rope_theta: f64,
    /// Whether the LM head shares the token embedding's weights.
    #[serde(default)]
    pub tie_word_embeddings: bool,
}

impl LlamaConfig {
    /// Names accepted by [`LlamaConfig::preset`].
    pub const PRESETS: [&'static str; 6] = ["tiny", "small", "1b", "7b", "13b", "70b"];

    /// A named shape: `7b`, `13b`, `70b` are Llama 2's published shapes; `1b` is the 1.2B shape
    /// of the PyTorch reference (`torch_llama.py --preset 1b`); `small` is the CPU default
    /// (about 1.3M parameters with a 2048-token vocabulary, sized to learn
    /// in a few minutes on two CPU cores); `tiny` is for tests.
    pub fn preset(name: &str) -> Result<Self> {
        let llama2 = |hidden, inter, layers, heads, kv| LlamaConfig {
            vocab_size: 32000,
            hidden_size: hidden,
            intermediate_size: inter,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            num_key_value_heads: kv,
            max_position_embeddings: 4096,
            rms_norm_eps: 1e-5,
            rope_theta: 10000.0,
            tie_word_embeddings: false,
        };
        Ok(match name {
            "tiny" => LlamaConfig {
                vocab_size: 256,
                hidden_size: 64,
                intermediate_size: 176,
                num_hidden_layers: 2,
                num_attention_heads: 4,
                num_key_value_heads: 2,
                max_position_embeddings: 256,
                ..llama2(0, 0, 0, 0, 0)
            },
            "small" => LlamaConfig {
                vocab_size: 2048,
                hidden_size: 128,
                intermediate_size: 384,
                num_hidden_layers: 4,
                num_attention_heads: 4,
                num_key_value_heads: 4,
                max_position_embeddings: 1024,
                ..llama2(0, 0, 0, 0, 0)
            },
            "1b" => llama2(2048, 5632, 22, 32, 32),
            "7b" => llama2(4096, 11008, 32, 32, 32),
            "13b" => llama2(5120, 13824, 40, 40, 40),
            "70b" => llama2(8192, 28672, 80, 64, 8),
            other => {
                return Err(LlamaError::Config(format!(
                    "unknown model preset '{other}'; known presets: {}",
                    Self::PRESETS.join(", ")
                )));
            }
        })
    }

    /// Width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads
    }

    /// Checks the relations between fields that the model relies on.
    pub fn validate(&self) -> Result<()> {
        let c = self;
        let fail = |m: String| Err(LlamaError::Config(m));
        if c.vocab_size == 0 || c.hidden_size == 0 || c.num_hidden_layers == 0 {
            return fail(format!(
                "vocab_size ({}), hidden_size ({}) and num_hidden_layers ({}) must be positive",
                c.vocab_size, c.hidden_size, c.num_hidden_layers
            ));
        }
        if c.num_attention_heads == 0 || !c.hidden_size.is_multiple_of(c.num_attention_heads) {
            return fail(format!(
                "hidden_size {} is not divisible by num_attention_heads {}",
                c.hidden_size, c.num_attention_heads
            ));
        }
        if c.num_key_value_heads == 0
            || !c.num_attention_heads.is_multiple_of(c.num_key_value_heads)
        {
            return fail(format!(
                "num_attention_heads {} is not divisible by num_key_value_heads {}",
                c.num_attention_heads, c.num_key_value_heads
            ));
        }
        if !c.head_dim().is_multiple_of(2) {
            return fail(format!(
                "head dimension {} must be even for rotary embeddings",
                c.head_dim()
            ));
        }
        Ok(())
    }

    /// Checks that a tensor-parallel degree `tp` splits this shape: query heads, key/value
    /// heads, the MLP width and the vocabulary must each be divisible by it (each rank holds
    /// whole heads and equal slices of the MLP, the embedding and the LM head). The error names
    /// the field, its value and `tp`.
    pub fn validate_tensor_parallel(&self, tp: usize) -> Result<()> {
        for (what, n) in [
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("intermediate_size", self.intermediate_size),
            ("vocab_size", self.vocab_size),
        ] {
            smp_burn::tp::split_len(what, n, tp)?;
        }
        Ok(())
    }

    /// Parameters of the whole model, counted from the shape alone (nothing is allocated).
    pub fn num_parameters(&self) -> usize {
        let embed = self.vocab_size * self.hidden_size;
        let head = if self.tie_word_embeddings { 0 } else { embed };
        embed + head + self.num_hidden_layers * self.block_parameters() + self.hidden_size
    }

    /// Parameters of one transformer block.
    pub fn block_parameters(&self) -> usize {
        let h = self.hidden_size;
        let kv = self.num_key_value_heads * self.head_dim();
        let attn = h * h * 2 + h * kv * 2;
        let mlp = 3 * h * self.intermediate_size;
        attn + mlp + 2 * h
    }

    /// Bytes one GPU needs to train this shape with smp-burn's CUDA path laid out as `layout`
    /// (fp32 master weights, AdamW moments and gradient shards; compute in
    /// [`StepLayout::compute`]), the first `recomputed_layers` decoder layers checkpointed (0:
    /// none; the number of layers or more: all), their inputs offloaded to host memory when
    /// [`StepLayout::offload_horizon`] is `Some(horizon)` (then only `horizon + 1` of them are on
    /// the device at once: the ones brought back ahead of the backward and the one whose copy is
    /// in flight in the forward).
    ///
    /// Calibrated on an H200 against the device memory in use as the step log reports it
    /// (docs/benchmarks.md lists each run beside this estimate); within 10 % of every one-GPU
    /// run measured: bf16 at S=4096 (1.2B 27.0 GiB, Llama 2 7B 112.6-122.1 GiB), FP8 (1.2B 25.8,
    /// 7B 116.8 GiB) and f32 with the reference attention (1.2B at S=2048 25.4-62.6 GiB, 7B
    /// 123.7 GiB). Two-GPU runs are counted more roughly (f32 gradients, NCCL buffers and the
    /// prefetched unit). Its use is to decide how many layers to recompute
    /// ([`Self::layers_to_recompute`]).
    pub fn training_memory_estimate(&self, layout: &StepLayout, recomputed_layers: usize) -> u64 {
        let (h, i) = (self.hidden_size as u64, self.intermediate_size as u64);
        let tokens = (layout.micro_batch * layout.seq_len) as u64;
        let shard_degree = layout.shard_degree.max(1);
        let tp = layout.tp.max(1) as u64;
        let ranks = shard_degree as u64 * tp;
        let f32_compute = layout.compute == Precision::F32;
        // Master weights (f32) and two moments (f32 or bf16), the gradient shard (f32 where it is reduced,
        // accumulated or computed in f32, bf16 where a unit has nothing to reduce or add to)
        // and, in bf16, the weight copy AdamW writes for the next gather.
        let grad_bytes = if shard_degree <= 1 && !f32_compute && !layout.accumulates_unreduced {
            2
        } else {
            4
        };
        let copy_bytes = if f32_compute { 0 } else { 2 };
        let moment_bytes = 2 * layout.adamw_moments.size() as u64;
        let mut state = self.num_parameters() as u64 * (4 + moment_bytes + copy_bytes) / ranks;
        let grads = self.num_parameters() as u64 * grad_bytes / ranks;
        if layout.accumulates_unreduced && shard_degree > 1 {
            // Sharded units keep their whole gradient (f32) until the last micro-batch reduces
            // it; unsharded ones accumulate into the gradient counted above.
            state += self.num_parameters() as u64 * 4 / tp;
        }
        // The largest unit (a layer, or the embedding / head, both split over the vocabulary
        // with tensor parallelism) gathered with its gradients and their f32 flat buffer while
        // it runs.
        let largest_unit = (self.block_parameters() as u64 / tp)
            .max((self.vocab_size * self.hidden_size) as u64 / tp);
        let transient = largest_unit * 12;
        // Tensors a layer keeps for its backward: its input, q, k, v, the attention output, the
        // residual (5 h values per token, split along the sequence with tensor parallelism),
        // gate, up and their product (3 i, split over the ranks), and the two norms' outputs
        // that feed the linears (2 h, gathered over the whole sequence with tensor
        // parallelism). The 1.2B model at S=32,768 measured 1.93 GiB per layer that keeps its
        // graph, 0.95 of this count; at S=4096 the pool hides a third of it in memory that the
        // gradient frees (below).
        let value_bytes: u64 = if f32_compute { 4 } else { 2 };
        let mut layer_acts = tokens * ((5 * h + 3 * i) / tp + 2 * h) * value_bytes;
        if !layout.flash_attention {
            // The reference attention keeps three f32 `seq x seq` tensors per head for its
            // backward (the softmax's input pieces and output; 1.2B in f32 at S=2048 measured
            // 1.69 GiB per layer that keeps its graph, 0.17 of it the other activations).
            let heads = (self.num_attention_heads as u64 / tp).max(1);
            let seq = layout.seq_len as u64;
            layer_acts += 3 * layout.micro_batch as u64 * heads * seq * seq * 4;
        }
        let layers = self.num_hidden_layers as u64;
        let recomputed = (recomputed_layers as u64).min(layers);
        // A recomputed layer keeps its input. The peak is at the end of the forward (every kept
        // layer's graph) or, when all are recomputed, in the backward (one layer's graph); the
        // kept layers are the last ones, so their graphs are gone before any recomputation.
        let kept_inputs = match layout.offload_horizon {
            Some(horizon) => recomputed.min(horizon as u64 + 1),
            None => recomputed,
        };
        let mut acts =
            kept_inputs * tokens * h * value_bytes / tp + (layers - recomputed).max(1) * layer_acts;
        if layout.selective_recompute {
            // Each recomputed layer's attention output (on the device even when its input is
            // offloaded) and per-row log-sum-exp (f32, per query head).
            let heads = self.num_attention_heads as u64;
            acts += recomputed * tokens * (h * value_bytes + heads * 4) / tp;
        }
        // The backward's own tensors of one layer (the gradients of gate, up, q, k, v and the
        // attention's f32 dQ): about 6 (2 h + i) values per token, fitted to the runs that
        // recompute every layer (1.2B at S=32,768: 30.0 GiB).
        let backward = tokens * 6 * (2 * h + i) / tp * value_bytes;
        let mut released = 0;
        if layout.fp8 {
            // A layer that keeps its graph keeps its weights' FP8 copies (a byte per
            // parameter); its inputs are kept in FP8 instead of bf16, which the measured
            // activations above hardly notice. Its backward then reads none of its bf16
            // matrices, so the engine frees an unsharded layer's bf16 weights after its
            // forward, and the pool hands that memory to the later layers' activations: 7B
            // measured 129.9 GiB before that release and 116.8 GiB with it (bf16: 122.8).
            let kept = layers - recomputed;
            acts += kept.max(1) * self.block_parameters() as u64 / tp;
            if shard_degree <= 1 {
                released = kept * self.block_parameters() as u64 * copy_bytes / tp;
            }
        }
        // An unsharded bf16 gradient that no later micro-batch adds to is created in the
        // backward as the activations are freed, and freed by the optimizer before the next
        // forward: only the larger of the two is held at the step's peak. Fitted with the rest
        // to fourteen one-GPU runs (1.2B and 7B, S=4096 and 32,768, full and selective
        // recomputation) within 4.4 % of each.
        // Not counted so with tensor parallelism, whose runs measured more (its collectives'
        // buffers).
        let peak = if grad_bytes == 2 && ranks == 1 && !layout.accumulates_unreduced {
            grads.max(acts)
        } else {
            grads + acts
        };
        // Allocator slack and the CUDA context.
        (state + transient + peak + backward - released) * 11 / 10 + (1 << 30)
    }

    /// How many decoder layers to recompute (activation checkpointing, first layers first) so
    /// that training laid out as `layout` fits `device_bytes` of GPU memory: the fewest whose
    /// estimate ([`Self::training_memory_estimate`]) stays within [`MEMORY_BUDGET_PERCENT`] of
    /// it, or all when even that does not fit. Recomputing a layer costs a third more of its
    /// compute, so every layer that fits keeps its activations.
    pub fn layers_to_recompute(&self, layout: &StepLayout, device_bytes: u64) -> usize {
        let budget = device_bytes / 100 * MEMORY_BUDGET_PERCENT;
        (0..=self.num_hidden_layers)
            .find(|&n| self.training_memory_estimate(layout, n) <= budget)
            .unwrap_or(self.num_hidden_layers)
    }

    /// How many layers to recompute, and whether selectively, when the run leaves both to the
    /// planner: the fewest layers recomputed in full ([`Self::layers_to_recompute`]) or the
    /// fewest recomputed selectively, whichever repeats fewer forward FLOPs
    /// ([`Self::recompute_flops_per_token`]). Selective recomputation keeps one more
    /// `seq x hidden` tensor per recomputed layer, so it may need more of them to fit; it is
    /// only taken where it fits the budget and where attention runs as the flash kernels (the
    /// only ones whose output it keeps). At S=32,768 attention's forward is 40 % of a Llama 2
    /// 7B layer's, at S=4096 8 %.
    pub fn recomputation(&self, layout: &StepLayout, device_bytes: u64) -> Recomputation {
        let plan = |selective| {
            let at = StepLayout {
                selective_recompute: selective,
                ..layout.clone()
            };
            let layers = self.layers_to_recompute(&at, device_bytes);
            (Recomputation { layers, selective }, at)
        };
        let (full, _) = plan(false);
        if full.layers == 0 || !layout.flash_attention {
            return full;
        }
        let (selective, selective_layout) = plan(true);
        let budget = device_bytes / 100 * MEMORY_BUDGET_PERCENT;
        let fits = self.training_memory_estimate(&selective_layout, selective.layers) <= budget;
        let cost = |r: &Recomputation| {
            r.layers as f64 * self.recompute_flops_per_token(layout.seq_len, r.selective)
        };
        if fits && cost(&selective) < cost(&full) {
            selective
        } else {
            full
        }
    }

    /// Refuses, before anything is built, a run whose memory estimate with `recomputation` (the
    /// planner's choice, which recomputes every layer when nothing less fits) exceeds
    /// `device_bytes` by more than [`OVER_DEVICE_PERCENT`]: such a run would only run out of
    /// memory once its model is built and its first step taken (Llama 2 7B at S=32,768 on an
    /// 80 GB H100: about 100 s). Runs within that margin are left to try, since the estimate
    /// can be off by a few percent either way.
    pub fn check_fits(
        &self,
        layout: &StepLayout,
        recomputation: Recomputation,
        device_bytes: u64,
    ) -> Result<()> {
        let at = StepLayout {
            selective_recompute: recomputation.selective,
            ..layout.clone()
        };
        let need = self.training_memory_estimate(&at, recomputation.layers);
        if need <= device_bytes / 100 * OVER_DEVICE_PERCENT {
            return Ok(());
        }
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        Err(LlamaError::Config(format!(
            "this run needs about {:.0} GiB per GPU even recomputing {} of {} layers{}, and the \
             GPU has {:.0} GiB; shard over more GPUs, shorten seq_len ({}) or micro_batch ({}), \
             keep AdamW's moments in bf16 ([adamw] moments = \"bf16\"), offload activations \
             (--activation-offloading), or name the layers to recompute \
             (--checkpointed-layers N) to try anyway",
            gib(need),
            recomputation.layers.min(self.num_hidden_layers),
            self.num_hidden_layers,
            if recomputation.selective {
                " selectively"
            } else {
                ""
            },
            gib(device_bytes),
            layout.seq_len,
            layout.micro_batch,
        )))
    }

    /// Forward FLOPs per token that recomputing one decoder layer repeats: its matrix products
    /// (two per parameter) and, unless `selective` (which keeps attention's output), attention's
    /// score and value products over the causal half of `seq_len` keys.
    pub fn recompute_flops_per_token(&self, seq_len: usize, selective: bool) -> f64 {
        let linear = 2.0 * self.block_parameters() as f64;
        let attention = 2.0 * (self.hidden_size * seq_len) as f64;
        if selective {
            linear
        } else {
            linear + attention
        }
    }

    /// Training FLOPs per token as MFU counts them (the PaLM paper's convention, as torchtitan
    /// computes it): `6 * N + 12 * L * H * S`, N = parameters outside the token embedding (LM
    /// head included); the second term is attention's score and value products, counted as if
    /// no position were masked.
    pub fn flops_per_token(&self, seq_len: usize) -> f64 {
        let n = (self.num_parameters() - self.vocab_size * self.hidden_size
            + if self.tie_word_embeddings {
                self.vocab_size * self.hidden_size
            } else {
                0
            }) as f64;
        6.0 * n + 12.0 * (self.num_hidden_layers * self.hidden_size * seq_len) as f64
    }
}

/// The share of a GPU's memory [`LlamaConfig::layers_to_recompute`] plans to fill. The estimate
/// already adds a tenth for the allocator and is within 5 % of every one-GPU run measured, the
/// worst under-count 4.4 % (7B at S=4096, 8 layers recomputed), which at this share still
/// leaves 3 % of the GPU. Llama 2 7B at S=32,768 with 31 of 32 layers recomputed selectively is
/// estimated at 129.2 GiB (all 32 measured 127.8), which this share of an H200 admits and 92 %
/// did not.
pub const MEMORY_BUDGET_PERCENT: u64 = 93;

/// How far, in percent of a GPU's memory, a run's estimate may go before
/// [`LlamaConfig::check_fits`] refuses it: the estimate's 10 % allocator slack plus its largest
/// miss of the runs measured (4.4 %), rounded up.
pub const OVER_DEVICE_PERCENT: u64 = 115;

/// Which decoder layers recompute their forward in the backward: the first `layers`, fully or,
/// with `selective`, keeping their attention's output ([`LlamaConfig::recomputation`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Recomputation {
    /// How many of the first layers recompute (0: none).
    pub layers: usize,
    /// Whether they keep their attention's output and statistics.
    pub selective: bool,
}

/// How one training step is laid out on a GPU, as far as its memory goes: what
/// [`LlamaConfig::training_memory_estimate`] needs besides the model's shape.
#[derive(Debug, Clone, PartialEq)]
pub struct StepLayout {
    /// Sequences per micro-batch (per tensor-parallel group).
    pub micro_batch: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Ranks each parameter is sharded over (1: unsharded).
    pub shard_degree: usize,
    /// Tensor-parallel degree (1: off).
    pub tp: usize,
    /// `Some(horizon)` when recomputed layers' inputs are offloaded to host memory.
    pub offload_horizon: Option<usize>,
    /// The dtype weights and activations are computed in (`param_dtype`).
    pub compute: Precision,
    /// Whether attention runs as the flash kernels (nothing of size `seq x seq` kept) or as
    /// the reference ops, which keep the scores (f32 compute, other head dimensions, GPUs
    /// before sm_80, or the attention fast path turned off).
    pub flash_attention: bool,
    /// Recomputed layers keep their attention's output and statistics
    /// (`ParallelConfig::selective_recompute`).
    pub selective_recompute: bool,
    /// The blocks' linear layers run in FP8 (`--fp8`), keeping each weight's FP8 transposed
    /// copy from the forward to the backward.
    pub fp8: bool,
    /// Several micro-batches per optimizer step whose gradients are reduced only after the
    /// last (FSDP's `no_sync`, the trainer's default): every unit keeps its whole gradient in
    /// f32 from one micro-batch to the next.
    pub accumulates_unreduced: bool,
    /// The dtype AdamW keeps its two moments in (`[adamw] moments`).
    pub adamw_moments: MomentDtype,
}

impl StepLayout {
    /// A layout with compute in bf16 and flash attention, unsharded, no tensor parallelism and
    /// no offloading: the common one-GPU case, changed field by field.
    pub fn bf16(micro_batch: usize, seq_len: usize) -> Self {
        Self {
            micro_batch,
            seq_len,
            shard_degree: 1,
            tp: 1,
            offload_horizon: None,
            compute: Precision::Bf16,
            flash_attention: true,
            selective_recompute: false,
            fp8: false,
            accumulates_unreduced: false,
            adamw_moments: MomentDtype::F32,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: f64 = (1u64 << 30) as f64;

    /// The estimate against the memory measured on an H200 (docs/benchmarks.md), and the
    /// choices it has to get right: neither the 1.2B model nor Llama 2 7B recomputes anything on
    /// one 141 GB GPU at S=4096 (7B ran at 122.1 GiB), 7B at S=8192 must.
    #[test]
    fn memory_estimate_matches_measured_runs() {
        let b1 = LlamaConfig::preset("1b").unwrap();
        let b7 = LlamaConfig::preset("7b").unwrap();
        let at = |shard, tp, seq| StepLayout {
            shard_degree: shard,
            tp,
            ..StepLayout::bf16(1, seq)
        };
        let gib = |c: &LlamaConfig, layout: &StepLayout, recomputed: usize| {
            c.training_memory_estimate(layout, recomputed) as f64 / GIB
        };
        let bf16 = |c: &LlamaConfig, shard, recomputed| gib(c, &at(shard, 1, 4096), recomputed);
        let near = |got: f64, measured: f64, within: f64| {
            assert!(
                (got - measured).abs() / measured < within,
                "estimate {got:.1} GiB against {measured} measured"
            )
        };
        // One H200, within 10 %.
        near(bf16(&b1, 1, 0), 27.0, 0.10);
        near(bf16(&b7, 1, 32), 112.6, 0.10);
        near(bf16(&b7, 1, 0), 122.1, 0.10);
        near(bf16(&b7, 1, 8), 120.2, 0.10);
        near(bf16(&b7, 1, 16), 118.4, 0.10);
        // FP8 layers that keep their weights' FP8 copies, the bf16 weights of each kept layer
        // freed after its forward.
        let fp8 = |c: &LlamaConfig| {
            let layout = StepLayout {
                fp8: true,
                ..at(1, 1, 4096)
            };
            gib(c, &layout, 0)
        };
        near(fp8(&b7), 116.8, 0.10);
        near(fp8(&b1), 25.8, 0.10);
        // S=32,768: the 1.2B model on one H100 (2026-12-06) and 7B on one H200, within 5 %, full
        // and selective recomputation.
        let long = |c: &LlamaConfig, recomputed, selective_recompute| {
            let layout = StepLayout {
                selective_recompute,
                ..StepLayout::bf16(1, 32768)
            };
            gib(c, &layout, recomputed)
        };
        for (model, recomputed, selective, measured) in [
            (&b1, 0, false, 69.6),
            (&b1, 11, false, 49.7),
            (&b1, 11, true, 51.1),
            (&b1, 22, false, 30.0),
            (&b1, 22, true, 32.5),
            (&b7, 30, false, 123.4),
            (&b7, 32, true, 127.8),
            (&b7, 30, true, 130.0),
        ] {
            near(long(model, recomputed, selective), measured, 0.05);
        }
        // The 1.2B model at S=40,960 ran out of memory on one 80 GB H100 with no layer
        // recomputed (the estimate then said 62 GiB): it must recompute there.
        let h100 = (79.1 * GIB) as u64;
        assert!(b1.layers_to_recompute(&StepLayout::bf16(1, 40960), h100) > 0);
        // Two ranks keep f32 gradients for the reduce-scatter (measured: 87.6 GiB); the
        // estimate counts NCCL's buffers and the prefetched unit only roughly.
        near(bf16(&b7, 2, 0), 87.6, 0.15);
        // Fewer recomputed layers never need less memory (up to the last one: recomputing every
        // layer saves nothing over keeping the last one's graph, whose backward comes first).
        for n in 0..31 {
            assert!(bf16(&b7, 1, n) >= bf16(&b7, 1, n + 1), "{n}");
        }
        let h200 = (139.8 * GIB) as u64;
        assert_eq!(b1.layers_to_recompute(&at(1, 1, 4096), h200), 0);
        assert_eq!(b7.layers_to_recompute(&at(1, 1, 4096), h200), 0);
        let long = b7.layers_to_recompute(&at(1, 1, 8192), h200);
        assert!(
            long > 0 && long < 32,
            "7B at S=8192 recomputes {long} layers"
        );
        assert_eq!(b7.layers_to_recompute(&at(1, 1, 65536), h200), 32);
        // Sharding and tensor parallelism divide the state.
        // (Measured: 87.6 GiB on each of two GPUs, 122.1 on one.)
        assert!(bf16(&b7, 2, 0) < bf16(&b7, 1, 0) - 30.0);
        assert!(gib(&b7, &at(1, 2, 4096), 0) < bf16(&b7, 1, 0) - 40.0);
        // Tensor parallelism 2 at S=32,768 on two GPUs (measured): 73.7 GiB with every layer
        // recomputed, 129.5 GiB with none (93 % of the GPU, over the planner's budget, which an
        // estimate that counted a kept layer as 5 h + 2 i values per token let through): now a
        // few layers recompute.
        near(gib(&b7, &at(1, 2, 32768), 32), 73.7, 0.15);
        near(gib(&b7, &at(1, 2, 32768), 0), 129.5, 0.15);
        let tp_long = b7.layers_to_recompute(&at(1, 2, 32768), h200);
        assert!((1..=4).contains(&tp_long), "{tp_long}");
    }

    /// f32 compute (`--param-dtype f32`) takes the reference attention, which keeps its
    /// `seq x seq` scores: measured on an H200, the 1.2B model at S=2048, micro-batch 1, holds
    /// 62.6 GiB with no layer recomputed, 43.4 with 11 of 22 and 25.4 with all; Llama 2 7B at
    /// S=4096 with all 32 recomputed 123.7 GiB. The estimate that ignored the scores said 24 GiB
    /// for the first, so the planner let micro-batch 4 run out of memory.
    #[test]
    fn memory_estimate_counts_f32_and_the_reference_attention() {
        let b1 = LlamaConfig::preset("1b").unwrap();
        let b7 = LlamaConfig::preset("7b").unwrap();
        let f32_layout = |micro_batch, seq| StepLayout {
            compute: Precision::F32,
            flash_attention: false,
            ..StepLayout::bf16(micro_batch, seq)
        };
        let gib = |c: &LlamaConfig, layout: &StepLayout, recomputed: usize| {
            c.training_memory_estimate(layout, recomputed) as f64 / GIB
        };
        for (model, layout, recomputed, measured) in [
            (&b1, f32_layout(1, 2048), 0, 62.6),
            (&b1, f32_layout(1, 2048), 11, 43.4),
            (&b1, f32_layout(1, 2048), 22, 25.4),
            (&b7, f32_layout(1, 4096), 32, 123.7),
        ] {
            let got = gib(model, &layout, recomputed);
            assert!(
                (got - measured).abs() / measured < 0.10,
                "{} layers, {recomputed} recomputed, S={}: estimate {got:.1} GiB, measured \
                 {measured}",
                model.num_hidden_layers,
                layout.seq_len
            );
        }
        // Micro-batch 4 needs about four times the scores: some layers must recompute, and
        // what the planner keeps fits the budget.
        let h200 = (139.8 * GIB) as u64;
        let four = f32_layout(4, 2048);
        let recomputed = b1.layers_to_recompute(&four, h200);
        assert!(recomputed > 0 && recomputed < 22, "{recomputed}");
        assert!(gib(&b1, &four, recomputed) <= 139.8 * 0.92);
        // The scores are what f32 adds beyond twice the bytes per value: with flash attention
        // the same layout keeps a small fraction of it.
        let flash = StepLayout {
            flash_attention: true,
            ..f32_layout(1, 2048)
        };
        assert!(gib(&b1, &flash, 0) < gib(&b1, &f32_layout(1, 2048), 0) / 2.0);
    }

    /// Accumulating over micro-batches without reducing each keeps the gradient in f32: an
    /// unsharded unit adds into its gradient (bf16 becomes f32, 2 bytes more per parameter), a
    /// sharded one keeps the whole gradient beside its f32 shard (4 bytes per parameter).
    #[test]
    fn accumulation_keeps_f32_gradients() {
        let b7 = LlamaConfig::preset("7b").unwrap();
        let params = b7.num_parameters() as f64;
        let more = |shard_degree| {
            let once = StepLayout {
                shard_degree,
                ..StepLayout::bf16(1, 4096)
            };
            let accumulating = StepLayout {
                accumulates_unreduced: true,
                ..once.clone()
            };
            (b7.training_memory_estimate(&accumulating, 0) - b7.training_memory_estimate(&once, 0))
                as f64
        };
        // Within the rounding of the integer estimate, the allocator's tenth included. Unsharded,
        // the f32 sum is also held beside the activations, where a single micro-batch's bf16
        // gradient takes the place they free: up to 4 bytes per parameter more (the 1.2B model
        // on one H100 measured 4.9 GiB more, 2.4 bytes per parameter).
        assert!(
            more(1) >= params * 2.0 * 1.1 && more(1) <= params * 4.0 * 1.1 + 16.0,
            "{}",
            more(1)
        );
        assert!((more(2) - params * 4.0 * 1.1).abs() < 16.0, "{}", more(2));
    }

    /// AdamW's moments in bf16 take 4 bytes per parameter off the state (25 GiB for Llama 2 7B
    /// on one GPU, the allocator's tenth included), which lets 7B accumulate micro-batches on
    /// one 141 GB GPU at S=4096 without recomputing a layer; with f32 moments it must.
    #[test]
    fn bf16_moments_take_four_bytes_per_parameter() {
        let b7 = LlamaConfig::preset("7b").unwrap();
        let params = b7.num_parameters() as f64;
        let accumulating = StepLayout {
            accumulates_unreduced: true,
            ..StepLayout::bf16(1, 4096)
        };
        let bf16 = StepLayout {
            adamw_moments: MomentDtype::Bf16,
            ..accumulating.clone()
        };
        let saved = (b7.training_memory_estimate(&accumulating, 0)
            - b7.training_memory_estimate(&bf16, 0)) as f64;
        assert!((saved - params * 4.0 * 1.1).abs() < 16.0, "{saved}");
        let h200 = (139.8 * GIB) as u64;
        assert!(b7.layers_to_recompute(&accumulating, h200) > 0);
        assert_eq!(b7.layers_to_recompute(&bf16, h200), 0);
    }

    /// Offloading takes the recomputed layers' inputs off the device but for the horizon's
    /// (Llama 2 7B at S=65,536: 32 inputs of 0.5 GiB against 3), and changes nothing when no
    /// layer recomputes. Not measured on a GPU yet.
    #[test]
    fn offloading_frees_the_recomputed_layers_inputs() {
        let b7 = LlamaConfig::preset("7b").unwrap();
        // Sharded over two GPUs, so that the f32 gradient shard adds to the activations
        // instead of taking the place they free (which would hide part of the saving).
        let gib = |recomputed, horizon| {
            let layout = StepLayout {
                offload_horizon: horizon,
                shard_degree: 2,
                ..StepLayout::bf16(1, 65536)
            };
            b7.training_memory_estimate(&layout, recomputed) as f64 / GIB
        };
        let saved = gib(32, None) - gib(32, Some(2));
        // 29 inputs of 0.5 GiB, plus the estimate's 10 % allocator slack.
        assert!((saved - 29.0 * 0.5 * 1.1).abs() < 0.1, "{saved}");
        assert_eq!(gib(0, None), gib(0, Some(2)));
        assert!(gib(32, Some(40)) == gib(32, None));
    }

    /// Left to the planner, recomputation is selective where that fits and repeats fewer FLOPs:
    /// Llama 2 7B on one H200 recomputes nothing at S=4096, selectively at S=16,384 (attention's
    /// forward there a quarter of a layer's), and fully where selective recomputation of every
    /// layer does not fit; never selectively with the reference attention, whose output it
    /// cannot keep.
    #[test]
    fn recomputation_is_selective_where_it_repeats_less() {
        let b7 = LlamaConfig::preset("7b").unwrap();
        let h200 = (139.8 * GIB) as u64;
        let budget = h200 / 100 * MEMORY_BUDGET_PERCENT;
        let none = Recomputation {
            layers: 0,
            selective: false,
        };
        assert_eq!(b7.recomputation(&StepLayout::bf16(1, 4096), h200), none);
        let at16k = StepLayout::bf16(1, 16384);
        let chosen = b7.recomputation(&at16k, h200);
        let full = b7.layers_to_recompute(&at16k, h200);
        assert!(
            chosen.selective && chosen.layers >= full,
            "{chosen:?}, {full} full"
        );
        let selective = StepLayout {
            selective_recompute: true,
            ..at16k.clone()
        };
        assert!(b7.training_memory_estimate(&selective, chosen.layers) <= budget);
        assert!(
            chosen.layers as f64 * b7.recompute_flops_per_token(16384, true)
                < full as f64 * b7.recompute_flops_per_token(16384, false)
        );
        // At S=32,768 all layers but the last recompute selectively (the last one's graph is
        // held at the backward's start anyway; measured with all 32: 127.8 GiB, 57.6-57.8 % MFU,
        // against 51.7-51.9 % recomputing 30 of 32 fully).
        let at32k = b7.recomputation(&StepLayout::bf16(1, 32768), h200);
        assert_eq!((at32k.layers, at32k.selective), (31, true));
        // At S=65,536 only full recomputation of every layer comes near the budget.
        let long = b7.recomputation(&StepLayout::bf16(1, 65536), h200);
        assert_eq!((long.layers, long.selective), (32, false));
        let reference = StepLayout {
            flash_attention: false,
            ..at16k
        };
        assert!(!b7.recomputation(&reference, h200).selective);
        // The choice ignores what the layout asked for: it is the planner's to make.
        assert_eq!(b7.recomputation(&selective, h200), chosen);
    }

    /// A run that cannot fit even recomputing every layer is refused before it is built, with
    /// the numbers and what would help; one the planner fits, or one just over the device,
    /// passes.
    #[test]
    fn runs_far_over_the_device_are_refused_up_front() {
        let b7 = LlamaConfig::preset("7b").unwrap();
        let b1 = LlamaConfig::preset("1b").unwrap();
        let h100 = (79.1 * GIB) as u64;
        let h200 = (139.8 * GIB) as u64;
        let check = |c: &LlamaConfig, layout: &StepLayout, device: u64| {
            c.check_fits(layout, c.recomputation(layout, device), device)
        };
        let at32k = StepLayout::bf16(1, 32768);
        let err = check(&b7, &at32k, h100).unwrap_err().to_string();
        for part in [
            "GiB per GPU",
            "32 of 32 layers",
            "79 GiB",
            "32768",
            "moments",
        ] {
            assert!(err.contains(part), "{part:?} missing from: {err}");
        }
        check(&b7, &at32k, h200).unwrap();
        check(&b1, &StepLayout::bf16(1, 4096), h100).unwrap();
        // Within the margin the run is left to try: 7B at S=4096 without recomputation on a
        // GPU a tenth smaller than the estimate.
        let at4k = StepLayout::bf16(1, 4096);
        let none = Recomputation {
            layers: 0,
            selective: false,
        };
        let need = b7.training_memory_estimate(&at4k, 0);
        b7.check_fits(&at4k, none, need / 110 * 100).unwrap();
        assert!(b7.check_fits(&at4k, none, need / 120 * 100).is_err());
    }

    /// Selective recomputation keeps each recomputed layer's attention output (Llama 2 7B at
    /// S=32,768: 256 MiB of bf16 plus 4 MiB of f32 statistics per layer), and nothing when no
    /// layer recomputes.
    #[test]
    fn selective_recomputation_keeps_the_attention_outputs() {
        let b7 = LlamaConfig::preset("7b").unwrap();
        // Sharded, so that what is kept adds up (see the offloading test).
        let gib = |recomputed, selective_recompute| {
            let layout = StepLayout {
                selective_recompute,
                shard_degree: 2,
                ..StepLayout::bf16(1, 32768)
            };
            b7.training_memory_estimate(&layout, recomputed) as f64 / GIB
        };
        let kept = gib(32, true) - gib(32, false);
        assert!(
            (kept - 32.0 * (260.0 / 1024.0) * 1.1).abs() < 0.01,
            "{kept}"
        );
        assert_eq!(gib(0, true), gib(0, false));
    }
}
