//! Building an engine: placements, names, tied parameters, groups and each rank's shards.

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::ops::Range;

use burn::module::{Initializer, Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::{
    Tensor,
    backend::{AutodiffBackend, Backend},
};
use collectives::CommunicatorExt;

use super::{BlockUnit, Engine, HeadUnit, ParamInfo, ParamMeta, Sharded, StemUnit, UnitId, Units};
use crate::error::SmpError;
use crate::fsdp::{FlatLayout, FlatParam, ShardedUnit};
use crate::init::{InitRule, InitSlice, init_values, normal_key};
use crate::mesh::Mesh;
use crate::optim::{AdamW, Group, Optimizer, ShardOptimizer};
use crate::tp::Placement;
use crate::tp::placement::slice_ranges;

/// Values of elements `range` (flat, row-major) of the *full* parameter `info` describes,
/// whatever slice of it this rank holds: one function serves every layout (a seed, a
/// checkpoint written by any number of ranks, a full model in memory).
pub type ParamSource<'a> = dyn Fn(&ParamInfo<'_>, Range<usize>) -> Result<Vec<f32>, SmpError> + 'a;

/// Where the parameters' initial values come from.
pub enum Init<'a> {
    /// The values the units hold, each rank keeping its own shard of them: a model initialized
    /// by Burn's own initializers (with the same seed on every rank; the engine checks that the
    /// data-parallel ranks agree), or loaded from a record. With tensor parallelism each rank's
    /// layers hold their own slices.
    FromUnits,
    /// Counter-based values from `seed` ([`crate::init`]): the same full parameters whatever the
    /// world size and layout, and each rank makes only its own shard.
    Seeded {
        /// The seed.
        seed: u64,
        /// The distribution of each parameter.
        rule: Box<dyn Fn(&ParamInfo<'_>) -> InitRule + 'a>,
    },
    /// Any source of full-parameter values (a checkpoint reader).
    Source(Box<ParamSource<'a>>),
}

impl std::fmt::Debug for Init<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Init::FromUnits => write!(f, "FromUnits"),
            Init::Seeded { seed, .. } => write!(f, "Seeded({seed})"),
            Init::Source(_) => write!(f, "Source"),
        }
    }
}

impl<'a> Init<'a> {
    /// [`Init::Seeded`] with the default rule (`default_rule`).
    pub fn seeded(seed: u64) -> Self {
        Init::Seeded {
            seed,
            rule: Box::new(default_rule),
        }
    }

    /// [`Init::Seeded`] with a rule of the caller's.
    pub fn seeded_with(seed: u64, rule: impl Fn(&ParamInfo<'_>) -> InitRule + 'a) -> Self {
        Init::Seeded {
            seed,
            rule: Box::new(rule),
        }
    }

    /// [`Init::Source`] from a closure.
    pub fn source(
        f: impl Fn(&ParamInfo<'_>, Range<usize>) -> Result<Vec<f32>, SmpError> + 'a,
    ) -> Self {
        Init::Source(Box::new(f))
    }

    /// The values of `full`, an initialized model built with [`crate::tp::TpGroup::single`]
    /// (whole layers), for a model that splits them: each rank slices its own part. Copies
    /// the full model's values to host memory once (a lazy parameter is initialized by its own
    /// initializer first, as Burn does on first use).
    ///
    /// # Errors
    /// A value that cannot be read as f32.
    pub fn from_full_units<B, S, K, H>(full: &Units<S, K, H>) -> Result<Self, SmpError>
    where
        B: Backend,
        S: Module<B>,
        K: Module<B>,
        H: Module<B>,
    {
        let mut values: HostParams = HashMap::new();
        let mut add = |unit: UnitId, m: &dyn Fn(&mut HostValues<'_>)| -> Result<(), SmpError> {
            let mut v = HostValues {
                unit,
                path: Vec::new(),
                out: &mut values,
                error: None,
            };
            m(&mut v);
            v.error.map_or(Ok(()), Err)
        };
        add(UnitId::Stem, &|v| full.stem.visit(v))?;
        for (i, b) in full.blocks.iter().enumerate() {
            add(UnitId::Block(i), &|v| b.visit(v))?;
        }
        add(UnitId::Head, &|v| full.head.visit(v))?;
        Ok(Init::source(move |info, range| {
            let (shape, data) =
                values
                    .get(&(info.unit, info.path.to_string()))
                    .ok_or_else(|| {
                        SmpError::Usage(format!(
                            "Init::from_full_units: the full model has no parameter {} in {}",
                            info.path,
                            info.unit.prefix()
                        ))
                    })?;
            if shape.as_slice() != info.shape {
                return Err(SmpError::Usage(format!(
                    "Init::from_full_units: {} is {shape:?} in the full model, {:?} in this one",
                    info.name, info.shape
                )));
            }
            Ok(data[range].to_vec())
        }))
    }
}

/// Host copies of parameters, keyed by unit and path: shape and values.
type HostParams = HashMap<(UnitId, String), (Vec<usize>, Vec<f32>)>;
/// Chooses a parameter's optimizer group.
type GroupRule<'a> = Box<dyn Fn(&ParamInfo<'_>) -> Group + 'a>;
/// Names a parameter for checkpoints and plans.
type NameRule<'a> = Box<dyn Fn(UnitId, &str) -> String + 'a>;
/// Overrides how a parameter is split across tensor-parallel ranks.
type PlacementRule<'a> = Box<dyn Fn(UnitId, &str) -> Option<Placement> + 'a>;

/// Collects every float parameter's values on the host.
struct HostValues<'a> {
    unit: UnitId,
    path: Vec<String>,
    out: &'a mut HostParams,
    error: Option<SmpError>,
}

