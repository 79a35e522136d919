//! The Llama 2 architecture in Burn, free of any parallelism.
//!
//! The model is written as three kinds of *units* — the token embedding, the decoder layers and
//! the head (final norm + LM head + loss) — because that is the granularity at which the
//! parallel layer shards, gathers and recomputes. Struct and field names mirror Hugging Face's
//! `LlamaForCausalLM`, so a parameter's Burn path is its Hugging Face name (see
//! [`hf_name`]) and weights are stored as `[out_features, in_features]` as PyTorch does.

use burn::module::{Initializer, Module, Param};
use burn::tensor::{Int, Tensor, backend::Backend};
use smp_burn::init::InitRule;
use smp_burn::ops;

use crate::config::LlamaConfig;
use crate::error::Result;

/// A bias-free linear layer with PyTorch's weight layout.
#[derive(Module, Debug)]
pub struct Linear<B: Backend> {
    /// `[out_features, in_features]`.
    pub weight: Param<Tensor<B, 2>>,
}

impl<B: Backend> Linear<B> {
    fn lazy(out_features: usize, in_features: usize, device: &B::Device) -> Self {
        Self {
            weight: Initializer::Zeros.init([out_features, in_features], device),
        }
    }

    /// `x @ weight^T`.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        ops::linear(x, self.weight.val())
    }
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

/// Token embedding table; the first unit of the model.
#[derive(Module, Debug)]
pub struct Embedding<B: Backend> {
    /// `[vocab, hidden]`.
    pub weight: Param<Tensor<B, 2>>,
}

impl<B: Backend> Embedding<B> {
    /// A template whose parameters are lazy (nothing is allocated until they are set).
    pub fn template(config: &LlamaConfig, device: &B::Device) -> Self {
        Self {
            weight: Initializer::Zeros.init([config.vocab_size, config.hidden_size], device),
        }
    }

    /// `[batch, seq]` token ids to `[batch, seq, hidden]`.
    pub fn forward(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        ops::embedding(self.weight.val(), tokens)
    }
}

/// Multi-head attention with grouped-query key/value heads and rotary position embeddings.
#[derive(Module, Debug)]
pub struct Attention<B: Backend> {
    /// Query projection.
    pub q_proj: Linear<B>,
    /// Key projection (`kv_heads * head_dim` outputs).
    pub k_proj: Linear<B>,
    /// Value projection (`kv_heads * head_dim` outputs).
    pub v_proj: Linear<B>,
    /// Output projection.
    pub o_proj: Linear<B>,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads.
    pub num_kv_heads: usize,
}

impl<B: Backend> Attention<B> {
    /// `x: [batch, seq, hidden]`; `cos`/`sin`: rotary tables `[seq, head_dim]`.
    ///
    /// The head width is taken from the query projection (`q_proj` outputs / `num_heads`), not
    /// from `hidden`: on a tensor-parallel rank the projections hold only this rank's heads, so
    /// the attention output is `num_heads * head_dim` wide, a slice of `hidden`, and `o_proj`
    /// (row-parallel) maps it back to a partial sum of the full width.
    pub fn forward(&self, x: Tensor<B, 3>, cos: Tensor<B, 2>, sin: Tensor<B, 2>) -> Tensor<B, 3> {
        let [batch, seq, _] = x.dims();
        let q = self.q_proj.forward(x.clone());
        let width = q.dims()[2];
        let head_dim = width / self.num_heads;
        let heads =
            |t: Tensor<B, 3>, n: usize| t.reshape([batch, seq, n, head_dim]).swap_dims(1, 2);
        let q = heads(q, self.num_heads);
        let k = heads(self.k_proj.forward(x.clone()), self.num_kv_heads);
        let v = heads(self.v_proj.forward(x), self.num_kv_heads);
        let q = ops::rope(q, cos.clone(), sin.clone());
        let k = ops::rope(k, cos, sin);
        let out = ops::causal_attention(q, k, v)
            .swap_dims(1, 2)
            .reshape([batch, seq, width]);
        self.o_proj.forward(out)
    }
}

/// The SwiGLU feed-forward block.
#[derive(Module, Debug)]
pub struct Mlp<B: Backend> {
    /// Gate projection (through SiLU).
    pub gate_proj: Linear<B>,
    /// Up projection.
    pub up_proj: Linear<B>,
    /// Down projection.
    pub down_proj: Linear<B>,
}

impl<B: Backend> Mlp<B> {
    /// `down(silu(gate(x)) * up(x))`.
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let gated = ops::swiglu(self.gate_proj.forward(x.clone()), self.up_proj.forward(x));
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
}

impl<B: Backend> DecoderLayer<B> {
    /// A template whose parameters are lazy.
    pub fn template(config: &LlamaConfig, device: &B::Device) -> Self {
        let (h, kv) = (
            config.hidden_size,
            config.num_key_value_heads * config.head_dim(),
        );
        let i = config.intermediate_size;
        Self {
            self_attn: Attention {
                q_proj: Linear::lazy(h, h, device),
                k_proj: Linear::lazy(kv, h, device),
                v_proj: Linear::lazy(kv, h, device),
                o_proj: Linear::lazy(h, h, device),
                num_heads: config.num_attention_heads,
                num_kv_heads: config.num_key_value_heads,
            },
            mlp: Mlp {
                gate_proj: Linear::lazy(i, h, device),
                up_proj: Linear::lazy(i, h, device),
                down_proj: Linear::lazy(h, i, device),
            },
            input_layernorm: RmsNorm::lazy(h, config.rms_norm_eps, device),
            post_attention_layernorm: RmsNorm::lazy(h, config.rms_norm_eps, device),
        }
    }

