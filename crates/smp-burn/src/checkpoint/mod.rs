//! Sharded checkpoints, as PyTorch DCP and Megatron's distributed checkpoints write them: each
//! rank writes only what it holds, one small index describes the global tensors, the write runs
//! in the background, and a load reshards to any layout.
//!
//! A checkpoint is a directory `step-NNNNNN/`:
//! - `tpTTT-shardSSSSS.safetensors`, one per rank of the first replica: every unit's flat fp32
//!   master shard and AdamW moments as 1-D tensors `<unit>.<kind>` (kind `weights`, `exp_avg`,
//!   `exp_avg_sq`);
//! - `index.json` ([`Index`]): the mesh that wrote it; for every parameter its global name,
//!   shape, the dimension tensor parallelism split it along, and which element range of which
//!   file's tensor holds which part of each slice; for every file its size and a CRC32 per
//!   16 MiB block;
//! - the caller's own small files (the trainer's state and tokenizer).
//!
//! Guarantees ([`Checkpointer`]):
//! - A checkpoint becomes visible only when every rank's file is complete and synced: files are
//!   written into `.step-NNNNNN.partial/`, rank 0 writes the index last, syncs, renames the
//!   directory into place and then moves `latest`. A crash at any moment leaves the previous
//!   checkpoint as `latest`.
//! - Every block read is checked against its CRC32; a damaged or truncated file is reported by
//!   name and byte range ([`ShardedCheckpoint`]).
//! - Training waits only for the copy of this rank's shards to host memory; the write runs on a
//!   background thread, and the next save waits for the previous one.
//! - Loading reshards: any world size, shard degree and tensor-parallel degree reads a
//!   checkpoint written by any other ([`crate::engine::Engine::load_checkpoint`]); each rank
//!   reads only the byte ranges it holds.

mod format;
mod manager;

pub use format::{
    DEFAULT_BLOCK_BYTES, FORMAT, FORMAT_VERSION, FileEntry, INDEX_FILE, Index, KINDS, Piece,
    SavedMesh, ShardSnapshot, ShardedCheckpoint, TensorEntry, kind_name,
};
pub use manager::{Checkpointer, Committed, SaveStarted, committed_checkpoints};

/// The file a rank writes: named by its tensor-parallel rank and its rank in the shard group,
/// so that the index can be derived from the layout alone.
pub fn rank_file(tp_rank: usize, shard_rank: usize) -> String {
    format!("tp{tp_rank:03}-shard{shard_rank:05}.safetensors")
}
