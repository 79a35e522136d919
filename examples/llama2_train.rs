//! Train Llama 2 on text: on the CPU by default (the embedded Shakespeare corpus, a small model,
//! a few minutes), on every visible GPU with `--device cuda`.
//!
//! ```text
//! cargo run --release --example llama2_train                          # CPU, defaults
//! cargo run --release --example llama2_train -- --nproc-per-node 2    # 2 CPU thread-ranks, sharded
//! llama2_train --device cuda --model 1b --seq-len 4096 --micro-batch 1 # every visible GPU
//! smp-run --nproc-per-node 8 -- llama2_train --device cuda ...        # one process per GPU
//! ```
//!
//! MFU follows DESIGN.md: FLOPs per token `6 * N + 12 * L * H * S` (N = parameters outside the
//! token embedding, LM head included), against 989.4 TFLOP/s dense bf16 per H100/H200.

use std::path::PathBuf;
use std::sync::Arc;

use burn::backend::{Autodiff, NdArray};
use clap::Parser;
use collectives::{CommOptions, Communicator, RendezvousConfig, run_on_threads};
use llama::train::{self, Prepared, Summary, TrainConfig};
use smp_burn::mesh::Mesh;
use smp_burn::{ParallelDims, Precision};

#[derive(Parser, Debug)]
#[command(
    about = "Train Llama 2 with smp-burn (sharded data and tensor parallelism on CPU threads or GPUs)"
)]
struct Cli {
    /// Read the run's configuration from a TOML file (command-line flags override it).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Write the effective configuration to this TOML file and exit.
    #[arg(long)]
    write_config: Option<PathBuf>,
    /// `cpu` (NdArray backend, f32) or `cuda` (Burn's CUDA backend; see `--param-dtype`).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Ranks to run in this process: CPU thread-ranks, or GPUs (default: every visible GPU).
    /// Ignored when launched by smp-run, torchrun or Slurm (RANK / SLURM_PROCID set).
    #[arg(long)]
    nproc_per_node: Option<usize>,
    /// Model preset: tiny, small, 1b, 7b, 13b, 70b.
    #[arg(long)]
    model: Option<String>,
    /// Tokens per sequence.
    #[arg(long)]
    seq_len: Option<usize>,
    /// Override the preset's number of decoder layers.
    #[arg(long)]
    layers: Option<usize>,
    /// Sequences per data-parallel rank per micro-batch (a tensor-parallel group shares them).
    #[arg(long)]
    micro_batch: Option<usize>,
    /// Tokens per optimizer step over all ranks (gradient accumulation fills it).
    #[arg(long)]
    global_batch_tokens: Option<usize>,
    /// Optimizer steps.
    #[arg(long)]
    steps: Option<u64>,
    /// Peak learning rate.
    #[arg(long)]
    lr: Option<f64>,
    /// Warmup steps.
    #[arg(long)]
    warmup_steps: Option<u64>,
    /// Seed of initialization and data order.
    #[arg(long)]
    seed: Option<u64>,
    /// `embedded` (Shakespeare) or a text file, `.gz`, directory or JSONL file.
    #[arg(long)]
    data: Option<String>,
    /// A tokenizer.json to use instead of training a BPE tokenizer on the corpus.
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Vocabulary size of the trained tokenizer.
    #[arg(long)]
    vocab_size: Option<usize>,
    /// Output directory (metrics.jsonl, loss.svg, checkpoints/).
    #[arg(long)]
    out_dir: Option<PathBuf>,
    /// Save a checkpoint every N steps (always at the end).
    #[arg(long)]
    checkpoint_interval: Option<u64>,
    /// Evaluate every N steps (always at the end).
    #[arg(long)]
    eval_interval: Option<u64>,
    /// Continue from the latest checkpoint in the output directory.
    #[arg(long)]
    resume: bool,
    /// Start afresh in an output directory that holds another run, replacing its checkpoints,
    /// metrics and export (without it, or --resume, that is refused).
    #[arg(long, conflicts_with = "resume")]
    overwrite: bool,
    /// Write no checkpoints (throughput runs of large models).
    #[arg(long)]
    no_checkpoint: bool,
    /// Start from a Hugging Face Llama checkpoint directory.
    #[arg(long)]
    init_from_hf: Option<PathBuf>,
    /// Export a Hugging Face checkpoint here at the end (`none` to skip).
    #[arg(long)]
    export_hf: Option<String>,
    /// Generate text from this prompt at the end (`none` to skip).
    #[arg(long)]
    sample: Option<String>,
    /// Shard parameters across groups of this many ranks and replicate across groups (0 = all).
    #[arg(long)]
    hybrid_shard_degree: Option<usize>,
    /// Split each decoder layer across this many ranks (Megatron-style tensor parallelism with
    /// sequence parallelism; 1 = off). Must divide the world size, `--seq-len`, the heads, the
    /// key/value heads and the MLP width; FSDP then shards across the remaining ranks.
    #[arg(long)]
    tensor_parallel_degree: Option<usize>,
    /// Start the next unit's all-gather before the current unit runs (1, the default) or not
    /// (0). On CUDA the gather, and in the backward the reduce-scatter, then run beside the
    /// compute: 7B on 2 H200s 432-439 against 459-463 ms per step.
    #[arg(long)]
    prefetch_depth: Option<usize>,
    /// Recompute each block in the backward pass instead of storing its activations. On CUDA
    /// the default recomputes as few layers as fit the GPU (see `--checkpointed-layers`).
    #[arg(long)]
    activation_checkpointing: Option<bool>,
    /// Recompute only the first N decoder layers, keeping the others' activations (implies
    /// `--activation-checkpointing true`; at least the number of layers means all).
    #[arg(long)]
    checkpointed_layers: Option<usize>,
    /// Keep the input of each recomputed layer in host memory between its forward and its
    /// backward (SMP's activation offloading). Implies `--activation-checkpointing true`. On
    /// CUDA without `--checkpointed-layers`, the layers to recompute are chosen with the
    /// offloaded inputs left out of the memory estimate. Results are unchanged.
    #[arg(long)]
    activation_offloading: bool,
    /// With `--activation-offloading`, how many layers ahead of its backward a layer's input is
    /// brought back (default 2).
    #[arg(long)]
    activation_loading_horizon: Option<usize>,
    /// Bitwise reproducible CUDA kernels: the attention backward then sums dQ without atomics
    /// at every head dim (7B steps about 1-4 % slower). The same as
    /// `SMP_BURN_DETERMINISTIC=1`; CPU runs are always deterministic.
    #[arg(long)]
    deterministic: bool,
    /// Compute dtype on CUDA: `bf16` (default; fp32 master weights and optimizer state) or
    /// `f32`.
    #[arg(long)]
    param_dtype: Option<String>,
    /// Hide the progress bar.
    #[arg(long)]
    no_progress: bool,
}