impl<B: Backend> ModuleVisitor<B> for HostValues<'_> {
    fn enter_module(&mut self, name: &str, _: &str) {
        self.path.push(name.to_string());
    }
    fn exit_module(&mut self, _: &str, _: &str) {
        self.path.pop();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let path = self.path.join(".");
        let value = param.val();
        let shape = value.dims().to_vec();
        match value.into_data().convert::<f32>().to_vec::<f32>() {
            Ok(v) => {
                self.out.insert((self.unit, path), (shape, v));
            }
            Err(e) => {
                self.error
                    .get_or_insert(SmpError::Usage(format!("reading {path}: {e:?}")));
            }
        }
    }
}

/// The default distribution of [`Init::seeded`]: biases (and LayerNorm's `beta`) zero, other
/// vectors (norm scales) one, matrices normal with standard deviation 0.02 (GPT-2's and
/// Llama's).
pub fn default_rule(info: &ParamInfo<'_>) -> InitRule {
    let field = info.path.rsplit('.').next().unwrap_or(info.path);
    match (info.shape.len(), field) {
        (_, "bias" | "beta") => InitRule::Constant(0.0),
        (0 | 1, _) => InitRule::Constant(1.0),
        _ => InitRule::Normal { std: 0.02 },
    }
}

/// Parameters shared between units (tied embeddings): they live in one unit of their own,
/// whose gradient sums every use's. Matrices and vectors only.
#[derive(Module, Debug)]
pub struct Tied<B: Backend> {
    /// The tied matrices, in order of first use.
    pub matrices: Vec<Param<Tensor<B, 2>>>,
    /// The tied vectors, in order of first use.
    pub vectors: Vec<Param<Tensor<B, 1>>>,
}

/// Configures and builds an [`Engine`] on a mesh.
pub struct EngineBuilder<'a, IB: Backend> {
    mesh: &'a Mesh<IB>,
    init: Init<'a>,
    groups: Option<GroupRule<'a>>,
    optimizer: Optimizer<IB>,
    max_grad_norm: Option<f64>,
    names: Option<NameRule<'a>>,
    placements: Option<PlacementRule<'a>>,
}

impl<IB: Backend> std::fmt::Debug for EngineBuilder<'_, IB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineBuilder")
            .field("init", &self.init)
            .field("optimizer", &self.optimizer)
            .field("max_grad_norm", &self.max_grad_norm)
            .finish()
    }
}

impl<'a, IB: Backend> EngineBuilder<'a, IB> {
    /// A builder with the defaults: values from the units ([`Init::FromUnits`]), AdamW with
    /// weight decay on matrices only, no clipping, names `stem.*`, `blocks.{i}.*`, `head.*`.
    pub fn new(mesh: &'a Mesh<IB>) -> Self {
        Self {
            mesh,
            init: Init::FromUnits,
            groups: None,
            optimizer: Optimizer::default(),
            max_grad_norm: None,
            names: None,
            placements: None,
        }
    }

