//! The training engine: sharded data parallelism (FSDP / ZeRO-3, hybrid sharding), tensor
//! parallelism, activation checkpointing and offloading for any Burn model cut into units.
//!
//! A model is three kinds of units, each any Burn module: a *stem* (token ids to the residual
//! stream, e.g. the embeddings), a list of *blocks* (the residual stream to itself, e.g.
//! transformer layers) and a *head* (the residual stream to a loss). The unit is the grain of
//! sharding, as an FSDP2 `fully_shard` call is: each unit's parameters are flattened into one
//! buffer that is sharded across the mesh's shard group, gathered just before the unit runs
//! and freed after it; its gradients are reduce-scattered once per unit. The engine owns every
//! gradient from the loss to the optimizer: the sums over tensor-parallel ranks, the reduction
//! over replicas in hybrid sharding, clipping and the step cannot be forgotten.
//!
//! ```
//! use burn::backend::{Autodiff, NdArray};
//! use burn::module::Module;
//! use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig};
//! use burn::tensor::{Int, Tensor, backend::Backend};
//! use collectives::{CommOptions, run_on_threads};
//! use smp_burn::engine::{BlockUnit, Cx, EngineBuilder, HeadUnit, Init, StemUnit, Units};
//! use smp_burn::{Loss, ParallelConfig, mesh::Mesh, ops};
//!
//! #[derive(Module, Debug)]
//! struct Stem<B: Backend> { emb: Embedding<B> }
//! #[derive(Module, Debug)]
//! struct Block<B: Backend> { mlp: Linear<B> }
//! #[derive(Module, Debug)]
//! struct Head<B: Backend> { out: Linear<B> }
//!
//! impl<B: Backend> StemUnit<B> for Stem<B> {
//!     type Aux = ();
//!     fn aux(&self, _: &Cx, _: &B::Device) {}
//!     fn forward(&self, ids: Tensor<B, 2, Int>, cx: &Cx) -> Tensor<B, 3> {
//!         self.emb.forward(cx.chunk_of(ids))
//!     }
//! }
//! impl<B: Backend> BlockUnit<B> for Block<B> {
//!     type Aux = ();
//!     fn forward(&self, x: Tensor<B, 3>, _: &(), _: &Cx) -> Tensor<B, 3> {
//!         x.clone() + self.mlp.forward(x).tanh()
//!     }
//! }
//! impl<B: Backend> HeadUnit<B> for Head<B> {
//!     fn loss(&self, x: Tensor<B, 3>, targets: Tensor<B, 2, Int>, cx: &Cx) -> Loss<B> {
//!         let [b, s, d] = x.dims();
//!         let logits = self.out.forward(x).reshape([b * s, 16]);
//!         Loss::over_chunk(ops::cross_entropy(logits, cx.chunk_of(targets).reshape([b * s])))
//!     }
//!     fn logits(&self, x: Tensor<B, 3>, _: &Cx) -> Tensor<B, 3> { self.out.forward(x) }
//! }
//!
//! type Train = Autodiff<NdArray<f32>>;
//! let losses = run_on_threads(2, CommOptions::default(), |world| {
//!     let dev = Default::default();
//!     let mesh = Mesh::over_host(world, &ParallelConfig::default()).unwrap();
//!     let units = Units {
//!         stem: Stem { emb: EmbeddingConfig::new(16, 8).init::<Train>(&dev) },
//!         blocks: (0..2).map(|_| Block { mlp: LinearConfig::new(8, 8).init(&dev) }).collect(),
//!         head: Head { out: LinearConfig::new(8, 16).init(&dev) },
//!     };
//!     let mut engine = EngineBuilder::new(&mesh)
//!         .init(Init::seeded(7))
//!         .build(units, &dev)
//!         .unwrap();
//!     let ids = Tensor::<Train, 2, Int>::from_ints([[1, 2, 3, 4]], &dev);
//!     let targets = Tensor::<Train, 2, Int>::from_ints([[2, 3, 4, 5]], &dev);
//!     let stats = engine.train_step([(ids, targets)], 1e-2).unwrap();
//!     stats.loss.into_scalar()
//! });
//! assert_eq!(losses[0], losses[1]);
//! ```

mod build;
mod schedule;
mod sharded;
mod state;

use std::ops::Range;
use std::sync::Arc;

use burn::module::Module;
use burn::tensor::{Int, Tensor, backend::Backend};

