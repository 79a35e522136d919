//! The Llama 2 architecture in Burn, free of any parallelism.
//!
//! The model is written as the engine's three kinds of *units* — the token embedding, the
//! decoder layers and the head (final norm + LM head + loss) — because that is the granularity
//! at which smp-burn shards, gathers and recomputes, and with smp-burn's tensor-parallel layers,
//! which are their plain counterparts on one rank. Field names mirror Hugging Face's
//! `LlamaForCausalLM`, so a parameter's path in its unit gives its Hugging Face name (see
//! [`hf_name`]), and weights are stored as `[out_features, in_features]` as PyTorch does.

use burn::module::{Initializer, Module, Param};
use burn::tensor::{Int, Tensor, backend::Backend};
use smp_burn::engine::{BlockUnit, Cx, HeadUnit, StemUnit, UnitId};
use smp_burn::init::InitRule;
use smp_burn::ops;
use smp_burn::tp::layers::{ParallelLinearConfig, VocabParallelEmbeddingConfig};
use smp_burn::tp::{
    ColumnParallelLinear, RowParallelLinear, TpGroup, VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
};
use smp_burn::{Documents, Loss, SmpError};

use crate::config::LlamaConfig;

/// A bias-free linear layer split over its output features (rows of the `[out, in]` weight).
fn column<B: Backend>(
    d_in: usize,
    d_out: usize,
    tp: &TpGroup,
    device: &B::Device,
) -> Result<ColumnParallelLinear<B>, SmpError> {
    ParallelLinearConfig::new(d_in, d_out)
        .with_bias(false)
        .with_initializer(Initializer::Zeros)
        .init_column(tp, device)
}

/// A bias-free linear layer split over its input features (columns of the weight).
fn row<B: Backend>(
    d_in: usize,
    d_out: usize,
    tp: &TpGroup,
    device: &B::Device,
) -> Result<RowParallelLinear<B>, SmpError> {
    ParallelLinearConfig::new(d_in, d_out)
        .with_bias(false)
        .with_initializer(Initializer::Zeros)
        .init_row(tp, device)
}

/// Root-mean-square normalization with a learned scale.
#[derive(Module, Debug)]
pub struct RmsNorm<B: Backend> {
    /// Per-channel scale, `[hidden]`.
    pub weight: Param<Tensor<B, 1>>,
    /// Added to the mean square.
    pub eps: f64,
}

impl<B: Backend> RmsNorm<B> {
    fn lazy(hidden: usize, eps: f64, device: &B::Device) -> Self {
        Self {
            weight: Initializer::Ones.init([hidden], device),
            eps,
        }
    }

    /// Normalizes the last dimension.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        ops::rms_norm(x, self.weight.val(), self.eps)
    }
}

/// The token embedding; the first unit of the model. It also makes the rotary tables every
/// layer shares.
#[derive(Module, Debug)]
pub struct Embedding<B: Backend> {
    /// The `[vocab, hidden]` table, split over the vocabulary under tensor parallelism.
    pub embed_tokens: VocabParallelEmbedding<B>,
    /// Width of one attention head (for the rotary tables).
    pub head_dim: usize,
    /// Base of the rotary frequencies.
    pub rope_theta: f64,
}

/// Rotary tables `(cos, sin)`, each `[seq, head_dim]`.
pub type RopeTables<B> = (Tensor<B, 2>, Tensor<B, 2>);

impl<B: Backend> StemUnit<B> for Embedding<B> {
    type Aux = RopeTables<B>;

    /// Built once per sequence length on the host (about 20 ms at S=4096, a sixth of a 1.2B
    /// model's step on an H200 if it were done per micro-batch).
    fn aux(&self, cx: &Cx, device: &B::Device) -> RopeTables<B> {
        ops::rope_tables(cx.seq_len(), self.head_dim, self.rope_theta, device)
    }

    fn forward(&self, tokens: Tensor<B, 2, Int>, _: &Cx) -> Tensor<B, 3> {
        self.embed_tokens.forward(tokens)
    }
}

/// Multi-head attention with grouped-query key/value heads and rotary position embeddings;
/// under tensor parallelism each rank holds `heads / tp` query and `kv_heads / tp` key/value
/// heads.
#[derive(Module, Debug)]
pub struct Attention<B: Backend> {
    /// Query projection (column-parallel).
    pub q_proj: ColumnParallelLinear<B>,
    /// Key projection (`kv_heads * head_dim` outputs, column-parallel).
    pub k_proj: ColumnParallelLinear<B>,
    /// Value projection (`kv_heads * head_dim` outputs, column-parallel).
    pub v_proj: ColumnParallelLinear<B>,
    /// Output projection (row-parallel).
    pub o_proj: RowParallelLinear<B>,
    /// Query heads on this rank.
    pub num_heads: usize,
    /// Key/value heads on this rank.
    pub num_kv_heads: usize,
}