    /// Where initial values come from.
    pub fn init(mut self, init: Init<'a>) -> Self {
        self.init = init;
        self
    }

    /// Each parameter's optimizer group (weight decay, learning-rate scale). The default decays
    /// matrices by the AdamW's `weight_decay` (none under another optimizer) and nothing else.
    pub fn param_groups(mut self, f: impl Fn(&ParamInfo<'_>) -> Group + 'a) -> Self {
        self.groups = Some(Box::new(f));
        self
    }

    /// AdamW with these hyper-parameters (the default optimizer).
    pub fn adamw(mut self, adamw: AdamW) -> Self {
        self.optimizer = Optimizer::AdamW(adamw);
        self
    }

    /// Another optimizer for the shards, e.g. a Burn optimizer through
    /// [`crate::optim::BurnOptim`].
    pub fn optimizer(mut self, optimizer: impl ShardOptimizer<IB> + 'static) -> Self {
        self.optimizer = Optimizer::Custom(std::sync::Arc::new(optimizer));
        self
    }

    /// Clips the gradient to this global norm (over every rank's shards; `None`: no clipping).
    pub fn max_grad_norm(mut self, max: impl Into<Option<f64>>) -> Self {
        self.max_grad_norm = max.into();
        self
    }

    /// Names parameters `f(unit, path in the unit)` (e.g. Hugging Face's names) in init
    /// sources, groups, exports and messages.
    pub fn names(mut self, f: impl Fn(UnitId, &str) -> String + 'a) -> Self {
        self.names = Some(Box::new(f));
        self
    }

    /// Overrides the placement of parameters for which `f(unit, path)` returns one (a
    /// tensor-parallel layer of your own); the others follow their layer's type.
    pub fn placements(mut self, f: impl Fn(UnitId, &str) -> Option<Placement> + 'a) -> Self {
        self.placements = Some(Box::new(f));
        self
    }

    /// Shards `units` over the mesh on `device`. The units may be lazy (nothing is allocated
    /// for their parameters unless [`Init::FromUnits`] reads them); every rank builds only its
    /// own shards. Collective: every rank of the mesh calls it.
    ///
    /// # Errors
    /// Shapes that do not fit the mesh, tied parameters whose shapes or placements differ, a
    /// tensor-parallel mesh without tensor-parallel layers, lazy parameters under
    /// [`Init::FromUnits`], ranks holding different values or layouts, a failing source.
    pub fn build<B, S, K, H>(
        self,
        units: Units<S, K, H>,
        device: &B::Device,
    ) -> Result<Engine<B, S, K, H>, SmpError>
    where
        B: AutodiffBackend<InnerBackend = IB>,
        S: StemUnit<B>,
        K: BlockUnit<B, Aux = S::Aux>,
        H: HeadUnit<B>,
    {
        let mesh = self.mesh;
        let config = mesh.config();
        let tp = mesh.tp();
        let degree = tp.degree();
        let name_of = |unit: UnitId, path: &str| match &self.names {
            Some(f) => f(unit, path),
            None => format!("{}.{path}", unit.prefix()),
        };

        // Every unit's parameters, in visiting order.
        let mut all: Vec<(UnitId, FlatLayout)> =
            vec![(UnitId::Stem, FlatLayout::of(&units.stem, 1))];
        for (i, b) in units.blocks.iter().enumerate() {
            all.push((UnitId::Block(i), FlatLayout::of(b, 1)));
        }
        all.push((UnitId::Head, FlatLayout::of(&units.head, 1)));

        // Placements and tied parameters.
        let placement_of = |unit: UnitId, p: &FlatParam| -> Result<Placement, SmpError> {
            let field = p.name.rsplit('.').next().unwrap_or(&p.name);
            let placement = self
                .placements
                .as_ref()
                .and_then(|f| f(unit, &p.name))
                .unwrap_or_else(|| Placement::of_layer_param(&p.container, field));
            if let Placement::Split { dim } = placement
                && dim >= p.shape.len()
            {
                return Err(SmpError::Usage(format!(
                    "{}: split on dim {dim}, but it has shape {:?}",
                    name_of(unit, &p.name),
                    p.shape
                )));
            }
            Ok(placement)
        };
        let mut first_use: HashMap<ParamId, (UnitId, FlatParam, Placement)> = HashMap::new();
        let mut tied_ids: Vec<ParamId> = Vec::new();
        for (unit, layout) in &all {
            let mut seen = HashSet::new();
            for p in &layout.params {
                if !seen.insert(p.id) {
                    return Err(SmpError::Usage(format!(
                        "{}: the same parameter appears twice in unit {}; share parameters \
                         between units only",
                        name_of(*unit, &p.name),
                        unit.prefix()
                    )));
                }
                let placement = placement_of(*unit, p)?;
                match first_use.get_mut(&p.id) {
                    None => {
                        first_use.insert(p.id, (*unit, p.clone(), placement));
                    }
                    Some((first_unit, first, first_placement)) => {
                        let (a, b) = (name_of(*first_unit, &first.name), name_of(*unit, &p.name));
                        if first.shape != p.shape {
                            return Err(SmpError::Usage(format!(
                                "tied parameter {a} is {:?}, its use as {b} {:?}",
                                first.shape, p.shape
                            )));
                        }
                        match (*first_placement, placement) {
                            (x, y) if x == y => {}
                            (Placement::Replicated, y) => *first_placement = y,
                            (_, Placement::Replicated) => {}
                            (x, y) => {
                                return Err(SmpError::Usage(format!(
                                    "tied parameter {a} is {} there and {} as {b}",
                                    x.describe(),
                                    y.describe()
                                )));
                            }
                        }
                        if !tied_ids.contains(&p.id) {
                            tied_ids.push(p.id);
                        }
                    }
                }
            }
        }
        if degree > 1
            && !first_use
                .values()
                .any(|(_, _, p)| matches!(p, Placement::Split { .. }))
        {
            return Err(SmpError::Usage(format!(
                "tensor_parallel_degree {degree}, but the model has no tensor-parallel layer \
                 (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding): every rank \
                 would compute alone on its part of each sequence"
            )));
        }
        // Layers built for another group than the mesh's would compute on wrong shapes.
        for (unit, p) in all
            .iter()
            .flat_map(|(u, l)| l.params.iter().map(move |p| (u, p)))
        {
            if let Some((group, built)) = crate::tp::layer_group(p.id)
                && group != tp.id()
                && (built > 1 || degree > 1)
            {
                return Err(SmpError::Usage(format!(
                    "{} belongs to a layer built for a tensor-parallel group of degree {built}, \
                     but the mesh's degree is {degree}: build the model's layers with mesh.tp()",
                    name_of(*unit, &p.name)
                )));
            }
        }
        let placements: HashMap<ParamId, Placement> =
            first_use.iter().map(|(id, (_, _, p))| (*id, *p)).collect();

        // What the callbacks see of a parameter, from its first use.
        let default_decay = match &self.optimizer {
            Optimizer::AdamW(a) => a.weight_decay,
            Optimizer::Custom(_) => 0.0,
        };
        let meta_of = |unit: UnitId, p: &FlatParam| -> ParamMeta {
            let (unit, first, placement) = match first_use.get(&p.id) {
                Some((u, f, pl)) => (*u, f, *pl),
                None => (unit, p, Placement::Replicated),
            };
            ParamMeta {
                name: name_of(unit, &first.name),
                path: first.name.clone(),
                full_shape: placement.full_shape(&first.shape, degree),
                placement,
            }
        };
        let info_of = |meta: &'_ ParamMeta, unit: UnitId, container: &'_ str| -> ParamInfoOwned {
            ParamInfoOwned {
                name: meta.name.clone(),
                unit,
                path: meta.path.clone(),
                shape: meta.full_shape.clone(),
                placement: meta.placement,
                container: container.to_string(),
            }
        };
        let group_of = |info: &ParamInfo<'_>| match &self.groups {
            Some(f) => f(info),
            None if info.shape.len() >= 2 => Group::decay(default_decay),
            None => Group::no_decay(),
        };

        // Values: the units' own (read once, by id, with a digest) or a source.
        let mut digest = Fingerprint::default();
        let unit_values = match self.init {
            Init::FromUnits => {
                let mut values = HashMap::new();
                let mut read = |m: &dyn Fn(&mut ReadValues<'_>)| -> Result<(), SmpError> {
                    let mut r = ReadValues {
                        out: &mut values,
                        path: Vec::new(),
                        digest: &mut digest,
                        error: None,
                    };
                    m(&mut r);
                    r.error.map_or(Ok(()), Err)
                };
                read(&|r| units.stem.visit(r))?;
                for b in &units.blocks {
                    read(&|r| b.visit(r))?;
                }
                read(&|r| units.head.visit(r))?;
                Some(values)
            }
            _ => None,
        };
        let tp_rank = tp.rank();
        let failure: RefCell<Option<SmpError>> = RefCell::new(None);
        let seeded;
        let source: Option<&ParamSource<'_>> = match &self.init {
            Init::FromUnits => None,
            Init::Source(source) => Some(source.as_ref()),
            Init::Seeded { seed, rule } => {
                seeded = move |info: &ParamInfo<'_>, r: Range<usize>| {
                    Ok(init_values(*seed, info.name, rule(info), r))
                };
                Some(&seeded)
            }
        };
        // Elements `range` of this rank's slice of the parameter `meta` describes.
        let values_of = |meta: &ParamMeta, unit: UnitId, p: &FlatParam, range: Range<usize>| {
            let result = match (&unit_values, source) {
                (Some(values), _) => {
                    let v = values.get(&p.id).expect("every parameter was read");
                    Ok(v[range.clone()].to_vec())
                }
                (None, Some(source)) => {
                    let owned = info_of(meta, unit, &p.container);
                    read_slice(
                        source,
                        &owned.view(),
                        &p.shape,
                        degree,
                        tp_rank,
                        range.clone(),
                    )
                }
                (None, None) => unreachable!("a source unless the units' values were read"),
            };
            result.unwrap_or_else(|e| {
                failure.borrow_mut().get_or_insert(e);
                vec![0.0; range.len()]
            })
        };

        // Each unit's metadata and groups, in its layout's order (tied parameters left out).
        let external: HashSet<ParamId> = tied_ids.iter().copied().collect();
        let unit_meta = |unit: UnitId, layout: &FlatLayout| -> (Vec<ParamMeta>, Vec<Group>) {
            layout
                .params
                .iter()
                .filter(|p| !external.contains(&p.id))
                .map(|p| {
                    let meta = meta_of(unit, p);
                    let group = group_of(&info_of(&meta, unit, &p.container).view());
                    (meta, group)
                })
                .unzip()
        };
        let ctx = mesh.fsdp();
        let by_path = |meta: &[ParamMeta]| -> HashMap<String, ParamMeta> {
            meta.iter().map(|m| (m.path.clone(), m.clone())).collect()
        };
        // A seeded normal parameter whose local elements are one run of the full parameter's
        // (replicated, or split along its first dimension) is described rather than drawn, so
        // that a GPU draws it where it is stored.
        let described = |m: &ParamMeta, unit: UnitId, p: &FlatParam, range: &Range<usize>| {
            let Init::Seeded { seed, rule } = &self.init else {
                return None;
            };
            let InitRule::Normal { std } = rule(&info_of(m, unit, &p.container).view()) else {
                return None;
            };
            let global_start = match m.placement {
                Placement::Replicated => range.start,
                Placement::Split { dim: 0 } => tp_rank * p.numel + range.start,
                Placement::Split { .. } => return None,
            };
            Some((normal_key(*seed, &m.name), std, global_start))
        };
        let init_for = |unit: UnitId, meta: HashMap<String, ParamMeta>| {
            let values_of = &values_of;
            let described = &described;
            move |p: &FlatParam, range: Range<usize>| -> InitSlice {
                let m = &meta[&p.name];
                match described(m, unit, p, &range) {
                    Some((key, std, start)) => InitSlice::Normal { key, std, start },
                    None => values_of(m, unit, p, range).into(),
                }
            }
        };
        // Each unit's moments take their dtype as it is built, so that a model's f32 zeros are
        // never all held at once.
        let moment_dtype = match &self.optimizer {
            Optimizer::AdamW(adamw) => Some(adamw.moments),
            Optimizer::Custom(_) => None,
        };
        // Tensor parallelism sums its replicated parameters' gradients across the group before
        // they are accumulated, so theirs must stay in the autodiff gradients.
        let summed_across_tp = |layout: &FlatLayout| -> Vec<ParamId> {
            let replicated = |p: &&FlatParam| {
                matches!(placements.get(&p.id), Some(Placement::Replicated) | None)
            };
            let params = layout.params.iter().filter(replicated);
            params.filter(|_| degree > 1).map(|p| p.id).collect()
        };
        macro_rules! sharded {
            ($unit:expr, $id:expr, $layout:expr) => {{
                let id = $id;
                let (meta, groups) = unit_meta(id, $layout);
                let mut unit = ShardedUnit::new_excluding(
                    id.prefix(),
                    lazy($unit),
                    ctx,
                    device,
                    external.clone(),
                    init_for(id, by_path(&meta)),
                )?;
                unit.set_groups(groups)?;
                unit.keep_grads_in_graph(summed_across_tp($layout));
                if let Some(dtype) = moment_dtype {
                    unit.set_moment_dtype(dtype);
                }
                let uses_tied = $layout.params.iter().any(|p| external.contains(&p.id));
                Sharded {
                    unit,
                    id,
                    meta,
                    uses_tied,
                }
            }};
        }
        let layouts: Vec<FlatLayout> = all.iter().map(|(_, l)| l.clone()).collect();
        let n_blocks = units.blocks.len();

        // The tied parameters as a unit of their own, from their first uses.
        let tied = if tied_ids.is_empty() {
            None
        } else {
            let mut collect = CollectTied::<B> {
                ids: &tied_ids,
                matrices: HashMap::new(),
                vectors: HashMap::new(),
                error: None,
            };
            units.stem.visit(&mut collect);
            for b in &units.blocks {
                b.visit(&mut collect);
            }
            units.head.visit(&mut collect);
            if let Some(e) = collect.error {
                return Err(e);
            }
            let mut template = Tied::<B> {
                matrices: Vec::new(),
                vectors: Vec::new(),
            };
            // Tied paths (`matrices.i` / `vectors.i`) and the metadata of each first use.
            let mut meta_by_path = HashMap::new();
            let mut groups = Vec::new();
            for id in &tied_ids {
                let (unit, first, _) = &first_use[id];
                let path = if let Some(p) = collect.matrices.remove(id) {
                    template.matrices.push(p);
                    format!("matrices.{}", template.matrices.len() - 1)
                } else {
                    let p = collect.vectors.remove(id).expect("checked by CollectTied");
                    template.vectors.push(p);
                    format!("vectors.{}", template.vectors.len() - 1)
                };
                let meta = meta_of(*unit, first);
                groups.push((
                    path.clone(),
                    group_of(&info_of(&meta, *unit, &first.container).view()),
                ));
                meta_by_path.insert(path, (meta, *unit));
            }
            let template = lazy(template);
            // The unit's own layout order: matrices, then vectors.
            let layout = FlatLayout::of(&template, 1);
            let ordered: Vec<ParamMeta> = layout
                .params
                .iter()
                .map(|p| meta_by_path[&p.name].0.clone())
                .collect();
            let ordered_groups: Vec<Group> = layout
                .params
                .iter()
                .map(|p| {
                    groups
                        .iter()
                        .find(|(path, _)| *path == p.name)
                        .expect("one group per tied parameter")
                        .1
                })
                .collect();
            let units_of: HashMap<String, UnitId> = meta_by_path
                .iter()
                .map(|(path, (_, unit))| (path.clone(), *unit))
                .collect();
            let metas: HashMap<String, ParamMeta> = meta_by_path
                .into_iter()
                .map(|(path, (meta, _))| (path, meta))
                .collect();
            let tied_init = |p: &FlatParam, range: Range<usize>| {
                let meta = &metas[&p.name];
                // The first use's id and container name the values (tied ids are the same).
                let (_, first, _) = &first_use[&p.id];
                values_of(meta, units_of[&p.name], first, range)
            };
            let mut unit = ShardedUnit::new_excluding(
                "tied",
                template,
                ctx,
                device,
                HashSet::new(),
                tied_init,
            )?;
            unit.set_groups(ordered_groups)?;
            unit.keep_grads_in_graph(summed_across_tp(&layout));
            if let Some(dtype) = moment_dtype {
                unit.set_moment_dtype(dtype);
            }
            Some(Sharded {
                unit,
                id: UnitId::Stem,
                meta: ordered,
                uses_tied: false,
            })
        };

        let stem = sharded!(units.stem, UnitId::Stem, &layouts[0]);
        let mut blocks = Vec::with_capacity(n_blocks);
        for (i, b) in units.blocks.into_iter().enumerate() {
            blocks.push(sharded!(b, UnitId::Block(i), &layouts[i + 1]));
        }
        let head = sharded!(units.head, UnitId::Head, &layouts[n_blocks + 1]);
        if let Some(e) = failure.into_inner() {
            return Err(e);
        }

        // Every rank must have built the same model (names, shapes, placements) and, from the
        // units' own values, data-parallel ranks the same values.
        let mut layout_digest = Fingerprint::default();
        for sharded in std::iter::once(&stem.meta)
            .chain(blocks.iter().map(|b| &b.meta))
            .chain(std::iter::once(&head.meta))
            .chain(tied.iter().map(|t| &t.meta))
        {
            for m in sharded {
                layout_digest.add_str(&m.name);
                layout_digest.add_str(&format!("{:?}{:?}", m.full_shape, m.placement));
            }
        }
        check_ranks_agree(
            mesh,
            layout_digest.0,
            unit_values.is_some().then_some(digest.0),
        )?;

        let mut engine = Engine {
            stem,
            blocks,
            head,
            tied,
            placements,
            device: device.clone(),
            checkpointing: config.checkpointing(),
            selective_recompute: config.selective_recompute,
            reduce_every_micro_batch: config.reduce_every_micro_batch,
            offloading: config.offloading_horizon(),
            offloaded_bytes: 0,
            optimizer: self.optimizer.clone(),
            max_grad_norm: self.max_grad_norm,
            steps: 0,
            aux: None,
            losses: Vec::new(),
            weighted_losses: Vec::new(),
            deferred: false,
            mesh: mesh.clone(),
        };
        if let Optimizer::Custom(_) = &self.optimizer {
            engine.for_each_unit(|u| u.use_custom_optimizer());
        }
        Ok(engine)
    }
}

