//! Sharded data parallelism (FSDP / ZeRO-3) for any Burn module.
//!
//! A model is cut into *units* (a transformer block for Llama; any sub-module elsewhere). Each
//! unit's parameters are flattened in the module's visiting order into one buffer, padded to a
//! multiple of the shard degree, and each rank keeps only its contiguous chunk of it: the fp32
//! master weights, the fp32 gradient and AdamW's two moments. A unit's full parameters exist
//! only while it runs: [`ShardedUnit::gather`] all-gathers them (in the compute dtype) into a
//! copy of the unit's module, and [`ShardedUnit::accumulate_grads`] reduce-scatters the
//! gradients of that copy back into the shard (all-reducing across replicas in hybrid mode).
//! With prefetch the reduce-scatter is only started there and [`ShardedUnit::finish_grads`]
//! adds its result, so that it runs beside the backward of the unit before.
//!
//! One all-gather and one reduce-scatter per unit, however many tensors it has: the flat buffer
//! is the bucketing that keeps small tensors from each paying a collective's latency.
//!
//! ```
//! use std::sync::Arc;
//! use burn::module::{Module, Param};
//! use burn::tensor::{Tensor, backend::Backend};
//! use burn_ndarray::NdArray;
//! use burn::backend::Autodiff;
//! use collectives::{CommOptions, run_on_threads};
//! use smp_burn::{HostTensorComm, ParallelConfig, fsdp::{FsdpContext, ShardedUnit}, init::{InitRule, init_values}};
//!
//! #[derive(Module, Debug)]
//! struct Layer<B: Backend> { weight: Param<Tensor<B, 2>> }
//!
//! type B = Autodiff<NdArray<f32>>;
//! let losses = run_on_threads(2, CommOptions::default(), |comm| {
//!     let dev = Default::default();
//!     let ctx = FsdpContext::<NdArray<f32>>::new(
//!         Arc::new(HostTensorComm::new(comm)), None, &ParallelConfig::default());
//!     // The template's parameters are lazy: building it allocates nothing.
//!     let template = Layer::<B> { weight: burn::module::Initializer::Zeros.init([4, 4], &dev) };
//!     let mut unit = ShardedUnit::new("layer", template, &ctx, &dev, |p, range| {
//!         init_values(0, &p.name, InitRule::Normal { std: 0.1 }, range)
//!     }).unwrap();
//!     let layer = unit.gather(&ctx, true).unwrap();
//!     let x = Tensor::<B, 2>::ones([2, 4], &dev);
//!     let loss = x.matmul(layer.weight.val()).square().mean();
//!     let grads = loss.backward();
//!     unit.accumulate_grads(&layer, &grads, &ctx, false).unwrap();
//!     loss.into_scalar()
//! });
//! assert_eq!(losses[0], losses[1]);
//! ```

use std::collections::HashSet;
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::{
    DType, FloatDType, Tensor, TensorData,
    backend::{AutodiffBackend, Backend},
};
use collectives::ReduceOp;

use crate::comm::{PendingCollective, PendingGather, TensorComm};
use crate::config::ParallelConfig;
use crate::error::SmpError;
use crate::init::{InitSlice, normal_values};
pub use crate::optim::{AdamW, MomentDtype};
use crate::optim::{Group, Optimizer, RunRates, RunState, ShardOptimizer};

/// Communication and precision settings shared by every unit of a model on one rank.
#[derive(Debug, Clone)]
pub struct FsdpContext<IB: Backend> {
    /// The group a parameter is sharded across.
    pub shard: Arc<dyn TensorComm<IB>>,
    /// The group across which shards are replicated (hybrid sharding); `None` = full sharding.
    pub replicate: Option<Arc<dyn TensorComm<IB>>>,
    /// Dtype of gathered parameters (the compute dtype).
    pub param_dtype: FloatDType,
    /// Dtype gradients are reduced in.
    pub reduce_dtype: FloatDType,
    /// Overlap collectives with compute in both directions (`prefetch_depth` 1): start the next
    /// unit's all-gather before the current unit runs, and leave a unit's gradient
    /// reduce-scatter pending (see [`ShardedUnit::accumulate_grads`]) while the previous unit's
    /// backward is queued.
    pub prefetch: bool,
    stats: Arc<std::sync::Mutex<CommStats>>,
}

/// Time and bytes spent in collectives on this rank since the last [`FsdpContext::take_stats`].
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CommStats {
    /// Wall time spent inside collective calls on the host. On CUDA the calls only queue work,
    /// so this is mostly the host waiting for CubeCL's launch queue when it runs ahead of the
    /// GPU, not exposed communication.
    pub wait: Duration,
    /// Number of collective calls.
    pub calls: u64,
    /// Device time the collectives ran (NCCL, timed with CUDA events); `None` where the
    /// communicator does not measure it. With `prefetch_depth` 1 part of it runs beside
    /// compute.
    pub device: Option<Duration>,
}

impl<IB: Backend> FsdpContext<IB> {
    /// A context for one rank: `shard` is this rank's shard group, `replicate` its replica group
    /// in hybrid sharding.
    pub fn new(
        shard: Arc<dyn TensorComm<IB>>,
        replicate: Option<Arc<dyn TensorComm<IB>>>,
        config: &ParallelConfig,
    ) -> Self {
        let replicate = replicate.filter(|r| r.world_size() > 1);
        Self {
            shard,
            replicate,
            param_dtype: config.param_dtype.dtype(),
            reduce_dtype: config.reduce_dtype.dtype(),
            prefetch: config.prefetch_depth > 0,
            stats: Default::default(),
        }
    }

    /// Returns the collective statistics gathered so far and resets them.
    pub fn take_stats(&self) -> CommStats {
        let mut stats = std::mem::take(&mut *self.stats.lock().expect("stats lock"));
        let mut device: Option<Duration> = None;
        for comm in std::iter::once(&self.shard).chain(self.replicate.as_ref()) {
            match comm.take_device_time() {
                Ok(Some(d)) => *device.get_or_insert(Duration::ZERO) += d,
                Ok(None) => {}
                Err(e) => tracing::warn!("timing collectives: {e}"),
            }
        }
        stats.device = device;
        stats
    }

    fn timed<T>(&self, f: impl FnOnce() -> Result<T, SmpError>) -> Result<T, SmpError> {
        let start = Instant::now();
        let out = f();
        let mut stats = self.stats.lock().expect("stats lock");
        stats.wait += start.elapsed();
        stats.calls += 1;
        out
    }

    /// Sum of `value` over the shard group (replicas hold identical shards, so they are not
    /// summed again). Used for the global gradient norm.
    pub fn sum_over_shards(&self, value: Tensor<IB, 1>) -> Result<Tensor<IB, 1>, SmpError> {
        if self.shard.world_size() == 1 {
            return Ok(value);
        }
        self.timed(|| self.shard.all_reduce(value, ReduceOp::Sum))
    }

    /// Mean of `value` over every data-parallel rank (shard group x replicas); for logging
    /// the loss.
    pub fn mean_over_data_parallel(&self, value: Tensor<IB, 1>) -> Result<Tensor<IB, 1>, SmpError> {
        let mut v = value;
        if self.shard.world_size() > 1 {
            v = self.timed(|| self.shard.all_reduce(v, ReduceOp::Avg))?;
        }
        if let Some(rep) = &self.replicate {
            v = self.timed(|| rep.all_reduce(v, ReduceOp::Avg))?;
        }
        Ok(v)
    }
}

/// One parameter's place in its unit's flat buffer.
#[derive(Debug, Clone, PartialEq)]
pub struct FlatParam {
    /// Path inside the unit, e.g. `self_attn.q_proj.weight`.
    pub name: String,
    /// The parameter's shape (this rank's slice under tensor parallelism).
    pub shape: Vec<usize>,
    /// First element in the flat buffer.
    pub offset: usize,
    /// Elements.
    pub numel: usize,
    /// Burn's id of the parameter (shared by the uses of a tied parameter).
    pub id: ParamId,
    /// The type of the module that holds it directly, as Burn's visitor names it
    /// (`Struct:ColumnParallelLinear`): what tensor parallelism reads its placement from.
    pub container: String,
}

/// How a unit's parameters are laid out in its flat buffer.
#[derive(Debug, Clone, PartialEq)]
pub struct FlatLayout {
    /// The parameters, in the module's visiting order.
    pub params: Vec<FlatParam>,
    /// Elements of all parameters.
    pub numel: usize,
    /// `numel` rounded up to a multiple of the shard degree.
    pub padded: usize,
}

impl FlatLayout {
    /// The layout of `module`'s float parameters for a shard group of `shard_degree` ranks.
    /// Reads only shapes: lazy parameters stay unallocated.
    pub fn of<B: Backend, M: Module<B>>(module: &M, shard_degree: usize) -> Self {
        Self::of_excluding(module, shard_degree, &HashSet::new())
    }

