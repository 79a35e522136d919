//! Real multi-process sharded training: `smp-run` launching two `llama2_train` processes that
//! talk over TCP, against the same run on two thread-ranks of one process.
//!
//! The binaries come from [`smp_burn_tests::binaries`].

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use llama::data::{DataSource, load_texts};
use llama::metrics::read_metrics;

use smp_burn_tests::binaries;
use smp_burn_tests::trainer::assert_losses;

/// Writes ~100 KB of the embedded corpus (past the Project Gutenberg header) to `dir`.
fn corpus_file(dir: &Path) -> PathBuf {
    let corpus = load_texts(&DataSource::Embedded, "text")
        .expect("embedded corpus")
        .remove(0);
    let start = corpus[1_000_000..].find('\n').expect("a newline") + 1_000_001;
    let mut end = start + 100_000;
    while !corpus.is_char_boundary(end) {
        end += 1;
    }
    let path = dir.join("corpus.txt");
    std::fs::write(&path, &corpus[start..end]).expect("write corpus");
    path
}

/// The training flags shared by every run here, writing to `out_dir`.
fn train_args(data: &Path, out_dir: &Path) -> Vec<String> {
    [
        "--model",
        "tiny",
        "--vocab-size",
        "300",
        "--seq-len",
        "32",
        "--micro-batch",
        "2",
        "--steps",
        "4",
        "--export-hf",
        "none",
        "--sample",
        "none",
        "--no-progress",
        "--no-checkpoint",
        "--eval-interval",
        "2",
    ]
    .into_iter()
    .map(String::from)
    .chain([
        "--data".into(),
        data.display().to_string(),
        "--out-dir".into(),
        out_dir.display().to_string(),
    ])
    .collect()
}

/// What a finished child left behind.
struct Finished {
    status: ExitStatus,
    stdout: String,
    stderr: String,
}

impl std::fmt::Display for Finished {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}\n--- stdout ---\n{}\n--- stderr ---\n{}",
            self.status, self.stdout, self.stderr
        )
    }
}

fn drain(src: impl Read + Send + 'static) -> JoinHandle<String> {
    std::thread::spawn(move || {
        let mut buf = Vec::new();
        let mut src = src;
        let _ = src.read_to_end(&mut buf);
        String::from_utf8_lossy(&buf).into_owned()
    })
}

