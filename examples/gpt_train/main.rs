//! Trains a GPT-2 style model (`model.rs`: LayerNorm with bias, GELU, learned positions, tied
//! embeddings) with smp-burn on bytes of the embedded Shakespeare corpus: a model that shares
//! nothing with the Llama crate, parallelized in about twenty lines (`train` below).
//!
//! ```text
//! cargo run --release -p smp-burn --example gpt_train                                   # 1 CPU rank
//! cargo run --release -p smp-burn --example gpt_train -- --ranks 4 --hybrid-shard-degree 2
//! cargo run --release -p smp-burn --example gpt_train -- --ranks 4 --tensor-parallel-degree 2
//! gpt_train --device cuda --backend cube|fusion --ranks 1 --layers 12 --d-model 768 --seq-len 1024
//! ```

mod model;

use std::io::Read;
use std::sync::Arc;
use std::time::Instant;

use burn::backend::{Autodiff, NdArray};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Int, Tensor, TensorData};
use clap::Parser;
use collectives::{CommOptions, Communicator, run_on_threads};
use model::{GptConfig, gpt_units};
use smp_burn::engine::{EngineBuilder, Group, Init};
use smp_burn::mesh::Mesh;
use smp_burn::{ParallelConfig, Precision};

#[derive(Parser, Debug, Clone)]
#[command(about = "Train a GPT-2 style model with smp-burn on the embedded Shakespeare corpus")]
struct Args {
    /// `cpu` (NdArray, f32) or `cuda` (bf16 compute, fp32 master weights).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// On CUDA: `cube` (Burn's CubeCL backend) or `fusion` (`burn::backend::Cuda`, with fusion).
    #[arg(long, default_value = "cube")]
    backend: String,
    /// Ranks: CPU threads, or GPUs (one thread each).
    #[arg(long, default_value_t = 1)]
    ranks: usize,
    /// Shard parameters in groups of this many ranks, replicate across groups (0 = all).
    #[arg(long, default_value_t = 0)]
    hybrid_shard_degree: usize,
    /// Split each block over this many ranks (tensor and sequence parallelism).
    #[arg(long, default_value_t = 1)]
    tensor_parallel_degree: usize,
    /// Recompute every block in the backward.
    #[arg(long, default_value_t = false)]
    activation_checkpointing: bool,
    /// Optimizer steps.
    #[arg(long, default_value_t = 200)]
    steps: usize,
    /// Tokens (bytes) per sequence.
    #[arg(long, default_value_t = 128)]
    seq_len: usize,
    /// Sequences per data-parallel rank per step.
    #[arg(long, default_value_t = 8)]
    micro_batch: usize,
    /// Blocks.
    #[arg(long, default_value_t = 4)]
    layers: usize,
    /// Width of the residual stream.
    #[arg(long, default_value_t = 128)]
    d_model: usize,
    /// Attention heads.
    #[arg(long, default_value_t = 4)]
    heads: usize,
    /// Peak learning rate (linear warmup over the first tenth of the steps).
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
}

/// The corpus as bytes (vocabulary 256).
fn corpus() -> Vec<u8> {
    let gz: &[u8] = include_bytes!("../../data/shakespeare.txt.gz");
    let mut text = Vec::new();
    flate2::read::GzDecoder::new(gz)
        .read_to_end(&mut text)
        .expect("the embedded corpus decompresses");
    text
}

