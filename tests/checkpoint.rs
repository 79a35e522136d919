//! Sharded checkpoints through the trainer behind `llama2_train`, on CPU thread-ranks with the
//! `tiny` model: a checkpoint written by one layout resumes in others, damage is found and the
//! run falls back to an older checkpoint, old checkpoints are pruned.
//!
//! Tolerance: as `tp_e2e.rs`. Other layouts regroup f32 sums (reduce-scatters over other
//! degrees, tensor-parallel partial products), so their losses match the uninterrupted run's
//! within 1e-4 relative (a step changes the loss by ~1e-2).

use std::path::Path;

use llama::train::{self, TrainConfig};
use smp_burn::fsdp::{AdamW, MomentDtype};

use smp_burn_tests::trainer::{Fixture, assert_losses, checkpoint_tensors, train, try_train};

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

/// `llama2_train convert`'s two directions: a sharded checkpoint to a Hugging Face directory
/// gives exactly the run's own f32 export (and its tokenizer); that directory back to a sharded
/// checkpoint holds the same weights with zero moments, and a run resumes from it.
#[test]
fn conversion_to_hugging_face_and_back() {
    let fx = Fixture::new();
    let run = fx.path("conv");
    train(
        TrainConfig {
            export_hf: Some(run.join("hf")),
            export_dtype: "f32".into(),
            ..config(&fx, "conv", 2, 4)
        },
        2,
    );
    let ckpt = train::latest_checkpoint(&run)
        .unwrap()
        .expect("a checkpoint");
    let converted = fx.path("converted");
    llama::convert::sharded_to_hf(&ckpt, &converted, llama::hf::SaveDType::F32).unwrap();
    let (a, b) = (
        llama::hf::load_safetensors_dir(run.join("hf")).unwrap(),
        llama::hf::load_safetensors_dir(&converted).unwrap(),
    );
    assert_eq!(a, b, "the converted checkpoint is the run's own export");
    assert!(converted.join("tokenizer.json").exists());

    let back = fx.path("back");
    llama::convert::hf_to_sharded(&converted, &back).unwrap();
    let tensors = checkpoint_tensors(&train::latest_checkpoint(&back).unwrap().unwrap());
    for (name, t) in &b {
        let (shape, w) = &tensors[&("weights".to_string(), name.clone())];
        assert_eq!((shape, w), (&t.shape, &t.data), "{name}");
        let (_, m) = &tensors[&("exp_avg".to_string(), name.clone())];
        assert!(m.iter().all(|&v| v == 0.0), "{name}: moments start at zero");
    }
    let e = llama::convert::hf_to_sharded(&converted, &back).expect_err("a used directory");
    assert!(e.to_string().contains("already holds checkpoints"), "{e}");
    let resumed = train(
        TrainConfig {
            resume: true,
            ..config(&fx, "back", 2, 4)
        },
        2,
    );
    assert_eq!(resumed.losses.len(), 2, "trained from step 0");
}

