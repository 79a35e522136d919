//! What a model's head hands the engine: a mean loss and the positions it averages over.

use burn::tensor::{Tensor, backend::Backend};

/// Which positions a [`Loss`] is the mean over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LossScope {
    /// The positions this rank holds between units: its chunk of the sequence under sequence
    /// parallelism, the whole sequence otherwise. The engine averages the chunks of a
    /// tensor-parallel group (each rank differentiates `1 / tp` of its own).
    Chunk,
    /// The whole sequence, the same value on every rank of the tensor-parallel group (what
    /// [`crate::tp::vocab_parallel_cross_entropy`] returns). Each rank differentiates all of
    /// it: the collectives inside distribute the gradient.
    Sequence,
}

/// A head's mean loss over one micro-batch, with its [`LossScope`]: the engine, not the model,
/// decides how tensor-parallel ranks' losses combine, so that a model cannot scale them wrong.
#[derive(Debug, Clone)]
pub struct Loss<B: Backend> {
    value: Tensor<B, 1>,
    scope: LossScope,
}

impl<B: Backend> Loss<B> {
    /// The mean loss over the positions this rank holds (see [`LossScope::Chunk`]): a head
    /// that scores its own chunk of the sequence, e.g. `ops::cross_entropy` on
    /// `cx.chunk_of(targets)`.
    pub fn over_chunk(value: Tensor<B, 1>) -> Self {
        Self {
            value,
            scope: LossScope::Chunk,
        }
    }

    /// The mean loss over the whole sequence, identical on every tensor-parallel rank (see
    /// [`LossScope::Sequence`]).
    pub fn over_sequence(value: Tensor<B, 1>) -> Self {
        Self {
            value,
            scope: LossScope::Sequence,
        }
    }

    /// The one-element mean loss.
    pub fn value(&self) -> &Tensor<B, 1> {
        &self.value
    }

    /// Which positions it averages over.
    pub fn scope(&self) -> LossScope {
        self.scope
    }

    /// The value and scope.
    pub fn into_parts(self) -> (Tensor<B, 1>, LossScope) {
        (self.value, self.scope)
    }
}
