//! Sharded checkpoints through the trainer behind `llama2_train`, on CPU thread-ranks with the
//! `tiny` model: a checkpoint written by one layout resumes in others, damage is found and the
//! run falls back to an older checkpoint, old checkpoints are pruned.
//!
//! Tolerance: as `tp_e2e.rs`. Other layouts regroup f32 sums (reduce-scatters over other
//! degrees, tensor-parallel partial products), so their losses match the uninterrupted run's
//! within 1e-4 relative (a step changes the loss by ~1e-2).

use std::path::Path;

use llama::train::{self, TrainConfig};
use smp_burn::fsdp::AdamW;

use smp_burn_tests::trainer::{Fixture, checkpoint_tensors, train, try_train};

/// `steps` steps at a constant learning rate, `micro_batch` rows per data-parallel rank.
fn config(fx: &Fixture, name: &str, steps: u64, micro_batch: usize) -> TrainConfig {
    TrainConfig {
        steps,
        micro_batch,
        warmup_steps: 0,
        lr: 3e-3,
        min_lr: 3e-3,
        eval_interval: 0,
        adamw: AdamW {
            eps: 1e-3,
            ..AdamW::default()
        },
        ..fx.base_config(name)
    }
}

fn assert_losses(got: &[f64], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: steps");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let rel = (g - w).abs() / w.abs();
        assert!(
            rel <= 1e-4,
            "{what}: loss {i}: {g} vs {w} ({rel:.1e}); all {got:?} vs {want:?}"
        );
    }
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

/// The committed `step-*` directories of a run, oldest first.
fn steps_of(dir: &Path) -> Vec<String> {
    let mut steps: Vec<String> = std::fs::read_dir(dir.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step-"))
        .collect();
    steps.sort();
    steps
}

/// A checkpoint written by 4 ranks with full sharding (each rank writes its quarter of every
/// unit) resumes on 2 ranks with tensor parallelism 2, on 2 ranks as 2 replicas (hybrid
/// sharding of degree 1), and on 1 rank, and each continues as the uninterrupted 4-rank run
/// does. The global batch is 16 rows in every layout.
#[test]
fn a_sharded_checkpoint_resumes_in_any_layout() {
    let fx = Fixture::new();
    let straight = train(config(&fx, "straight", 6, 4), 4);
    let first = train(config(&fx, "split", 3, 4), 4);
    assert_losses(&first.losses, &straight.losses[..3], "the first 3 steps");
    let latest = train::latest_checkpoint(&fx.path("split"))
        .unwrap()
        .expect("a checkpoint");
    let files: Vec<String> = std::fs::read_dir(&latest)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".safetensors"))
        .collect();
    assert_eq!(files.len(), 4, "one file per rank: {files:?}");
    let saved = checkpoint_tensors(&latest);

    for (name, world, tp, hybrid, micro_batch) in [
        ("tp2", 2, 2, 0, 16),
        ("replicas", 2, 1, 1, 8),
        ("one", 1, 1, 0, 16),
    ] {
        copy_dir(&fx.path("split"), &fx.path(name));
        let mut cfg = TrainConfig {
            resume: true,
            ..config(&fx, name, 6, micro_batch)
        };
        cfg.parallel.tensor_parallel_degree = tp;
        cfg.parallel.hybrid_shard_degree = hybrid;
        let resumed = train(cfg, world);
        assert_losses(
            &resumed.losses,
            &straight.losses[3..],
            &format!("steps 4-6 resumed as {name}"),
        );
    }
    // Resuming read the checkpoint without changing it.
    assert!(checkpoint_tensors(&latest) == saved);
}

/// A flipped byte in the newest checkpoint's shard file is found by its checksum: the run says
/// which file and falls back to the checkpoint before, continuing from there; when every
/// checkpoint is damaged, resuming is an error naming each.
#[test]
fn a_damaged_checkpoint_falls_back_to_the_one_before() {
    let fx = Fixture::new();
    let cfg = |steps| TrainConfig {
        checkpoint_interval: 1,
        ..config(&fx, "damaged", steps, 4)
    };
    let straight = train(cfg(4), 1);
    std::fs::remove_dir_all(fx.path("damaged")).unwrap();
    train(cfg(2), 1);
    assert_eq!(
        steps_of(&fx.path("damaged")),
        ["step-000001", "step-000002"]
    );
    let flip = |step: &str| {
        let file = fx
            .path("damaged")
            .join("checkpoints")
            .join(step)
            .join("tp000-shard00000.safetensors");
        let mut bytes = std::fs::read(&file).unwrap();
        let at = bytes.len() - 100;
        bytes[at] ^= 0x01;
        std::fs::write(&file, bytes).unwrap();
    };
    flip("step-000002");
    let resumed = train(
        TrainConfig {
            resume: true,
            ..cfg(4)
        },
        1,
    );
    assert_losses(
        &resumed.losses,
        &straight.losses[1..],
        "steps 2-4 from the step-1 checkpoint",
    );

    // Both damaged: an error naming both, nothing trained.
    std::fs::remove_dir_all(fx.path("damaged")).unwrap();
    train(cfg(2), 1);
    flip("step-000001");
    flip("step-000002");
    let e = try_train(
        TrainConfig {
            resume: true,
            ..cfg(4)
        },
        1,
    )
    .expect_err("every checkpoint is damaged");
    assert!(
        e.contains("no intact checkpoint")
            && e.contains("step-000001")
            && e.contains("step-000002")
            && e.contains("CRC32"),
        "{e}"
    );
}

/// `keep_checkpoints` keeps the newest K committed checkpoints; 0 is refused.
#[test]
fn keep_checkpoints_prunes_older_ones() {
    let fx = Fixture::new();
    let cfg = TrainConfig {
        checkpoint_interval: 1,
        keep_checkpoints: Some(2),
        ..config(&fx, "keep", 4, 4)
    };
    train(cfg.clone(), 2);
    assert_eq!(steps_of(&fx.path("keep")), ["step-000003", "step-000004"]);
    let e = try_train(
        TrainConfig {
            keep_checkpoints: Some(0),
            out_dir: fx.path("keep0"),
            ..cfg
        },
        1,
    )
    .expect_err("keep 0");
    assert!(e.contains("keep_checkpoints = 0"), "{e}");
}
