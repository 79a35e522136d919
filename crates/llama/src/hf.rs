//! Hugging Face checkpoint directories (`config.json` + safetensors) at the level of named host
//! tensors, with HF's tensor names (`model.layers.0.self_attn.q_proj.weight`, ...).
//!
//! What is written is what `transformers` writes for `LlamaForCausalLM`, so an export loads
//! with `AutoModelForCausalLM.from_pretrained(dir)`; what is read is any Llama checkpoint in
//! BF16, F16, F32 or F64, single-file or sharded.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use safetensors::tensor::Dtype;
use serde::Deserialize;
use serde_json::json;

use crate::config::LlamaConfig;
use crate::error::{LlamaError, Result};

/// Name of the single-file checkpoint.
pub const SINGLE_FILE: &str = "model.safetensors";
/// Name of the shard index of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// A tensor in host memory, row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    /// Dimensions, outermost first (PyTorch's order: `[out_features, in_features]` for linears).
    pub shape: Vec<usize>,
    /// `shape.iter().product()` values.
    pub data: Vec<f32>,
}

impl HostTensor {
    /// A tensor after checking that `data` has as many values as `shape` describes.
    pub fn new(shape: Vec<usize>, data: Vec<f32>) -> Result<Self> {
        let numel: usize = shape.iter().product();
        if numel != data.len() {
            return Err(LlamaError::Config(format!(
                "tensor of shape {shape:?} needs {numel} values, got {}",
                data.len()
            )));
        }
        Ok(HostTensor { shape, data })
    }

    /// Number of values.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Named tensors; sorted by name so that iteration (and hence file layout) is deterministic.
pub type TensorMap = BTreeMap<String, HostTensor>;

/// The floating-point format tensors are stored in by [`save_hf_dir`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SaveDType {
    /// bfloat16, the format Llama 2 weights are published in (half the size of F32).
    #[default]
    BF16,
    /// IEEE half precision; values beyond ±65504 become infinite.
    F16,
    /// Full precision: a lossless export of f32 weights.
    F32,
}

impl SaveDType {
    /// Bytes per stored value.
    pub fn size_bytes(self) -> usize {
        match self {
            SaveDType::BF16 | SaveDType::F16 => 2,
            SaveDType::F32 => 4,
        }
    }

    /// The `torch_dtype` string of `config.json`.
    pub fn torch_name(self) -> &'static str {
        match self {
            SaveDType::BF16 => "bfloat16",
            SaveDType::F16 => "float16",
            SaveDType::F32 => "float32",
        }
    }

    fn encode(self, values: &[f32]) -> Vec<u8> {
        match self {
            SaveDType::BF16 => values
                .iter()
                .flat_map(|&v| half::bf16::from_f32(v).to_bits().to_le_bytes())
                .collect(),
            SaveDType::F16 => values
                .iter()
                .flat_map(|&v| half::f16::from_f32(v).to_bits().to_le_bytes())
                .collect(),
            SaveDType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        }
    }
}

impl std::str::FromStr for SaveDType {
    type Err = LlamaError;

    /// Accepts `bf16`/`bfloat16`, `f16`/`fp16`/`float16`, `f32`/`fp32`/`float32`.
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "bf16" | "bfloat16" => Ok(SaveDType::BF16),
            "f16" | "fp16" | "float16" => Ok(SaveDType::F16),
            "f32" | "fp32" | "float32" => Ok(SaveDType::F32),
            other => Err(LlamaError::Config(format!(
                "unknown save dtype '{other}'; use bf16, f16 or f32"
            ))),
        }
    }
}

impl std::fmt::Display for SaveDType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            SaveDType::BF16 => "bf16",
            SaveDType::F16 => "f16",
            SaveDType::F32 => "f32",
        })
    }
}

/// The fields of a Hugging Face Llama `config.json` that shape the model, with
/// `transformers`' defaults for those that may be absent.
#[derive(Deserialize)]
struct HfLlamaConfig {
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    max_position_embeddings: Option<usize>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    tie_word_embeddings: Option<bool>,
}

