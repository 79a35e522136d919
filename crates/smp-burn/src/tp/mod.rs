//! Tensor parallelism (Megatron-LM's layout), with or without sequence parallelism.
//!
//! A transformer block's column-parallel linears ([`ColumnParallelLinear`]: q/k/v, gate/up) hold
//! a slice of the output features on each of the `tp` ranks and its row-parallel ones
//! ([`RowParallelLinear`]: the attention output, down) a slice of the input features, so each
//! rank computes a partial sum of a row-parallel output. Between those regions the residual
//! stream is either replicated on every rank (plain tensor parallelism) or, with *sequence
//! parallelism* (the default), split along the sequence: each rank keeps `[batch, seq / tp,
//! hidden]`, which divides the memory of norms, residuals and saved block inputs by `tp` — what
//! makes long sequences fit.
//!
//! A model is written once with the layers of [`layers`]; the same code runs unsplit with
//! [`TpGroup::single`]. Entering a split region is [`TpGroup::enter`], whose [`Gathered`]
//! result only column-parallel layers (and [`vocab_parallel_cross_entropy`]) take, so a
//! sequence chunk cannot reach them by mistake; leaving it is [`RowParallelLinear::forward`],
//! which reduces the partial sums and only then adds its bias. The embedding and the LM head can
//! be split over the vocabulary ([`VocabParallelEmbedding`], [`vocab_parallel_cross_entropy`]):
//! no rank then holds the whole table or the logits of the whole vocabulary.
//!
//! Every collective these use is a conjugate forward/backward pair in [`mappings`]. A collective
//! that fails (a dead peer, a timeout) cannot return an error from inside a layer's forward or
//! Burn's backward: the group records the first failure, the op yields zeros, and
//! [`TpGroup::take_failure`] (which the engine calls after every unit) turns it into an `Err`.

pub mod cross_entropy;
pub mod layers;
pub mod mappings;
pub mod placement;

use std::any::Any;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use burn::tensor::{Tensor, backend::Backend};
use collectives::ReduceOp;

use crate::comm::TensorComm;
use crate::error::SmpError;
use crate::fsdp::CommStats;

pub use cross_entropy::vocab_parallel_cross_entropy;
pub use layers::{ColumnParallelLinear, Gathered, RowParallelLinear, VocabParallelEmbedding};
pub use mappings::Mapping;
pub use placement::Placement;

/// One rank's tensor-parallel group on the inner backend `IB`: the communicator of the mesh's
/// `tensor` axis (ranks that hold the same data-parallel shard and split each layer between
/// them), whether the residual stream is split along the sequence, and the first collective
/// failure. Cheap to clone (shared state).
#[derive(Debug, Clone)]
pub struct TpContext<IB: Backend> {
    inner: Arc<TpInner<IB>>,
}

#[derive(Debug)]
struct TpInner<IB: Backend> {
    comm: Arc<dyn TensorComm<IB>>,
    sequence_parallel: bool,
    stats: Mutex<CommStats>,
    failure: Arc<Mutex<Option<String>>>,
}

impl<IB: Backend> TpContext<IB> {
    /// The context of `comm`'s group (the `tensor` axis of the device mesh), with the residual
    /// stream split along the sequence when `sequence_parallel`.
    pub fn new(comm: Arc<dyn TensorComm<IB>>, sequence_parallel: bool) -> Self {
        Self {
            inner: Arc::new(TpInner {
                comm,
                sequence_parallel,
                stats: Mutex::default(),
                failure: Arc::default(),
            }),
        }
    }

    /// Ranks a layer is split across.
    pub fn degree(&self) -> usize {
        self.inner.comm.world_size()
    }

    /// This rank's index in the tensor-parallel group: which slice of each split weight and
    /// which chunk of the sequence it holds.
    pub fn rank(&self) -> usize {
        self.inner.comm.rank()
    }

    /// Whether the residual stream between split regions is this rank's chunk of the sequence.
    pub fn sequence_parallel(&self) -> bool {
        self.inner.sequence_parallel
    }

    /// The communicator of the group.
    pub fn comm(&self) -> &Arc<dyn TensorComm<IB>> {
        &self.inner.comm
    }

    /// Sum of `t` over the group. Plain tensors, no autodiff.
    pub fn all_reduce_sum(&self, t: Tensor<IB, 1>) -> Result<Tensor<IB, 1>, SmpError> {
        self.all_reduce(t, ReduceOp::Sum)
    }

    /// Mean of `t` over the group.
    pub fn all_reduce_mean(&self, t: Tensor<IB, 1>) -> Result<Tensor<IB, 1>, SmpError> {
        self.all_reduce(t, ReduceOp::Avg)
    }

