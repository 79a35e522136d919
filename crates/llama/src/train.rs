//! The training loop behind `llama2_train`: data, schedule, gradient accumulation, evaluation,
//! checkpoints, metrics, export and sampling, for one rank of any data-parallel layout; and the
//! run's configuration, [`TrainConfig`], which is at once the command line and the TOML file.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::tensor::{Int, Tensor, TensorData, backend::AutodiffBackend};
use clap::parser::ValueSource;
use clap::{ArgAction, Args, CommandFactory, FromArgMatches, Parser};
use collectives::{CommunicatorExt, ReduceOp};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use smp_burn::checkpoint::{Checkpointer, Committed, ShardedCheckpoint, committed_checkpoints};
use smp_burn::engine::{Init, MicroBatch, StateKind};
use smp_burn::fsdp::AdamW;
use smp_burn::mesh::Mesh;
use smp_burn::{Documents, KernelConfig, ParallelConfig, ParallelDims, Precision};

use crate::config::LlamaConfig;
use crate::data::{Batch, DataPosition, TokenDataset};
use crate::error::{LlamaError, Result};
use crate::hf::{self, SaveDType};
use crate::metrics::{MetricsLog, StepMetrics, write_loss_plot_svg};
use crate::parallel::{Build, LlamaEngine, build, seeded_init};
use crate::tokenizer::TextTokenizer;

/// Everything a training run needs besides the model shape.
///
/// The one description of the run's settings: each field is a key of the TOML file
/// `llama2_train --config` reads (`seq_len = 256`; the sections `[parallel]`, `[kernels]` and
/// `[adamw]` are tables) and, but for `adamw`, a flag of `llama2_train` (`--seq-len 256`), with
/// its default written once, on the field. [`TrainConfig::from_args`] layers them: the default,
/// then the file, then the flags typed on the command line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Args)]
#[serde(default, deny_unknown_fields)]
pub struct TrainConfig {
    /// `cpu` (NdArray backend, f32) or `cuda` (Burn's CUDA backend, bf16 by default).
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda"])]
    pub device: String,
    /// Ranks to run in this process: CPU thread-ranks, or GPUs (default: 1 on the CPU, every
    /// visible GPU with cuda). Ignored when launched by smp-run, torchrun or Slurm (RANK or
    /// SLURM_PROCID set).
    #[arg(long)]
    pub nproc_per_node: Option<usize>,
    /// Model preset: tiny, small, 1b, 7b, 13b, 70b; ignored with `init_from_hf`.
    #[arg(long, default_value = "small")]
    pub model: String,
    /// Overrides the preset's number of decoder layers (a 70B-wide model with a few layers
    /// shows per-rank memory and step time of the real widths on fewer GPUs).
    #[arg(long)]
    pub layers: Option<usize>,
    /// Vocabulary size of the tokenizer trained on the corpus (when none is given).
    #[arg(long, default_value_t = 2048)]
    pub vocab_size: usize,
    /// Tokens per training sequence.
    #[arg(long, default_value_t = 128)]
    pub seq_len: usize,
    /// Sequences per data-parallel rank per micro-batch (the ranks of a tensor-parallel group
    /// share them, each taking its chunk of the sequence).
    #[arg(long, default_value_t = 16)]
    pub micro_batch: usize,
    /// Tokens per optimizer step over all ranks, filled by gradient accumulation; 0 = one
    /// micro-batch per rank.
    #[arg(long, default_value_t = 0)]
    pub global_batch_tokens: usize,
    /// Optimizer steps.
    #[arg(long, default_value_t = 400)]
    pub steps: u64,
    /// Peak learning rate.
    #[arg(long, default_value_t = 3e-3)]
    pub lr: f64,
    /// Final learning rate of the cosine decay.
    #[arg(long, default_value_t = 3e-4)]
    pub min_lr: f64,
    /// Linear warmup steps.
    #[arg(long, default_value_t = 30)]
    pub warmup_steps: u64,
    /// AdamW hyper-parameters (the `[adamw]` table of a config file; no flags).
    #[arg(skip)]
    pub adamw: AdamW,
    /// Clip the global gradient norm to this value; 0 = off.
    #[arg(long, default_value_t = 1.0)]
    pub grad_clip: f64,
    /// Seed of initialization and data order (the same seed gives the same weights and batches;
    /// see `deterministic` for the arithmetic).
    #[arg(long, default_value_t = 1234)]
    pub seed: u64,
    /// `embedded` (the Shakespeare corpus in the binary) or a path: text, `.gz`, directory,
    /// JSONL.
    #[arg(long, default_value = "embedded")]
    pub data: String,
    /// JSONL field holding the text.
    #[arg(long, default_value = "text")]
    pub text_field: String,
    /// A `tokenizer.json` to use instead of training a BPE tokenizer on the corpus. A resumed
    /// run uses the checkpoint's; one given here must have the same vocabulary.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Fraction of the corpus held out for validation.
    #[arg(long, default_value_t = 0.02)]
    pub val_fraction: f64,
    /// Keep attention and rotary positions inside each document of a packed row (a document
    /// ends at `</s>`): FlashAttention's varlen, Megatron's `reset_attention_mask` with
    /// `reset_position_ids`. No token attends to the previous document, and attention's work
    /// shrinks to the documents' own. Off, a row is one causal sequence across documents.
    #[arg(long)]
    pub document_masking: bool,
    /// Evaluate every this many steps (and at the end); 0 = only at the end.
    #[arg(long, default_value_t = 100)]
    pub eval_interval: u64,
    /// Validation batches per evaluation.
    #[arg(long, default_value_t = 8)]
    pub eval_batches: usize,
    /// Where checkpoints, metrics.jsonl and loss.svg go.
    #[arg(long, default_value = "runs/llama2")]
    pub out_dir: PathBuf,
    /// Save a checkpoint every this many steps (and at the end); 0 = only at the end.
    #[arg(long, default_value_t = 0)]
    pub checkpoint_interval: u64,
    /// Write checkpoints at all; off, no step saves one whatever `checkpoint_interval` says.
    /// The flag is `--no-checkpoint`.
    #[arg(
        long = "no-checkpoint",
        action = ArgAction::SetFalse,
        help = "Write no checkpoints, not even at checkpoint_interval (throughput runs of large \
                models); the config key is checkpoints = false"
    )]
    pub checkpoints: bool,
    /// Keep only the newest this many checkpoints, deleting older ones once a newer one is
    /// complete; unset keeps all.
    #[arg(long, value_name = "K")]
    pub keep_checkpoints: Option<usize>,
    /// Continue from the latest checkpoint in `out_dir`.
    #[arg(long)]
    pub resume: bool,
    /// Start a fresh run in an `out_dir` (or export directory) that holds another run's
    /// checkpoints, metrics or export, replacing them; without it (or `resume`) that is an
    /// error, so that no run destroys another's data.
    #[arg(long, conflicts_with = "resume")]
    pub overwrite: bool,
    /// Resume although the data settings differ from the checkpoint's (sequence length, data,
    /// text field, validation split, global batch, seed); without it a resumed run with other
    /// data settings is refused with both values, as its data position would mean something
    /// else.
    #[arg(long)]
    pub resume_with_changes: bool,
    /// Start from a Hugging Face Llama directory's weights (and its config.json).
    #[arg(long)]
    pub init_from_hf: Option<PathBuf>,
    /// Write a Hugging Face checkpoint here at the end; `none` for no export. Default:
    /// `<out_dir>/hf`.
    #[arg(long, value_name = "DIR|none")]
    #[serde(with = "none_means_off")]
    pub export_hf: Option<PathBuf>,
    /// Dtype of the exported weights: bf16, f16 or f32.
    #[arg(long, default_value = "bf16")]
    pub export_dtype: String,
    /// Generate text from this prompt at the end; `none` for no sample.
    #[arg(long, default_value = "ROMEO:", value_name = "PROMPT|none")]
    #[serde(with = "none_means_off")]
    pub sample: Option<String>,
    /// Tokens to generate.
    #[arg(long, default_value_t = 120)]
    pub sample_tokens: usize,
    /// Peak FLOP/s per GPU for MFU, in TFLOP/s, for a GPU the built-in table does not know
    /// (or to count against another peak). Default: the table's dense bf16 figure for the CUDA
    /// device's name (`llama::metrics::PEAK_FLOPS_16BIT`).
    #[arg(long, value_name = "TFLOPS")]
    pub peak_tflops: Option<f64>,
    /// On CUDA: let the planner (`llama::plan`) choose the tensor-parallel and shard degrees,
    /// the micro-batch, the recomputed layers and offloading for the GPUs of this run, log its
    /// prediction, and compare it with the measured step at the end. Settings given explicitly
    /// (a flag or a file key) are kept.
    #[arg(long)]
    pub auto: bool,
    /// Show a progress bar (rank 0). The flag is `--no-progress`.
    #[arg(long = "no-progress", action = ArgAction::SetFalse, help = "Hide the progress bar")]
    pub progress: bool,
    /// Parallelism: the `[parallel]` table of a config file.
    #[command(flatten)]
    pub parallel: ParallelSection,
    /// Kernel settings over `SMP_BURN_KERNELS`: the `[kernels]` table of a config file.
    #[command(flatten)]
    pub kernels: KernelSection,
}

impl Default for TrainConfig {
    /// The flags' defaults, and the export under `out_dir`.
    fn default() -> Self {
        let mut c: Self = flag_defaults();
        c.export_hf = Some(c.out_dir.join("hf"));
        c
    }
}

/// A value of type `T` with every flag at its default: the defaults are written on the fields'
/// `#[arg]` attributes only, and serde's defaults come from here.
fn flag_defaults<T: Args + FromArgMatches>() -> T {
    let command = T::augment_args(clap::Command::new("defaults"));
    let matches = command
        .try_get_matches_from(["defaults"])
        .expect("every flag has a default or is optional");
    T::from_arg_matches(&matches).expect("the defaults parse")
}

/// Serde for an `Option` whose `None` is written `"none"`, as on the command line
/// (`--export-hf none`): a key left out of a config file means the default, not off.
mod none_means_off {
    use std::ffi::OsStr;

    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub fn serialize<S: Serializer, T: Serialize>(
        value: &Option<T>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        match value {
            Some(v) => v.serialize(s),
            None => s.serialize_str("none"),
        }
    }

    pub fn deserialize<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
    where
        D: Deserializer<'de>,
        T: Deserialize<'de> + AsRef<OsStr>,
    {
        Ok(Option::<T>::deserialize(d)?.filter(|v| v.as_ref() != OsStr::new("none")))
    }
}

/// The run's parallel layout: smp-burn's [`ParallelConfig`] with the trainer's defaults, its
/// fields the `[parallel]` keys and flags of the same names (`--tensor-parallel-degree`).
///
/// It dereferences to the [`ParallelConfig`] the engine takes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(from = "ParallelFlags", into = "ParallelFlags")]
pub struct ParallelSection(pub ParallelConfig);

impl Default for ParallelSection {
    fn default() -> Self {
        ParallelFlags::default().into()
    }
}

impl std::ops::Deref for ParallelSection {
    type Target = ParallelConfig;
    fn deref(&self) -> &ParallelConfig {
        &self.0
    }
}

impl std::ops::DerefMut for ParallelSection {
    fn deref_mut(&mut self) -> &mut ParallelConfig {
        &mut self.0
    }
}

