//! `smp-run`: launches one process per local rank, like `torchrun`.
//!
//! Children get `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR` and
//! `MASTER_PORT`; `CUDA_VISIBLE_DEVICES` is left alone so programs pick their GPU from
//! `LOCAL_RANK`. Output lines are prefixed with `[rank R] `. When a rank fails, the others
//! are stopped and `smp-run` exits with the failed rank's status.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::ExitStatusExt;
use std::process::{Command, ExitCode, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use clap::Parser;

#[derive(Parser, Debug)]
#[command(
    name = "smp-run",
    about = "Launch a distributed smp-burn job (torchrun-style)",
    after_help = "Example: smp-run --nproc-per-node 4 -- ./train --config cfg.toml"
)]
struct Args {
    /// Processes to start on this node (usually one per GPU).
    #[arg(long, default_value_t = 1)]
    nproc_per_node: usize,
    /// Number of nodes in the job.
    #[arg(long, default_value_t = 1)]
    nnodes: usize,
    /// Index of this node, 0..nnodes.
    #[arg(long, default_value_t = 0)]
    node_rank: usize,
    /// Host of the rendezvous store (rank 0's node).
    #[arg(long, default_value = "127.0.0.1")]
    master_addr: String,
    /// Port of the rendezvous store; 0 or unset picks a free port on a single node
    /// (multi-node jobs default to 29500, as every node must agree).
    #[arg(long)]
    master_port: Option<u16>,
    /// Seconds between asking ranks to stop (SIGTERM) and killing them (SIGKILL).
    #[arg(long, default_value_t = 5.0)]
    kill_grace_secs: f64,
    /// Program and its arguments (after `--`).
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
    command: Vec<String>,
}

enum Event {
    Exited(usize, std::io::Result<ExitStatus>),
    Signal,
}

fn describe(status: &ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exit code {c}"),
        (None, Some(s)) => format!("signal {s}"),
        _ => status.to_string(),
    }
}

fn exit_code(status: &ExitStatus) -> u8 {
    match (status.code(), status.signal()) {
        (Some(c), _) => u8::try_from(c & 0xff).unwrap_or(1).max(1),
        (None, Some(s)) => 128u8.saturating_add(s as u8),
        _ => 1,
    }
}

/// Signals through `kill(1)` so the launcher needs no libc bindings.
fn signal(pids: &[u32], sig: &str) {
    if pids.is_empty() {
        return;
    }
    let _ = Command::new("kill")
        .arg(format!("-{sig}"))
        .args(pids.iter().map(u32::to_string))
        .stderr(Stdio::null())
        .status();
}

fn forward(
    rank: usize,
    src: impl Read + Send + 'static,
    to_stderr: bool,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut r = BufReader::new(src);
        let mut line = Vec::new();
        loop {
            line.clear();
            match r.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
            if line.last() != Some(&b'\n') {
                line.push(b'\n');
            }
            let mut out = format!("[rank {rank}] ").into_bytes();
            out.extend_from_slice(&line);
            // Whole lines under one lock so ranks never interleave mid-line.
            let _ = if to_stderr {
                std::io::stderr().lock().write_all(&out)
            } else {
                std::io::stdout().lock().write_all(&out)
            };
        }
    })
}

