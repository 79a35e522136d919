//! The engine's side of sharded checkpoints ([`crate::checkpoint`]): what this rank writes,
//! the index that describes every rank's files, and loading into any layout.

use std::collections::BTreeMap;

use burn::module::Module;
use burn::tensor::backend::AutodiffBackend;

use super::{BlockUnit, Engine, HeadUnit, Sharded, StemUnit};
use crate::checkpoint::{
    FORMAT, FORMAT_VERSION, FileEntry, Index, KINDS, Piece, SavedMesh, ShardSnapshot,
    ShardedCheckpoint, TensorEntry, kind_name, rank_file,
};
use crate::error::SmpError;
use crate::tp::Placement;

impl<B, S, K, H> Engine<B, S, K, H>
where
    B: AutodiffBackend,
    S: StemUnit<B>,
    K: BlockUnit<B, Aux = S::Aux>,
    H: HeadUnit<B>,
{
    /// This rank's part of a checkpoint: every unit's fp32 master shard and AdamW moments,
    /// their copies to host memory started (queued behind the last step on CUDA). `None` on
    /// replicas other than the first (hybrid sharding): their shards are the first replica's.
    /// Not collective.
    ///
    /// # Errors
    /// Another optimizer than AdamW; a failed device read.
    pub fn snapshot_shards(&self) -> Result<Option<ShardSnapshot>, SmpError> {
        let replica = self.mesh.fsdp().replicate.as_ref().map_or(0, |r| r.rank());
        if replica > 0 {
            return Ok(None);
        }
        let mut snapshot = ShardSnapshot::new(rank_file(
            self.mesh.tp().rank(),
            self.stem.unit.shard_rank(),
        ));
        snapshot_unit(&self.stem, &mut snapshot)?;
        for b in &self.blocks {
            snapshot_unit(b, &mut snapshot)?;
        }
        snapshot_unit(&self.head, &mut snapshot)?;
        if let Some(t) = &self.tied {
            snapshot_unit(t, &mut snapshot)?;
        }
        Ok(Some(snapshot))
    }

    /// The index of a checkpoint this engine's ranks wrote with [`Self::snapshot_shards`],
    /// given every written file's entry. Derived from this rank's layout: every rank's units
    /// have the same flat layout and shard degree, so no rank's pieces need sending.
    pub fn checkpoint_index(&self, files: BTreeMap<String, FileEntry>) -> Index {
        let dims = self.mesh.dims();
        let tp = self.mesh.tp().degree();
        let mut tensors = BTreeMap::new();
        index_unit(&self.stem, tp, &mut tensors);
        for b in &self.blocks {
            index_unit(b, tp, &mut tensors);
        }
        index_unit(&self.head, tp, &mut tensors);
        if let Some(t) = &self.tied {
            index_unit(t, tp, &mut tensors);
        }
        for entry in tensors.values_mut() {
            entry
                .pieces
                .sort_by_key(|p: &Piece| (p.tp_rank, p.local[0]));
        }
        Index {
            format: FORMAT.into(),
            version: FORMAT_VERSION,
            mesh: SavedMesh {
                world: dims.world,
                replicate: dims.replicate,
                shard: dims.shard,
                tensor: dims.tensor,
            },
            kinds: KINDS.iter().map(|k| kind_name(*k).to_string()).collect(),
            tensors,
            files,
        }
    }

    /// Overwrites the weights and AdamW moments from `checkpoint`, written by any layout: each
    /// rank reads only the byte ranges of its own shards (and verifies the blocks it reads).
    ///
    /// # Errors
    /// A tensor the checkpoint lacks or of another shape; a damaged block.
    pub fn load_checkpoint(&mut self, checkpoint: &ShardedCheckpoint) -> Result<(), SmpError> {
        for kind in KINDS {
            self.load_state(kind, &checkpoint.source(kind))?;
        }
        Ok(())
    }
}

fn snapshot_unit<B: AutodiffBackend, M: Module<B>>(
    unit: &Sharded<B, M>,
    out: &mut ShardSnapshot,
) -> Result<(), SmpError> {
    let state = unit.unit.shard_state()?;
    for (kind, t) in KINDS.into_iter().zip(state) {
        out.push(format!("{}.{}", unit.unit.name, kind_name(kind)), t)?;
    }
    Ok(())
}

/// Adds the pieces of `unit`'s parameters that every (tensor-parallel rank, shard rank) file
/// holds. A parameter every tensor-parallel rank holds whole is indexed from slice 0 only.
fn index_unit<B: AutodiffBackend, M: Module<B>>(
    unit: &Sharded<B, M>,
    tp: usize,
    tensors: &mut BTreeMap<String, TensorEntry>,
) {
    let layout = unit.unit.layout();
    let degree = unit.unit.shard_degree();
    for (p, m) in layout.params.iter().zip(&unit.meta) {
        let split_dim = match m.placement {
            Placement::Split { dim } if tp > 1 => Some(dim),
            _ => None,
        };
        let entry = tensors
            .entry(m.name.clone())
            .or_insert_with(|| TensorEntry {
                shape: m.full_shape.clone(),
                dtype: "F32".into(),
                split_dim,
                pieces: Vec::new(),
            });
        let slices = if split_dim.is_some() { tp } else { 1 };
        for tp_rank in 0..slices {
            for shard in 0..degree {
                let held = layout.shard_range(shard, degree);
                let start = held.start.max(p.offset);
                let end = held.end.min(p.offset + p.numel);
                if start >= end {
                    continue;
                }
                entry.pieces.push(Piece {
                    tp_rank,
                    local: [start - p.offset, end - p.offset],
                    file: rank_file(tp_rank, shard),
                    unit: unit.unit.name.clone(),
                    offset: start - held.start,
                });
            }
        }
    }
}
