//! Shared helpers for the cross-crate tests: a tiny sharded Llama trained on threads-as-ranks.

use std::path::PathBuf;
use std::process::Command;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use burn::backend::Autodiff;
use burn::tensor::{Int, Tensor, TensorData};
use burn_ndarray::NdArray;
use collectives::Communicator;
use llama::LlamaConfig;
use llama::parallel::{Build, build, seeded_init};
use smp_burn::engine::{MicroBatch, StateKind};
use smp_burn::fsdp::AdamW;
use smp_burn::mesh::Mesh;
use smp_burn::{Documents, ParallelConfig};

/// `smp-run` and `llama2_train`, built (once per test process) into the profile directory this
/// test runs from: `<target>/<profile>/deps/<this test>` gives `<target>/<profile>`.
pub struct Binaries {
    /// The launcher.
    pub smp_run: PathBuf,
    /// The trainer.
    pub llama2_train: PathBuf,
}

/// The binaries belong to other packages (`collectives` and `smp-llama`), for which cargo sets
/// no `CARGO_BIN_EXE_*` in a test, so they are built into the test's own target directory with
/// `cargo build` (a no-op of a second when they are up to date; it also keeps them from going
/// stale when only this package's tests are run). A failed build fails the test.
pub fn binaries() -> &'static Binaries {
    static BINARIES: OnceLock<Binaries> = OnceLock::new();
    BINARIES.get_or_init(|| {
        let exe = std::env::current_exe().expect("current_exe");
        let deps = exe.parent().expect("the test binary's directory");
        assert_eq!(
            deps.file_name().and_then(|n| n.to_str()),
            Some("deps"),
            "expected the test binary under <target>/<profile>/deps: {}",
            exe.display()
        );
        let profile_dir = deps.parent().expect("profile directory");
        let target_dir = profile_dir.parent().expect("target directory");
        let profile = profile_dir
            .file_name()
            .and_then(|n| n.to_str())
            .expect("profile directory name");
        let mut cmd = Command::new(env!("CARGO"));
        cmd.current_dir(env!("CARGO_MANIFEST_DIR"))
            .args(["build", "-p", "collectives", "--bin", "smp-run"])
            .args(["-p", "smp-llama", "--example", "llama2_train"])
            // Selected as `cargo test --workspace` selects it (with its default features), so
            // that this build reuses the test build's smp-burn instead of compiling it again.
            .args(["-p", "smp-burn"])
            .env("CARGO_TARGET_DIR", target_dir);
        // `release` and `debug` are spelled as cargo's own profiles; a custom profile by name.
        match profile {
            "release" => cmd.arg("--release"),
            "debug" => &mut cmd,
            other => cmd.args(["--profile", other]),
        };
        let t = Instant::now();
        let status = cmd.status().expect("run cargo build");
        assert!(
            status.success(),
            "building smp-run and llama2_train failed ({status}): {cmd:?}"
        );
        eprintln!("cargo build of the binaries: {:?}", t.elapsed());
        let b = Binaries {
            smp_run: profile_dir.join("smp-run"),
            llama2_train: profile_dir.join("examples").join("llama2_train"),
        };
        for p in [&b.smp_run, &b.llama2_train] {
            assert!(p.is_file(), "{} missing after cargo build", p.display());
        }
        b
    })
}

/// The CPU backend the tests train on.
pub type Cpu = Autodiff<NdArray<f32>>;

/// What a rank ends a test run with.
#[derive(Debug, Clone)]
pub struct RunResult {
    /// Mean loss over all data-parallel ranks, per step.
    pub losses: Vec<f64>,
    /// Global gradient norms, per step.
    pub grad_norms: Vec<f64>,
    /// Every parameter after training (full, gathered), by Hugging Face name.
    pub params: Vec<(String, Vec<f32>)>,
    /// Bytes of parameter, gradient and optimizer state this rank held after the last step.
    pub state_bytes: usize,
    /// Bytes of activations the last micro-batch kept in host memory (activation offloading).
    pub offloaded_bytes: usize,
}

