//! The training loop behind `llama2_train`: data, schedule, gradient accumulation, evaluation,
//! checkpoints, metrics, export and sampling, for one rank of any data-parallel layout.

use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::tensor::{Int, Tensor, TensorData, backend::AutodiffBackend};
use serde::{Deserialize, Serialize};
use smp_burn::engine::{Init, StateKind};
use smp_burn::fsdp::AdamW;
use smp_burn::mesh::Mesh;
use smp_burn::{ParallelConfig, ParallelDims};

use crate::config::LlamaConfig;
use crate::data::{Batch, DataPosition, TokenDataset};
use crate::error::{LlamaError, Result};
use crate::hf::{self, HostTensor, SaveDType, TensorMap};
use crate::metrics::{MetricsLog, StepMetrics, write_loss_plot_svg};
use crate::parallel::{Build, LlamaEngine, build, seeded_init};
use crate::tokenizer::TextTokenizer;

/// Peak dense bf16 FLOP/s of an H100/H200 SXM, the denominator of MFU (DESIGN.md).
pub const H100_PEAK_FLOPS: f64 = 989.4e12;

/// Everything a training run needs besides the model shape; serializable so that a run can be
/// described by (and written out as) a TOML file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct TrainConfig {
    /// Model preset name (see [`LlamaConfig::preset`]); ignored when `init_from_hf` is set.
    pub model: String,
    /// Overrides the preset's number of decoder layers (a 70B-wide model with a few layers
    /// shows per-rank memory and step time of the real widths on fewer GPUs).
    pub layers: Option<usize>,
    /// Vocabulary size of the tokenizer trained on the corpus (when none is given).
    pub vocab_size: usize,
    /// Tokens per training sequence.
    pub seq_len: usize,
    /// Sequences per data-parallel rank per micro-batch (the ranks of a tensor-parallel group
    /// share them, each taking its chunk of the sequence).
    pub micro_batch: usize,
    /// Tokens per optimizer step over all ranks; 0 = one micro-batch per rank.
    pub global_batch_tokens: usize,
    /// Optimizer steps.
    pub steps: u64,
    /// Peak learning rate.
    pub lr: f64,
    /// Final learning rate of the cosine decay.
    pub min_lr: f64,
    /// Linear warmup steps.
    pub warmup_steps: u64,
    /// AdamW hyper-parameters.
    pub adamw: AdamW,
    /// Clip the global gradient norm to this value; 0 = off.
    pub grad_clip: f64,
    /// Seed of initialization and data order.
    pub seed: u64,
    /// `embedded` (the Shakespeare corpus in the binary) or a path: text, `.gz`, directory, JSONL.
    pub data: String,
    /// JSONL field holding the text.
    pub text_field: String,
    /// A `tokenizer.json` to use instead of training one.
    pub tokenizer: Option<PathBuf>,
    /// Fraction of the corpus held out for validation.
    pub val_fraction: f64,
    /// Evaluate every this many steps (and at the end); 0 = only at the end.
    pub eval_interval: u64,
    /// Validation batches per evaluation.
    pub eval_batches: usize,
    /// Where checkpoints, metrics and plots go.
    pub out_dir: PathBuf,
    /// Save a checkpoint every this many steps (and at the end); 0 = only at the end.
    pub checkpoint_interval: u64,
    /// Write checkpoints at all (off for throughput benchmarks of large models).
    pub checkpoints: bool,
    /// Continue from the latest checkpoint in `out_dir`.
    pub resume: bool,
    /// Start a fresh run in an `out_dir` (or export directory) that holds another run's
    /// checkpoints, metrics or export, replacing them; without it (or `resume`) that is an
    /// error, so that no run destroys another's data.
    pub overwrite: bool,
    /// Start from a Hugging Face Llama directory's weights (and its config.json).
    pub init_from_hf: Option<PathBuf>,
    /// Write a Hugging Face checkpoint here at the end.
    pub export_hf: Option<PathBuf>,
    /// Dtype of the exported weights.
    pub export_dtype: String,
    /// Generate text from this prompt at the end.
    pub sample: Option<String>,
    /// Tokens to generate.
    pub sample_tokens: usize,
    /// Parallelism.
    pub parallel: ParallelConfig,
    /// Show a progress bar (rank 0).
    pub progress: bool,
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            model: "small".into(),
            layers: None,
            vocab_size: 2048,
            seq_len: 128,
            micro_batch: 16,
            global_batch_tokens: 0,
            steps: 400,
            lr: 3e-3,
            min_lr: 3e-4,
            warmup_steps: 30,
            adamw: AdamW::default(),
            grad_clip: 1.0,
            seed: 1234,
            data: "embedded".into(),
            text_field: "text".into(),
            tokenizer: None,
            val_fraction: 0.02,
            eval_interval: 100,
            eval_batches: 8,
            out_dir: PathBuf::from("runs/llama2"),
            checkpoint_interval: 0,
            checkpoints: true,
            resume: false,
            overwrite: false,
            init_from_hf: None,
            export_hf: Some(PathBuf::from("runs/llama2/hf")),
            export_dtype: "bf16".into(),
            sample: Some("ROMEO:".into()),
            sample_tokens: 120,
            parallel: ParallelConfig {
                activation_checkpointing: false,
                ..Default::default()
            },
            progress: true,
        }
    }
}

