//! Tensor-parallel building blocks (Megatron-LM's `layers.py`): each allocates only this rank's
//! slice of its weights, lazily, and runs the collectives its place in a split region needs.
//!
//! Weights are stored as `[out_features, in_features]` (PyTorch's layout, which
//! [`crate::ops::linear`] and the fast CUDA GEMMs take), so column-parallel layers split
//! dimension 0 and row-parallel ones dimension 1. At degree 1 ([`TpGroup::single`]) every layer
//! is its plain counterpart and runs no collective.

use burn::module::{Initializer, Module, Param};
use burn::tensor::{Int, Tensor, backend::Backend};

use super::TpGroup;
use super::mappings::{Mapping, gather_last_dim};
use crate::error::SmpError;
use crate::ops;

/// Activations inside a split region, `[batch, seq, hidden]` with the whole sequence: what
/// [`TpGroup::enter`] returns and only column-parallel layers consume, so that a sequence chunk
/// cannot reach them by mistake.
///
/// Do not apply a replicated parameter (a norm, a bias of your own) to [`Gathered::tensor`]:
/// the engine sums replicated parameters' gradients over the group on the premise that each
/// rank applied them to its own positions only.
#[derive(Debug, Clone)]
pub struct Gathered<B: Backend> {
    tensor: Tensor<B, 3>,
    tp: TpGroup,
}

impl<B: Backend> Gathered<B> {
    pub(crate) fn new(tensor: Tensor<B, 3>, tp: TpGroup) -> Self {
        Self { tensor, tp }
    }

    /// The gathered activations, `[batch, seq, hidden]`.
    pub fn tensor(&self) -> &Tensor<B, 3> {
        &self.tensor
    }

    /// The group that gathered them.
    pub fn group(&self) -> &TpGroup {
        &self.tp
    }

    /// `[batch, seq, hidden]`.
    pub fn dims(&self) -> [usize; 3] {
        self.tensor.dims()
    }
}

/// Burn's default initializer of `nn::Linear` (Kaiming uniform over the fan-in).
fn linear_initializer() -> Initializer {
    Initializer::KaimingUniform {
        gain: 1.0 / 3.0f64.sqrt(),
        fan_out_only: false,
    }
}

/// The configuration of a [`ColumnParallelLinear`] or [`RowParallelLinear`]: the *full* layer's
/// sizes, whatever the degree.
#[derive(Debug, Clone)]
pub struct ParallelLinearConfig {
    /// Input features of the whole layer.
    pub d_input: usize,
    /// Output features of the whole layer.
    pub d_output: usize,
    /// Whether the layer adds a learned bias.
    pub bias: bool,
    /// How the weights are initialized when the layer is used on its own (the engine's
    /// initialization source replaces it).
    pub initializer: Initializer,
}

impl ParallelLinearConfig {
    /// A layer from `d_input` to `d_output` features with a bias and Burn's `Linear` init.
    pub fn new(d_input: usize, d_output: usize) -> Self {
        Self {
            d_input,
            d_output,
            bias: true,
            initializer: linear_initializer(),
        }
    }

    /// With or without a bias.
    pub fn with_bias(mut self, bias: bool) -> Self {
        self.bias = bias;
        self
    }

    /// With another initializer.
    pub fn with_initializer(mut self, initializer: Initializer) -> Self {
        self.initializer = initializer;
        self
    }

    /// This rank's column-parallel slice: output features split over `tp`.
    ///
    /// # Errors
    /// When the degree does not divide `d_output` (the message names both).
    pub fn init_column<B: Backend>(
        &self,
        tp: &TpGroup,
        device: &B::Device,
    ) -> Result<ColumnParallelLinear<B>, SmpError> {
        let out = tp.split_len("ColumnParallelLinear: d_output", self.d_output)?;
        let fans = (Some(self.d_input), Some(self.d_output));
        let layer = ColumnParallelLinear {
            weight: self
                .initializer
                .init_with([out, self.d_input], fans.0, fans.1, device),
            bias: self
                .bias
                .then(|| self.initializer.init_with([out], fans.0, fans.1, device)),
            tp: tp.clone(),
        };
        super::register_layer(
            tp,
            [layer.weight.id]
                .into_iter()
                .chain(layer.bias.as_ref().map(|b| b.id)),
        );
        Ok(layer)
    }

