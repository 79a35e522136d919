//! Model shapes: Llama 2 presets and any shape read from a Hugging Face `config.json`.

use serde::{Deserialize, Serialize};

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

    /// Bytes one GPU needs to train this shape with smp-burn's CUDA path (bf16 compute, fp32
    /// master weights, AdamW moments and gradient shards), `tokens` per micro-batch per
    /// tensor-parallel group, parameters sharded over `shard_degree x tp` ranks, the first
    /// `recomputed_layers` decoder layers checkpointed (0: none; the number of layers or more:
    /// all), their inputs offloaded to host memory when `offload_horizon` is `Some(horizon)`
    /// (then only `horizon + 1` of them are on the device at once: the ones brought back ahead
    /// of the backward and the one whose copy is in flight in the forward).
    ///
    /// A rough model, calibrated on an H200 at S=4096 (the memory in use as the step log reports
    /// it): Llama 2 7B on one GPU measured 112.6 GiB with every layer recomputed and 122.1 GiB
    /// with none (this gives 115.4 and 125.4); the 1.2B preset 27.0 GiB with none (25.4); 7B on
    /// two GPUs 87.6 GiB with none (77.0: f32 gradients, NCCL buffers and the prefetched unit
    /// are counted only roughly). Its use is to decide how many layers to recompute
    /// ([`Self::layers_to_recompute`]), not to predict the last gigabyte.
    pub fn training_memory_estimate(
        &self,
        tokens: usize,
        shard_degree: usize,
        tp: usize,
        recomputed_layers: usize,
        offload_horizon: Option<usize>,
    ) -> u64 {
        let (h, i) = (self.hidden_size as u64, self.intermediate_size as u64);
        let tokens = tokens as u64;
        let ranks = (shard_degree.max(1) * tp.max(1)) as u64;
        // Master weights and two moments (f32), the gradient shard (f32 where it is reduced,
        // bf16 where a unit has nothing to reduce) and the bf16 weight copy AdamW writes for the
        // next gather.
        let grad_bytes = if shard_degree <= 1 { 2 } else { 4 };
        let state = self.num_parameters() as u64 * (12 + grad_bytes + 2) / ranks;
        // The largest unit (a layer, or the embedding / head, both split over the vocabulary
        // with tensor parallelism) gathered in bf16 with its bf16 gradients and their f32 flat
        // buffer while it runs.
        let largest_unit = (self.block_parameters() as u64 / tp.max(1) as u64)
            .max((self.vocab_size * self.hidden_size / tp.max(1)) as u64);
        let transient = largest_unit * 12;
        // bf16 tensors a layer keeps for its backward: the inputs of its linears, q/k/v and the
        // attention output, the norms' inputs, the MLP's gate/up outputs, split along the
        // sequence with tensor parallelism. Counting every one gives about 10 h + 4 i values per
        // token; the pool measured half of that (7B: 0.3 GiB per layer at 4,096 tokens; several
        // of those tensors are views of one buffer or freed early), so 5 h + 2 i. With tensor
        // parallelism the inputs of q/k/v and of gate/up are the sequence gathered from every
        // rank, `h` values per token of the full sequence each (7B, tp 2, S=32,768 measured
        // 129.5 GiB with no layer recomputed).
        let tp = tp.max(1) as u64;
        let gathered = if tp > 1 { 2 * h } else { 0 };
        let layer_acts = tokens * ((5 * h + 2 * i) / tp + gathered) * 2;
        let layers = self.num_hidden_layers as u64;
        let recomputed = (recomputed_layers as u64).min(layers);
        // A recomputed layer keeps its input. The peak is at the end of the forward (every kept
        // layer's graph) or, when all are recomputed, in the backward (one layer's graph); the
        // kept layers are the last ones, so their graphs are gone before any recomputation.
        let kept_inputs = match offload_horizon {
            Some(horizon) => recomputed.min(horizon as u64 + 1),
            None => recomputed,
        };
        let acts = kept_inputs * tokens * h * 2 / tp + (layers - recomputed).max(1) * layer_acts;
        // Allocator slack and the CUDA context.
        (state + transient + acts) * 11 / 10 + (1 << 30)
    }

    /// How many decoder layers to recompute (activation checkpointing, first layers first) so
    /// that training fits `device_bytes` of GPU memory: the fewest whose estimate
    /// ([`Self::training_memory_estimate`]) stays within [`MEMORY_BUDGET_PERCENT`] of it, or all
    /// when even that does not fit. Recomputing a layer costs a third more of its compute, so
    /// every layer that fits keeps its activations.
    pub fn layers_to_recompute(
        &self,
        tokens: usize,
        shard_degree: usize,
        tp: usize,
        offload_horizon: Option<usize>,
        device_bytes: u64,
    ) -> usize {
        let budget = device_bytes / 100 * MEMORY_BUDGET_PERCENT;
        (0..=self.num_hidden_layers)
            .find(|&n| {
                self.training_memory_estimate(tokens, shard_degree, tp, n, offload_horizon)
                    <= budget
            })
            .unwrap_or(self.num_hidden_layers)
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
/// already adds a tenth for the allocator; 7B on one H200 ran at 87 % of it (122.1 of
/// 139.8 GiB) with no layer recomputed.
pub const MEMORY_BUDGET_PERCENT: u64 = 92;

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
        let gib = |c: &LlamaConfig, shard, recomputed: usize| {
            c.training_memory_estimate(4096, shard, 1, recomputed, None) as f64 / GIB
        };
        let near = |got: f64, measured: f64| (got - measured).abs() / measured < 0.15;
        assert!(near(gib(&b1, 1, 0), 27.0), "{}", gib(&b1, 1, 0));
        assert!(near(gib(&b7, 1, 32), 112.6), "{}", gib(&b7, 1, 32));
        assert!(near(gib(&b7, 1, 0), 122.1), "{}", gib(&b7, 1, 0));
        assert!(near(gib(&b7, 1, 8), 120.2), "{}", gib(&b7, 1, 8));
        assert!(near(gib(&b7, 1, 16), 118.4), "{}", gib(&b7, 1, 16));
        // Two ranks keep f32 gradients for the reduce-scatter (measured: 87.6 GiB).
        assert!(near(gib(&b7, 2, 0), 87.6), "{}", gib(&b7, 2, 0));
        // Fewer recomputed layers never need less memory (up to the last one: recomputing every
        // layer saves nothing over keeping the last one's graph, whose backward comes first).
        for n in 0..31 {
            assert!(gib(&b7, 1, n) >= gib(&b7, 1, n + 1), "{n}");
        }
        let h200 = (139.8 * GIB) as u64;
        assert_eq!(b1.layers_to_recompute(4096, 1, 1, None, h200), 0);
        assert_eq!(b7.layers_to_recompute(4096, 1, 1, None, h200), 0);
        let long = b7.layers_to_recompute(8192, 1, 1, None, h200);
        assert!(
            long > 0 && long < 32,
            "7B at S=8192 recomputes {long} layers"
        );
        assert_eq!(b7.layers_to_recompute(65536, 1, 1, None, h200), 32);
        // Sharding and tensor parallelism divide the state.
        assert!(gib(&b7, 2, 0) < gib(&b7, 1, 0) - 40.0);
        let tp2 = b7.training_memory_estimate(4096, 1, 2, 0, None) as f64 / GIB;
        assert!(tp2 < gib(&b7, 1, 0) - 40.0);
        // Tensor parallelism 2 at S=32,768 (measured): 73.7 GiB with every layer
        // recomputed, 129.5 GiB with none, which the automatic choice (none) kept.
        let tp_long = |n| b7.training_memory_estimate(32768, 1, 2, n, None) as f64 / GIB;
        assert!(near(tp_long(32), 73.7), "{}", tp_long(32));
        assert!(near(tp_long(0), 129.5), "{}", tp_long(0));
        assert_eq!(b7.layers_to_recompute(32768, 1, 2, None, h200), 0);
    }

    /// Offloading takes the recomputed layers' inputs off the device but for the horizon's
    /// (Llama 2 7B at S=65,536: 32 inputs of 0.5 GiB against 3), and changes nothing when no
    /// layer recomputes. Not measured on a GPU yet.
    #[test]
    fn offloading_frees_the_recomputed_layers_inputs() {
        let b7 = LlamaConfig::preset("7b").unwrap();
        let gib = |recomputed, horizon| {
            b7.training_memory_estimate(65536, 1, 1, recomputed, horizon) as f64 / GIB
        };
        let saved = gib(32, None) - gib(32, Some(2));
        // 29 inputs of 0.5 GiB, plus the estimate's 10 % allocator slack.
        assert!((saved - 29.0 * 0.5 * 1.1).abs() < 0.1, "{saved}");
        assert_eq!(gib(0, None), gib(0, Some(2)));
        assert!(gib(32, Some(40)) == gib(32, None));
    }
}
