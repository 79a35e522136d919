//! The on-disk format: one safetensors file per writing rank and the index that describes the
//! global tensors, and the reader that serves any slice of them.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fs::File;
use std::io::{BufWriter, Read, Seek, SeekFrom, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use burn::tensor::{Tensor, backend::Backend};

use crate::engine::ParamInfo;
use crate::error::SmpError;
use crate::fsdp::StateKind;
use crate::readback::{PendingRead, read_later};

/// The index's `format` field.
pub const FORMAT: &str = "smp-burn-sharded";
/// The index's `version` field: readers refuse other versions with both named.
pub const FORMAT_VERSION: u32 = 1;
/// The index's file name inside a checkpoint directory.
pub const INDEX_FILE: &str = "index.json";
/// Bytes per checksummed block: a reader verifies each block it touches once, so a resharding
/// load that needs a few rows of a file reads and checks those blocks only.
pub const DEFAULT_BLOCK_BYTES: u64 = 16 << 20;
/// The state a checkpoint holds for every parameter, in file order.
pub const KINDS: [StateKind; 3] = [StateKind::Weights, StateKind::ExpAvg, StateKind::ExpAvgSq];

/// The name of `kind` in tensor names and messages.
pub fn kind_name(kind: StateKind) -> &'static str {
    match kind {
        StateKind::Weights => "weights",
        StateKind::ExpAvg => "exp_avg",
        StateKind::ExpAvgSq => "exp_avg_sq",
    }
}

/// Blocks the reader keeps verified in memory (per checkpoint opened): 8 x 16 MiB.
const CACHED_BLOCKS: usize = 8;

/// What `index.json` holds: every global tensor, where its slices are, and every file's size
/// and checksums. Written by rank 0 last, after every rank's file is complete and synced.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Index {
    /// [`FORMAT`].
    pub format: String,
    /// [`FORMAT_VERSION`].
    pub version: u32,
    /// The mesh that wrote it.
    pub mesh: SavedMesh,
    /// The kinds of state each unit's tensors hold, by [`kind_name`].
    pub kinds: Vec<String>,
    /// Every parameter by its global name.
    pub tensors: BTreeMap<String, TensorEntry>,
    /// Every rank file by name.
    pub files: BTreeMap<String, FileEntry>,
}

/// The degrees of the mesh that wrote a checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedMesh {
    /// Ranks.
    pub world: usize,
    /// Replica groups (hybrid sharding); only the first wrote.
    pub replicate: usize,
    /// Ranks each parameter was sharded over.
    pub shard: usize,
    /// Tensor-parallel degree.
    pub tensor: usize,
}

/// One global tensor: its shape and where each part of each tensor-parallel slice lies.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TensorEntry {
    /// The full shape.
    pub shape: Vec<usize>,
    /// Element type of the stored values (`F32`).
    pub dtype: String,
    /// The dimension tensor parallelism split it along when saved (`None`: every
    /// tensor-parallel rank held all of it, and slice 0 is indexed).
    pub split_dim: Option<usize>,
    /// The stored parts, sorted by (tensor-parallel rank, local range).
    pub pieces: Vec<Piece>,
}

/// Elements `local` (row-major, of tensor-parallel slice `tp_rank`) of a tensor, stored in
/// `file` as elements `offset..` of the tensors `<unit>.<kind>`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Piece {
    /// The tensor-parallel slice.
    pub tp_rank: usize,
    /// Flat range within the slice.
    pub local: [usize; 2],
    /// The rank file.
    pub file: String,
    /// The unit whose flat shard holds it.
    pub unit: String,
    /// Element offset of `local[0]` in that shard.
    pub offset: usize,
}

/// A rank file's size, checksums and tensors.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileEntry {
    /// Size in bytes.
    pub bytes: u64,
    /// Bytes per checksummed block (the last may be shorter).
    pub block_bytes: u64,
    /// CRC32 of each block, header included.
    pub block_crc32: Vec<u32>,
    /// Each tensor's absolute byte range in the file.
    pub tensors: BTreeMap<String, [u64; 2]>,
}