/// Reads `dir/config.json` of a Llama checkpoint.
///
/// Extra fields are ignored. Absent fields take `transformers`' defaults:
/// `num_key_value_heads = num_attention_heads`, `rope_theta = 10000`,
/// `tie_word_embeddings = false`, `max_position_embeddings = 2048`, `rms_norm_eps = 1e-6`.
/// Features this model does not implement (another `model_type`, `rope_scaling`, biases, an
/// activation other than SiLU, a `head_dim` other than `hidden_size / num_attention_heads`)
/// are rejected rather than silently ignored.
pub fn read_hf_config(dir: impl AsRef<Path>) -> Result<LlamaConfig> {
    let path = dir.as_ref().join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| LlamaError::io(&path, e))?;
    let value: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| LlamaError::checkpoint(&path, format!("invalid JSON: {e}")))?;
    let unsupported = |m: String| Err(LlamaError::checkpoint(&path, m));
    match value.get("model_type").and_then(|v| v.as_str()) {
        Some("llama") | None => {}
        Some(other) => {
            return unsupported(format!(
                "model_type is \"{other}\"; only \"llama\" checkpoints can be loaded"
            ));
        }
    }
    if let Some(rs) = value.get("rope_scaling").filter(|v| !v.is_null()) {
        return unsupported(format!(
            "rope_scaling {rs} is not supported (plain RoPE only)"
        ));
    }
    for bias in ["attention_bias", "mlp_bias"] {
        if value.get(bias).and_then(|v| v.as_bool()) == Some(true) {
            return unsupported(format!(
                "{bias} = true is not supported (Llama has no biases)"
            ));
        }
    }
    if let Some(act) = value.get("hidden_act").and_then(|v| v.as_str())
        && act != "silu"
    {
        return unsupported(format!("hidden_act \"{act}\" is not supported (SiLU only)"));
    }
    // transformers 5 writes `rope_parameters: {rope_type, rope_theta}` instead of `rope_theta`.
    let mut rope_theta_v5 = None;
    if let Some(rp) = value.get("rope_parameters").filter(|v| !v.is_null()) {
        match rp.get("rope_type").and_then(|v| v.as_str()) {
            Some("default") | None => {}
            Some(other) => {
                return unsupported(format!(
                    "rope_parameters.rope_type \"{other}\" is not supported (plain RoPE only)"
                ));
            }
        }
        rope_theta_v5 = rp.get("rope_theta").and_then(|v| v.as_f64());
    }
    let hf: HfLlamaConfig = serde_json::from_value(value.clone())
        .map_err(|e| LlamaError::checkpoint(&path, format!("not a Llama config: {e}")))?;
    let cfg = LlamaConfig {
        vocab_size: hf.vocab_size,
        hidden_size: hf.hidden_size,
        intermediate_size: hf.intermediate_size,
        num_hidden_layers: hf.num_hidden_layers,
        num_attention_heads: hf.num_attention_heads,
        num_key_value_heads: hf.num_key_value_heads.unwrap_or(hf.num_attention_heads),
        max_position_embeddings: hf.max_position_embeddings.unwrap_or(2048),
        rms_norm_eps: hf.rms_norm_eps.unwrap_or(1e-6),
        rope_theta: hf.rope_theta.or(rope_theta_v5).unwrap_or(10000.0),
        tie_word_embeddings: hf.tie_word_embeddings.unwrap_or(false),
    };
    cfg.validate()
        .map_err(|e| LlamaError::checkpoint(&path, e.to_string()))?;
    if let Some(hd) = value.get("head_dim").and_then(|v| v.as_u64())
        && hd as usize != cfg.head_dim()
    {
        return unsupported(format!(
            "head_dim {hd} differs from hidden_size / num_attention_heads = {}",
            cfg.head_dim()
        ));
    }
    Ok(cfg)
}

/// The `config.json` `transformers` writes for a `LlamaForCausalLM` of shape `cfg` stored in
/// `dtype`. Special-token ids are those of [`crate::tokenizer::TextTokenizer`].
pub fn hf_config_json(cfg: &LlamaConfig, dtype: SaveDType) -> serde_json::Value {
    json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "torch_dtype": dtype.torch_name(),
        "bos_token_id": 1,
        "eos_token_id": 2,
        "attention_bias": false,
        "attention_dropout": 0.0,
        "mlp_bias": false,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": true,
        "rope_scaling": null,
        "head_dim": cfg.head_dim(),
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tie_word_embeddings,
    })
}

/// All tensors of a checkpoint directory, converted to f32.
///
/// Reads `model.safetensors.index.json` and its shards when the index exists, else
/// `model.safetensors`. A damaged file, a tensor in another format than BF16/F16/F32/F64, or a
/// tensor the index promises but its shard lacks is an error naming the file (and tensor).
pub fn load_safetensors_dir(dir: impl AsRef<Path>) -> Result<TensorMap> {
    let reader = CheckpointReader::open(dir)?;
    reader
        .tensors
        .iter()
        .map(|(name, t)| {
            let data = reader.read(name, 0..t.shape.iter().product())?;
            let tensor = HostTensor::new(t.shape.clone(), data)
                .map_err(|e| LlamaError::checkpoint(&t.path, format!("tensor {name}: {e}")))?;
            Ok((name.clone(), tensor))
        })
        .collect()
}

/// A checkpoint directory opened for reading slices of its tensors.
///
/// Only the safetensors headers are read when it is opened; values are read from disk on
/// demand, one requested range at a time. Each rank of a sharded model reads just its own
/// chunks, so loading a 70B checkpoint does not need every rank to hold all of it in f32.
#[derive(Debug)]
pub struct CheckpointReader {
    tensors: BTreeMap<String, StoredTensor>,
}

#[derive(Debug)]
struct StoredTensor {
    path: PathBuf,
    dtype: Dtype,
    shape: Vec<usize>,
    /// Absolute byte offset of the first element in the file.
    start: u64,
}

fn dtype_size(d: Dtype) -> Option<usize> {
    match d {
        Dtype::BF16 | Dtype::F16 => Some(2),
        Dtype::F32 => Some(4),
        Dtype::F64 => Some(8),
        _ => None,
    }
}

