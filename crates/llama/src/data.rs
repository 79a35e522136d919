//! The text data pipeline: reading a corpus, packing its tokens into fixed windows, and serving
//! them as a resumable, shuffled stream of batches (and per-rank slices of them).

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use crate::error::{LlamaError, Result};
use crate::tokenizer::TextTokenizer;

/// The Shakespeare corpus (see `data/README.md` for its origin and attribution), compiled in so
/// that the default run needs no files.
static EMBEDDED_CORPUS: &[u8] = include_bytes!("../../../data/shakespeare.txt.gz");

/// Where the training text comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DataSource {
    /// The Shakespeare corpus compiled into the binary, as one document (its plays are
    /// concatenated without a reliable separator, so no attempt is made to split them).
    Embedded,
    /// A plain text file (one document), a `.gz` text file, a `.jsonl` (or `.jsonl.gz`) file
    /// with one document per line, or a directory of such files, read recursively in path
    /// order with hidden entries (names starting with `.`) skipped.
    Path(PathBuf),
}

impl DataSource {
    /// The source a command-line value names: `embedded` or `shakespeare` for the built-in
    /// corpus, anything else a path.
    pub fn from_arg(arg: &str) -> Self {
        match arg {
            "embedded" | "shakespeare" => DataSource::Embedded,
            path => DataSource::Path(PathBuf::from(path)),
        }
    }
}

impl std::fmt::Display for DataSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DataSource::Embedded => write!(f, "embedded Shakespeare corpus"),
            DataSource::Path(p) => write!(f, "{}", p.display()),
        }
    }
}

/// Reads the documents of `source`; `text_field` names the string field of JSONL records.
///
/// Empty (all-whitespace) documents are dropped; a source without any text is an error, as is
/// a JSONL line that is not an object with a string `text_field` (the message gives the path
/// and line number).
pub fn load_texts(source: &DataSource, text_field: &str) -> Result<Vec<String>> {
    let (docs, origin) = match source {
        DataSource::Embedded => {
            let text = gunzip(EMBEDDED_CORPUS, Path::new("<embedded shakespeare.txt.gz>"))?;
            (vec![text], PathBuf::from("<embedded>"))
        }
        DataSource::Path(path) => {
            let meta = std::fs::metadata(path).map_err(|e| LlamaError::io(path, e))?;
            let mut docs = Vec::new();
            if meta.is_dir() {
                let mut files = Vec::new();
                collect_files(path, &mut files)?;
                for f in files {
                    read_file_docs(&f, text_field, &mut docs)?;
                }
            } else {
                read_file_docs(path, text_field, &mut docs)?;
            }
            (docs, path.clone())
        }
    };
    let docs: Vec<String> = docs.into_iter().filter(|d| !d.trim().is_empty()).collect();
    if docs.is_empty() {
        return Err(LlamaError::Data(format!(
            "{} contains no text",
            origin.display()
        )));
    }
    Ok(docs)
}

fn collect_files(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    let mut entries = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| LlamaError::io(dir, e))? {
        let entry = entry.map_err(|e| LlamaError::io(dir, e))?;
        if entry.file_name().to_string_lossy().starts_with('.') {
            continue;
        }
        entries.push(entry.path());
    }
    entries.sort();
    for p in entries {
        // `metadata` follows symlinks, so linked files and directories are read like real ones.
        let meta = std::fs::metadata(&p).map_err(|e| LlamaError::io(&p, e))?;
        if meta.is_dir() {
            collect_files(&p, out)?;
        } else {
            out.push(p);
        }
    }
    Ok(())
}

fn read_file_docs(path: &Path, text_field: &str, docs: &mut Vec<String>) -> Result<()> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().to_lowercase())
        .unwrap_or_default();
    let bytes = std::fs::read(path).map_err(|e| LlamaError::io(path, e))?;
    let (text, inner_name) = match name.strip_suffix(".gz") {
        Some(inner) => (gunzip(&bytes, path)?, inner.to_string()),
        None => (
            String::from_utf8(bytes).map_err(|e| {
                LlamaError::Data(format!("{} is not UTF-8 text: {e}", path.display()))
            })?,
            name,
        ),
    };
    if inner_name.ends_with(".jsonl") {
        parse_jsonl(&text, text_field, path, docs)
    } else {
        docs.push(text);
        Ok(())
    }
}

