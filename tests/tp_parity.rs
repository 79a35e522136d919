//! Tensor parallelism (with sequence parallelism) must train like one rank: TP=2 on 2 ranks,
//! TP=2 x FSDP 2 on 4 ranks, TP=4 on 4 ranks, and the 8-rank mesh replicate 2 x shard 2 x
//! tensor 2, each against the 1-rank run of the same model, data and seed.
//!
//! Tolerance: [`smp_burn_tests::assert_matches`], as `fsdp_parity.rs` (losses within 2e-5
//! relative, gradient norms within 1e-3, parameters within 1e-3 of each tensor's largest
//! magnitude), for the same reason: f32 throughout, and tensor parallelism only regroups sums.
//! A row-parallel projection adds the ranks' partial products in a reduce-scatter where one rank
//! sums all columns in one matmul; each rank's loss is the mean over its chunk of the sequence,
//! and replicated parameters' gradients are summed over the chunks. A wrong slice, a missing
//! gradient sum or a double-counted norm in clipping moves losses and weights by orders of
//! magnitude more (the losses change by ~1e-2 per step).

use collectives::{CommOptions, run_on_threads};
use llama::LlamaConfig;
use smp_burn::{ParallelConfig, ParallelDims};
use smp_burn_tests::{RunResult, assert_matches, train_rank_packed};

const STEPS: usize = 3;
/// Divisible by every data-parallel size used here (1, 2, 4).
const GLOBAL_BATCH: usize = 8;
/// Divisible by every tensor-parallel degree used here (2, 4).
const SEQ: usize = 16;

fn run(
    config: &LlamaConfig,
    world: usize,
    parallel: &ParallelConfig,
    steps: usize,
    micro_batches: usize,
) -> Vec<RunResult> {
    run_packed(config, world, parallel, (steps, micro_batches), None)
}

/// [`run`] with every row packed with documents of `document_lengths`, when given.
fn run_packed(
    config: &LlamaConfig,
    world: usize,
    parallel: &ParallelConfig,
    (steps, micro_batches): (usize, usize),
    document_lengths: Option<&[usize]>,
) -> Vec<RunResult> {
    let opts = CommOptions {
        timeout: std::time::Duration::from_secs(60),
    };
    run_on_threads(world, opts, |comm| {
        train_rank_packed(
            comm,
            parallel,
            config,
            (steps, GLOBAL_BATCH, SEQ, micro_batches),
            document_lengths,
        )
    })
}

fn parallel(tp: usize, sdp: usize, checkpointing: bool) -> ParallelConfig {
    ParallelConfig {
        tensor_parallel_degree: tp,
        hybrid_shard_degree: sdp,
        activation_checkpointing: checkpointing,
        ..Default::default()
    }
}

fn tiny() -> LlamaConfig {
    LlamaConfig::preset("tiny").unwrap()
}

fn check(reference: &RunResult, runs: &[RunResult], what: &str) {
    for (rank, r) in runs.iter().enumerate() {
        assert_matches(reference, r, &format!("{what}, rank {rank}"));
    }
}

/// TP=2 on 2 ranks, with activation checkpointing and without it (the kept graphs run the
/// collectives' backward at the end), the latter with 2 micro-batches of accumulation.
#[test]
fn tp2_matches_one_rank() {
    let config = tiny();
    let reference = run(&config, 1, &parallel(1, 0, true), STEPS, 1).remove(0);
    assert!(
        reference.losses[STEPS - 1] < reference.losses[0],
        "the model should learn: {:?}",
        reference.losses
    );
    check(
        &reference,
        &run(&config, 2, &parallel(2, 0, true), STEPS, 1),
        "tp 2",
    );
    let reference = run(&config, 1, &parallel(1, 0, true), STEPS, 2).remove(0);
    check(
        &reference,
        &run(&config, 2, &parallel(2, 0, false), STEPS, 2),
        "tp 2, no checkpointing, 2 micro-batches",
    );
}

/// TP=2 with activation offloading: each tp rank offloads its chunk of the sequence (the
/// residual stream between the split regions) and brings it back for the recompute.
#[test]
fn tp2_with_offloading_matches_one_rank() {
    let config = tiny();
    let reference = run(&config, 1, &parallel(1, 0, true), STEPS, 2).remove(0);
    let offloaded = ParallelConfig {
        activation_offloading: true,
        activation_loading_horizon: 1,
        ..parallel(2, 0, true)
    };
    let runs = run(&config, 2, &offloaded, STEPS, 2);
    check(&reference, &runs, "tp 2, offloading, 2 micro-batches");
    // Each tp rank offloads its half of the sequence of all 8 rows, for both layers (f32).
    for r in &runs {
        assert_eq!(r.offloaded_bytes, 2 * GLOBAL_BATCH * (SEQ / 2) * 64 * 4);
    }
}