fn main() -> ExitCode {
    let args = Args::parse();
    if args.nproc_per_node == 0 || args.nnodes == 0 || args.node_rank >= args.nnodes {
        eprintln!(
            "smp-run: need --nproc-per-node >= 1, --nnodes >= 1 and --node-rank < --nnodes \
             (got {}, {}, {})",
            args.nproc_per_node, args.nnodes, args.node_rank
        );
        return ExitCode::from(2);
    }
    let port = match args.master_port {
        Some(p) if p != 0 => p,
        _ if args.nnodes > 1 => 29500,
        _ => match collectives::free_port() {
            Ok(p) => p,
            Err(e) => {
                eprintln!("smp-run: could not find a free port: {e}");
                return ExitCode::from(1);
            }
        },
    };
    let n = args.nproc_per_node;
    let world = n * args.nnodes;
    let (tx, rx) = mpsc::channel::<Event>();
    {
        let tx = tx.clone();
        if let Err(e) = ctrlc::set_handler(move || {
            let _ = tx.send(Event::Signal);
        }) {
            eprintln!("smp-run: warning: cannot forward signals: {e}");
        }
    }
    let mut pids: Vec<Option<u32>> = vec![None; n];
    let mut forwarders = Vec::new();
    let grace = Duration::from_secs_f64(args.kill_grace_secs.max(0.0));
    for local in 0..n {
        let rank = args.node_rank * n + local;
        let spawned = Command::new(&args.command[0])
            .args(&args.command[1..])
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("LOCAL_WORLD_SIZE", n.to_string())
            .env("MASTER_ADDR", &args.master_addr)
            .env("MASTER_PORT", port.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn();
        let mut child = match spawned {
            Ok(c) => c,
            Err(e) => {
                eprintln!(
                    "smp-run: cannot start {:?} for rank {rank}: {e}",
                    args.command[0]
                );
                let live: Vec<u32> = pids.iter().flatten().copied().collect();
                signal(&live, "KILL");
                return ExitCode::from(127);
            }
        };
        pids[local] = Some(child.id());
        if let Some(out) = child.stdout.take() {
            forwarders.push(forward(rank, out, false));
        }
        if let Some(err) = child.stderr.take() {
            forwarders.push(forward(rank, err, true));
        }
        let tx = tx.clone();
        std::thread::spawn(move || {
            let st = child.wait();
            let _ = tx.send(Event::Exited(local, st));
        });
    }
    drop(tx);

    let mut failure: Option<u8> = None;
    let mut stop_deadline: Option<Instant> = None;
    let mut killed = false;
    let mut running = n;
    while running > 0 {
        let ev = match stop_deadline {
            Some(d) => match rx.recv_timeout(d.saturating_duration_since(Instant::now())) {
                Ok(ev) => ev,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    if !killed {
                        let live: Vec<u32> = pids.iter().flatten().copied().collect();
                        eprintln!("smp-run: ranks still running after {grace:?}; killing them");
                        signal(&live, "KILL");
                        killed = true;
                    }
                    stop_deadline = Some(Instant::now() + Duration::from_secs(3600));
                    continue;
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            },
            None => match rx.recv() {
                Ok(ev) => ev,
                Err(_) => break,
            },
        };
        let stop_others = |pids: &[Option<u32>]| {
            let live: Vec<u32> = pids.iter().flatten().copied().collect();
            signal(&live, "TERM");
            Some(Instant::now() + grace)
        };
        match ev {
            Event::Exited(local, status) => {
                running -= 1;
                pids[local] = None;
                let rank = args.node_rank * n + local;
                let failed = match &status {
                    Ok(s) if s.success() => None,
                    Ok(s) => Some((describe(s), exit_code(s))),
                    Err(e) => Some((format!("unknown status ({e})"), 1)),
                };
                if let Some((what, code)) = failed
                    && failure.is_none()
                {
                    failure = Some(code);
                    eprintln!(
                        "smp-run: rank {rank} failed with {what}; stopping the other {running} local rank(s)"
                    );
                    if stop_deadline.is_none() {
                        stop_deadline = stop_others(&pids);
                    }
                }
            }
            Event::Signal => {
                if failure.is_none() {
                    failure = Some(130);
                }
                eprintln!("smp-run: interrupted; stopping {running} rank(s)");
                if stop_deadline.is_none() {
                    stop_deadline = stop_others(&pids);
                } else {
                    // A second interrupt means "now".
                    stop_deadline = Some(Instant::now());
                }
            }
        }
    }
    // Output of a rank that exited may still be in flight; do not let a grandchild that
    // keeps the pipe open hold the launcher forever.
    let flush_deadline = Instant::now() + Duration::from_secs(2);
    for f in forwarders {
        while !f.is_finished() && Instant::now() < flush_deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    match failure {
        None => ExitCode::SUCCESS,
        Some(code) => ExitCode::from(code),
    }
}