fn build_config(cli: &Cli) -> Result<TrainConfig, Box<dyn std::error::Error>> {
    let mut c = match &cli.config {
        Some(path) => TrainConfig::from_toml_file(path)?,
        None => TrainConfig::default(),
    };
    macro_rules! set {
        ($($field:ident),*) => { $( if let Some(v) = cli.$field.clone() { c.$field = v; } )* };
    }
    set!(
        model,
        seq_len,
        micro_batch,
        global_batch_tokens,
        steps,
        lr,
        warmup_steps,
        seed,
        data,
        vocab_size,
        out_dir,
        checkpoint_interval,
        eval_interval
    );
    if cli.layers.is_some() {
        c.layers = cli.layers;
    }
    if cli.tokenizer.is_some() {
        c.tokenizer = cli.tokenizer.clone();
    }
    if cli.init_from_hf.is_some() {
        c.init_from_hf = cli.init_from_hf.clone();
    }
    if cli.resume {
        c.resume = true;
    }
    if cli.overwrite {
        c.overwrite = true;
    }
    if cli.no_checkpoint {
        c.checkpoints = false;
    }
    if cli.no_progress {
        c.progress = false;
    }
    match cli.export_hf.as_deref() {
        Some("none") => c.export_hf = None,
        Some(dir) => c.export_hf = Some(dir.into()),
        None if cli.out_dir.is_some() => c.export_hf = Some(c.out_dir.join("hf")),
        None => {}
    }
    match cli.sample.as_deref() {
        Some("none") => c.sample = None,
        Some(p) => c.sample = Some(p.into()),
        None => {}
    }
    if let Some(k) = cli.hybrid_shard_degree {
        c.parallel.hybrid_shard_degree = k;
    }
    if let Some(tp) = cli.tensor_parallel_degree {
        c.parallel.tensor_parallel_degree = tp;
    }
    if let Some(d) = cli.prefetch_depth {
        c.parallel.prefetch_depth = d;
    }
    if let Some(a) = cli.activation_checkpointing {
        c.parallel.activation_checkpointing = a;
    }
    if let Some(n) = cli.checkpointed_layers {
        if cli.activation_checkpointing == Some(false) {
            return Err(format!(
                "--checkpointed-layers {n} asks for recomputation, --activation-checkpointing \
                 false turns it off: give one of them"
            )
            .into());
        }
        c.parallel.activation_checkpointing = true;
        c.parallel.checkpointed_layers = Some(n);
    }
    if cli.activation_offloading {
        if cli.activation_checkpointing == Some(false) {
            return Err(
                "--activation-offloading moves the inputs that recomputed layers keep, \
                 --activation-checkpointing false turns recomputation off: give one of them"
                    .into(),
            );
        }
        c.parallel.activation_offloading = true;
        c.parallel.activation_checkpointing = true;
    }
    if let Some(h) = cli.activation_loading_horizon {
        if !c.parallel.activation_offloading {
            return Err(format!(
                "--activation-loading-horizon {h} needs --activation-offloading (or \
                 activation_offloading = true in the config file)"
            )
            .into());
        }
        c.parallel.activation_loading_horizon = h;
    }
    if cli.device == "cuda" {
        c.parallel.param_dtype = match cli.param_dtype.as_deref() {
            None | Some("bf16") => Precision::Bf16,
            Some("f32") => Precision::F32,
            Some(other) => return Err(format!("--param-dtype {other}: use bf16 or f32").into()),
        };
    }
    Ok(c)
}