fn parse_jsonl(text: &str, field: &str, path: &Path, docs: &mut Vec<String>) -> Result<()> {
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = || format!("{}:{}", path.display(), i + 1);
        let value: serde_json::Value = serde_json::from_str(line)
            .map_err(|e| LlamaError::Data(format!("{}: invalid JSON: {e}", at())))?;
        match value.get(field) {
            Some(serde_json::Value::String(s)) => docs.push(s.clone()),
            Some(other) => {
                return Err(LlamaError::Data(format!(
                    "{}: field \"{field}\" is not a string but {}",
                    at(),
                    json_kind(other)
                )));
            }
            None => {
                return Err(LlamaError::Data(format!(
                    "{}: no \"{field}\" field (choose the field with --text-field)",
                    at()
                )));
            }
        }
    }
    Ok(())
}

fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

fn gunzip(bytes: &[u8], path: &Path) -> Result<String> {
    let mut text = String::new();
    // `MultiGzDecoder` because concatenated gzip members are valid gzip (`cat a.gz b.gz`).
    flate2::read::MultiGzDecoder::new(bytes)
        .read_to_string(&mut text)
        .map_err(|e| {
            LlamaError::Data(format!(
                "{}: cannot decompress as gzip UTF-8 text: {e}",
                path.display()
            ))
        })?;
    Ok(text)
}

/// Where a rank is in the training stream: the `index`-th window of the shuffled order of
/// `epoch`. Saved in checkpoints so that a resumed run reads exactly the batches it would
/// have read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct DataPosition {
    /// Completed passes over the training windows.
    pub epoch: u64,
    /// Windows of the current epoch already consumed.
    pub index: u64,
}

/// A batch of token windows, row-major `[batch, seq_len]`; `targets` are `inputs` shifted by
/// one token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    /// Input token ids.
    pub inputs: Vec<i64>,
    /// The token following each input token.
    pub targets: Vec<i64>,
    /// Rows.
    pub batch: usize,
    /// Tokens per row.
    pub seq_len: usize,
}

/// Token windows for next-token prediction, split into train and validation.
///
/// Documents are concatenated with `</s>` after each one (so it also separates consecutive
/// documents), then cut into non-overlapping windows of `seq_len + 1` tokens: inputs are the
/// first `seq_len`, targets the last `seq_len`. The tail that does not fill a window is
/// dropped. The last `val_fraction` of the windows (rounded up, at least one when the fraction
/// is positive) is the validation split, so train and validation share no token.
///
/// Train windows are served in a fresh shuffled order each epoch. The permutation is a
/// Fisher-Yates shuffle driven by a SplitMix64 stream seeded with
/// `seed ^ (epoch * 0x9E37_79B9_7F4A_7C15)`; it is written out here rather than taken from
/// `rand` so that the order, and therefore resuming from a [`DataPosition`], cannot change
/// with a dependency upgrade.
#[derive(Debug)]
pub struct TokenDataset {
    tokens: Vec<u32>,
    seq_len: usize,
    train_windows: usize,
    val_windows: usize,
    seed: u64,
    /// The permutation of the most recently used epoch, since consecutive batches almost always
    /// share an epoch.
    order_cache: Mutex<Option<(u64, Arc<Vec<u32>>)>>,
}

impl TokenDataset {
    /// Packs tokenized documents as described on the type; `eos_id` is appended to each.
    ///
    /// Fails if there are not enough tokens for one train window (and one validation window
    /// when `val_fraction > 0`).
    pub fn from_documents(
        docs: &[Vec<u32>],
        eos_id: u32,
        seq_len: usize,
        val_fraction: f64,
        seed: u64,
    ) -> Result<Self> {
        let total: usize = docs.iter().map(|d| d.len() + 1).sum();
        let mut tokens = Vec::with_capacity(total);
        for d in docs {
            tokens.extend_from_slice(d);
            tokens.push(eos_id);
        }
        Self::from_tokens(tokens, seq_len, val_fraction, seed)
    }

    /// Reads nothing itself: tokenizes `texts` (in parallel) with `tokenizer` and packs them
    /// with [`TokenDataset::from_documents`].
    pub fn from_texts<S: AsRef<str>>(
        texts: &[S],
        tokenizer: &TextTokenizer,
        seq_len: usize,
        val_fraction: f64,
        seed: u64,
    ) -> Result<Self> {
        let docs = tokenizer.encode_batch(texts)?;
        Self::from_documents(&docs, tokenizer.eos_id(), seq_len, val_fraction, seed)
    }

