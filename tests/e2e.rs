//! End-to-end runs of the trainer behind `llama2_train` (`llama::train`): the `tiny` model on a
//! 200 KB slice of the embedded Shakespeare corpus, on one and two CPU thread-ranks.
//!
//! Every run is short (a few steps of 4 x 32 tokens), so the whole file takes seconds; one test
//! runs the `llama2_train` binary itself, on its configuration only (no training).

use std::path::PathBuf;
use std::process::Command;

use llama::LlamaConfig;
use llama::hf;
use llama::tokenizer::TextTokenizer;
use llama::train::{self, Summary, TrainConfig};
use smp_burn::fsdp::AdamW;

use smp_burn_tests::binaries;
use smp_burn_tests::trainer::{Fixture, checkpoint_tensors, train, try_train};

/// A short run of the tiny model: 6 steps, 2 of warmup.
fn config(fx: &Fixture, name: &str) -> TrainConfig {
    TrainConfig {
        steps: 6,
        warmup_steps: 2,
        ..fx.base_config(name)
    }
}

/// A run interrupted after 3 steps and resumed continues as if it had not stopped: the same
/// losses for steps 4-6 and the same final weights. Two ranks, so that sharded optimizer state
/// goes through the checkpoint.
///
/// The learning rate is held constant: the cosine schedule depends on `steps`, which is 3 in
/// the first half of the interrupted run and 6 in the straight run.
///
/// Tolerance: CPU training here is not bitwise reproducible from one run to the next, even on
/// one rank: two identical runs in one process can differ by an f32 ulp or two in a loss from
/// step 2 on. (The likely cause is burn-ndarray's SIMD kernels, which split each buffer at
/// vector alignment and run the unaligned head and tail through scalar code whose results, for
/// functions such as `exp`, can differ from the vector path's by an ulp; which elements fall
/// where depends on allocation addresses.) So the check is: losses within 1e-5 relative and
/// weights within 1e-3 of each tensor's largest magnitude (~1e-4 absolute). AdamW runs with
/// epsilon 1e-3 here (as in `fsdp_parity.rs`) so that an ulp of noise in a near-zero gradient
/// does not become a full +-lr update of either sign. A resume that lost the optimizer moments,
/// the step count or the data position moves weights by a sizeable fraction of lr (3e-3) and
/// losses by 1e-3 or more (one step changes the loss by ~1e-2 here).
#[test]
fn resume_matches_an_uninterrupted_run() {
    let fx = Fixture::new();
    let base = |name: &str, steps: u64| TrainConfig {
        steps,
        warmup_steps: 0,
        min_lr: 3e-3,
        lr: 3e-3,
        export_hf: Some(fx.path(name).join("hf")),
        export_dtype: "f32".into(),
        adamw: AdamW {
            eps: 1e-3,
            ..AdamW::default()
        },
        ..config(&fx, name)
    };
    let straight = train(base("straight", 6), 2);
    assert_eq!(straight.losses.len(), 6);

    let first = train(base("split", 3), 2);
    assert_close(&first.losses, &straight.losses[..3], "the first 3 steps");
    let latest = train::latest_checkpoint(&fx.path("split"))
        .unwrap()
        .expect("a checkpoint");
    assert!(latest.ends_with("step-000003"), "{}", latest.display());

    let resumed = train(
        TrainConfig {
            resume: true,
            ..base("split", 6)
        },
        2,
    );
    assert_eq!(resumed.steps, 6);
    assert_eq!(
        resumed.losses.len(),
        3,
        "the resumed run trains steps 4-6 only"
    );
    assert_close(
        &resumed.losses,
        &straight.losses[3..],
        "steps 4-6 after resume",
    );

    let a = hf::load_safetensors_dir(fx.path("straight").join("hf")).unwrap();
    let b = hf::load_safetensors_dir(fx.path("split").join("hf")).unwrap();
    assert_eq!(
        a.keys().collect::<Vec<_>>(),
        b.keys().collect::<Vec<_>>(),
        "tensor names"
    );
    for (name, ta) in &a {
        let tb = &b[name];
        assert_eq!(ta.shape, tb.shape, "shape of {name}");
        let scale = ta.data.iter().fold(0f32, |m, x| m.max(x.abs()));
        let diff = ta
            .data
            .iter()
            .zip(&tb.data)
            .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(
            diff <= 1e-4 * scale,
            "{name}: resumed weights differ by {diff:.2e} (max |w| {scale})"
        );
    }
    // The metrics log holds each step once: the resumed run appended steps 4-6.
    let metrics = std::fs::read_to_string(fx.path("split").join("metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 6, "{metrics}");
}

fn assert_close(got: &[f64], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let rel = (g - w).abs() / w.abs();
        assert!(
            rel <= 1e-5,
            "{what}: loss {i}: {g} vs {w} ({rel:.1e} relative); all {got:?} vs {want:?}"
        );
    }
}

/// Two ranks of 2 rows each train like one rank of 4 rows: the micro-batch is per rank, the
/// global batch (and the data order) the same.
///
/// Tolerance: the 2-rank run averages two per-rank means and reduces gradients across ranks,
/// the 1-rank run sums in another order, so the runs differ by f32 rounding (~1e-7 relative per
/// operation), which AdamW can amplify a little over steps where a gradient is near zero. We
/// accept 1e-4 relative on every step's loss; a wrong slice or a double-counted rank moves the
/// loss by far more (the losses change by ~1e-2 per step).
#[test]
fn two_ranks_match_one_rank() {
    let fx = Fixture::new();
    let one = train(config(&fx, "one"), 1);
    let two = train(
        TrainConfig {
            micro_batch: 2,
            ..config(&fx, "two")
        },
        2,
    );
    assert_eq!(one.losses.len(), 6);
    assert!(
        one.losses[5] < one.losses[0],
        "the model should learn: {:?}",
        one.losses
    );
    for (step, (a, b)) in one.losses.iter().zip(&two.losses).enumerate() {
        let rel = (a - b).abs() / a.abs();
        assert!(
            rel <= 1e-4,
            "step {}: 2-rank loss {b} vs 1-rank {a} ({rel:.1e} relative)",
            step + 1
        );
    }
    let (a, b) = (one.final_val_loss.unwrap(), two.final_val_loss.unwrap());
    assert!((a - b).abs() <= 1e-4 * a, "validation loss {b} vs {a}");
}

fn expect_error(result: Result<Summary, String>, what: &str) -> String {
    match result {
        Ok(s) => panic!("{what}: expected an error, got a run of {} steps", s.steps),
        Err(e) => e,
    }
}

/// Bad configurations and damaged checkpoints give errors that name the values involved, and
/// never a panic (`try_train` would propagate one).
#[test]
fn errors_name_the_values() {
    let fx = Fixture::new();
    let one_step = |name: &str| TrainConfig {
        steps: 1,
        ..config(&fx, name)
    };
    train(one_step("ckpt"), 1);

    // Resuming with another model shape names both shapes.
    let e = expect_error(
        try_train(
            TrainConfig {
                model: "small".into(),
                resume: true,
                ..one_step("ckpt")
            },
            1,
        ),
        "resume with another shape",
    );
    assert!(
        e.contains("hidden_size: 64") && e.contains("hidden_size: 128"),
        "{e}"
    );

    // A truncated weights file names the file.
    let ckpt = train::latest_checkpoint(&fx.path("ckpt"))
        .unwrap()
        .expect("a checkpoint");
    let file = ckpt.join("tp000-shard00000.safetensors");
    let bytes = std::fs::read(&file).expect("the checkpoint holds rank 0's shards");
    std::fs::write(&file, &bytes[..bytes.len() / 2]).unwrap();
    let e = expect_error(
        try_train(
            TrainConfig {
                resume: true,
                ..one_step("ckpt")
            },
            1,
        ),
        "truncated checkpoint",
    );
    assert!(
        e.contains("tp000-shard00000.safetensors") && e.contains("truncated"),
        "{e}"
    );

    // A global batch that is not a whole number of micro-batches: 2 ranks x 4 rows x 32 tokens
    // = 256 tokens per micro-batch.
    let e = expect_error(
        try_train(
            TrainConfig {
                global_batch_tokens: 384,
                ..one_step("batch")
            },
            2,
        ),
        "global_batch_tokens",
    );
    assert!(e.contains("384") && e.contains("256"), "{e}");

    // An unknown preset names the known ones.
    let e = expect_error(
        try_train(
            TrainConfig {
                model: "huge".into(),
                ..one_step("preset")
            },
            1,
        ),
        "unknown preset",
    );
    assert!(e.contains("huge"), "{e}");
    for name in LlamaConfig::PRESETS {
        assert!(e.contains(name), "{e} should name {name}");
    }

    // Hybrid sharding over groups of 3 cannot split 2 ranks.
    let mut cfg = one_step("hybrid");
    cfg.parallel.hybrid_shard_degree = 3;
    let e = expect_error(try_train(cfg, 2), "hybrid_shard_degree");
    assert!(
        e.contains("hybrid_shard_degree 3") && e.contains("size 2"),
        "{e}"
    );
}

/// Every file under `dir` with its bytes, sorted by path: compared before and after a refused
/// run to show that nothing was written.
fn snapshot(dir: &std::path::Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut files = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else {
                files.push((path.clone(), std::fs::read(&path).unwrap()));
            }
        }
    }
    files.sort();
    files
}

