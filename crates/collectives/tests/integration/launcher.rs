//! Real multi-process runs through `smp-run` and the self-test program.

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const RUN: &str = env!("CARGO_BIN_EXE_smp-run");
const SELFTEST: &str = env!("CARGO_BIN_EXE_smp-collectives-selftest");

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn three_processes_all_reduce() {
    let o = Command::new(RUN)
        .args(["--nproc-per-node", "3", "--", SELFTEST, "--elems", "777"])
        .env("SMP_COMM_TIMEOUT_SECS", "10")
        .env("SMP_RENDEZVOUS_TIMEOUT_SECS", "10")
        .output()
        .unwrap();
    let (out, err) = text(&o);
    assert!(o.status.success(), "stdout:\n{out}\nstderr:\n{err}");
    for r in 0..3 {
        assert!(
            out.contains(&format!("[rank {r}] selftest passed")),
            "{out}"
        );
        assert!(
            out.contains(&format!("[rank {r}] all_reduce ok: world 3, 777 elements")),
            "{out}"
        );
    }
}

#[test]
fn launcher_reports_the_failed_rank_and_stops_the_rest() {
    let t = Instant::now();
    let o = Command::new(RUN)
        .args(["--nproc-per-node", "3", "--kill-grace-secs", "2", "--"])
        .args([SELFTEST, "--die-rank", "1"])
        .env("SMP_COMM_TIMEOUT_SECS", "5")
        .env("SMP_RENDEZVOUS_TIMEOUT_SECS", "5")
        .output()
        .unwrap();
    let (out, err) = text(&o);
    assert!(
        t.elapsed() < Duration::from_secs(8),
        "took {:?}",
        t.elapsed()
    );
    assert!(!o.status.success(), "stdout:\n{out}\nstderr:\n{err}");
    assert!(
        err.contains("smp-run: rank 1 failed with exit code 17"),
        "{err}"
    );
    assert_eq!(o.status.code(), Some(17), "{err}");
}

#[test]
fn survivors_name_the_dead_rank_within_the_timeout() {
    let port = collectives::free_port().unwrap();
    let t = Instant::now();
    let children: Vec<_> = (0..3)
        .map(|rank| {
            Command::new(SELFTEST)
                .args(["--die-rank", "1"])
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", "3")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("SMP_COMM_TIMEOUT_SECS", "5")
                .env("SMP_RENDEZVOUS_TIMEOUT_SECS", "5")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outs: Vec<Output> = children
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect();
    // Well under the 5 s collective timeout: the closed connection is noticed at once.
    assert!(
        t.elapsed() < Duration::from_secs(4),
        "took {:?}",
        t.elapsed()
    );
    assert_eq!(outs[1].status.code(), Some(17));
    for r in [0, 2] {
        let (_, err) = text(&outs[r]);
        assert_eq!(outs[r].status.code(), Some(1), "{err}");
        assert!(err.contains("rank 1 is gone"), "rank {r}: {err}");
    }
}

#[test]
fn launcher_rejects_bad_arguments() {
    let o = Command::new(RUN)
        .args(["--nproc-per-node", "0", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    let o = Command::new(RUN)
        .args(["--nproc-per-node", "1", "--", "/nonexistent/program"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(127));
    assert!(text(&o).1.contains("/nonexistent/program"));
}

#[test]
fn sigterm_is_forwarded_to_the_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let script = format!(
        "echo $$ > {}/pid.$RANK; echo started; exec sleep 30",
        dir.path().display()
    );
    let mut child = Command::new(RUN)
        .args([
            "--nproc-per-node",
            "2",
            "--kill-grace-secs",
            "3",
            "--",
            "sh",
            "-c",
            &script,
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid_file = |r: usize| dir.path().join(format!("pid.{r}"));
    let t = Instant::now();
    while !(pid_file(0).exists() && pid_file(1).exists()) {
        assert!(t.elapsed() < Duration::from_secs(5), "ranks never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    // The ctrlc handler is installed before the ranks start, so the signal is not lost.
    let st = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(st.success());
    let t = Instant::now();
    let status = child.wait().unwrap();
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t.elapsed()
    );
    assert_eq!(status.code(), Some(130));
    for r in 0..2 {
        let pid = std::fs::read_to_string(pid_file(r)).unwrap();
        let proc_dir = format!("/proc/{}", pid.trim());
        assert!(
            !std::path::Path::new(&proc_dir).exists(),
            "rank {r} (pid {}) survived the launcher",
            pid.trim()
        );
    }
}

#[test]
fn two_launchers_form_one_job_as_two_nodes() {
    let port = collectives::free_port().unwrap().to_string();
    let launch = |node: &str| {
        Command::new(RUN)
            .args([
                "--nproc-per-node",
                "2",
                "--nnodes",
                "2",
                "--node-rank",
                node,
            ])
            .args(["--master-addr", "127.0.0.1", "--master-port", &port, "--"])
            .args([SELFTEST, "--elems", "64"])
            .env("SMP_COMM_TIMEOUT_SECS", "10")
            .env("SMP_RENDEZVOUS_TIMEOUT_SECS", "10")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let nodes = [launch("0"), launch("1")];
    for (node, child) in nodes.into_iter().enumerate() {
        let o = child.wait_with_output().unwrap();
        let (out, err) = text(&o);
        assert!(o.status.success(), "node {node}:\n{out}\n{err}");
        for local in 0..2 {
            let rank = node * 2 + local;
            assert!(
                out.contains(&format!("[rank {rank}] all_reduce ok: world 4")),
                "{out}"
            );
            assert!(
                out.contains(&format!("[rank {rank}] selftest passed")),
                "{out}"
            );
        }
    }
}