/// Deterministic token batches: `[global_batch, seq]` inputs and next-token targets.
pub fn synthetic_batch(step: usize, global_batch: usize, seq: usize, vocab: usize) -> Vec<i64> {
    let mut x = (step as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (0..global_batch * (seq + 1))
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // A skewed distribution so the model has something to learn.
            ((x % vocab as u64) * (x % 3 + 1) / 3) as i64
        })
        .collect()
}

/// Trains the tiny model for `steps` steps on this rank's slice of each global batch, with
/// `micro_batches` gradient-accumulation steps per optimizer step.
pub fn train_rank(
    comm: Arc<dyn Communicator>,
    parallel: &ParallelConfig,
    config: &LlamaConfig,
    steps: usize,
    global_batch: usize,
    seq: usize,
    micro_batches: usize,
) -> RunResult {
    train_rank_packed(
        comm,
        parallel,
        config,
        (steps, global_batch, seq, micro_batches),
        None,
    )
}

/// [`train_rank`] with `(steps, global_batch, seq, micro_batches)`, every row packed with
/// documents of `document_lengths` (summing to `seq`) when given.
pub fn train_rank_packed(
    comm: Arc<dyn Communicator>,
    parallel: &ParallelConfig,
    config: &LlamaConfig,
    (steps, global_batch, seq, micro_batches): (usize, usize, usize, usize),
    document_lengths: Option<&[usize]>,
) -> RunResult {
    let device = Default::default();
    let mesh = Mesh::<NdArray<f32>>::over_host(comm, parallel).expect("mesh");
    // A large epsilon keeps Adam's update proportional to the gradient for tiny gradients, where
    // `g / sqrt(v)` would otherwise turn rounding noise into a full +-lr step of either sign.
    let how = Build {
        init: seeded_init(42),
        adamw: AdamW {
            eps: 1e-3,
            ..AdamW::default()
        },
        max_grad_norm: Some(1.0),
    };
    let mut model = build::<Cpu>(config, &mesh, &device, how).expect("model");
    let (dp_rank, dp) = (mesh.dp_rank(), mesh.dp_size());
    let local = global_batch / dp;
    let mut result = RunResult {
        losses: vec![],
        grad_norms: vec![],
        params: vec![],
        state_bytes: 0,
        offloaded_bytes: 0,
    };
    for step in 0..steps {
        let mut micro = Vec::with_capacity(micro_batches);
        for mb in 0..micro_batches {
            let all = synthetic_batch(
                step * micro_batches + mb,
                global_batch,
                seq,
                config.vocab_size,
            );
            let rows = &all[dp_rank * local * (seq + 1)..(dp_rank + 1) * local * (seq + 1)];
            let inputs: Vec<i64> = rows
                .chunks(seq + 1)
                .flat_map(|r| r[..seq].to_vec())
                .collect();
            let mut targets: Vec<i64> =
                rows.chunks(seq + 1).flat_map(|r| r[1..].to_vec()).collect();
            let documents = document_lengths.map(|lengths| {
                // A document's last position predicts the next document's first token: not
                // scored, as the trainer does under document masking.
                for row in targets.chunks_mut(seq) {
                    let mut end = 0;
                    for &len in lengths {
                        end += len;
                        row[end - 1] = smp_burn::ops::IGNORE_INDEX;
                    }
                }
                Documents::from_lengths(seq, vec![lengths.to_vec(); local]).expect("documents")
            });
            let tokens =
                Tensor::<Cpu, 2, Int>::from_data(TensorData::new(inputs, [local, seq]), &device);
            let targets =
                Tensor::<Cpu, 2, Int>::from_data(TensorData::new(targets, [local, seq]), &device);
            micro.push(match documents {
                Some(documents) => MicroBatch::packed(tokens, targets, documents),
                None => (tokens, targets).into(),
            });
        }
        let scale = model.per_scored_target(&micro).expect("scored targets");
        for (mb, micro) in micro.into_iter().enumerate() {
            model
                .forward_backward(micro, scale.clone(), mb + 1 == micro_batches)
                .expect("step");
        }
        let stats = model.step(1e-2).expect("optimizer");
        result.losses.push(stats.loss.clone().into_scalar() as f64);
        result.grad_norms.push(stats.grad_norm_now());
    }
    result.state_bytes = model.state_bytes();
    result.offloaded_bytes = model.offloaded_bytes();
    result.params = model
        .gather_named(StateKind::Weights)
        .expect("gather")
        .into_iter()
        .map(|(n, _, v)| (n, v))
        .collect();
    result
}