/// A fresh run pointed at another run's output directory is refused before any work, naming
/// the directory and what it holds, and changes nothing there; `resume` continues that run and
/// `overwrite` replaces it (its old checkpoints gone, not mixed with the new ones).
#[test]
fn a_used_output_directory_is_refused() {
    let fx = Fixture::new();
    let dir = fx.path("used");
    let cfg = |steps: u64| TrainConfig {
        steps,
        export_hf: Some(dir.join("hf")),
        ..config(&fx, "used")
    };
    train(cfg(2), 1);
    let snapshot = || snapshot(&dir);
    let before = snapshot();
    let latest = train::latest_checkpoint(&dir)
        .unwrap()
        .expect("a checkpoint");

    let e = expect_error(try_train(cfg(3), 1), "a fresh run in a used directory");
    assert!(
        e.contains(&dir.display().to_string())
            && e.contains("metrics.jsonl")
            && e.contains("--resume")
            && e.contains("--overwrite"),
        "{e}"
    );
    assert!(
        snapshot() == before,
        "the refused run changed files in {}",
        dir.display()
    );

    // The export directory alone is guarded too.
    let e = expect_error(
        try_train(
            TrainConfig {
                export_hf: Some(dir.join("hf")),
                ..config(&fx, "elsewhere")
            },
            1,
        ),
        "a fresh run exporting over another run's export",
    );
    assert!(e.contains(&dir.join("hf").display().to_string()), "{e}");

    // Resuming continues the run; overwriting replaces it.
    let resumed = train(
        TrainConfig {
            resume: true,
            ..cfg(3)
        },
        1,
    );
    assert_eq!(resumed.steps, 3);
    let fresh = train(
        TrainConfig {
            overwrite: true,
            steps: 1,
            ..cfg(1)
        },
        1,
    );
    assert_eq!(fresh.steps, 1);
    let now = train::latest_checkpoint(&dir)
        .unwrap()
        .expect("a checkpoint");
    assert_ne!(
        now, latest,
        "the overwriting run's checkpoint is the latest"
    );
    let steps: Vec<_> = std::fs::read_dir(dir.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step-"))
        .collect();
    assert_eq!(steps, ["step-000001"], "old checkpoints are gone");
}

/// The Hugging Face export of a run reloads with every parameter at its shape, and matches the
/// fp32 checkpoint of the same step to bf16 precision.
#[test]
fn hf_export_reloads() {
    let fx = Fixture::new();
    let hf_dir = fx.path("export").join("hf");
    let cfg = TrainConfig {
        steps: 2,
        export_hf: Some(hf_dir.clone()),
        ..config(&fx, "export")
    };
    train(cfg.clone(), 2);

    let model = hf::read_hf_config(&hf_dir).expect("config.json");
    let expected = train::model_config(&cfg, 300).unwrap();
    assert_eq!(model, expected);
    let exported = hf::load_safetensors_dir(&hf_dir).expect("reload");
    let shapes = llama::model::parameter_shapes(&model);
    assert_eq!(
        exported.len(),
        shapes.len(),
        "{:?}",
        exported.keys().collect::<Vec<_>>()
    );
    for (name, shape) in &shapes {
        let t = exported
            .get(name)
            .unwrap_or_else(|| panic!("{name} missing from the export"));
        assert_eq!(&t.shape, shape, "{name}");
    }
    assert!(
        hf_dir.join("tokenizer.json").exists(),
        "the export carries the tokenizer"
    );

    let ckpt = train::latest_checkpoint(&fx.path("export"))
        .unwrap()
        .expect("a checkpoint");
    let master = checkpoint_tensors(&ckpt);
    for (name, t) in &exported {
        let (_, m) = &master[&("weights".to_string(), name.clone())];
        for (x, y) in t.data.iter().zip(m) {
            // bf16 keeps 8 significant bits: relative error at most 2^-8 after rounding.
            assert!(
                (x - y).abs() <= y.abs() / 256.0,
                "{name}: exported {x} vs fp32 {y}"
            );
        }
    }
}

/// Llama 2's published parameter counts, from the shapes alone (nothing is allocated).
#[test]
fn preset_parameter_counts() {
    for (name, published) in [
        ("7b", 6_738_415_616usize),
        ("13b", 13_015_864_320),
        ("70b", 68_976_648_192),
    ] {
        let n = LlamaConfig::preset(name).unwrap().num_parameters();
        assert_eq!(n, published, "{name}");
    }
}

/// A validation split smaller than one global batch turns evaluation off up front (with a
/// warning) instead of failing the run after its last step; training itself is unaffected.
#[test]
fn too_small_validation_split_skips_evaluation() {
    let fx = Fixture::new();
    let mut config = config(&fx, "small_val");
    config.steps = 2;
    // 2% of 200 KB in 32-token windows is a few windows; 2 ranks x 64 sequences is more.
    config.micro_batch = 64;
    let summary = train(config, 2);
    assert_eq!(summary.steps, 2);
    assert_eq!(summary.final_val_loss, None);
    assert!(summary.final_loss.is_finite());
}

/// `layers` replaces the preset's depth and nothing else.
#[test]
fn layers_override_changes_only_the_depth() {
    let base = TrainConfig {
        model: "7b".into(),
        ..TrainConfig::default()
    };
    let deep = train::model_config(&base, 300).expect("7b");
    let shallow = train::model_config(
        &TrainConfig {
            layers: Some(3),
            ..base.clone()
        },
        300,
    )
    .expect("7b with 3 layers");
    assert_eq!(shallow.num_hidden_layers, 3);
    assert_eq!(
        LlamaConfig {
            num_hidden_layers: deep.num_hidden_layers,
            ..shallow.clone()
        },
        deep
    );
    let zero = train::model_config(
        &TrainConfig {
            layers: Some(0),
            ..base
        },
        300,
    );
    assert!(zero.is_err());
}

/// `checkpoints = false` (`--no-checkpoint`) wins over a checkpoint interval: no step saves.
#[test]
fn no_checkpoint_wins_over_an_interval() {
    let fx = Fixture::new();
    let summary = train(
        TrainConfig {
            steps: 2,
            checkpoints: false,
            checkpoint_interval: 1,
            ..config(&fx, "no_ckpt")
        },
        1,
    );
    assert_eq!(summary.steps, 2);
    let dir = fx.path("no_ckpt");
    assert!(
        dir.join("metrics.jsonl").exists(),
        "the run wrote its metrics"
    );
    assert!(
        !dir.join("checkpoints").exists(),
        "a checkpoint was written to {}",
        dir.display()
    );
}

/// The binary's configuration end to end, without training: a config file's misspelt key
/// stops it with a non-zero status and a message naming the file, the key and the valid key;
/// a flag given with a file overrides the file's value and leaves its other keys.
#[test]
fn llama2_train_config_file_and_flags() {
    let bin = binaries().llama2_train.clone();
    let dir = tempfile::tempdir().expect("tempdir");
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "model = \"tiny\"\n[parallel]\nprefetch_dept = 0\n").unwrap();
    let out = Command::new(&bin)
        .arg("--config")
        .arg(&bad)
        .output()
        .expect("run llama2_train");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "exit status {}: {stderr}",
        out.status
    );
    assert!(
        stderr.contains(&bad.display().to_string())
            && stderr.contains("`prefetch_dept`")
            && stderr.contains("did you mean `parallel.prefetch_depth`"),
        "{stderr}"
    );

    let good = dir.path().join("run.toml");
    std::fs::write(
        &good,
        "steps = 7\nseq_len = 64\n[parallel]\nprefetch_depth = 0\n",
    )
    .unwrap();
    let written = dir.path().join("effective.toml");
    let out = Command::new(&bin)
        .arg("--config")
        .arg(&good)
        .args(["--steps", "3", "--write-config"])
        .arg(&written)
        .output()
        .expect("run llama2_train");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let effective = TrainConfig::from_toml_file(&written).expect("the written file reads back");
    assert_eq!(effective.steps, 3, "the flag overrides the file");
    assert_eq!(effective.seq_len, 64, "the file overrides the default");
    assert_eq!(effective.parallel.prefetch_depth, 0);
    assert_eq!(effective.micro_batch, TrainConfig::default().micro_batch);
}

