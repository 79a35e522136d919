//! Train Llama 2 on text: on the CPU by default (the embedded Shakespeare corpus, a small model,
//! a few minutes), on every visible GPU with `--device cuda`.
//!
//! ```text
//! cargo run --release --example llama2_train                          # CPU, defaults
//! cargo run --release --example llama2_train -- --nproc-per-node 2    # 2 CPU thread-ranks, sharded
//! llama2_train --device cuda --model 1b --seq-len 4096 --micro-batch 1 # every visible GPU
//! smp-run --nproc-per-node 8 -- llama2_train --device cuda ...        # one process per GPU
//! llama2_train --config run.toml --steps 50                           # a file, one flag over it
//! ```
//!
//! Every flag is also a key of the TOML file `--config` reads (`llama::train::TrainConfig`
//! holds both); flags typed override the file, which overrides the defaults.
//!
//! MFU: FLOPs per token `6 * N + 12 * L * H * S` (N = parameters outside the token embedding,
//! LM head included) per GPU, against the GPU's dense bf16 tensor-core peak, looked up by its
//! CUDA device name (`llama::metrics::PEAK_FLOPS_16BIT`) or given with `--peak-tflops`. A GPU
//! the table lacks, or f32 compute, reports no MFU.

use std::sync::Arc;

use clap::Parser;

#[path = "llama2_train_plan.rs"]
mod plan_cli;

use burn::backend::{Autodiff, NdArray};
use collectives::{CommOptions, Communicator, RendezvousConfig, run_on_threads};
use llama::LlamaError;
#[cfg(feature = "cuda")]
use llama::config::{Recomputation, StepLayout};
use llama::train::{self, Prepared, ResolvedConfig, Summary, TrainConfig};
use smp_burn::mesh::Mesh;
use smp_burn::{KernelConfig, ParallelDims};

/// Which decoder layers to recompute so that the run fits one GPU, from the memory estimate:
/// with `choose_selective`, full or selective recomputation as `LlamaConfig::recomputation`
/// finds cheaper, otherwise as the configuration says (`LlamaConfig::layers_to_recompute`).
/// All of them, fully, when the device cannot be asked.
#[cfg(feature = "cuda")]
fn recomputation(
    config: &TrainConfig,
    dims: &ParallelDims,
    choose_selective: bool,
) -> Result<Recomputation, DynError> {
    let model = train::model_config(config, 1)?;
    let layers = model.num_hidden_layers;
    let Some(have) = smp_burn::cuda::cuda_device_memory(0) else {
        return Ok(Recomputation {
            layers,
            selective: config.parallel.selective_recompute,
        });
    };
    let compute = config.parallel.param_dtype;
    // The flash kernels' own test of shapes and dtype, on the first GPU's architecture.
    let head_dim = model.head_dim();
    let shape = |heads| [config.micro_batch, heads, config.seq_len, head_dim];
    let flash_attention = smp_burn::kernel_config::fast_paths().attention
        && smp_burn::cuda::attention::supports(
            &shape(model.num_attention_heads),
            &shape(model.num_key_value_heads),
            burn::tensor::DType::from(compute.dtype()),
        )
        && smp_burn::cuda::cuda_compute_capability(0).is_some_and(|cc| cc >= (8, 0));
    let mut layout = StepLayout {
        micro_batch: config.micro_batch,
        seq_len: config.seq_len,
        shard_degree: dims.shard,
        tp: dims.tensor,
        offload_horizon: config.parallel.offloading_horizon(),
        compute,
        flash_attention,
        selective_recompute: config.parallel.selective_recompute,
        fp8: smp_burn::kernel_config::fp8_recipe().enabled(),
        accumulates_unreduced: train::accumulation_steps(config, dims.world / dims.tensor)? > 1
            && !config.parallel.reduce_every_micro_batch,
        adamw_moments: config.adamw.moments,
    };
    let plan = |layout: &StepLayout| {
        if choose_selective {
            model.recomputation(layout, have)
        } else {
            Recomputation {
                layers: model.layers_to_recompute(layout, have),
                selective: layout.selective_recompute,
            }
        }
    };
    let mut chosen = plan(&layout);
    if layout.fp8 {
        // FP8 keeps each weight's FP8 copy for the backward (a few % of a step) only where it
        // costs no recomputed layer (a third of a layer's compute each).
        let without_copies = StepLayout {
            fp8: false,
            ..layout.clone()
        };
        let fewer = plan(&without_copies);
        if fewer.layers < chosen.layers {
            smp_burn::cuda::fp8::keep_weight_copies(false);
            tracing::info!(
                "FP8: the backward casts each weight again instead of keeping its FP8 copy \
                 from the forward: the copies would need {} more recomputed layers to fit \
                 (--checkpointed-layers N keeps them)",
                chosen.layers - fewer.layers
            );
            (layout, chosen) = (without_copies, fewer);
        }
    }
    model.check_fits(&layout, chosen, have)?;
    let chosen_layout = StepLayout {
        selective_recompute: chosen.selective,
        ..layout
    };
    let need = |n| model.training_memory_estimate(&chosen_layout, n);
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    tracing::info!(
        "activation checkpointing: recomputing {} of {layers} layers{}; this run needs about \
         {:.0} GiB per GPU ({:.0} GiB recomputing none{}), {:.0} GiB is {} % of the GPU \
         (--activation-checkpointing, --checkpointed-layers and --selective-recompute, or the \
         config file's keys, override)",
        chosen.layers,
        if chosen.selective && chosen.layers > 0 {
            " selectively (their attention outputs kept)"
        } else {
            ""
        },
        gib(need(chosen.layers)),
        gib(need(0)),
        if flash_attention {
            ""
        } else {
            "; attention without the flash kernels keeps its seq x seq scores"
        },
        gib(have / 100 * llama::config::MEMORY_BUDGET_PERCENT),
        llama::config::MEMORY_BUDGET_PERCENT
    );
    Ok(chosen)
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
    let mesh = smp_burn::mesh::nccl_mesh::<Inner>(world, &prepared.config.parallel, gpu)?;
    // Device-wide memory in use (the driver's view, so it includes CubeCL's pools and caches);
    // Burn 0.21 exposes no peak-allocation counter.
    let memory = smp_burn::cuda::memory_in_use(gpu)?;
    let peak = peak_flops(&prepared.config, gpu);
    Ok(train::train_rank::<B>(
        prepared, mesh, &device, peak, &memory,
    )?)
}