    /// [`Self::of`] without the parameters in `exclude` (tied parameters that live in a unit
    /// of their own).
    pub fn of_excluding<B: Backend, M: Module<B>>(
        module: &M,
        shard_degree: usize,
        exclude: &HashSet<ParamId>,
    ) -> Self {
        struct Collect<'a> {
            path: Vec<String>,
            containers: Vec<String>,
            params: Vec<FlatParam>,
            offset: usize,
            exclude: &'a HashSet<ParamId>,
        }
        impl<B: Backend> ModuleVisitor<B> for Collect<'_> {
            fn enter_module(&mut self, name: &str, container: &str) {
                self.path.push(name.to_string());
                self.containers.push(container.to_string());
            }
            fn exit_module(&mut self, _: &str, _: &str) {
                self.path.pop();
                self.containers.pop();
            }
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                if self.exclude.contains(&param.id) {
                    return;
                }
                let shape = param.lazy_shape().to_vec();
                let numel = shape.iter().product();
                // Burn enters a field with the type of the struct that has it.
                let container = self.containers.last().cloned().unwrap_or_default();
                self.params.push(FlatParam {
                    name: self.path.join("."),
                    shape,
                    offset: self.offset,
                    numel,
                    id: param.id,
                    container,
                });
                self.offset += numel;
            }
        }
        let mut c = Collect {
            path: vec![],
            containers: vec![],
            params: vec![],
            offset: 0,
            exclude,
        };
        module.visit(&mut c);
        let numel = c.offset;
        let padded = numel.div_ceil(shard_degree) * shard_degree;
        Self {
            params: c.params,
            numel,
            padded: padded.max(shard_degree),
        }
    }

    /// Elements each rank holds.
    pub fn shard_len(&self, shard_degree: usize) -> usize {
        self.padded / shard_degree
    }

    /// The flat range rank `rank` holds.
    pub fn shard_range(&self, rank: usize, shard_degree: usize) -> Range<usize> {
        let len = self.shard_len(shard_degree);
        rank * len..(rank + 1) * len
    }
}

/// Parameters a unit takes from elsewhere at assembly (tied parameters), by id: tensors of the
/// autodiff backend, of any rank.
#[derive(Default)]
pub struct ExternalParams {
    values: std::collections::HashMap<ParamId, Box<dyn std::any::Any>>,
}

impl std::fmt::Debug for ExternalParams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExternalParams")
            .field("count", &self.values.len())
            .finish()
    }
}

impl ExternalParams {
    /// Supplies `value` for the parameter `id`.
    pub fn insert<B: Backend, const D: usize>(&mut self, id: ParamId, value: Tensor<B, D>) {
        self.values.insert(id, Box::new(value));
    }

    /// The value supplied for `id`, if it is a `Tensor<B, D>`.
    pub fn get<B: Backend, const D: usize>(&self, id: ParamId) -> Option<Tensor<B, D>> {
        self.values
            .get(&id)?
            .downcast_ref::<Tensor<B, D>>()
            .cloned()
    }
}

/// Partial sums of a gradient's squares and each parameter's range of them.
type SqPartials<IB> = (Tensor<IB, 1>, Vec<Range<usize>>);

/// A unit whose parameters, gradients and optimizer state are sharded across a group.
#[derive(Debug)]
pub struct ShardedUnit<B: AutodiffBackend, M: Module<B>> {
    /// Name of the unit (its path in the model), for messages and checkpoints.
    pub name: String,
    template: M,
    layout: FlatLayout,
    rank: usize,
    degree: usize,
    /// fp32 master weights of this rank's chunk.
    master: Tensor<B::InnerBackend, 1>,
    /// The master chunk in the compute dtype as the fused AdamW last wrote it (the next
    /// gather's input, sparing a cast that reads the f32 chunk again); `None` after anything
    /// else changes the master weights.
    compute: Option<Tensor<B::InnerBackend, 1>>,
    /// The compute dtype of the gathered parameters.
    param_dtype: FloatDType,
    grad: Option<Tensor<B::InnerBackend, 1>>,
    /// Partial sums of the squares of `grad`, from the packing kernel, and each parameter's
    /// range of them (CUDA, units with nothing to reduce): the gradient norm without reading
    /// `grad` again. `None` whenever `grad` has changed since.
    grad_sq_partials: Option<SqPartials<B::InnerBackend>>,
    deferred_full_grad: Option<Tensor<B::InnerBackend, 1>>,
    /// The reduce-scatter of the last gradients, started but not yet added to `grad` (prefetch
    /// only). It keeps the unit's full-size gradient alive until [`Self::finish_grads`].
    pending_grad: Option<PendingCollective<B::InnerBackend>>,
    /// AdamW's first and second moments of this rank's chunk; `None` under another optimizer.
    moments: Option<[Tensor<B::InnerBackend, 1>; 2]>,
    /// The dtype the moments are kept in ([`Self::set_moment_dtype`]).
    moment_dtype: MomentDtype,
    /// Another optimizer's state, one entry per run of [`Self::group_runs`].
    run_states: Vec<Option<RunState>>,
    /// Each parameter's optimizer group, in layout order.
    groups: Vec<Group>,
    /// Parameters of the template that live in another unit (tied parameters): left out of the
    /// flat buffer, supplied at assembly, their gradients left to that unit.
    external: HashSet<ParamId>,
    /// Names this unit's weight-gradient targets (see [`Self::keep_grads_in_graph`]).
    id: u64,
    /// Parameters whose gradients must reach the autodiff gradients even when accumulating
    /// ([`Self::keep_grads_in_graph`]).
    grads_in_graph: HashSet<ParamId>,
}

impl<B: AutodiffBackend, M: Module<B>> Drop for ShardedUnit<B, M> {
    fn drop(&mut self) {
        // A step cut short leaves weight-gradient targets holding the gradient sum.
        crate::fast::forget_weight_grad_targets(self.id);
    }
}

/// The next [`ShardedUnit`]'s id.
static NEXT_UNIT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

impl<B: AutodiffBackend, M: Module<B>> ShardedUnit<B, M> {
    /// Shards `template` (whose parameters may be lazy and are never materialized here) across
    /// `ctx.shard`. `init(param, range)` returns the values of elements `range` of a parameter
    /// (a `Vec<f32>`, or an [`InitSlice`] describing a seeded normal draw, which a GPU draws
    /// itself), so each rank creates only its own chunk.
    pub fn new<V>(
        name: impl Into<String>,
        template: M,
        ctx: &FsdpContext<B::InnerBackend>,
        device: &B::Device,
        init: impl Fn(&FlatParam, Range<usize>) -> V,
    ) -> Result<Self, SmpError>
    where
        V: Into<InitSlice>,
    {
        Self::new_excluding(name, template, ctx, device, HashSet::new(), init)
    }

    /// [`Self::new`] leaving out the parameters in `external`, which another unit holds (tied
    /// parameters): [`Self::assemble_with`] supplies them.
    pub fn new_excluding<V>(
        name: impl Into<String>,
        template: M,
        ctx: &FsdpContext<B::InnerBackend>,
        device: &B::Device,
        external: HashSet<ParamId>,
        init: impl Fn(&FlatParam, Range<usize>) -> V,
    ) -> Result<Self, SmpError>
    where
        V: Into<InitSlice>,
    {
        let degree = ctx.shard.world_size();
        let rank = ctx.shard.rank();
        let layout = FlatLayout::of_excluding::<B, M>(&template, degree, &external);
        let name = name.into();
        if layout.params.is_empty() && FlatLayout::of::<B, M>(&template, 1).params.is_empty() {
            // Legal (a unit of parameter-free layers), but far more often a module whose
            // parameters Burn does not visit: `derive(Module)` finds them only through a
            // backend generic named `B`.
            tracing::warn!(
                "unit {name}: the module has no float parameters to shard; if it should, check \
                 that its struct's backend generic is named `B` (Burn's derive(Module) visits \
                 parameters only through a generic of that name)"
            );
        }
        let range = layout.shard_range(rank, degree);
        let init = |p: &FlatParam, r: Range<usize>| init(p, r).into();
        let master = upload_shard::<B::InnerBackend>(&layout, range, &init, device)?;
        let zeros = master.zeros_like();
        let default_decay = AdamW::default().weight_decay;
        let groups = layout
            .params
            .iter()
            .map(|p| {
                if p.shape.len() >= 2 {
                    Group::decay(default_decay)
                } else {
                    Group::no_decay()
                }
            })
            .collect();
        Ok(Self {
            name,
            template,
            layout,
            rank,
            degree,
            master,
            compute: None,
            param_dtype: ctx.param_dtype,
            grad: None,
            grad_sq_partials: None,
            deferred_full_grad: None,
            pending_grad: None,
            moments: Some([zeros.clone(), zeros]),
            moment_dtype: MomentDtype::F32,
            run_states: Vec::new(),
            groups,
            external,
            id: NEXT_UNIT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            grads_in_graph: HashSet::new(),
        })
    }