/// The flags and keys of [`ParallelSection`]; [`ParallelConfig`] belongs to smp-burn, which
/// knows no command line, so its fields are listed again here, once, with the trainer's
/// defaults and help.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Args)]
#[serde(default, deny_unknown_fields)]
#[command(next_help_heading = "Parallelism ([parallel] in a config file)")]
struct ParallelFlags {
    /// Shard parameters across groups of this many ranks and replicate across groups (0 = all
    /// ranks: full sharding).
    #[arg(long, default_value_t = 0)]
    hybrid_shard_degree: usize,
    /// Split each decoder layer across this many ranks (Megatron-style tensor parallelism with
    /// sequence parallelism; 1 = off). Must divide the world size, `seq_len`, the heads, the
    /// key/value heads and the MLP width; FSDP then shards across the remaining ranks.
    #[arg(long, default_value_t = 1)]
    tensor_parallel_degree: usize,
    /// Compute dtype: bf16 (fp32 master weights and optimizer state) or f32. Default: bf16
    /// with `device = cuda`, f32 on the CPU.
    #[arg(long, value_parser = parse_precision, default_value = "f32", hide_default_value = true)]
    param_dtype: Precision,
    /// Dtype gradients are reduced in: f32 or bf16.
    #[arg(long, value_parser = parse_precision, default_value = "f32")]
    reduce_dtype: Precision,
    /// Recompute each decoder layer in the backward pass instead of storing its activations
    /// (true or false). On CUDA, unless this or `checkpointed_layers` is set, the fewest layers
    /// are recomputed that fit the GPU's memory.
    #[arg(long, action = ArgAction::Set, default_value_t = false, value_name = "BOOL")]
    activation_checkpointing: bool,
    /// Recompute only the first N decoder layers, keeping the others' activations (implies
    /// `activation_checkpointing`; at least the number of layers means all).
    #[arg(long, value_name = "N")]
    checkpointed_layers: Option<usize>,
    /// Recomputed layers also keep their attention's output and statistics, so that their
    /// recomputation skips attention's forward (at long sequences the larger part of it) for
    /// one more `seq x hidden` tensor per layer; on CUDA the memory estimate counts it. Alone
    /// it means true. On CUDA, unless this, `activation_checkpointing` or `checkpointed_layers`
    /// is set, the planner chooses it where it repeats fewer FLOPs than recomputing fully.
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    selective_recompute: bool,
    /// Keep the input of each recomputed layer in host memory between its forward and its
    /// backward (SMP's activation offloading; implies `activation_checkpointing`). On CUDA
    /// without `checkpointed_layers`, the layers to recompute are chosen with the offloaded
    /// inputs left out of the memory estimate. Results are unchanged.
    #[arg(long)]
    activation_offloading: bool,
    /// With `activation_offloading`, how many layers ahead of its backward a layer's input is
    /// brought back.
    #[arg(long, default_value_t = 2, value_name = "N")]
    activation_loading_horizon: usize,
    /// With tensor parallelism, split the residual stream along the sequence between the split
    /// regions (Megatron's sequence parallelism; true or false).
    #[arg(long, action = ArgAction::Set, default_value_t = true, value_name = "BOOL")]
    sequence_parallel: bool,
    /// Start the next unit's all-gather before the current unit runs (1) or not (0). On CUDA
    /// the gather, and in the backward the reduce-scatter, then run beside the compute: 7B on
    /// 2 H200s 432-439 against 459-463 ms per step.
    #[arg(long, default_value_t = 1)]
    prefetch_depth: usize,
    /// Reduce gradients after every micro-batch (true) or only after the last one of a step
    /// (false: the full f32 gradient is accumulated locally, FSDP's `no_sync`). True trades a
    /// reduction per micro-batch for that gradient's memory.
    #[arg(long, action = ArgAction::Set, default_value_t = false, value_name = "BOOL")]
    reduce_every_micro_batch: bool,
}

impl Default for ParallelFlags {
    fn default() -> Self {
        flag_defaults()
    }
}

/// `bf16` or `f32`, as the TOML form spells [`Precision`].
fn parse_precision(s: &str) -> std::result::Result<Precision, String> {
    match s {
        "bf16" => Ok(Precision::Bf16),
        "f32" => Ok(Precision::F32),
        other => Err(format!("'{other}': use bf16 or f32")),
    }
}

impl From<ParallelFlags> for ParallelSection {
    fn from(f: ParallelFlags) -> Self {
        Self(ParallelConfig {
            hybrid_shard_degree: f.hybrid_shard_degree,
            tensor_parallel_degree: f.tensor_parallel_degree,
            param_dtype: f.param_dtype,
            reduce_dtype: f.reduce_dtype,
            activation_checkpointing: f.activation_checkpointing,
            checkpointed_layers: f.checkpointed_layers,
            selective_recompute: f.selective_recompute,
            activation_offloading: f.activation_offloading,
            activation_loading_horizon: f.activation_loading_horizon,
            sequence_parallel: f.sequence_parallel,
            prefetch_depth: f.prefetch_depth,
            reduce_every_micro_batch: f.reduce_every_micro_batch,
        })
    }
}

impl From<ParallelSection> for ParallelFlags {
    fn from(s: ParallelSection) -> Self {
        // Destructured without `..`: a field added to `ParallelConfig` must be given a flag.
        let ParallelConfig {
            hybrid_shard_degree,
            tensor_parallel_degree,
            param_dtype,
            reduce_dtype,
            activation_checkpointing,
            checkpointed_layers,
            selective_recompute,
            activation_offloading,
            activation_loading_horizon,
            sequence_parallel,
            prefetch_depth,
            reduce_every_micro_batch,
        } = s.0;
        Self {
            hybrid_shard_degree,
            tensor_parallel_degree,
            param_dtype,
            reduce_dtype,
            activation_checkpointing,
            checkpointed_layers,
            selective_recompute,
            activation_offloading,
            activation_loading_horizon,
            sequence_parallel,
            prefetch_depth,
            reduce_every_micro_batch,
        }
    }
}

impl FromArgMatches for ParallelSection {
    fn from_arg_matches(matches: &clap::ArgMatches) -> std::result::Result<Self, clap::Error> {
        ParallelFlags::from_arg_matches(matches).map(Self::from)
    }

    fn update_from_arg_matches(
        &mut self,
        matches: &clap::ArgMatches,
    ) -> std::result::Result<(), clap::Error> {
        let mut flags = ParallelFlags::from(self.clone());
        flags.update_from_arg_matches(matches)?;
        *self = flags.into();
        Ok(())
    }
}

impl Args for ParallelSection {
    fn augment_args(cmd: clap::Command) -> clap::Command {
        ParallelFlags::augment_args(cmd)
    }

    fn augment_args_for_update(cmd: clap::Command) -> clap::Command {
        ParallelFlags::augment_args_for_update(cmd)
    }

    fn group_id() -> Option<clap::Id> {
        ParallelFlags::group_id()
    }
}

/// Kernel settings layered over the environment's `SMP_BURN_KERNELS`
/// ([`smp_burn::KernelConfig`]): the `[kernels]` table of a config file, with
/// [`smp_burn::KernelConfig`]'s own TOML keys, and flags. A setting left out keeps the
/// environment's value (or the default).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, Args)]
#[serde(default, deny_unknown_fields)]
#[command(next_help_heading = "Kernels ([kernels] in a config file, over SMP_BURN_KERNELS)")]
pub struct KernelSection {
    /// Fast CUDA paths: all, none, or names joined by `+` (gemm+attention+norm).
    #[arg(long = "fast-paths", value_name = "PATHS")]
    pub fast: Option<String>,
    /// Bitwise reproducible CUDA kernels: the attention backward then sums dQ without atomics
    /// at every head dim (7B steps about 1-4 % slower). `--deterministic` alone means true. On
    /// CPU it changes nothing: the seed fixes initialization and data order, but losses may
    /// differ from run to run in their last bits (Burn's CPU kernels split buffers at vector
    /// alignment, which depends on where memory was allocated).
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    pub deterministic: Option<bool>,
    /// The flash-attention forward kernel: mma-8x2, mma-4x2 or wgmma (default: the fastest for
    /// the device and head dim).
    #[arg(long, value_name = "KERNEL")]
    pub flash_forward: Option<String>,
    /// The flash-attention backward kernel: split, atomic, atomic-grid or wgmma (default: the
    /// fastest for the device and head dim; split when deterministic).
    #[arg(long, value_name = "KERNEL")]
    pub flash_backward: Option<String>,
    /// Where compiled CUDA kernels are cached (default: $XDG_CACHE_HOME/smp-burn/cubecl, else
    /// ~/.cache/smp-burn/cubecl).
    #[arg(long = "kernel-cache-dir", value_name = "DIR")]
    pub cache_dir: Option<PathBuf>,
    /// FP8 linear layers in the transformer blocks: off, or tensorwise (per-tensor current
    /// scaling, E4M3 forward and E5M2 gradients). Needs --device cuda on GPUs of compute
    /// capability 8.9 or later (Ada, Hopper); the embedding, the LM head and the optimizer
    /// stay as they are.
    #[arg(long, value_name = "RECIPE")]
    pub fp8: Option<String>,
}

impl KernelSection {
    /// `base` (most often [`KernelConfig::from_env`]) with the settings given here applied.
    ///
    /// # Errors
    /// A value [`KernelConfig`] does not accept, or settings that contradict each other
    /// (deterministic kernels with a non-deterministic `flash_backward`), named in the message.
    pub fn apply(&self, base: KernelConfig) -> Result<KernelConfig> {
        // smp-burn reports kernel settings as its configuration errors, whose prefix says
        // "parallel".
        let kernel_error = |message: &str| {
            let message = message.trim_start_matches("invalid parallel configuration: ");
            LlamaError::Config(format!("kernel settings: {message}"))
        };
        // The given items, read by KernelConfig's own TOML form: it parses and checks them,
        // and only they are taken over `base`.
        let given = toml::Table::try_from(self).map_err(|e| kernel_error(&e.to_string()))?;
        let parsed: KernelConfig = toml::Value::Table(given)
            .try_into()
            .map_err(|e: toml::de::Error| kernel_error(e.message()))?;
        let mut c = base;
        if self.fast.is_some() {
            c.fast_paths = parsed.fast_paths;
        }
        if let Some(on) = self.deterministic {
            c.deterministic = on;
        }
        if self.flash_forward.is_some() {
            c.flash_forward = parsed.flash_forward;
        }
        if self.flash_backward.is_some() {
            c.flash_backward = parsed.flash_backward;
        }
        if self.cache_dir.is_some() {
            c.cache_dir = parsed.cache_dir;
        }
        if self.fp8.is_some() {
            c.fp8 = parsed.fp8;
        }
        c.validate().map_err(|e| kernel_error(&e.to_string()))?;
        Ok(c)
    }
}

/// `llama2_train`'s command line: a [`TrainConfig`], every field a flag, and the two options
/// that read and write it as a TOML file.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "llama2_train",
    about = "Train Llama 2 with smp-burn (sharded data and tensor parallelism on CPU threads or \
             GPUs)",
    after_help = "Precedence: built-in default < --config FILE < flags given here. Every flag \
                  but --config and --write-config is also a key of the TOML file: --seq-len is \
                  seq_len, the parallelism flags go in [parallel], the kernel flags in \
                  [kernels]; --no-checkpoint is checkpoints = false, --no-progress is progress \
                  = false, --fast-paths is fast and --kernel-cache-dir is cache_dir in \
                  [kernels]. --write-config FILE shows the form."
)]
pub struct TrainArgs {
    /// Read the run's configuration from this TOML file; flags given here override it.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Write the effective configuration to this TOML file and exit.
    #[arg(long, value_name = "FILE")]
    pub write_config: Option<PathBuf>,
    /// The run.
    #[command(flatten)]
    pub train: TrainConfig,
}

/// Where a setting of a [`ResolvedConfig`] came from, lowest precedence first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Source {
    /// The built-in default (or a value derived from other settings, such as `export_hf`).
    Default,
    /// The config file given with `--config`.
    File,
    /// A flag typed on the command line.
    Flag,
}

/// A [`TrainConfig`] resolved from its layers, and which settings the user fixed: the trainer
/// chooses the others (the layers to recompute on a GPU, the compute dtype by device).
#[derive(Debug, Clone)]
pub struct ResolvedConfig {
    /// The run's configuration.
    pub config: TrainConfig,
    /// The source of every setting not left at its default, by dotted key
    /// (`parallel.checkpointed_layers`).
    pub sources: BTreeMap<String, Source>,
    /// The file given with `--config`.
    pub config_file: Option<PathBuf>,
    /// Where `--write-config` asked the configuration to be written.
    pub write_config: Option<PathBuf>,
}

/// Keys whose default follows other settings or the GPU, left out of a written config file
/// unless the user set them, so that reading it back derives them again.
const DERIVED_KEYS: [&str; 5] = [
    "export_hf",
    "parallel.param_dtype",
    "parallel.activation_checkpointing",
    "parallel.checkpointed_layers",
    "parallel.selective_recompute",
];

/// The top-level keys whose fields are flags too (flattened sections).
const FLAG_SECTIONS: [&str; 2] = ["parallel", "kernels"];

impl ResolvedConfig {
    /// Where the setting `key` (dotted: `parallel.prefetch_depth`) came from.
    pub fn source(&self, key: &str) -> Source {
        self.sources.get(key).copied().unwrap_or(Source::Default)
    }

    /// Whether the user set `key`, in the config file or as a flag.
    pub fn is_explicit(&self, key: &str) -> bool {
        self.source(key) > Source::Default
    }

    /// The configuration as a TOML file: every key, but those whose defaults derive from other
    /// settings (`export_hf`, `parallel.param_dtype`, `parallel.activation_checkpointing`,
    /// `parallel.checkpointed_layers`, `parallel.selective_recompute`) where the user left them
    /// to the trainer.
    pub fn to_toml(&self) -> String {
        let mut table = String::new();
        let mut body = String::new();
        let mut in_string = false;
        // Filtered line by line to keep the struct's order (a `toml::Table` sorts its keys);
        // the keys dropped are one-line scalars, and the lines of a multi-line string (a
        // sample prompt) are kept as they are.
        for line in self.config.to_toml().lines() {
            let was_in_string = in_string;
            if (line.matches("\"\"\"").count() + line.matches("'''").count()) % 2 == 1 {
                in_string = !in_string;
            }
            if was_in_string {
                body.push_str(line);
                body.push('\n');
                continue;
            }
            if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
                table = name.to_string();
            }
            let key = line.split_once(" = ").map(|(k, _)| match table.as_str() {
                "" => k.to_string(),
                t => format!("{t}.{k}"),
            });
            let derived = key
                .as_deref()
                .is_some_and(|k| DERIVED_KEYS.contains(&k) && !self.is_explicit(k));
            if !derived {
                body.push_str(line);
                body.push('\n');
            }
        }
        format!(
            "# llama2_train --config FILE reads this; flags given with it override it. Left out\n\
             # unless set, as they follow out_dir, device and the GPU's memory: {}.\n{body}",
            DERIVED_KEYS.join(", ")
        )
    }
}