    /// Packs an already concatenated token stream (no separators are added).
    pub fn from_tokens(
        tokens: Vec<u32>,
        seq_len: usize,
        val_fraction: f64,
        seed: u64,
    ) -> Result<Self> {
        if seq_len == 0 {
            return Err(LlamaError::Data("seq_len must be positive".into()));
        }
        if !(0.0..1.0).contains(&val_fraction) {
            return Err(LlamaError::Data(format!(
                "val_fraction must be in [0, 1), got {val_fraction}"
            )));
        }
        let windows = tokens.len() / (seq_len + 1);
        let val_windows = if val_fraction > 0.0 {
            // The small slack keeps products like 100 * 0.1 from rounding up to 11.
            ((windows as f64 * val_fraction - 1e-9).ceil() as usize).max(1)
        } else {
            0
        };
        if windows < val_windows + 1 {
            return Err(LlamaError::Data(format!(
                "{} tokens make {windows} windows of seq_len + 1 = {} tokens, but at least {} \
                 are needed (1 train{}); use more text or a shorter sequence",
                tokens.len(),
                seq_len + 1,
                val_windows + 1,
                if val_windows > 0 {
                    format!(", {val_windows} validation")
                } else {
                    String::new()
                }
            )));
        }
        if windows - val_windows > u32::MAX as usize {
            return Err(LlamaError::Data(format!(
                "{windows} windows is more than supported"
            )));
        }
        Ok(TokenDataset {
            tokens,
            seq_len,
            train_windows: windows - val_windows,
            val_windows,
            seed,
            order_cache: Mutex::new(None),
        })
    }

    /// Tokens per row of a batch.
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    /// Windows in the training split (the epoch length in rows).
    pub fn train_windows(&self) -> usize {
        self.train_windows
    }

    /// Windows in the validation split.
    pub fn val_windows(&self) -> usize {
        self.val_windows
    }

    /// The whole packed token stream, including the unused tail.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// The training batch at `pos` (`batch` rows), advancing `pos`.
    ///
    /// A batch may straddle two epochs: once the epoch's windows are used up the position moves
    /// to the next epoch (and its new order) within the batch, so every batch is full.
    pub fn next_batch(&self, pos: &mut DataPosition, batch: usize) -> Batch {
        let ids = self.advance(pos, batch);
        self.gather(ids.iter().map(|&w| self.train_start(w)))
    }

    /// Rows `[rank * global_batch / world, (rank + 1) * global_batch / world)` of the batch
    /// `next_batch(pos, global_batch)` would return, advancing `pos` the same way on every rank
    /// (only the rank's own rows are materialised).
    pub fn next_batch_for_rank(
        &self,
        pos: &mut DataPosition,
        global_batch: usize,
        rank: usize,
        world: usize,
    ) -> Result<Batch> {
        let (lo, hi) = rank_rows(global_batch, rank, world)?;
        let ids = self.advance(pos, global_batch);
        Ok(self.gather(ids[lo..hi].iter().map(|&w| self.train_start(w))))
    }