/// An output or export path that cannot be written is refused before any training, naming the
/// path, rather than at the first checkpoint or at the export.
#[test]
fn unwritable_outputs_fail_before_training() {
    let fx = Fixture::new();
    // A directory under a regular file cannot be created, even by root.
    let file = fx.path("a-file");
    std::fs::write(&file, "not a directory").unwrap();
    let e = expect_error(
        try_train(
            TrainConfig {
                out_dir: file.join("out"),
                ..config(&fx, "unwritable-out")
            },
            1,
        ),
        "out_dir under a file",
    );
    assert!(e.contains("--out-dir") && e.contains("a-file"), "{e}");
    let out = fx.path("writable-out");
    let e = expect_error(
        try_train(
            TrainConfig {
                out_dir: out.clone(),
                export_hf: Some(file.join("sub").join("hf")),
                ..config(&fx, "unwritable-export")
            },
            1,
        ),
        "export_hf under a file",
    );
    assert!(e.contains("--export-hf") && e.contains("a-file"), "{e}");
    assert!(!out.join("metrics.jsonl").exists(), "no step may run");
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "not a directory");
}

/// A Hugging Face model whose vocabulary is smaller than the tokenizer's is refused naming both
/// sizes and the directory (a token id past the embedding's rows panicked at the first lookup).
#[test]
fn an_hf_model_smaller_than_the_tokenizer_is_refused() {
    let fx = Fixture::new();
    let dir = fx.path("hf-small-vocab");
    std::fs::create_dir_all(&dir).unwrap();
    let model = LlamaConfig {
        vocab_size: 256,
        ..LlamaConfig::preset("tiny").unwrap()
    };
    let json = hf::hf_config_json(&model, hf::SaveDType::BF16).to_string();
    std::fs::write(dir.join("config.json"), json).unwrap();
    let e = expect_error(
        try_train(
            TrainConfig {
                init_from_hf: Some(dir.clone()),
                ..config(&fx, "hf-vocab")
            },
            1,
        ),
        "a tokenizer larger than the model's vocabulary",
    );
    assert!(
        e.contains("300") && e.contains("256") && e.contains("hf-small-vocab"),
        "{e}"
    );
}