impl CheckpointReader {
    /// Reads the headers of `model.safetensors`, or of the shards a `model.safetensors.index.json`
    /// lists. A truncated file, a header that does not parse, a tensor in a format other than
    /// BF16/F16/F32/F64, or a tensor the index promises but its shard lacks is an error naming
    /// the file and the tensor.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let index_path = dir.join(INDEX_FILE);
        let single = dir.join(SINGLE_FILE);
        let mut tensors = BTreeMap::new();
        if index_path.exists() {
            for (file, names) in read_index(&index_path)? {
                let path = dir.join(&file);
                let mut header = read_header(&path)?;
                for name in names {
                    let t = header.remove(&name).ok_or_else(|| {
                        LlamaError::checkpoint(
                            &path,
                            format!("tensor {name} is listed for this shard in {INDEX_FILE} but the shard does not contain it"),
                        )
                    })?;
                    tensors.insert(name, t);
                }
            }
        } else if single.exists() {
            tensors = read_header(&single)?;
        } else {
            return Err(LlamaError::checkpoint(
                dir,
                format!("no {SINGLE_FILE} or {INDEX_FILE} in this directory"),
            ));
        }
        Ok(Self { tensors })
    }

    /// Every tensor's name and shape.
    pub fn shapes(&self) -> BTreeMap<String, Vec<usize>> {
        self.tensors
            .iter()
            .map(|(n, t)| (n.clone(), t.shape.clone()))
            .collect()
    }

    /// Elements `range` (flat, row-major) of tensor `name`, converted to f32.
    pub fn read(&self, name: &str, range: std::ops::Range<usize>) -> Result<Vec<f32>> {
        use std::io::{Read, Seek, SeekFrom};
        let t = self
            .tensors
            .get(name)
            .ok_or_else(|| LlamaError::Config(format!("the checkpoint has no tensor {name}")))?;
        let numel: usize = t.shape.iter().product();
        if range.end > numel || range.start > range.end {
            return Err(LlamaError::checkpoint(
                &t.path,
                format!("elements {range:?} of tensor {name} requested, it has {numel}"),
            ));
        }
        let size = dtype_size(t.dtype).expect("checked when opened");
        let mut bytes = vec![0u8; range.len() * size];
        let mut f = std::fs::File::open(&t.path).map_err(|e| LlamaError::io(&t.path, e))?;
        f.seek(SeekFrom::Start(t.start + (range.start * size) as u64))
            .and_then(|_| f.read_exact(&mut bytes))
            .map_err(|e| LlamaError::io(&t.path, e))?;
        Ok(decode(&bytes, t.dtype))
    }
}

/// Values of a little-endian buffer of `dtype` (one of the four float formats) as f32.
fn decode(bytes: &[u8], dtype: Dtype) -> Vec<f32> {
    match dtype {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
        Dtype::F64 => bytes
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().expect("chunk of 8")) as f32)
            .collect(),
        _ => unreachable!("dtype checked when the header was read"),
    }
}

/// The tensors a safetensors file's header describes, checked against the file's size.
fn read_header(path: &Path) -> Result<BTreeMap<String, StoredTensor>> {
    use std::io::Read;
    #[derive(Deserialize)]
    struct Entry {
        dtype: Dtype,
        shape: Vec<usize>,
        data_offsets: (usize, usize),
    }
    let bad = |msg: String| {
        LlamaError::checkpoint(
            path,
            format!("not a valid safetensors file (truncated?): {msg}"),
        )
    };
    let mut f = std::fs::File::open(path).map_err(|e| LlamaError::io(path, e))?;
    let file_len = f.metadata().map_err(|e| LlamaError::io(path, e))?.len();
    let mut n = [0u8; 8];
    f.read_exact(&mut n).map_err(|_| {
        bad(format!(
            "{file_len} bytes, shorter than the header length field"
        ))
    })?;
    let n = u64::from_le_bytes(n);
    if n > 100_000_000 || 8 + n > file_len {
        return Err(bad(format!("header of {n} bytes in a file of {file_len}")));
    }
    let mut header = vec![0u8; n as usize];
    f.read_exact(&mut header)
        .map_err(|e| LlamaError::io(path, e))?;
    let raw: BTreeMap<String, serde_json::Value> =
        serde_json::from_slice(&header).map_err(|e| bad(format!("header: {e}")))?;
    let data_start = 8 + n;
    let mut out = BTreeMap::new();
    for (name, value) in raw {
        if name == "__metadata__" {
            continue;
        }
        let e: Entry =
            serde_json::from_value(value).map_err(|e| bad(format!("tensor {name}: {e}")))?;
        let Some(size) = dtype_size(e.dtype) else {
            return Err(LlamaError::checkpoint(
                path,
                format!(
                    "tensor {name} has dtype {:?}; only BF16, F16, F32 and F64 can be loaded",
                    e.dtype
                ),
            ));
        };
        let numel: usize = e.shape.iter().product();
        let (lo, hi) = e.data_offsets;
        if hi < lo || hi - lo != numel * size {
            return Err(bad(format!(
                "tensor {name}: {} bytes for shape {:?} of {:?}",
                hi.saturating_sub(lo),
                e.shape,
                e.dtype
            )));
        }
        if data_start + hi as u64 > file_len {
            return Err(bad(format!(
                "tensor {name} ends at byte {} but the file has {file_len}",
                data_start + hi as u64
            )));
        }
        out.insert(
            name,
            StoredTensor {
                path: path.to_path_buf(),
                dtype: e.dtype,
                shape: e.shape,
                start: data_start + lo as u64,
            },
        );
    }
    Ok(out)
}

/// Checks a checkpoint's tensor shapes against the model's (see [`check_tensors`]).
pub fn check_shapes(
    expected: &[(String, Vec<usize>)],
    got: &BTreeMap<String, Vec<usize>>,
    path: &Path,
) -> Result<()> {
    let map: TensorMap = got
        .iter()
        .map(|(n, shape)| {
            (
                n.clone(),
                HostTensor {
                    shape: shape.clone(),
                    data: Vec::new(),
                },
            )
        })
        .collect();
    check_tensors(expected, &map, path)
}