    /// Keeps the gradients of `params` in the autodiff gradients, where a caller reads them
    /// before [`Self::accumulate_grads`] (tensor parallelism sums its replicated parameters'
    /// across the group there).
    ///
    /// Why it is needed: from the second micro-batch of an accumulation step on, a weight
    /// matrix's gradient GEMM adds straight into this unit's f32 gradient sum (on CUDA;
    /// Megatron's gradient-accumulation fusion), so its gradient never appears in the autodiff
    /// gradients.
    pub fn keep_grads_in_graph(&mut self, params: impl IntoIterator<Item = ParamId>) {
        self.grads_in_graph.extend(params);
    }

    /// Sets each parameter's optimizer group (in layout order).
    ///
    /// # Errors
    /// When the count differs from the layout's parameters.
    pub fn set_groups(&mut self, groups: Vec<Group>) -> Result<(), SmpError> {
        if groups.len() != self.layout.params.len() {
            return Err(SmpError::Usage(format!(
                "unit {}: {} parameter groups for {} parameters",
                self.name,
                groups.len(),
                self.layout.params.len()
            )));
        }
        self.groups = groups;
        Ok(())
    }

    /// Each parameter's optimizer group, in layout order.
    pub fn groups(&self) -> &[Group] {
        &self.groups
    }

    /// Keeps AdamW's moments in `dtype` from now on (they are converted, values rounded to
    /// nearest). Where the backend has no bf16 tensors they stay f32 holding bf16-rounded
    /// values (see [`MomentDtype`]).
    pub fn set_moment_dtype(&mut self, dtype: MomentDtype) {
        self.moment_dtype = dtype;
        if let Some(moments) = self.moments.take() {
            self.moments = Some(moments.map(|t| self.stored_moment(t)));
        }
    }

    /// `t` (any float dtype) as this unit keeps a moment: f32, or rounded to bf16 (stored as
    /// bf16 where the backend has it).
    fn stored_moment(&self, t: Tensor<B::InnerBackend, 1>) -> Tensor<B::InnerBackend, 1> {
        match self.moment_dtype {
            MomentDtype::F32 => t.cast(FloatDType::F32),
            MomentDtype::Bf16 => {
                if B::InnerBackend::supports_dtype(&t.device(), DType::BF16) {
                    t.cast(FloatDType::BF16)
                } else {
                    let device = t.device();
                    let n = t.dims()[0];
                    let values: Vec<f32> = t
                        .into_data()
                        .convert::<f32>()
                        .to_vec()
                        .expect("a float tensor reads as f32");
                    let rounded: Vec<f32> = values
                        .into_iter()
                        .map(|v| burn::tensor::bf16::from_f32(v).to_f32())
                        .collect();
                    Tensor::from_data(TensorData::new(rounded, [n]), &device)
                }
            }
        }
    }

    /// Frees AdamW's moments: another optimizer steps this unit (its state is made on the first
    /// step).
    pub fn use_custom_optimizer(&mut self) {
        self.moments = None;
        self.run_states.clear();
    }

    /// The template the unit was built from (lazy parameters; shapes only).
    pub fn template(&self) -> &M {
        &self.template
    }

    /// The flat layout of this unit.
    pub fn layout(&self) -> &FlatLayout {
        &self.layout
    }

    /// Drops the unit's hold on the compute-dtype weights AdamW wrote for the next forward,
    /// when the unit is not sharded (its gather is that very buffer): once the module gathered
    /// from it and the graph let go of it too, its memory serves the rest of the step. A gather
    /// before the next optimizer step casts the master weights again.
    pub fn release_compute_copy(&mut self) {
        if self.degree == 1 {
            self.compute = None;
        }
    }

    /// The module with full parameters, all-gathered in the compute dtype. With `track_grad`
    /// every parameter is an autodiff leaf whose gradient [`Self::accumulate_grads`] collects.
    pub fn gather(
        &self,
        ctx: &FsdpContext<B::InnerBackend>,
        track_grad: bool,
    ) -> Result<M, SmpError> {
        let full = self.start_gather(ctx)?.wait()?;
        Ok(self.assemble(full, track_grad))
    }

    /// The module with the full fp32 master weights (no gradient), with the parameters this
    /// unit leaves to another taken from `external`: the trained values for Burn's own tools.
    pub fn gather_master(
        &self,
        ctx: &FsdpContext<B::InnerBackend>,
        external: &ExternalParams,
    ) -> Result<M, SmpError> {
        self.assert_grads_finished("gather_master");
        let full = if self.degree == 1 {
            self.master.clone()
        } else {
            ctx.timed(|| ctx.shard.all_gather(self.master.clone()))?
        };
        Ok(self.assemble_with(full, false, external))
    }

    /// [`Self::gather`] with the parameters this unit leaves to another taken from `external`.
    pub fn gather_with(
        &self,
        ctx: &FsdpContext<B::InnerBackend>,
        track_grad: bool,
        external: &ExternalParams,
    ) -> Result<M, SmpError> {
        let full = self.start_gather(ctx)?.wait()?;
        Ok(self.assemble_with(full, track_grad, external))
    }

    /// Starts gathering the full flat parameters in the compute dtype (see
    /// [`TensorComm::all_gather_start`]); [`Self::assemble`] turns the waited result into the
    /// module. Queuing other work between the two lets it run beside the gather on CUDA.
    pub fn start_gather(
        &self,
        ctx: &FsdpContext<B::InnerBackend>,
    ) -> Result<PendingGather<B::InnerBackend>, SmpError> {
        let shard = match &self.compute {
            Some(c) if c.dtype() == DType::from(ctx.param_dtype) => c.clone(),
            _ => self.master.clone().cast(ctx.param_dtype),
        };
        if self.degree == 1 {
            Ok(PendingGather::ready(shard))
        } else {
            ctx.timed(|| ctx.shard.all_gather_start(shard))
        }
    }

    /// The module with the parameters of `full` (from [`Self::start_gather`]); with
    /// `track_grad` every parameter is an autodiff leaf.
    pub fn assemble(&self, full: Tensor<B::InnerBackend, 1>, track_grad: bool) -> M {
        self.assemble_with(full, track_grad, &ExternalParams::default())
    }

    /// [`Self::assemble`] with the parameters this unit leaves to another (tied parameters)
    /// taken from `external`.
    ///
    /// # Panics
    /// When `external` lacks one of them (the engine supplies every one).
    pub fn assemble_with(
        &self,
        full: Tensor<B::InnerBackend, 1>,
        track_grad: bool,
        external: &ExternalParams,
    ) -> M {
        self.unflatten(full, track_grad, external, false)
    }

    /// [`Self::assemble_with`], the module's vector parameters (norm scales, biases) copied
    /// into buffers of their own rather than views of `full`. A graph that keeps them (a norm's
    /// backward reads its scale) then does not keep `full` alive: where nothing reads the
    /// matrices after the forward either (FP8 layers that keep their weights' FP8 copies),
    /// `full` is freed once the module's own values are dropped.
    pub fn assemble_with_own_vectors(
        &self,
        full: Tensor<B::InnerBackend, 1>,
        track_grad: bool,
        external: &ExternalParams,
    ) -> M {
        self.unflatten(full, track_grad, external, true)
    }