    /// All validation windows in order, `batch` rows at a time. The last partial batch is
    /// dropped (so every batch has the same shape); with fewer validation windows than `batch`
    /// there are no batches at all.
    pub fn val_batches(&self, batch: usize) -> impl Iterator<Item = Batch> + '_ {
        let n = self.val_batch_count(batch);
        (0..n).map(move |b| self.gather((b * batch..(b + 1) * batch).map(|w| self.val_start(w))))
    }

    /// This rank's rows of each batch of [`TokenDataset::val_batches`]`(global_batch)`.
    pub fn val_batches_for_rank(
        &self,
        global_batch: usize,
        rank: usize,
        world: usize,
    ) -> Result<impl Iterator<Item = Batch> + '_> {
        let (lo, hi) = rank_rows(global_batch, rank, world)?;
        let n = self.val_batch_count(global_batch);
        Ok((0..n).map(move |b| {
            let base = b * global_batch;
            self.gather((base + lo..base + hi).map(|w| self.val_start(w)))
        }))
    }

    /// How many batches [`TokenDataset::val_batches`]`(batch)` yields.
    pub fn val_batch_count(&self, batch: usize) -> usize {
        self.val_windows.checked_div(batch).unwrap_or(0)
    }

    /// Entropy in nats per token of the unigram distribution of the train windows' target
    /// tokens: the loss of a model that ignores context, so a trained model must go below it.
    pub fn unigram_entropy(&self) -> f64 {
        let mut counts: HashMap<u32, u64> = HashMap::new();
        for w in 0..self.train_windows {
            let s = self.train_start(w);
            for &t in &self.tokens[s + 1..s + 1 + self.seq_len] {
                *counts.entry(t).or_default() += 1;
            }
        }
        let n: u64 = counts.values().sum();
        if n == 0 {
            return 0.0;
        }
        let n = n as f64;
        counts
            .values()
            .map(|&c| {
                let p = c as f64 / n;
                -p * p.ln()
            })
            .sum()
    }

    /// The shuffled order of train windows in `epoch`.
    pub fn epoch_order(&self, epoch: u64) -> Arc<Vec<u32>> {
        let mut cache = self.order_cache.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((e, order)) = cache.as_ref()
            && *e == epoch
        {
            return order.clone();
        }
        let order = Arc::new(shuffled(self.train_windows, self.seed, epoch));
        *cache = Some((epoch, order.clone()));
        order
    }

    /// The next `n` train window indices from `pos`, advancing it.
    fn advance(&self, pos: &mut DataPosition, n: usize) -> Vec<usize> {
        let mut out = Vec::with_capacity(n);
        let mut order = self.epoch_order(pos.epoch);
        while out.len() < n {
            if pos.index >= self.train_windows as u64 {
                pos.epoch += 1;
                pos.index = 0;
                order = self.epoch_order(pos.epoch);
            }
            out.push(order[pos.index as usize] as usize);
            pos.index += 1;
        }
        out
    }

    fn train_start(&self, window: usize) -> usize {
        window * (self.seq_len + 1)
    }

    fn val_start(&self, window: usize) -> usize {
        (self.train_windows + window) * (self.seq_len + 1)
    }

    fn gather(&self, starts: impl Iterator<Item = usize>) -> Batch {
        let mut inputs = Vec::new();
        let mut targets = Vec::new();
        let mut rows = 0;
        for s in starts {
            let w = &self.tokens[s..s + self.seq_len + 1];
            inputs.extend(w[..self.seq_len].iter().map(|&t| t as i64));
            targets.extend(w[1..].iter().map(|&t| t as i64));
            rows += 1;
        }
        Batch {
            inputs,
            targets,
            batch: rows,
            seq_len: self.seq_len,
        }
    }
}

fn rank_rows(global_batch: usize, rank: usize, world: usize) -> Result<(usize, usize)> {
    if world == 0 || rank >= world {
        return Err(LlamaError::Data(format!(
            "rank {rank} is outside a world of size {world}"
        )));
    }
    if !global_batch.is_multiple_of(world) {
        return Err(LlamaError::Data(format!(
            "global batch {global_batch} is not divisible by the data-parallel world size \
             {world}"
        )));
    }
    let per = global_batch / world;
    Ok((rank * per, (rank + 1) * per))
}

/// SplitMix64: a tiny, well-mixed generator whose output is fixed by its definition.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..bound` by rejection, so that no index is favoured.
    fn below(&mut self, bound: u64) -> u64 {
        let zone = u64::MAX - u64::MAX % bound;
        loop {
            let x = self.next();
            if x < zone {
                return x % bound;
            }
        }
    }
}