/// One rank's part of a checkpoint on its way to host memory: each unit's flat shard of each
/// kind, named `<unit>.<kind>`. On CUDA the copies are queued on the compute stream behind the
/// step that produced the values (into pinned memory, so training does not wait for them and
/// the next optimizer step cannot overtake them); elsewhere the values are read when written.
pub struct ShardSnapshot {
    /// The file it goes to.
    pub file: String,
    tensors: Vec<(String, usize, Values)>,
}

/// A snapshot tensor's values: a device read under way, or made when written (a converter
/// reading another file: one tensor in memory at a time).
enum Values {
    Read(PendingRead),
    Lazy(Box<dyn FnOnce() -> Result<Vec<f32>, SmpError> + Send>),
}

impl std::fmt::Debug for ShardSnapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardSnapshot")
            .field("file", &self.file)
            .field("tensors", &self.tensors.len())
            .field("bytes", &self.bytes())
            .finish()
    }
}

impl ShardSnapshot {
    /// An empty snapshot for `file`.
    pub fn new(file: String) -> Self {
        Self {
            file,
            tensors: Vec::new(),
        }
    }

    /// Starts copying `values` (1-D, any float dtype, stored as f32) as tensor `name`.
    ///
    /// # Errors
    /// The device cannot be reached.
    pub fn push<B: Backend>(&mut self, name: String, values: Tensor<B, 1>) -> Result<(), SmpError> {
        let len = values.dims()[0];
        self.tensors
            .push((name, len, Values::Read(read_later(values)?)));
        Ok(())
    }

    /// Adds tensor `name` of `len` values, made by `make` when the file is written.
    pub fn push_with(
        &mut self,
        name: String,
        len: usize,
        make: impl FnOnce() -> Result<Vec<f32>, SmpError> + Send + 'static,
    ) {
        self.tensors.push((name, len, Values::Lazy(Box::new(make))));
    }

    /// Bytes the file's tensors hold.
    pub fn bytes(&self) -> usize {
        self.tensors.iter().map(|(_, n, _)| n * 4).sum()
    }

    /// Writes the snapshot as a safetensors file `dir/<file>` (1-D F32 tensors), synced to
    /// disk, with a CRC32 per `block_bytes`; returns the file's entry for the index.
    ///
    /// # Errors
    /// The file cannot be created, written or synced (the path and the OS error named).
    pub fn write(self, dir: &Path, block_bytes: u64) -> Result<FileEntry, SmpError> {
        let path = dir.join(&self.file);
        let fail = |e: std::io::Error| SmpError::Checkpoint {
            path: path.clone(),
            reason: format!("writing: {e}"),
        };
        let mut header = serde_json::Map::new();
        header.insert(
            "__metadata__".into(),
            serde_json::json!({ "format": FORMAT, "version": FORMAT_VERSION.to_string() }),
        );
        let mut at = 0u64;
        let mut relative = Vec::with_capacity(self.tensors.len());
        for (name, len, _) in &self.tensors {
            let end = at + 4 * *len as u64;
            header.insert(
                name.clone(),
                serde_json::json!({ "dtype": "F32", "shape": [len], "data_offsets": [at, end] }),
            );
            relative.push((name.clone(), [at, end]));
            at = end;
        }
        let mut header = serde_json::to_vec(&header).expect("a JSON map serializes");
        // safetensors pads the header with spaces so that the data starts 8-byte aligned.
        header.resize(header.len().div_ceil(8) * 8, b' ');
        let data_start = 8 + header.len() as u64;
        let file = File::create(&path).map_err(fail)?;
        let mut out = CrcWriter::new(BufWriter::with_capacity(8 << 20, file), block_bytes);
        out.write_all(&(header.len() as u64).to_le_bytes())
            .map_err(fail)?;
        out.write_all(&header).map_err(fail)?;
        for (name, len, pending) in self.tensors {
            // One tensor's values at a time in pageable memory.
            let values = match pending {
                Values::Read(read) => read.wait()?,
                Values::Lazy(make) => make()?,
            };
            if values.len() != len {
                return Err(SmpError::Checkpoint {
                    path: path.clone(),
                    reason: format!("{name}: {} values read, {len} expected", values.len()),
                });
            }
            for chunk in values.chunks(1 << 20) {
                let bytes: Vec<u8> = chunk.iter().flat_map(|v| v.to_le_bytes()).collect();
                out.write_all(&bytes).map_err(fail)?;
            }
        }
        let (writer, block_crc32, bytes) = out.finish();
        let file = writer.into_inner().map_err(|e| fail(e.into_error()))?;
        file.sync_all().map_err(fail)?;
        Ok(FileEntry {
            bytes,
            block_bytes,
            block_crc32,
            tensors: relative
                .into_iter()
                .map(|(name, [a, b])| (name, [data_start + a, data_start + b]))
                .collect(),
        })
    }
}

