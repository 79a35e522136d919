//! A GPT-2 style model written for smp-burn as any Burn user would: LayerNorm with bias, GELU
//! MLP, learned positions and (by default) tied embeddings, with smp-burn's tensor-parallel
//! layers where a layer can be split. Nothing here is shared with the Llama crate.
//!
//! The attention projection `c_attn` is column-parallel with its outputs ordered head by head
//! (`[q, k, v]` of head 0, then of head 1, ...: Megatron's layout), so that each rank's slice
//! holds the whole query, key and value of its own heads.

use burn::module::{Module, Param};
use burn::nn::{Embedding, EmbeddingConfig, LayerNorm, LayerNormConfig};
use burn::tensor::activation::gelu;
use burn::tensor::{Int, Tensor, backend::Backend};
use smp_burn::engine::{BlockUnit, Cx, HeadUnit, StemUnit, Units};
use smp_burn::tp::layers::{ParallelLinearConfig, VocabParallelEmbeddingConfig};
use smp_burn::tp::{
    ColumnParallelLinear, RowParallelLinear, TpGroup, VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
};
use smp_burn::{Loss, SmpError, ops};

/// The shape of a GPT.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GptConfig {
    /// Vocabulary size.
    pub vocab: usize,
    /// Longest sequence (learned positions).
    pub max_seq: usize,
    /// Blocks.
    pub layers: usize,
    /// Attention heads.
    pub heads: usize,
    /// Width of the residual stream.
    pub d_model: usize,
    /// Whether the LM head reuses the token embedding.
    pub tie_embeddings: bool,
}

impl GptConfig {
    /// Parameters of the model (tied embeddings counted once).
    pub fn num_parameters(&self) -> usize {
        let d = self.d_model;
        let block =
            2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d);
        let head = 2 * d
            + if self.tie_embeddings {
                0
            } else {
                self.vocab * d
            };
        self.vocab * d + self.max_seq * d + self.layers * block + head
    }
}

/// Token and position embeddings.
#[derive(Module, Debug)]
pub struct Stem<B: Backend> {
    /// Token embedding, split over the vocabulary under tensor parallelism.
    pub wte: VocabParallelEmbedding<B>,
    /// Learned positions (replicated).
    pub wpe: Embedding<B>,
}

impl<B: Backend> StemUnit<B> for Stem<B> {
    type Aux = ();

    fn aux(&self, _: &Cx, _: &B::Device) {}

    fn forward(&self, tokens: Tensor<B, 2, Int>, cx: &Cx) -> Tensor<B, 3> {
        let positions = cx.positions::<B>(&tokens.device());
        self.wte.forward(tokens) + self.wpe.forward(positions)
    }
}

/// A pre-norm transformer block.
#[derive(Module, Debug)]
pub struct Block<B: Backend> {
    /// Norm before attention.
    pub ln_1: LayerNorm<B>,
    /// Fused query, key and value projection (column-parallel, head-major).
    pub c_attn: ColumnParallelLinear<B>,
    /// Attention output projection (row-parallel).
    pub c_proj: RowParallelLinear<B>,
    /// Norm before the MLP.
    pub ln_2: LayerNorm<B>,
    /// MLP up projection (column-parallel).
    pub c_fc: ColumnParallelLinear<B>,
    /// MLP down projection (row-parallel).
    pub mlp_proj: RowParallelLinear<B>,
    /// Attention heads on this rank.
    pub heads: usize,
    tp: TpGroup,
}

impl<B: Backend> BlockUnit<B> for Block<B> {
    type Aux = ();