impl TrainConfig {
    /// Reads a TOML file; fields it omits keep their defaults.
    pub fn from_toml_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| LlamaError::io(path, e))?;
        toml::from_str(&text).map_err(|e| LlamaError::Config(format!("{}: {e}", path.display())))
    }

    /// The TOML text of this configuration.
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

/// The model shape of a run: from the Hugging Face directory, else the preset with the
/// tokenizer's vocabulary for the small shapes.
pub fn model_config(cfg: &TrainConfig, tokenizer_vocab: usize) -> Result<LlamaConfig> {
    if let Some(dir) = &cfg.init_from_hf {
        return hf::read_hf_config(dir);
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

/// Loads the corpus and the tokenizer (training a byte-level BPE when none is given) and packs
/// the data. On resume the checkpoint's own tokenizer is used, so token ids stay the same.
pub fn prepare(config: TrainConfig) -> Result<Prepared> {
    check_output_is_free(&config)?;
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

fn tensors<B: AutodiffBackend>(
    batch: &Batch,
    device: &B::Device,
) -> (Tensor<B, 2, Int>, Tensor<B, 2, Int>) {
    let shape = [batch.batch, batch.seq_len];
    (
        Tensor::from_data(TensorData::new(batch.inputs.clone(), shape), device),
        Tensor::from_data(TensorData::new(batch.targets.clone(), shape), device),
    )
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
    let resume_dir = if cfg.resume {
        latest_checkpoint(&cfg.out_dir)?
    } else {
        None
    };
    let (mut model, mut start_step, mut position) = match &resume_dir {
        Some(dir) => {
            let state = TrainerState::read(dir)?;
            if state.model != prepared.model {
                return Err(LlamaError::checkpoint(
                    dir,
                    format!(
                        "was written for model {:?}, this run builds {:?}",
                        state.model, prepared.model
                    ),
                ));
            }
            let weights = load_checked(&dir.join("model"), &prepared.model)?;
            let mut model = build(Init::source(reader_source(&weights)))?;
            for (kind, sub) in [
                (StateKind::ExpAvg, "exp_avg"),
                (StateKind::ExpAvgSq, "exp_avg_sq"),
            ] {
                let path = dir.join("optimizer").join(sub);
                let moments = load_checked(&path, &prepared.model)?;
                model.load_state(kind, &reader_source(&moments))?;
            }
            model.set_optimizer_steps(state.step);
            (model, state.step, state.data_position)
        }
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
    let saves = |done: u64| {
        cfg.checkpoints && done == cfg.steps
            || (cfg.checkpoint_interval > 0 && done.is_multiple_of(cfg.checkpoint_interval))
    };

    let mut offload_reported = false;
    while start_step < cfg.steps {
        let step = start_step;
        let t0 = Instant::now();
        let lr = cfg.lr_at(step);
        for micro in 0..accum {
            let batch = prepared.dataset.next_batch_for_rank(
                &mut position,
                global_micro,
                mesh.dp_rank(),
                mesh.dp_size(),
            )?;
            let (inputs, targets) = tensors::<B>(&batch, device);
            let last = micro + 1 == accum;
            model.forward_backward(inputs, targets, 1.0 / accum as f32, last)?;
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
            if saves(reported) {
                save_checkpoint(&model, prepared, reported, position, lead)?;
            }
        }
    }
    if let Some(bar) = bar {
        bar.finish();
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
    let mut total = 0.0;
    let mut n = 0;
    for batch in prepared
        .dataset
        .val_batches_for_rank(global, mesh.dp_rank(), mesh.dp_size())?
        .take(cfg.eval_batches.max(1))
    {
        let (inputs, targets) = tensors::<B>(&batch, device);
        total += model.eval_loss(inputs, targets)?;
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

fn named_map(items: Vec<(String, Vec<usize>, Vec<f32>)>) -> Result<TensorMap> {
    items
        .into_iter()
        .map(|(n, shape, data)| Ok((n, HostTensor::new(shape, data)?)))
        .collect()
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
    let weights = named_map(model.gather_named(StateKind::Weights)?)?;
    if !lead {
        return Ok(());
    }
    let dtype: SaveDType = prepared.config.export_dtype.parse()?;
    let parent = dir.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(|e| LlamaError::io(parent, e))?;
    // The tokenizer is staged beside the export (same file system) and removed with `tmp`.
    let tmp = tempfile::Builder::new()
        .prefix(".smp-export-")
        .tempdir_in(parent)
        .map_err(|e| LlamaError::io(parent, e))?;
    let tok = tmp.path().join("tokenizer.json");
    prepared.tokenizer.save(&tok)?;
    hf::save_hf_dir(dir, &prepared.model, &weights, dtype, 2 << 30, Some(&tok))?;
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

impl TrainerState {
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

/// The checkpoint named by `out_dir/latest`, if any.
pub fn latest_checkpoint(out_dir: &Path) -> Result<Option<PathBuf>> {
    let latest = out_dir.join("checkpoints").join("latest");
    match std::fs::read_to_string(&latest) {
        Ok(name) => {
            let dir = out_dir.join("checkpoints").join(name.trim());
            if !dir.join("trainer_state.json").exists() {
                return Err(LlamaError::checkpoint(
                    &dir,
                    "named by 'latest' but incomplete or missing",
                ));
            }
            Ok(Some(dir))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(LlamaError::io(latest, e)),
    }
}

/// Writes a full checkpoint (fp32 weights, AdamW moments, data position, tokenizer) under
/// `out_dir/checkpoints/step-NNNNNN`, atomically: everything is written to a temporary
/// directory that is renamed into place, and only then does `latest` (itself replaced by a
/// rename) point at it. A crash at any moment leaves the previous checkpoint usable.
/// Collective: every rank gathers; rank 0 writes.
pub fn save_checkpoint<B: AutodiffBackend>(
    model: &LlamaEngine<B>,
    prepared: &Prepared,
    step: u64,
    position: DataPosition,
    lead: bool,
) -> Result<()> {
    let weights = named_map(model.gather_named(StateKind::Weights)?)?;
    let m1 = named_map(model.gather_named(StateKind::ExpAvg)?)?;
    let m2 = named_map(model.gather_named(StateKind::ExpAvgSq)?)?;
    if !lead {
        return Ok(());
    }
    let root = prepared.config.out_dir.join("checkpoints");
    std::fs::create_dir_all(&root).map_err(|e| LlamaError::io(&root, e))?;
    let name = format!("step-{step:06}");
    let tmp = root.join(format!(".{name}.partial"));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(|e| LlamaError::io(&tmp, e))?;
    let f32_shards = 4 << 30;
    hf::save_hf_dir(
        tmp.join("model"),
        &prepared.model,
        &weights,
        SaveDType::F32,
        f32_shards,
        None,
    )?;
    hf::save_hf_dir(
        tmp.join("optimizer/exp_avg"),
        &prepared.model,
        &m1,
        SaveDType::F32,
        f32_shards,
        None,
    )?;
    hf::save_hf_dir(
        tmp.join("optimizer/exp_avg_sq"),
        &prepared.model,
        &m2,
        SaveDType::F32,
        f32_shards,
        None,
    )?;
    prepared.tokenizer.save(tmp.join("tokenizer.json"))?;
    let state = TrainerState {
        step,
        data_position: position,
        model: prepared.model.clone(),
        train: prepared.config.clone(),
    };
    let state_path = tmp.join("trainer_state.json");
    std::fs::write(
        &state_path,
        serde_json::to_string_pretty(&state).expect("serializable"),
    )
    .map_err(|e| LlamaError::io(&state_path, e))?;
    let dest = root.join(&name);
    if dest.exists() {
        std::fs::remove_dir_all(&dest).map_err(|e| LlamaError::io(&dest, e))?;
    }
    std::fs::rename(&tmp, &dest).map_err(|e| LlamaError::io(&dest, e))?;
    let latest_tmp = root.join(".latest.partial");
    std::fs::write(&latest_tmp, &name).map_err(|e| LlamaError::io(&latest_tmp, e))?;
    std::fs::rename(&latest_tmp, root.join("latest"))
        .map_err(|e| LlamaError::io(root.join("latest"), e))?;
    Ok(())
}