pub use crate::fsdp::StateKind;
use crate::fsdp::{CommStats, FsdpContext, ShardedUnit};
pub use crate::init::InitRule;
pub use crate::loss::{Loss, LossScope};
pub use crate::optim::{AdamW, BurnOptim, Group, MomentDtype, Optimizer, ShardOptimizer};
use crate::tp::{Placement, TpGroup};
pub use build::{EngineBuilder, Init, ParamSource, Tied};
pub use state::{NamedTensors, PlanEntry};

use crate::ActivationCheckpointing;
use crate::documents::Documents;
use crate::error::SmpError;
use crate::mesh::Mesh;

/// The first unit: token ids to the residual stream.
pub trait StemUnit<B: Backend>: Module<B> {
    /// What every block needs besides the residual stream and depends on the sequence length
    /// only (rotary tables, masks); `()` when there is nothing. The engine makes it once per
    /// sequence length, from the stem's lazy template: [`Self::aux`] must not read parameters.
    type Aux: Clone;

    /// The blocks' shared inputs for sequences of `cx.seq_len()` tokens.
    fn aux(&self, cx: &Cx, device: &B::Device) -> Self::Aux;

    /// `tokens: [batch, seq]` (the whole sequence, the same on every tensor-parallel rank) to
    /// the residual stream of the positions this rank holds, `[batch, cx.chunk().len(),
    /// hidden]`: with sequence parallelism that is its chunk of the sequence (a
    /// [`crate::tp::VocabParallelEmbedding`] returns it; a replicated embedding looks up
    /// [`Cx::chunk_of`] the tokens).
    fn forward(&self, tokens: Tensor<B, 2, Int>, cx: &Cx) -> Tensor<B, 3>;
}

/// A repeated unit: the residual stream to itself (shape unchanged).
pub trait BlockUnit<B: Backend>: Module<B> {
    /// The stem's [`StemUnit::Aux`].
    type Aux: Clone;

    /// `x: [batch, cx.chunk().len(), hidden]` to the same shape.
    fn forward(&self, x: Tensor<B, 3>, aux: &Self::Aux, cx: &Cx) -> Tensor<B, 3>;
}

/// The last unit: the residual stream to a loss.
pub trait HeadUnit<B: Backend>: Module<B> {
    /// The mean loss of `x` (this rank's positions) against `targets: [batch, seq]` (the whole
    /// sequence): [`Loss::over_chunk`] for a head that scores its own positions,
    /// [`Loss::over_sequence`] for [`crate::tp::vocab_parallel_cross_entropy`].
    fn loss(&self, x: Tensor<B, 3>, targets: Tensor<B, 2, Int>, cx: &Cx) -> Loss<B>;

    /// Logits `[batch, seq, vocab]` of the whole sequence over the whole vocabulary, the same
    /// on every tensor-parallel rank (evaluation and sampling; no gradient is taken). A head
    /// that scores its own positions gathers them with [`Cx::gather_sequence`].
    fn logits(&self, x: Tensor<B, 3>, cx: &Cx) -> Tensor<B, 3>;
}

/// A model cut into units. `K` may be an enum module for models whose blocks differ.
#[derive(Debug, Clone)]
pub struct Units<S, K, H> {
    /// The first unit.
    pub stem: S,
    /// The repeated units, in order.
    pub blocks: Vec<K>,
    /// The last unit.
    pub head: H,
}

/// Which unit a parameter belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum UnitId {
    /// The stem.
    Stem,
    /// Block `i`.
    Block(usize),
    /// The head.
    Head,
}

impl UnitId {
    /// The default prefix of its parameters' names: `stem`, `blocks.{i}`, `head`.
    pub fn prefix(self) -> String {
        match self {
            UnitId::Stem => "stem".into(),
            UnitId::Block(i) => format!("blocks.{i}"),
            UnitId::Head => "head".into(),
        }
    }
}

/// What a unit knows about the micro-batch it runs on.
#[derive(Debug, Clone)]
pub struct Cx {
    batch: usize,
    seq_len: usize,
    chunk: Range<usize>,
    tp: TpGroup,
    documents: Option<Arc<Documents>>,
}

impl Cx {
    /// A context for sequences of `seq_len` tokens on `tp`'s group.
    ///
    /// # Errors
    /// With sequence parallelism, when the degree does not divide `seq_len`.
    pub fn new(batch: usize, seq_len: usize, tp: &TpGroup) -> Result<Self, SmpError> {
        Ok(Self {
            batch,
            seq_len,
            chunk: tp.sequence_chunk(seq_len)?,
            tp: tp.clone(),
            documents: None,
        })
    }