    fn forward(&self, x: Tensor<B, 3>, _: &(), _: &Cx) -> Tensor<B, 3> {
        let a = self.tp.enter(self.ln_1.forward(x.clone()));
        let [batch, seq, _] = a.dims();
        let qkv = self.c_attn.forward(&a);
        let head_dim = qkv.dims()[2] / (3 * self.heads);
        let qkv = qkv.reshape([batch, seq, self.heads, 3, head_dim]);
        let part = |i: usize| {
            qkv.clone()
                .narrow(3, i, 1)
                .reshape([batch, seq, self.heads, head_dim])
                .swap_dims(1, 2)
        };
        let attn = ops::causal_attention(part(0), part(1), part(2))
            .swap_dims(1, 2)
            .reshape([batch, seq, self.heads * head_dim]);
        let h = x + self.c_proj.forward(attn);
        let m = self.tp.enter(self.ln_2.forward(h.clone()));
        h + self.mlp_proj.forward(gelu(self.c_fc.forward(&m)))
    }
}

/// The final norm and the LM head (the token embedding when tied).
#[derive(Module, Debug)]
pub struct Head<B: Backend> {
    /// Final norm.
    pub ln_f: LayerNorm<B>,
    /// The tied token embedding's rows on this rank (the stem's `wte.weight`).
    pub wte: Option<Param<Tensor<B, 2>>>,
    /// An LM head of its own when embeddings are not tied.
    pub lm_head: Option<ColumnParallelLinear<B>>,
    tp: TpGroup,
}

impl<B: Backend> Head<B> {
    fn weight(&self) -> Tensor<B, 2> {
        match (&self.wte, &self.lm_head) {
            (Some(w), _) => w.val(),
            (None, Some(l)) => l.weight.val(),
            (None, None) => unreachable!("built with one of them"),
        }
    }
}

impl<B: Backend> HeadUnit<B> for Head<B> {
    fn loss(&self, x: Tensor<B, 3>, targets: Tensor<B, 2, Int>, _: &Cx) -> Loss<B> {
        let x = self.tp.enter(self.ln_f.forward(x));
        vocab_parallel_cross_entropy(&x, self.weight(), targets)
    }

    fn logits(&self, x: Tensor<B, 3>, _: &Cx) -> Tensor<B, 3> {
        let x = self.tp.enter(self.ln_f.forward(x));
        let local = ops::linear(x.tensor().clone(), self.weight());
        smp_burn::tp::mappings::gather_last_dim(local, &self.tp)
    }
}

/// The model as the engine's units.
pub type GptUnits<B> = Units<Stem<B>, Block<B>, Head<B>>;

/// The model as units, each rank's layers holding its slices for `tp` (lazy: nothing is
/// allocated until the engine or a forward reads a parameter).
///
/// # Errors
/// A degree that does not divide the heads, the width or the vocabulary.
pub fn gpt_units<B: Backend>(
    c: &GptConfig,
    tp: &TpGroup,
    device: &B::Device,
) -> Result<GptUnits<B>, SmpError> {
    let d = c.d_model;
    let heads = tp.split_len("heads", c.heads)?;
    let stem = Stem {
        wte: VocabParallelEmbeddingConfig::new(c.vocab, d).init(tp, device)?,
        wpe: EmbeddingConfig::new(c.max_seq, d).init(device),
    };
    let mut blocks = Vec::with_capacity(c.layers);
    for _ in 0..c.layers {
        blocks.push(Block {
            ln_1: LayerNormConfig::new(d).init(device),
            c_attn: ParallelLinearConfig::new(d, 3 * d).init_column(tp, device)?,
            c_proj: ParallelLinearConfig::new(d, d).init_row(tp, device)?,
            ln_2: LayerNormConfig::new(d).init(device),
            c_fc: ParallelLinearConfig::new(d, 4 * d).init_column(tp, device)?,
            mlp_proj: ParallelLinearConfig::new(4 * d, d).init_row(tp, device)?,
            heads,
            tp: tp.clone(),
        });
    }
    let head = Head {
        ln_f: LayerNormConfig::new(d).init(device),
        // A clone of the stem's parameter keeps its id: the engine sees one tied parameter.
        wte: c.tie_embeddings.then(|| stem.wte.weight.clone()),
        lm_head: if c.tie_embeddings {
            None
        } else {
            Some(
                ParallelLinearConfig::new(d, c.vocab)
                    .with_bias(false)
                    .init_column(tp, device)?,
            )
        },
        tp: tp.clone(),
    };
    Ok(Units { stem, blocks, head })
}
