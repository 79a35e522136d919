//! The trainer behind `llama2_train` with tensor parallelism: checkpoints, exports, resume
//! across layouts, sampling and the configuration errors, on CPU thread-ranks with the `tiny`
//! model on a 200 KB slice of the embedded corpus.
//!
//! Tolerances: as `e2e.rs` and `fsdp_parity.rs`. Tensor parallelism regroups f32 sums (partial
//! products added in a reduce-scatter, per-chunk loss means averaged, replicated gradients
//! summed over chunks), so runs differ from one rank by rounding: losses within 1e-4 relative
//! (a step changes the loss by ~1e-2), stored tensors within 1e-3 of each tensor's largest
//! magnitude. AdamW's epsilon is 1e-3 so that rounding noise in near-zero gradients does not
//! become full-size updates. Names, shapes, dtypes and `config.json` must be identical.

use std::path::Path;

use llama::hf;
use llama::train::{self, TrainConfig};
use smp_burn::fsdp::AdamW;

use smp_burn_tests::trainer::{Fixture, assert_losses, checkpoint_tensors, train, try_train};

/// `steps` steps of 4 x 32 tokens at a constant learning rate, tensor-parallel over `tp` ranks.
fn config(fx: &Fixture, name: &str, steps: u64, tp: usize) -> TrainConfig {
    let mut c = TrainConfig {
        steps,
        warmup_steps: 0,
        lr: 3e-3,
        min_lr: 3e-3,
        adamw: AdamW {
            eps: 1e-3,
            ..AdamW::default()
        },
        ..fx.base_config(name)
    };
    c.parallel.tensor_parallel_degree = tp;
    c
}

/// Two checkpoint (or export) directories hold the same tensors: identical names and shapes,
/// values within 1e-3 of each tensor's largest magnitude.
fn assert_same_tensors(a: &Path, b: &Path) {
    let (ta, tb) = (
        hf::load_safetensors_dir(a).expect("load a"),
        hf::load_safetensors_dir(b).expect("load b"),
    );
    assert_eq!(
        ta.keys().collect::<Vec<_>>(),
        tb.keys().collect::<Vec<_>>(),
        "tensor names of {} and {}",
        a.display(),
        b.display()
    );
    for (name, x) in &ta {
        let y = &tb[name];
        assert_eq!(x.shape, y.shape, "shape of {name} in {}", b.display());
        let scale = x.data.iter().fold(0f32, |m, v| m.max(v.abs()));
        let diff = x
            .data
            .iter()
            .zip(&y.data)
            .fold(0f32, |m, (p, q)| m.max((p - q).abs()));
        assert!(
            diff <= 1e-3 * scale,
            "{name} in {}: differs by {diff:.2e} (max |x| {scale:.2e})",
            b.display()
        );
    }
}

/// A TP=2 run writes the checkpoint a 1-rank run writes (weights and both AdamW moments, read
/// back as full tensors under the same names and shapes) and the same Hugging Face
/// export; its losses, validation loss and sampled text match too (sampling pads the prompt to
/// a multiple of the degree).
#[test]
fn tp2_checkpoint_export_and_sample_match_one_rank() {
    let fx = Fixture::new();
    let with = |name: &str, tp: usize| TrainConfig {
        export_hf: Some(fx.path(name).join("hf")),
        export_dtype: "f32".into(),
        sample: Some("ROMEO:".into()),
        sample_tokens: 12,
        ..config(&fx, name, 3, tp)
    };
    let one = train(with("one", 1), 1);
    let tp = train(with("tp", 2), 2);
    assert_losses(&tp.losses, &one.losses, "tp 2");
    let (a, b) = (one.final_val_loss.unwrap(), tp.final_val_loss.unwrap());
    assert!((a - b).abs() <= 1e-4 * a, "validation loss {b} vs {a}");
    assert_eq!(tp.sample, one.sample, "sampled text");

    let ckpt = |name: &str| {
        train::latest_checkpoint(&fx.path(name))
            .unwrap()
            .expect("a checkpoint")
    };
    let (c1, c2) = (
        checkpoint_tensors(&ckpt("one")),
        checkpoint_tensors(&ckpt("tp")),
    );
    assert_eq!(
        c1.keys().collect::<Vec<_>>(),
        c2.keys().collect::<Vec<_>>(),
        "tensor names and kinds"
    );
    for (key, (shape, x)) in &c1 {
        let (shape2, y) = &c2[key];
        assert_eq!(shape, shape2, "shape of {key:?}");
        let scale = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let diff = x.iter().zip(y).fold(0f32, |m, (p, q)| m.max((p - q).abs()));
        assert!(
            diff <= 1e-3 * scale,
            "{key:?}: differs by {diff:.2e} (max |x| {scale:.2e})"
        );
    }
    assert_same_tensors(&fx.path("one").join("hf"), &fx.path("tp").join("hf"));
}

/// A checkpoint written with TP=2 resumes on 4 ranks as TP=2 x FSDP 2 (each rank reads its own
/// FSDP chunk of its own tp slice), and the run continues as an uninterrupted 1-rank run.
#[test]
fn tp_checkpoint_resumes_in_another_layout() {
    let fx = Fixture::new();
    let straight = train(config(&fx, "straight", 6, 1), 1);
    let first = train(config(&fx, "split", 3, 2), 2);
    assert_losses(&first.losses, &straight.losses[..3], "first 3 steps, tp 2");
    // 2 data-parallel ranks of 2 rows each: the same 4-row global batch.
    let resumed = train(
        TrainConfig {
            resume: true,
            micro_batch: 2,
            ..config(&fx, "split", 6, 2)
        },
        4,
    );
    assert_eq!(resumed.losses.len(), 3, "steps 4-6 only");
    assert_losses(
        &resumed.losses,
        &straight.losses[3..],
        "steps 4-6 resumed as tp 2 x shard 2",
    );
}

/// Layouts tensor parallelism cannot split fail before training, naming the values.
#[test]
fn tp_errors_name_the_values() {
    let fx = Fixture::new();
    let err = |config: TrainConfig, world: usize| match try_train(config, world) {
        Ok(s) => panic!("expected an error, got {} steps", s.steps),
        Err(e) => e,
    };
    let e = err(
        TrainConfig {
            seq_len: 33,
            ..config(&fx, "seq", 1, 2)
        },
        2,
    );
    assert!(
        e.contains("seq_len 33") && e.contains("tensor_parallel_degree 2"),
        "{e}"
    );
    // tiny: 4 query heads, 2 key/value heads, MLP width 176.
    let e = err(
        TrainConfig {
            seq_len: 36,
            ..config(&fx, "heads", 1, 3)
        },
        3,
    );
    assert!(
        e.contains("num_attention_heads 4") && e.contains("tensor_parallel_degree 3"),
        "{e}"
    );
    let e = err(config(&fx, "kv", 1, 4), 4);
    assert!(
        e.contains("num_key_value_heads 2") && e.contains("tensor_parallel_degree 4"),
        "{e}"
    );
    let e = err(config(&fx, "world", 1, 2), 3);
    assert!(
        e.contains("tensor_parallel_degree 2") && e.contains("world size 3"),
        "{e}"
    );
}