/// Zero sizes and impossible rates are refused before any work, each named with its value.
#[test]
fn zero_sizes_and_bad_rates_are_named() {
    let fx = Fixture::new();
    let e = expect_error(
        try_train(
            TrainConfig {
                steps: 0,
                micro_batch: 0,
                lr: f64::NAN,
                ..config(&fx, "zeros")
            },
            1,
        ),
        "zero sizes",
    );
    for part in ["steps = 0", "micro_batch = 0", "lr = NaN"] {
        assert!(e.contains(part), "{part} missing from: {e}");
    }
    let e = expect_error(
        try_train(
            TrainConfig {
                seq_len: 0,
                ..config(&fx, "seq0")
            },
            1,
        ),
        "seq_len 0",
    );
    assert!(e.contains("seq_len = 0"), "{e}");
    assert!(
        !fx.path("zeros").exists() && !fx.path("seq0").exists(),
        "nothing written"
    );
}

/// Resuming with other data settings (here the sequence length) is refused with both values,
/// and goes ahead only with `resume_with_changes`.
#[test]
fn resuming_with_other_data_settings_needs_a_flag() {
    let fx = Fixture::new();
    let first = TrainConfig {
        steps: 2,
        ..config(&fx, "changed")
    };
    train(first.clone(), 1);
    let shorter = TrainConfig {
        steps: 3,
        seq_len: 16,
        resume: true,
        ..first
    };
    let e = expect_error(try_train(shorter.clone(), 1), "another seq_len");
    assert!(
        e.contains("seq_len: 32 -> 16") && e.contains("--resume-with-changes"),
        "{e}"
    );
    let s = train(
        TrainConfig {
            resume_with_changes: true,
            ..shorter
        },
        1,
    );
    assert_eq!(s.steps, 3);
}