    /// This context for rows packed with `documents`.
    ///
    /// # Errors
    /// `documents` describes another `[batch, seq]` than the context's (both named).
    pub fn with_documents(mut self, documents: Arc<Documents>) -> Result<Self, SmpError> {
        if documents.batch() != self.batch || documents.seq_len() != self.seq_len {
            return Err(SmpError::Usage(format!(
                "documents for [batch, seq] = [{}, {}] given with a micro-batch of [{}, {}] tokens",
                documents.batch(),
                documents.seq_len(),
                self.batch,
                self.seq_len
            )));
        }
        self.documents = Some(documents);
        Ok(self)
    }

    /// The documents packed into the rows, if the micro-batch says (see [`MicroBatch`]):
    /// attention and positions then stay inside each one
    /// ([`crate::ops::causal_attention_in_documents`], [`crate::ops::rope_in_documents`]).
    pub fn documents(&self) -> Option<&Documents> {
        self.documents.as_deref()
    }

    /// Sequences in the micro-batch.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Tokens per sequence (the whole sequence).
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    /// The positions this rank holds between units: its chunk of the sequence with sequence
    /// parallelism, all of them otherwise.
    pub fn chunk(&self) -> Range<usize> {
        self.chunk.clone()
    }

    /// The tensor-parallel group.
    pub fn tp(&self) -> &TpGroup {
        &self.tp
    }

    /// The columns of `t: [batch, seq]` at this rank's positions ([`Self::chunk`]).
    pub fn chunk_of<B: Backend, K: burn::tensor::TensorKind<B> + burn::tensor::BasicOps<B>>(
        &self,
        t: Tensor<B, 2, K>,
    ) -> Tensor<B, 2, K> {
        if self.chunk.len() == t.dims()[1] {
            return t;
        }
        t.narrow(1, self.chunk.start, self.chunk.len())
    }

    /// The positions of this rank's chunk, `[batch, chunk]` (learned position embeddings):
    /// within the row, or within each document when the rows are packed
    /// ([`Self::documents`]), so that a packed document is encoded as it would be alone.
    pub fn positions<B: Backend>(&self, device: &B::Device) -> Tensor<B, 2, Int> {
        let chunk = self.chunk.clone();
        if let Some(documents) = self.documents.as_deref().filter(|d| d.is_packed()) {
            let all = documents.positions();
            let mine: Vec<i64> = all
                .chunks(self.seq_len)
                .flat_map(|row| row[chunk.clone()].iter().copied())
                .collect();
            let data = burn::tensor::TensorData::new(mine, [self.batch, chunk.len()]);
            return Tensor::from_data(data, device);
        }
        Tensor::<B, 1, Int>::arange(chunk.start as i64..chunk.end as i64, device)
            .unsqueeze::<2>()
            .repeat_dim(0, self.batch)
    }

    /// The whole sequence `[batch, seq, d]` from every rank's `[batch, chunk, d]` (identity
    /// without sequence parallelism): for heads that score their own positions, in
    /// [`HeadUnit::logits`].
    pub fn gather_sequence<B: Backend>(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        if !self.tp.sequence_parallel() {
            return x;
        }
        crate::tp::mappings::gather_sequence(x, &self.tp)
    }
}

/// One micro-batch of a data-parallel rank: `tokens` and `targets` `[batch, seq]` (the same on
/// every tensor-parallel rank) and, for rows packed with several documents, where each one
/// starts. A `(tokens, targets)` pair converts into one without documents.
#[derive(Debug, Clone)]
pub struct MicroBatch<B: Backend> {
    /// Input token ids.
    pub tokens: Tensor<B, 2, Int>,
    /// The token each input position predicts.
    pub targets: Tensor<B, 2, Int>,
    /// The packing of the rows; `None` is one sequence per row.
    pub documents: Option<Arc<Documents>>,
}

impl<B: Backend> MicroBatch<B> {
    /// Rows packed with `documents`.
    pub fn packed(
        tokens: Tensor<B, 2, Int>,
        targets: Tensor<B, 2, Int>,
        documents: Documents,
    ) -> Self {
        Self {
            tokens,
            targets,
            documents: Some(Arc::new(documents)),
        }
    }
}

impl<B: Backend> From<(Tensor<B, 2, Int>, Tensor<B, 2, Int>)> for MicroBatch<B> {
    fn from((tokens, targets): (Tensor<B, 2, Int>, Tensor<B, 2, Int>)) -> Self {
        Self {
            tokens,
            targets,
            documents: None,
        }
    }
}