/// The peak FLOP/s MFU is measured against on `gpu`: `--peak-tflops`, else the table's figure
/// for the device's name; `None`, said once per process, when neither gives one.
#[cfg(feature = "cuda")]
fn peak_flops(config: &TrainConfig, gpu: usize) -> Option<f64> {
    static SAID: std::sync::Once = std::sync::Once::new();
    let name = cuda_device_name(gpu);
    let peak = llama::metrics::mfu_peak_flops(
        name.as_deref(),
        config.parallel.param_dtype,
        config.peak_tflops,
    );
    match peak {
        Ok(flops) => {
            SAID.call_once(|| {
                tracing::info!(
                    "MFU against {:.1} TFLOP/s per GPU ({})",
                    flops / 1e12,
                    match config.peak_tflops {
                        Some(_) => "--peak-tflops".to_string(),
                        None => format!("dense bf16 peak of {}", name.as_deref().unwrap_or("?")),
                    }
                )
            });
            Some(flops)
        }
        Err(why) => {
            SAID.call_once(|| tracing::info!("{why}"));
            None
        }
    }
}

/// The CUDA device name of `gpu` ("NVIDIA H100 80GB HBM3"), from the driver; `None` without a
/// driver or device.
#[cfg(feature = "cuda")]
fn cuda_device_name(gpu: usize) -> Option<String> {
    if smp_burn::cuda::cuda_device_count() <= gpu {
        return None;
    }
    let device = cudarc::driver::result::device::get(i32::try_from(gpu).ok()?).ok()?;
    cudarc::driver::result::device::get_name(device).ok()
}

