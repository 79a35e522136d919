//! The 8-GPU layouts of the scaling plan, simulated on 8 CPU thread-ranks with the tiny model:
//! full sharding (hybrid_shard_degree 0) and hybrid sharding over groups of 2, 4 and 8 must each
//! train like one rank, and each rank must hold 1/shard of the state.
//!
//! Tolerances are those of `fsdp_parity.rs` (see [`smp_burn_tests::assert_matches`]): the same
//! sums in another order, so f32 rounding only.

use collectives::{CommOptions, run_on_threads};
use llama::LlamaConfig;
use smp_burn::ParallelConfig;
use smp_burn_tests::{RunResult, assert_matches, train_rank};

const WORLD: usize = 8;
const STEPS: usize = 3;
/// Divisible by 8: each rank trains on 2 rows.
const GLOBAL_BATCH: usize = 16;
const SEQ: usize = 8;

fn run(world: usize, hybrid_shard_degree: usize) -> Vec<RunResult> {
    let config = LlamaConfig::preset("tiny").unwrap();
    let parallel = ParallelConfig {
        hybrid_shard_degree,
        activation_checkpointing: true,
        ..Default::default()
    };
    let opts = CommOptions {
        timeout: std::time::Duration::from_secs(60),
    };
    run_on_threads(world, opts, |comm| {
        train_rank(comm, &parallel, &config, STEPS, GLOBAL_BATCH, SEQ, 1)
    })
}

#[test]
fn eight_rank_layouts_match_one_rank() {
    let reference = run(1, 0).remove(0);
    // hybrid_shard_degree 0 shards over all 8 ranks.
    for (sdp, shard) in [(0, 8), (2, 2), (4, 4), (8, 8)] {
        let runs = run(WORLD, sdp);
        assert_eq!(runs.len(), WORLD);
        for (rank, r) in runs.iter().enumerate() {
            let what = format!("world {WORLD}, hybrid_shard_degree {sdp}, rank {rank}");
            assert_matches(&reference, r, &what);
            // Each unit is padded to a multiple of the shard size: at most shard - 1 elements
            // per unit, a tiny fraction of the tiny model's units.
            let ratio = r.state_bytes as f64 / reference.state_bytes as f64;
            assert!(
                (ratio * shard as f64 - 1.0).abs() < 0.01,
                "{what}: rank holds {ratio:.4} of the 1-rank state, expected 1/{shard}"
            );
        }
    }
}