/// Resuming with a `tokenizer` other than the checkpoint's is refused naming both files and
/// sizes, and changes nothing; the same tokenizer given again (as a repeated command line
/// does) resumes.
#[test]
fn resuming_with_another_tokenizer_is_refused() {
    let fx = Fixture::new();
    let first = TrainConfig {
        steps: 2,
        ..config(&fx, "retok")
    };
    train(first.clone(), 1);
    let other = fx.path("other-tokenizer.json");
    let text = std::fs::read_to_string(&first.data).unwrap();
    TextTokenizer::train_byte_level_bpe([&text[..text.len() / 4]], 280)
        .unwrap()
        .save(&other)
        .unwrap();
    let before = snapshot(&first.out_dir);
    let resume = TrainConfig {
        steps: 3,
        resume: true,
        ..first
    };
    let e = expect_error(
        try_train(
            TrainConfig {
                tokenizer: Some(other.clone()),
                ..resume.clone()
            },
            1,
        ),
        "another tokenizer",
    );
    assert!(
        e.contains("other-tokenizer.json (280 tokens)") && e.contains("300 tokens"),
        "{e}"
    );
    assert!(snapshot(&resume.out_dir) == before, "the refused run wrote");
    assert_eq!(train(resume, 1).steps, 3);
}

/// A corpus with fewer training sequences than one step's global batch is refused before any
/// work, naming the counts (each batch would repeat sequences and the summary describe them).
#[test]
fn a_corpus_shorter_than_one_batch_is_refused() {
    let fx = Fixture::new();
    let small = fx.path("small.txt");
    let text = std::fs::read_to_string(&fx.base_config("x").data).unwrap();
    std::fs::write(&small, &text[..600]).unwrap();
    let cfg = TrainConfig {
        data: small.to_string_lossy().into_owned(),
        micro_batch: 8,
        val_fraction: 0.0,
        ..config(&fx, "small")
    };
    let e = expect_error(try_train(cfg.clone(), 2), "a corpus shorter than a batch");
    assert!(
        e.contains("global batch of 16")
            && e.contains("micro_batch 8 x 2 data-parallel ranks x 1 accumulation steps"),
        "{e}"
    );
    assert!(
        !cfg.out_dir.exists() || snapshot(&cfg.out_dir).is_empty(),
        "the refused run wrote"
    );
    // The same corpus fills a batch of 2 x 1.
    let fits = TrainConfig {
        micro_batch: 1,
        steps: 1,
        ..cfg
    };
    assert_eq!(train(fits, 2).steps, 1);
}