impl<B: Backend> Attention<B> {
    /// `x`: the gathered `[batch, seq, hidden]`; `cos`/`sin`: rotary tables `[seq, head_dim]`;
    /// `documents`: the packing of the rows, if any (attention and positions then stay inside
    /// each document). Returns this rank's reduced output (see [`RowParallelLinear::forward`]).
    pub fn forward(
        &self,
        x: &smp_burn::tp::Gathered<B>,
        cos: Tensor<B, 2>,
        sin: Tensor<B, 2>,
        documents: Option<&Documents>,
    ) -> Tensor<B, 3> {
        let [batch, seq, _] = x.dims();
        let q = self.q_proj.forward(x);
        let width = q.dims()[2];
        let head_dim = width / self.num_heads;
        let heads =
            |t: Tensor<B, 3>, n: usize| t.reshape([batch, seq, n, head_dim]).swap_dims(1, 2);
        let q = heads(q, self.num_heads);
        let k = heads(self.k_proj.forward(x), self.num_kv_heads);
        let v = heads(self.v_proj.forward(x), self.num_kv_heads);
        let out = match documents {
            Some(documents) => {
                let [q, k] = ops::rope_in_documents([q, k], cos, sin, documents);
                ops::causal_attention_in_documents(q, k, v, documents)
            }
            None => {
                let q = ops::rope(q, cos.clone(), sin.clone());
                let k = ops::rope(k, cos, sin);
                ops::causal_attention(q, k, v)
            }
        };
        let out = out.swap_dims(1, 2).reshape([batch, seq, width]);
        self.o_proj.forward(out)
    }
}

/// The SwiGLU feed-forward block.
#[derive(Module, Debug)]
pub struct Mlp<B: Backend> {
    /// Gate projection (through SiLU; column-parallel).
    pub gate_proj: ColumnParallelLinear<B>,
    /// Up projection (column-parallel).
    pub up_proj: ColumnParallelLinear<B>,
    /// Down projection (row-parallel).
    pub down_proj: RowParallelLinear<B>,
}

impl<B: Backend> Mlp<B> {
    /// `down(silu(gate(x)) * up(x))`.
    pub fn forward(&self, x: &smp_burn::tp::Gathered<B>) -> Tensor<B, 3> {
        let gated = ops::swiglu(self.gate_proj.forward(x), self.up_proj.forward(x));
        self.down_proj.forward(gated)
    }
}

/// One transformer block: pre-norm attention and pre-norm MLP, each with a residual.
#[derive(Module, Debug)]
pub struct DecoderLayer<B: Backend> {
    /// Attention.
    pub self_attn: Attention<B>,
    /// Feed-forward.
    pub mlp: Mlp<B>,
    /// Norm before attention.
    pub input_layernorm: RmsNorm<B>,
    /// Norm before the MLP.
    pub post_attention_layernorm: RmsNorm<B>,
    tp: TpGroup,
}

impl<B: Backend> BlockUnit<B> for DecoderLayer<B> {
    type Aux = RopeTables<B>;

    /// `x`: this rank's residual stream (its chunk of the sequence with sequence
    /// parallelism); each norm runs on it, then the split region's input is gathered.
    fn forward(&self, x: Tensor<B, 3>, (cos, sin): &RopeTables<B>, cx: &Cx) -> Tensor<B, 3> {
        let attn_in = self.tp.enter(self.input_layernorm.forward(x.clone()));
        let h = x + self
            .self_attn
            .forward(&attn_in, cos.clone(), sin.clone(), cx.documents());
        let mlp_in = self
            .tp
            .enter(self.post_attention_layernorm.forward(h.clone()));
        h + self.mlp.forward(&mlp_in)
    }
}

/// The last unit: final norm, LM head (split over the vocabulary under tensor parallelism),
/// and the loss.
#[derive(Module, Debug)]
pub struct LmHead<B: Backend> {
    /// Final RMSNorm (`model.norm` in Hugging Face's names).
    pub norm: RmsNorm<B>,
    /// Projection to the vocabulary (`lm_head`).
    pub lm_head: ColumnParallelLinear<B>,
    tp: TpGroup,
}

impl<B: Backend> HeadUnit<B> for LmHead<B> {
    /// Mean next-token cross-entropy through [`vocab_parallel_cross_entropy`]: on one rank the
    /// fused chunked LM-head loss (no `[tokens, vocab]` f32 logits), split over the vocabulary
    /// on several.
    fn loss(&self, x: Tensor<B, 3>, targets: Tensor<B, 2, Int>, _: &Cx) -> Loss<B> {
        let x = self.tp.enter(self.norm.forward(x));
        vocab_parallel_cross_entropy(&x, self.lm_head.weight.val(), targets)
    }

    fn logits(&self, x: Tensor<B, 3>, _: &Cx) -> Tensor<B, 3> {
        let x = self.tp.enter(self.norm.forward(x));
        self.lm_head.forward_gathered(&x)
    }
}