/// Recomputes as few layers as fit the GPU, unless the user fixed which ones (a flag or a config
/// file key: `activation_checkpointing`, `checkpointed_layers`); fully or selectively, whichever
/// repeats fewer FLOPs, unless the user set `selective_recompute`.
#[cfg(feature = "cuda")]
fn fit_to_gpu(
    resolved: &ResolvedConfig,
    mut config: TrainConfig,
    dims: &ParallelDims,
) -> Result<TrainConfig, DynError> {
    if !resolved.is_explicit("parallel.activation_checkpointing")
        && !resolved.is_explicit("parallel.checkpointed_layers")
    {
        let choose_selective = !resolved.is_explicit("parallel.selective_recompute");
        let chosen = recomputation(&config, dims, choose_selective)?;
        config.parallel.activation_checkpointing = chosen.layers > 0;
        config.parallel.checkpointed_layers = Some(chosen.layers);
        config.parallel.selective_recompute = chosen.selective && chosen.layers > 0;
        if chosen.layers == 0 && config.parallel.activation_offloading {
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
fn fit_to_gpu(
    _: &ResolvedConfig,
    config: TrainConfig,
    _: &ParallelDims,
) -> Result<TrainConfig, DynError> {
    Ok(config)
}

/// Refuses an FP8 recipe when any GPU of this process lacks FP8 tensor cores.
#[cfg(feature = "cuda")]
fn check_fp8_gpus(fp8: smp_burn::Fp8Recipe, gpus: usize) -> Result<(), DynError> {
    if fp8.enabled() {
        for gpu in 0..gpus {
            smp_burn::cuda::fp8::check_fp8_device(gpu)?;
        }
        tracing::info!(
            "FP8 ({}): the blocks' linear layers run E4M3/E5M2 GEMMs through cuBLASLt",
            fp8.name()
        );
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn check_fp8_gpus(_: smp_burn::Fp8Recipe, _: usize) -> Result<(), DynError> {
    Ok(())
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
fn cuda_setup(config: &TrainConfig) -> Result<usize, DynError> {
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
fn cuda_setup(_: &TrainConfig) -> Result<usize, DynError> {
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
        // A third-party parser's panic that `llama::guard::catch` turns into an error.
        if llama::guard::active() {
            return;
        }
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
        // teardown, which waited forever on a collective the panicked rank never joined (the
        // surviving rank hung until killed) or crashed in it.
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
    if std::env::args_os().nth(1).is_some_and(|a| a == "plan") {
        let result = if std::env::args_os().nth(2).is_some_and(|a| a == "calibrate") {
            plan_cli::calibrate(&plan_cli::CalibrateArgs::parse_from(
                std::env::args_os().skip(2),
            ))
        } else {
            plan_cli::run(&plan_cli::PlanArgs::parse_from(std::env::args_os().skip(1)))
        };
        if let Err(e) = result {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
        return;
    }
    if std::env::args_os().nth(1).is_some_and(|a| a == "convert") {
        let args = ConvertArgs::parse_from(std::env::args_os().skip(1));
        if let Err(e) = convert(&args) {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
        return;
    }
    let resolved = match TrainConfig::from_args(std::env::args_os()) {
        Ok(r) => r,
        // Help, or a flag clap rejects: printed as clap formats it, with clap's exit status.
        Err(LlamaError::Usage(e)) => e.exit(),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    };
    if let Err(e) = run(resolved) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

/// `llama2_train convert FROM TO`: a sharded checkpoint to a Hugging Face directory, or a
/// Hugging Face directory to a sharded checkpoint, on the CPU, one tensor in memory at a time.
#[derive(clap::Parser)]
#[command(
    name = "llama2_train convert",
    about = "Convert a sharded checkpoint to a Hugging Face directory (FROM holds index.json, \
             or is a run directory whose latest checkpoint is taken), or a Hugging Face \
             directory to a sharded checkpoint (FROM holds config.json; TO is then a run \
             directory that `llama2_train --resume --out-dir TO` continues from)"
)]
struct ConvertArgs {
    /// A checkpoint (`.../checkpoints/step-NNNNNN`), a run directory, or a Hugging Face model.
    from: std::path::PathBuf,
    /// Where the converted copy goes.
    to: std::path::PathBuf,
    /// The exported weights' dtype (to Hugging Face): bf16, f16 or f32.
    #[arg(long, default_value = "bf16")]
    dtype: String,
}

fn convert(args: &ConvertArgs) -> Result<(), DynError> {
    use smp_burn::checkpoint::INDEX_FILE;
    let started = std::time::Instant::now();
    let checkpoint = if args.from.join(INDEX_FILE).exists() {
        Some(args.from.clone())
    } else {
        train::latest_checkpoint(&args.from)?
    };
    match checkpoint {
        Some(dir) => {
            llama::convert::sharded_to_hf(&dir, &args.to, args.dtype.parse()?)?;
            tracing::info!(
                "wrote {} from {} in {:.1} s",
                args.to.display(),
                dir.display(),
                started.elapsed().as_secs_f64()
            );
        }
        None if args.from.join("config.json").exists() => {
            llama::convert::hf_to_sharded(&args.from, &args.to)?;
            tracing::info!(
                "wrote {} from {} in {:.1} s",
                args.to.join("checkpoints").display(),
                args.from.display(),
                started.elapsed().as_secs_f64()
            );
        }
        None => {
            return Err(format!(
                "{}: neither a checkpoint (no {INDEX_FILE}), a run directory with one, nor a \
                 Hugging Face model (no config.json)",
                args.from.display()
            )
            .into());
        }
    }
    Ok(())
}

/// The kernel settings: the environment's SMP_BURN_KERNELS, then the config file's
/// `[kernels]` and the kernel flags.
fn kernel_config(config: &TrainConfig) -> Result<KernelConfig, DynError> {
    use smp_burn::kernel_config::KERNELS_ENV;
    let over_env = |e: LlamaError| match std::env::var(KERNELS_ENV) {
        Ok(env) => format!("{e} (over {KERNELS_ENV}={env:?})"),
        Err(_) => e.to_string(),
    };
    Ok(config
        .kernels
        .apply(KernelConfig::from_env()?)
        .map_err(over_env)?)
}

fn run(resolved: ResolvedConfig) -> Result<(), DynError> {
    if let Some(path) = &resolved.write_config {
        std::fs::write(path, resolved.to_toml())?;
        println!("wrote {}", path.display());
        return Ok(());
    }
    let config = resolved.config.clone();
    // Before the first tensor: the kernel cache's directory is read when CUDA starts.
    let kernels = kernel_config(&config)?;
    let cuda = config.device == "cuda";
    if kernels.fp8.enabled() && !cuda {
        return Err(format!(
            "FP8 ({}) runs on CUDA GPUs of compute capability 8.9 or later: add --device cuda \
             (or leave out --fp8 / fp8= in SMP_BURN_KERNELS)",
            kernels.fp8.name()
        )
        .into());
    }
    let fp8 = kernels.fp8;
    kernels.install()?;
    let launched = std::env::var_os("RANK").is_some() || std::env::var_os("SLURM_PROCID").is_some();
    let gpus = if cuda { cuda_setup(&config)? } else { 0 };
    check_fp8_gpus(fp8, gpus)?;
    // Check the layout against the world size before minutes of tokenizing.
    let nproc = config.nproc_per_node.unwrap_or(if cuda { gpus } else { 1 });
    let world = if launched {
        RendezvousConfig::from_env()?.world_size
    } else {
        nproc
    };
    let (config, prediction) = if config.auto {
        if !cuda {
            return Err("--auto plans for GPUs: add --device cuda".into());
        }
        let (config, p) = plan_cli::auto_layout(&resolved, config, world)?;
        (config, Some(p))
    } else {
        (config, None)
    };
    let dims = ParallelDims::new(&config.parallel, world)?;
    let config = if cuda && prediction.is_none() {
        fit_to_gpu(&resolved, config, &dims)?
    } else {
        config
    };
    // The model's shape is known before the tokenizer, so a layout that cannot split it fails
    // before minutes of tokenizing.
    // The shapes that take the tokenizer's vocabulary get a stand-in that any degree splits;
    // each rank checks the real one once the tokenizer is built (`train_rank`).
    let tp = config.parallel.tensor_parallel_degree.max(1);
    train::check_tensor_parallel(&config, &train::model_config(&config, tp)?)?;
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
        let n = nproc;
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
            if let Some(p) = &prediction {
                plan_cli::compare_with_prediction(&prepared.config, p)?;
            }
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
    if c.checkpoints {
        println!("checkpoint: {}", c.out_dir.join("checkpoints").display());
    } else {
        println!("checkpoint: none (--no-checkpoint)");
    }
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