/// A writer that checksums what passes through it in fixed blocks.
struct CrcWriter<W: Write> {
    inner: W,
    block_bytes: u64,
    in_block: u64,
    hasher: crc32fast::Hasher,
    crcs: Vec<u32>,
    total: u64,
}

impl<W: Write> CrcWriter<W> {
    fn new(inner: W, block_bytes: u64) -> Self {
        Self {
            inner,
            block_bytes: block_bytes.max(1),
            in_block: 0,
            hasher: crc32fast::Hasher::new(),
            crcs: Vec::new(),
            total: 0,
        }
    }

    fn finish(mut self) -> (W, Vec<u32>, u64) {
        if self.in_block > 0 {
            self.crcs.push(self.hasher.finalize());
        }
        (self.inner, self.crcs, self.total)
    }
}

impl<W: Write> Write for CrcWriter<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let room = (self.block_bytes - self.in_block) as usize;
        let n = self.inner.write(&buf[..buf.len().min(room)])?;
        self.hasher.update(&buf[..n]);
        self.in_block += n as u64;
        self.total += n as u64;
        if self.in_block == self.block_bytes {
            let done = std::mem::take(&mut self.hasher);
            self.crcs.push(done.finalize());
            self.in_block = 0;
        }
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// A committed checkpoint opened for reading: its index, and verified blocks of its files.
pub struct ShardedCheckpoint {
    dir: PathBuf,
    index: Index,
    cache: Mutex<BlockCache>,
    /// Bytes read from its files so far (each block once while cached).
    bytes_read: std::sync::atomic::AtomicU64,
}

#[derive(Default)]
struct BlockCache {
    files: HashMap<String, File>,
    blocks: HashMap<(String, u64), Arc<Vec<u8>>>,
    order: VecDeque<(String, u64)>,
}