impl TrainConfig {
    /// Resolves `llama2_train`'s command line (`args` starts with the program name): the
    /// defaults, overridden by the TOML file of `--config` if any, overridden by the flags
    /// typed. A file's section sets only the keys it names. Then the settings implied by
    /// others: `checkpointed_layers` and `activation_offloading` turn on
    /// `activation_checkpointing` (unless a higher layer turned it off), `export_hf` follows
    /// `out_dir`, `param_dtype` is bf16 with `device = cuda`.
    ///
    /// # Errors
    /// [`LlamaError::Usage`] for what clap rejects (and `--help`, which it reports the same
    /// way); [`LlamaError::Config`] for a file that cannot be read or parsed, an unknown key
    /// (named, with the closest valid key), a value of the wrong type, or settings that
    /// contradict each other.
    pub fn from_args<I, T>(args: I) -> Result<ResolvedConfig>
    where
        I: IntoIterator<Item = T>,
        T: Into<OsString> + Clone,
    {
        let matches = TrainArgs::command().try_get_matches_from(args)?;
        let args = TrainArgs::from_arg_matches(&matches)?;
        let defaults = to_json(&TrainConfig::default())?;
        // The typed flags only: clap fills in the defaults of the others, which must not
        // override the file.
        let typed = to_json(&args.train)?;
        let mut flags = Value::Object(Map::new());
        for id in matches.ids() {
            let id = id.as_str();
            if matches.value_source(id) != Some(ValueSource::CommandLine) {
                continue;
            }
            if let Some(path) = flag_key(&defaults, id) {
                let value = lookup(&typed, &path).cloned().unwrap_or(Value::Null);
                insert(&mut flags, &path, value);
            }
        }
        let file = match &args.config {
            Some(path) => Some((path.as_path(), read_layer(path, &defaults)?)),
            None => None,
        };
        let mut resolved = resolve(defaults, file, flags)?;
        resolved.write_config = args.write_config;
        Ok(resolved)
    }

    /// Reads a TOML file: the keys it gives over the defaults, as `--config path` with no
    /// other flag.
    ///
    /// # Errors
    /// As [`TrainConfig::from_args`].
    pub fn from_toml_file(path: &Path) -> Result<Self> {
        let defaults = to_json(&TrainConfig::default())?;
        let layer = read_layer(path, &defaults)?;
        let flags = Value::Object(Map::new());
        Ok(resolve(defaults, Some((path, layer)), flags)?.config)
    }

    /// The TOML text of this configuration, every key.
    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).expect("a TrainConfig always serializes")
    }

    /// Learning rate at optimizer step `step` (0-based): linear warmup, then cosine decay to
    /// `min_lr` at the last step.
    pub fn lr_at(&self, step: u64) -> f64 {
        if step < self.warmup_steps {
            return self.lr * (step + 1) as f64 / self.warmup_steps as f64;
        }
        let span = self.steps.saturating_sub(self.warmup_steps).max(1) as f64;
        let progress = ((step - self.warmup_steps) as f64 / span).min(1.0);
        self.min_lr
            + 0.5 * (self.lr - self.min_lr) * (1.0 + (std::f64::consts::PI * progress).cos())
    }
}

fn to_json(config: &TrainConfig) -> Result<Value> {
    serde_json::to_value(config)
        .map_err(|e| LlamaError::Config(format!("the configuration does not serialize: {e}")))
}

/// The key of flag `id`: a top-level key, or one of a flattened section's; `None` for the
/// options that are no key (`--config`) and clap's argument groups.
fn flag_key(defaults: &Value, id: &str) -> Option<Vec<String>> {
    let top = defaults.as_object()?;
    if top.get(id).is_some_and(|v| !v.is_object()) {
        return Some(vec![id.to_string()]);
    }
    FLAG_SECTIONS
        .iter()
        .find(|s| top.get(**s).and_then(|t| t.get(id)).is_some())
        .map(|s| vec![s.to_string(), id.to_string()])
}

fn lookup<'a>(value: &'a Value, path: &[String]) -> Option<&'a Value> {
    path.iter().try_fold(value, |v, k| v.get(k))
}

fn insert(into: &mut Value, path: &[String], value: Value) {
    let mut slot = into;
    for key in path {
        if !slot.is_object() {
            *slot = Value::Object(Map::new());
        }
        slot = slot
            .as_object_mut()
            .expect("made an object")
            .entry(key.clone())
            .or_insert(Value::Null);
    }
    *slot = value;
}

/// Lays `layer` over `into`: tables key by key, anything else replaced.
fn merge(into: &mut Value, layer: &Value) {
    match (into, layer) {
        (Value::Object(base), Value::Object(over)) => {
            for (k, v) in over {
                merge(base.entry(k.clone()).or_insert(Value::Null), v);
            }
        }
        (slot, v) => *slot = v.clone(),
    }
}

/// The dotted keys of a layer's values.
fn leaf_keys(value: &Value, prefix: &str, out: &mut Vec<String>) {
    if let Value::Object(m) = value {
        for (k, v) in m {
            let key = if prefix.is_empty() {
                k.clone()
            } else {
                format!("{prefix}.{k}")
            };
            if v.is_object() {
                leaf_keys(v, &key, out);
            } else {
                out.push(key);
            }
        }
    }
}

/// A config file's keys as a layer, after checking that each is a key of the configuration.
fn read_layer(path: &Path, defaults: &Value) -> Result<Value> {
    let text = std::fs::read_to_string(path).map_err(|e| LlamaError::io(path, e))?;
    let table: toml::Table = text
        .parse()
        .map_err(|e| LlamaError::Config(format!("{}: {e}", path.display())))?;
    check_keys(&table, defaults, defaults, "", path, &text)?;
    serde_json::to_value(&table).map_err(|e| LlamaError::Config(format!("{}: {e}", path.display())))
}

/// Refuses a key the configuration (`known`, the defaults at this level of `root`) does not
/// have, naming the file, the line, the key and the closest valid key: a misspelt key would
/// otherwise leave its setting at the default without a word.
fn check_keys(
    table: &toml::Table,
    known: &Value,
    root: &Value,
    prefix: &str,
    path: &Path,
    text: &str,
) -> Result<()> {
    let Some(known_keys) = known.as_object() else {
        return Ok(());
    };
    for (key, value) in table {
        let dotted = if prefix.is_empty() {
            key.clone()
        } else {
            format!("{prefix}.{key}")
        };
        match known_keys.get(key) {
            Some(sub) if sub.is_object() => {
                if let Some(t) = value.as_table() {
                    check_keys(t, sub, root, &dotted, path, text)?;
                }
            }
            Some(_) => {}
            None => {
                let line = text
                    .lines()
                    .position(|l| {
                        let l = l.trim_start().trim_start_matches('[').trim_start();
                        l.strip_prefix(key.as_str())
                            .is_some_and(|rest| rest.trim_start().starts_with(['=', ']', '.']))
                    })
                    .map(|i| format!(", line {}", i + 1))
                    .unwrap_or_default();
                let place = if prefix.is_empty() {
                    String::new()
                } else {
                    format!(" in [{prefix}]")
                };
                return Err(LlamaError::Config(format!(
                    "{}{line}: unknown key `{key}`{place}; {}",
                    path.display(),
                    suggestion(key, prefix, known_keys, root)
                )));
            }
        }
    }
    Ok(())
}

/// What to write instead of the unknown `key` of table `prefix`: the same key in the table
/// it belongs to, else the closest key of this table, else of any table, else the list of
/// this table's keys.
fn suggestion(key: &str, prefix: &str, here: &Map<String, Value>, root: &Value) -> String {
    let mut everywhere = Vec::new();
    leaf_keys(root, "", &mut everywhere);
    let qualified = |k: &str| {
        if prefix.is_empty() {
            k.to_string()
        } else {
            format!("{prefix}.{k}")
        }
    };
    if let Some(moved) = everywhere
        .iter()
        .find(|k| k.rsplit('.').next() == Some(key))
    {
        return format!("did you mean `{moved}`{}?", table_of(moved));
    }
    if let Some(close) = closest(key, here.keys().map(String::as_str)) {
        return format!("did you mean `{}`?", qualified(close));
    }
    let leaf = |k: &String| k.rsplit('.').next().unwrap_or(k).to_string();
    let leaves: Vec<String> = everywhere.iter().map(leaf).collect();
    if let Some(close) = closest(key, leaves.iter().map(String::as_str))
        && let Some(k) = everywhere.iter().find(|k| leaf(k) == close)
    {
        return format!("did you mean `{k}`{}?", table_of(k));
    }
    let mut valid: Vec<&str> = here.keys().map(String::as_str).collect();
    valid.sort_unstable();
    format!("valid keys here: {}", valid.join(", "))
}

/// " (in the [parallel] table)" for a key of a table, nothing for a top-level key.
fn table_of(dotted: &str) -> String {
    match dotted.rsplit_once('.') {
        Some((table, _)) => format!(" (in the [{table}] table)"),
        None => " (a top-level key, before any [table])".to_string(),
    }
}

/// The candidate nearest `key` by [`edit_distance`], if near enough to be a misspelling of it
/// (a third of its length, at least one edit), or one that holds the other (`warmup`,
/// `warmup_steps`).
fn closest<'a>(key: &str, candidates: impl Iterator<Item = &'a str> + Clone) -> Option<&'a str> {
    let limit = (key.chars().count() / 3).max(1);
    candidates
        .clone()
        .map(|c| (edit_distance(key, c), c))
        .filter(|(d, _)| *d <= limit)
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c)
        .or_else(|| {
            candidates
                .filter(|c| key.len() >= 4 && (c.contains(key) || key.contains(c)))
                .min_by_key(|c| c.len().abs_diff(key.len()))
        })
}

/// Edit distance between `a` and `b`: the fewest insertions, deletions, substitutions and
/// swaps of two neighbouring characters that turn one into the other (the optimal string
/// alignment distance).
pub fn edit_distance(a: &str, b: &str) -> usize {
    let a: Vec<char> = a.chars().collect();
    let b: Vec<char> = b.chars().collect();
    // d[i][j]: distance between the first i characters of a and the first j of b.
    let mut d: Vec<Vec<usize>> = (0..=a.len())
        .map(|i| {
            (0..=b.len())
                .map(|j| {
                    if i == 0 {
                        j
                    } else if j == 0 {
                        i
                    } else {
                        0
                    }
                })
                .collect()
        })
        .collect();
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let substitute = d[i - 1][j - 1] + usize::from(a[i - 1] != b[j - 1]);
            let mut best = substitute.min(d[i - 1][j] + 1).min(d[i][j - 1] + 1);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                best = best.min(d[i - 2][j - 2] + 1);
            }
            d[i][j] = best;
        }
    }
    d[a.len()][b.len()]
}

/// The configuration of `defaults` with the file's and the flags' layers over it, and the
/// settings they imply; the file (its path and its keys) is named in every error it causes.
fn resolve(defaults: Value, file: Option<(&Path, Value)>, flags: Value) -> Result<ResolvedConfig> {
    let mut merged = defaults;
    let mut sources = BTreeMap::new();
    let mut layers = Vec::new();
    if let Some((_, layer)) = &file {
        layers.push((layer, Source::File));
    }
    layers.push((&flags, Source::Flag));
    for (layer, source) in layers {
        merge(&mut merged, layer);
        let mut keys = Vec::new();
        leaf_keys(layer, "", &mut keys);
        sources.extend(keys.into_iter().map(|k| (k, source)));
    }
    let file_path = file.as_ref().map(|(p, _)| *p);
    let mut config: TrainConfig = serde_json::from_value(merged).map_err(|e| {
        // Flags are checked by clap, so the file holds the wrong value; its own parse says
        // where (a table left partial, `[adamw]`, is no error of the merged form).
        let place = file_path.map_or(String::new(), |p| format!("{}: ", p.display()));
        let spanned = file_path
            .and_then(|p| std::fs::read_to_string(p).ok())
            .and_then(|text| toml::from_str::<TrainConfig>(&text).err())
            .filter(|e| !e.message().contains("missing field"));
        match spanned {
            Some(s) => LlamaError::Config(format!("{place}{s}")),
            None => LlamaError::Config(format!("{place}{e}")),
        }
    })?;
    settle(&mut config, &sources, file_path)?;
    Ok(ResolvedConfig {
        config,
        sources,
        config_file: file_path.map(Path::to_path_buf),
        write_config: None,
    })
}