/// Compares each rank's digests over the world: the layout digest must be the same everywhere,
/// the values digest the same among ranks of the same tensor-parallel index.
fn check_ranks_agree<IB: Backend>(
    mesh: &Mesh<IB>,
    layout: u64,
    values: Option<u64>,
) -> Result<(), SmpError> {
    if mesh.world_size() == 1 {
        return Ok(());
    }
    let mine = [
        mesh.tp().rank() as i64,
        layout as i64,
        values.map_or(0, |v| v as i64),
    ];
    let all = mesh.world().all_gather(&mine)?;
    let rows: Vec<&[i64]> = all.chunks(3).collect();
    for (r, row) in rows.iter().enumerate() {
        if row[1] != rows[0][1] {
            return Err(SmpError::Usage(format!(
                "rank {r} built another model than rank 0 (parameter names, shapes or \
                 placements differ): every rank must build the same units"
            )));
        }
        if values.is_some()
            && let Some((q, _)) = rows
                .iter()
                .enumerate()
                .find(|(_, other)| other[0] == row[0] && other[2] != row[2])
        {
            return Err(SmpError::Usage(format!(
                "ranks {q} and {r} hold different initial values for the same parameters \
                 (Burn's initializers draw from each process's own random state): seed every \
                 rank alike before building the model (Backend::seed), or use Init::seeded"
            )));
        }
    }
    Ok(())
}