/// Runs `cmd` to completion, or fails the test after `limit`: the child gets SIGTERM (which
/// `smp-run` forwards to its ranks), then SIGKILL, and the panic shows what it printed.
fn run_with_deadline(cmd: &mut Command, limit: Duration) -> Finished {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // A launcher in the test's environment must not turn the thread-rank run into a rank.
        .env_remove("RANK")
        .env_remove("SLURM_PROCID")
        .env("SMP_COMM_TIMEOUT_SECS", "60")
        .env("SMP_RENDEZVOUS_TIMEOUT_SECS", "60")
        .env("RUST_LOG", "info");
    let mut child: Child = cmd.spawn().unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"));
    let out = drain(child.stdout.take().expect("piped stdout"));
    let err = drain(child.stderr.take().expect("piped stderr"));
    let deadline = Instant::now() + limit;
    let mut timed_out = false;
    let status = loop {
        if let Some(st) = child.try_wait().expect("try_wait") {
            break st;
        }
        if Instant::now() >= deadline {
            timed_out = true;
            let _ = Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .status();
            let grace = Instant::now() + Duration::from_secs(10);
            while child.try_wait().expect("try_wait").is_none() && Instant::now() < grace {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = child.kill();
            break child.wait().expect("wait");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let finished = Finished {
        status,
        stdout: out.join().expect("stdout reader"),
        stderr: err.join().expect("stderr reader"),
    };
    assert!(!timed_out, "{cmd:?} ran past {limit:?}: {finished}");
    finished
}

/// The per-step losses of a run's `metrics.jsonl`, checking there is one finite loss per step.
fn losses(out_dir: &Path, steps: usize, what: &str) -> Vec<f64> {
    let path = out_dir.join("metrics.jsonl");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{what}: read {}: {e}", path.display()));
    assert_eq!(text.lines().count(), steps, "{what}: {text}");
    let metrics = read_metrics(&path).unwrap_or_else(|e| panic!("{what}: {e}"));
    let steps_logged: Vec<u64> = metrics.iter().map(|m| m.step).collect();
    assert_eq!(
        steps_logged,
        (1..=steps as u64).collect::<Vec<_>>(),
        "{what}: {text}"
    );
    for m in &metrics {
        assert!(
            m.loss.is_finite(),
            "{what}: step {} loss {}",
            m.step,
            m.loss
        );
    }
    // --eval-interval 2 with 4 steps: validation at steps 2 and 4 only.
    let evaluated: Vec<u64> = metrics
        .iter()
        .filter(|m| m.val_loss.is_some_and(f64::is_finite))
        .map(|m| m.step)
        .collect();
    assert_eq!(evaluated, vec![2, 4], "{what}: {text}");
    metrics.iter().map(|m| m.loss).collect()
}

/// Two processes through `smp-run` (TCP) train like two thread-ranks in one process: the same
/// math over another transport. Tolerance 1e-5 relative per step's loss: CPU runs differ by an
/// f32 ulp or two from run to run (see `e2e.rs`), and a wrong slice, a lost shard or a
/// double-counted rank moves the loss by 1e-3 or more.
#[test]
fn two_processes_train_like_two_thread_ranks() {
    let bins = binaries();
    let dir = tempfile::tempdir().expect("tempdir");
    let data = corpus_file(dir.path());
    let limit = Duration::from_secs(300);

    let launched_dir = dir.path().join("launched");
    let t = Instant::now();
    let launched = run_with_deadline(
        Command::new(&bins.smp_run)
            .args(["--nproc-per-node", "2", "--"])
            .arg(&bins.llama2_train)
            .args(train_args(&data, &launched_dir)),
        limit,
    );
    eprintln!("smp-run, 2 processes: {:?}", t.elapsed());
    assert!(launched.status.success(), "smp-run: {launched}");
    for rank in 0..2 {
        assert!(
            launched.stderr.contains(&format!("[rank {rank}] ")),
            "rank {rank} printed nothing: {launched}"
        );
    }
    let multi = losses(&launched_dir, 4, "smp-run, 2 processes");

    let threads_dir = dir.path().join("threads");
    let t = Instant::now();
    let threads = run_with_deadline(
        Command::new(&bins.llama2_train)
            .args(["--nproc-per-node", "2"])
            .args(train_args(&data, &threads_dir)),
        limit,
    );
    eprintln!("llama2_train, 2 thread-ranks: {:?}", t.elapsed());
    assert!(threads.status.success(), "llama2_train: {threads}");
    let single = losses(&threads_dir, 4, "one process, 2 thread-ranks");

    for (step, (a, b)) in single.iter().zip(&multi).enumerate() {
        let rel = (a - b).abs() / a.abs();
        assert!(
            rel <= 1e-5,
            "step {}: 2-process loss {b} vs 2-thread-rank loss {a} ({rel:.1e} relative); \
             all {multi:?} vs {single:?}",
            step + 1
        );
    }
}

/// A layout the world cannot hold fails every rank with an error naming the value, and the
/// launcher exits non-zero instead of hanging.
#[test]
fn launched_ranks_reject_a_bad_hybrid_shard_degree() {
    let bins = binaries();
    let dir = tempfile::tempdir().expect("tempdir");
    let data = corpus_file(dir.path());
    let t = Instant::now();
    let o = run_with_deadline(
        Command::new(&bins.smp_run)
            .args(["--nproc-per-node", "2", "--kill-grace-secs", "5", "--"])
            .arg(&bins.llama2_train)
            .args(train_args(&data, &dir.path().join("bad")))
            .args(["--hybrid-shard-degree", "3"]),
        Duration::from_secs(180),
    );
    eprintln!("smp-run with hybrid_shard_degree 3: {:?}", t.elapsed());
    assert!(!o.status.success(), "expected a failure: {o}");
    assert!(o.stderr.contains("hybrid_shard_degree 3"), "{o}");
    assert!(o.stderr.contains("smp-run: rank"), "{o}");
}

/// FP8 asked for on the CPU is refused before any work, saying what it needs, whether from the
/// flag or the environment's kernel settings, and the output directory stays untouched.
#[test]
fn fp8_on_the_cpu_is_refused() {
    let bins = binaries();
    let dir = tempfile::tempdir().expect("tempdir");
    let data = corpus_file(dir.path());
    let out = dir.path().join("fp8");
    for (flag, env) in [(Some("tensorwise"), None), (None, Some("fp8=delayed"))] {
        let mut cmd = Command::new(&bins.llama2_train);
        cmd.args(train_args(&data, &out));
        if let Some(recipe) = flag {
            cmd.args(["--fp8", recipe]);
        }
        if let Some(spec) = env {
            cmd.env("SMP_BURN_KERNELS", spec);
        }
        let o = run_with_deadline(&mut cmd, Duration::from_secs(60));
        assert!(!o.status.success(), "expected a refusal: {o}");
        let recipe = flag.unwrap_or("delayed");
        assert!(
            o.stderr.contains(&format!("FP8 ({recipe})")) && o.stderr.contains("--device cuda"),
            "{o}"
        );
        assert!(!out.exists(), "the refused run wrote {}", out.display());
    }
}

/// The per-step losses of a run without evaluation (`--eval-interval 0`).
fn plain_losses(out_dir: &Path, steps: usize, what: &str) -> Vec<f64> {
    let metrics =
        read_metrics(out_dir.join("metrics.jsonl")).unwrap_or_else(|e| panic!("{what}: {e}"));
    let logged: Vec<u64> = metrics.iter().map(|m| m.step).collect();
    assert_eq!(logged, (1..=steps as u64).collect::<Vec<_>>(), "{what}");
    metrics.iter().map(|m| m.loss).collect()
}

/// 64 processes launched as 8 simulated nodes of 8 (one `smp-run` per node, every rank over
/// TCP on this machine, as a multi-node job is launched) train like one rank, with tensor
/// parallelism 2 and hybrid sharding over groups inside a node (4 ranks: 4 x TP 2 = one
/// node) and across nodes (16 ranks: 4 nodes), each sharded group replicated over the rest.
/// The one rank accumulates the same global batch in 32 micro-batches. Tolerance 1e-4
/// relative per step's loss, as the thread-rank tensor-parallel tests (`tp_e2e.rs`): a
/// different order of the same sums; a lost or doubled shard moves it by 1e-3 or more.
#[test]
fn sixty_four_processes_on_eight_nodes_train_like_one_rank() {
    const NODES: usize = 8;
    const PER_NODE: usize = 8;
    const STEPS: usize = 3;
    let bins = binaries();
    let dir = tempfile::tempdir().expect("tempdir");
    let data = corpus_file(dir.path());
    // AdamW's epsilon at 1e-3, as in tp_e2e.rs: rounding noise in near-zero gradients is not
    // amplified into the weights.
    let config = dir.path().join("run.toml");
    std::fs::write(&config, "[adamw]\neps = 1e-3\n").expect("write config");
    let args = |out: &Path| -> Vec<String> {
        let mut a = train_args(&data, out);
        // 32 data-parallel ranks (64 / TP 2) of one 32-token sequence each.
        for (flag, value) in [
            ("--micro-batch", "1"),
            ("--steps", "3"),
            ("--eval-interval", "0"),
            ("--global-batch-tokens", "1024"),
        ] {
            let at = a.iter().position(|x| x == flag);
            match at {
                Some(i) => a[i + 1] = value.into(),
                None => a.extend([flag.into(), value.into()]),
            }
        }
        a.extend(["--config".into(), config.display().to_string()]);
        a
    };

    let one_dir = dir.path().join("one");
    let t = Instant::now();
    let one = run_with_deadline(
        Command::new(&bins.llama2_train).args(args(&one_dir)),
        Duration::from_secs(300),
    );
    eprintln!("one rank: {:?}", t.elapsed());
    assert!(one.status.success(), "one rank: {one}");
    let reference = plain_losses(&one_dir, STEPS, "one rank");

    for sdp in [4, 16] {
        let out = dir.path().join(format!("sdp{sdp}"));
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let t = Instant::now();
        let launchers: Vec<_> = (0..NODES)
            .map(|node| {
                let mut cmd = Command::new(&bins.smp_run);
                cmd.args(["--nproc-per-node", &PER_NODE.to_string()])
                    .args(["--nnodes", &NODES.to_string()])
                    .args(["--node-rank", &node.to_string()])
                    .args(["--master-addr", "127.0.0.1"])
                    .args(["--master-port", &port.to_string()])
                    .args(["--kill-grace-secs", "5", "--"])
                    .arg(&bins.llama2_train)
                    .args(args(&out))
                    .args(["--tensor-parallel-degree", "2"])
                    .args(["--hybrid-shard-degree", &sdp.to_string()]);
                std::thread::spawn(move || run_with_deadline(&mut cmd, Duration::from_secs(600)))
            })
            .collect();
        for (node, l) in launchers.into_iter().enumerate() {
            let finished = l.join().expect("launcher thread");
            assert!(
                finished.status.success(),
                "node {node} of 8, hybrid_shard_degree {sdp}: {finished}"
            );
        }
        eprintln!(
            "64 processes, TP 2, hybrid_shard_degree {sdp}: {:?}",
            t.elapsed()
        );
        let got = plain_losses(&out, STEPS, &format!("64 processes, sdp {sdp}"));
        assert_losses(
            &got,
            &reference,
            &format!("hybrid_shard_degree {sdp}, 64 processes"),
        );
    }
}