/// Applies what settings imply for others and refuses contradictions, each by the layer that
/// set it: a flag overrides what a file implies, and two settings of one layer that contradict
/// each other are an error naming both.
fn settle(
    c: &mut TrainConfig,
    sources: &BTreeMap<String, Source>,
    file: Option<&Path>,
) -> Result<()> {
    let source = |key: &str| sources.get(key).copied().unwrap_or(Source::Default);
    // How the user wrote `key = value`: as a flag, or as a key of the file.
    let said = |key: &str, value: &dyn std::fmt::Display| match source(key) {
        Source::Flag => {
            let flag = key.rsplit('.').next().unwrap_or(key).replace('_', "-");
            match value.to_string().as_str() {
                // A switch (`--resume`) takes no value.
                "true" => format!("--{flag}"),
                v => format!("--{flag} {v}"),
            }
        }
        _ => format!(
            "{key} = {value}{}",
            file.map(|f| format!(" in {}", f.display()))
                .unwrap_or_default()
        ),
    };
    let conflict = |a: String, b: String, why: &str| {
        Err(LlamaError::Config(format!(
            "{a} {why}, {b} turns recomputation off: give one of them"
        )))
    };
    if !matches!(c.device.as_str(), "cpu" | "cuda") {
        return Err(LlamaError::Config(format!(
            "{}: use cpu or cuda",
            said("device", &format!("'{}'", c.device))
        )));
    }
    let ac = "parallel.activation_checkpointing";
    for (key, asks, why) in [
        (
            "parallel.checkpointed_layers",
            c.parallel.checkpointed_layers.is_some(),
            "asks for recomputation",
        ),
        (
            "parallel.activation_offloading",
            c.parallel.activation_offloading,
            "moves the inputs that recomputed layers keep",
        ),
    ] {
        if !asks || source(key) == Source::Default {
            continue;
        }
        if source(ac) == source(key) && !c.parallel.activation_checkpointing {
            let value: &dyn std::fmt::Display = match c.parallel.checkpointed_layers {
                Some(ref n) if key.ends_with("layers") => n,
                _ => &true,
            };
            return conflict(said(key, value), said(ac, &false), why);
        }
        // A higher layer's `false` stands: checkpointing is then off (and offloading refused
        // by the layout check, which says why).
        if source(ac) < source(key) {
            c.parallel.activation_checkpointing = true;
        }
    }
    let selective = "parallel.selective_recompute";
    if c.parallel.selective_recompute
        && source(selective) > Source::Default
        && source(ac) > Source::Default
        && !c.parallel.activation_checkpointing
    {
        return conflict(
            said(selective, &true),
            said(ac, &false),
            "keeps what the recomputed layers' attention computed",
        );
    }
    // A typed horizon without offloading does nothing, which the user should hear; a file
    // (one written by --write-config lists every key) may hold it for a later run.
    let horizon = "parallel.activation_loading_horizon";
    if source(horizon) == Source::Flag && !c.parallel.activation_offloading {
        return Err(LlamaError::Config(format!(
            "{} needs activation offloading (--activation-offloading, or activation_offloading \
             = true in [parallel])",
            said(horizon, &c.parallel.activation_loading_horizon)
        )));
    }
    if c.resume && c.overwrite {
        return Err(LlamaError::Config(format!(
            "{} and {}: continue the run in {} or replace it, not both",
            said("resume", &true),
            said("overwrite", &true),
            c.out_dir.display()
        )));
    }
    if let Some(t) = c.peak_tflops
        && !(t.is_finite() && t > 0.0)
    {
        return Err(LlamaError::Config(format!(
            "{}: a peak of positive TFLOP/s",
            said("peak_tflops", &t)
        )));
    }
    if source("export_hf") == Source::Default {
        c.export_hf = Some(c.out_dir.join("hf"));
    }
    if source("parallel.param_dtype") == Source::Default {
        c.parallel.param_dtype = if c.device == "cuda" {
            Precision::Bf16
        } else {
            Precision::F32
        };
    }
    c.kernels
        .apply(KernelConfig::default())
        .map_err(|e| match (e, file) {
            (LlamaError::Config(m), Some(f))
                if sources.keys().any(|k| k.starts_with("kernels.")) =>
            {
                LlamaError::Config(format!("{}: {m}", f.display()))
            }
            (e, _) => e,
        })?;
    Ok(())
}

/// The model shape of a run: from the Hugging Face directory, else the preset with the
/// tokenizer's vocabulary for the small shapes.
pub fn model_config(cfg: &TrainConfig, tokenizer_vocab: usize) -> Result<LlamaConfig> {
    if let Some(dir) = &cfg.init_from_hf {
        let model = hf::read_hf_config(dir)?;
        // A token id past the embedding's rows would panic at the first lookup.
        if tokenizer_vocab > model.vocab_size {
            return Err(LlamaError::Config(format!(
                "the tokenizer has {tokenizer_vocab} tokens but the model in {} has vocab_size \
                 {}: use the tokenizer that came with that model (its tokenizer.json)",
                dir.display(),
                model.vocab_size
            )));
        }
        return Ok(model);
    }
    let mut model = LlamaConfig::preset(&cfg.model)?;
    if matches!(cfg.model.as_str(), "tiny" | "small") {
        model.vocab_size = tokenizer_vocab;
    }
    if let Some(layers) = cfg.layers {
        if layers == 0 {
            return Err(LlamaError::Config("layers must be at least 1".into()));
        }
        model.num_hidden_layers = layers;
    }
    if tokenizer_vocab > model.vocab_size {
        return Err(LlamaError::Config(format!(
            "the tokenizer has {tokenizer_vocab} tokens but model '{}' has vocab_size {}",
            cfg.model, model.vocab_size
        )));
    }
    model.max_position_embeddings = model.max_position_embeddings.max(cfg.seq_len);
    Ok(model)
}

/// The tokenizer and packed data shared by every rank of a process.
#[derive(Debug)]
pub struct Prepared {
    /// The run's configuration.
    pub config: TrainConfig,
    /// The model's shape.
    pub model: LlamaConfig,
    /// The tokenizer (trained on the corpus, loaded from a file or from the checkpoint).
    pub tokenizer: TextTokenizer,
    /// Packed train and validation windows.
    pub dataset: TokenDataset,
}

impl Prepared {
    /// The token after which rows are cut into documents, with `document_masking`.
    fn document_separator(&self) -> Option<u32> {
        self.config
            .document_masking
            .then(|| self.tokenizer.eos_id())
    }
}

/// Loads the corpus and the tokenizer (training a byte-level BPE when none is given) and packs
/// the data. On resume the checkpoint's own tokenizer is used, so token ids stay the same.
pub fn prepare(config: TrainConfig) -> Result<Prepared> {
    check_values(&config)?;
    check_output_is_free(&config)?;
    check_outputs_writable(&config)?;
    let texts = crate::data::load_texts(
        &crate::data::DataSource::from_arg(&config.data),
        &config.text_field,
    )?;
    let resume_tok = if config.resume {
        latest_checkpoint(&config.out_dir)?.map(|dir| dir.join("tokenizer.json"))
    } else {
        None
    };
    let tokenizer = match (&resume_tok, &config.tokenizer, &config.init_from_hf) {
        (Some(saved), Some(given), _) => {
            let tokenizer = TextTokenizer::from_file(saved)?;
            check_same_tokenizer(&tokenizer, saved, &TextTokenizer::from_file(given)?, given)?;
            tokenizer
        }
        (Some(path), _, _) | (None, Some(path), _) => TextTokenizer::from_file(path)?,
        (None, None, Some(dir)) if dir.join("tokenizer.json").exists() => {
            TextTokenizer::from_file(dir.join("tokenizer.json"))?
        }
        _ => TextTokenizer::train_byte_level_bpe(
            texts.iter().map(String::as_str),
            config.vocab_size,
        )?,
    };
    let model = model_config(&config, tokenizer.vocab_size())?;
    let dataset = TokenDataset::from_texts(
        &texts,
        &tokenizer,
        config.seq_len,
        config.val_fraction,
        config.seed,
    )?;
    Ok(Prepared {
        config,
        model,
        tokenizer,
        dataset,
    })
}

/// Refuses to resume with a `--tokenizer` other than the checkpoint's: the model's embedding
/// rows are indexed by the checkpoint's token ids, so another vocabulary would feed it other
/// tokens under the same numbers. Two tokenizers are the same here when their vocabularies
/// (token to id, added tokens included) are.
fn check_same_tokenizer(
    saved: &TextTokenizer,
    saved_path: &Path,
    given: &TextTokenizer,
    given_path: &Path,
) -> Result<()> {
    let (a, b) = (saved.inner().get_vocab(true), given.inner().get_vocab(true));
    if a == b {
        return Ok(());
    }
    let differing = a.iter().filter(|(t, id)| b.get(*t) != Some(id)).count()
        + b.keys().filter(|t| !a.contains_key(*t)).count();
    Err(LlamaError::Config(format!(
        "--tokenizer {} ({} tokens) is not the tokenizer of the checkpoint being resumed ({}, {} \
         tokens; {differing} tokens differ): the model's embeddings are indexed by the \
         checkpoint's token ids. Resume without --tokenizer (the checkpoint's is used), or start \
         a fresh run",
        given_path.display(),
        b.len(),
        saved_path.display(),
        a.len()
    )))
}

/// What a finished run reports.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Summary {
    /// Optimizer steps completed.
    pub steps: u64,
    /// Last training loss.
    pub final_loss: f64,
    /// Last validation loss.
    pub final_val_loss: Option<f64>,
    /// Entropy of the train tokens' unigram distribution (nats/token): the no-context baseline.
    pub unigram_entropy: f64,
    /// Mean tokens/s over the run (all ranks).
    pub tokens_per_sec: f64,
    /// Generated text, if asked.
    pub sample: Option<String>,
    /// Per-step training losses of this run (for tests and plots).
    pub losses: Vec<f64>,
}

/// The micro-batch of `batch` on `device`; with `document_separator`, its rows cut into
/// documents after each such token, and the separator's own target (the next document's first
/// token, which nothing it may attend to predicts) left out of the loss, as Megatron-LM's
/// `--eod-mask-loss` and Hugging Face's flattening collator do.
fn micro_batch<B: AutodiffBackend>(
    batch: &Batch,
    document_separator: Option<u32>,
    device: &B::Device,
) -> Result<MicroBatch<B>> {
    let shape = [batch.batch, batch.seq_len];
    let tokens = Tensor::from_data(TensorData::new(batch.inputs.clone(), shape), device);
    let mut targets = batch.targets.clone();
    if let Some(separator) = document_separator {
        for (target, &input) in targets.iter_mut().zip(&batch.inputs) {
            if input == separator as i64 {
                *target = smp_burn::ops::IGNORE_INDEX;
            }
        }
    }
    let targets = Tensor::from_data(TensorData::new(targets, shape), device);
    Ok(match document_separator {
        Some(separator) => MicroBatch::packed(
            tokens,
            targets,
            Documents::after_separator(
                &batch.inputs,
                batch.batch,
                batch.seq_len,
                separator as i64,
            )?,
        ),
        None => (tokens, targets).into(),
    })
}

/// What document masking does to the first micro-batch: documents per row and the share of
/// attention's work left. A corpus of one document (the embedded one) gets a warning: then the
/// masking changes nothing.
fn log_packing(documents: &Documents) {
    let rows = documents.batch();
    let count = documents.cu_seqlens().len() - 1;
    if documents.is_packed() {
        tracing::info!(
            "document masking: {:.1} documents per row in the first micro-batch; attention \
             does {:.0} % of the unmasked rows' work",
            count as f64 / rows as f64,
            documents.attention_share() * 100.0
        );
    } else {
        tracing::warn!(
            "document masking: no row of the first micro-batch holds more than one document \
             (documents end at </s>; the embedded corpus is one document), so the masking \
             changes nothing there"
        );
    }
}

/// Micro-batches per optimizer step for the requested global batch.
pub fn accumulation_steps(cfg: &TrainConfig, dp_size: usize) -> Result<usize> {
    let per_micro = cfg.micro_batch * cfg.seq_len * dp_size;
    if cfg.global_batch_tokens == 0 {
        return Ok(1);
    }
    if !cfg.global_batch_tokens.is_multiple_of(per_micro) {
        return Err(LlamaError::Config(format!(
            "global_batch_tokens {} is not a multiple of micro_batch {} x seq_len {} x data-parallel ranks {dp_size} = {per_micro}",
            cfg.global_batch_tokens, cfg.micro_batch, cfg.seq_len
        )));
    }
    Ok(cfg.global_batch_tokens / per_micro)
}

/// Checks that the training split holds at least one optimizer step's sequences: with fewer,
/// every batch would repeat windows within itself (the loader wraps into the next epoch), and
/// the losses and the summary would describe a few sequences seen many times.
pub fn check_data_fills_a_batch(prepared: &Prepared, dp_size: usize, accum: usize) -> Result<()> {
    let cfg = &prepared.config;
    let rows = cfg.micro_batch * dp_size * accum;
    let windows = prepared.dataset.train_windows();
    if windows >= rows {
        return Ok(());
    }
    Err(LlamaError::Data(format!(
        "the training split has {windows} sequences of seq_len {} ({} tokens of data; \
         val_fraction {} holds back {} more), fewer than one step's global batch of {rows} \
         (micro_batch {} x {dp_size} data-parallel ranks x {accum} accumulation steps): each step \
         would repeat sequences; use more data, a shorter seq_len or a smaller batch",
        cfg.seq_len,
        prepared.dataset.tokens().len(),
        cfg.val_fraction,
        prepared.dataset.val_windows(),
        cfg.micro_batch,
    )))
}

