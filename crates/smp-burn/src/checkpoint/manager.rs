//! Saving in the background and committing atomically: [`Checkpointer`].

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use burn::tensor::backend::AutodiffBackend;
use collectives::{Communicator, CommunicatorExt, ReduceOp};

use super::format::{DEFAULT_BLOCK_BYTES, FileEntry, INDEX_FILE, Index, ShardSnapshot};
use crate::engine::{BlockUnit, Engine, HeadUnit, StemUnit};
use crate::error::SmpError;

/// What a rank's writer thread reports: its file (none on replicas that do not write) or why
/// it failed.
type WriterResult = Result<Option<(String, FileEntry)>, String>;

/// Saves an engine's state as sharded checkpoints under one directory (`root/step-NNNNNN`, and
/// `root/latest` naming the newest), writing in the background and committing when every rank
/// is done. Every rank of the job holds one and uses it the same way, in the same order:
/// [`Self::save`] at a save step, [`Self::poll`] once per step, [`Self::finish`] at the end.
pub struct Checkpointer {
    root: PathBuf,
    world: Arc<dyn Communicator>,
    keep: Option<usize>,
    block_bytes: u64,
    pending: Option<Pending>,
}

/// A save whose files are being written.
struct Pending {
    step: u64,
    tmp: PathBuf,
    /// Rank 0's index without the files (the layout is known at the save step).
    index: Option<Index>,
    extra: Vec<(String, Vec<u8>)>,
    writer: Option<JoinHandle<WriterResult>>,
    started: Instant,
}

/// What [`Checkpointer::save`] did before returning to training.
#[derive(Debug, Clone, Copy)]
pub struct SaveStarted {
    /// Time spent waiting for the previous save to finish.
    pub waited: Duration,
    /// Time training was blocked by this save: starting the copies of this rank's shards to
    /// host memory (on CUDA they run on the compute stream, before the next step's work).
    pub blocked: Duration,
    /// Bytes this rank writes.
    pub bytes: usize,
}

/// A checkpoint made visible.
#[derive(Debug, Clone)]
pub struct Committed {
    /// Its step.
    pub step: u64,
    /// Its directory.
    pub dir: PathBuf,
    /// From [`Checkpointer::save`] to the commit: the background write and the wait for every
    /// rank.
    pub write_time: Duration,
}

impl Checkpointer {
    /// A checkpointer writing under `root`, keeping every checkpoint, with 16 MiB checksum
    /// blocks. `world` is the job's host communicator (every rank).
    pub fn new(root: impl Into<PathBuf>, world: Arc<dyn Communicator>) -> Self {
        Self {
            root: root.into(),
            world,
            keep: None,
            block_bytes: DEFAULT_BLOCK_BYTES,
            pending: None,
        }
    }

    /// Keeps only the newest `keep` committed checkpoints (`None`: all). At least 1.
    pub fn keep(mut self, keep: Option<usize>) -> Self {
        self.keep = keep.map(|k| k.max(1));
        self
    }

    /// Bytes per checksummed block (tests use small blocks to exercise many of them).
    pub fn block_bytes(mut self, bytes: u64) -> Self {
        self.block_bytes = bytes.max(1);
        self
    }

    /// The directory checkpoints go to.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Whether a save is being written.
    pub fn is_pending(&self) -> bool {
        self.pending.is_some()
    }

    /// Starts saving `engine`'s state at `step`, with the caller's small files (`(name,
    /// bytes)`, written by rank 0 into the checkpoint beside the index). Waits for the previous
    /// save to commit, copies this rank's shards to host memory and returns; a background
    /// thread writes them. Collective.
    ///
    /// # Errors
    /// The previous save failed; the directory cannot be prepared; a collective failed.
    pub fn save<B, S, K, H>(
        &mut self,
        engine: &Engine<B, S, K, H>,
        step: u64,
        extra: Vec<(String, Vec<u8>)>,
    ) -> Result<SaveStarted, SmpError>
    where
        B: AutodiffBackend,
        S: StemUnit<B>,
        K: BlockUnit<B, Aux = S::Aux>,
        H: HeadUnit<B>,
    {
        let t0 = Instant::now();
        self.finish()?;
        let waited = t0.elapsed();
        let t1 = Instant::now();
        let snapshot = engine.snapshot_shards()?;
        let blocked = t1.elapsed();
        let index = (self.world.rank() == 0).then(|| engine.checkpoint_index(BTreeMap::new()));
        let mut started = self.save_prepared(step, snapshot, index, extra)?;
        started.waited = waited;
        started.blocked = blocked;
        Ok(started)
    }