/// The largest relative difference between two runs' parameters: `max |a-b| / (max |a| + tiny)`
/// per tensor.
pub fn max_param_rel_diff(a: &RunResult, b: &RunResult) -> f64 {
    a.params
        .iter()
        .zip(&b.params)
        .map(|((na, va), (nb, vb))| {
            assert_eq!(na, nb);
            let scale = va.iter().fold(0f32, |m, x| m.max(x.abs())) as f64 + 1e-12;
            let diff = va
                .iter()
                .zip(vb)
                .fold(0f32, |m, (x, y)| m.max((x - y).abs())) as f64;
            diff / scale
        })
        .fold(0.0, f64::max)
}

/// Asserts that `got` trained like the 1-rank `reference`: per-step losses within 2e-5
/// relative, gradient norms within 1e-3 relative, and every parameter within 1e-3 of its
/// tensor's largest magnitude. `fsdp_parity.rs` explains these tolerances (f32 sums in another
/// order; a real sharding bug moves the results by orders of magnitude more).
pub fn assert_matches(reference: &RunResult, got: &RunResult, what: &str) {
    assert_eq!(reference.losses.len(), got.losses.len(), "{what}: steps");
    for (step, (a, b)) in reference.losses.iter().zip(&got.losses).enumerate() {
        assert!(
            (a - b).abs() <= 2e-5 * a.abs(),
            "{what}: step {step} loss {b} vs 1-rank {a}"
        );
    }
    for (a, b) in reference.grad_norms.iter().zip(&got.grad_norms) {
        assert!(
            (a - b).abs() <= 1e-3 * a.abs(),
            "{what}: grad norm {b} vs 1-rank {a}"
        );
    }
    let diff = max_param_rel_diff(reference, got);
    assert!(
        diff < 1e-3,
        "{what}: parameters differ from 1-rank by {diff:.2e} (relative)"
    );
}

/// End-to-end runs of the trainer (`llama::train`) on thread-ranks, as `llama2_train` runs
/// them on the CPU: a small corpus fixture and the train-and-compare-ranks driver.
pub mod trainer {
    use std::path::PathBuf;
    use std::sync::Arc;
    use std::time::Duration;

    use collectives::{CommOptions, Communicator, run_on_threads};
    use llama::data::{DataSource, load_texts};
    use llama::tokenizer::TextTokenizer;
    use llama::train::{self, Prepared, Summary, TrainConfig};
    use smp_burn::mesh::Mesh;

    use super::Cpu;

    /// A temporary directory holding a ~200 KB slice of the corpus and a tokenizer trained on
    /// it (vocabulary 300), shared by the runs of one test so that they see the same token ids.
    pub struct Fixture {
        dir: tempfile::TempDir,
        data: PathBuf,
        tokenizer: PathBuf,
    }

    impl Fixture {
        /// Writes the corpus slice and trains the tokenizer.
        #[allow(clippy::new_without_default)]
        pub fn new() -> Self {
            let dir = tempfile::tempdir().expect("tempdir");
            let corpus = load_texts(&DataSource::Embedded, "text")
                .expect("embedded corpus")
                .remove(0);
            // Skip the Project Gutenberg header: start 1 MB in, at a line boundary.
            let start = corpus[1_000_000..].find('\n').expect("a newline") + 1_000_001;
            let mut end = start + 200_000;
            while !corpus.is_char_boundary(end) {
                end += 1;
            }
            let text = &corpus[start..end];
            let data = dir.path().join("corpus.txt");
            std::fs::write(&data, text).expect("write corpus");
            let tokenizer = dir.path().join("tokenizer.json");
            TextTokenizer::train_byte_level_bpe([text], 300)
                .expect("train tokenizer")
                .save(&tokenizer)
                .expect("save tokenizer");
            Self {
                dir,
                data,
                tokenizer,
            }
        }