/// Checks that the run's `tensor_parallel_degree` splits its sequences (`seq_len`) and the
/// model (heads, key/value heads, MLP width); each error names the values. Nothing to check
/// without tensor parallelism.
pub fn check_tensor_parallel(cfg: &TrainConfig, model: &LlamaConfig) -> Result<()> {
    let tp = cfg.parallel.tensor_parallel_degree.max(1);
    if tp == 1 {
        return Ok(());
    }
    smp_burn::tp::split_len("seq_len", cfg.seq_len, tp)?;
    model.validate_tensor_parallel(tp)
}

/// Trains one rank. Every rank of the job calls this with the same `prepared` data; rank 0
/// writes files and shows progress. `peak_flops` is the device's peak for MFU (None on CPU).
pub fn train_rank<B: AutodiffBackend>(
    prepared: &Prepared,
    mesh: Mesh<B::InnerBackend>,
    device: &B::Device,
    peak_flops: Option<f64>,
    memory_in_use: &dyn Fn() -> Option<u64>,
) -> Result<Summary> {
    let cfg = &prepared.config;
    let rank = mesh.rank();
    let lead = rank == 0;
    let world = mesh.world_size();
    let dims = ParallelDims::new(&cfg.parallel, world)?;
    check_tensor_parallel(cfg, &prepared.model)?;
    let accum = accumulation_steps(cfg, mesh.dp_size())?;
    let global_micro = cfg.micro_batch * mesh.dp_size();
    let tokens_per_step = (global_micro * accum * cfg.seq_len) as u64;
    check_data_fills_a_batch(prepared, mesh.dp_size(), accum)?;

    // Model: from a checkpoint, from Hugging Face weights, or from the seed.
    let clip = (cfg.grad_clip > 0.0).then_some(cfg.grad_clip);
    let build = |init: Init<'_>| {
        let how = Build {
            init,
            adamw: cfg.adamw,
            max_grad_norm: clip,
        };
        build::<B>(&prepared.model, &mesh, device, how)
    };
    let resumed = if cfg.resume {
        resume_from_checkpoint(prepared, &mesh, &build)?
    } else {
        None
    };
    let (mut model, mut start_step, mut position) = match resumed {
        Some(state) => state,
        None => {
            let model = match &cfg.init_from_hf {
                Some(hf_dir) => {
                    let weights = load_checked(hf_dir, &prepared.model)?;
                    build(Init::source(reader_source(&weights)))?
                }
                None => build(seeded_init(cfg.seed))?,
            };
            (model, 0, DataPosition::default())
        }
    };
    let mut checkpointer = cfg.checkpoints.then(|| {
        Checkpointer::new(cfg.out_dir.join("checkpoints"), mesh.world().clone())
            .keep(cfg.keep_checkpoints)
    });
    let unigram = prepared.dataset.unigram_entropy();
    let flops_per_token = prepared.model.flops_per_token(cfg.seq_len);

    if cfg.overwrite && !cfg.resume && lead {
        clear_previous_run(&cfg.out_dir)?;
    }
    std::fs::create_dir_all(&cfg.out_dir).map_err(|e| LlamaError::io(&cfg.out_dir, e))?;
    let metrics_path = cfg.out_dir.join("metrics.jsonl");
    let mut metrics = if lead {
        Some(if start_step > 0 {
            MetricsLog::resume(&metrics_path, start_step)?
        } else {
            MetricsLog::create(&metrics_path)?
        })
    } else {
        None
    };
    if lead {
        let n = prepared.model.num_parameters();
        tracing::info!(
            "model: {:.2}M parameters ({} layers, hidden {}), {} ranks ({} replica x {} shard x {} tensor), \
             {accum} micro-batch(es) of {} x {} tokens per data-parallel rank per step ({tokens_per_step} tokens/step); \
             {} train / {} validation windows; unigram baseline {unigram:.3} nats; \
             {} of {} layers recompute their forward in the backward (activation checkpointing){}",
            n as f64 / 1e6,
            prepared.model.num_hidden_layers,
            prepared.model.hidden_size,
            world,
            dims.replicate,
            dims.shard,
            dims.tensor,
            cfg.micro_batch,
            cfg.seq_len,
            prepared.dataset.train_windows(),
            prepared.dataset.val_windows(),
            cfg.parallel
                .checkpointing()
                .recomputed_layers(prepared.model.num_hidden_layers),
            prepared.model.num_hidden_layers,
            match cfg.parallel.offloading_horizon() {
                Some(h) =>
                    format!(", their inputs offloaded to host memory (loading horizon {h} layers)"),
                None => String::new(),
            },
        );
        tracing::info!("plan: {}", model.plan_summary());
    }
    // Every rank reports its own share: with sharding it is 1/shard-degree of the whole.
    tracing::info!(
        "rank {rank}: fp32 weights, gradients and AdamW state held: {:.1} MB{}",
        model.state_bytes() as f64 / 1e6,
        memory_in_use()
            .map(|m| format!(
                "; memory in use after init: {:.1} GiB",
                m as f64 / (1u64 << 30) as f64
            ))
            .unwrap_or_default()
    );

    // Found out now, not after the last step: a validation split smaller than one global batch
    // (tiny corpora, long sequences, many ranks) would otherwise fail the run at its end.
    let val_global = cfg.micro_batch * mesh.dp_size();
    let can_evaluate = prepared.dataset.val_windows() >= val_global;
    if !can_evaluate && lead {
        tracing::warn!(
            "evaluation is off: the validation split has {} windows, fewer than one global batch \
             of {val_global} ({} per rank x {} data-parallel ranks); raise val_fraction or use \
             more data",
            prepared.dataset.val_windows(),
            cfg.micro_batch,
            mesh.dp_size()
        );
    }
    let bar = (lead && cfg.progress).then(|| {
        let bar = indicatif::ProgressBar::new(cfg.steps);
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{bar:30} {pos}/{len} [{elapsed_precise}<{eta_precise}] {msg}",
            )
            .expect("valid template"),
        );
        bar.set_position(start_step);
        bar
    });
    // indicatif draws nothing when stderr is not a terminal (logs, CI, `| tee`): fall back to
    // log lines then, about 40 per run unless progress was turned off explicitly (every step).
    let bar = bar.filter(|b| !b.is_hidden());
    let log_every = if cfg.progress {
        (cfg.steps / 40).max(1)
    } else {
        1
    };

    let mut train_curve = Vec::new();
    let mut val_curve = Vec::new();
    let mut losses = Vec::new();
    let mut last_val = None;
    let mut last_loss = f64::NAN;
    let run_start = Instant::now();
    let mut tokens_done = 0u64;
    let mut pending: Option<PendingStep> = None;
    // Which steps end with an evaluation or a checkpoint (1-based step counts).
    let evaluates = |done: u64| {
        can_evaluate
            && (done == cfg.steps
                || (cfg.eval_interval > 0 && done.is_multiple_of(cfg.eval_interval)))
    };
    // `checkpoints = false` wins over an interval: a throughput run that inherits an interval
    // from a config file must not spend minutes writing a large model.
    let saves = |done: u64| {
        cfg.checkpoints
            && (done == cfg.steps
                || (cfg.checkpoint_interval > 0 && done.is_multiple_of(cfg.checkpoint_interval)))
    };
    if lead && !cfg.checkpoints && cfg.checkpoint_interval > 0 {
        tracing::warn!(
            "checkpoint_interval {} is ignored: checkpoints are off (--no-checkpoint)",
            cfg.checkpoint_interval
        );
    }

    let mut offload_reported = false;
    let mut packing_reported = false;
    let separator = prepared.document_separator();
    while start_step < cfg.steps {
        let step = start_step;
        let t0 = Instant::now();
        let lr = cfg.lr_at(step);
        let mut micro_batches = Vec::with_capacity(accum);
        for _ in 0..accum {
            let batch = prepared.dataset.next_batch_for_rank(
                &mut position,
                global_micro,
                mesh.dp_rank(),
                mesh.dp_size(),
            )?;
            micro_batches.push(micro_batch::<B>(&batch, separator, device)?);
        }
        if lead
            && !packing_reported
            && let Some(documents) = &micro_batches[0].documents
        {
            packing_reported = true;
            log_packing(documents);
        }
        // The step's loss is the mean over its scored targets, however they fall into ranks
        // and micro-batches (the separators' targets are not scored under document masking).
        let scale = model.per_scored_target(&micro_batches)?;
        for (micro, micro_batch) in micro_batches.into_iter().enumerate() {
            model.forward_backward(micro_batch, scale.clone(), micro + 1 == accum)?;
            if lead && !offload_reported && model.offloaded_bytes() > 0 {
                offload_reported = true;
                tracing::info!(
                    "activation offloading: {:.1} MiB of layer inputs per micro-batch in host \
                     memory (rank 0)",
                    model.offloaded_bytes() as f64 / (1u64 << 20) as f64
                );
            }
        }
        // The host returns from queuing forward and backward long before the GPU finishes them
        // unless the step is host-bound: this against the step time tells which one it is.
        let issued = t0.elapsed().as_secs_f64();
        // The previous step's numbers: their copies were queued behind that step's work, long
        // done by now, so this does not wait for the work just queued (see `smp_burn::readback`).
        let mut ready = Vec::with_capacity(2);
        if let Some(prev) = pending.take() {
            ready.push(prev.finish(t0)?);
        }
        let stats = model.step(lr)?;
        start_step += 1;
        let this = PendingStep {
            step: start_step,
            lr,
            started: t0,
            issued,
            loss: smp_burn::readback::read_later(stats.loss)?,
            grad_norm: smp_burn::readback::read_later(stats.grad_norm)?,
            comm: stats.comm,
        };
        // Evaluating, saving and the last step need this step's numbers (and a quiet GPU) now;
        // other steps are reported once the next step's work is queued.
        if evaluates(start_step) || saves(start_step) || start_step == cfg.steps {
            ready.push(this.finish(Instant::now())?);
        } else {
            pending = Some(this);
        }
        for report in ready {
            let StepReport {
                step: reported,
                lr,
                loss,
                grad_norm,
                dt,
                issued,
                comm,
            } = report;
            tokens_done += tokens_per_step;
            last_loss = loss;
            losses.push(loss);
            train_curve.push((reported, loss));
            if !loss.is_finite() {
                return Err(LlamaError::Config(format!(
                    "training diverged at step {reported}: loss {loss}; try a lower learning rate (now {lr:.2e})"
                )));
            }
            let val_loss = if evaluates(reported) {
                Some(evaluate_loss(&mut model, prepared, &mesh, device)?)
            } else {
                None
            };
            if let Some(v) = val_loss {
                last_val = Some(v);
                val_curve.push((reported, v));
            }
            let tokens_per_sec = tokens_per_step as f64 / dt;
            let tflops = flops_per_token * tokens_per_sec / world as f64 / 1e12;
            let mfu = peak_flops.map(|p| tflops * 1e12 / p);
            // Read once: the metrics and the log line report the same figure.
            let mem_bytes = memory_in_use();
            if let Some(m) = metrics.as_mut() {
                m.log(&StepMetrics {
                    step: reported,
                    loss,
                    val_loss,
                    lr,
                    grad_norm,
                    tokens_per_sec,
                    tflops_per_device: tflops,
                    mfu: mfu.unwrap_or(f64::NAN),
                    peak_mem_bytes: mem_bytes,
                    comm_wait_ms: Some(comm.wait.as_secs_f64() * 1e3),
                    comm_device_ms: comm.device.map(|d| d.as_secs_f64() * 1e3),
                    host_issue_ms: Some(issued * 1e3),
                })?;
            }
            if let Some(bar) = &bar {
                let val = val_loss
                    .or(last_val)
                    .map(|v| format!(" val {v:.3}"))
                    .unwrap_or_default();
                bar.set_message(format!(
                    "loss {loss:.3}{val} | {tokens_per_sec:.0} tok/s | lr {lr:.1e}"
                ));
                bar.set_position(reported);
            }
            let eval_step = val_loss.is_some();
            if bar.is_none() && lead && (reported % log_every == 0 || eval_step) {
                tracing::info!(
                    "step {reported}/{}: loss {loss:.4}{} | {:.0} ms (fwd+bwd issued in {:.0}) | {tokens_per_sec:.0} tok/s{} | {:.1} GFLOP/s/device{} | grad norm {:.3} | host in comm calls {:.1} ms{}{}",
                    cfg.steps,
                    val_loss.map(|v| format!(" val {v:.4}")).unwrap_or_default(),
                    dt * 1e3,
                    issued * 1e3,
                    if world > 1 {
                        format!(" ({:.0} per device)", tokens_per_sec / world as f64)
                    } else {
                        String::new()
                    },
                    tflops * 1e3,
                    mfu.map(|m| format!(" | MFU {:.1}%", 100.0 * m))
                        .unwrap_or_default(),
                    grad_norm,
                    comm.wait.as_secs_f64() * 1e3,
                    comm.device
                        .map(|d| format!(" (NCCL device time {:.1} ms)", d.as_secs_f64() * 1e3))
                        .unwrap_or_default(),
                    mem_bytes
                        .map(|b| format!(" | mem {:.1} GiB", b as f64 / (1u64 << 30) as f64))
                        .unwrap_or_default(),
                );
            }
            if saves(reported)
                && let Some(saver) = checkpointer.as_mut()
            {
                let extras = checkpoint_extras(prepared, reported, position)?;
                let started = saver.save(&model, reported, extras)?;
                if lead {
                    tracing::info!(
                        "checkpoint at step {reported}: training waited {:.0} ms ({:.0} ms for \
                         the previous save, {:.0} ms copying {:.1} MB of this rank's shards); \
                         writing in the background",
                        (started.waited + started.blocked).as_secs_f64() * 1e3,
                        started.waited.as_secs_f64() * 1e3,
                        started.blocked.as_secs_f64() * 1e3,
                        started.bytes as f64 / 1e6
                    );
                }
            }
        }
        if let Some(saver) = checkpointer.as_mut()
            && let Some(done) = saver.poll()?
            && lead
        {
            log_committed(&done);
        }
    }
    if let Some(bar) = bar {
        bar.finish();
    }
    if let Some(saver) = checkpointer.as_mut()
        && let Some(done) = saver.finish()?
        && lead
    {
        log_committed(&done);
    }
    let elapsed = run_start.elapsed().as_secs_f64();

    if lead && !train_curve.is_empty() {
        let title = format!(
            "Llama {} on {} — train and validation loss",
            cfg.model, cfg.data
        );
        write_loss_plot_svg(
            cfg.out_dir.join("loss.svg"),
            &train_curve,
            &val_curve,
            &title,
        )?;
    }
    if let Some(dir) = &cfg.export_hf {
        export_hf(&model, prepared, dir, lead)?;
    }
    let sample = match &cfg.sample {
        Some(prompt) => Some(generate(
            &mut model,
            prepared,
            prompt,
            cfg.sample_tokens,
            device,
        )?),
        None => None,
    };
    Ok(Summary {
        steps: start_step,
        final_loss: last_loss,
        final_val_loss: last_val,
        unigram_entropy: unigram,
        tokens_per_sec: tokens_done as f64 / elapsed.max(1e-9),
        sample,
        losses,
    })
}