    fn unflatten(
        &self,
        full: Tensor<B::InnerBackend, 1>,
        track_grad: bool,
        external: &ExternalParams,
        own_vectors: bool,
    ) -> M {
        struct Unflatten<'a, IB: Backend> {
            full: Tensor<IB, 1>,
            layout: &'a FlatLayout,
            next: usize,
            track_grad: bool,
            own_vectors: bool,
            leave: &'a HashSet<ParamId>,
            external: &'a ExternalParams,
            /// The f32 gradient sum of earlier micro-batches, which the weights' gradient GEMMs
            /// add into, and the unit's id naming those targets.
            grad_sum: Option<(&'a Tensor<IB, 1>, u64)>,
            grads_in_graph: &'a HashSet<ParamId>,
        }
        impl<B: AutodiffBackend> ModuleMapper<B> for Unflatten<'_, B::InnerBackend> {
            fn map_float<const D: usize>(
                &mut self,
                param: Param<Tensor<B, D>>,
            ) -> Param<Tensor<B, D>> {
                if self.leave.contains(&param.id) {
                    let t = self
                        .external
                        .get::<B, D>(param.id)
                        .expect("the engine supplies every tied parameter");
                    return Param::initialized(param.id, t);
                }
                let spec = &self.layout.params[self.next];
                self.next += 1;
                let dims: [usize; D] = spec
                    .shape
                    .clone()
                    .try_into()
                    .expect("rank recorded by layout");
                let mut inner = self
                    .full
                    .clone()
                    .narrow(0, spec.offset, spec.numel)
                    .reshape(dims);
                if self.own_vectors && D == 1 {
                    // A new buffer: `full` still holds the view's storage, so the product
                    // cannot be written in place.
                    inner = inner.mul_scalar(1.0);
                }
                let mut t = Tensor::<B, D>::from_inner(inner);
                if self.track_grad {
                    t = t.require_grad();
                    if let Some((sum, owner)) = self.grad_sum.filter(|_| D == 2)
                        && !self.grads_in_graph.contains(&param.id)
                    {
                        crate::fast::add_weight_grad_into(&t, sum, spec.offset, owner);
                    }
                }
                // The template's own (lazy) value is dropped without ever being created.
                Param::initialized(param.id, t)
            }
        }
        let mut mapper = Unflatten {
            full,
            layout: &self.layout,
            next: 0,
            track_grad,
            own_vectors,
            leave: &self.external,
            external,
            grad_sum: self.deferred_full_grad.as_ref().map(|sum| (sum, self.id)),
            grads_in_graph: &self.grads_in_graph,
        };
        self.template.clone().map(&mut mapper)
    }

    /// Collects the gradients of a module returned by [`Self::gather`] from `grads`,
    /// reduce-scatters them across the shard group (mean over ranks) and, in hybrid mode,
    /// all-reduces them across replicas, adding the result to this rank's gradient shard.
    ///
    /// With `defer`, the full gradient is only accumulated locally (FSDP's `no_sync`, for all but
    /// the last micro-batch of an accumulation step); the next call without `defer` reduces the
    /// sum once.
    ///
    /// With `ctx.prefetch` the reduce-scatter is only started (on CUDA it then runs beside the
    /// kernels queued next, the previous unit's backward) and [`Self::finish_grads`] adds the
    /// result, so the caller must call it before the gradient is read. Because a pending
    /// reduce-scatter keeps the full-size gradient alive, the caller should finish each unit
    /// once the next one's reduce-scatter has started, bounding the pending ones to two. A
    /// reduce still pending from an earlier call is finished first.
    pub fn accumulate_grads(
        &mut self,
        module: &M,
        grads: &B::Gradients,
        ctx: &FsdpContext<B::InnerBackend>,
        defer: bool,
    ) -> Result<(), SmpError> {
        self.finish_grads(ctx)?;
        struct Grads<'a, B: AutodiffBackend> {
            grads: &'a B::Gradients,
            /// Each parameter's gradient; `None` where a GEMM already added it into the sum.
            pieces: Vec<Option<Tensor<B::InnerBackend, 1>>>,
            layout: &'a FlatLayout,
            device: Option<B::Device>,
            leave: &'a HashSet<ParamId>,
        }
        impl<B: AutodiffBackend> ModuleVisitor<B> for Grads<'_, B> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                if self.leave.contains(&param.id) {
                    return;
                }
                let value = param.val();
                let spec = &self.layout.params[self.pieces.len()];
                let device = value.device();
                let added = crate::fast::weight_grad_added(&value);
                // Kept in the compute dtype: the packing casts (one pass, not two).
                let piece = match value.grad(self.grads) {
                    // Another use's share (a tied weight) is still added.
                    Some(g) => Some(g.reshape([spec.numel])),
                    None if added => None,
                    // A parameter the step did not use has a zero gradient.
                    None => Some(Tensor::zeros([spec.numel], &device)),
                };
                self.device = Some(device);
                self.pieces.push(piece);
            }
        }
        let mut collect = Grads::<B> {
            grads,
            pieces: Vec::new(),
            layout: &self.layout,
            device: None,
            leave: &self.external,
        };
        module.visit(&mut collect);
        crate::fast::forget_weight_grad_targets(self.id);
        // A unit whose only parameters are tied ones (a stem holding just the shared
        // embedding) has nothing of its own; its zero gradient still takes part in the
        // collectives so that every rank issues the same ones.
        let device = collect
            .device
            .clone()
            .unwrap_or_else(|| self.master.device());
        // Without a group to reduce over and nothing to add to, the flat gradient can stay in
        // the compute dtype: the same values, half the bytes written here and read again by the
        // gradient norm and AdamW (about 2 ms of a 1.2B model's step on one H200).
        let unreduced = self.degree == 1
            && ctx.replicate.is_none()
            && !defer
            && self.deferred_full_grad.is_none()
            && self.grad.is_none();
        // An earlier micro-batch's gradient (f32, deferred): the pieces are added into it in
        // one pass each where the kernels serve them, instead of packed and then added; those
        // a GEMM already added into it are skipped.
        let mut prev = self.deferred_full_grad.take();
        if let Some(acc) = prev.take() {
            let rest: Vec<_> = (self.layout.params.iter())
                .zip(&collect.pieces)
                .filter_map(|(spec, piece)| piece.clone().map(|p| (spec.offset, p)))
                .collect();
            let sum = if rest.is_empty() {
                Ok(acc)
            } else {
                crate::fast::pack_add(rest, acc).map_err(|(_, acc)| acc)
            };
            match sum {
                Ok(sum) => return self.accumulated(sum, ctx, defer, unreduced),
                Err(acc) => prev = Some(acc),
            }
        }
        // Only a GEMM serving the fused path skips a piece, and that path's packing kernels
        // took them above; a zero keeps the layout here regardless.
        let pieces: Vec<_> = (self.layout.params.iter())
            .zip(collect.pieces)
            .map(|(spec, piece)| piece.unwrap_or_else(|| Tensor::zeros([spec.numel], &device)))
            .collect();
        let piece_dtype = pieces.first().map(|p| p.dtype());
        let flat_dtype = match piece_dtype {
            Some(d) if unreduced && pieces.iter().all(|p| p.dtype() == d) => d,
            _ => DType::F32,
        };
        // The packing can sum the squares on the way only when the packed buffer is the
        // gradient the norm reads: nothing to reduce and nothing to add.
        let mut pieces = pieces;
        if unreduced && !pieces.is_empty() {
            match crate::fast::pack_with_sq_sums(pieces, self.layout.padded, flat_dtype) {
                Ok((full, partials, ranges)) => {
                    self.add_grad_shard(full, ctx, true)?;
                    self.grad_sq_partials = Some((partials, ranges));
                    return Ok(());
                }
                Err(back) => pieces = back,
            }
        }
        let packed = if pieces.is_empty() {
            Ok(Tensor::zeros([self.layout.padded], &device))
        } else {
            crate::fast::pack(pieces, self.layout.padded, flat_dtype)
        };
        let mut full = match packed {
            Ok(full) => full,
            Err(pieces) => {
                let mut pieces: Vec<_> = pieces
                    .into_iter()
                    .map(|p| p.cast(FloatDType::F32))
                    .collect();
                if self.layout.padded > self.layout.numel {
                    pieces.push(Tensor::zeros(
                        [self.layout.padded - self.layout.numel],
                        &device,
                    ));
                }
                Tensor::cat(pieces, 0)
            }
        };
        if let Some(prev) = prev {
            full = full + prev;
        }
        self.accumulated(full, ctx, defer, unreduced)
    }

    /// The rest of [`Self::accumulate_grads`] once `full` holds every gradient of the step so
    /// far: kept for a later micro-batch (`defer`), or reduced (unless `unreduced`: no group
    /// and nothing added) and added to the shard.
    fn accumulated(
        &mut self,
        full: Tensor<B::InnerBackend, 1>,
        ctx: &FsdpContext<B::InnerBackend>,
        defer: bool,
        unreduced: bool,
    ) -> Result<(), SmpError> {
        if defer {
            self.deferred_full_grad = Some(full);
            return Ok(());
        }
        if unreduced {
            return self.add_grad_shard(full, ctx, true);
        }
        let full = full.cast(ctx.reduce_dtype);
        if self.degree == 1 {
            return self.add_grad_shard(full, ctx, false);
        }
        if ctx.prefetch {
            self.pending_grad =
                Some(ctx.timed(|| ctx.shard.reduce_scatter_start(full, ReduceOp::Avg))?);
            return Ok(());
        }
        let shard = ctx.timed(|| ctx.shard.reduce_scatter(full, ReduceOp::Avg))?;
        self.add_grad_shard(shard, ctx, false)
    }

    /// Waits for the reduce-scatter [`Self::accumulate_grads`] left pending (prefetch) and adds
    /// its result to the gradient shard, all-reducing it across replicas first in hybrid mode
    /// (synchronously, here). Does nothing when none is pending. Every rank of the group must
    /// finish its units in the same order, since the replica all-reduce is a collective.
    pub fn finish_grads(&mut self, ctx: &FsdpContext<B::InnerBackend>) -> Result<(), SmpError> {
        match self.pending_grad.take() {
            Some(pending) => {
                let shard = pending.wait()?;
                self.add_grad_shard(shard, ctx, false)
            }
            None => Ok(()),
        }
    }

    /// Whether a reduce-scatter of this unit's gradients awaits [`Self::finish_grads`].
    pub fn has_pending_grads(&self) -> bool {
        self.pending_grad.is_some()
    }

    /// Adds a reduce-scattered gradient shard (in the reduce dtype) to `grad`, averaged over
    /// the replicas first in hybrid mode. The gradient is kept in f32, or, with `keep_dtype`
    /// and no gradient yet, in the shard's own dtype (a later addition widens it to f32).
    fn add_grad_shard(
        &mut self,
        mut shard: Tensor<B::InnerBackend, 1>,
        ctx: &FsdpContext<B::InnerBackend>,
        keep_dtype: bool,
    ) -> Result<(), SmpError> {
        if let Some(rep) = &ctx.replicate {
            shard = ctx.timed(|| rep.all_reduce(shard, ReduceOp::Avg))?;
        }
        self.grad_sq_partials = None;
        self.grad = Some(match self.grad.take() {
            Some(g) => g.cast(FloatDType::F32) + shard.cast(FloatDType::F32),
            None if keep_dtype => shard,
            None => shard.cast(FloatDType::F32),
        });
        Ok(())
    }

    /// Panics if a reduce-scatter is still pending: reading the gradient or saving state then
    /// would silently miss the last gradients (and reorder collectives between ranks).
    fn assert_grads_finished(&self, what: &str) {
        assert!(
            self.pending_grad.is_none(),
            "unit {}: {what} called while a gradient reduce-scatter is pending; call \
             ShardedUnit::finish_grads first",
            self.name
        );
    }

    /// This rank's chunk of the gradient summed since the last optimizer step (the flat
    /// layout's elements [`FlatLayout::shard_range`] of this rank; f32, or the compute dtype
    /// when nothing was reduced or added); `None` before the first [`Self::accumulate_grads`].
    ///
    /// # Panics
    /// If a reduce-scatter is still pending ([`Self::finish_grads`] first).
    pub fn grad_shard(&self) -> Option<Tensor<B::InnerBackend, 1>> {
        self.assert_grads_finished("grad_shard");
        self.grad.clone()
    }

    /// Sum of squares of this rank's gradient shard (a 1-element tensor; no host sync).
    pub fn grad_sq_sum(&self) -> Option<Tensor<B::InnerBackend, 1>> {
        self.assert_grads_finished("grad_sq_sum");
        let g = self.grad.as_ref()?;
        if let Some(sum) = self.partial_sq_sum(&|_| 1.0) {
            return Some(sum);
        }
        let whole = [(0..g.dims()[0], 1.0)];
        Some(
            crate::fast::weighted_sq_sum(g, &whole)
                .unwrap_or_else(|| g.clone().cast(FloatDType::F32).square().sum()),
        )
    }

    /// [`Self::grad_sq_sum`] with each parameter's squares multiplied by `weight(param)`. With
    /// tensor parallelism a parameter every tp rank holds whole (a norm weight) is weighted by
    /// `1 / tp`, so that summing over the tp group counts it once in the global norm, while each
    /// rank's slice of a split weight counts fully.
    pub fn grad_sq_sum_weighted(
        &self,
        weight: &dyn Fn(&FlatParam) -> f32,
    ) -> Option<Tensor<B::InnerBackend, 1>> {
        self.assert_grads_finished("grad_sq_sum_weighted");
        let g = self.grad.as_ref()?;
        if let Some(sum) = self.partial_sq_sum(weight) {
            return Some(sum);
        }
        let range = self.layout.shard_range(self.rank, self.degree);
        // Padding holds zeros; its weight does not matter.
        let runs = param_runs(&self.layout, range.clone(), weight, 0.0);
        if let Some(sum) = crate::fast::weighted_sq_sum(g, &runs) {
            return Some(sum);
        }
        let device = g.device();
        let w = build_shard::<B::InnerBackend>(&self.layout, range, &device, &|p, r| {
            Ok(Tensor::full([r.len()], weight(p), &device))
        })
        .expect("filling weights cannot fail");
        Some((g.clone().cast(FloatDType::F32).square() * w).sum())
    }

    /// The weighted sum of squares from the packing kernel's partial sums, when it left them.
    fn partial_sq_sum(
        &self,
        weight: &dyn Fn(&FlatParam) -> f32,
    ) -> Option<Tensor<B::InnerBackend, 1>> {
        let (partials, ranges) = self.grad_sq_partials.as_ref()?;
        // The parameters' ranges are back to back: neighbours of equal weight merge into one
        // run, so a unit takes one launch per run (two with tensor parallelism) instead of one
        // per parameter (48 launches instead of 225 for a Llama block).
        let mut runs = Vec::new();
        for (p, r) in self.layout.params.iter().zip(ranges) {
            push_run(&mut runs, r.clone(), weight(p));
        }
        crate::fast::weighted_sum(partials, &runs)
    }

    /// One optimizer step on this rank's shard, scaling the gradient by `grad_scale` (the
    /// clipping factor), then clears the gradient. `step` counts from 1; `lr` is scaled by each
    /// parameter group's `lr_scale`.
    ///
    /// # Errors
    /// A custom optimizer's failure, or AdamW asked of a unit whose moments were freed.
    pub fn optimizer_step(
        &mut self,
        optimizer: &Optimizer<B::InnerBackend>,
        lr: f64,
        step: u64,
        grad_scale: Tensor<B::InnerBackend, 1>,
    ) -> Result<(), SmpError> {
        match optimizer {
            Optimizer::AdamW(opt) => self.adamw_step(opt, lr, step, grad_scale),
            Optimizer::Custom(opt) => self.custom_step(opt.as_ref(), lr, grad_scale),
        }
    }

    /// One AdamW step on this rank's shard (see [`Self::optimizer_step`]).
    fn adamw_step(
        &mut self,
        opt: &AdamW,
        lr: f64,
        step: u64,
        grad_scale: Tensor<B::InnerBackend, 1>,
    ) -> Result<(), SmpError> {
        self.assert_grads_finished("adamw_step");
        self.grad_sq_partials = None;
        let Some(grad) = self.grad.take() else {
            return Ok(());
        };
        let Some([exp_avg, exp_avg_sq]) = self.moments.take() else {
            return Err(SmpError::Usage(format!(
                "unit {}: AdamW step on a unit whose AdamW state was freed for another optimizer",
                self.name
            )));
        };
        // Moved out rather than cloned: the fused kernel updates buffers in place only when it
        // holds their only handle.
        let hole = || Tensor::empty([0], &grad.device());
        let state = [
            std::mem::replace(&mut self.master, hole()),
            exp_avg,
            exp_avg_sq,
        ];
        let runs: Vec<(Range<usize>, RunRates)> = self
            .group_runs()
            .into_iter()
            .map(|(r, g)| (r, RunRates::of(g)))
            .collect();
        self.compute = None;
        let copy_dtype =
            (self.param_dtype != FloatDType::F32).then(|| DType::from(self.param_dtype));
        let state = match crate::fast::adamw_step(
            state,
            &grad,
            &grad_scale,
            opt,
            lr,
            step,
            &runs,
            copy_dtype,
        ) {
            Ok(([m, a, v], copy)) => {
                self.master = m;
                self.moments = Some([a, v]);
                self.compute = copy;
                return Ok(());
            }
            Err(state) => state,
        };
        let [master, exp_avg, exp_avg_sq] = state;
        let g = grad.cast(FloatDType::F32) * grad_scale;
        let (b1, b2) = (opt.beta1, opt.beta2);
        let exp_avg = exp_avg.cast(FloatDType::F32) * b1 + g.clone() * (1.0 - b1);
        let exp_avg_sq = exp_avg_sq.cast(FloatDType::F32) * b2 + g.square() * (1.0 - b2);
        let bias1 = 1.0 - b1.powi(step as i32);
        let bias2 = 1.0 - b2.powi(step as i32);
        let denom = (exp_avg_sq.clone() / bias2).sqrt() + opt.eps;
        let update = exp_avg.clone() / bias1 / denom;
        // Per-element learning rate and decay from the groups, one fill per run.
        let device = master.device();
        let fill = |value: &dyn Fn(&RunRates) -> f32| {
            let mut parts: Vec<Tensor<B::InnerBackend, 1>> = runs
                .iter()
                .map(|(r, rates)| Tensor::full([r.len()], value(rates), &device))
                .collect();
            match parts.len() {
                0 => Tensor::zeros([0], &device),
                1 => parts.pop().expect("one run"),
                _ => Tensor::cat(parts, 0),
            }
        };
        let lr_each = fill(&|r| r.lr_scale) * lr;
        let decay_each = fill(&|r| r.weight_decay);
        let decayed = master.clone() - master * decay_each * lr_each.clone();
        self.master = decayed - update * lr_each;
        // The update above took the moments before rounding, as the fused kernel does.
        self.moments = Some([self.stored_moment(exp_avg), self.stored_moment(exp_avg_sq)]);
        Ok(())
    }

    /// One step of a custom optimizer, run by run of equal groups (see [`ShardOptimizer`]).
    fn custom_step(
        &mut self,
        opt: &dyn ShardOptimizer<B::InnerBackend>,
        lr: f64,
        grad_scale: Tensor<B::InnerBackend, 1>,
    ) -> Result<(), SmpError> {
        self.assert_grads_finished("optimizer step");
        self.grad_sq_partials = None;
        let Some(grad) = self.grad.take() else {
            return Ok(());
        };
        self.compute = None;
        let grad = grad.cast(FloatDType::F32) * grad_scale;
        let runs = self.group_runs();
        self.run_states.resize_with(runs.len(), || None);
        let mut parts = Vec::with_capacity(runs.len());
        for (i, (r, group)) in runs.into_iter().enumerate() {
            let param = self.master.clone().narrow(0, r.start, r.len());
            let g = grad.clone().narrow(0, r.start, r.len());
            let state = self.run_states[i].take();
            let (param, state) = opt.step(lr * group.lr_scale, &group, param, g, state)?;
            self.run_states[i] = state;
            parts.push(param);
        }
        self.master = match parts.len() {
            0 => self.master.clone(),
            1 => parts.pop().expect("one run"),
            _ => Tensor::cat(parts, 0),
        };
        Ok(())
    }

    /// This rank's chunk as runs of elements that share an optimizer group, relative to the
    /// chunk's start; the padding gets no weight decay.
    fn group_runs(&self) -> Vec<(Range<usize>, Group)> {
        let range = self.layout.shard_range(self.rank, self.degree);
        let index: std::collections::HashMap<usize, usize> = self
            .layout
            .params
            .iter()
            .enumerate()
            .map(|(i, p)| (p.offset, i))
            .collect();
        let groups = &self.groups;
        param_runs(
            &self.layout,
            range,
            &|p| groups[index[&p.offset]],
            Group::no_decay(),
        )
    }

    /// Bytes this rank holds for the unit: master weights, gradient, deferred gradient and the
    /// two AdamW moments (f32; the gradient of an unsharded unit in the compute dtype), and the
    /// compute-dtype copy of the weights the fused AdamW keeps for the next gather.
    pub fn state_bytes(&self) -> usize {
        let shard = self.layout.shard_len(self.degree);
        let grad = self.grad.as_ref().map_or(0, |g| g.dtype().size() * shard);
        let compute = self
            .compute
            .as_ref()
            .map_or(0, |c| c.dtype().size() * shard);
        let deferred = if self.deferred_full_grad.is_some() {
            self.layout.padded
        } else {
            0
        };
        let moments = self
            .moments
            .as_ref()
            .map_or(0, |m| m.iter().map(|t| t.dtype().size() * shard).sum());
        4 * (shard + deferred) + moments + grad + compute
    }

    /// Overwrites this rank's chunk of `kind` with values from `init` (as in [`Self::new`]):
    /// how a checkpoint written with any number of ranks is loaded into this layout.
    pub fn load_state(
        &mut self,
        kind: StateKind,
        init: impl Fn(&FlatParam, Range<usize>) -> Vec<f32>,
    ) -> Result<(), SmpError> {
        let range = self.layout.shard_range(self.rank, self.degree);
        let init = |p: &FlatParam, r: Range<usize>| InitSlice::Values(init(p, r));
        let t = upload_shard::<B::InnerBackend>(&self.layout, range, &init, &self.master.device())?;
        match kind {
            StateKind::Weights => {
                self.master = t;
                self.compute = None;
            }
            StateKind::ExpAvg | StateKind::ExpAvgSq => {
                let index = usize::from(kind == StateKind::ExpAvgSq);
                let t = self.stored_moment(t);
                self.moments_mut()?[index] = t;
            }
        }
        Ok(())
    }

    /// AdamW's moments, or an error naming the unit when another optimizer steps it.
    fn moments_mut(&mut self) -> Result<&mut [Tensor<B::InnerBackend, 1>; 2], SmpError> {
        let name = &self.name;
        self.moments.as_mut().ok_or_else(|| {
            SmpError::Usage(format!(
                "unit {name}: the optimizer state is not AdamW's; saving and loading it is \
                 supported for the default AdamW only"
            ))
        })
    }

    /// AdamW's moments, or an error naming the unit when another optimizer steps it.
    fn moments(&self) -> Result<&[Tensor<B::InnerBackend, 1>; 2], SmpError> {
        self.moments.as_ref().ok_or_else(|| {
            SmpError::Usage(format!(
                "unit {}: the optimizer state is not AdamW's; saving and loading it is \
                 supported for the default AdamW only",
                self.name
            ))
        })
    }

    /// This rank's chunk of the fp32 master weights, AdamW's first and second moments.
    ///
    /// # Errors
    /// Under another optimizer than AdamW.
    pub fn shard_state(&self) -> Result<[Tensor<B::InnerBackend, 1>; 3], SmpError> {
        self.assert_grads_finished("shard_state");
        let [a, s] = self.moments()?;
        // Checkpoints hold f32 whatever the moments' dtype: bf16 values are exact in f32, and a
        // checkpoint loads into a run that keeps them in either dtype.
        Ok([
            self.master.clone(),
            a.clone().cast(FloatDType::F32),
            s.clone().cast(FloatDType::F32),
        ])
    }

    /// Replaces this rank's shard state (from a checkpoint); lengths must match.
    pub fn load_shard_state(
        &mut self,
        state: [Tensor<B::InnerBackend, 1>; 3],
    ) -> Result<(), SmpError> {
        let want = self.layout.shard_len(self.degree);
        for (t, what) in state.iter().zip(["weights", "exp_avg", "exp_avg_sq"]) {
            if t.dims()[0] != want {
                return Err(SmpError::Config(format!(
                    "unit {}: checkpoint {what} shard has {} elements, this layout needs {want}",
                    self.name,
                    t.dims()[0]
                )));
            }
        }
        let [m, a, s] = state;
        let moments = [self.stored_moment(a), self.stored_moment(s)];
        *self.moments_mut()? = moments;
        self.master = m.cast(FloatDType::F32);
        self.compute = None;
        Ok(())
    }

    /// The full fp32 values of every parameter, gathered from all ranks (for export and
    /// checkpoints). Every rank of the shard group must call it.
    pub fn gather_full_f32(
        &self,
        ctx: &FsdpContext<B::InnerBackend>,
        which: StateKind,
    ) -> Result<Vec<(FlatParam, Vec<f32>)>, SmpError> {
        self.assert_grads_finished("gather_full_f32");
        let shard = match which {
            StateKind::Weights => self.master.clone(),
            StateKind::ExpAvg => self.moments()?[0].clone().cast(FloatDType::F32),
            StateKind::ExpAvgSq => self.moments()?[1].clone().cast(FloatDType::F32),
        };
        let full = if self.degree == 1 {
            shard
        } else {
            ctx.timed(|| ctx.shard.all_gather(shard))?
        };
        let host: Vec<f32> =
            full.into_data().convert::<f32>().to_vec().map_err(|e| {
                SmpError::Config(format!("unit {}: reading weights: {e:?}", self.name))
            })?;
        Ok(self
            .layout
            .params
            .iter()
            .map(|p| (p.clone(), host[p.offset..p.offset + p.numel].to_vec()))
            .collect())
    }

    /// Rank of this process in the unit's shard group.
    pub fn shard_rank(&self) -> usize {
        self.rank
    }

    /// Ranks of the unit's shard group.
    pub fn shard_degree(&self) -> usize {
        self.degree
    }

    /// Ids of the template's parameters, in layout order.
    pub fn param_ids(&self) -> Vec<ParamId> {
        struct Ids<'a>(&'a mut Vec<ParamId>);
        impl<B: Backend> ModuleVisitor<B> for Ids<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                self.0.push(param.id);
            }
        }
        let mut ids = Vec::new();
        self.template.visit(&mut Ids(&mut ids));
        ids
    }
}