/// How much one micro-batch's mean loss counts in its step ([`Engine::forward_backward`]).
#[derive(Debug, Clone)]
pub enum LossScale<IB: Backend> {
    /// The loss times a constant (`1 / micro-batches` for accumulation): every micro-batch
    /// weighs the same and the step reports the mean of their losses. An `f32` converts into
    /// this.
    Constant(f32),
    /// The loss times the micro-batch's scored targets (those that are not
    /// [`crate::ops::IGNORE_INDEX`]) over this one-element tensor, the step's scored targets
    /// per data-parallel rank ([`Engine::per_scored_target`] makes it). The step's loss is then
    /// the mean over every scored target of the global batch, whatever its split into ranks
    /// and micro-batches, as PyTorch's trainers normalize by the batch's token count. Without
    /// ignored targets this is exactly [`Self::Constant`] of `1 / micro-batches`.
    PerScoredTarget(Tensor<IB, 1>),
}

impl<IB: Backend> From<f32> for LossScale<IB> {
    fn from(scale: f32) -> Self {
        Self::Constant(scale)
    }
}

/// How many of `targets` a loss scores (those not ignored), as one f32 element on the inner
/// backend.
pub(crate) fn scored_count<B: burn::tensor::backend::AutodiffBackend, const D: usize>(
    targets: Tensor<B, D, Int>,
) -> Tensor<B::InnerBackend, 1> {
    targets
        .inner()
        .greater_equal_elem(0)
        .float()
        .cast(burn::tensor::DType::F32)
        .sum()
}

/// What one optimizer step reports, on the device (reading a value waits for the step; see
/// [`crate::readback`] for reading it later without draining the GPU's queue).
#[derive(Debug, Clone)]
pub struct StepStats<IB: Backend> {
    /// Mean loss of the step's micro-batches over every data-parallel rank (one element).
    pub loss: Tensor<IB, 1>,
    /// Global gradient norm before clipping (one element).
    pub grad_norm: Tensor<IB, 1>,
    /// Time in collectives and calls made since the last step.
    pub comm: CommStats,
}

impl<IB: Backend> StepStats<IB> {
    /// The gradient norm on the host (waits for the device; NaN if the read fails).
    pub fn grad_norm_now(&self) -> f64 {
        crate::readback::read_later(self.grad_norm.clone())
            .and_then(|pending| pending.wait())
            .ok()
            .and_then(|v| v.first().copied())
            .map_or(f64::NAN, f64::from)
    }
}

/// A parameter as the builder's callbacks see it.
#[derive(Debug, Clone)]
pub struct ParamInfo<'a> {
    /// The parameter's name (`stem.emb.weight`, or what [`EngineBuilder::names`] made of it).
    pub name: &'a str,
    /// The unit that holds it (the first, for a tied parameter).
    pub unit: UnitId,
    /// Its path inside the unit, e.g. `attn.c_attn.weight`.
    pub path: &'a str,
    /// The full parameter's shape, whatever slice of it this rank holds.
    pub shape: &'a [usize],
    /// How tensor parallelism places it.
    pub placement: Placement,
    /// The type of the module that holds it, as Burn's visitor names it
    /// (`Struct:LayerNorm`).
    pub container: &'a str,
}

/// How a unit's parameters are placed and named: one entry per [`FlatParam`] of its layout.
#[derive(Debug, Clone)]
struct ParamMeta {
    name: String,
    path: String,
    full_shape: Vec<usize>,
    placement: Placement,
}

/// A sharded unit with the engine's knowledge of its parameters.
#[derive(Debug)]
struct Sharded<B: burn::tensor::backend::AutodiffBackend, M: Module<B>> {
    unit: ShardedUnit<B, M>,
    id: UnitId,
    /// One entry per parameter of the unit's flat layout, in its order.
    meta: Vec<ParamMeta>,
    /// Whether the unit uses a tied parameter (whose gradient it then hands to the tied unit).
    uses_tied: bool,
}