    /// This rank's row-parallel slice: input features split over `tp`.
    ///
    /// # Errors
    /// When the degree does not divide `d_input` (the message names both).
    pub fn init_row<B: Backend>(
        &self,
        tp: &TpGroup,
        device: &B::Device,
    ) -> Result<RowParallelLinear<B>, SmpError> {
        let input = tp.split_len("RowParallelLinear: d_input", self.d_input)?;
        let fans = (Some(self.d_input), Some(self.d_output));
        let layer = RowParallelLinear {
            weight: self
                .initializer
                .init_with([self.d_output, input], fans.0, fans.1, device),
            bias: self.bias.then(|| {
                self.initializer
                    .init_with([self.d_output], fans.0, fans.1, device)
            }),
            tp: tp.clone(),
        };
        super::register_layer(
            tp,
            [layer.weight.id]
                .into_iter()
                .chain(layer.bias.as_ref().map(|b| b.id)),
        );
        Ok(layer)
    }
}

/// A linear layer whose output features are split over the tensor-parallel group: rank `r`
/// holds output rows `[r * out / tp, (r + 1) * out / tp)` of the `[out, in]` weight (and of the
/// bias) and maps the gathered input to its slice of the output, `[batch, seq, out / tp]`.
/// Megatron's `ColumnParallelLinear` with `gather_output = False`.
#[derive(Module, Debug)]
pub struct ColumnParallelLinear<B: Backend> {
    /// This rank's rows of the `[out, in]` weight: `[out / tp, in]`.
    pub weight: Param<Tensor<B, 2>>,
    /// This rank's slice of the bias, `[out / tp]`.
    pub bias: Option<Param<Tensor<B, 1>>>,
    tp: TpGroup,
}

impl<B: Backend> ColumnParallelLinear<B> {
    /// `x W^T + b` for this rank's output features: `[batch, seq, out / tp]`, in FP8 under an
    /// FP8 recipe ([`ops::linear_fp8`]).
    pub fn forward(&self, x: &Gathered<B>) -> Tensor<B, 3> {
        let layer = self.weight.id;
        self.project(x, |x, w| ops::linear_fp8(x, w, layer))
    }

    /// [`Self::forward`] with the output features of every rank gathered, `[batch, seq, out]`
    /// (Megatron's `gather_output = True`; backward: this rank's slice of the gradient). For
    /// full-vocabulary logits when sampling: always in the compute dtype, as an LM head is
    /// under FP8 recipes.
    pub fn forward_gathered(&self, x: &Gathered<B>) -> Tensor<B, 3> {
        gather_last_dim(self.project(x, ops::linear), &self.tp)
    }

    fn project(
        &self,
        x: &Gathered<B>,
        linear: impl FnOnce(Tensor<B, 3>, Tensor<B, 2>) -> Tensor<B, 3>,
    ) -> Tensor<B, 3> {
        self.tp.check();
        let y = linear(x.tensor.clone(), self.weight.val());
        match &self.bias {
            Some(b) => y + b.val().unsqueeze::<3>(),
            None => y,
        }
    }

    /// The group the layer is split over.
    pub fn group(&self) -> &TpGroup {
        &self.tp
    }
}

/// A linear layer whose input features are split over the tensor-parallel group: rank `r`
/// holds input columns `[r * in / tp, (r + 1) * in / tp)` of the `[out, in]` weight, takes the
/// matching slice of the features (a column-parallel layer's output) and computes a partial sum
/// of the output, which it reduces — reduce-scattered along the sequence with sequence
/// parallelism, all-reduced without — before adding its (replicated) bias once.
#[derive(Module, Debug)]
pub struct RowParallelLinear<B: Backend> {
    /// This rank's columns of the `[out, in]` weight: `[out, in / tp]`.
    pub weight: Param<Tensor<B, 2>>,
    /// The whole bias, `[out]`, added after the reduction.
    pub bias: Option<Param<Tensor<B, 1>>>,
    tp: TpGroup,
}