    /// `t` reduced by `op` over the group.
    pub fn all_reduce(&self, t: Tensor<IB, 1>, op: ReduceOp) -> Result<Tensor<IB, 1>, SmpError> {
        if self.degree() == 1 {
            return Ok(t);
        }
        self.timed(|| self.inner.comm.all_reduce(t, op))
    }

    /// Every rank's `t` concatenated in rank order.
    pub fn all_gather(&self, t: Tensor<IB, 1>) -> Result<Tensor<IB, 1>, SmpError> {
        if self.degree() == 1 {
            return Ok(t);
        }
        self.timed(|| self.inner.comm.all_gather(t))
    }

    /// Time and calls spent in this group's collectives since the last call (and the device
    /// time where the communicator measures it); resets them.
    pub fn take_stats(&self) -> CommStats {
        let mut stats =
            std::mem::take(&mut *self.inner.stats.lock().unwrap_or_else(|p| p.into_inner()));
        match self.inner.comm.take_device_time() {
            Ok(d) => stats.device = d,
            Err(e) => tracing::warn!("timing tensor-parallel collectives: {e}"),
        }
        stats
    }

    pub(crate) fn timed<T>(&self, f: impl FnOnce() -> Result<T, SmpError>) -> Result<T, SmpError> {
        let start = Instant::now();
        let out = f();
        let mut stats = self.inner.stats.lock().unwrap_or_else(|p| p.into_inner());
        stats.wait += start.elapsed();
        stats.calls += 1;
        out
    }

    /// Records the first failure of an op that cannot return an error (see the module docs).
    pub(crate) fn poison(&self, what: &str, e: impl std::fmt::Display) {
        poison(&self.inner.failure, format!("{what}: {e}"));
    }
}

fn poison(slot: &Mutex<Option<String>>, message: String) {
    let mut slot = slot.lock().unwrap_or_else(|p| p.into_inner());
    if slot.is_none() {
        tracing::error!("tensor parallelism: {message}");
        *slot = Some(message);
    }
}

/// A [`TpContext`] with its backend erased, so that layers (whose `Module` derive clones
/// non-module fields between backends, e.g. in `valid()`) can hold it whatever their backend.
pub(crate) trait ErasedTp: Send + Sync + std::fmt::Debug {
    fn degree(&self) -> usize;
    fn rank(&self) -> usize;
    fn sequence_parallel(&self) -> bool;
    fn failure(&self) -> &Arc<Mutex<Option<String>>>;
    /// The context itself, for code that knows its inner backend.
    fn as_any(&self) -> &dyn Any;
    /// Applies `mapping` to a `Tensor<IB, 3>` or `Tensor<Autodiff<IB>, 3>` in a box; `Err`
    /// hands the box back when it holds another backend's tensor.
    fn apply(
        &self,
        mapping: Mapping,
        x: Box<dyn Any>,
    ) -> Result<Result<Box<dyn Any>, SmpError>, Box<dyn Any>>;
    /// [`vocab_parallel_cross_entropy`] on boxed `(x, weight, targets)` of `IB` or
    /// `Autodiff<IB>`; `Err` hands them back for another backend.
    fn vocab_cross_entropy(
        &self,
        args: cross_entropy::BoxedArgs,
    ) -> Result<Result<Box<dyn Any>, SmpError>, cross_entropy::BoxedArgs>;
}