fn shuffled(n: usize, seed: u64, epoch: u64) -> Vec<u32> {
    let mut rng = SplitMix64(seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let mut v: Vec<u32> = (0..n as u32).collect();
    for i in (1..n).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        v.swap(i, j);
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// Distinct tokens 10.. so that every window is recognisable.
    fn counting(len: u32, seq_len: usize, val: f64) -> TokenDataset {
        TokenDataset::from_tokens((10..10 + len).collect(), seq_len, val, 7).unwrap()
    }

    #[test]
    fn packing_shift_and_eos() {
        let docs = vec![vec![10, 11, 12], vec![20, 21], vec![30, 31, 32, 33]];
        let ds = TokenDataset::from_documents(&docs, 2, 3, 0.0, 0).unwrap();
        assert_eq!(ds.tokens(), &[10, 11, 12, 2, 20, 21, 2, 30, 31, 32, 33, 2]);
        assert_eq!((ds.train_windows(), ds.val_windows()), (3, 0));
        let mut pos = DataPosition::default();
        let b = ds.next_batch(&mut pos, 3);
        assert_eq!((b.batch, b.seq_len, b.inputs.len()), (3, 3, 9));
        let mut rows: Vec<(Vec<i64>, Vec<i64>)> = (0..3)
            .map(|r| {
                (
                    b.inputs[r * 3..r * 3 + 3].to_vec(),
                    b.targets[r * 3..r * 3 + 3].to_vec(),
                )
            })
            .collect();
        rows.sort();
        assert_eq!(
            rows,
            vec![
                (vec![10, 11, 12], vec![11, 12, 2]),
                (vec![20, 21, 2], vec![21, 2, 30]),
                (vec![31, 32, 33], vec![32, 33, 2]),
            ]
        );
        assert_eq!(pos, DataPosition { epoch: 0, index: 3 });
    }

    #[test]
    fn split_is_disjoint_and_val_is_ordered() {
        let ds = counting(1000, 9, 0.1);
        assert_eq!((ds.train_windows(), ds.val_windows()), (90, 10));
        let mut pos = DataPosition::default();
        let train = ds.next_batch(&mut pos, 90);
        let val: Vec<Batch> = ds.val_batches(4).collect();
        assert_eq!(
            val.len(),
            2,
            "10 windows in batches of 4: the partial batch is dropped"
        );
        let max_train = train.targets.iter().max().unwrap();
        let min_val = val.iter().flat_map(|b| &b.inputs).min().unwrap();
        assert!(max_train < min_val, "{max_train} vs {min_val}");
        assert_eq!(val[0].inputs[..3], [910, 911, 912]);
        assert_eq!(val[1].inputs[0], 910 + 40);
        // One epoch visits every train window exactly once.
        let mut firsts: Vec<i64> = train.inputs.chunks(9).map(|r| r[0]).collect();
        firsts.sort();
        assert_eq!(firsts, (0..90).map(|w| 10 + w * 10).collect::<Vec<i64>>());
        assert!(ds.unigram_entropy() > 6.0); // 810 distinct targets: ln 810 = 6.70
    }

    #[test]
    fn shuffle_is_deterministic_and_resume_is_exact() {
        let ds = counting(2000, 7, 0.05);
        let other = counting(2000, 7, 0.05);
        let mut a = DataPosition::default();
        let mut b = DataPosition::default();
        let one_go: Vec<Batch> = (0..40).map(|_| ds.next_batch(&mut a, 12)).collect();
        let mut resumed: Vec<Batch> = (0..13).map(|_| other.next_batch(&mut b, 12)).collect();
        let saved = serde_json::to_string(&b).unwrap();
        let mut b: DataPosition = serde_json::from_str(&saved).unwrap();
        let fresh = counting(2000, 7, 0.05);
        resumed.extend((13..40).map(|_| fresh.next_batch(&mut b, 12)));
        assert_eq!(one_go, resumed);
        assert_eq!(a, b);
        assert!(a.epoch >= 2, "40 * 12 rows should span epochs: {a:?}");
        // Epochs are shuffled differently, and not in storage order.
        assert_ne!(*ds.epoch_order(0), *ds.epoch_order(1));
        assert_ne!(
            *ds.epoch_order(0),
            (0..ds.train_windows() as u32).collect::<Vec<_>>()
        );
        let reseeded = TokenDataset::from_tokens((10..2010).collect(), 7, 0.05, 8).unwrap();
        assert_ne!(*ds.epoch_order(0), *reseeded.epoch_order(0));
    }

    #[test]
    fn rank_slices_concatenate_to_global_batch() {
        let ds = counting(3000, 5, 0.1);
        let world = 4;
        let mut global_pos = DataPosition {
            epoch: 3,
            index: 440,
        };
        let mut rank_pos = vec![global_pos; world];
        for _ in 0..5 {
            let global = ds.next_batch(&mut global_pos, 8);
            let mut inputs = Vec::new();
            let mut targets = Vec::new();
            for (rank, pos) in rank_pos.iter_mut().enumerate() {
                let b = ds.next_batch_for_rank(pos, 8, rank, world).unwrap();
                assert_eq!(b.batch, 2);
                inputs.extend(b.inputs);
                targets.extend(b.targets);
                assert_eq!(*pos, global_pos);
            }
            assert_eq!((inputs, targets), (global.inputs, global.targets));
        }
        let err = ds
            .next_batch_for_rank(&mut global_pos, 6, 0, 4)
            .unwrap_err()
            .to_string();
        assert!(err.contains('6') && err.contains('4'), "{err}");
        let val: Vec<i64> = ds.val_batches(4).flat_map(|b| b.inputs).collect();
        let sliced: Vec<i64> = ds
            .val_batches_for_rank(4, 1, 2)
            .unwrap()
            .flat_map(|b| b.inputs)
            .collect();
        assert_eq!(sliced[..10], val[10..20]);
    }

    #[test]
    fn too_little_data_is_an_error() {
        let err = TokenDataset::from_tokens(vec![1; 10], 9, 0.1, 0)
            .unwrap_err()
            .to_string();
        assert!(err.contains("10 tokens"), "{err}");
        assert!(TokenDataset::from_tokens(vec![1; 10], 4, 1.5, 0).is_err());
    }

    #[test]
    fn sources_jsonl_directory_gzip_and_errors() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        std::fs::create_dir_all(root.join("b/sub")).unwrap();
        std::fs::create_dir_all(root.join(".git")).unwrap();
        std::fs::write(root.join(".git/HEAD"), "hidden").unwrap();
        std::fs::write(root.join(".hidden.txt"), "hidden").unwrap();
        std::fs::write(root.join("a.txt"), "first").unwrap();
        std::fs::write(
            root.join("b/sub/c.jsonl"),
            "{\"text\": \"third\"}\n\n{\"text\": \"x\"}\n",
        )
        .unwrap();
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(b"second").unwrap();
        std::fs::write(root.join("b/a.txt.gz"), gz.finish().unwrap()).unwrap();
        std::fs::write(root.join("b/empty.txt"), "  \n").unwrap();

        let docs = load_texts(&DataSource::Path(root.to_path_buf()), "text").unwrap();
        assert_eq!(docs, ["first", "second", "third", "x"]);

        let bad = root.join("b/sub/c.jsonl");
        std::fs::write(&bad, "{\"text\": \"ok\"}\n{\"body\": \"no\"}\n").unwrap();
        let err = load_texts(&DataSource::Path(bad.clone()), "text")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("c.jsonl:2") && err.contains("\"text\""),
            "{err}"
        );
        let docs = load_texts(&DataSource::Path(bad.clone()), "body");
        assert!(docs.unwrap_err().to_string().contains("c.jsonl:1"));
        std::fs::write(&bad, "{\"text\": 3}\nnot json\n").unwrap();
        let err = load_texts(&DataSource::Path(bad.clone()), "text")
            .unwrap_err()
            .to_string();
        assert!(err.contains("c.jsonl:1") && err.contains("number"), "{err}");

        let missing = root.join("nope.txt");
        let err = load_texts(&DataSource::Path(missing), "text").unwrap_err();
        assert!(matches!(err, LlamaError::Io { .. }) && err.to_string().contains("nope.txt"));
        let empty = root.join("b/empty.txt");
        let err = load_texts(&DataSource::Path(empty), "text")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("empty.txt") && err.contains("no text"),
            "{err}"
        );
    }

    #[test]
    fn embedded_corpus_tokenizes_quickly() {
        assert_eq!(DataSource::from_arg("shakespeare"), DataSource::Embedded);
        let docs = load_texts(&DataSource::from_arg("embedded"), "text").unwrap();
        assert_eq!(docs.len(), 1);
        assert!(docs[0].len() > 5_000_000 && docs[0].starts_with("ALL'S WELL"));
        let tok = TextTokenizer::train_byte_level_bpe([&docs[0][..300_000]], 512).unwrap();
        let t = std::time::Instant::now();
        let ds = TokenDataset::from_texts(&docs, &tok, 128, 0.05, 1).unwrap();
        let secs = t.elapsed().as_secs_f64();
        assert!(secs < 30.0, "tokenizing the corpus took {secs:.1}s");
        assert!(ds.train_windows() > 10_000, "{}", ds.train_windows());
        let h = ds.unigram_entropy();
        assert!(h > 3.0 && h < (512f64).ln(), "{h}");
    }
}