    /// `[batch, seq, hidden]` to the same shape.
    pub fn forward(&self, x: Tensor<B, 3>, cos: Tensor<B, 2>, sin: Tensor<B, 2>) -> Tensor<B, 3> {
        self.forward_split(x, cos, sin, &Unsplit)
            .expect("the unsplit layer runs no collective, so it cannot fail")
    }

    /// The layer with the entry and exit of each split region left to `sp`: `sp.enter` before
    /// the attention and the MLP (after their norms), `sp.exit` after them (before the
    /// residual add). With [`Unsplit`] this is [`Self::forward`]; with sequence parallelism
    /// (`llama::parallel`) `x` is this rank's `[batch, seq / tp, hidden]` chunk, `enter`
    /// gathers the sequence for the column-parallel projections and `exit` reduce-scatters the
    /// row-parallel projections' partial sums back to the chunk. `cos`/`sin` cover the full
    /// sequence, since rotary embeddings are applied after `enter`.
    pub fn forward_split(
        &self,
        x: Tensor<B, 3>,
        cos: Tensor<B, 2>,
        sin: Tensor<B, 2>,
        sp: &dyn SplitRegions<B>,
    ) -> Result<Tensor<B, 3>> {
        let attn_in = sp.enter(self.input_layernorm.forward(x.clone()))?;
        let h = x + sp.exit(self.self_attn.forward(attn_in, cos, sin))?;
        let mlp_in = sp.enter(self.post_attention_layernorm.forward(h.clone()))?;
        Ok(h.clone() + sp.exit(self.mlp.forward(mlp_in))?)
    }
}

/// Where a decoder layer's split regions (attention and MLP, between their norm and the
/// residual add) begin and end. The model stays free of collectives: the parallel layer
/// supplies an implementation that runs them (`llama::parallel`), [`Unsplit`] runs none.
pub trait SplitRegions<B: Backend> {
    /// Before the column-parallel projections: the norm's output to the region's input.
    fn enter(&self, x: Tensor<B, 3>) -> Result<Tensor<B, 3>>;
    /// After the row-parallel projection: the region's output to what the residual adds.
    fn exit(&self, x: Tensor<B, 3>) -> Result<Tensor<B, 3>>;
}

/// No split: both region boundaries are the identity.
#[derive(Debug, Clone, Copy, Default)]
pub struct Unsplit;

impl<B: Backend> SplitRegions<B> for Unsplit {
    fn enter(&self, x: Tensor<B, 3>) -> Result<Tensor<B, 3>> {
        Ok(x)
    }
    fn exit(&self, x: Tensor<B, 3>) -> Result<Tensor<B, 3>> {
        Ok(x)
    }
}

/// The last unit: final norm, LM head, and the loss.
#[derive(Module, Debug)]
pub struct LmHead<B: Backend> {
    /// Final RMSNorm (`model.norm` in Hugging Face's names).
    pub norm: RmsNorm<B>,
    /// Projection to the vocabulary (`lm_head`).
    pub lm_head: Linear<B>,
}

impl<B: Backend> LmHead<B> {
    /// A template whose parameters are lazy.
    pub fn template(config: &LlamaConfig, device: &B::Device) -> Self {
        Self {
            norm: RmsNorm::lazy(config.hidden_size, config.rms_norm_eps, device),
            lm_head: Linear::lazy(config.vocab_size, config.hidden_size, device),
        }
    }

    /// `[batch, seq, hidden]` to logits `[batch, seq, vocab]`.
    pub fn logits(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        self.lm_head.forward(self.norm.forward(x))
    }

    /// Mean next-token cross-entropy against `targets: [batch, seq]`, through
    /// `ops::linear_cross_entropy`: where the backend allows, the LM head and the loss run in
    /// token chunks, so the `[batch * seq, vocab]` logits are never all held in f32.
    pub fn loss(&self, x: Tensor<B, 3>, targets: Tensor<B, 2, Int>) -> Tensor<B, 1> {
        let [batch, seq, hidden] = x.dims();
        ops::linear_cross_entropy(
            self.norm.forward(x).reshape([batch * seq, hidden]),
            self.lm_head.weight.val(),
            targets.reshape([batch * seq]),
        )
    }
}

/// Which unit a parameter belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnitKind {
    /// The token embedding.
    Embedding,
    /// Decoder layer `i`.
    Layer(usize),
    /// Final norm and LM head.
    Head,
}

/// Hugging Face's name of the parameter at `path` inside a unit.
pub fn hf_name(unit: UnitKind, path: &str) -> String {
    match unit {
        UnitKind::Embedding => format!("model.embed_tokens.{path}"),
        UnitKind::Layer(i) => format!("model.layers.{i}.{path}"),
        UnitKind::Head => match path.strip_prefix("norm.") {
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