impl<IB: Backend> ErasedTp for TpContext<IB> {
    fn degree(&self) -> usize {
        TpContext::degree(self)
    }
    fn rank(&self) -> usize {
        TpContext::rank(self)
    }
    fn sequence_parallel(&self) -> bool {
        self.inner.sequence_parallel
    }
    fn failure(&self) -> &Arc<Mutex<Option<String>>> {
        &self.inner.failure
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn apply(
        &self,
        mapping: Mapping,
        x: Box<dyn Any>,
    ) -> Result<Result<Box<dyn Any>, SmpError>, Box<dyn Any>> {
        mappings::apply_erased(self, mapping, x)
    }
    fn vocab_cross_entropy(
        &self,
        args: cross_entropy::BoxedArgs,
    ) -> Result<Result<Box<dyn Any>, SmpError>, cross_entropy::BoxedArgs> {
        cross_entropy::apply_erased(self, args)
    }
}

/// A rank's tensor-parallel group as the model's layers hold it: backend-erased, cheap to clone,
/// and of degree 1 ([`TpGroup::single`]) when nothing is split, where every op is the identity.
/// Get it from [`crate::mesh::Mesh::tp`].
#[derive(Clone, Debug)]
pub struct TpGroup {
    inner: Option<Arc<dyn ErasedTp>>,
    /// Which mesh made it (0: [`TpGroup::single`]); the engine checks that the model's layers
    /// were built with its own group.
    id: u64,
}

/// Ids of groups made by meshes (0 is [`TpGroup::single`]).
static NEXT_GROUP: AtomicU64 = AtomicU64::new(1);

/// The group each tensor-parallel layer's parameters were built for, by parameter id, so that
/// the engine can refuse a model whose layers were built with another group than its mesh's
/// before it runs (a layer split for the wrong degree computes on wrong shapes).
static LAYER_GROUPS: Mutex<Option<std::collections::HashMap<burn::module::ParamId, (u64, usize)>>> =
    Mutex::new(None);

/// Records that the parameters `ids` belong to a layer built for `tp`.
pub(crate) fn register_layer(tp: &TpGroup, ids: impl IntoIterator<Item = burn::module::ParamId>) {
    let mut map = LAYER_GROUPS.lock().unwrap_or_else(|p| p.into_inner());
    let map = map.get_or_insert_with(Default::default);
    for id in ids {
        map.insert(id, (tp.id, tp.degree()));
    }
}

/// The group id and degree the layer holding parameter `id` was built for, if it is a
/// tensor-parallel layer's.
pub(crate) fn layer_group(id: burn::module::ParamId) -> Option<(u64, usize)> {
    let map = LAYER_GROUPS.lock().unwrap_or_else(|p| p.into_inner());
    map.as_ref()?.get(&id).copied()
}

thread_local! {
    /// The group of the engine that is running a unit on this thread (see [`TpGroup::check`]).
    static ACTIVE: std::cell::Cell<Option<(u64, usize)>> = const { std::cell::Cell::new(None) };
}

impl Default for TpGroup {
    fn default() -> Self {
        Self::single()
    }
}

impl TpGroup {
    /// No tensor parallelism: every layer holds its whole weights and every op is the identity.
    pub fn single() -> Self {
        Self { inner: None, id: 0 }
    }

    /// The group of `ctx` (degree 1 gives [`TpGroup::single`]'s behaviour under a mesh's id).
    pub fn new<IB: Backend>(ctx: TpContext<IB>) -> Self {
        let id = NEXT_GROUP.fetch_add(1, Ordering::Relaxed);
        let inner = (ctx.degree() > 1).then(|| Arc::new(ctx) as Arc<dyn ErasedTp>);
        Self { inner, id }
    }

    /// The id of the mesh that made the group (0: [`TpGroup::single`]).
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// Ranks each split layer is divided across (1: nothing is split).
    pub fn degree(&self) -> usize {
        self.inner.as_ref().map_or(1, |t| t.degree())
    }

    /// This rank's index in the group: which slice of each split weight it holds.
    pub fn rank(&self) -> usize {
        self.inner.as_ref().map_or(0, |t| t.rank())
    }

    /// Whether the residual stream between split regions is split along the sequence (always
    /// `false` at degree 1, where there is nothing to split).
    pub fn sequence_parallel(&self) -> bool {
        self.inner.as_ref().is_some_and(|t| t.sequence_parallel())
    }

    /// `len / degree`, or an error naming `what`, `len` and the degree when it does not divide
    /// (heads, key/value heads, the MLP width, the vocabulary, the sequence).
    pub fn split_len(&self, what: &str, len: usize) -> Result<usize, SmpError> {
        split_len(what, len, self.degree())
    }

    /// The positions of a sequence of `seq` tokens this rank holds between split regions:
    /// `[rank * seq / tp, (rank + 1) * seq / tp)` with sequence parallelism, all of them
    /// without.
    pub fn sequence_chunk(&self, seq: usize) -> Result<Range<usize>, SmpError> {
        if !self.sequence_parallel() {
            return Ok(0..seq);
        }
        let local = split_len("sequence length", seq, self.degree())?;
        Ok(self.rank() * local..(self.rank() + 1) * local)
    }

    /// Enters a split region: the input of column-parallel layers. With sequence parallelism
    /// this all-gathers the sequence (backward: reduce-scatter); without it, it is the identity
    /// whose backward sums the gradient over the group (Megatron's `copy_to_tensor_model_
    /// parallel_region`). Apply the region's norm before entering it, so that its weight sees
    /// this rank's own positions only.
    pub fn enter<B: Backend>(&self, x: Tensor<B, 3>) -> Gathered<B> {
        self.check();
        let mapping = if self.sequence_parallel() {
            Mapping::GatherSequence
        } else {
            Mapping::CopyToTp
        };
        Gathered::new(self.apply(mapping, x), self.clone())
    }

    /// The inner context, when the group was made for backend `IB` and is split.
    pub fn context<IB: Backend>(&self) -> Option<&TpContext<IB>> {
        self.inner
            .as_ref()?
            .as_any()
            .downcast_ref::<TpContext<IB>>()
    }