/// `llama2_train` killed with SIGKILL at random moments while it saves a checkpoint at every
/// step (so that most kills land during a background write): after each kill the latest
/// checkpoint opens and every block of it verifies, and the next start resumes from it. 30
/// kills; `SMP_KILL_CASES=300` for a longer run.
#[test]
fn kills_during_saves_leave_a_readable_latest_checkpoint() {
    use std::process::{Command, Stdio};
    use std::time::Duration;
    let fx = Fixture::new();
    let base = fx.base_config("killed");
    let dir = base.out_dir.clone();
    let cases: usize = std::env::var("SMP_KILL_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(30);
    let command = |steps: u64| {
        let mut cmd = Command::new(&smp_burn_tests::binaries().llama2_train);
        cmd.args(["--model", "tiny", "--seq-len", "32", "--micro-batch", "4"])
            .args(["--checkpoint-interval", "1", "--keep-checkpoints", "3"])
            .args([
                "--eval-interval",
                "0",
                "--export-hf",
                "none",
                "--sample",
                "none",
            ])
            .args(["--no-progress", "--resume", "--steps", &steps.to_string()])
            .arg("--data")
            .arg(&base.data)
            .arg("--tokenizer")
            .arg(base.tokenizer.as_ref().expect("the fixture's tokenizer"))
            .arg("--out-dir")
            .arg(&dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        cmd
    };
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let (mut readable, mut last_step, mut during_write) = (0, 0u64, 0);
    for case in 0..cases {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let mut child = command(1_000_000).spawn().expect("start llama2_train");
        std::thread::sleep(Duration::from_millis(300 + rng % 1200));
        child.kill().expect("SIGKILL");
        child.wait().unwrap();
        let partial = std::fs::read_dir(dir.join("checkpoints")).is_ok_and(|entries| {
            entries
                .flatten()
                .any(|e| e.file_name().to_string_lossy().starts_with(".step-"))
        });
        during_write += usize::from(partial);
        let Some(latest) = train::latest_checkpoint(&dir).unwrap() else {
            continue;
        };
        let ckpt = smp_burn::checkpoint::ShardedCheckpoint::open(&latest)
            .unwrap_or_else(|e| panic!("kill {case}: the latest checkpoint does not open: {e}"));
        ckpt.verify()
            .unwrap_or_else(|e| panic!("kill {case}: the latest checkpoint is damaged: {e}"));
        let state: serde_json::Value =
            serde_json::from_slice(&std::fs::read(latest.join("trainer_state.json")).unwrap())
                .unwrap_or_else(|e| panic!("kill {case}: trainer_state.json: {e}"));
        let step = state["step"].as_u64().expect("a step");
        assert!(
            step >= last_step,
            "kill {case}: latest went back from {last_step} to {step}"
        );
        last_step = step;
        readable += 1;
    }
    eprintln!(
        "{cases} kills: {during_write} during a checkpoint write, {readable} found a checkpoint, \
         all readable; the last at step {last_step}"
    );
    assert!(
        readable >= cases / 2 && last_step > 0,
        "only {readable} of {cases} kills found a checkpoint (last step {last_step})"
    );
    assert!(during_write > 0, "no kill landed during a checkpoint write");
    // The run then finishes: two more steps from where it was killed.
    let status = command(last_step + 2).status().unwrap();
    assert!(status.success(), "the resumed run failed: {status}");
    let latest = train::latest_checkpoint(&dir).unwrap().unwrap();
    assert!(latest.ends_with(format!("step-{:06}", last_step + 2)));
    // A kill between a commit and its pruning leaves one more; the next commit prunes it.
    assert!(steps_of(&dir).len() <= 3, "{:?}", steps_of(&dir));
}

/// What a rank holds and reads. Saving, each of 4 ranks snapshots its own shards only (at least
/// a quarter of the model's 12 bytes per parameter, and no more than the state it holds: no
/// unit is gathered). Loading into 2 ranks, each reads about half of the files' bytes (its own
/// ranges, rounded out to 4 KiB checksum blocks), and the two layouts hold the same values.
#[test]
fn ranks_write_and_read_only_their_shards() {
    use collectives::{CommOptions, run_on_threads};
    use llama::LlamaConfig;
    use smp_burn::SmpError;
    use smp_burn::checkpoint::{Checkpointer, ShardedCheckpoint};
    use smp_burn::engine::StateKind;

    let model = LlamaConfig::preset("small").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_path_buf();
    let engine = |world| seeded_engine(&model, world, 1);
    let saved = run_on_threads(4, CommOptions::default(), |world| {
        let engine = engine(world.clone());
        let snapshot = engine
            .snapshot_shards()
            .unwrap()
            .expect("every rank writes");
        let quarter = model.num_parameters() * 12 / 4;
        assert!(
            snapshot.bytes() >= quarter && snapshot.bytes() <= engine.state_bytes(),
            "snapshot {} bytes: a quarter of the model is {quarter}, the rank holds {}",
            snapshot.bytes(),
            engine.state_bytes()
        );
        let mut saver = Checkpointer::new(&root, world).block_bytes(4096);
        saver.save(&engine, 1, Vec::new()).unwrap();
        saver.finish().unwrap().expect("committed");
        engine.gather_named(StateKind::Weights).unwrap()
    });
    let ckpt_dir = root.join("step-000001");
    let total = files_bytes(&ckpt_dir);
    let loaded = run_on_threads(2, CommOptions::default(), |world| {
        let mut engine = engine(world);
        let ckpt = ShardedCheckpoint::open(&ckpt_dir).unwrap();
        engine.load_checkpoint(&ckpt)?;
        let read = ckpt.bytes_read();
        assert!(
            read as f64 <= total as f64 * 0.6 && read as f64 >= total as f64 * 0.4,
            "a rank of 2 read {read} of {total} bytes"
        );
        engine.gather_named(StateKind::Weights)
    });
    for got in loaded {
        let got: Result<_, SmpError> = got;
        assert!(
            got.unwrap() == saved[0],
            "the 2-rank load holds the saved weights"
        );
    }
}

/// Llama 2 70B's widths (hidden 8192, MLP 28672, 64 heads, 8 key/value heads, vocabulary 32000)
/// with `SMP_70B_LAYERS` layers (default 1; 1.38B parameters, 16.6 GB of weights and moments)
/// save from 4 ranks with full sharding and load as 2 ranks with tensor parallelism 2, without
/// training: each rank snapshots exactly its own shards and reads about its share of the
/// files; the process's peak resident memory while saving stays within the ranks' state plus
/// two units each. Not in CI (25 GiB of memory: the ranks share one process; 100 s on 16
/// cores, minutes of I/O):
/// `cargo test --release -p smp-burn-tests --test all -- --ignored checkpoint::seventy_b`.
#[test]
#[ignore = "25 GiB of memory and minutes of I/O; run by name"]
fn seventy_b_widths_save_and_load_within_their_shards() {
    use collectives::{CommOptions, run_on_threads};
    use llama::LlamaConfig;
    use smp_burn::checkpoint::{Checkpointer, ShardedCheckpoint};

    let layers = std::env::var("SMP_70B_LAYERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let model = LlamaConfig {
        num_hidden_layers: layers,
        ..LlamaConfig::preset("70b").unwrap()
    };
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_path_buf();
    let engine = |world, tp| seeded_engine(&model, world, tp);
    // Peak resident memory of this process (the ranks are its threads), reset per phase
    // (`clear_refs` 5 resets VmHWM), in bytes.
    let reset_peak = || std::fs::write("/proc/self/clear_refs", "5").is_ok();
    let peak = || -> u64 {
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .unwrap_or(0)
            * 1024
    };
    let base = peak();
    let measured = reset_peak();
    let t = std::time::Instant::now();
    let written = run_on_threads(4, CommOptions::default(), |world| {
        let engine = engine(world.clone(), 1);
        let mut saver = Checkpointer::new(&root, world);
        let started = saver.save(&engine, 1, Vec::new()).unwrap();
        saver.finish().unwrap().expect("committed");
        (started.bytes, engine.state_bytes())
    });
    let saved = t.elapsed();
    let save_peak = peak();
    let total = files_bytes(&root.join("step-000001"));
    reset_peak();
    let t = std::time::Instant::now();
    let read = run_on_threads(2, CommOptions::default(), |world| {
        let mut engine = engine(world, 2);
        let ckpt = ShardedCheckpoint::open(&root.join("step-000001")).unwrap();
        engine.load_checkpoint(&ckpt).unwrap();
        ckpt.bytes_read()
    });
    eprintln!(
        "70B widths, {layers} layer(s): {:.2}B parameters, {:.1} GB of files; per rank written \
         {:?} (state held {:?}) in {:.0} s; per rank read as TP 2 {:?} in {:.0} s",
        model.num_parameters() as f64 / 1e9,
        total as f64 / 1e9,
        written.iter().map(|w| w.0).collect::<Vec<_>>(),
        written.iter().map(|w| w.1).collect::<Vec<_>>(),
        saved.as_secs_f64(),
        read,
        t.elapsed().as_secs_f64()
    );
    let load_peak = peak();
    // What the ranks may hold together: their state and, per rank, a whole unit in f32 twice
    // (gathered for the engine's build, read back and encoded while saving), plus the
    // process before the test.
    let unit = model
        .block_parameters()
        .max(model.vocab_size * model.hidden_size) as u64
        * 4;
    let state: u64 = written.iter().map(|w| w.1 as u64).sum();
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    eprintln!(
        "peak resident memory (VmHWM) of the 4 saving ranks: {:.1} GiB (their state {:.1} GiB, \
         one unit {:.1} GiB); of the 2 loading ranks: {:.1} GiB; before: {:.1} GiB",
        gib(save_peak),
        gib(state),
        gib(unit),
        gib(load_peak),
        gib(base)
    );
    if measured {
        let bound = base + state + 4 * 2 * unit + (1 << 30);
        assert!(
            save_peak <= bound,
            "saving peaked at {:.1} GiB, above state + 2 units per rank ({:.1} GiB)",
            gib(save_peak),
            gib(bound)
        );
    }
    for (bytes, held) in written {
        assert!(bytes <= held && bytes * 4 >= model.num_parameters() * 12);
    }
    for r in read {
        assert!(
            r as f64 <= total as f64 * 0.75,
            "a rank of 2 read {r} of {total} bytes"
        );
    }
}

/// A run directory holding only checkpoints of the earlier, unsharded format is not resumed as
/// if empty (that would start afresh over it): the error names the directory and the way out.
#[test]
fn an_earlier_format_checkpoint_is_named_not_ignored() {
    let fx = Fixture::new();
    let old = fx.path("old").join("checkpoints").join("step-000004");
    std::fs::create_dir_all(old.join("model")).unwrap();
    std::fs::write(old.join("trainer_state.json"), "{}").unwrap();
    let e = try_train(
        TrainConfig {
            resume: true,
            ..config(&fx, "old", 6, 4)
        },
        1,
    )
    .expect_err("an earlier format");
    assert!(
        e.contains("step-000004") && e.contains("earlier version") && e.contains("convert"),
        "{e}"
    );
}

/// An engine of `model` on `world`'s ranks with full sharding and tensor parallelism
/// `tp`: seeded values, AdamW, no clipping.
fn seeded_engine(
    model: &llama::LlamaConfig,
    world: std::sync::Arc<dyn collectives::Communicator>,
    tp: usize,
) -> llama::parallel::LlamaEngine<smp_burn_tests::Cpu> {
    use llama::parallel::{Build, build, seeded_init};
    let parallel = smp_burn::ParallelConfig {
        tensor_parallel_degree: tp,
        ..smp_burn::ParallelConfig::default()
    };
    let mesh = smp_burn::mesh::Mesh::over_host(world, &parallel).unwrap();
    let how = Build {
        init: seeded_init(7),
        adamw: AdamW::default(),
        max_grad_norm: None,
    };
    build(model, &mesh, &Default::default(), how).unwrap()
}

/// Bytes of every file a checkpoint's index lists.
fn files_bytes(dir: &Path) -> u64 {
    smp_burn::checkpoint::ShardedCheckpoint::open(dir)
        .unwrap()
        .index()
        .files
        .values()
        .map(|f| f.bytes)
        .sum()
}

/// AdamW's moments kept in bf16 (`[adamw] moments = "bf16"`): 4 ranks match 1 rank, the
/// checkpoint holds them as f32 values that bf16 represents exactly, and a run resumed from it
/// on 2 ranks continues as the uninterrupted one. The option changes the trajectory (within
/// 1e-2 of the f32 moments' losses after 6 steps) but not what N ranks compute against one.
#[test]
fn bf16_moments_shard_save_and_resume() {
    let fx = Fixture::new();
    let bf16 = |name: &str, steps| {
        let mut c = config(&fx, name, steps, 4);
        c.adamw.moments = MomentDtype::Bf16;
        c
    };
    let straight = train(bf16("straight", 6), 4);
    let f32_moments = train(config(&fx, "f32", 6, 4), 4);
    assert!(
        straight.losses != f32_moments.losses,
        "bf16 moments gave bitwise the losses of f32 moments: {:?}",
        straight.losses
    );
    for (b, f) in straight.losses.iter().zip(&f32_moments.losses) {
        assert!(
            (b - f).abs() / f.abs() < 1e-2,
            "bf16 against f32 moments: {:?} vs {:?}",
            straight.losses,
            f32_moments.losses
        );
    }
    let one = train(
        TrainConfig {
            micro_batch: 16,
            ..bf16("one", 6)
        },
        1,
    );
    assert_losses(
        &one.losses,
        &straight.losses,
        "1 rank against 4, bf16 moments",
    );

    let first = train(bf16("split", 3), 4);
    assert_losses(&first.losses, &straight.losses[..3], "the first 3 steps");
    let latest = train::latest_checkpoint(&fx.path("split"))
        .unwrap()
        .expect("a checkpoint");
    let mut moments = 0;
    for ((kind, name), (_, values)) in checkpoint_tensors(&latest) {
        if kind == "weights" {
            continue;
        }
        moments += values.len();
        for v in values {
            assert_eq!(
                burn::tensor::bf16::from_f32(v).to_f32(),
                v,
                "{kind} of {name} holds {v}, which bf16 does not represent"
            );
        }
    }
    assert!(moments > 0, "the checkpoint holds no moments");
    copy_dir(&fx.path("split"), &fx.path("two"));
    let resumed = train(
        TrainConfig {
            resume: true,
            micro_batch: 8,
            ..bf16("two", 6)
        },
        2,
    );
    assert_losses(
        &resumed.losses,
        &straight.losses[3..],
        "steps 4-6 resumed on 2 ranks",
    );
}
