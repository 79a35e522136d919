//! The engine's state as full, named tensors: for checkpoints and exports, and for loading
//! them back into any layout.

use std::ops::Range;

use burn::module::Module;
use burn::tensor::{Tensor, TensorData, backend::AutodiffBackend};

use super::build::{ParamSource, read_slice};
use super::{BlockUnit, Engine, HeadUnit, ParamInfo, ParamMeta, Sharded, StemUnit, UnitId, Units};
use crate::error::SmpError;
use crate::fsdp::{ExternalParams, FlatParam, StateKind};
use crate::tp::Placement;
use crate::tp::placement::join_slices;

/// Full tensors by name: `(name, shape, fp32 values)`.
pub type NamedTensors = Vec<(String, Vec<usize>, Vec<f32>)>;

/// One parameter of the engine's plan: what a user reads to see how the model was split.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanEntry {
    /// The parameter's name.
    pub name: String,
    /// The unit that holds it (`tied` parameters: their first use).
    pub unit: UnitId,
    /// Whether it is shared between units (sharded once, in a unit of its own).
    pub tied: bool,
    /// The full shape.
    pub shape: Vec<usize>,
    /// How tensor parallelism places it.
    pub placement: Placement,
}

impl<B, S, K, H> Engine<B, S, K, H>
where
    B: AutodiffBackend,
    S: StemUnit<B>,
    K: BlockUnit<B, Aux = S::Aux>,
    H: HeadUnit<B>,
{
    /// Every parameter with its full shape and placement, unit by unit.
    pub fn plan(&self) -> Vec<PlanEntry> {
        let mut out = Vec::new();
        let mut add = |meta: &[ParamMeta], unit: UnitId, tied: bool| {
            out.extend(meta.iter().map(|m| PlanEntry {
                name: m.name.clone(),
                unit,
                tied,
                shape: m.full_shape.clone(),
                placement: m.placement,
            }))
        };
        add(&self.stem.meta, UnitId::Stem, false);
        for b in &self.blocks {
            add(&b.meta, b.id, false);
        }
        add(&self.head.meta, UnitId::Head, false);
        if let Some(t) = &self.tied {
            add(&t.meta, t.id, true);
        }
        out
    }

    /// A one-line summary of the plan for logs: units, parameters split and replicated.
    pub fn plan_summary(&self) -> String {
        let plan = self.plan();
        let count = |split: bool| {
            plan.iter()
                .filter(|p| matches!(p.placement, Placement::Split { .. }) == split)
                .map(|p| p.shape.iter().product::<usize>())
                .sum::<usize>()
        };
        let tied: Vec<&str> = plan
            .iter()
            .filter(|p| p.tied)
            .map(|p| p.name.as_str())
            .collect();
        format!(
            "{} units (stem, {} blocks, head{}); {:.2}M parameters split over {} tensor-parallel \
             ranks, {:.2}M replicated; {} recomputed block(s){}",
            self.blocks.len() + 2 + usize::from(self.tied.is_some()),
            self.blocks.len(),
            if tied.is_empty() {
                String::new()
            } else {
                format!(", tied: {}", tied.join(", "))
            },
            count(true) as f64 / 1e6,
            self.mesh.tp().degree(),
            count(false) as f64 / 1e6,
            self.checkpointing.recomputed_layers(self.blocks.len()),
            match self.offloading {
                Some(h) => format!(", offloaded to host memory (loading horizon {h})"),
                None => String::new(),
            }
        )
    }

    /// The units with their full fp32 weights, as plain Burn modules (no gradients): for Burn's
    /// own tools (records, evaluation, a single-process run). Tied parameters come back shared
    /// (one id, one tensor). Collective: every rank must call it.
    ///
    /// # Errors
    /// Under tensor parallelism (the layers then hold slices, not whole weights; use
    /// [`Self::gather_named`]), or a failed collective.
    pub fn gather_units(&self) -> Result<Units<S, K, H>, SmpError> {
        if self.mesh.tp().degree() > 1 {
            return Err(SmpError::Usage(format!(
                "gather_units under tensor_parallel_degree {}: the layers hold slices; use \
                 gather_named for the full tensors",
                self.mesh.tp().degree()
            )));
        }
        let ctx = self.mesh.fsdp();
        let mut external = ExternalParams::default();
        if let Some(t) = &self.tied {
            let tied = t.unit.gather_master(ctx, &ExternalParams::default())?;
            for p in &tied.matrices {
                external.insert::<B, 2>(p.id, p.val());
            }
            for p in &tied.vectors {
                external.insert::<B, 1>(p.id, p.val());
            }
        }
        Ok(Units {
            stem: self.stem.unit.gather_master(ctx, &external)?,
            blocks: self
                .blocks
                .iter()
                .map(|b| b.unit.gather_master(ctx, &external))
                .collect::<Result<_, _>>()?,
            head: self.head.unit.gather_master(ctx, &external)?,
        })
    }

    /// Every parameter's (or AdamW moment's) full fp32 values by name, in plan order. Split
    /// parameters' slices are gathered over the tensor-parallel group and joined, so the
    /// result is the same whatever the layout. Collective: every rank must call it. Holds the
    /// whole model on every rank: [`Self::for_each_gathered`] holds one unit at a time.
    ///
    /// # Errors
    /// A failed collective; moments under another optimizer than AdamW.
    pub fn gather_named(&self, which: StateKind) -> Result<NamedTensors, SmpError> {
        let mut out = Vec::new();
        self.for_each_gathered(which, |name, shape, values| {
            out.push((name.to_string(), shape.to_vec(), values));
            Ok(())
        })?;
        Ok(out)
    }

    /// Calls `f(name, full shape, full fp32 values)` for every parameter (or AdamW moment) in
    /// plan order, gathering one unit at a time: no rank holds more than its shards and one
    /// unit's full values (an export of a model larger than any host's memory). Collective:
    /// every rank calls it and sees every tensor; typically one rank writes them.
    ///
    /// # Errors
    /// A failed collective; moments under another optimizer than AdamW; what `f` returns.
    pub fn for_each_gathered(
        &self,
        which: StateKind,
        mut f: impl FnMut(&str, &[usize], Vec<f32>) -> Result<(), SmpError>,
    ) -> Result<(), SmpError> {
        self.gather_unit(&self.stem, which, &mut f)?;
        for b in &self.blocks {
            self.gather_unit(b, which, &mut f)?;
        }
        self.gather_unit(&self.head, which, &mut f)?;
        if let Some(t) = &self.tied {
            self.gather_unit(t, which, &mut f)?;
        }
        Ok(())
    }

    fn gather_unit<M: Module<B>>(
        &self,
        unit: &Sharded<B, M>,
        which: StateKind,
        f: &mut impl FnMut(&str, &[usize], Vec<f32>) -> Result<(), SmpError>,
    ) -> Result<(), SmpError> {
        let items = unit.unit.gather_full_f32(self.mesh.fsdp(), which)?;
        let items = self.join_tp_slices(&unit.meta, items)?;
        for ((_, values), m) in items.into_iter().zip(&unit.meta) {
            f(&m.name, &m.full_shape, values)?;
        }
        Ok(())
    }

    /// One unit's parameters with their tensor-parallel slices (this rank's) replaced by the
    /// full tensors: one all-gather over the group of every split parameter of the unit.
    fn join_tp_slices(
        &self,
        meta: &[ParamMeta],
        mut items: Vec<(FlatParam, Vec<f32>)>,
    ) -> Result<Vec<(FlatParam, Vec<f32>)>, SmpError> {
        let Some(tp) = self.mesh.tp_context() else {
            return Ok(items);
        };
        let split: Vec<(usize, usize)> = meta
            .iter()
            .enumerate()
            .filter_map(|(i, m)| match m.placement {
                Placement::Split { dim } => Some((i, dim)),
                Placement::Replicated => None,
            })
            .collect();
        if split.is_empty() {
            return Ok(items);
        }
        let mut local = Vec::new();
        for (i, _) in &split {
            local.extend_from_slice(&items[*i].1);
        }
        let per_rank = local.len();
        let t = Tensor::<B::InnerBackend, 1>::from_data(
            TensorData::new(local, [per_rank]),
            &self.device,
        );
        let all: Vec<f32> = tp
            .all_gather(t)?
            .into_data()
            .convert::<f32>()
            .to_vec()
            .map_err(|e| SmpError::Usage(format!("reading gathered slices: {e:?}")))?;
        let degree = tp.degree();
        let mut offset = 0;
        for (i, dim) in split {
            let (p, values) = &mut items[i];
            let slices: Vec<&[f32]> = (0..degree)
                .map(|r| &all[r * per_rank + offset..r * per_rank + offset + p.numel])
                .collect();
            offset += p.numel;
            *values = join_slices(&slices, &p.shape, dim);
        }
        Ok(items)
    }

    /// Overwrites `kind` (the weights or an AdamW moment) of every parameter from full values:
    /// loads a checkpoint written with any layout (each rank reads only its own slice).
    ///
    /// # Errors
    /// What `source` reports; moments under another optimizer than AdamW.
    pub fn load_state(
        &mut self,
        kind: StateKind,
        source: &ParamSource<'_>,
    ) -> Result<(), SmpError> {
        let degree = self.mesh.tp().degree();
        let rank = self.mesh.tp().rank();
        let failure = std::cell::RefCell::new(None);
        // Each unit's metadata by flat offset (its layout's order; a tied unit's paths are its
        // own, not its first use's).
        let load = |params: &[FlatParam], meta: &[ParamMeta], unit: UnitId| {
            let by_offset: std::collections::HashMap<usize, ParamMeta> = params
                .iter()
                .zip(meta)
                .map(|(p, m)| (p.offset, m.clone()))
                .collect();
            let failure = &failure;
            move |p: &FlatParam, range: Range<usize>| {
                let m = &by_offset[&p.offset];
                let info = ParamInfo {
                    name: &m.name,
                    unit,
                    path: &m.path,
                    shape: &m.full_shape,
                    placement: m.placement,
                    container: &p.container,
                };
                read_slice(source, &info, &p.shape, degree, rank, range.clone()).unwrap_or_else(
                    |e| {
                        failure.borrow_mut().get_or_insert(e);
                        vec![0.0; range.len()]
                    },
                )
            }
        };
        let f = load(
            &self.stem.unit.layout().params,
            &self.stem.meta,
            UnitId::Stem,
        );
        self.stem.unit.load_state(kind, f)?;
        for b in &mut self.blocks {
            let f = load(&b.unit.layout().params, &b.meta, b.id);
            b.unit.load_state(kind, f)?;
        }
        let f = load(
            &self.head.unit.layout().params,
            &self.head.meta,
            UnitId::Head,
        );
        self.head.unit.load_state(kind, f)?;
        if let Some(t) = &mut self.tied {
            let f = load(&t.unit.layout().params, &t.meta, t.id);
            t.unit.load_state(kind, f)?;
        }
        match failure.into_inner() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}