    /// Applies one of the conjugate pairs of [`mappings`] (identity at degree 1). A failure is
    /// recorded (see [`Self::take_failure`]) and yields zeros of the expected shape.
    pub fn apply<B: Backend>(&self, mapping: Mapping, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let Some(inner) = &self.inner else {
            return x;
        };
        let dims = x.dims();
        let (device, dtype) = (x.device(), x.dtype());
        let message = match inner.apply(mapping, Box::new(x)) {
            Ok(Ok(y)) => match y.downcast::<Tensor<B, 3>>() {
                Ok(y) => return *y,
                Err(_) => "the op returned another backend's tensor".to_string(),
            },
            Ok(Err(e)) => format!("{}: {e}", mapping.name()),
            Err(_) => backend_mismatch::<B>(),
        };
        poison(inner.failure(), message);
        let out = mapping.output_dims(dims, inner.degree());
        Tensor::zeros(out, (&device, dtype))
    }

    /// The first collective failure since the last call (see the module docs), or a layer
    /// built with another group than the running engine's. The engine calls this after every
    /// unit's forward and backward.
    pub fn take_failure(&self) -> Option<SmpError> {
        let inner = self.inner.as_ref()?;
        let message = inner
            .failure()
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()?;
        Some(SmpError::TensorParallel(message))
    }

    /// Records a misuse found inside a layer (which cannot return an error).
    pub(crate) fn poison(&self, message: String) {
        match &self.inner {
            Some(inner) => poison(inner.failure(), message),
            None => MISUSE.with(|m| {
                m.borrow_mut().get_or_insert(message);
            }),
        }
    }

    /// Checks, in a layer's forward, that the layer was built with the group of the engine
    /// running it (a layer built with [`TpGroup::single`] inside a tensor-parallel engine would
    /// silently compute on a wrong split). Misuse is recorded as a failure.
    pub(crate) fn check(&self) {
        if let Some((id, degree)) = ACTIVE.with(|a| a.get())
            && id != self.id
            && (degree > 1 || self.degree() > 1)
        {
            self.poison(format!(
                "a layer built with a tensor-parallel group of degree {} runs in an engine of \
                 degree {degree}: build the model's layers with the mesh's group (mesh.tp())",
                self.degree()
            ));
        }
    }

    /// Marks this group as the one the engine runs units with on this thread until the guard
    /// drops.
    pub(crate) fn activate(&self) -> ActiveGroup {
        let previous = ACTIVE.with(|a| a.replace(Some((self.id, self.degree()))));
        ActiveGroup { previous }
    }

    /// The misuse recorded by a layer of a degree-1 group on this thread, if any.
    pub(crate) fn take_misuse() -> Option<SmpError> {
        MISUSE
            .with(|m| m.borrow_mut().take())
            .map(SmpError::TensorParallel)
    }

    /// Vocab-parallel cross-entropy through the erased context (degree > 1).
    pub(crate) fn vocab_cross_entropy(
        &self,
        args: cross_entropy::BoxedArgs,
    ) -> Result<Box<dyn Any>, Option<SmpError>> {
        let inner = self.inner.as_ref().ok_or(None)?;
        match inner.vocab_cross_entropy(args) {
            Ok(Ok(out)) => Ok(out),
            Ok(Err(e)) => Err(Some(e)),
            Err(_) => Err(Some(SmpError::TensorParallel(String::from(
                "vocab_parallel_cross_entropy: the tensors' backend is not the group's",
            )))),
        }
    }
}

thread_local! {
    /// Misuse found by layers of a degree-1 group, which has no shared failure slot.
    static MISUSE: std::cell::RefCell<Option<String>> = const { std::cell::RefCell::new(None) };
}

/// Restores the previously active group when dropped (see [`TpGroup::activate`]).
pub(crate) struct ActiveGroup {
    previous: Option<(u64, usize)>,
}

impl Drop for ActiveGroup {
    fn drop(&mut self) {
        ACTIVE.with(|a| a.set(self.previous));
    }
}

fn backend_mismatch<B: Backend>() -> String {
    format!(
        "the tensor-parallel group was made for another backend than {} (tensor parallelism \
         needs the mesh's backend, or Burn's Autodiff over it without a checkpointing strategy)",
        std::any::type_name::<B>()
    )
}

/// `len / degree`, or an error naming `what`, `len` and the degree when it does not divide.
pub fn split_len(what: &str, len: usize, degree: usize) -> Result<usize, SmpError> {
    if degree == 0 || !len.is_multiple_of(degree) {
        return Err(SmpError::Config(format!(
            "{what} {len} is not divisible by tensor_parallel_degree {degree}"
        )));
    }
    Ok(len / degree)
}