/// Rows `first..first + rows` of step `step`'s global batch: random windows of the corpus, the
/// same on every rank for the same row.
fn batch<B: Backend>(
    text: &[u8],
    step: usize,
    first: usize,
    rows: usize,
    seq: usize,
    device: &B::Device,
) -> (Tensor<B, 2, Int>, Tensor<B, 2, Int>) {
    let (mut inputs, mut targets) = (Vec::new(), Vec::new());
    for row in first..first + rows {
        let mut x = ((step as u64) << 32 | row as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        x ^= x >> 29;
        let start = (x % (text.len() - seq - 1) as u64) as usize;
        inputs.extend(text[start..start + seq].iter().map(|&b| b as i64));
        targets.extend(text[start + 1..start + seq + 1].iter().map(|&b| b as i64));
    }
    let t = |v: Vec<i64>| Tensor::from_data(TensorData::new(v, [rows, seq]), device);
    (t(inputs), t(targets))
}

/// One rank's training; returns the final loss and the tokens per second of all ranks over the
/// steps after the warmup.
fn train<B: AutodiffBackend>(
    args: &Args,
    mesh: Mesh<B::InnerBackend>,
    device: &B::Device,
    text: &[u8],
) -> Result<(f64, f64), smp_burn::SmpError> {
    let config = GptConfig {
        vocab: 256,
        max_seq: args.seq_len,
        layers: args.layers,
        heads: args.heads,
        d_model: args.d_model,
        tie_embeddings: true,
    };
    if mesh.rank() == 0 {
        println!("{} parameters", config.num_parameters());
    }
    // --- the parallel setup ---
    let units = gpt_units::<B>(&config, mesh.tp(), device)?;
    let mut engine = EngineBuilder::new(&mesh)
        .init(Init::seeded(42))
        .max_grad_norm(1.0)
        // Decay matrices but not the position table, norms or biases.
        .param_groups(|p| match p.shape.len() >= 2 && !p.name.contains("wpe") {
            true => Group::decay(0.1),
            false => Group::no_decay(),
        })
        .build(units, device)?;
    let warmup = (args.steps / 10).max(1);
    let (mut loss, mut timed_from) = (f64::NAN, None);
    for step in 0..args.steps {
        let first = mesh.dp_rank() * args.micro_batch;
        let micro = batch::<B>(text, step, first, args.micro_batch, args.seq_len, device);
        let lr = args.lr * ((step + 1) as f64 / warmup as f64).min(1.0);
        let stats = engine.train_step([micro], lr)?;
        // --- end of the parallel setup ---
        if step + 1 == warmup {
            timed_from = Some(Instant::now());
        }
        if step % 20 == 0 || step + 1 == args.steps {
            loss = f64::from(
                stats
                    .loss
                    .into_data()
                    .convert::<f32>()
                    .to_vec::<f32>()
                    .unwrap()[0],
            );
            if mesh.rank() == 0 {
                println!("step {step:4}: loss {loss:.4}");
            }
        }
    }
    let tokens = (args.steps - warmup) * args.micro_batch * mesh.dp_size() * args.seq_len;
    let secs = timed_from.map_or(f64::NAN, |t| t.elapsed().as_secs_f64());
    Ok((loss, tokens as f64 / secs))
}

fn parallel_config(args: &Args, dtype: Precision) -> ParallelConfig {
    ParallelConfig {
        hybrid_shard_degree: args.hybrid_shard_degree,
        tensor_parallel_degree: args.tensor_parallel_degree,
        activation_checkpointing: args.activation_checkpointing,
        param_dtype: dtype,
        ..Default::default()
    }
}

fn main() {
    let args = Args::parse();
    let text = corpus();
    let opts = CommOptions::default();
    let results = run_on_threads(args.ranks, opts, |world: Arc<dyn Communicator>| {
        let rank = world.rank();
        match (args.device.as_str(), args.backend.as_str()) {
            ("cpu", _) => {
                let mesh = Mesh::over_host(world, &parallel_config(&args, Precision::F32))?;
                train::<Autodiff<NdArray<f32>>>(&args, mesh, &Default::default(), &text)
            }
            #[cfg(feature = "cuda")]
            ("cuda", "cube") => cuda::<smp_burn::cuda::CudaCube>(&args, world, rank, &text),
            #[cfg(feature = "cuda")]
            ("cuda", "fusion") => cuda::<burn::backend::Cuda>(&args, world, rank, &text),
            #[cfg(not(feature = "cuda"))]
            ("cuda", _) => Err(smp_burn::SmpError::Usage(format!(
                "--device cuda (rank {rank}): this binary was built without the `cuda` feature"
            ))),
            (d, b) => Err(smp_burn::SmpError::Usage(format!(
                "--device {d} --backend {b}: use --device cpu, or --device cuda with --backend \
                 cube or fusion"
            ))),
        }
    });
    let mut failed = false;
    for (rank, r) in results.iter().enumerate() {
        if let Err(e) = r {
            eprintln!("rank {rank}: error: {e}");
            failed = true;
        }
    }
    if failed {
        std::process::exit(1);
    }
    let (loss, tokens_per_sec) = results[0].as_ref().expect("checked above");
    println!(
        "final loss {loss:.4}; {tokens_per_sec:.0} tokens/s over all {} rank(s) ({}, {})",
        args.ranks, args.device, args.backend
    );
    println!(
        "{{\"final_loss\": {loss}, \"tokens_per_sec\": {tokens_per_sec}, \"ranks\": {}, \"backend\": \"{}\"}}",
        args.ranks, args.backend
    );
}

/// One GPU rank on backend `IB` (with autodiff on top), NCCL between ranks.
#[cfg(feature = "cuda")]
fn cuda<IB: smp_burn::cuda::CudaTensors>(
    args: &Args,
    world: Arc<dyn Communicator>,
    rank: usize,
    text: &[u8],
) -> Result<(f64, f64), smp_burn::SmpError> {
    let mesh =
        smp_burn::mesh::nccl_mesh::<IB>(world, &parallel_config(args, Precision::Bf16), rank)?;
    let device = burn::backend::cuda::CudaDevice::new(rank);
    train::<Autodiff<IB>>(args, mesh, &device, text)
}