/// TP=2 x FSDP over 2 ranks (4 ranks; FSDP shards each tp rank's layer slice across the 2
/// ranks with the same tp index), and the same with prefetch.
#[test]
fn tp2_with_fsdp2_matches_one_rank() {
    let config = tiny();
    let reference = run(&config, 1, &parallel(1, 0, true), STEPS, 1).remove(0);
    let dims = ParallelDims::new(&parallel(2, 0, true), 4).unwrap();
    assert_eq!((dims.replicate, dims.shard, dims.tensor), (1, 2, 2));
    check(
        &reference,
        &run(&config, 4, &parallel(2, 0, true), STEPS, 1),
        "tp 2 x shard 2",
    );
    let prefetch = ParallelConfig {
        prefetch_depth: 1,
        ..parallel(2, 0, true)
    };
    check(
        &reference,
        &run(&config, 4, &prefetch, STEPS, 1),
        "tp 2 x shard 2, prefetch",
    );
}

/// Rows packed with three documents each: TP 2 x FSDP 2 with selective recomputation (the
/// attention of each document kept and taken back in order) trains like one rank with the same
/// packing, and the packing changes what is learned (so it is not ignored).
#[test]
fn packed_documents_match_one_rank() {
    let config = tiny();
    let lengths = [5, 7, 4];
    let packed = |world, parallel: &ParallelConfig| {
        run_packed(&config, world, parallel, (STEPS, 1), Some(&lengths))
    };
    let reference = packed(1, &parallel(1, 0, true)).remove(0);
    let unpacked = run(&config, 1, &parallel(1, 0, true), STEPS, 1).remove(0);
    for (step, (a, b)) in reference.losses.iter().zip(&unpacked.losses).enumerate() {
        if step > 0 {
            assert!(
                (a - b).abs() > 1e-4 * a.abs(),
                "step {step}: packed loss {a} equals the unpacked {b}"
            );
        }
    }
    let selective = ParallelConfig {
        selective_recompute: true,
        ..parallel(2, 0, true)
    };
    check(
        &reference,
        &packed(4, &selective),
        "packed documents, tp 2 x shard 2, selective recomputation",
    );
}

/// TP=4 on 4 ranks: one query and one key/value head per rank (the tiny shape with 4 key/value
/// heads, since its 2 do not split 4 ways).
#[test]
fn tp4_matches_one_rank() {
    let config = LlamaConfig {
        num_key_value_heads: 4,
        ..tiny()
    };
    let reference = run(&config, 1, &parallel(1, 0, true), STEPS, 1).remove(0);
    check(
        &reference,
        &run(&config, 4, &parallel(4, 0, true), STEPS, 1),
        "tp 4",
    );
}

/// The 8-GPU layout replicate 2 x shard 2 x tensor 2: the planner accepts it and it trains
/// like one rank.
#[test]
fn eight_ranks_replicate2_shard2_tensor2() {
    let p = parallel(2, 2, true);
    let dims = ParallelDims::new(&p, 8).unwrap();
    assert_eq!((dims.replicate, dims.shard, dims.tensor), (2, 2, 2));
    let config = tiny();
    let reference = run(&config, 1, &parallel(1, 0, true), STEPS, 1).remove(0);
    check(
        &reference,
        &run(&config, 8, &p, STEPS, 1),
        "replicate 2 x shard 2 x tensor 2",
    );
}

/// Each rank builds only its own FSDP chunk of its own tp slice of every parameter (row slices
/// of column-parallel weights, strided column blocks of row-parallel ones), yet the model
/// gathered over both groups and joined along the split dimensions is bitwise the model one
/// rank builds from the same seed: slicing at init and joining at export are exact inverses of
/// the unsplit layout.
#[test]
fn tp_init_equals_unsplit_init() {
    let config = tiny();
    let reference = run(&config, 1, &parallel(1, 0, true), 0, 1).remove(0);
    for (world, tp) in [(2, 2), (4, 2)] {
        for (rank, r) in run(&config, world, &parallel(tp, 0, true), 0, 1)
            .iter()
            .enumerate()
        {
            assert_eq!(
                r.params, reference.params,
                "{world} ranks, tp {tp}, rank {rank}: initial weights differ"
            );
        }
    }
}