/// With `document_masking`, rows packed from many short documents train alike on one and two
/// ranks (tolerance as in `two_ranks_match_one_rank`), and differently from the same rows
/// without it (most rows hold parts of two or more documents, so the mask and the restarted
/// positions change every step's loss).
#[test]
fn document_masking_matches_across_ranks_and_changes_training() {
    let fx = Fixture::new();
    let corpus = std::fs::read_to_string(&fx.base_config("x").data).expect("corpus");
    // Two lines per document: some 30 tokens, about a 32-token row.
    let lines: Vec<&str> = corpus.lines().filter(|l| !l.trim().is_empty()).collect();
    let jsonl: String = lines
        .chunks(2)
        .map(|c| serde_json::json!({ "text": c.join("\n") }).to_string() + "\n")
        .collect();
    let data = fx.path("docs.jsonl");
    std::fs::write(&data, jsonl).expect("write documents");
    let masked = |name: &str, micro_batch, document_masking| TrainConfig {
        data: data.to_string_lossy().into_owned(),
        micro_batch,
        document_masking,
        ..config(&fx, name)
    };
    let one = train(masked("one", 4, true), 1);
    let two = train(masked("two", 2, true), 2);
    let plain = train(masked("plain", 4, false), 1);
    assert!(
        one.losses[5] < one.losses[0],
        "the model should learn: {:?}",
        one.losses
    );
    smp_burn_tests::trainer::assert_losses(&two.losses, &one.losses, "2 ranks, masked");
    for (step, (a, b)) in one.losses.iter().zip(&plain.losses).enumerate().skip(1) {
        assert!(
            (a - b).abs() > 1e-4 * a.abs(),
            "step {step}: masked loss {a} equals the unmasked {b}"
        );
    }
    let (a, b) = (one.final_val_loss.unwrap(), two.final_val_loss.unwrap());
    assert!((a - b).abs() <= 1e-4 * a, "validation loss {b} vs {a}");
}
