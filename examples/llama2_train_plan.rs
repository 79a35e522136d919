//! `llama2_train plan`: the planner's command line (ranking layouts for a cluster, a scaling
//! table and plot) and `llama2_train plan calibrate`, which measures the GPU at hand.

use std::path::PathBuf;
use std::process::Command;

use llama::LlamaConfig;
use llama::plan::{self, Calibration, CalibrationRun, Workload};
use smp_burn::fsdp::MomentDtype;
use smp_burn::plan::{Cluster, Gpu, Link, parse_collective_bench};

type DynError = Box<dyn std::error::Error + Send + Sync>;

/// Predicts memory and step time of every layout of a Llama training run on a cluster and
/// ranks them.
#[derive(clap::Parser)]
#[command(
    name = "llama2_train plan",
    about = "Rank the layouts (tensor-parallel degree, shard degree, micro-batch, recomputed \
             layers, offloading) of a training run on a cluster by predicted step time; \
             `llama2_train plan calibrate --help` measures the GPU at hand",
    after_help = "Example: llama2_train plan --model 70b --cluster p4d --nodes 32 \
                  --global-batch-tokens 4194304\n         llama2_train plan --model 7b --cluster \
                  h200 --scaling 16,32,64,128 --svg scaling.svg"
)]
pub struct PlanArgs {
    /// Model preset (tiny, small, 1b, 7b, 13b, 70b); with --scaling a comma-separated list.
    #[arg(long, default_value = "7b")]
    model: String,
    /// A Hugging Face model directory whose config.json gives the shape (instead of --model).
    #[arg(long)]
    hf_config: Option<PathBuf>,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 4096)]
    seq_len: usize,
    /// Tokens per optimizer step over the whole cluster (4M by default, as SMP's benchmarks).
    #[arg(long, default_value_t = 4 << 20)]
    global_batch_tokens: usize,
    /// Share of whole rows' causal attention that runs, for rows packed with documents under
    /// `--document-masking` (the trainer logs it: "attention does N % of the unmasked rows'
    /// work"); 1 for one sequence per row.
    #[arg(long, default_value_t = 1.0)]
    attention_share: f64,
    /// The dtype AdamW keeps its moments in (`[adamw] moments` of the trainer's config): bf16
    /// takes 4 bytes per parameter off the state and 8 off the optimizer step's traffic.
    #[arg(long, default_value = "f32", value_parser = ["f32", "bf16"])]
    adamw_moments: String,
    /// Cluster preset: p4d (8 A100-40GB, 400 Gb/s EFA), p5 (8 H100, 3,200 Gb/s EFA), h200
    /// (8 H200, 8 x 400 Gb/s); with --scaling a comma-separated list.
    #[arg(long, default_value = "h200")]
    cluster: String,
    /// Nodes.
    #[arg(long, default_value_t = 16)]
    nodes: usize,
    /// GPUs per node (the preset's 8 unless set).
    #[arg(long)]
    gpus_per_node: Option<usize>,
    /// Device memory per GPU in GiB (the preset's unless set).
    #[arg(long)]
    gpu_memory_gib: Option<f64>,
    /// Dense bf16 peak per GPU in TFLOP/s (the preset's unless set).
    #[arg(long)]
    peak_tflops: Option<f64>,
    /// Bus bandwidth inside a node, GB/s.
    #[arg(long)]
    intra_gbps: Option<f64>,
    /// Latency of a ring step inside a node, microseconds.
    #[arg(long)]
    intra_latency_us: Option<f64>,
    /// Network bandwidth of one node (all NICs), GB/s.
    #[arg(long)]
    inter_gbps: Option<f64>,
    /// Latency of a ring step between nodes, microseconds.
    #[arg(long)]
    inter_latency_us: Option<f64>,
    /// Fit the in-node link to `collective_bench` output (its RESULT lines, the `burn` variant)
    /// instead of the preset's.
    #[arg(long, value_name = "FILE")]
    links_from: Option<PathBuf>,
    /// Ranks the `--links-from` run used.
    #[arg(long, default_value_t = 2)]
    links_ranks: usize,
    /// A calibration written by `llama2_train plan calibrate` (default: the H200 one measured
    /// for this repository, scaled to the cluster's GPU by its peak).
    #[arg(long, value_name = "FILE")]
    calibration: Option<PathBuf>,
    /// Only layouts with this tensor-parallel degree.
    #[arg(long)]
    tp: Option<usize>,
    /// Only layouts with this shard degree.
    #[arg(long)]
    sdp: Option<usize>,
    /// Only layouts with this micro-batch.
    #[arg(long)]
    micro_batch: Option<usize>,
    /// Predict with this many recomputed layers instead of the fewest that fit.
    #[arg(long)]
    recomputed: Option<usize>,
    /// Only layouts with (true) or without (false) FP8 linear layers (offered where the GPU
    /// has FP8 tensor cores and the calibration measured FP8's speedup).
    #[arg(long, value_name = "BOOL")]
    fp8: Option<bool>,
    /// Only layouts with (true) or without (false) selective recomputation (offered where
    /// layers are recomputed).
    #[arg(long, value_name = "BOOL")]
    selective: Option<bool>,
    /// Share of the collectives' time beside compute that is hidden (default: the calibration's,
    /// 0.3 as measured on two H200s; 1 is perfect overlap).
    #[arg(long)]
    overlap: Option<f64>,
    /// Layouts to print.
    #[arg(long, default_value_t = 10)]
    top: usize,
    /// Instead of ranking one cluster: the best layout for each of these node counts.
    #[arg(long, value_delimiter = ',')]
    scaling: Vec<usize>,
    /// With --scaling: also plot TFLOP/s per GPU against nodes into this SVG file.
    #[arg(long, value_name = "FILE")]
    svg: Option<PathBuf>,
}