/// A step whose loss and gradient norm are still on their way from the device.
struct PendingStep {
    /// Steps done once this one is (1-based).
    step: u64,
    lr: f64,
    started: Instant,
    /// Seconds from the start of the step until forward and backward were queued.
    issued: f64,
    loss: smp_burn::readback::PendingRead,
    grad_norm: smp_burn::readback::PendingRead,
    comm: smp_burn::fsdp::CommStats,
}

/// A step's numbers on the host.
struct StepReport {
    step: u64,
    lr: f64,
    loss: f64,
    grad_norm: f64,
    /// Seconds from the step's start to `end` of [`PendingStep::finish`]: the next step's start
    /// for a step reported late, which in steady state is the GPU's time per step.
    dt: f64,
    issued: f64,
    comm: smp_burn::fsdp::CommStats,
}

impl PendingStep {
    /// Waits for the numbers (and reports a failed asynchronous GEMM: the copies ran after it).
    fn finish(self, end: Instant) -> Result<StepReport> {
        let first = |v: Vec<f32>| v.first().copied().map_or(f64::NAN, f64::from);
        let loss = first(self.loss.wait()?);
        let grad_norm = first(self.grad_norm.wait()?);
        #[cfg(feature = "cuda")]
        smp_burn::cuda::gemm::async_error()?;
        Ok(StepReport {
            step: self.step,
            lr: self.lr,
            loss,
            grad_norm,
            dt: end.duration_since(self.started).as_secs_f64(),
            issued: self.issued,
            comm: self.comm,
        })
    }
}

fn evaluate_loss<B: AutodiffBackend>(
    model: &mut LlamaEngine<B>,
    prepared: &Prepared,
    mesh: &Mesh<B::InnerBackend>,
    device: &B::Device,
) -> Result<f64> {
    let cfg = &prepared.config;
    let global = cfg.micro_batch * mesh.dp_size();
    let separator = prepared.document_separator();
    let mut total = 0.0;
    let mut n = 0;
    for batch in prepared
        .dataset
        .val_batches_for_rank(global, mesh.dp_rank(), mesh.dp_size())?
        .take(cfg.eval_batches.max(1))
    {
        total += model.eval_loss(micro_batch::<B>(&batch, separator, device)?)?;
        n += 1;
    }
    if n == 0 {
        return Err(LlamaError::Data(format!(
            "the validation split has {} windows, fewer than one global batch of {global}; raise val_fraction",
            prepared.dataset.val_windows()
        )));
    }
    Ok(total / n as f64)
}

/// Samples `tokens` tokens after `prompt` (temperature 0.8, top-k 40, fixed seed). Every rank
/// runs it in lockstep (the forward gathers parameters); all get the same text.
pub fn generate<B: AutodiffBackend>(
    model: &mut LlamaEngine<B>,
    prepared: &Prepared,
    prompt: &str,
    tokens: usize,
    device: &B::Device,
) -> Result<String> {
    let mut ids: Vec<i64> = prepared
        .tokenizer
        .encode(prompt)?
        .into_iter()
        .map(i64::from)
        .collect();
    let window = prepared.config.seq_len;
    let mut rng = 0x0005_DEEC_E66D_u64 ^ prepared.config.seed;
    for _ in 0..tokens {
        let context = &ids[ids.len().saturating_sub(window)..];
        let input = Tensor::<B, 2, Int>::from_data(
            TensorData::new(context.to_vec(), [1, context.len()]),
            device,
        );
        let logits = model.logits(input)?;
        let vocab = logits.dims()[2];
        let last: Vec<f32> = logits
            .narrow(1, context.len() - 1, 1)
            .reshape([vocab])
            .into_data()
            .convert::<f32>()
            .to_vec()
            .expect("f32 logits");
        let mut top: Vec<(usize, f32)> = last.iter().copied().enumerate().collect();
        top.sort_by(|a, b| b.1.total_cmp(&a.1));
        top.truncate(40);
        let max = top[0].1;
        let weights: Vec<f64> = top
            .iter()
            .map(|(_, l)| (((l - max) / 0.8) as f64).exp())
            .collect();
        let sum: f64 = weights.iter().sum();
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let mut pick = (rng >> 11) as f64 / (1u64 << 53) as f64 * sum;
        let mut chosen = top[0].0;
        for ((id, _), w) in top.iter().zip(&weights) {
            if pick < *w {
                chosen = *id;
                break;
            }
            pick -= w;
        }
        if chosen as u32 == prepared.tokenizer.eos_id() {
            break;
        }
        ids.push(chosen as i64);
    }
    let generated: Vec<u32> = ids.iter().map(|&t| t as u32).collect();
    let text = prepared.tokenizer.decode(&generated)?;
    Ok(text)
}

/// The model, step and data position of the newest intact checkpoint in the run's directory;
/// `None` when there is none to resume. A checkpoint any rank finds damaged (a checksum, a
/// missing or truncated file) is skipped for the next older one, with a warning naming it and
/// why; a checkpoint of another model or data settings is an error (falling back would not
/// help).
fn resume_from_checkpoint<B: AutodiffBackend>(
    prepared: &Prepared,
    mesh: &Mesh<B::InnerBackend>,
    build: &dyn Fn(Init<'_>) -> Result<LlamaEngine<B>>,
) -> Result<Option<(LlamaEngine<B>, u64, DataPosition)>> {
    let cfg = &prepared.config;
    let candidates = committed_checkpoints(&cfg.out_dir.join("checkpoints"));
    let mut skipped = Vec::new();
    for dir in &candidates {
        let state = ResumeState::read(dir)?;
        let changes = state.data_changes(cfg);
        if !changes.is_empty() {
            if !cfg.resume_with_changes {
                return Err(LlamaError::checkpoint(
                    dir,
                    format!(
                        "was written by a run with other data settings ({}); its data position \
                         would mean something else here. Pass --resume-with-changes to \
                         continue anyway, or start afresh",
                        changes.join(", ")
                    ),
                ));
            }
            tracing::warn!("resuming with other data settings: {}", changes.join(", "));
        }
        if state.model != prepared.model {
            return Err(LlamaError::checkpoint(
                dir,
                format!(
                    "was written for model {:?}, this run builds {:?}",
                    state.model, prepared.model
                ),
            ));
        }
        let loaded = ShardedCheckpoint::open(dir)
            .map_err(LlamaError::from)
            .and_then(|ckpt| {
                let mut model = build(Init::source(ckpt.source(StateKind::Weights)))?;
                for kind in [StateKind::ExpAvg, StateKind::ExpAvgSq] {
                    model.load_state(kind, &ckpt.source(kind))?;
                }
                Ok((model, ckpt.bytes_read()))
            });
        // Every rank resumes from the same checkpoint: one rank's damaged file sends all back.
        let mut damaged = [u8::from(loaded.is_err())];
        mesh.world()
            .all_reduce(&mut damaged, ReduceOp::Max)
            .map_err(smp_burn::SmpError::from)?;
        match loaded {
            Ok((mut model, bytes)) if damaged[0] == 0 => {
                if mesh.rank() == 0 {
                    let newest = if skipped.is_empty() {
                        ""
                    } else {
                        ", the newest intact checkpoint"
                    };
                    tracing::info!(
                        "resumed from {} (step {}{newest}); rank 0 read {:.2} GB of it",
                        dir.display(),
                        state.step,
                        bytes as f64 / 1e9
                    );
                }
                model.set_optimizer_steps(state.step);
                return Ok(Some((model, state.step, state.data_position)));
            }
            result => {
                let why = match result {
                    Err(e) => e.to_string(),
                    Ok(_) => "another rank found it damaged (see its log)".into(),
                };
                tracing::warn!(
                    "checkpoint {} cannot be resumed ({why}); trying the next older one",
                    dir.display()
                );
                skipped.push(format!("{}: {why}", dir.display()));
            }
        }
    }
    if skipped.is_empty() {
        return Ok(None);
    }
    Err(LlamaError::Config(format!(
        "--resume: no intact checkpoint in {}: {}",
        cfg.out_dir.join("checkpoints").display(),
        skipped.join("; ")
    )))
}

/// Logs a checkpoint that became visible.
fn log_committed(done: &Committed) {
    tracing::info!(
        "checkpoint {} complete ({:.1} s from the save step to every rank's file synced)",
        done.dir.display(),
        done.write_time.as_secs_f64()
    );
}

/// Opens a checkpoint directory and checks its tensor names and shapes against the model; the
/// values are read later, each rank only its own chunks.
fn load_checked(dir: &Path, config: &LlamaConfig) -> Result<hf::CheckpointReader> {
    let reader = hf::CheckpointReader::open(dir)?;
    hf::check_shapes(
        &crate::model::parameter_shapes(config),
        &reader.shapes(),
        dir,
    )?;
    Ok(reader)
}

/// Full-parameter values from a checkpoint, by Hugging Face name.
fn reader_source(
    reader: &hf::CheckpointReader,
) -> impl Fn(
    &smp_burn::engine::ParamInfo<'_>,
    std::ops::Range<usize>,
) -> std::result::Result<Vec<f32>, smp_burn::SmpError>
+ '_ {
    move |info, range| {
        reader
            .read(info.name, range)
            .map_err(|e| smp_burn::SmpError::Usage(e.to_string()))
    }
}

/// Exports the model as a Hugging Face directory (bf16 by default). Collective; rank 0 writes.
pub fn export_hf<B: AutodiffBackend>(
    model: &LlamaEngine<B>,
    prepared: &Prepared,
    dir: &Path,
    lead: bool,
) -> Result<()> {
    let dtype: SaveDType = prepared.config.export_dtype.parse()?;
    // Rank 0 writes; every rank takes part in gathering one unit at a time. A failure on rank 0
    // is kept until the gathers are done, so that no rank is left waiting in one.
    let mut failure: Option<LlamaError> = None;
    let mut export = None;
    let mut staged = None;
    if lead {
        let specs = model
            .plan()
            .into_iter()
            .map(|p| (p.name, p.shape))
            .collect();
        let started = (|| -> Result<_> {
            let parent = dir.parent().unwrap_or(Path::new("."));
            std::fs::create_dir_all(parent).map_err(|e| LlamaError::io(parent, e))?;
            // The tokenizer is staged beside the export (same file system), removed with `tmp`.
            let tmp = tempfile::Builder::new()
                .prefix(".smp-export-")
                .tempdir_in(parent)
                .map_err(|e| LlamaError::io(parent, e))?;
            prepared.tokenizer.save(tmp.path().join("tokenizer.json"))?;
            let export = hf::HfExport::create(dir, &prepared.model, specs, dtype, 2 << 30)?;
            Ok((tmp, export))
        })();
        match started {
            Ok((tmp, e)) => {
                staged = Some(tmp);
                export = Some(e);
            }
            Err(e) => failure = Some(e),
        }
    }
    model.for_each_gathered(StateKind::Weights, |name, _, values| {
        if let Some(e) = export.as_mut()
            && failure.is_none()
            && let Err(err) = e.push(name, &values)
        {
            failure = Some(err);
        }
        Ok(())
    })?;
    let mut failed = [u8::from(failure.is_some())];
    model
        .mesh()
        .world()
        .all_reduce(&mut failed, ReduceOp::Max)
        .map_err(smp_burn::SmpError::from)?;
    if let Some(e) = failure {
        return Err(e);
    }
    if failed[0] != 0 {
        return Err(LlamaError::Config(format!(
            "the export to {} failed on rank 0 (see its log)",
            dir.display()
        )));
    }
    if !lead {
        return Ok(());
    }
    let tok = staged.as_ref().map(|t| t.path().join("tokenizer.json"));
    export
        .expect("made when nothing failed")
        .finish(tok.as_deref())?;
    tracing::info!("exported a Hugging Face checkpoint to {}", dir.display());
    Ok(())
}