/// The elements `range` of a unit's flat buffer, asking `init` only for the parts of each
/// parameter that fall inside it; padding is zero.
/// Produces the device values of elements `range` of one parameter.
type ShardPiece<'a, IB> = dyn Fn(&FlatParam, Range<usize>) -> Result<Tensor<IB, 1>, SmpError> + 'a;

/// `range` of the flat buffer as maximal runs of elements whose parameters share `key(param)`,
/// relative to `range.start`; the padding past the last parameter gets `padding`.
fn param_runs<K: Copy + PartialEq>(
    layout: &FlatLayout,
    range: Range<usize>,
    key: &dyn Fn(&FlatParam) -> K,
    padding: K,
) -> Vec<(Range<usize>, K)> {
    let mut runs = Vec::new();
    for p in &layout.params {
        let lo = p.offset.max(range.start);
        let hi = (p.offset + p.numel).min(range.end);
        if lo < hi {
            push_run(&mut runs, lo - range.start..hi - range.start, key(p));
        }
    }
    let covered = runs.last().map_or(0, |(r, _)| r.end);
    push_run(&mut runs, covered..range.len(), padding);
    runs
}

/// Appends `r` with key `k` to `runs`, extending the last run when it ends where `r` starts and
/// has the same key; empty ranges are dropped.
fn push_run<K: PartialEq>(runs: &mut Vec<(Range<usize>, K)>, r: Range<usize>, k: K) {
    match runs.last_mut() {
        _ if r.is_empty() => {}
        Some((last, lk)) if *lk == k && last.end == r.start => last.end = r.end,
        _ => runs.push((r, k)),
    }
}