/// Measures this GPU for the planner: short runs of the trainer, then the fit.
#[derive(clap::Parser)]
#[command(
    name = "llama2_train plan calibrate",
    about = "Time short training runs on the first GPU (a few decoder layers of the model's \
             widths at several sequence lengths, micro-batches and recomputation, and on an FP8 \
             GPU one run again in FP8) and fit the planner's rates to them"
)]
pub struct CalibrateArgs {
    /// Model preset whose widths the runs take.
    #[arg(long, default_value = "7b")]
    model: String,
    /// Sequence lengths (one attention rate each; below 4,096 with micro-batches of 4,096
    /// tokens); the first of 4,096 or more also gets a micro-batch-2 and an all-recomputed run.
    #[arg(long, value_delimiter = ',', default_value = "1024,4096,16384,32768")]
    seq_lens: Vec<usize>,
    /// Decoder layers of the runs (at least two different counts).
    #[arg(long, value_delimiter = ',', default_value = "2,8")]
    layers: Vec<usize>,
    /// Steps per run; the mean of the steps after the second is its time (a step's own time
    /// is uneven: the host queues ahead of the GPU).
    #[arg(long, default_value_t = 10)]
    steps: usize,
    /// The optimizer's rate in TB/s: AdamW's measured rate on this GPU (3.8 on an H200,
    /// `kernel_bench`); the runs cannot tell it from the layers' work.
    #[arg(long, default_value_t = 3.8)]
    optimizer_tbps: f64,
    /// Where the calibration goes.
    #[arg(long, default_value = "calibration.json")]
    out: PathBuf,
    /// Directory for the runs' output (metrics.jsonl per run).
    #[arg(long, default_value = "runs/calibrate")]
    work_dir: PathBuf,
    /// Passed to every run (saves training a tokenizer per run).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Overwrite --out if it exists.
    #[arg(long)]
    overwrite: bool,
    /// Fit again the runs a calibration measured (its `.runs.json`), without a GPU: to fit
    /// with another `--optimizer-tbps`, or after a fit that failed.
    #[arg(long, value_name = "FILE")]
    from_runs: Option<PathBuf>,
}