/// A model's units sharded over a mesh, with the schedule that trains them.
pub struct Engine<B: burn::tensor::backend::AutodiffBackend, S, K, H>
where
    S: StemUnit<B>,
    K: BlockUnit<B, Aux = S::Aux>,
    H: HeadUnit<B>,
{
    mesh: Mesh<B::InnerBackend>,
    stem: Sharded<B, S>,
    blocks: Vec<Sharded<B, K>>,
    head: Sharded<B, H>,
    /// Parameters shared between units (tied embeddings), sharded as one unit of their own.
    tied: Option<Sharded<B, Tied<B>>>,
    /// Every parameter's placement, by Burn id (the tied ones included).
    placements: std::collections::HashMap<burn::module::ParamId, Placement>,
    device: B::Device,
    checkpointing: ActivationCheckpointing,
    /// Recomputed blocks keep their attention's results ([`crate::selective`]).
    selective_recompute: bool,
    /// [`Engine::train_step`] reduces after every micro-batch
    /// ([`ParallelConfig::reduce_every_micro_batch`](crate::ParallelConfig)).
    reduce_every_micro_batch: bool,
    offloading: Option<usize>,
    offloaded_bytes: usize,
    optimizer: Optimizer<B::InnerBackend>,
    max_grad_norm: Option<f64>,
    steps: u64,
    /// The stem's shared block inputs for the last sequence length.
    aux: Option<(usize, S::Aux)>,
    /// Losses of the micro-batches since the last step (this rank's, tensor-parallel mean).
    losses: Vec<Tensor<B::InnerBackend, 1>>,
    /// Their shares of the step's mean ([`LossScale::PerScoredTarget`]: each loss times its
    /// weight), when every micro-batch since the last step was weighted so.
    weighted_losses: Vec<Tensor<B::InnerBackend, 1>>,
    /// Whether the last micro-batch left its gradients unreduced (`sync = false`).
    deferred: bool,
}

impl<B, S, K, H> std::fmt::Debug for Engine<B, S, K, H>
where
    B: burn::tensor::backend::AutodiffBackend,
    S: StemUnit<B>,
    K: BlockUnit<B, Aux = S::Aux>,
    H: HeadUnit<B>,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("blocks", &self.blocks.len())
            .field("tied", &self.tied.is_some())
            .field("checkpointing", &self.checkpointing)
            .field("selective_recompute", &self.selective_recompute)
            .field("reduce_every_micro_batch", &self.reduce_every_micro_batch)
            .field("offloading", &self.offloading)
            .field("optimizer", &self.optimizer)
            .field("steps", &self.steps)
            .finish()
    }
}

impl<B, S, K, H> Engine<B, S, K, H>
where
    B: burn::tensor::backend::AutodiffBackend,
    S: StemUnit<B>,
    K: BlockUnit<B, Aux = S::Aux>,
    H: HeadUnit<B>,
{
    /// The mesh the engine runs on.
    pub fn mesh(&self) -> &Mesh<B::InnerBackend> {
        &self.mesh
    }

    /// The sharding context.
    pub fn context(&self) -> &FsdpContext<B::InnerBackend> {
        self.mesh.fsdp()
    }

    /// Blocks in the model.
    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Optimizer steps taken (restored with [`Self::set_optimizer_steps`] on resume: AdamW's
    /// bias corrections depend on it).
    pub fn optimizer_steps(&self) -> u64 {
        self.steps
    }

    /// Sets the optimizer's step count (when resuming from a checkpoint).
    pub fn set_optimizer_steps(&mut self, steps: u64) {
        self.steps = steps;
    }

    /// Bytes of parameter, gradient and optimizer state this rank holds.
    pub fn state_bytes(&self) -> usize {
        self.stem.unit.state_bytes()
            + self
                .blocks
                .iter()
                .map(|b| b.unit.state_bytes())
                .sum::<usize>()
            + self.head.unit.state_bytes()
            + self.tied.as_ref().map_or(0, |t| t.unit.state_bytes())
    }

    /// Bytes of activations the last micro-batch kept in host memory instead of on the device
    /// (0 without activation offloading): one input per recomputed block.
    pub fn offloaded_bytes(&self) -> usize {
        self.offloaded_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type B = burn_ndarray::NdArray<f32>;

    fn ints(t: Tensor<B, 2, Int>) -> Vec<i64> {
        t.into_data().convert::<i64>().to_vec().unwrap()
    }

    /// Positions restart at each document, and a mismatched packing is refused.
    #[test]
    fn positions_follow_the_documents() {
        let dev = Default::default();
        let cx = Cx::new(2, 5, &TpGroup::single()).unwrap();
        assert_eq!(
            ints(cx.positions::<B>(&dev)),
            [0, 1, 2, 3, 4, 0, 1, 2, 3, 4]
        );
        let documents = Documents::from_lengths(5, vec![vec![2, 3], vec![5]]).unwrap();
        let packed = cx.clone().with_documents(Arc::new(documents)).unwrap();
        assert_eq!(
            ints(packed.positions::<B>(&dev)),
            [0, 1, 0, 1, 2, 0, 1, 2, 3, 4]
        );
        let other = Documents::from_lengths(4, vec![vec![4], vec![4]]).unwrap();
        let e = cx.with_documents(Arc::new(other)).unwrap_err().to_string();
        assert!(e.contains("[2, 4]") && e.contains("[2, 5]"), "{e}");
    }
}