/// The model as the engine's units, each layer holding this rank's slices for `tp`, lazily
/// (nothing is allocated here). Llama's tensor-parallel plan is in the layer types: q/k/v and
/// gate/up column-parallel, o and down row-parallel, the embedding and the LM head split over
/// the vocabulary, norms replicated.
///
/// # Errors
/// A shape that is invalid or that the degree does not split (the message names the values).
pub fn units<B: Backend>(
    config: &LlamaConfig,
    tp: &TpGroup,
    device: &B::Device,
) -> crate::error::Result<LlamaUnits<B>> {
    config.validate()?;
    config.validate_tensor_parallel(tp.degree())?;
    if config.tie_word_embeddings {
        return Err(crate::LlamaError::Config(
            "tie_word_embeddings = true is not supported by the Llama trainer (Llama 2 does not \
             tie them)"
                .into(),
        ));
    }
    let (h, i, v) = (
        config.hidden_size,
        config.intermediate_size,
        config.vocab_size,
    );
    let kv = config.num_key_value_heads * config.head_dim();
    let stem = Embedding {
        embed_tokens: VocabParallelEmbeddingConfig::new(v, h)
            .with_initializer(Initializer::Zeros)
            .init(tp, device)?,
        head_dim: config.head_dim(),
        rope_theta: config.rope_theta,
    };
    let mut blocks = Vec::with_capacity(config.num_hidden_layers);
    for _ in 0..config.num_hidden_layers {
        blocks.push(DecoderLayer {
            self_attn: Attention {
                q_proj: column(h, h, tp, device)?,
                k_proj: column(h, kv, tp, device)?,
                v_proj: column(h, kv, tp, device)?,
                o_proj: row(h, h, tp, device)?,
                num_heads: config.num_attention_heads / tp.degree(),
                num_kv_heads: config.num_key_value_heads / tp.degree(),
            },
            mlp: Mlp {
                gate_proj: column(h, i, tp, device)?,
                up_proj: column(h, i, tp, device)?,
                down_proj: row(i, h, tp, device)?,
            },
            input_layernorm: RmsNorm::lazy(h, config.rms_norm_eps, device),
            post_attention_layernorm: RmsNorm::lazy(h, config.rms_norm_eps, device),
            tp: tp.clone(),
        });
    }
    let head = LmHead {
        norm: RmsNorm::lazy(h, config.rms_norm_eps, device),
        lm_head: column(h, v, tp, device)?,
        tp: tp.clone(),
    };
    Ok(smp_burn::engine::Units { stem, blocks, head })
}

/// Llama's units.
pub type LlamaUnits<B> = smp_burn::engine::Units<Embedding<B>, DecoderLayer<B>, LmHead<B>>;

/// Hugging Face's name of the parameter at `path` inside a unit: the engine's names for Llama,
/// so that seeds, checkpoints and exports all speak Hugging Face's names.
pub fn hf_name(unit: UnitId, path: &str) -> String {
    match unit {
        UnitId::Stem => format!("model.{path}"),
        UnitId::Block(i) => format!("model.layers.{i}.{path}"),
        UnitId::Head => match path.strip_prefix("norm.") {
            Some(rest) => format!("model.norm.{rest}"),
            None => path.to_string(),
        },
    }
}

/// Llama's initialization: normal(0, 0.02) for matrices, ones for norm weights.
pub fn init_rule(shape: &[usize]) -> InitRule {
    if shape.len() >= 2 {
        InitRule::Normal { std: 0.02 }
    } else {
        InitRule::Constant(1.0)
    }
}

/// Every parameter of a model of this shape as (Hugging Face name, shape), without allocating.
pub fn parameter_shapes(config: &LlamaConfig) -> Vec<(String, Vec<usize>)> {
    let (h, kv, i, v) = (
        config.hidden_size,
        config.num_key_value_heads * config.head_dim(),
        config.intermediate_size,
        config.vocab_size,
    );
    let mut out = vec![("model.embed_tokens.weight".to_string(), vec![v, h])];
    for l in 0..config.num_hidden_layers {
        let p = |s: &str| format!("model.layers.{l}.{s}");
        out.extend([
            (p("self_attn.q_proj.weight"), vec![h, h]),
            (p("self_attn.k_proj.weight"), vec![kv, h]),
            (p("self_attn.v_proj.weight"), vec![kv, h]),
            (p("self_attn.o_proj.weight"), vec![h, h]),
            (p("mlp.gate_proj.weight"), vec![i, h]),
            (p("mlp.up_proj.weight"), vec![i, h]),
            (p("mlp.down_proj.weight"), vec![h, i]),
            (p("input_layernorm.weight"), vec![h]),
            (p("post_attention_layernorm.weight"), vec![h]),
        ]);
    }
    out.push(("model.norm.weight".to_string(), vec![h]));
    out.push(("lm_head.weight".to_string(), vec![v, h]));
    out
}