/// What besides tensors a checkpoint records.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainerState {
    /// Optimizer steps completed.
    pub step: u64,
    /// Where the data stream continues.
    pub data_position: DataPosition,
    /// The model shape the checkpoint holds.
    pub model: LlamaConfig,
    /// The configuration of the run that wrote it.
    pub train: TrainConfig,
}

/// The part of a [`TrainerState`] a resumed run reads back. The configuration that wrote the
/// checkpoint is left unread: keys renamed or removed since must not make a checkpoint
/// unresumable, and the resumed run's configuration is its own.
#[derive(Deserialize)]
struct ResumeState {
    step: u64,
    data_position: DataPosition,
    model: LlamaConfig,
    /// The writing run's configuration, read leniently: only the data settings are compared.
    #[serde(default)]
    train: serde_json::Value,
}

impl ResumeState {
    /// The data settings that differ between the checkpoint's run and `cfg`, as
    /// `name: checkpoint's -> this run's`. A checkpoint that does not record one skips it.
    fn data_changes(&self, cfg: &TrainConfig) -> Vec<String> {
        let ours = serde_json::to_value(cfg).unwrap_or_default();
        [
            "seq_len",
            "data",
            "text_field",
            "val_fraction",
            "global_batch_tokens",
            "seed",
        ]
        .iter()
        .filter_map(|key| {
            let (theirs, ours) = (self.train.get(key)?, ours.get(key)?);
            (theirs != ours).then(|| format!("{key}: {theirs} -> {ours}"))
        })
        .collect()
    }

    fn read(dir: &Path) -> Result<Self> {
        let path = dir.join("trainer_state.json");
        let text = std::fs::read_to_string(&path).map_err(|e| LlamaError::io(&path, e))?;
        serde_json::from_str(&text)
            .map_err(|e| LlamaError::checkpoint(&path, format!("unreadable: {e}")))
    }
}

/// Refuses a fresh run whose output directory or export directory holds another run's files
/// (checkpoints, metrics, loss plot, an export), unless the run resumes or overwrites: checked
/// before any work, so that nothing existing is replaced by surprise. Resuming where there is
/// nothing to resume starts afresh, with a warning (a preempted job's first start does that).
fn check_output_is_free(config: &TrainConfig) -> Result<()> {
    if config.resume {
        let root = config.out_dir.join("checkpoints");
        let older_format = std::fs::read_dir(&root).ok().and_then(|entries| {
            entries.flatten().map(|e| e.path()).find(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("step-"))
                    && p.join("trainer_state.json").exists()
                    && !p.join(smp_burn::checkpoint::INDEX_FILE).exists()
            })
        });
        if let Some(old) = older_format
            && latest_checkpoint(&config.out_dir)?.is_none()
        {
            return Err(LlamaError::checkpoint(
                &old,
                "was written by an earlier version (Hugging Face layout, no index.json), which \
                 --resume no longer reads. Convert its weights with `llama2_train convert \
                 <it>/model <new run dir>` (AdamW moments restart at zero) and resume there",
            ));
        }
        if latest_checkpoint(&config.out_dir)?.is_none() {
            tracing::warn!(
                "--resume: {} holds no checkpoint; starting a fresh run",
                config.out_dir.display()
            );
        }
        return Ok(());
    }
    if config.overwrite {
        return Ok(());
    }
    let out = &config.out_dir;
    let mut found: Vec<PathBuf> = ["checkpoints", "metrics.jsonl", "loss.svg"]
        .iter()
        .map(|name| out.join(name))
        .filter(|path| path.exists())
        .collect();
    if let Some(export) = &config.export_hf {
        let used = std::fs::read_dir(export).is_ok_and(|mut entries| entries.next().is_some());
        if used {
            found.push(export.clone());
        }
    }
    if found.is_empty() {
        return Ok(());
    }
    let found: Vec<String> = found.iter().map(|p| p.display().to_string()).collect();
    Err(LlamaError::Config(format!(
        "{} holds another run's files ({}); pass --resume to continue that run, --overwrite to \
         replace it, or choose another --out-dir (and --export-hf)",
        out.display(),
        found.join(", ")
    )))
}

/// Sizes and rates that no run can use, refused by name before any work: zero sizes divide by
/// zero deep inside the data pipeline, and a NaN or negative rate trains nonsense silently.
fn check_values(c: &TrainConfig) -> Result<()> {
    let mut bad = Vec::new();
    for (name, value) in [
        ("steps", c.steps as usize),
        ("seq_len", c.seq_len),
        ("micro_batch", c.micro_batch),
    ] {
        if value == 0 {
            bad.push(format!("{name} = 0 (must be at least 1)"));
        }
    }
    if c.keep_checkpoints == Some(0) {
        bad.push("keep_checkpoints = 0 (keep at least 1, or leave it unset to keep all)".into());
    }
    if c.eval_interval > 0 && c.eval_batches == 0 {
        bad.push("eval_batches = 0 with evaluation on (eval_interval > 0)".into());
    }
    for (name, value) in [
        ("lr", c.lr),
        ("min_lr", c.min_lr),
        ("grad_clip", c.grad_clip),
    ] {
        if !value.is_finite() || value < 0.0 {
            bad.push(format!("{name} = {value} (must be a finite number >= 0)"));
        }
    }
    if c.min_lr > c.lr {
        bad.push(format!("min_lr = {} is above lr = {}", c.min_lr, c.lr));
    }
    if !(0.0..1.0).contains(&c.val_fraction) {
        bad.push(format!(
            "val_fraction = {} (must be in [0, 1))",
            c.val_fraction
        ));
    }
    if bad.is_empty() {
        Ok(())
    } else {
        Err(LlamaError::Config(bad.join("; ")))
    }
}

/// Creates the output directory and writes (then removes) a probe file in it and beside the
/// export directory, so that a path that cannot be written fails now, not at the first
/// checkpoint or at the export after the training time is spent.
fn check_outputs_writable(config: &TrainConfig) -> Result<()> {
    let probe = |dir: &Path, flag: &str| -> Result<()> {
        let fail = |e: std::io::Error| {
            LlamaError::Config(format!(
                "{flag} {}: cannot write there ({e}); choose a writable directory",
                dir.display()
            ))
        };
        std::fs::create_dir_all(dir).map_err(fail)?;
        // Unique per call: ranks that are threads of one process may probe at once.
        static PROBES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = PROBES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let file = dir.join(format!(".smp-write-probe-{}-{n}", std::process::id()));
        std::fs::write(&file, b"").map_err(fail)?;
        std::fs::remove_file(&file).map_err(fail)
    };
    probe(&config.out_dir, "--out-dir")?;
    if let Some(export) = &config.export_hf {
        // The export is written beside its final place and renamed into it.
        let parent = export.parent().filter(|p| !p.as_os_str().is_empty());
        probe(parent.unwrap_or(Path::new(".")), "--export-hf (its parent)")?;
    }
    Ok(())
}

/// Removes what a previous run left in the output directory before an overwriting run starts,
/// so that its checkpoints cannot be mistaken for this run's.
fn clear_previous_run(out_dir: &Path) -> Result<()> {
    for name in ["checkpoints", "metrics.jsonl", "loss.svg"] {
        let path = out_dir.join(name);
        let removed = if path.is_dir() {
            std::fs::remove_dir_all(&path)
        } else if path.exists() {
            std::fs::remove_file(&path)
        } else {
            Ok(())
        };
        removed.map_err(|e| LlamaError::io(&path, e))?;
    }
    Ok(())
}

/// The checkpoint a resume tries first: the one `out_dir/checkpoints/latest` names, else the
/// newest committed one. Older committed checkpoints are the fallbacks
/// ([`smp_burn::checkpoint::committed_checkpoints`]).
pub fn latest_checkpoint(out_dir: &Path) -> Result<Option<PathBuf>> {
    Ok(committed_checkpoints(&out_dir.join("checkpoints"))
        .into_iter()
        .next())
}