/// Shard file name → tensor names, from an index's `weight_map`.
fn read_index(path: &Path) -> Result<BTreeMap<String, Vec<String>>> {
    #[derive(Deserialize)]
    struct Index {
        weight_map: BTreeMap<String, String>,
    }
    let text = std::fs::read_to_string(path).map_err(|e| LlamaError::io(path, e))?;
    let index: Index = serde_json::from_str(&text)
        .map_err(|e| LlamaError::checkpoint(path, format!("invalid shard index: {e}")))?;
    let mut shards: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (name, file) in index.weight_map {
        // The index comes from outside; it must not point out of the checkpoint directory.
        if file.contains('/') || file.contains('\\') || file.starts_with('.') {
            return Err(LlamaError::checkpoint(
                path,
                format!("tensor {name} maps to shard '{file}', which is not a plain file name"),
            ));
        }
        shards.entry(file).or_default().push(name);
    }
    if shards.is_empty() {
        return Err(LlamaError::checkpoint(path, "weight_map is empty"));
    }
    Ok(shards)
}

/// Writes a complete Hugging Face checkpoint directory at `dir`.
///
/// Contents: `config.json` ([`hf_config_json`]), `generation_config.json`, the tensors in
/// `dtype` as `model.safetensors` when they fit in `max_shard_bytes`, else as
/// `model-0000i-of-0000n.safetensors` shards plus `model.safetensors.index.json` (the layout
/// and index `transformers` writes, safetensors metadata `{"format": "pt"}`), and, when a
/// `tokenizer_json` is given, a copy of it with a `tokenizer_config.json` naming the special
/// tokens so that `AutoTokenizer.from_pretrained(dir)` works too.
///
/// Tensors are laid out in natural name order (`layers.2` before `layers.10`) so that a shard
/// holds consecutive layers. The directory is written under a temporary sibling name and
/// renamed into place only when complete, so a crash leaves the previous export intact (the
/// swap itself is two renames, since a non-empty directory cannot be replaced in one). To avoid
/// deleting unrelated data, an existing `dir` holding anything but export files is refused.
pub fn save_hf_dir(
    dir: impl AsRef<Path>,
    cfg: &LlamaConfig,
    tensors: &TensorMap,
    dtype: SaveDType,
    max_shard_bytes: u64,
    tokenizer_json: Option<&Path>,
) -> Result<()> {
    let dir = dir.as_ref();
    for (name, t) in tensors {
        if t.numel() != t.data.len() {
            return Err(LlamaError::checkpoint(
                dir,
                format!(
                    "tensor {name} has shape {:?} but {} values",
                    t.shape,
                    t.data.len()
                ),
            ));
        }
    }
    let mut names: Vec<&String> = tensors.keys().collect();
    names.sort_by_cached_key(|n| natural_key(n));
    let specs = names
        .iter()
        .map(|n| ((*n).clone(), tensors[*n].shape.clone()))
        .collect();
    let mut export = HfExport::create(dir, cfg, specs, dtype, max_shard_bytes)?;
    for n in names {
        export.push(n, &tensors[n].data)?;
    }
    export.finish(tokenizer_json)
}

/// A Hugging Face directory written one tensor at a time, in an order fixed up front, so that
/// no more than one tensor is ever held: how a sharded model is exported unit by unit, and a
/// sharded checkpoint converted, without the whole model in memory. The layout is
/// [`save_hf_dir`]'s (greedy shards of at most `max_shard_bytes` in the given order, the index
/// when there are several); the directory is written beside `dir` and renamed into place by
/// [`Self::finish`]. Dropped unfinished, it removes what it wrote.
pub struct HfExport {
    dir: PathBuf,
    tmp: PathBuf,
    cfg: LlamaConfig,
    dtype: SaveDType,
    specs: Vec<(String, Vec<usize>)>,
    /// For each spec, its shard.
    shard_of: Vec<usize>,
    shard_names: Vec<String>,
    next: usize,
    open: Option<(usize, std::io::BufWriter<std::fs::File>)>,
    weight_map: BTreeMap<String, String>,
    total_size: u64,
    finished: bool,
}

impl HfExport {
    /// Starts an export to `dir` of the tensors `specs` (name, shape), which [`Self::push`]
    /// must then receive in this order.
    ///
    /// # Errors
    /// No tensors; `dir` is a file or holds files other than an export's; the temporary
    /// directory cannot be made.
    pub fn create(
        dir: &Path,
        cfg: &LlamaConfig,
        specs: Vec<(String, Vec<usize>)>,
        dtype: SaveDType,
        max_shard_bytes: u64,
    ) -> Result<Self> {
        if specs.is_empty() {
            return Err(LlamaError::checkpoint(dir, "no tensors to save"));
        }
        if dir.is_file() {
            return Err(LlamaError::checkpoint(
                dir,
                "exists and is a file, not a directory",
            ));
        }
        if dir.is_dir() {
            refuse_foreign_files(dir)?;
        }
        let name = dir
            .file_name()
            .ok_or_else(|| LlamaError::checkpoint(dir, "export path has no directory name"))?
            .to_string_lossy()
            .into_owned();
        let parent = match dir.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        std::fs::create_dir_all(&parent).map_err(|e| LlamaError::io(&parent, e))?;
        let tmp = parent.join(format!(".{name}.tmp-{}", std::process::id()));
        if tmp.exists() {
            std::fs::remove_dir_all(&tmp).map_err(|e| LlamaError::io(&tmp, e))?;
        }
        std::fs::create_dir(&tmp).map_err(|e| LlamaError::io(&tmp, e))?;
        // Greedy packing in order, as transformers does: a tensor larger than the limit gets a
        // shard of its own rather than an error.
        let mut shard_of = Vec::with_capacity(specs.len());
        let (mut shard, mut current) = (0usize, 0u64);
        for (i, (_, shape)) in specs.iter().enumerate() {
            let size = (shape.iter().product::<usize>() * dtype.size_bytes()) as u64;
            if i > 0 && current + size > max_shard_bytes {
                shard += 1;
                current = 0;
            }
            current += size;
            shard_of.push(shard);
        }
        let count = shard + 1;
        let shard_names = (0..count)
            .map(|i| {
                if count == 1 {
                    SINGLE_FILE.to_string()
                } else {
                    format!("model-{:05}-of-{count:05}.safetensors", i + 1)
                }
            })
            .collect();
        Ok(Self {
            dir: dir.to_path_buf(),
            tmp,
            cfg: cfg.clone(),
            dtype,
            specs,
            shard_of,
            shard_names,
            next: 0,
            open: None,
            weight_map: BTreeMap::new(),
            total_size: 0,
            finished: false,
        })
    }