    /// [`Self::save`] of a snapshot and index made by the caller (a converter writing a
    /// checkpoint from other files): `index` (without its files) on rank 0, `None` elsewhere;
    /// `snapshot` on the ranks that write one. Collective.
    ///
    /// # Errors
    /// As [`Self::save`]; rank 0 without an index.
    pub fn save_prepared(
        &mut self,
        step: u64,
        snapshot: Option<ShardSnapshot>,
        index: Option<Index>,
        extra: Vec<(String, Vec<u8>)>,
    ) -> Result<SaveStarted, SmpError> {
        let t0 = Instant::now();
        self.finish()?;
        let waited = t0.elapsed();
        let lead = self.world.rank() == 0;
        let tmp = self.root.join(format!(".step-{step:06}.partial"));
        if lead && index.is_none() {
            return Err(self.error(&tmp, "rank 0 saves without an index"));
        }
        // Rank 0 clears what a crashed run left (partial directories are never read) and makes
        // the directory before anyone writes into it.
        let prepared = if lead { self.prepare(&tmp).err() } else { None };
        let ok = self.agree(prepared.is_none())?;
        if let Some(e) = prepared {
            return Err(e);
        }
        if !ok {
            return Err(self.error(&tmp, "rank 0 could not prepare the directory (see its log)"));
        }
        let bytes = snapshot.as_ref().map_or(0, ShardSnapshot::bytes);
        let (dir, block_bytes) = (tmp.clone(), self.block_bytes);
        let writer = std::thread::Builder::new()
            .name(format!("checkpoint-{step}"))
            .spawn(move || -> WriterResult {
                let Some(snapshot) = snapshot else {
                    return Ok(None);
                };
                let file = snapshot.file.clone();
                let entry = snapshot
                    .write(&dir, block_bytes)
                    .map_err(|e| e.to_string())?;
                Ok(Some((file, entry)))
            })
            .map_err(|e| self.error(&tmp, &format!("starting the writer thread: {e}")))?;
        self.pending = Some(Pending {
            step,
            tmp,
            index,
            extra,
            writer: Some(writer),
            started: t0,
        });
        Ok(SaveStarted {
            waited,
            blocked: Duration::ZERO,
            bytes,
        })
    }

    /// Commits the pending save if every rank has written its file: one small all-reduce while
    /// a save is pending, nothing otherwise. Once per step on every rank.
    ///
    /// # Errors
    /// A rank's write or the commit failed (the partial directory is removed; the previous
    /// checkpoint stays `latest`).
    pub fn poll(&mut self) -> Result<Option<Committed>, SmpError> {
        let Some(p) = &self.pending else {
            return Ok(None);
        };
        let mine = p.writer.as_ref().is_none_or(|w| w.is_finished());
        if self.agree(mine)? {
            self.commit()
        } else {
            Ok(None)
        }
    }

    /// Waits for the pending save and commits it. Collective.
    ///
    /// # Errors
    /// As [`Self::poll`].
    pub fn finish(&mut self) -> Result<Option<Committed>, SmpError> {
        if self.pending.is_none() {
            return Ok(None);
        }
        self.commit()
    }

    /// Whether every rank says `mine`.
    fn agree(&self, mine: bool) -> Result<bool, SmpError> {
        let mut dissent = [u8::from(!mine)];
        self.world.all_reduce(&mut dissent, ReduceOp::Max)?;
        Ok(dissent[0] == 0)
    }

    fn error(&self, path: &Path, reason: &str) -> SmpError {
        SmpError::Checkpoint {
            path: path.to_path_buf(),
            reason: reason.to_string(),
        }
    }

    fn prepare(&self, tmp: &Path) -> Result<(), SmpError> {
        let io = |p: &Path, e: std::io::Error| self.error(p, &e.to_string());
        std::fs::create_dir_all(&self.root).map_err(|e| io(&self.root, e))?;
        for entry in std::fs::read_dir(&self.root).map_err(|e| io(&self.root, e))? {
            let path = entry.map_err(|e| io(&self.root, e))?.path();
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
            if name.starts_with(".step-") && path.is_dir() {
                std::fs::remove_dir_all(&path).map_err(|e| io(&path, e))?;
            }
        }
        std::fs::create_dir_all(tmp).map_err(|e| io(tmp, e))
    }

    /// Waits for this rank's writer, shares every rank's result, and lets rank 0 publish.
    fn commit(&mut self) -> Result<Option<Committed>, SmpError> {
        let Some(mut p) = self.pending.take() else {
            return Ok(None);
        };
        let mine: WriterResult = match p.writer.take().map(JoinHandle::join) {
            Some(Ok(result)) => result,
            Some(Err(_)) => Err("the writer thread panicked".into()),
            None => Ok(None),
        };
        let encoded = serde_json::to_vec(&mine).expect("a writer result serializes");
        let all = self.world.all_gather_varlen(&encoded)?;
        let mut files = BTreeMap::new();
        let mut failures = Vec::new();
        for (rank, bytes) in all.iter().enumerate() {
            match serde_json::from_slice::<WriterResult>(bytes) {
                Ok(Ok(Some((name, entry)))) => {
                    files.insert(name, entry);
                }
                Ok(Ok(None)) => {}
                Ok(Err(e)) => failures.push(format!("rank {rank}: {e}")),
                Err(e) => failures.push(format!("rank {rank}: unreadable report ({e})")),
            }
        }
        let lead = self.world.rank() == 0;
        let published = if !failures.is_empty() {
            Err(self.error(
                &p.tmp,
                &format!("step {} was not saved: {}", p.step, failures.join("; ")),
            ))
        } else if lead {
            let mut index = p.index.take().expect("rank 0 made the index");
            index.files = files;
            self.publish(&p, &index)
        } else {
            Ok(())
        };
        if published.is_err() && lead {
            let _ = std::fs::remove_dir_all(&p.tmp);
        }
        // Every rank learns whether rank 0 made it visible.
        let ok = self.agree_with_lead(published.is_ok())?;
        published?;
        if !ok {
            return Err(self.error(
                &p.tmp,
                &format!("rank 0 could not commit step {} (see its log)", p.step),
            ));
        }
        Ok(Some(Committed {
            step: p.step,
            dir: self.root.join(step_dir(p.step)),
            write_time: p.started.elapsed(),
        }))
    }