/// The small files a checkpoint carries beside the shards: the trainer's state (step, data
/// position, model shape, configuration) and the tokenizer.
fn checkpoint_extras(
    prepared: &Prepared,
    step: u64,
    position: DataPosition,
) -> Result<Vec<(String, Vec<u8>)>> {
    let state = TrainerState {
        step,
        data_position: position,
        model: prepared.model.clone(),
        train: prepared.config.clone(),
    };
    let tokenizer = prepared
        .tokenizer
        .inner()
        .to_string(false)
        .map_err(|e| LlamaError::Config(format!("serializing the tokenizer: {e}")))?;
    Ok(vec![
        (
            "trainer_state.json".into(),
            serde_json::to_vec_pretty(&state).expect("serializable"),
        ),
        ("tokenizer.json".into(), tokenizer.into_bytes()),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A config file in a temporary directory (kept alive with it).
    struct File {
        _dir: tempfile::TempDir,
        path: PathBuf,
    }

    fn file(text: &str) -> File {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("run.toml");
        std::fs::write(&path, text).expect("write the config file");
        File { _dir: dir, path }
    }

    fn args(extra: &[&str]) -> Result<ResolvedConfig> {
        TrainConfig::from_args(std::iter::once("llama2_train").chain(extra.iter().copied()))
    }

    fn with_file(f: &File, extra: &[&str]) -> Result<ResolvedConfig> {
        let path = f.path.to_str().expect("a UTF-8 path");
        args(&[&["--config", path], extra].concat())
    }

    fn config_error(r: Result<ResolvedConfig>) -> String {
        match r {
            Ok(r) => panic!("expected an error, got {:?}", r.config),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn no_flags_give_the_defaults() {
        let r = args(&[]).unwrap();
        assert_eq!(r.config, TrainConfig::default());
        assert!(r.sources.is_empty(), "{:?}", r.sources);
        let d = TrainConfig::default();
        assert_eq!((d.model.as_str(), d.seq_len, d.steps), ("small", 128, 400));
        assert_eq!(d.export_hf, Some(PathBuf::from("runs/llama2/hf")));
        assert!(d.checkpoints && d.progress && !d.parallel.activation_checkpointing);
        assert_eq!(d.parallel.param_dtype, Precision::F32);
        assert_eq!(d.parallel.prefetch_depth, 1);
        assert_eq!(d.kernels, KernelSection::default());
    }

    /// An unknown key is refused with the file, the line, the key and the closest valid key,
    /// also inside a section and for a key written in the wrong table.
    #[test]
    fn unknown_keys_are_named_with_the_closest_key() {
        let f = file("model = \"tiny\"\nstesp = 4\n");
        let e = config_error(with_file(&f, &[]));
        assert!(
            e.contains(&f.path.display().to_string())
                && e.contains("line 2")
                && e.contains("`stesp`")
                && e.contains("did you mean `steps`"),
            "{e}"
        );
        let f = file("[parallel]\ntensor_paralel_degree = 2\n");
        let e = config_error(with_file(&f, &[]));
        assert!(
            e.contains("`tensor_paralel_degree` in [parallel]")
                && e.contains("`parallel.tensor_parallel_degree`"),
            "{e}"
        );
        let f = file("tensor_parallel_degree = 2\n");
        let e = config_error(with_file(&f, &[]));
        assert!(
            e.contains("`parallel.tensor_parallel_degree` (in the [parallel] table)"),
            "{e}"
        );
        let f = file("[paralel]\nprefetch_depth = 0\n");
        let e = config_error(with_file(&f, &[]));
        assert!(e.contains("`paralel`") && e.contains("`parallel`"), "{e}");
        let f = file("[kernels]\ndeterminstic = true\n");
        let e = config_error(with_file(&f, &[]));
        assert!(e.contains("`kernels.deterministic`"), "{e}");
        let f = file("xyzzy = 1\n");
        let e = config_error(with_file(&f, &[]));
        assert!(
            e.contains("`xyzzy`") && e.contains("valid keys here:"),
            "{e}"
        );
    }

    #[test]
    fn wrong_types_name_the_file() {
        let f = file("seq_len = \"long\"\n");
        let e = config_error(with_file(&f, &[]));
        assert!(
            e.contains(&f.path.display().to_string()) && e.contains("seq_len"),
            "{e}"
        );
        let f = file("[kernels]\nflash_forward = \"8x2\"\n");
        let e = config_error(with_file(&f, &[]));
        assert!(e.contains("8x2") && e.contains("mma-8x2"), "{e}");
    }

    /// Default < file < flag, key by key; a section sets the keys it names and no other.
    #[test]
    fn flags_override_the_file_which_overrides_the_defaults() {
        let f = file(
            "steps = 7\nseq_len = 64\ncheckpoint_interval = 5\n\n[parallel]\n\
             tensor_parallel_degree = 2\n\n[kernels]\ndeterministic = true\n\n[adamw]\n\
             eps = 1e-3\nmoments = \"bf16\"\n",
        );
        let r = with_file(&f, &["--steps", "9", "--prefetch-depth", "0"]).unwrap();
        let c = &r.config;
        let d = TrainConfig::default();
        assert_eq!(c.steps, 9, "the flag wins");
        assert_eq!(c.seq_len, 64, "the file wins over the default");
        assert_eq!(c.checkpoint_interval, 5);
        assert_eq!(c.parallel.tensor_parallel_degree, 2);
        assert_eq!(c.parallel.prefetch_depth, 0);
        assert_eq!(c.kernels.deterministic, Some(true));
        assert_eq!(c.adamw.eps, 1e-3);
        assert_eq!(c.adamw.moments, smp_burn::fsdp::MomentDtype::Bf16);
        // Nothing else moved: not the other keys of the sections, not the top-level ones.
        assert_eq!(
            TrainConfig {
                steps: d.steps,
                seq_len: d.seq_len,
                checkpoint_interval: d.checkpoint_interval,
                adamw: d.adamw,
                kernels: d.kernels.clone(),
                parallel: ParallelSection(ParallelConfig {
                    tensor_parallel_degree: 1,
                    prefetch_depth: 1,
                    ..c.parallel.0.clone()
                }),
                ..c.clone()
            },
            d
        );
        assert_eq!(r.source("steps"), Source::Flag);
        assert_eq!(r.source("seq_len"), Source::File);
        assert_eq!(r.source("parallel.prefetch_depth"), Source::Flag);
        assert_eq!(r.source("adamw.eps"), Source::File);
        assert_eq!(r.source("lr"), Source::Default);
        // A flag left at its default does not reset the file's value.
        let r = with_file(&f, &["--seq-len", "128"]).unwrap();
        assert_eq!((r.config.seq_len, r.config.steps), (128, 7));
    }

    #[test]
    fn negative_flags_and_none_values() {
        let f = file("checkpoint_interval = 10\nprogress = true\nexport_hf = \"none\"\n");
        let r = with_file(
            &f,
            &["--no-checkpoint", "--no-progress", "--sample", "none"],
        )
        .unwrap();
        assert!(!r.config.checkpoints && !r.config.progress);
        assert_eq!(r.config.checkpoint_interval, 10);
        assert_eq!(
            (r.config.export_hf.as_ref(), r.config.sample.as_ref()),
            (None, None)
        );
        // A file's `out_dir` moves the default export with it; `--export-hf DIR` sets it.
        let f = file("out_dir = \"/tmp/elsewhere\"\n");
        let r = with_file(&f, &[]).unwrap();
        assert_eq!(r.config.export_hf, Some(PathBuf::from("/tmp/elsewhere/hf")));
        let r = with_file(&f, &["--export-hf", "/tmp/x"]).unwrap();
        assert_eq!(r.config.export_hf, Some(PathBuf::from("/tmp/x")));
        let r = args(&["--deterministic"]).unwrap();
        assert_eq!(r.config.kernels.deterministic, Some(true));
        let r = args(&["--deterministic", "false", "--steps", "3"]).unwrap();
        assert_eq!(r.config.kernels.deterministic, Some(false));
    }

    /// The memory planner's choices (`activation_checkpointing`, `checkpointed_layers`) count
    /// as the user's only where the user set them, in a file as with flags; what they imply
    /// follows, by layer.
    #[test]
    fn recomputation_settings_and_what_they_imply() {
        let f = file("steps = 3\n[parallel]\nprefetch_depth = 0\n");
        let r = with_file(&f, &[]).unwrap();
        assert!(!r.is_explicit("parallel.activation_checkpointing"));
        assert!(!r.is_explicit("parallel.checkpointed_layers"));
        for r in [
            args(&["--checkpointed-layers", "3"]).unwrap(),
            with_file(&file("[parallel]\ncheckpointed_layers = 3\n"), &[]).unwrap(),
        ] {
            assert!(r.is_explicit("parallel.checkpointed_layers"));
            assert!(r.config.parallel.activation_checkpointing);
            assert_eq!(r.config.parallel.checkpointed_layers, Some(3));
        }
        // Offloading implies recomputation without fixing it: the planner still chooses.
        let r = args(&["--activation-offloading"]).unwrap();
        assert!(r.config.parallel.activation_checkpointing);
        assert!(!r.is_explicit("parallel.activation_checkpointing"));
        // Two settings of one layer that contradict each other are refused, naming both.
        let e = config_error(args(&[
            "--checkpointed-layers",
            "3",
            "--activation-checkpointing",
            "false",
        ]));
        assert!(
            e.contains("--checkpointed-layers 3") && e.contains("--activation-checkpointing false"),
            "{e}"
        );
        let e = config_error(args(&[
            "--selective-recompute",
            "--activation-checkpointing",
            "false",
        ]));
        assert!(
            e.contains("--selective-recompute") && e.contains("--activation-checkpointing false"),
            "{e}"
        );
        let r = args(&["--selective-recompute"]).unwrap();
        assert!(r.config.parallel.selective_recompute);
        // `false` said out loud keeps the planner from choosing it.
        let r = args(&["--selective-recompute", "false"]).unwrap();
        assert!(!r.config.parallel.selective_recompute);
        assert!(r.is_explicit("parallel.selective_recompute"));
        assert!(
            !args(&[])
                .unwrap()
                .is_explicit("parallel.selective_recompute")
        );
        let f = file("[parallel]\ncheckpointed_layers = 3\nactivation_checkpointing = false\n");
        let e = config_error(with_file(&f, &[]));
        assert!(
            e.contains("parallel.checkpointed_layers = 3 in")
                && e.contains(&f.path.display().to_string()),
            "{e}"
        );
        // A flag overrides what the file implies, either way.
        let r = with_file(&f, &["--activation-checkpointing", "true"]).unwrap();
        assert!(r.config.parallel.activation_checkpointing);
        let f = file("[parallel]\nactivation_checkpointing = false\n");
        let r = with_file(&f, &["--checkpointed-layers", "2"]).unwrap();
        assert!(r.config.parallel.activation_checkpointing);
        let e = config_error(args(&["--activation-loading-horizon", "3"]));
        assert!(e.contains("--activation-loading-horizon 3"), "{e}");
        let e = config_error(with_file(&file("resume = true\n"), &["--overwrite"]));
        assert!(
            e.contains("--overwrite") && e.contains("resume = true"),
            "{e}"
        );
    }

    #[test]
    fn compute_dtype_follows_the_device_unless_set() {
        let dtype = |a: &[&str]| args(a).unwrap().config.parallel.param_dtype;
        assert_eq!(dtype(&[]), Precision::F32);
        assert_eq!(dtype(&["--device", "cuda"]), Precision::Bf16);
        assert_eq!(
            dtype(&["--device", "cuda", "--param-dtype", "f32"]),
            Precision::F32
        );
        let f = file("device = \"cuda\"\n[parallel]\nparam_dtype = \"f32\"\n");
        assert_eq!(
            with_file(&f, &[]).unwrap().config.parallel.param_dtype,
            Precision::F32
        );
        let e = config_error(with_file(&file("device = \"tpu\"\n"), &[]));
        assert!(e.contains("'tpu'") && e.contains("cpu or cuda"), "{e}");
        assert!(matches!(
            args(&["--param-dtype", "f16"]),
            Err(LlamaError::Usage(_))
        ));
    }

    /// A written configuration reads back to the same run, the derived keys left to derive.
    #[test]
    fn written_config_reads_back() {
        let r = args(&["--device", "cuda", "--steps", "11", "--peak-tflops", "500"]).unwrap();
        let text = r.to_toml();
        let has_key = |k: &str| text.lines().any(|l| l.starts_with(k));
        assert!(!has_key("param_dtype") && !has_key("export_hf"), "{text}");
        assert!(
            text.contains("steps = 11") && text.contains("[parallel]"),
            "{text}"
        );
        let back = with_file(&file(&text), &[]).unwrap();
        assert_eq!(back.config, r.config);
        assert!(!back.is_explicit("parallel.activation_checkpointing"));
        let full = TrainConfig::from_toml_file(&file(&r.config.to_toml()).path).unwrap();
        assert_eq!(full, r.config);
        // A prompt over several lines, one of them looking like a derived key, stays whole.
        let prompt = "KING:\nexport_hf = \"x\"\n[parallel]\nparam_dtype = \"f32\"";
        let r = args(&["--sample", prompt, "--device", "cuda"]).unwrap();
        let back = with_file(&file(&r.to_toml()), &[]).unwrap();
        assert_eq!(back.config.sample.as_deref(), Some(prompt));
        assert_eq!(back.config, r.config);
    }

    /// Every flag is a key of the file, one key per flag, and no two flags share a name.
    #[test]
    fn every_flag_is_one_config_key() {
        let defaults = to_json(&TrainConfig::default()).unwrap();
        let command = TrainArgs::command();
        let mut longs = std::collections::HashSet::new();
        for arg in command.get_arguments() {
            let id = arg.get_id().as_str();
            if let Some(long) = arg.get_long() {
                assert!(longs.insert(long.to_string()), "--{long} twice");
            }
            if matches!(id, "config" | "write_config" | "help") {
                continue;
            }
            let key = flag_key(&defaults, id).unwrap_or_else(|| panic!("flag {id}: no key"));
            let mut leaves = Vec::new();
            leaf_keys(&defaults, "", &mut leaves);
            let same = leaves
                .iter()
                .filter(|k| k.rsplit('.').next() == Some(id))
                .count();
            assert_eq!(same, 1, "{id} names {same} keys ({key:?})");
        }
    }

    #[test]
    fn kernel_section_applies_over_the_environment() {
        let env = KernelConfig::parse("flash_backward=atomic,cache_dir=/tmp/k").unwrap();
        let section = KernelSection {
            fast: Some("gemm+attention".into()),
            ..Default::default()
        };
        let c = section.apply(env.clone()).unwrap();
        assert_eq!(
            c.flash_backward, env.flash_backward,
            "kept from the environment"
        );
        assert_eq!(c.cache_dir, env.cache_dir);
        assert!(c.fast_paths.gemm && c.fast_paths.attention && !c.fast_paths.norm);
        // Deterministic kernels over an environment that asked for a non-deterministic backward
        // contradict each other, and the message says so.
        let det = KernelSection {
            deterministic: Some(true),
            ..Default::default()
        };
        let e = det.apply(env).unwrap_err().to_string();
        assert!(e.contains("atomic") && e.contains("split"), "{e}");
        let bad = KernelSection {
            flash_backward: Some("grid".into()),
            ..Default::default()
        };
        let e = bad.apply(KernelConfig::default()).unwrap_err().to_string();
        assert!(e.contains("grid"), "{e}");
        // FP8: the flag's recipe over the environment's; an unknown recipe is named.
        let fp8 = KernelSection {
            fp8: Some("tensorwise".into()),
            ..Default::default()
        };
        let c = fp8
            .apply(KernelConfig::parse("fp8=delayed").unwrap())
            .unwrap();
        assert_eq!(c.fp8, smp_burn::Fp8Recipe::Tensorwise);
        let bad = KernelSection {
            fp8: Some("e4m3".into()),
            ..Default::default()
        };
        let e = bad.apply(KernelConfig::default()).unwrap_err().to_string();
        assert!(e.contains("e4m3") && e.contains("tensorwise"), "{e}");
    }

    /// The example of docs/configuration.md is a valid configuration, with the derived
    /// settings the page says.
    #[test]
    fn documented_example_reads() {
        let page = include_str!("../../../docs/configuration.md");
        let example = page
            .split("```toml\n")
            .nth(1)
            .and_then(|rest| rest.split("```").next())
            .expect("a TOML example");
        let r = with_file(&file(example), &[]).unwrap();
        assert_eq!(r.config.model, "7b");
        assert_eq!(r.config.export_hf, Some(PathBuf::from("runs/7b/hf")));
        assert_eq!(r.config.parallel.param_dtype, Precision::Bf16);
        assert!(!r.is_explicit("parallel.activation_checkpointing"));
        assert_eq!(r.config.kernels.deterministic, Some(true));
    }

    #[test]
    fn edit_distance_counts_edits() {
        assert_eq!(edit_distance("steps", "steps"), 0);
        assert_eq!(edit_distance("stesp", "steps"), 1);
        assert_eq!(edit_distance("sed", "seed"), 1);
        assert_eq!(edit_distance("lr", "min_lr"), 4);
        assert_eq!(edit_distance("", "abc"), 3);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(
            closest("warmup", ["warmup_steps", "lr"].into_iter()),
            Some("warmup_steps")
        );
        assert_eq!(closest("zzz", ["steps", "seed"].into_iter()), None);
    }
}