/// This rank's shard as one f32 device tensor, made of the pieces `piece(param, range within the
/// param)` returns for each parameter overlapping `range`, plus the zero padding at the end.
///
/// Piece by piece so that the host never holds the whole shard: a 70B-wide layer's shard is
/// gigabytes, and building it in one host buffer (and copying it into Burn's `TensorData`) made
/// start-up page-fault bound: minutes per rank.
fn build_shard<IB: Backend>(
    layout: &FlatLayout,
    range: Range<usize>,
    device: &IB::Device,
    piece: &ShardPiece<'_, IB>,
) -> Result<Tensor<IB, 1>, SmpError> {
    let mut pieces = Vec::new();
    let mut filled = 0;
    for p in &layout.params {
        let lo = p.offset.max(range.start);
        let hi = (p.offset + p.numel).min(range.end);
        if lo < hi {
            pieces.push(piece(p, lo - p.offset..hi - p.offset)?);
            filled += hi - lo;
        }
    }
    if filled < range.len() {
        pieces.push(Tensor::zeros([range.len() - filled], device));
    }
    let t = match pieces.len() {
        0 => Tensor::zeros([0], device),
        1 => pieces.pop().expect("one piece"),
        _ => Tensor::cat(pieces, 0),
    };
    Ok(t.cast(FloatDType::F32))
}