/// What `plan calibrate` measured, saved before the fit.
#[derive(serde::Serialize, serde::Deserialize)]
struct MeasuredRuns {
    gpu: Gpu,
    runs: Vec<CalibrationRun>,
}

fn cluster(args: &PlanArgs, preset: &str, nodes: usize) -> Result<Cluster, DynError> {
    let mut c = Cluster::preset(preset, nodes)?;
    if let Some(g) = args.gpus_per_node {
        if g == 0 {
            return Err("--gpus-per-node 0: need at least one".into());
        }
        c.gpus_per_node = g;
    }
    if let Some(gib) = args.gpu_memory_gib {
        c.gpu.memory_bytes = (gib * (1u64 << 30) as f64) as u64;
    }
    if let Some(t) = args.peak_tflops {
        c.gpu.peak_bf16_flops = t * 1e12;
    }
    let set = |link: &mut Link, gbps: Option<f64>, us: Option<f64>| {
        if let Some(g) = gbps {
            link.bus_bytes_per_s = g * 1e9;
        }
        if let Some(u) = us {
            link.latency_s = u * 1e-6;
        }
    };
    set(&mut c.intra_node, args.intra_gbps, args.intra_latency_us);
    set(&mut c.inter_node, args.inter_gbps, args.inter_latency_us);
    if let Some(path) = &args.links_from {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let samples = parse_collective_bench(&text, "burn", args.links_ranks);
        c.intra_node = Link::fit(&samples).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    if c.gpu.memory_bytes == 0 || c.gpu.peak_bf16_flops <= 0.0 {
        return Err("the GPU needs positive memory and peak".into());
    }
    Ok(c)
}

fn calibration_for(
    args: &PlanArgs,
    model: &LlamaConfig,
    gpu: &Gpu,
) -> Result<Calibration, DynError> {
    let set = match &args.calibration {
        Some(path) => Calibration::load(path)?,
        None => Calibration::h200(),
    };
    let mut cal = Calibration::nearest(&set, model, gpu)?;
    if let Some(o) = args.overlap {
        if !(0.0..=1.0).contains(&o) {
            return Err(format!("--overlap {o}: must be within 0 and 1").into());
        }
        cal.overlap = o;
    }
    Ok(cal)
}

/// The layouts `--tp`, `--sdp`, `--micro-batch` allow, predicted again with `--recomputed`
/// layers where that is given.
fn restrict(
    args: &PlanArgs,
    workload: &Workload,
    cluster: &Cluster,
    cal: &Calibration,
    ranked: Vec<plan::Prediction>,
) -> Vec<plan::Prediction> {
    let keep = |l: &plan::Layout| {
        args.tp.is_none_or(|t| l.tp == t)
            && args.sdp.is_none_or(|d| l.sdp == d)
            && args.micro_batch.is_none_or(|m| l.micro_batch == m)
            && args.fp8.is_none_or(|f| l.fp8 == f)
            && args.selective.is_none_or(|s| l.selective == s)
    };
    ranked
        .into_iter()
        .filter(|p| keep(&p.layout))
        .filter_map(|p| match args.recomputed {
            Some(r) => plan::predict(
                workload,
                cluster,
                cal,
                plan::Layout {
                    recomputed_layers: r,
                    ..p.layout
                },
            ),
            None => Some(p),
        })
        .collect()
}

/// `llama2_train plan ...`.
pub fn run(args: &PlanArgs) -> Result<(), DynError> {
    let workload = |model: &str| -> Result<(String, Workload), DynError> {
        let (name, model) = match &args.hf_config {
            Some(dir) => (dir.display().to_string(), llama::hf::read_hf_config(dir)?),
            None => (model.to_string(), LlamaConfig::preset(model)?),
        };
        model.validate()?;
        if !(args.attention_share > 0.0 && args.attention_share <= 1.0) {
            return Err(format!(
                "--attention-share {} is not a share of the rows' attention: it must be in \
                 (0, 1]",
                args.attention_share
            )
            .into());
        }
        Ok((
            name,
            Workload {
                attention_share: args.attention_share,
                adamw_moments: match args.adamw_moments.as_str() {
                    "bf16" => MomentDtype::Bf16,
                    _ => MomentDtype::F32,
                },
                ..Workload::new(model, args.seq_len, args.global_batch_tokens)
            },
        ))
    };
    let models: Vec<&str> = args.model.split(',').map(str::trim).collect();
    let clusters: Vec<&str> = args.cluster.split(',').map(str::trim).collect();
    if args.scaling.is_empty() {
        if models.len() > 1 || clusters.len() > 1 {
            return Err("several models or clusters need --scaling N,N,...".into());
        }
        let (name, workload) = workload(models[0])?;
        let c = cluster(args, clusters[0], args.nodes)?;
        let cal = calibration_for(args, &workload.model, &c.gpu)?;
        let ranked = restrict(args, &workload, &c, &cal, plan::search(&workload, &c, &cal));
        println!(
            "{name}, S={}{}, {} tokens per step on {} x {} {} ({}); compute rates from {}\n",
            args.seq_len,
            if args.attention_share < 1.0 {
                format!(
                    " (packed documents: {:.0} % of the rows' attention)",
                    args.attention_share * 100.0
                )
            } else {
                String::new()
            },
            args.global_batch_tokens,
            c.nodes,
            c.gpus_per_node,
            c.gpu.name,
            c.name,
            cal.gpu
        );
        if ranked.is_empty() {
            return Err(format!(
                "no layout divides {} tokens per step over {} GPUs in sequences of {}: make \
                 the global batch a multiple of the data-parallel ranks x {}",
                args.global_batch_tokens,
                c.world(),
                args.seq_len,
                args.seq_len
            )
            .into());
        }
        print!(
            "{}",
            plan::format_predictions(&ranked, c.gpu.peak_bf16_flops, args.top)
        );
        if !ranked[0].fits {
            println!("\nno layout fits the GPU's memory; the smallest are listed");
        }
        return Ok(());
    }
    let mut series = Vec::new();
    for preset in &clusters {
        for model in &models {
            let (name, workload) = workload(model)?;
            println!(
                "\n{name} on {preset}, S={}, {} tokens per step\n\n| nodes | GPUs | tp | sdp | \
                 micro-batch x count | recomputed | offload | fp8 | memory/GPU | step | exposed \
                 comm | TFLOP/s/GPU | efficiency |\n| --- | --- | --- | --- | --- | --- | --- \
                 | --- | --- | --- | --- | --- | --- |",
                args.seq_len, args.global_batch_tokens
            );
            let mut points = Vec::new();
            let mut first: Option<f64> = None;
            for &nodes in &args.scaling {
                let c = cluster(args, preset, nodes)?;
                let cal = calibration_for(args, &workload.model, &c.gpu)?;
                let ranked = restrict(args, &workload, &c, &cal, plan::search(&workload, &c, &cal));
                let Some(best) = ranked.first().filter(|p| p.fits) else {
                    println!(
                        "| {nodes} | {} | no layout fits | | | | | | | | | | |",
                        c.world()
                    );
                    continue;
                };
                let tflops = best.flops_per_gpu / 1e12;
                let base = *first.get_or_insert(tflops);
                let l = best.layout;
                println!(
                    "| {nodes} | {} | {} | {} | {} x {}{} | {}{} | {} | {} | {:.1} GiB | {:.2} s | \
                     {:.2} s | {tflops:.1} | {:.1} % |",
                    c.world(),
                    l.tp,
                    l.sdp,
                    l.micro_batch,
                    best.micro_batches,
                    if l.reduce_every_micro_batch {
                        ", reduced each"
                    } else {
                        ""
                    },
                    l.recomputed_layers,
                    if l.selective { " (selective)" } else { "" },
                    if l.offload { "yes" } else { "no" },
                    if l.fp8 { "yes" } else { "no" },
                    best.memory_bytes as f64 / (1u64 << 30) as f64,
                    best.step_s,
                    best.exposed_comm_s,
                    100.0 * tflops / base
                );
                points.push((nodes as f64, tflops));
            }
            series.push((format!("{name} on {preset}"), points));
        }
    }
    if let Some(path) = &args.svg {
        plan::write_scaling_svg(
            path,
            &format!(
                "Predicted model TFLOP/s per GPU, S={}, {} tokens per step",
                args.seq_len, args.global_batch_tokens
            ),
            "model TFLOP/s per GPU",
            &series,
        )?;
        println!("\nwrote {}", path.display());
    }
    Ok(())
}

/// `llama2_train plan calibrate ...`: runs this binary on the GPU for each calibration shape.
pub fn calibrate(args: &CalibrateArgs) -> Result<(), DynError> {
    if args.out.exists() && !args.overwrite {
        return Err(format!(
            "{} exists; pass --overwrite to replace it",
            args.out.display()
        )
        .into());
    }
    if let Some(path) = &args.from_runs {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let measured: MeasuredRuns =
            serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        let model = format!(
            "{} hidden",
            measured.runs.first().map_or(0, |r| r.hidden_size)
        );
        return fit_and_report(args, &model, &measured.gpu, &measured.runs);
    }
    let mut layers = args.layers.clone();
    layers.sort_unstable();
    layers.dedup();
    if layers.len() < 2 || layers[0] == 0 || args.seq_lens.is_empty() || args.steps < 4 {
        return Err(format!(
            "calibration needs two or more layer counts above 0 (got {:?}), a sequence length \
             and at least 4 steps (got {})",
            args.layers, args.steps
        )
        .into());
    }
    let model = LlamaConfig::preset(&args.model)?;
    let exe = std::env::current_exe()?;
    let gpu = detect_gpu()?;
    // On an FP8 GPU, the deepest bf16 run at the first S >= 4096 again with FP8 linear layers:
    // it measures FP8's speedup.
    let mut shapes: Vec<_> = plan::calibration_shapes(&args.seq_lens, &layers)
        .into_iter()
        .map(|shape| (shape, false))
        .collect();
    if gpu.peak_fp8_flops.is_some()
        && let Some(&(twin, _)) = shapes.iter().find(|((l, s, mb, r), _)| {
            *l == layers[layers.len() - 1] && *s >= 4096 && *mb == 1 && *r == 0
        })
    {
        shapes.push((twin, true));
    }
    let mut runs = Vec::new();
    for (i, &((l, s, mb, r), fp8)) in shapes.iter().enumerate() {
        let precision = if fp8 { "-fp8" } else { "" };
        let dir = args
            .work_dir
            .join(format!("l{l}-s{s}-mb{mb}-r{r}{precision}"));
        eprintln!(
            "[{}/{}] {} widths, {l} layers, S={s}, micro-batch {mb}, {r} recomputed{}",
            i + 1,
            shapes.len(),
            args.model,
            if fp8 { ", FP8" } else { "" }
        );
        let mut cmd = Command::new(&exe);
        cmd.args([
            "--device",
            "cuda",
            "--nproc-per-node",
            "1",
            "--model",
            &args.model,
        ]);
        cmd.args(["--layers", &l.to_string(), "--seq-len", &s.to_string()]);
        cmd.args(["--micro-batch", &mb.to_string()]);
        cmd.args(["--global-batch-tokens", &(mb * s).to_string()]);
        cmd.args(["--steps", &args.steps.to_string(), "--eval-interval", "0"]);
        cmd.args(["--no-checkpoint", "--export-hf", "none", "--sample", "none"]);
        cmd.args(["--no-progress", "--overwrite", "--out-dir"]);
        cmd.arg(&dir);
        if r == 0 {
            cmd.args(["--activation-checkpointing", "false"]);
        } else {
            cmd.args(["--checkpointed-layers", &r.to_string()]);
        }
        if let Some(t) = &args.tokenizer {
            cmd.arg("--tokenizer").arg(t);
        }
        if fp8 {
            cmd.args(["--fp8", "tensorwise"]);
        }
        let status = cmd.status()?;
        if !status.success() {
            return Err(format!("calibration run in {} failed ({status})", dir.display()).into());
        }
        let metrics = llama::metrics::read_metrics(dir.join("metrics.jsonl"))?;
        let times: Vec<f64> = metrics
            .iter()
            .skip(2)
            .filter(|m| m.tokens_per_sec > 0.0)
            .map(|m| (mb * s) as f64 / m.tokens_per_sec)
            .collect();
        if times.is_empty() {
            return Err(format!("{}: no timed steps after the second", dir.display()).into());
        }
        runs.push(CalibrationRun {
            layers: l,
            hidden_size: model.hidden_size,
            intermediate_size: model.intermediate_size,
            heads: model.num_attention_heads,
            vocab_size: model.vocab_size,
            seq_len: s,
            micro_batch: mb,
            recomputed_layers: r,
            fp8,
            step_s: times.iter().sum::<f64>() / times.len() as f64,
            predicted_s: 0.0,
        });
    }
    // Saved before the fit, so that a fit that fails leaves the measurements.
    let raw = args.out.with_extension("runs.json");
    let measured = MeasuredRuns { gpu, runs };
    std::fs::write(&raw, serde_json::to_string_pretty(&measured)?)?;
    fit_and_report(args, &args.model, &measured.gpu, &measured.runs)
}

fn fit_and_report(
    args: &CalibrateArgs,
    model: &str,
    gpu: &Gpu,
    runs: &[CalibrationRun],
) -> Result<(), DynError> {
    let cal = Calibration::fit(gpu, args.optimizer_tbps * 1e12, runs)?;
    cal.save(&args.out)?;
    let attention: Vec<String> = cal
        .attention
        .iter()
        .map(|r| format!("{:.0} at S={}", r.flops / 1e12, r.seq_len))
        .collect();
    let fp8 = cal
        .fp8_linear_speedup
        .map_or(String::new(), |s| format!(", FP8 linear layers {s:.3}x"));
    println!(
        "{}, {} widths: linear {:.0} TFLOP/s, attention {} TFLOP/s, optimizer {:.2} TB/s (given)\
         {fp8}\n\n| layers | S | micro-batch | recomputed | fp8 | measured | fitted |\n\
         | --- | --- | --- | --- | --- | --- | --- |",
        cal.gpu,
        model,
        cal.linear_flops / 1e12,
        attention.join(", "),
        cal.optimizer_bytes_per_s / 1e12,
    );
    for r in &cal.runs {
        println!(
            "| {} | {} | {} | {} | {} | {:.1} ms | {:.1} ms |",
            r.layers,
            r.seq_len,
            r.micro_batch,
            r.recomputed_layers,
            if r.fp8 { "yes" } else { "no" },
            r.step_s * 1e3,
            r.predicted_s * 1e3
        );
    }
    println!("\nwrote {}", args.out.display());
    Ok(())
}

/// The first CUDA GPU as the planner describes it.
#[cfg(feature = "cuda")]
fn detect_gpu() -> Result<Gpu, DynError> {
    let name = super::cuda_device_name(0).ok_or("no CUDA device to calibrate")?;
    let peak = llama::metrics::device_peak_flops(&name).ok_or_else(|| {
        format!("no bf16 peak known for \"{name}\" (llama::metrics::PEAK_FLOPS_16BIT)")
    })?;
    Ok(Gpu {
        memory_bytes: smp_burn::cuda::cuda_device_memory(0).unwrap_or(0),
        name,
        peak_bf16_flops: peak,
        // Ada's and Hopper's FP8 tensor cores run at twice their bf16 rate.
        peak_fp8_flops: smp_burn::cuda::fp8::fp8_capable(0).then_some(2.0 * peak),
    })
}

#[cfg(not(feature = "cuda"))]
fn detect_gpu() -> Result<Gpu, DynError> {
    Err(super::NO_CUDA.into())
}

/// `--auto`: the planner's best layout for `world` GPUs of the kind of GPU 0 (one node, or
/// `world / LOCAL_WORLD_SIZE` nodes under a launcher), keeping every layout setting the user
/// gave explicitly. Returns the configuration to run and the prediction for it.
#[cfg(feature = "cuda")]
pub fn auto_layout(
    resolved: &llama::train::ResolvedConfig,
    mut config: llama::train::TrainConfig,
    world: usize,
) -> Result<(llama::train::TrainConfig, plan::Prediction), DynError> {
    let mut gpu = detect_gpu()?;
    if let Some(t) = config.peak_tflops {
        gpu.peak_bf16_flops = t * 1e12;
    }
    let per_node = std::env::var("LOCAL_WORLD_SIZE")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&n| n > 0 && world.is_multiple_of(n))
        .unwrap_or(world);
    let cluster = Cluster {
        name: "this machine".into(),
        nodes: world / per_node,
        gpus_per_node: per_node,
        ..Cluster::preset("h200", 1)?
    };
    let cluster = Cluster { gpu, ..cluster };
    // Packed documents' attention share is known only once the data is read, after the layout
    // is chosen: the plan counts whole rows' attention, which overstates a masked step's time.
    if config.document_masking {
        tracing::info!(
            "--auto with --document-masking: the plan prices attention over whole rows; the \
             masked step does less (see the logged share; `llama2_train plan --attention-share` \
             prices it)"
        );
    }
    let workload = Workload {
        adamw_moments: config.adamw.moments,
        ..Workload::new(
            llama::train::model_config(&config, 1)?,
            config.seq_len,
            config.global_batch_tokens,
        )
    };
    let calibration = Calibration::nearest(&Calibration::h200(), &workload.model, &cluster.gpu)?;
    let explicit = |key: &str| resolved.is_explicit(key);
    let p = &config.parallel;
    let dp = |tp: usize| world / tp.max(1);
    let keeps = |l: &plan::Layout| {
        (!explicit("parallel.tensor_parallel_degree") || l.tp == p.tensor_parallel_degree)
            && (!explicit("parallel.hybrid_shard_degree")
                || l.sdp
                    == match p.hybrid_shard_degree {
                        0 => dp(l.tp),
                        d => d,
                    })
            && (!explicit("micro_batch") || l.micro_batch == config.micro_batch)
            && (!explicit("parallel.activation_offloading") || l.offload == p.activation_offloading)
            && (!explicit("parallel.selective_recompute")
                || l.selective == p.selective_recompute
                || (l.recomputed_layers == 0 && p.selective_recompute))
            // FP8 changes the numerics: the planner follows the run's recipe, never picks it.
            && l.fp8 == smp_burn::kernel_config::fp8_recipe().enabled()
    };
    let ranked = plan::search(&workload, &cluster, &calibration);
    let best = ranked
        .into_iter()
        .find(|c| {
            // A layout of one micro-batch reduces once either way.
            let reduces_as_asked = !explicit("parallel.reduce_every_micro_batch")
                || c.layout.reduce_every_micro_batch == p.reduce_every_micro_batch
                || c.micro_batches == 1;
            c.fits && keeps(&c.layout) && reduces_as_asked
        })
        .ok_or_else(|| {
            format!(
                "--auto: no layout of {} tokens per step in sequences of {} fits {world} x {} \
                 with the settings given",
                config.global_batch_tokens, config.seq_len, cluster.gpu.name
            )
        })?;
    // Recomputation the user fixed is predicted as given.
    let best = if explicit("parallel.activation_checkpointing")
        || explicit("parallel.checkpointed_layers")
    {
        let layers = workload.model.num_hidden_layers;
        let recomputed = match (p.activation_checkpointing, p.checkpointed_layers) {
            (false, _) => 0,
            (true, Some(n)) => n.min(layers),
            (true, None) => layers,
        };
        plan::predict(
            &workload,
            &cluster,
            &calibration,
            plan::Layout {
                recomputed_layers: recomputed,
                offload: p.activation_offloading,
                selective: p.selective_recompute && recomputed > 0,
                ..best.layout
            },
        )
        .unwrap_or(best)
    } else {
        best
    };
    let l = best.layout;
    config.parallel.tensor_parallel_degree = l.tp;
    config.parallel.hybrid_shard_degree = if l.sdp == dp(l.tp) { 0 } else { l.sdp };
    config.micro_batch = l.micro_batch;
    if !explicit("parallel.activation_checkpointing") && !explicit("parallel.checkpointed_layers") {
        config.parallel.activation_checkpointing = l.recomputed_layers > 0;
        config.parallel.checkpointed_layers = Some(l.recomputed_layers);
        config.parallel.activation_offloading = l.offload && l.recomputed_layers > 0;
        if !explicit("parallel.selective_recompute") {
            config.parallel.selective_recompute = l.selective && l.recomputed_layers > 0;
        }
    }
    if !explicit("parallel.reduce_every_micro_batch") {
        config.parallel.reduce_every_micro_batch = l.reduce_every_micro_batch;
    }
    tracing::info!(
        "planner (--auto): tp {}, shard degree {}, {} replica(s), micro-batch {} x {}, {} layer(s) \
         recomputed{}{}; predicts {:.3} s per step ({:.3} compute, {:.3} exposed communication), \
         {:.0} tokens/s, {:.1} GiB per GPU",
        l.tp,
        l.sdp,
        best.replicas,
        l.micro_batch,
        best.micro_batches,
        l.recomputed_layers,
        if l.offload { ", offloaded" } else { "" },
        if l.fp8 { ", FP8 linear layers" } else { "" },
        best.step_s,
        best.compute_s,
        best.exposed_comm_s,
        best.tokens_per_s,
        best.memory_bytes as f64 / (1u64 << 30) as f64
    );
    Ok((config, best))
}