/// How many decoder layers to recompute so that the run fits one GPU
/// (`LlamaConfig::layers_to_recompute`, from the memory estimate); all of them when the device
/// cannot be asked.
#[cfg(feature = "cuda")]
fn layers_to_recompute(config: &TrainConfig, dims: &ParallelDims) -> Result<usize, DynError> {
    let model = train::model_config(config, 1)?;
    let layers = model.num_hidden_layers;
    let tokens = config.micro_batch * config.seq_len;
    let Some(have) = smp_burn::cuda::cuda_device_memory(0) else {
        return Ok(layers);
    };
    let horizon = config.parallel.offloading_horizon();
    let recomputed = model.layers_to_recompute(tokens, dims.shard, dims.tensor, horizon, have);
    let need = |n| model.training_memory_estimate(tokens, dims.shard, dims.tensor, n, horizon);
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    tracing::info!(
        "activation checkpointing: recomputing {recomputed} of {layers} layers; this run needs \
         about {:.0} GiB per GPU ({:.0} GiB recomputing none), {:.0} GiB is {} % of the GPU \
         (--activation-checkpointing and --checkpointed-layers override)",
        gib(need(recomputed)),
        gib(need(0)),
        gib(have / 100 * llama::config::MEMORY_BUDGET_PERCENT),
        llama::config::MEMORY_BUDGET_PERCENT
    );
    Ok(recomputed)
}

/// Peak resident memory of this process (CPU runs), from /proc.
fn peak_rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

type DynError = Box<dyn std::error::Error + Send + Sync>;

fn run_cpu_rank(world: Arc<dyn Communicator>, prepared: &Prepared) -> Result<Summary, DynError> {
    type B = Autodiff<NdArray<f32>>;
    let mesh = Mesh::over_host(world, &prepared.config.parallel)?;
    Ok(train::train_rank::<B>(
        prepared,
        mesh,
        &Default::default(),
        None,
        &peak_rss,
    )?)
}

#[cfg(feature = "cuda")]
fn run_cuda_rank(
    world: Arc<dyn Communicator>,
    prepared: &Prepared,
    gpu: usize,
) -> Result<Summary, DynError> {
    // Plain CubeCL (no fusion): see `smp_burn::cuda::CudaCube` for why.
    type Inner = smp_burn::cuda::CudaCube;
    type B = Autodiff<Inner>;
    let device = burn::backend::cuda::CudaDevice::new(gpu);
    let mesh = smp_burn::cuda::nccl_mesh::<Inner>(world, &prepared.config.parallel, gpu)?;
    // Device-wide memory in use (the driver's view, so it includes CubeCL's pools and caches);
    // Burn 0.21 exposes no peak-allocation counter.
    let memory = smp_burn::cuda::memory_in_use(gpu)?;
    Ok(train::train_rank::<B>(
        prepared,
        mesh,
        &device,
        Some(train::H100_PEAK_FLOPS),
        &memory,
    )?)
}