/// [`build_shard`] with values from a host initializer (checked for length).
fn upload_shard<IB: Backend>(
    layout: &FlatLayout,
    range: Range<usize>,
    init: &dyn Fn(&FlatParam, Range<usize>) -> InitSlice,
    device: &IB::Device,
) -> Result<Tensor<IB, 1>, SmpError> {
    build_shard::<IB>(layout, range, device, &|p, r| {
        let part = match init(p, r.clone()) {
            InitSlice::Values(part) => part,
            InitSlice::Normal { key, std, start } => {
                let drawn = start..start + r.len();
                if let Some(t) = crate::fast::normal_init::<IB>(key, std, drawn.clone(), device) {
                    check_device_draw(&t, key, std, &drawn, &p.name)?;
                    return Ok(t);
                }
                normal_values(key, std, drawn)
            }
        };
        if part.len() != r.len() {
            return Err(SmpError::Config(format!(
                "initializer returned {} values for elements {}..{} of {}",
                part.len(),
                r.start,
                r.end,
                p.name
            )));
        }
        let n = part.len();
        // `TensorData::new` takes the vector as it is; `from_floats(&[..])` would copy it.
        Ok(Tensor::from_data(TensorData::new(part, [n]), device))
    })
}

/// Compares the first device-drawn slice of this process with the host's draw of its first
/// elements, once: a GPU whose `log` or `cos` were off, or a miscompiled kernel, would otherwise
/// start every run from wrong weights without a word. The two differ by the last bits of `log`
/// and `cos` (a few 1e-7 of the value); a tenth of a percent of `std` is a wrong draw.
fn check_device_draw<IB: Backend>(
    drawn: &Tensor<IB, 1>,
    key: u64,
    std: f32,
    range: &Range<usize>,
    name: &str,
) -> Result<(), SmpError> {
    static CHECKED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if CHECKED.swap(true, std::sync::atomic::Ordering::Relaxed) {
        return Ok(());
    }
    let n = range.len().min(4096);
    let gpu: Vec<f32> = drawn
        .clone()
        .narrow(0, 0, n)
        .into_data()
        .convert::<f32>()
        .to_vec()
        .map_err(|e| SmpError::Config(format!("reading the GPU's initial values: {e:?}")))?;
    let host = normal_values(key, std, range.start..range.start + n);
    let worst = gpu
        .iter()
        .zip(&host)
        .enumerate()
        .max_by(|a, b| (a.1.0 - a.1.1).abs().total_cmp(&(b.1.0 - b.1.1).abs()));
    // A NaN difference is a wrong draw too.
    if let Some((i, (g, h))) = worst
        && ((g - h).abs().is_nan() || (g - h).abs() > 1e-3 * std)
    {
        return Err(SmpError::Config(format!(
            "the GPU's seeded initialization disagrees with the host's: element {} of {name} is \
             {g} on the GPU and {h} on the host (std {std}); draw on the host with the `init` \
             fast path off (SMP_BURN_KERNELS=fast=... without init)",
            range.start + i
        )));
    }
    tracing::debug!(
        "seeded initialization on the GPU matches the host's on the first {n} values of {name}"
    );
    Ok(())
}

/// Which of a unit's sharded tensors to read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StateKind {
    /// fp32 master weights.
    Weights,
    /// AdamW's first moment.
    ExpAvg,
    /// AdamW's second moment.
    ExpAvgSq,
}