#[cfg(not(feature = "cuda"))]
pub fn auto_layout(
    _: &llama::train::ResolvedConfig,
    _: llama::train::TrainConfig,
    _: usize,
) -> Result<(llama::train::TrainConfig, plan::Prediction), DynError> {
    Err(super::NO_CUDA.into())
}

/// Prints the planner's prediction beside the run's measured step (the median of the steps
/// after the third, from metrics.jsonl) and memory.
pub fn compare_with_prediction(
    config: &llama::train::TrainConfig,
    p: &plan::Prediction,
) -> Result<(), DynError> {
    let metrics = llama::metrics::read_metrics(config.out_dir.join("metrics.jsonl"))?;
    let mut rates: Vec<f64> = metrics
        .iter()
        .skip(3)
        .map(|m| m.tokens_per_sec)
        .filter(|t| t.is_finite() && *t > 0.0)
        .collect();
    let memory = metrics.iter().filter_map(|m| m.peak_mem_bytes).max();
    if rates.is_empty() {
        println!(
            "planner: predicted {:.0} tokens/s; too few steps to compare (need 4+)",
            p.tokens_per_s
        );
        return Ok(());
    }
    rates.sort_by(f64::total_cmp);
    let measured = rates[rates.len() / 2];
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    println!(
        "planner: predicted {:.0} tokens/s ({:.3} s per step), measured {measured:.0} (median of \
         steps 4-{}): prediction / measured {:.3}; memory predicted {:.1} GiB, measured {}",
        p.tokens_per_s,
        p.step_s,
        metrics.len(),
        p.tokens_per_s / measured,
        gib(p.memory_bytes),
        memory.map_or("-".into(), |m| format!("{:.1} GiB", gib(m)))
    );
    Ok(())
}