impl ShardedCheckpoint {
    /// Opens the checkpoint in `dir`: reads its index and checks that every file it names
    /// exists with the recorded size. Contents are verified block by block as they are read
    /// ([`Self::verify`] reads everything).
    ///
    /// # Errors
    /// No or an unreadable index, another format or version, a missing or truncated file: each
    /// named with the path and the values.
    pub fn open(dir: &Path) -> Result<Self, SmpError> {
        let fail = |reason: String| SmpError::Checkpoint {
            path: dir.to_path_buf(),
            reason,
        };
        let path = dir.join(INDEX_FILE);
        let text = std::fs::read(&path).map_err(|e| fail(format!("reading {INDEX_FILE}: {e}")))?;
        let index: Index = serde_json::from_slice(&text)
            .map_err(|e| fail(format!("{INDEX_FILE} is damaged: {e}")))?;
        if index.format != FORMAT || index.version != FORMAT_VERSION {
            return Err(fail(format!(
                "{INDEX_FILE} is format {} version {}; this build reads {FORMAT} version \
                 {FORMAT_VERSION}",
                index.format, index.version
            )));
        }
        for (name, entry) in &index.files {
            let file = dir.join(name);
            let len = std::fs::metadata(&file)
                .map_err(|e| fail(format!("{name}: {e}")))?
                .len();
            if len != entry.bytes {
                return Err(fail(format!(
                    "{name} has {len} bytes, the index recorded {}: the file is truncated or \
                     was replaced",
                    entry.bytes
                )));
            }
            let blocks = entry.bytes.div_ceil(entry.block_bytes.max(1));
            if entry.block_bytes == 0 || blocks != entry.block_crc32.len() as u64 {
                return Err(fail(format!(
                    "{INDEX_FILE}: {name} lists {} checksums for {} blocks of {} bytes",
                    entry.block_crc32.len(),
                    blocks,
                    entry.block_bytes
                )));
            }
        }
        for (name, t) in &index.tensors {
            for p in &t.pieces {
                let bad_file = !index.files.contains_key(&p.file);
                if bad_file || p.local[0] > p.local[1] {
                    return Err(fail(format!(
                        "{INDEX_FILE}: a piece of {name} names {} elements {}..{}",
                        p.file, p.local[0], p.local[1]
                    )));
                }
            }
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            index,
            cache: Mutex::new(BlockCache::default()),
            bytes_read: Default::default(),
        })
    }

    /// The checkpoint's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The index.
    pub fn index(&self) -> &Index {
        &self.index
    }

    /// Bytes read from the checkpoint's files so far: what a rank's load cost in I/O (its own
    /// shards, rounded out to whole checksum blocks).
    pub fn bytes_read(&self) -> u64 {
        self.bytes_read.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Reads every block of every file and checks its checksum.
    ///
    /// # Errors
    /// The first damaged block, named by file and byte range, or a read failure.
    pub fn verify(&self) -> Result<(), SmpError> {
        for (name, entry) in &self.index.files {
            for block in 0..entry.block_crc32.len() as u64 {
                self.read_block(name, entry, block)?;
            }
        }
        Ok(())
    }

    /// Elements `range` (row-major) of `kind` of the global tensor `name`, whose shape the
    /// caller expects to be `shape`.
    ///
    /// # Errors
    /// A tensor the checkpoint lacks or of another shape (both shapes named), elements no file
    /// holds, a damaged block (file and byte range named).
    pub fn read(
        &self,
        name: &str,
        shape: &[usize],
        kind: StateKind,
        range: Range<usize>,
    ) -> Result<Vec<f32>, SmpError> {
        let entry =
            self.index.tensors.get(name).ok_or_else(|| {
                self.error(format!(
            "has no tensor {name}: it was written for another model (its first tensors: {})",
            self.index.tensors.keys().take(3).cloned().collect::<Vec<_>>().join(", ")
        ))
            })?;
        if entry.shape != shape {
            return Err(self.error(format!(
                "{name} has shape {:?}, this model's is {shape:?}",
                entry.shape
            )));
        }
        let numel: usize = shape.iter().product();
        if range.end > numel {
            return Err(self.error(format!(
                "elements {}..{} of {name} asked for, it has {numel}",
                range.start, range.end
            )));
        }
        let degree = self.index.mesh.tensor.max(1);
        let mut out = Vec::with_capacity(range.len());
        for (tp_rank, local, len) in slice_runs(shape, entry.split_dim, degree, range) {
            self.read_local(name, entry, kind, tp_rank, local..local + len, &mut out)?;
        }
        Ok(out)
    }

    /// A source of `kind`'s values for [`crate::engine::Init::Source`] and
    /// [`crate::engine::Engine::load_state`]: each rank reads only the ranges it holds.
    pub fn source(
        &self,
        kind: StateKind,
    ) -> impl Fn(&ParamInfo<'_>, Range<usize>) -> Result<Vec<f32>, SmpError> + '_ {
        move |info, range| self.read(info.name, info.shape, kind, range)
    }

    fn error(&self, reason: String) -> SmpError {
        SmpError::Checkpoint {
            path: self.dir.clone(),
            reason,
        }
    }

    /// Elements `want` of tensor-parallel slice `tp_rank` of `name`, appended to `out`.
    fn read_local(
        &self,
        name: &str,
        entry: &TensorEntry,
        kind: StateKind,
        tp_rank: usize,
        want: Range<usize>,
        out: &mut Vec<f32>,
    ) -> Result<(), SmpError> {
        let first = entry
            .pieces
            .partition_point(|p| (p.tp_rank, p.local[1]) <= (tp_rank, want.start));
        let mut at = want.start;
        for p in &entry.pieces[first..] {
            if at >= want.end || p.tp_rank != tp_rank || p.local[0] > at {
                break;
            }
            let end = want.end.min(p.local[1]);
            let tensor = format!("{}.{}", p.unit, kind_name(kind));
            let file = &self.index.files[&p.file];
            let Some(&[begin, stop]) = file.tensors.get(&tensor) else {
                return Err(self.error(format!("{} has no tensor {tensor}", p.file)));
            };
            let from = begin + 4 * (p.offset + at - p.local[0]) as u64;
            let to = from + 4 * (end - at) as u64;
            if to > stop {
                return Err(self.error(format!(
                    "{INDEX_FILE}: {name} slice {tp_rank} elements {at}..{end} run past {tensor} \
                     in {}",
                    p.file
                )));
            }
            let bytes = self.read_bytes(&p.file, file, from..to)?;
            out.extend(
                bytes
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            );
            at = end;
        }
        if at < want.end {
            return Err(self.error(format!(
                "{INDEX_FILE}: elements {at}..{} of {name}'s tensor-parallel slice {tp_rank} are in \
                 no file",
                want.end
            )));
        }
        Ok(())
    }

    fn read_bytes(
        &self,
        name: &str,
        entry: &FileEntry,
        range: Range<u64>,
    ) -> Result<Vec<u8>, SmpError> {
        let mut out = Vec::with_capacity((range.end - range.start) as usize);
        let mut at = range.start;
        while at < range.end {
            let block = at / entry.block_bytes;
            let data = self.read_block(name, entry, block)?;
            let start = block * entry.block_bytes;
            let end = range.end.min(start + data.len() as u64);
            out.extend_from_slice(&data[(at - start) as usize..(end - start) as usize]);
            at = end;
        }
        Ok(out)
    }

    /// Block `block` of file `name`, read and verified once, then kept among the last few.
    fn read_block(
        &self,
        name: &str,
        entry: &FileEntry,
        block: u64,
    ) -> Result<Arc<Vec<u8>>, SmpError> {
        let key = (name.to_string(), block);
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(data) = cache.blocks.get(&key) {
            return Ok(data.clone());
        }
        let path = self.dir.join(name);
        let start = block * entry.block_bytes;
        let len = entry.block_bytes.min(entry.bytes.saturating_sub(start));
        let mut data = vec![0u8; len as usize];
        let io = |e: std::io::Error| SmpError::Checkpoint {
            path: path.clone(),
            reason: format!("reading bytes {start}..{}: {e}", start + len),
        };
        if !cache.files.contains_key(name) {
            let f = File::open(&path).map_err(io)?;
            cache.files.insert(name.to_string(), f);
        }
        let file = cache.files.get_mut(name).expect("inserted above");
        file.seek(SeekFrom::Start(start)).map_err(io)?;
        file.read_exact(&mut data).map_err(io)?;
        self.bytes_read
            .fetch_add(len, std::sync::atomic::Ordering::Relaxed);
        let crc = crc32fast::hash(&data);
        let recorded = entry.block_crc32[block as usize];
        if crc != recorded {
            return Err(SmpError::Checkpoint {
                path,
                reason: format!(
                    "damaged: bytes {start}..{} have CRC32 {crc:08x}, the index recorded \
                     {recorded:08x}",
                    start + len
                ),
            });
        }
        let data = Arc::new(data);
        cache.blocks.insert(key.clone(), data.clone());
        cache.order.push_back(key);
        while cache.order.len() > CACHED_BLOCKS {
            let old = cache.order.pop_front().expect("non-empty");
            cache.blocks.remove(&old);
        }
        Ok(data)
    }
}

/// Elements `range` of a full tensor of `shape` as runs `(slice, local start, length)` over the
/// `degree` tensor-parallel slices it was saved in, split along `split_dim` (`None`: slice 0
/// holds it all).
pub(crate) fn slice_runs(
    shape: &[usize],
    split_dim: Option<usize>,
    degree: usize,
    range: Range<usize>,
) -> Vec<(usize, usize, usize)> {
    let Some(dim) = split_dim.filter(|_| degree > 1) else {
        return vec![(0, range.start, range.len())];
    };
    let inner: usize = shape[dim + 1..].iter().product();
    let n = shape[dim];
    let part = n / degree;
    let mut out: Vec<(usize, usize, usize)> = Vec::new();
    let mut g = range.start;
    while g < range.end {
        let (outer, rest) = (g / (n * inner), g % (n * inner));
        let (idx, off) = (rest / inner, rest % inner);
        let (slice, local_idx) = (idx / part, idx % part);
        let local = (outer * part + local_idx) * inner + off;
        let len = ((part - local_idx) * inner - off).min(range.end - g);
        match out.last_mut() {
            Some((s, l, n)) if *s == slice && *l + *n == local => *n += len,
            _ => out.push((slice, local, len)),
        }
        g += len;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Splitting a `[4, 6]` tensor into 2 or 3 slices along either dimension and reading any
    /// range back through the runs gives the row-major elements.
    #[test]
    fn runs_address_every_element_once() {
        let shape = [4usize, 6];
        let full: Vec<usize> = (0..24).collect();
        for dim in [0, 1] {
            for degree in [1, 2, 3] {
                if !shape[dim].is_multiple_of(degree) {
                    continue;
                }
                // Each slice's row-major elements.
                let slices: Vec<Vec<usize>> = (0..degree)
                    .map(|s| {
                        full.iter()
                            .copied()
                            .filter(|&g| {
                                let idx = if dim == 0 { g / 6 } else { g % 6 };
                                idx / (shape[dim] / degree) == s
                            })
                            .collect()
                    })
                    .collect();
                for a in 0..24 {
                    for b in a..=24 {
                        let got: Vec<usize> = slice_runs(&shape, Some(dim), degree, a..b)
                            .into_iter()
                            .flat_map(|(s, l, n)| slices[s][l..l + n].to_vec())
                            .collect();
                        assert_eq!(got, full[a..b], "dim {dim} degree {degree} {a}..{b}");
                    }
                }
            }
        }
    }

    /// A written snapshot reads back through the index, across block boundaries, and a flipped
    /// byte is reported with the file and the byte range.
    #[test]
    fn written_files_read_back_and_damage_is_named() {
        let dir = tempfile_dir();
        let values: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5).collect();
        let file = "tp000-shard00000.safetensors".to_string();
        let mut snap = ShardSnapshot::new(file.clone());
        let t = Tensor::<burn_ndarray::NdArray<f32>, 1>::from_floats(
            values.as_slice(),
            &Default::default(),
        );
        snap.push("u.weights".into(), t).unwrap();
        let entry = snap.write(&dir, 256).unwrap();
        assert!(entry.block_crc32.len() > 10);
        let index = Index {
            format: FORMAT.into(),
            version: FORMAT_VERSION,
            mesh: SavedMesh {
                world: 1,
                replicate: 1,
                shard: 1,
                tensor: 1,
            },
            kinds: vec!["weights".into()],
            tensors: BTreeMap::from([(
                "w".to_string(),
                TensorEntry {
                    shape: vec![10, 100],
                    dtype: "F32".into(),
                    split_dim: None,
                    pieces: vec![Piece {
                        tp_rank: 0,
                        local: [0, 1000],
                        file: file.clone(),
                        unit: "u".into(),
                        offset: 0,
                    }],
                },
            )]),
            files: BTreeMap::from([(file.clone(), entry.clone())]),
        };
        std::fs::write(dir.join(INDEX_FILE), serde_json::to_vec(&index).unwrap()).unwrap();
        let ckpt = ShardedCheckpoint::open(&dir).unwrap();
        let got = ckpt
            .read("w", &[10, 100], StateKind::Weights, 37..911)
            .unwrap();
        assert_eq!(got, values[37..911]);
        let e = ckpt
            .read("w", &[100, 10], StateKind::Weights, 0..1)
            .unwrap_err();
        assert!(e.to_string().contains("[10, 100]"), "{e}");
        ckpt.verify().unwrap();

        // Flip one byte of the data: the block holding it is refused.
        let path = dir.join(&file);
        let mut bytes = std::fs::read(&path).unwrap();
        let at = entry.tensors["u.weights"][0] as usize + 4 * 600;
        bytes[at] ^= 0x10;
        std::fs::write(&path, &bytes).unwrap();
        let ckpt = ShardedCheckpoint::open(&dir).unwrap();
        assert_eq!(
            ckpt.read("w", &[10, 100], StateKind::Weights, 0..100)
                .unwrap(),
            values[..100]
        );
        let e = ckpt
            .read("w", &[10, 100], StateKind::Weights, 0..1000)
            .unwrap_err();
        let text = e.to_string();
        let block = at as u64 / 256 * 256;
        assert!(
            text.contains(&file) && text.contains(&format!("bytes {block}..")),
            "{text}"
        );
        assert!(ckpt.verify().is_err());
        // Truncation is found at open.
        std::fs::write(&path, &bytes[..bytes.len() - 4]).unwrap();
        let e = ShardedCheckpoint::open(&dir)
            .err()
            .expect("a truncated file");
        assert!(e.to_string().contains("truncated"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn tempfile_dir() -> PathBuf {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "smp-ckpt-test-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }
}