/// Clones the first use of each tied parameter (matrices and vectors).
struct CollectTied<'a, B: Backend> {
    ids: &'a [ParamId],
    matrices: HashMap<ParamId, Param<Tensor<B, 2>>>,
    vectors: HashMap<ParamId, Param<Tensor<B, 1>>>,
    error: Option<SmpError>,
}

impl<B: Backend> ModuleVisitor<B> for CollectTied<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if !self.ids.contains(&param.id)
            || self.matrices.contains_key(&param.id)
            || self.vectors.contains_key(&param.id)
        {
            return;
        }
        let any = param as &dyn std::any::Any;
        if let Some(p) = any.downcast_ref::<Param<Tensor<B, 2>>>() {
            self.matrices.insert(param.id, p.clone());
        } else if let Some(p) = any.downcast_ref::<Param<Tensor<B, 1>>>() {
            self.vectors.insert(param.id, p.clone());
        } else {
            self.error.get_or_insert(SmpError::Usage(format!(
                "a tied parameter of rank {D}: only matrices and vectors can be shared between \
                 units"
            )));
        }
    }
}

/// Elements `range` (flat, row-major) of this rank's slice, of shape `local`, of the parameter
/// `info` describes, read from `source` in full-parameter coordinates; every range `source`
/// returns is checked for length.
pub(super) fn read_slice(
    source: &ParamSource<'_>,
    info: &ParamInfo<'_>,
    local: &[usize],
    degree: usize,
    rank: usize,
    range: Range<usize>,
) -> Result<Vec<f32>, SmpError> {
    let full_ranges = match info.placement {
        Placement::Replicated => vec![range.clone()],
        Placement::Split { dim } => slice_ranges(local, dim, degree, rank, range.clone()),
    };
    let mut out = Vec::with_capacity(range.len());
    for r in full_ranges {
        let part = source(info, r.clone())?;
        if part.len() != r.len() {
            return Err(SmpError::Usage(format!(
                "the init source returned {} values for elements {}..{} of {}",
                part.len(),
                r.start,
                r.end,
                info.name
            )));
        }
        out.extend(part);
    }
    Ok(out)
}