/// The clipping factor (`max_norm / (norm + 1e-6)` where the norm exceeds `max_norm`, else 1)
/// and the global gradient norm, from the per-unit sums of squares; `norm` is summed over the
/// shard group so it is the norm of the whole model's gradient. Both stay on the device (one
/// element each), as in PyTorch's `clip_grad_norm_`: reading the norm here made the host wait
/// for the whole backward before it could queue the optimizer (see [`crate::readback`]).
pub fn clip_factor<IB: Backend>(
    sq_sums: Vec<Tensor<IB, 1>>,
    max_norm: Option<f64>,
    ctx: &FsdpContext<IB>,
) -> Result<(Tensor<IB, 1>, Tensor<IB, 1>), SmpError> {
    let local = Tensor::cat(sq_sums, 0).sum();
    let total = ctx.sum_over_shards(local)?;
    let norm = total.sqrt();
    let scale = match max_norm {
        Some(max) => {
            let coef = (norm.clone() + 1e-6).recip() * max;
            norm.ones_like()
                .mask_where(norm.clone().greater_elem(max), coef)
        }
        None => norm.ones_like(),
    };
    Ok((scale, norm))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The clipping factor on the device: `max / (norm + 1e-6)` only above the threshold, the
    /// norm itself for logging, over a one-rank shard group.
    #[test]
    fn clip_factor_scales_only_above_the_threshold() {
        use burn_ndarray::NdArray;
        use collectives::{CommOptions, run_on_threads};
        type Nd = NdArray<f32>;
        let results = run_on_threads(1, CommOptions::default(), |comm| {
            let dev = Default::default();
            let ctx = FsdpContext::<Nd>::new(
                Arc::new(crate::comm::HostTensorComm::new(comm)),
                None,
                &ParallelConfig::default(),
            );
            // Squares summing to 25: norm 5.
            let sq = || {
                vec![
                    Tensor::<Nd, 1>::from_floats([9.0], &dev),
                    Tensor::<Nd, 1>::from_floats([16.0], &dev),
                ]
            };
            let value = |t: Tensor<Nd, 1>| t.into_scalar();
            [Some(1.0), Some(10.0), Some(5.0), None].map(|max| {
                let (scale, norm) = clip_factor(sq(), max, &ctx).unwrap();
                (value(scale), value(norm))
            })
        });
        let [clipped, under, at, off] = results[0];
        assert!((clipped.0 - 1.0 / (5.0 + 1e-6)).abs() < 1e-7, "{clipped:?}");
        assert_eq!(clipped.1, 5.0);
        assert_eq!(under.0, 1.0, "below the threshold nothing is scaled");
        assert_eq!(at.0, 1.0, "a norm equal to the threshold is not scaled");
        assert_eq!(off.0, 1.0, "no clipping without a threshold");
    }

    fn layout(shapes: &[&[usize]], degree: usize) -> FlatLayout {
        let mut offset = 0;
        let params = shapes
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let numel = s.iter().product();
                let p = FlatParam {
                    name: format!("p{i}"),
                    shape: s.to_vec(),
                    offset,
                    numel,
                    id: ParamId::new(),
                    container: String::new(),
                };
                offset += numel;
                p
            })
            .collect();
        FlatLayout {
            params,
            numel: offset,
            padded: offset.div_ceil(degree) * degree,
        }
    }

    /// A matrix and a vector, the smallest module with both a weight-gradient GEMM and a
    /// vector gradient.
    #[derive(Module, Debug)]
    struct MatrixAndVector<B: Backend> {
        weight: Param<Tensor<B, 2>>,
        vector: Param<Tensor<B, 1>>,
    }

    type TestAutodiff = burn::backend::Autodiff<burn_ndarray::NdArray<f32>>;

    /// One sharded unit holding a `weight_shape` matrix and a vector of `vector_len`, with
    /// seeded normal values of `std`, over `comm` with `config`.
    fn matrix_and_vector_unit(
        comm: Arc<dyn collectives::Communicator>,
        config: &ParallelConfig,
        weight_shape: [usize; 2],
        vector_len: usize,
        std: f32,
    ) -> (
        FsdpContext<burn_ndarray::NdArray<f32>>,
        ShardedUnit<TestAutodiff, MatrixAndVector<TestAutodiff>>,
    ) {
        use burn::module::Initializer;

        use crate::comm::HostTensorComm;
        use crate::init::{InitRule, init_values};

        let dev = Default::default();
        let ctx = FsdpContext::new(Arc::new(HostTensorComm::new(comm)), None, config);
        let template = MatrixAndVector::<TestAutodiff> {
            weight: Initializer::Zeros.init(weight_shape, &dev),
            vector: Initializer::Zeros.init([vector_len], &dev),
        };
        let unit = ShardedUnit::new("layer", template, &ctx, &dev, |p, range| {
            init_values(0, &p.name, InitRule::Normal { std }, range)
        })
        .unwrap();
        (ctx, unit)
    }

    /// With prefetch, `accumulate_grads` leaves the reduce-scatter pending; finishing it (also
    /// implicitly, by a second accumulation) gives exactly the gradient of the synchronous path,
    /// and reading the gradient while one is pending panics instead of missing it.
    #[test]
    fn pending_reduce_scatter_matches_synchronous() {
        use collectives::{CommOptions, run_on_threads};
        type B = TestAutodiff;

        let grads_with = |prefetch: bool| {
            run_on_threads(2, CommOptions::default(), |comm| {
                let dev = Default::default();
                let config = ParallelConfig {
                    prefetch_depth: usize::from(prefetch),
                    ..Default::default()
                };
                let rank = comm.rank();
                let (ctx, mut unit) = matrix_and_vector_unit(comm, &config, [4, 3], 3, 0.1);
                // Two micro-batches without `defer`, with different data on each rank.
                for micro in 0..2 {
                    let layer = unit.gather(&ctx, true).unwrap();
                    let x = Tensor::<B, 2>::ones([2, 4], &dev) * (1.0 + rank as f32) - micro as f32;
                    let y = x.matmul(layer.weight.val()) + layer.vector.val().unsqueeze();
                    let grads = y.square().mean().backward();
                    unit.accumulate_grads(&layer, &grads, &ctx, false).unwrap();
                    assert_eq!(unit.has_pending_grads(), prefetch);
                }
                if prefetch {
                    let read = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        unit.grad_sq_sum();
                    }));
                    assert!(read.is_err(), "reading a pending gradient must panic");
                }
                unit.finish_grads(&ctx).unwrap();
                assert!(!unit.has_pending_grads());
                let g = unit.grad.clone().expect("a gradient");
                g.into_data().to_vec::<f32>().unwrap()
            })
        };
        assert_eq!(grads_with(true), grads_with(false));
    }

    /// Accumulation over micro-batches (`defer` on all but the last) on one rank: the gradient
    /// shard holds every element of the layout and equals the sum of each micro-batch's own
    /// gradients, taken from plain autodiff on the same weights.
    #[test]
    fn deferred_micro_batches_sum_into_the_gradient_shard() {
        use collectives::{CommOptions, run_on_threads};
        type B = TestAutodiff;

        let (micro_batches, k, n) = (3, 5, 3);
        let out = run_on_threads(1, CommOptions::default(), |comm| {
            let dev = Default::default();
            let (ctx, mut unit) =
                matrix_and_vector_unit(comm, &ParallelConfig::default(), [n, k], k, 0.5);
            let mut want = vec![0f32; n * k + k];
            for micro in 0..micro_batches {
                let layer = unit.gather(&ctx, true).unwrap();
                let x = Tensor::<B, 2>::from_floats(
                    [
                        [1.0 + micro as f32, -2.0, 0.5, 3.0, -1.0],
                        [0.25, 1.0, -0.5, 2.0, 1.5],
                    ],
                    &dev,
                );
                let forward = |layer: &MatrixAndVector<B>| {
                    let scaled = x.clone() * layer.vector.val().unsqueeze_dim(0);
                    crate::ops::linear(scaled, layer.weight.val())
                        .square()
                        .sum()
                };
                // The same micro-batch's gradients on a plain copy of the gathered weights.
                let plain = unit.gather(&ctx, true).unwrap();
                let g = forward(&plain).backward();
                let dw = plain.weight.val().grad(&g).unwrap().into_data();
                let ds = plain.vector.val().grad(&g).unwrap().into_data();
                for (w, v) in want.iter_mut().zip(
                    dw.to_vec::<f32>()
                        .unwrap()
                        .into_iter()
                        .chain(ds.to_vec::<f32>().unwrap()),
                ) {
                    *w += v;
                }
                let grads = forward(&layer).backward();
                let defer = micro + 1 < micro_batches;
                unit.accumulate_grads(&layer, &grads, &ctx, defer).unwrap();
            }
            let got = unit.grad_shard().expect("a gradient").into_data();
            (got.to_vec::<f32>().unwrap(), want)
        });
        let (got, want) = &out[0];
        assert_eq!(
            got.len(),
            want.len(),
            "the shard of a one-rank unit holds every element"
        );
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-4 * w.abs().max(1.0),
                "element {i}: {g} against {w}"
            );
        }
    }

    fn decay_runs(layout: &FlatLayout, range: Range<usize>) -> Vec<(Range<usize>, bool)> {
        param_runs(layout, range, &|p| p.shape.len() >= 2, false)
    }

    #[test]
    fn decay_runs_merge_neighbours_and_cover_padding() {
        // A Llama layer's order: matrices, then two norm vectors; 2 x 3 + 3 x 2 + 4 + 4 = 20
        // elements, padded to 21 for 3 ranks (7 each).
        let l = layout(&[&[2, 3], &[3, 2], &[4], &[4]], 3);
        assert_eq!(decay_runs(&l, l.shard_range(0, 3)), vec![(0..7, true)]);
        assert_eq!(
            decay_runs(&l, l.shard_range(1, 3)),
            vec![(0..5, true), (5..7, false)]
        );
        assert_eq!(decay_runs(&l, l.shard_range(2, 3)), vec![(0..7, false)]);
        // Interleaved flags and a rank holding only padding.
        let l = layout(&[&[3], &[2, 2], &[1]], 4);
        assert_eq!(
            decay_runs(&l, 0..8),
            vec![(0..3, false), (3..7, true), (7..8, false)]
        );
        assert_eq!(decay_runs(&l, 8..10), vec![(0..2, false)]);
    }

    /// The runs the gradient norm weighs (tensor parallelism counts replicated parameters
    /// `1 / tp`): equal weights merge across parameters, padding gets its own key.
    #[test]
    fn weighted_runs_follow_parameters() {
        // Two matrices (6 + 6), two vectors (4 + 4): 20 elements padded to 21 for 3 ranks.
        let l = layout(&[&[2, 3], &[3, 2], &[4], &[4]], 3);
        let weight = |p: &FlatParam| if p.shape.len() >= 2 { 1.0f32 } else { 0.5 };
        assert_eq!(
            param_runs(&l, l.shard_range(1, 3), &weight, 0.0),
            vec![(0..5, 1.0), (5..7, 0.5)]
        );
        assert_eq!(
            param_runs(&l, l.shard_range(2, 3), &weight, 0.0),
            vec![(0..6, 0.5), (6..7, 0.0)]
        );
        assert_eq!(param_runs(&l, 0..21, &|_| 1.0f32, 1.0), vec![(0..21, 1.0)]);
    }
}