/// Recomputes as few layers as fit the GPU, unless the command line or a config file chose.
#[cfg(feature = "cuda")]
fn fit_to_gpu(
    cli: &Cli,
    mut config: TrainConfig,
    dims: &ParallelDims,
) -> Result<TrainConfig, DynError> {
    if cli.activation_checkpointing.is_none()
        && cli.checkpointed_layers.is_none()
        && cli.config.is_none()
    {
        let recomputed = layers_to_recompute(&config, dims)?;
        config.parallel.activation_checkpointing = recomputed > 0;
        config.parallel.checkpointed_layers = Some(recomputed);
        if recomputed == 0 && config.parallel.activation_offloading {
            // Offloading moves what recomputed layers keep; with none there is nothing to move.
            tracing::info!(
                "activation offloading: off, since no layer needs recomputing to fit the GPU \
                 (--checkpointed-layers N recomputes and offloads N layers anyway)"
            );
            config.parallel.activation_offloading = false;
        }
    }
    Ok(config)
}

#[cfg(not(feature = "cuda"))]
fn fit_to_gpu(_: &Cli, config: TrainConfig, _: &ParallelDims) -> Result<TrainConfig, DynError> {
    Ok(config)
}

/// Without the `cuda` feature there is no CUDA rank to run (`run` refuses `--device cuda`
/// before any rank starts).
#[cfg(not(feature = "cuda"))]
fn run_cuda_rank(_: Arc<dyn Communicator>, _: &Prepared, _: usize) -> Result<Summary, DynError> {
    Err(NO_CUDA.into())
}

/// What `--device cuda` says in a build without the `cuda` feature.
#[cfg(not(feature = "cuda"))]
const NO_CUDA: &str = "--device cuda: this binary was built without the `cuda` feature \
                       (default-features = false); rebuild with it";

/// The GPUs this process can use, after setting up the kernel cache and logging what runs.
#[cfg(feature = "cuda")]
fn cuda_setup(cli: &Cli, config: &TrainConfig) -> Result<usize, DynError> {
    let gpus = smp_burn::cuda::cuda_device_count();
    if gpus == 0 {
        return Err("--device cuda: no CUDA device found (is the NVIDIA driver loaded?)".into());
    }
    match smp_burn::cuda::configure_kernel_cache() {
        Ok(dir) => tracing::info!(
            "CUDA kernels are compiled on first use (a minute or more on a fresh machine, \
             the first step waits for it); cached in {}",
            dir.display()
        ),
        Err(file) => tracing::info!("CubeCL configuration from {}", file.display()),
    }
    if cli.deterministic {
        smp_burn::cuda::flash::set_deterministic(Some(true));
    }
    tracing::info!("{}", smp_burn::cuda::gemm::gemm_ordering_summary()?);
    // A Hugging Face checkpoint's head dim is known only once it is read; presets now.
    if config.init_from_hf.is_none()
        && let Ok(model) = llama::LlamaConfig::preset(&config.model)
    {
        tracing::info!("{}", smp_burn::cuda::attention_summary(model.head_dim()));
    }
    Ok(gpus)
}

#[cfg(not(feature = "cuda"))]
fn cuda_setup(_: &Cli, _: &TrainConfig) -> Result<usize, DynError> {
    Err(NO_CUDA.into())
}

/// Stops the whole process on a panic in any thread, with a message that says what to do.
///
/// CubeCL runs GPU work on its own threads; when one of them panics (most often: out of GPU
/// memory), the training threads would carry on with a broken device and print numbers that
/// mean nothing. Checkpoints already written stay intact.
fn install_panic_hook() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        default(info);
        let msg = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or("");
        if msg.contains("can't allocate buffer") || msg.contains("out of memory") {
            eprintln!(
                "error: out of GPU memory ({msg}). Shard over more GPUs (--nproc-per-node), \
                 recompute more layers (--activation-checkpointing true, or a larger \
                 --checkpointed-layers), or lower --micro-batch / --seq-len."
            );
        } else {
            eprintln!("error: a thread panicked; stopping (the last checkpoint is intact)");
        }
        // `_exit`, not `std::process::exit`: the latter runs the CUDA and NCCL libraries'
        // teardown, which waited forever on a collective the panicked rank never joined (call AB:
        // the surviving rank hung until killed) or crashed in it.
        _exit(101);
    }));
}