/// A [`ParamInfo`] that owns its strings.
struct ParamInfoOwned {
    name: String,
    unit: UnitId,
    path: String,
    shape: Vec<usize>,
    placement: Placement,
    container: String,
}

impl ParamInfoOwned {
    fn view(&self) -> ParamInfo<'_> {
        ParamInfo {
            name: &self.name,
            unit: self.unit,
            path: &self.path,
            shape: &self.shape,
            placement: self.placement,
            container: &self.container,
        }
    }
}

/// Reads every float parameter's values by id ([`Init::FromUnits`]).
struct ReadValues<'a> {
    out: &'a mut HashMap<ParamId, Vec<f32>>,
    path: Vec<String>,
    digest: &'a mut Fingerprint,
    error: Option<SmpError>,
}

impl<B: Backend> ModuleVisitor<B> for ReadValues<'_> {
    fn enter_module(&mut self, name: &str, _: &str) {
        self.path.push(name.to_string());
    }
    fn exit_module(&mut self, _: &str, _: &str) {
        self.path.pop();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if self.out.contains_key(&param.id) || self.error.is_some() {
            return;
        }
        let path = self.path.join(".");
        // A lazy parameter is initialized here by its own initializer, as Burn would on first
        // use.
        let value = param.val();
        let lazy = param.lazy_shape().to_vec();
        if value.dims().as_slice() != lazy.as_slice() {
            self.error = Some(SmpError::Usage(format!(
                "{path}: its value is {:?} but its declared shape {lazy:?} (Burn's \
                 LinearLayout::Col transposes on initialization); use the default layout",
                value.dims()
            )));
            return;
        }
        match value.into_data().convert::<f32>().to_vec::<f32>() {
            Ok(v) => {
                self.digest.add(&v);
                self.out.insert(param.id, v);
            }
            Err(e) => self.error = Some(SmpError::Usage(format!("reading {path}: {e:?}"))),
        }
    }
}

