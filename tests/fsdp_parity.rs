//! N-rank sharded training must match 1-rank training.
//!
//! Tolerance: f32 throughout. The sharded run computes each rank's mean loss over its own rows
//! and averages the ranks' gradients, where one rank averages over all rows at once: the same
//! sums in a different order, so results differ by float rounding only (about 1e-7 relative per
//! operation). The runs use AdamW with a large epsilon (see `train_rank`) so that rounding noise
//! in near-zero gradients is not amplified into full-size updates of random sign. We accept
//! relative differences of 2e-5 on losses and 1e-3 on parameters (relative to each tensor's
//! largest magnitude); a real bug (a missing shard, a wrong slice, a double-counted replica)
//! moves them by orders of magnitude more.

use collectives::{CommOptions, run_on_threads};
use llama::LlamaConfig;
use smp_burn::ParallelConfig;
use smp_burn_tests::{RunResult, assert_matches, train_rank};

const STEPS: usize = 3;
const GLOBAL_BATCH: usize = 12;
const SEQ: usize = 16;

fn run(world: usize, parallel: ParallelConfig, micro_batches: usize) -> Vec<RunResult> {
    let config = LlamaConfig::preset("tiny").unwrap();
    let opts = CommOptions {
        timeout: std::time::Duration::from_secs(60),
    };
    run_on_threads(world, opts, |comm| {
        train_rank(
            comm,
            &parallel,
            &config,
            STEPS,
            GLOBAL_BATCH,
            SEQ,
            micro_batches,
        )
    })
}

fn parallel(sdp: usize, checkpointing: bool) -> ParallelConfig {
    ParallelConfig {
        hybrid_shard_degree: sdp,
        activation_checkpointing: checkpointing,
        ..Default::default()
    }
}

#[test]
fn sharded_training_matches_one_rank() {
    let reference = run(1, parallel(0, true), 1).remove(0);
    assert!(
        reference.losses[STEPS - 1] < reference.losses[0],
        "the model should learn: {:?}",
        reference.losses
    );
    for world in [2, 3, 4] {
        let runs = run(world, parallel(0, true), 1);
        for (rank, r) in runs.iter().enumerate() {
            assert_matches(
                &reference,
                r,
                &format!("full sharding, {world} ranks, rank {rank}"),
            );
        }
    }
}

#[test]
fn hybrid_sharding_matches_one_rank() {
    let reference = run(1, parallel(0, true), 1).remove(0);
    for r in run(4, parallel(2, true), 1) {
        assert_matches(&reference, &r, "hybrid 2 x 2");
    }
}

#[test]
fn without_checkpointing_and_with_accumulation() {
    let reference = run(1, parallel(0, true), 2).remove(0);
    for r in run(2, parallel(0, false), 2) {
        assert_matches(&reference, &r, "2 ranks, no checkpointing, 2 micro-batches");
    }
    // Checkpointing changes nothing but memory.
    let plain = run(1, parallel(0, false), 2).remove(0);
    assert_matches(&reference, &plain, "1 rank without checkpointing");
}

/// Recomputing only some layers (the first one of two) gives the all-recomputed results: on one
/// rank, and on 2 ranks with prefetch (whose backward must skip the kept layer's gather) and
/// without. Not bitwise: the recomputed and the kept graphs sum some gradients in a different
/// order (so do all-recomputed and none-recomputed runs), hence `assert_matches`' tolerance.
#[test]
fn partial_checkpointing_matches_full() {
    let reference = run(1, parallel(0, true), 1).remove(0);
    let one = ParallelConfig {
        checkpointed_layers: Some(1),
        ..parallel(0, true)
    };
    assert_matches(
        &reference,
        &run(1, one, 1).remove(0),
        "1 rank, first layer recomputed",
    );
    for prefetch_depth in [1, 0] {
        let partial = ParallelConfig {
            checkpointed_layers: Some(1),
            prefetch_depth,
            ..parallel(0, true)
        };
        for r in run(2, partial, 1) {
            assert_matches(
                &reference,
                &r,
                &format!("2 ranks, first layer recomputed, prefetch {prefetch_depth}"),
            );
        }
    }
}

/// Activation offloading moves the recomputed layers' inputs to host memory and back; the
/// values round-trip exactly (`smp_burn::offload`'s unit test), so the results are those without
/// offloading, whatever the loading horizon (1, 2, and more than the layers), on 1 and 2 ranks,
/// with accumulation, and when only some layers recompute (the others keep their graph on the
/// device). Compared within `assert_matches`' tolerance, not bitwise: CPU training here differs
/// by an ulp or two between identical runs in one process (see `e2e.rs`), offloaded or not.
#[test]
fn offloading_changes_nothing_but_memory() {
    let offloaded = |base: ParallelConfig, horizon: usize| ParallelConfig {
        activation_offloading: true,
        activation_loading_horizon: horizon,
        ..base
    };
    let reference = run(1, parallel(0, true), 2).remove(0);
    assert_eq!(reference.offloaded_bytes, 0);
    // A micro-batch on one rank: 12 rows x 16 tokens x hidden 64 x 4 bytes, per layer.
    let layer_input = GLOBAL_BATCH * SEQ * 64 * 4;
    for horizon in [1, 2, 5] {
        let r = run(1, offloaded(parallel(0, true), horizon), 2).remove(0);
        assert_matches(&reference, &r, &format!("1 rank, horizon {horizon}"));
        assert_eq!(
            r.offloaded_bytes,
            2 * layer_input,
            "both layers' inputs offloaded"
        );
    }
    let partial = ParallelConfig {
        checkpointed_layers: Some(1),
        ..parallel(0, true)
    };
    for (rank, r) in run(2, offloaded(partial, 1), 2).iter().enumerate() {
        // Each of the 2 ranks holds half of a micro-batch's rows; only layer 0 recomputes.
        assert_eq!(r.offloaded_bytes, layer_input / 2, "rank {rank}");
        assert_matches(
            &reference,
            r,
            &format!("2 ranks, first layer recomputed and offloaded, rank {rank}"),
        );
    }
}