unsafe extern "C" {
    /// POSIX `_exit`: ends the process at once, without atexit handlers.
    safe fn _exit(status: std::ffi::c_int) -> !;
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_target(false)
        .with_writer(std::io::stderr)
        .init();
    install_panic_hook();
    let cli = Cli::parse();
    if let Err(e) = run(cli) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<(), DynError> {
    let config = build_config(&cli).map_err(|e| e.to_string())?;
    if let Some(path) = &cli.write_config {
        std::fs::write(path, config.to_toml())?;
        println!("wrote {}", path.display());
        return Ok(());
    }
    let cuda = match cli.device.as_str() {
        "cpu" => false,
        "cuda" => true,
        other => return Err(format!("unknown device '{other}': use cpu or cuda").into()),
    };
    let launched = std::env::var_os("RANK").is_some() || std::env::var_os("SLURM_PROCID").is_some();
    let gpus = if cuda { cuda_setup(&cli, &config)? } else { 0 };
    // Check the layout against the world size before minutes of tokenizing.
    let world = if launched {
        RendezvousConfig::from_env()?.world_size
    } else {
        cli.nproc_per_node.unwrap_or(if cuda { gpus } else { 1 })
    };
    let dims = ParallelDims::new(&config.parallel, world)?;
    let config = if cuda {
        fit_to_gpu(&cli, config, &dims)?
    } else {
        config
    };
    // The model's shape is known before the tokenizer except for the vocabulary, which
    // tensor parallelism does not split.
    train::check_tensor_parallel(&config, &train::model_config(&config, 1)?)?;
    train::accumulation_steps(
        &config,
        world / config.parallel.tensor_parallel_degree.max(1),
    )?;
    tracing::info!("preparing data and tokenizer ({})", config.data);
    let prepared = train::prepare(config)?;
    let opts = CommOptions::from_env()?;
    // (global rank, outcome) of every rank this process ran.
    let (first_rank, results): (usize, Vec<Result<Summary, String>>) = if launched {
        let rdv = RendezvousConfig::from_env()?;
        let world = collectives::init_tcp(&rdv, opts)?;
        let out = if cuda {
            run_cuda_rank(world, &prepared, rdv.local_rank % gpus)
        } else {
            run_cpu_rank(world, &prepared)
        };
        (rdv.rank, vec![out.map_err(|e| e.to_string())])
    } else {
        let n = cli.nproc_per_node.unwrap_or(if cuda { gpus } else { 1 });
        if cuda && n > gpus {
            return Err(format!("--nproc-per-node {n} but only {gpus} GPU(s) are visible").into());
        }
        let results = run_on_threads(n, opts, |world| {
            let rank = world.rank();
            let out = if cuda {
                run_cuda_rank(world, &prepared, rank)
            } else {
                run_cpu_rank(world, &prepared)
            };
            out.map_err(|e| e.to_string())
        });
        (0, results)
    };
    let mut first_error = None;
    for (i, r) in results.iter().enumerate() {
        if let Err(e) = r {
            eprintln!("rank {} failed: {e}", first_rank + i);
            first_error.get_or_insert(e.clone());
        }
    }
    if let Some(e) = first_error {
        return Err(e.into());
    }
    if let Some(Ok(s)) = results.first() {
        let is_lead = first_rank == 0;
        if is_lead {
            print_summary(s, &prepared);
        }
    }
    Ok(())
}

fn print_summary(s: &Summary, prepared: &Prepared) {
    let c = &prepared.config;
    println!("\n=== summary ===");
    println!("steps: {}   tokens/s: {:.0}", s.steps, s.tokens_per_sec);
    println!(
        "train loss: {:.3}   validation loss: {}",
        s.final_loss,
        s.final_val_loss
            .map(|v| format!("{v:.3}"))
            .unwrap_or("-".into())
    );
    println!(
        "unigram baseline (no context): {:.3} nats/token",
        s.unigram_entropy
    );
    println!(
        "metrics: {}   loss plot: {}",
        c.out_dir.join("metrics.jsonl").display(),
        c.out_dir.join("loss.svg").display()
    );
    println!("checkpoint: {}", c.out_dir.join("checkpoints").display());
    if let Some(dir) = &c.export_hf {
        println!(
            "Hugging Face export: {} (LlamaForCausalLM.from_pretrained)",
            dir.display()
        );
    }
    if let Some(text) = &s.sample {
        println!("\n--- sample ---\n{text}\n--------------");
    }
}