    fn agree_with_lead(&self, ok: bool) -> Result<bool, SmpError> {
        let mut flag = [u8::from(ok)];
        self.world.broadcast(&mut flag, 0)?;
        Ok(flag[0] == 1)
    }

    /// Rank 0: the caller's files and the index into the partial directory, synced; the
    /// directory renamed into place; `latest` moved; old checkpoints pruned.
    fn publish(&self, p: &Pending, index: &Index) -> Result<(), SmpError> {
        for (name, bytes) in &p.extra {
            write_synced(&p.tmp.join(name), bytes)?;
        }
        let json = serde_json::to_vec_pretty(index).expect("the index serializes");
        write_synced(&p.tmp.join(INDEX_FILE), &json)?;
        sync_dir(&p.tmp)?;
        let name = step_dir(p.step);
        let dest = self.root.join(&name);
        // A checkpoint of the same step (a run resumed from an earlier one) is moved aside, not
        // deleted, until the new one is in place.
        let aside = self.root.join(format!(".{name}.replaced"));
        let replaced = dest.exists();
        if replaced {
            std::fs::rename(&dest, &aside).map_err(|e| self.error(&dest, &e.to_string()))?;
        }
        std::fs::rename(&p.tmp, &dest).map_err(|e| self.error(&dest, &e.to_string()))?;
        sync_dir(&self.root)?;
        let latest_tmp = self.root.join(".latest.partial");
        write_synced(&latest_tmp, name.as_bytes())?;
        let latest = self.root.join("latest");
        std::fs::rename(&latest_tmp, &latest).map_err(|e| self.error(&latest, &e.to_string()))?;
        sync_dir(&self.root)?;
        if replaced {
            let _ = std::fs::remove_dir_all(&aside);
        }
        if let Some(keep) = self.keep {
            for (step, old) in committed_steps(&self.root).into_iter().rev().skip(keep) {
                if step != p.step {
                    // Renamed out of sight first: a kill in the middle of deleting must not
                    // leave a `step-*` directory that is neither complete nor ever pruned.
                    let doomed = self.root.join(format!(".{}.deleting", step_dir(step)));
                    if std::fs::rename(&old, &doomed).is_ok() {
                        let _ = std::fs::remove_dir_all(&doomed);
                    }
                }
            }
        }
        Ok(())
    }
}

fn step_dir(step: u64) -> String {
    format!("step-{step:06}")
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), SmpError> {
    use std::io::Write;
    let fail = |e: std::io::Error| SmpError::Checkpoint {
        path: path.to_path_buf(),
        reason: format!("writing: {e}"),
    };
    let mut f = std::fs::File::create(path).map_err(fail)?;
    f.write_all(bytes).map_err(fail)?;
    f.sync_all().map_err(fail)
}

/// Syncs a directory's entries (a rename is durable only once its directory is).
fn sync_dir(dir: &Path) -> Result<(), SmpError> {
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| SmpError::Checkpoint {
            path: dir.to_path_buf(),
            reason: format!("syncing the directory: {e}"),
        })
}

/// Committed checkpoints (`step-*` directories with an index) under `root`, oldest first.
fn committed_steps(root: &Path) -> Vec<(u64, PathBuf)> {
    let Ok(entries) = std::fs::read_dir(root) else {
        return Vec::new();
    };
    let mut out: Vec<(u64, PathBuf)> = entries
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let step = name.strip_prefix("step-")?.parse().ok()?;
            let path = e.path();
            path.join(INDEX_FILE).is_file().then_some((step, path))
        })
        .collect();
    out.sort();
    out
}

/// The committed checkpoints under `root` in the order a resume tries them: the one `latest`
/// names, then the others newest first (the fallbacks when it is damaged).
pub fn committed_checkpoints(root: &Path) -> Vec<PathBuf> {
    let mut steps: Vec<PathBuf> = committed_steps(root)
        .into_iter()
        .rev()
        .map(|(_, p)| p)
        .collect();
    if let Ok(name) = std::fs::read_to_string(root.join("latest")) {
        let named = root.join(name.trim());
        if let Some(i) = steps.iter().position(|p| *p == named) {
            let latest = steps.remove(i);
            steps.insert(0, latest);
        }
    }
    steps
}