    /// The next tensor's values (f32, converted to the export dtype).
    ///
    /// # Errors
    /// Another tensor than the next one expected, a wrong number of values, a write failure.
    pub fn push(&mut self, name: &str, values: &[f32]) -> Result<()> {
        use std::io::Write;
        let Some((want, shape)) = self.specs.get(self.next) else {
            return Err(LlamaError::checkpoint(
                &self.dir,
                format!("tensor {name} pushed after the last one"),
            ));
        };
        let numel: usize = shape.iter().product();
        if want != name || values.len() != numel {
            return Err(LlamaError::checkpoint(
                &self.dir,
                format!(
                    "expected tensor {want} ({numel} values) next, got {name} ({} values)",
                    values.len()
                ),
            ));
        }
        let shard = self.shard_of[self.next];
        if self.open.as_ref().is_none_or(|(s, _)| *s != shard) {
            self.close_shard()?;
            self.open = Some((shard, self.open_shard(shard)?));
        }
        let path = self.tmp.join(&self.shard_names[shard]);
        let (_, out) = self.open.as_mut().expect("opened above");
        for chunk in values.chunks(1 << 20) {
            out.write_all(&self.dtype.encode(chunk))
                .map_err(|e| LlamaError::io(&path, e))?;
        }
        self.weight_map
            .insert(name.to_string(), self.shard_names[shard].clone());
        self.total_size += (numel * self.dtype.size_bytes()) as u64;
        self.next += 1;
        Ok(())
    }

    /// Creates shard `shard`'s file and writes its safetensors header.
    fn open_shard(&self, shard: usize) -> Result<std::io::BufWriter<std::fs::File>> {
        use std::io::Write;
        let path = self.tmp.join(&self.shard_names[shard]);
        let mut header = serde_json::Map::new();
        header.insert("__metadata__".into(), json!({"format": "pt"}));
        let mut at = 0u64;
        for (i, (name, shape)) in self.specs.iter().enumerate() {
            if self.shard_of[i] != shard {
                continue;
            }
            let end = at + (shape.iter().product::<usize>() * self.dtype.size_bytes()) as u64;
            let dtype = match self.dtype {
                SaveDType::BF16 => "BF16",
                SaveDType::F16 => "F16",
                SaveDType::F32 => "F32",
            };
            header.insert(
                name.clone(),
                json!({"dtype": dtype, "shape": shape, "data_offsets": [at, end]}),
            );
            at = end;
        }
        let mut header = serde_json::to_vec(&header).expect("a JSON map serializes");
        header.resize(header.len().div_ceil(8) * 8, b' ');
        let file = std::fs::File::create(&path).map_err(|e| LlamaError::io(&path, e))?;
        let mut out = std::io::BufWriter::with_capacity(8 << 20, file);
        out.write_all(&(header.len() as u64).to_le_bytes())
            .and_then(|()| out.write_all(&header))
            .map_err(|e| LlamaError::io(&path, e))?;
        Ok(out)
    }

    fn close_shard(&mut self) -> Result<()> {
        if let Some((shard, out)) = self.open.take() {
            let path = self.tmp.join(&self.shard_names[shard]);
            let file = out
                .into_inner()
                .map_err(|e| LlamaError::io(&path, e.into_error()))?;
            file.sync_all().map_err(|e| LlamaError::io(&path, e))?;
        }
        Ok(())
    }