/// A 64-bit FNV-1a digest of values, to check that data-parallel ranks hold the same model.
#[derive(Debug, Default)]
struct Fingerprint(u64);

impl Fingerprint {
    fn add_bytes(&mut self, bytes: impl IntoIterator<Item = u8>) {
        let mut h = if self.0 == 0 {
            0xcbf2_9ce4_8422_2325
        } else {
            self.0
        };
        for b in bytes {
            h = (h ^ b as u64).wrapping_mul(0x100_0000_01b3);
        }
        self.0 = h;
    }

    fn add(&mut self, values: &[f32]) {
        self.add_bytes(values.iter().flat_map(|v| v.to_bits().to_le_bytes()));
    }

    fn add_str(&mut self, s: &str) {
        self.add_bytes(s.bytes());
    }
}

/// `module` with every parameter made lazy again (same id and shape), so that the engine's
/// templates hold no values: an initialized model's values live in the shards only.
fn lazy<B: Backend, M: Module<B>>(module: M) -> M {
    struct Lazy;
    impl<B: Backend> ModuleMapper<B> for Lazy {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let shape = param.lazy_shape();
            let device = param.lazy_device();
            let mut p = Initializer::Zeros.init::<B, D, _>(shape, &device);
            p.id = param.id;
            p
        }
    }
    module.map(&mut Lazy)
}