/// Reducing after every micro-batch (no full-gradient accumulation between them) gives the
/// results of reducing once per step: on 2 ranks with full sharding and on 4 with hybrid
/// sharding, 2 micro-batches each.
#[test]
fn reducing_every_micro_batch_matches_one_rank() {
    let reference = run(1, parallel(0, true), 2).remove(0);
    for (world, degree) in [(2, 0), (4, 2)] {
        let each = ParallelConfig {
            reduce_every_micro_batch: true,
            ..parallel(degree, true)
        };
        for r in run(world, each, 2) {
            assert_matches(
                &reference,
                &r,
                &format!("{world} ranks, shard degree {degree}, reduced every micro-batch"),
            );
        }
    }
}

/// Selective recomputation: each recomputed layer keeps its attention's output and its
/// recomputation takes it back (a layer whose recomputation found nothing kept, or left some
/// unused, fails the step). The results are those of full recomputation, on 1 and 2 ranks,
/// with one layer keeping its graph and with offloading. The CPU's reference attention
/// recomputes to differentiate, so the values agree to rounding.
#[test]
fn selective_recomputation_matches_full() {
    let reference = run(1, parallel(0, true), 2).remove(0);
    let selective = ParallelConfig {
        selective_recompute: true,
        ..parallel(0, true)
    };
    assert_matches(
        &reference,
        &run(1, selective.clone(), 2).remove(0),
        "1 rank, selective",
    );
    let partial_offloaded = ParallelConfig {
        checkpointed_layers: Some(1),
        activation_offloading: true,
        activation_loading_horizon: 1,
        ..selective
    };
    for r in run(2, partial_offloaded, 2) {
        assert_matches(
            &reference,
            &r,
            "2 ranks, selective, first layer recomputed and offloaded",
        );
    }
}

#[test]
fn each_rank_holds_a_quarter_of_the_state() {
    let one = run(1, parallel(0, true), 1).remove(0);
    for r in run(4, parallel(0, true), 1) {
        let ratio = r.state_bytes as f64 / one.state_bytes as f64;
        // Padding to a multiple of 4 adds at most 3 elements per unit.
        assert!(
            (ratio - 0.25).abs() < 0.01,
            "rank holds {ratio:.4} of the 1-rank state"
        );
    }
}

/// Delayed initialization: each rank creates only its own chunk, yet the gathered model is
/// bitwise the model one rank creates from the same seed (no training step involved).
#[test]
fn sharded_init_equals_unsharded_init() {
    let config = LlamaConfig::preset("tiny").unwrap();
    let opts = CommOptions {
        timeout: std::time::Duration::from_secs(60),
    };
    let init = |world: usize, sdp: usize| {
        let p = parallel(sdp, true);
        run_on_threads(world, opts.clone(), |comm| {
            train_rank(comm, &p, &config, 0, GLOBAL_BATCH, SEQ, 1)
        })
    };
    let reference = init(1, 0).remove(0);
    for (world, sdp) in [(3, 0), (4, 2)] {
        for r in init(world, sdp) {
            assert_eq!(
                r.params, reference.params,
                "{world} ranks, sdp {sdp}: initial weights differ"
            );
        }
    }
}

/// Runs every `(world, sdp, checkpointing)` layout with `prefetch_depth = 1` and
/// `micro_batches` per step, and checks every rank against the 1-rank run.
fn assert_prefetch_matches_one_rank(micro_batches: usize, layouts: &[(usize, usize, bool)]) {
    let reference = run(1, parallel(0, true), micro_batches).remove(0);
    for &(world, sdp, checkpointing) in layouts {
        let config = ParallelConfig {
            prefetch_depth: 1,
            ..parallel(sdp, checkpointing)
        };
        for (rank, r) in run(world, config, micro_batches).iter().enumerate() {
            assert_matches(
                &reference,
                r,
                &format!(
                    "{world} ranks, sdp {sdp}, checkpointing {checkpointing}, prefetch, \
                     {micro_batches} micro-batch(es), rank {rank}"
                ),
            );
        }
    }
}

/// Prefetching the next unit's all-gather (`prefetch_depth = 1`) changes when collectives are
/// started, not what they compute: 2- and 4-rank runs (4 = hybrid 2 x 2) with prefetch, with
/// and without checkpointing, match the 1-rank run.
#[test]
fn prefetch_matches_one_rank() {
    assert_prefetch_matches_one_rank(1, &[(2, 0, true), (2, 0, false), (4, 2, true)]);
}

/// Prefetch also leaves each unit's gradient reduce-scatter pending until the next unit's has
/// started: with gradient accumulation (the last micro-batch reduces the deferred sum) and in
/// hybrid mode (the replica all-reduce runs when a unit is finished), 2 and 4 ranks still
/// match the 1-rank run.
#[test]
fn prefetch_with_accumulation_matches_one_rank() {
    assert_prefetch_matches_one_rank(2, &[(2, 0, false), (4, 2, true), (4, 2, false)]);
}