    /// Writes the index, `config.json`, `generation_config.json` and, with `tokenizer_json`,
    /// the tokenizer files, then renames the directory into place (replacing an earlier export,
    /// which stays until the new one is complete).
    ///
    /// # Errors
    /// Tensors not yet pushed; a write or rename failure.
    pub fn finish(mut self, tokenizer_json: Option<&Path>) -> Result<()> {
        if self.next != self.specs.len() {
            return Err(LlamaError::checkpoint(
                &self.dir,
                format!(
                    "finished after {} of {} tensors (next: {})",
                    self.next,
                    self.specs.len(),
                    self.specs[self.next].0
                ),
            ));
        }
        self.close_shard()?;
        let tmp = self.tmp.clone();
        write_json(
            &tmp.join("config.json"),
            &hf_config_json(&self.cfg, self.dtype),
        )?;
        write_json(
            &tmp.join("generation_config.json"),
            &json!({"_from_model_config": true, "bos_token_id": 1, "eos_token_id": 2}),
        )?;
        if self.shard_names.len() > 1 {
            write_json(
                &tmp.join(INDEX_FILE),
                &json!({"metadata": {"total_size": self.total_size}, "weight_map": self.weight_map}),
            )?;
        }
        if let Some(src) = tokenizer_json {
            let dst = tmp.join("tokenizer.json");
            std::fs::copy(src, &dst).map_err(|e| LlamaError::io(src, e))?;
            write_json(
                &tmp.join("tokenizer_config.json"),
                &json!({
                    "tokenizer_class": "PreTrainedTokenizerFast",
                    "bos_token": "<s>",
                    "eos_token": "</s>",
                    "unk_token": "<unk>",
                    "model_max_length": self.cfg.max_position_embeddings,
                    "clean_up_tokenization_spaces": false,
                }),
            )?;
        }
        let dir = self.dir.clone();
        let parent = tmp.parent().unwrap_or(Path::new(".")).to_path_buf();
        let name = dir
            .file_name()
            .expect("checked at create")
            .to_string_lossy();
        if dir.exists() {
            let old = parent.join(format!(".{name}.old-{}", std::process::id()));
            if old.exists() {
                std::fs::remove_dir_all(&old).map_err(|e| LlamaError::io(&old, e))?;
            }
            std::fs::rename(&dir, &old).map_err(|e| LlamaError::io(&dir, e))?;
            if let Err(e) = std::fs::rename(&tmp, &dir) {
                let _ = std::fs::rename(&old, &dir);
                return Err(LlamaError::io(&dir, e));
            }
            std::fs::remove_dir_all(&old).map_err(|e| LlamaError::io(&old, e))?;
        } else {
            std::fs::rename(&tmp, &dir).map_err(|e| LlamaError::io(&dir, e))?;
        }
        self.finished = true;
        Ok(())
    }
}

impl Drop for HfExport {
    fn drop(&mut self) {
        if !self.finished {
            let _ = std::fs::remove_dir_all(&self.tmp);
        }
    }
}

fn is_export_file(name: &str) -> bool {
    matches!(
        name,
        "config.json"
            | "generation_config.json"
            | "tokenizer.json"
            | "tokenizer_config.json"
            | "special_tokens_map.json"
            | SINGLE_FILE
            | INDEX_FILE
    ) || (name.starts_with("model-") && name.ends_with(".safetensors"))
}

fn refuse_foreign_files(dir: &Path) -> Result<()> {
    for entry in std::fs::read_dir(dir).map_err(|e| LlamaError::io(dir, e))? {
        let entry = entry.map_err(|e| LlamaError::io(dir, e))?;
        let fname = entry.file_name().to_string_lossy().into_owned();
        if !is_export_file(&fname) {
            return Err(LlamaError::checkpoint(
                dir,
                format!(
                    "exists and holds '{fname}', which is not part of a Hugging Face export; \
                     refusing to replace it (choose an empty or new directory)"
                ),
            ));
        }
    }
    Ok(())
}

fn write_json(path: &Path, value: &serde_json::Value) -> Result<()> {
    let mut text = serde_json::to_string_pretty(value).expect("JSON values always serialize");
    text.push('\n');
    std::fs::write(path, text).map_err(|e| LlamaError::io(path, e))?;
    sync_file(path)
}

/// Flushes to disk, so that the rename that publishes an export cannot reach the disk before
/// the data it points to.
fn sync_file(path: &Path) -> Result<()> {
    std::fs::File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(|e| LlamaError::io(path, e))
}

/// A sort key comparing digit runs by value.
pub(crate) fn natural_key(name: &str) -> Vec<(u64, String)> {
    let mut key = Vec::new();
    let mut rest = name;
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(rest.len());
        if digits > 0 {
            key.push((rest[..digits].parse().unwrap_or(u64::MAX), String::new()));
            rest = &rest[digits..];
        } else {
            let text = rest
                .find(|c: char| c.is_ascii_digit())
                .unwrap_or(rest.len());
            key.push((0, rest[..text].to_string()));
            rest = &rest[text..];
        }
    }
    key
}