        /// The tiny model on this corpus, 4 x 32 tokens per step, writing to
        /// `<tempdir>/<name>`, without export or sample; tests set steps and schedule.
        pub fn base_config(&self, name: &str) -> TrainConfig {
            TrainConfig {
                model: "tiny".into(),
                vocab_size: 300,
                seq_len: 32,
                micro_batch: 4,
                data: self.data.to_string_lossy().into_owned(),
                tokenizer: Some(self.tokenizer.clone()),
                eval_batches: 2,
                out_dir: self.path(name),
                export_hf: None,
                sample: None,
                progress: false,
                ..TrainConfig::default()
            }
        }

        /// `<tempdir>/<name>`.
        pub fn path(&self, name: &str) -> PathBuf {
            self.dir.path().join(name)
        }
    }

    /// One CPU rank, set up as `llama2_train` sets up its thread-ranks.
    fn cpu_rank(world: Arc<dyn Communicator>, prepared: &Prepared) -> Result<Summary, String> {
        let mesh = Mesh::over_host(world, &prepared.config.parallel).map_err(|e| e.to_string())?;
        train::train_rank::<Cpu>(prepared, mesh, &Default::default(), None, &|| None)
            .map_err(|e| e.to_string())
    }

    /// Prepares and trains on `world` thread-ranks; rank 0's summary, or the first rank's
    /// error. Every rank must report the same losses (bitwise: they are means over all ranks)
    /// and sample, or fail alike.
    pub fn try_train(config: TrainConfig, world: usize) -> Result<Summary, String> {
        let prepared = train::prepare(config).map_err(|e| e.to_string())?;
        let opts = CommOptions {
            timeout: Duration::from_secs(60),
        };
        let mut results = run_on_threads(world, opts, |comm| cpu_rank(comm, &prepared)).into_iter();
        let first = results.next().expect("at least one rank");
        let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for (i, r) in results.enumerate() {
            match (&first, &r) {
                (Ok(a), Ok(b)) => {
                    assert_eq!(bits(&a.losses), bits(&b.losses), "rank {} losses", i + 1);
                    assert_eq!(a.sample, b.sample, "rank {} sample", i + 1);
                }
                (Err(_), Err(_)) => {}
                _ => panic!("rank 0 gave {first:?} but rank {} gave {r:?}", i + 1),
            }
        }
        first
    }

    /// Per-step losses equal in number and each within 1e-4 relative of `want`'s: the tolerance
    /// of runs whose layouts regroup f32 sums.
    pub fn assert_losses(got: &[f64], want: &[f64], what: &str) {
        assert_eq!(got.len(), want.len(), "{what}: steps");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            let rel = (g - w).abs() / w.abs();
            assert!(
                rel <= 1e-4,
                "{what}: loss {i}: {g} vs {w} ({rel:.1e}); all {got:?} vs {want:?}"
            );
        }
    }

    /// Every tensor of a sharded checkpoint, read whole: `(kind, name) -> (shape, values)`,
    /// kind `weights`, `exp_avg` or `exp_avg_sq`.
    pub fn checkpoint_tensors(
        dir: &std::path::Path,
    ) -> std::collections::BTreeMap<(String, String), (Vec<usize>, Vec<f32>)> {
        use smp_burn::checkpoint::{KINDS, ShardedCheckpoint, kind_name};
        let ckpt = ShardedCheckpoint::open(dir)
            .unwrap_or_else(|e| panic!("opening {}: {e}", dir.display()));
        let mut out = std::collections::BTreeMap::new();
        for (name, entry) in &ckpt.index().tensors {
            let numel = entry.shape.iter().product();
            for kind in KINDS {
                let values = ckpt
                    .read(name, &entry.shape, kind, 0..numel)
                    .unwrap_or_else(|e| panic!("reading {name}: {e}"));
                out.insert(
                    (kind_name(kind).to_string(), name.clone()),
                    (entry.shape.clone(), values),
                );
            }
        }
        out
    }

    /// [`try_train`], panicking on an error.
    pub fn train(config: TrainConfig, world: usize) -> Summary {
        try_train(config, world).unwrap_or_else(|e| panic!("training failed: {e}"))
    }
}