impl<B: Backend> RowParallelLinear<B> {
    /// `x: [batch, seq, in / tp]` (the whole sequence) to `[batch, seq / tp, out]` with sequence
    /// parallelism, `[batch, seq, out]` without.
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        self.tp.check();
        let partial = ops::linear_fp8(x, self.weight.val(), self.weight.id);
        let mapping = if self.tp.sequence_parallel() {
            Mapping::ReduceScatterSequence
        } else {
            Mapping::ReduceFromTp
        };
        let y = self.tp.apply(mapping, partial);
        match &self.bias {
            Some(b) => y + b.val().unsqueeze::<3>(),
            None => y,
        }
    }

    /// The group the layer is split over.
    pub fn group(&self) -> &TpGroup {
        &self.tp
    }
}

/// The configuration of a [`VocabParallelEmbedding`]: the whole table's sizes.
#[derive(Debug, Clone)]
pub struct VocabParallelEmbeddingConfig {
    /// Rows of the whole table (the vocabulary).
    pub vocab: usize,
    /// Width of an embedding.
    pub d_model: usize,
    /// How the table is initialized when the layer is used on its own.
    pub initializer: Initializer,
}

impl VocabParallelEmbeddingConfig {
    /// A `vocab x d_model` table with Burn's `Embedding` init (standard normal).
    pub fn new(vocab: usize, d_model: usize) -> Self {
        Self {
            vocab,
            d_model,
            initializer: Initializer::Normal {
                mean: 0.0,
                std: 1.0,
            },
        }
    }

    /// With another initializer.
    pub fn with_initializer(mut self, initializer: Initializer) -> Self {
        self.initializer = initializer;
        self
    }

    /// This rank's rows of the table.
    ///
    /// # Errors
    /// When the degree does not divide `vocab` (the message names both).
    pub fn init<B: Backend>(
        &self,
        tp: &TpGroup,
        device: &B::Device,
    ) -> Result<VocabParallelEmbedding<B>, SmpError> {
        let rows = tp.split_len("VocabParallelEmbedding: vocab", self.vocab)?;
        let layer = VocabParallelEmbedding {
            weight: self.initializer.init([rows, self.d_model], device),
            tp: tp.clone(),
        };
        super::register_layer(tp, [layer.weight.id]);
        Ok(layer)
    }
}

/// A token embedding whose table is split over the vocabulary: rank `r` holds rows
/// `[r * vocab / tp, (r + 1) * vocab / tp)`, looks up the tokens that fall in them (zeros for
/// the others) and the ranks' partial embeddings are summed — reduce-scattered to this rank's
/// sequence chunk with sequence parallelism (Megatron's `reduce_scatter_embeddings`),
/// all-reduced without.
#[derive(Module, Debug)]
pub struct VocabParallelEmbedding<B: Backend> {
    /// This rank's rows of the `[vocab, d_model]` table.
    pub weight: Param<Tensor<B, 2>>,
    tp: TpGroup,
}

impl<B: Backend> VocabParallelEmbedding<B> {
    /// `ids: [batch, seq]` (the whole sequence, the same on every rank of the group) to
    /// `[batch, seq / tp, d_model]` with sequence parallelism, `[batch, seq, d_model]` without.
    pub fn forward(&self, ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        self.tp.check();
        let weight = self.weight.val();
        if self.tp.degree() == 1 {
            return ops::embedding(weight, ids);
        }
        let rows = weight.dims()[0];
        let start = (self.tp.rank() * rows) as i64;
        let mine = ids
            .clone()
            .greater_equal_elem(start)
            .bool_and(ids.clone().lower_elem(start + rows as i64));
        // Tokens of other ranks look up row 0 and are zeroed, so row 0's gradient gets nothing
        // from them.
        let local = ids.sub_scalar(start).mask_fill(mine.clone().bool_not(), 0);
        let partial = ops::embedding(weight.clone(), local);
        let partial = partial * mine.float().cast(weight.dtype()).unsqueeze_dim::<3>(2);
        let mapping = if self.tp.sequence_parallel() {
            Mapping::ReduceScatterSequence
        } else {
            Mapping::ReduceFromTp
        };
        self.tp.apply(mapping, partial)
    }

    /// The group the table is split over.
    pub fn group(&self) -> &TpGroup {
        &self.tp
    }
}