/// Checks that `got` holds exactly the `expected` names and shapes; `path` is the checkpoint
/// they came from, for the message.
///
/// Every problem is listed (up to 20): missing tensors, tensors the model does not have, and
/// shape mismatches with both shapes.
pub fn check_tensors(
    expected: &[(String, Vec<usize>)],
    got: &TensorMap,
    path: &Path,
) -> Result<()> {
    let mut problems = Vec::new();
    let mut known = std::collections::HashSet::new();
    for (name, shape) in expected {
        known.insert(name.as_str());
        match got.get(name) {
            None => problems.push(format!("missing tensor {name} (expected shape {shape:?})")),
            Some(t) if &t.shape != shape => problems.push(format!(
                "tensor {name} has shape {:?}, the model expects {shape:?}",
                t.shape
            )),
            Some(_) => {}
        }
    }
    for (name, t) in got {
        if !known.contains(name.as_str()) {
            problems.push(format!(
                "unexpected tensor {name} (shape {:?}) that the model does not have",
                t.shape
            ));
        }
    }
    if problems.is_empty() {
        return Ok(());
    }
    const SHOWN: usize = 20;
    let more = problems.len().saturating_sub(SHOWN);
    problems.truncate(SHOWN);
    let mut message = problems.join("; ");
    if more > 0 {
        message.push_str(&format!("; and {more} more"));
    }
    Err(LlamaError::checkpoint(path, message))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> LlamaConfig {
        LlamaConfig::preset("tiny").unwrap()
    }

    fn tensors() -> TensorMap {
        let mut m = TensorMap::new();
        let mut x = 0.1f32;
        let mut next = move || {
            x = (x * 1.7 + 0.31) % 3.0 - 1.2;
            x
        };
        for layer in [0, 1, 2, 10] {
            for (n, shape) in [
                ("self_attn.q_proj.weight", vec![8, 16]),
                ("mlp.up_proj.weight", vec![12, 8]),
            ] {
                let numel = shape.iter().product();
                let data = (0..numel).map(|_| next()).collect();
                m.insert(
                    format!("model.layers.{layer}.{n}"),
                    HostTensor::new(shape, data).unwrap(),
                );
            }
        }
        m.insert(
            "model.norm.weight".into(),
            HostTensor::new(vec![8], vec![1.0; 8]).unwrap(),
        );
        m
    }

    #[test]
    fn f32_round_trip_is_exact_with_config_and_tokenizer() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("export");
        let tok = tmp.path().join("tok.json");
        std::fs::write(&tok, "{\"version\": \"1.0\"}").unwrap();
        let t = tensors();
        save_hf_dir(&dir, &cfg(), &t, SaveDType::F32, u64::MAX, Some(&tok)).unwrap();
        assert_eq!(load_safetensors_dir(&dir).unwrap(), t);
        assert_eq!(read_hf_config(&dir).unwrap(), cfg());
        assert!(dir.join(SINGLE_FILE).exists() && !dir.join(INDEX_FILE).exists());
        assert!(dir.join("tokenizer.json").exists() && dir.join("tokenizer_config.json").exists());
        let config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap())
                .unwrap();
        assert_eq!(config["architectures"][0], "LlamaForCausalLM");
        assert_eq!(config["torch_dtype"], "float32");
        assert_eq!(config["head_dim"], 16);
        // The safetensors header carries the metadata PyTorch loaders look for.
        let bytes = std::fs::read(dir.join(SINGLE_FILE)).unwrap();
        let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        assert_eq!(meta.metadata().as_ref().unwrap()["format"], "pt");
        // Only the export is left: no temporary or old directories.
        let entries: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().collect();
        assert_eq!(entries.len(), 2);
    }

    #[test]
    fn bf16_round_trip_within_rounding_and_f16_too() {
        let tmp = tempfile::tempdir().unwrap();
        let t = tensors();
        for (dtype, rel) in [
            (SaveDType::BF16, 1.0 / 256.0),
            (SaveDType::F16, 1.0 / 2048.0),
        ] {
            let dir = tmp.path().join(dtype.to_string());
            save_hf_dir(&dir, &cfg(), &t, dtype, u64::MAX, None).unwrap();
            let back = load_safetensors_dir(&dir).unwrap();
            for (name, a) in &t {
                let b = &back[name];
                assert_eq!(a.shape, b.shape);
                for (x, y) in a.data.iter().zip(&b.data) {
                    assert!((x - y).abs() <= x.abs() * rel, "{name} {dtype}: {x} vs {y}");
                }
            }
            let size = std::fs::metadata(dir.join(SINGLE_FILE)).unwrap().len();
            let values: usize = t.values().map(|t| t.data.len()).sum();
            assert!(
                size < (values * 2 + 4096) as u64,
                "{dtype} file is {size} bytes"
            );
        }
    }

    #[test]
    fn sharded_write_reads_back_and_replaces_previous_export() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("export");
        let t = tensors();
        save_hf_dir(&dir, &cfg(), &t, SaveDType::F32, u64::MAX, None).unwrap();
        // 128 and 96 f32 values: at most one q_proj plus one up_proj per 1 KiB shard.
        save_hf_dir(&dir, &cfg(), &t, SaveDType::F32, 1024, None).unwrap();
        assert!(
            !dir.join(SINGLE_FILE).exists(),
            "the old single file must be gone"
        );
        let index: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join(INDEX_FILE)).unwrap()).unwrap();
        let total: usize = t.values().map(|t| t.data.len() * 4).sum();
        assert_eq!(index["metadata"]["total_size"], total);
        let map = index["weight_map"].as_object().unwrap();
        assert_eq!(map.len(), t.len());
        let files: std::collections::BTreeSet<&str> =
            map.values().map(|v| v.as_str().unwrap()).collect();
        assert!(files.len() >= 4, "{files:?}");
        let n = files.len();
        assert!(files.contains(format!("model-00001-of-{n:05}.safetensors").as_str()));
        // Natural order keeps layer 2 ahead of layer 10.
        let shard_of = |name: &str| map[name].as_str().unwrap().to_string();
        assert!(
            shard_of("model.layers.2.mlp.up_proj.weight")
                < shard_of("model.layers.10.mlp.up_proj.weight")
        );
        assert_eq!(load_safetensors_dir(&dir).unwrap(), t);

        std::fs::write(dir.join("notes.txt"), "mine").unwrap();
        let err = save_hf_dir(&dir, &cfg(), &t, SaveDType::F32, 1024, None).unwrap_err();
        assert!(err.to_string().contains("notes.txt"), "{err}");
        assert!(dir.join("notes.txt").exists());
    }

    /// The slice reader returns exactly what the whole-file loader does, for any range, from
    /// single and sharded checkpoints in every stored dtype; damaged files fail when opened.
    #[test]
    fn checkpoint_reader_slices_match_the_full_load() {
        let tmp = tempfile::tempdir().unwrap();
        let t = tensors();
        for (i, (dtype, shard_bytes)) in [
            (SaveDType::F32, u64::MAX),
            (SaveDType::BF16, 1024),
            (SaveDType::F16, u64::MAX),
        ]
        .into_iter()
        .enumerate()
        {
            let dir = tmp.path().join(format!("ckpt{i}"));
            save_hf_dir(&dir, &cfg(), &t, dtype, shard_bytes, None).unwrap();
            let full = load_safetensors_dir(&dir).unwrap();
            let reader = CheckpointReader::open(&dir).unwrap();
            let shapes: BTreeMap<String, Vec<usize>> = full
                .iter()
                .map(|(n, t)| (n.clone(), t.shape.clone()))
                .collect();
            assert_eq!(reader.shapes(), shapes);
            for (name, whole) in &full {
                let n = whole.data.len();
                for range in [0..n, 0..1, n / 3..n - n / 4, n - 1..n, 5..5] {
                    assert_eq!(
                        reader.read(name, range.clone()).unwrap(),
                        whole.data[range.clone()],
                        "{name} {range:?} ({dtype:?})"
                    );
                }
                assert!(reader.read(name, 0..n + 1).is_err());
            }
            assert!(reader.read("model.ghost", 0..1).is_err());
        }
        let dir = tmp.path().join("ckpt0");
        let file = dir.join(SINGLE_FILE);
        let bytes = std::fs::read(&file).unwrap();
        std::fs::write(&file, &bytes[..bytes.len() - 100]).unwrap();
        let err = CheckpointReader::open(&dir).unwrap_err().to_string();
        assert!(
            err.contains(SINGLE_FILE) && err.contains("ends at byte"),
            "{err}"
        );
        std::fs::write(&file, &bytes[..4]).unwrap();
        assert!(CheckpointReader::open(&dir).is_err());
    }

    #[test]
    fn corrupt_unknown_dtype_and_missing_shard_tensor_errors() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("export");
        let t = tensors();
        save_hf_dir(&dir, &cfg(), &t, SaveDType::BF16, u64::MAX, None).unwrap();
        let file = dir.join(SINGLE_FILE);
        let bytes = std::fs::read(&file).unwrap();
        std::fs::write(&file, &bytes[..bytes.len() - 100]).unwrap();
        let err = load_safetensors_dir(&dir).unwrap_err().to_string();
        assert!(err.contains("model.safetensors"), "{err}");

        let data: Vec<u8> = [1i32, 2, 3].iter().flat_map(|v| v.to_le_bytes()).collect();
        let view = safetensors::tensor::TensorView::new(Dtype::I32, vec![3], &data).unwrap();
        safetensors::serialize_to_file([("model.counts", view)], None, &file).unwrap();
        let err = load_safetensors_dir(&dir).unwrap_err().to_string();
        assert!(
            err.contains("model.counts") && err.contains("I32") && err.contains(SINGLE_FILE),
            "{err}"
        );

        save_hf_dir(&dir, &cfg(), &t, SaveDType::F32, 1024, None).unwrap();
        let index_path = dir.join(INDEX_FILE);
        let mut index: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&index_path).unwrap()).unwrap();
        let shard = index["weight_map"]["model.norm.weight"]
            .as_str()
            .unwrap()
            .to_string();
        index["weight_map"]["model.ghost.weight"] = json!(shard);
        std::fs::write(&index_path, index.to_string()).unwrap();
        let err = load_safetensors_dir(&dir).unwrap_err().to_string();
        assert!(
            err.contains("model.ghost.weight") && err.contains(&shard),
            "{err}"
        );

        let err = load_safetensors_dir(tmp.path()).unwrap_err().to_string();
        assert!(err.contains(SINGLE_FILE), "{err}");
    }

    #[test]
    fn check_tensors_names_every_problem() {
        let t = tensors();
        let path = Path::new("/ckpt/model.safetensors");
        let mut expected: Vec<(String, Vec<usize>)> = t
            .iter()
            .map(|(n, x)| (n.clone(), x.shape.clone()))
            .collect();
        check_tensors(&expected, &t, path).unwrap();
        expected.retain(|(n, _)| n != "model.norm.weight");
        expected.push(("lm_head.weight".into(), vec![256, 8]));
        expected[0].1 = vec![16, 8];
        let err = check_tensors(&expected, &t, path).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, LlamaError::Checkpoint { .. }));
        assert!(msg.contains("/ckpt/model.safetensors"), "{msg}");
        assert!(msg.contains("missing tensor lm_head.weight"), "{msg}");
        assert!(msg.contains("unexpected tensor model.norm.weight"), "{msg}");
        assert!(msg.contains("[12, 8]") && msg.contains("[16, 8]"), "{msg}");
    }

    #[test]
    fn reads_hf_configs_with_defaults_and_rejects_others() {
        let tmp = tempfile::tempdir().unwrap();
        let write = |v: serde_json::Value| {
            std::fs::write(tmp.path().join("config.json"), v.to_string()).unwrap()
        };
        write(json!({
            "model_type": "llama", "vocab_size": 32000, "hidden_size": 4096,
            "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "torch_dtype": "float16",
            "transformers_version": "4.31.0", "rope_scaling": null
        }));
        assert_eq!(
            read_hf_config(tmp.path()).unwrap(),
            LlamaConfig::preset("7b").unwrap()
        );
        write(json!({"model_type": "mistral", "vocab_size": 1}));
        let err = read_hf_config(tmp.path()).unwrap_err().to_string();
        assert!(
            err.contains("mistral") && err.contains("config.json"),
            "{err}"
        );
        let mut v = hf_config_json(&cfg(), SaveDType::BF16);
        v["num_hidden_layers"] = json!("two");
        write(v);
        assert!(read_hf_config(tmp.path()).is_err());
        assert!("BF16".parse::<SaveDType>().unwrap() == SaveDType::BF16);
        assert!("int8".parse::<SaveDType>().is_err());
    }
}
