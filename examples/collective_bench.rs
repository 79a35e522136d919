//! NCCL collectives through smp-burn's CUDA bridge, against bare NCCL.
//!
//! For all-reduce, all-gather, reduce-scatter and broadcast, sizes 1 MiB .. 1 GiB (bf16), three
//! variants: `bare` (NCCL on cudarc buffers, no Burn), `burn` (CudaTensorComm on Burn CUDA
//! tensors, ordered by context events) and `hostsync` (the same, ordered by host waits). Then
//! whether a Burn matmul loop overlaps an all-gather loop.
//!
//! Sizes follow the PyTorch baseline, `scripts/torch_coll.py`: `size` is the full buffer (the
//! all-reduce buffer, the gathered output, the reduce-scatter input); bus bandwidth as
//! nccl-tests: all-reduce `size/t * 2(n-1)/n`, all-gather and reduce-scatter
//! `size/t * (n-1)/n`, broadcast `size/t`. Times are the mean of back-to-back iterations (the slowest rank's).
//!
//! One GPU per thread by default; one process per GPU when `RANK`/`WORLD_SIZE` are set (e.g.
//! under `torchrun` or `smp-run`). Flags: `--max-mib N` (1024), `--iters N` (20),
//! `--world N` (all GPUs), `--no-overlap`, `--profile` (host cost of the bridge's steps).
//! Machine-readable lines: `RESULT|op|bytes|variant|ms|busbw_GBps`.

use std::sync::Arc;
use std::time::Instant;

use burn::tensor::{Distribution, Tensor, backend::Backend};
use burn_cuda::CudaDevice;
use collectives::{CommOptions, Communicator, CommunicatorExt, DType, ReduceOp};
use cudarc::driver::{CudaContext, DevicePtr, DevicePtrMut};
use half::bf16;
use smp_burn::TensorComm;
use smp_burn::cuda::{CudaTensorComm, Ordering, cuda_device_count};

/// The trainer's backend (plain CubeCL, no fusion): pinning a buffer is then one call to
/// CubeCL's server instead of a fusion resolve plus that call.
type B = smp_burn::cuda::CudaCube<bf16, i32>;

const OPS: [&str; 4] = ["all_reduce", "all_gather", "reduce_scatter", "broadcast"];

#[derive(Clone, Debug)]
struct Args {
    max_mib: usize,
    iters: usize,
    world: Option<usize>,
    overlap: bool,
    profile: bool,
}

/// The flags, for `--help` and after a bad one.
const USAGE: &str =
    "usage: collective_bench [--max-mib N] [--iters N] [--world N] [--no-overlap] [--profile]";

/// The command line as [`Args`]; `Err` names the flag and the value it could not use.
fn parse_args(argv: impl IntoIterator<Item = String>) -> Result<Args, String> {
    let mut a = Args {
        max_mib: 1024,
        iters: 20,
        world: None,
        overlap: true,
        profile: false,
    };
    let mut it = argv.into_iter();
    while let Some(flag) = it.next() {
        let mut value = || -> Result<usize, String> {
            let v = it.next().ok_or(format!("{flag} takes a positive number"))?;
            v.parse()
                .ok()
                .filter(|&n: &usize| n > 0)
                .ok_or(format!("{flag} takes a positive number, got {v:?}"))
        };
        match flag.as_str() {
            "--max-mib" => a.max_mib = value()?,
            "--iters" => a.iters = value()?,
            "--world" => a.world = Some(value()?),
            "--no-overlap" => a.overlap = false,
            "--profile" => a.profile = true,
            other => return Err(format!("unknown flag {other:?}")),
        }
    }
    Ok(a)
}

fn busbw(op: &str, bytes: usize, n: usize, secs: f64) -> f64 {
    let algbw = bytes as f64 / secs / 1e9;
    let nf = n as f64;
    match op {
        "all_reduce" => algbw * 2.0 * (nf - 1.0) / nf,
        "all_gather" | "reduce_scatter" => algbw * (nf - 1.0) / nf,
        _ => algbw,
    }
}

/// One measurement, already reduced to the slowest rank.
#[derive(Clone, Debug)]
struct Row {
    op: &'static str,
    bytes: usize,
    variant: &'static str,
    ms: f64,
    busbw: f64,
}

/// Slowest rank's time, so that every rank reports the same figure.
fn slowest(host: &dyn Communicator, secs: f64) -> f64 {
    let mut v = [secs];
    host.all_reduce(&mut v, ReduceOp::Max)
        .expect("all_reduce max");
    v[0]
}

fn run_rank(host: Arc<dyn Communicator>, device: usize, args: &Args) -> Vec<Row> {
    let (rank, world) = (host.rank(), host.world_size());
    let say = |s: &str| {
        if rank == 0 {
            println!("{s}");
        }
    };
    let dev = CudaDevice { index: device };
    let comm = CudaTensorComm::new(host.as_ref(), device).expect("NCCL init");
    let nccl = comm.nccl();
    let ctx = CudaContext::new(device).expect("cuda ctx");
    let stream = ctx.new_stream().expect("stream");
    let s = stream.cu_stream();
    say(&format!(
        "INFO|world {world}, NCCL {:?}, device cuda:{device}",
        collectives::nccl::nccl_version()
    ));

    // Correctness first, with no host synchronization between Burn and NCCL.
    {
        let x = Tensor::<B, 1>::full([1 << 20], (rank + 1) as f32, &dev);
        let sum = TensorComm::<B>::all_reduce(&comm, x.clone(), ReduceOp::Sum).unwrap();
        let g = TensorComm::<B>::all_gather(&comm, x.clone()).unwrap();
        let rs = TensorComm::<B>::reduce_scatter(&comm, x.clone(), ReduceOp::Sum).unwrap();
        let b = TensorComm::<B>::broadcast(&comm, x, world - 1).unwrap();
        let want = (world * (world + 1) / 2) as f32;
        let v = |t: Tensor<B, 1>| t.into_data().convert::<f32>().to_vec::<f32>().unwrap();
        let (vs, vg, vr, vb) = (v(sum + 0.0), v(g * 1.0), v(rs * 1.0), v(b * 1.0));
        let ok = vs.iter().all(|x| *x == want)
            && (0..world).all(|r| {
                vg[r << 20] == (r + 1) as f32 && vg[((r + 1) << 20) - 1] == (r + 1) as f32
            })
            && vr.iter().all(|x| *x == want)
            && vb.iter().all(|x| *x == world as f32);
        let mut flag = [if ok { 0u8 } else { 1u8 }];
        host.all_reduce(&mut flag, ReduceOp::Max).unwrap();
        say(&format!(
            "CHECK|all four collectives on Burn tensors, read back by Burn with no host sync: {}",
            if flag[0] == 0 { "OK" } else { "WRONG" }
        ));
    }

    let mut rows = Vec::new();
    let mut mib = 1;
    let mut sizes = Vec::new();
    while mib <= args.max_mib {
        sizes.push(mib);
        mib *= 4;
    }
    let iters = args.iters;
    let warm = 3;
    for &mib in &sizes {
        let bytes = mib << 20;
        let n = bytes / 2;
        let shard = n / world;
        for op in OPS {
            // (a) bare NCCL on cudarc buffers.
            {
                let (send_len, recv_len) = match op {
                    "all_gather" => (shard, n),
                    "reduce_scatter" => (n, shard),
                    _ => (n, n),
                };
                let send = stream.alloc_zeros::<bf16>(send_len).unwrap();
                let mut recv = stream.alloc_zeros::<bf16>(recv_len).unwrap();
                let (sp, _g1) = send.device_ptr(&stream);
                let (rp, _g2) = recv.device_ptr_mut(&stream);
                let one = || {
                    // SAFETY: cudarc buffers of the right lengths on this device, alive until the
                    // stream is synchronized below; `s` belongs to the same context.
                    unsafe {
                        match op {
                            "all_reduce" => {
                                nccl.all_reduce(sp, rp, n, DType::BF16, ReduceOp::Sum, s)
                            }
                            "all_gather" => nccl.all_gather(sp, rp, shard, DType::BF16, s),
                            "reduce_scatter" => {
                                nccl.reduce_scatter(sp, rp, shard, DType::BF16, ReduceOp::Sum, s)
                            }
                            _ => nccl.broadcast(sp, rp, n, DType::BF16, 0, s),
                        }
                    }
                    .unwrap()
                };
                for _ in 0..warm {
                    one();
                }
                // SAFETY: `s` is this device's live stream.
                unsafe { nccl.synchronize(s) }.unwrap();
                host.barrier().unwrap();
                let t = Instant::now();
                for _ in 0..iters {
                    one();
                }
                // SAFETY: `s` is this device's live stream.
                unsafe { nccl.synchronize(s) }.unwrap();
                let dt = slowest(host.as_ref(), t.elapsed().as_secs_f64() / iters as f64);
                rows.push(Row {
                    op,
                    bytes,
                    variant: "bare",
                    ms: dt * 1e3,
                    busbw: busbw(op, bytes, world, dt),
                });
            }
            // (b), (c) through CudaTensorComm on Burn bf16 tensors.
            let input_len = if op == "all_gather" { shard } else { n };
            let x = Tensor::<B, 1>::ones([input_len], &dev);
            B::sync(&dev).unwrap();
            for (variant, ordering) in
                [("burn", Ordering::Events), ("hostsync", Ordering::HostSync)]
            {
                comm.set_ordering(ordering);
                let one = || {
                    let out = match op {
                        "all_reduce" => {
                            TensorComm::<B>::all_reduce(&comm, x.clone(), ReduceOp::Sum)
                        }
                        "all_gather" => TensorComm::<B>::all_gather(&comm, x.clone()),
                        "reduce_scatter" => {
                            TensorComm::<B>::reduce_scatter(&comm, x.clone(), ReduceOp::Sum)
                        }
                        _ => TensorComm::<B>::broadcast(&comm, x.clone(), 0),
                    };
                    drop(out.unwrap());
                };
                for _ in 0..warm {
                    one();
                }
                comm.synchronize().unwrap();
                B::sync(&dev).unwrap();
                host.barrier().unwrap();
                let t = Instant::now();
                for _ in 0..iters {
                    one();
                }
                comm.synchronize().unwrap();
                B::sync(&dev).unwrap();
                let dt = slowest(host.as_ref(), t.elapsed().as_secs_f64() / iters as f64);
                rows.push(Row {
                    op,
                    bytes,
                    variant,
                    ms: dt * 1e3,
                    busbw: busbw(op, bytes, world, dt),
                });
            }
            comm.set_ordering(Ordering::Events);
            if rank == 0 {
                for r in rows
                    .iter()
                    .rev()
                    .take(3)
                    .collect::<Vec<_>>()
                    .into_iter()
                    .rev()
                {
                    println!(
                        "RESULT|{}|{}|{}|{:.4}|{:.1}",
                        r.op, r.bytes, r.variant, r.ms, r.busbw
                    );
                }
            }
        }
    }

    if args.overlap {
        overlap(host.as_ref(), &comm, &dev, iters);
    }
    if args.profile {
        profile(host.as_ref(), &comm, &dev, device);
    }
    rows
}

/// Host-side cost of the bridge's steps for a 64 MiB all-reduce (enqueue only, no waits).
fn profile(host: &dyn Communicator, comm: &CudaTensorComm, dev: &CudaDevice, device: usize) {
    let n = (64 << 20) / 2;
    let reps = 50;
    let x = Tensor::<B, 1>::ones([n], dev);
    let bridge = smp_burn::cuda::StreamBridge::new(device).unwrap();
    let settle = || {
        comm.synchronize().unwrap();
        B::sync(dev).unwrap();
        bridge.context().synchronize().unwrap();
        host.barrier().unwrap();
    };
    let per = |t: Instant| t.elapsed().as_secs_f64() / reps as f64 * 1e6;
    settle();
    let t = Instant::now();
    for _ in 0..reps {
        drop(Tensor::<B, 1>::empty([n], dev));
    }
    let t_empty = per(t);
    settle();
    let t = Instant::now();
    for _ in 0..reps {
        drop(smp_burn::cuda::pin_tensor(&x).unwrap());
    }
    let t_pin = per(t);
    settle();
    let t = Instant::now();
    for _ in 0..reps {
        let o = Tensor::<B, 1>::empty([n], dev);
        drop(smp_burn::cuda::pin_tensor(&o).unwrap());
    }
    let t_pin_new = per(t);
    settle();
    let t = Instant::now();
    for _ in 0..reps {
        bridge.burn_to_comm().unwrap();
        bridge.comm_to_burn().unwrap();
    }
    let t_fence = per(t);
    settle();
    let mut enq = Vec::new();
    for _ in 0..3 {
        let t = Instant::now();
        for _ in 0..reps {
            drop(TensorComm::<B>::all_reduce(comm, x.clone(), ReduceOp::Sum).unwrap());
        }
        enq.push(per(t));
        settle();
    }
    let t = Instant::now();
    for _ in 0..reps {
        drop(TensorComm::<B>::all_reduce(comm, x.clone(), ReduceOp::Sum).unwrap());
    }
    comm.synchronize().unwrap();
    B::sync(dev).unwrap();
    let t_total = per(t);
    if host.rank() == 0 {
        println!(
            "PROFILE|64MiB all_reduce, us per op (host): empty {t_empty:.1}; pin existing {t_pin:.1}; empty+pin {t_pin_new:.1}; fence pair {t_fence:.1}; whole op enqueue {enq:.1?}; whole op incl. GPU {t_total:.1}"
        );
    }
}

/// Does a Burn matmul loop overlap an all-gather loop? Times each alone and both interleaved
/// on the same thread (how FSDP prefetch would issue them).
fn overlap(host: &dyn Communicator, comm: &CudaTensorComm, dev: &CudaDevice, iters: usize) {
    let rank = host.rank();
    let world = host.world_size();
    let m = 8192;
    let a = Tensor::<B, 2>::random([m, m], Distribution::Normal(0.0, 0.01), dev);
    let b = Tensor::<B, 2>::random([m, m], Distribution::Normal(0.0, 0.01), dev);
    let shard = Tensor::<B, 1>::ones([(256 << 20) / 2 / world], dev);
    let mm = || drop(a.clone().matmul(b.clone()));
    let ag = || drop(TensorComm::<B>::all_gather(comm, shard.clone()).unwrap());
    let time = |f: &dyn Fn()| {
        for _ in 0..2 {
            f();
        }
        comm.synchronize().unwrap();
        B::sync(dev).unwrap();
        host.barrier().unwrap();
        let t = Instant::now();
        for _ in 0..iters {
            f();
        }
        comm.synchronize().unwrap();
        B::sync(dev).unwrap();
        slowest(host, t.elapsed().as_secs_f64() / iters as f64) * 1e3
    };
    let t_mm = time(&mm);
    let t_ag = time(&ag);
    let t_both = time(&|| {
        ag();
        mm();
    });
    if rank == 0 {
        let tflops = 2.0 * (m as f64).powi(3) / (t_mm * 1e-3) / 1e12;
        println!("RESULT|overlap_matmul_8192|0|alone|{t_mm:.4}|{tflops:.1}");
        println!(
            "RESULT|overlap_allgather_256MiB|{}|alone|{t_ag:.4}|0",
            256 << 20
        );
        println!("RESULT|overlap_both|0|interleaved|{t_both:.4}|0");
        let hidden = (t_mm + t_ag - t_both) / t_mm.min(t_ag) * 100.0;
        println!(
            "OVERLAP|matmul {t_mm:.3} ms + all-gather {t_ag:.3} ms alone = {:.3} ms; together {t_both:.3} ms; {hidden:.0}% of the shorter one hidden",
            t_mm + t_ag
        );
    }
}

fn print_table(rows: &[Row]) {
    println!(
        "\n{:<15} {:>9} {:>22} {:>22} {:>22}",
        "op", "size", "bare ms / GB/s", "burn ms / GB/s", "hostsync ms / GB/s"
    );
    let mut keys: Vec<(&str, usize)> = rows.iter().map(|r| (r.op, r.bytes)).collect();
    keys.dedup();
    for (op, bytes) in keys {
        let cell = |v: &str| {
            rows.iter()
                .find(|r| r.op == op && r.bytes == bytes && r.variant == v)
                .map(|r| format!("{:.3} / {:.1}", r.ms, r.busbw))
                .unwrap_or_default()
        };
        println!(
            "{:<15} {:>6}MiB {:>22} {:>22} {:>22}",
            op,
            bytes >> 20,
            cell("bare"),
            cell("burn"),
            cell("hostsync")
        );
    }
}

fn main() {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    if argv.iter().any(|a| a == "--help" || a == "-h") {
        println!("{USAGE}");
        return;
    }
    let args = parse_args(argv).unwrap_or_else(|e| {
        eprintln!("collective_bench: {e}\n{USAGE}");
        std::process::exit(2);
    });
    let gpus = cuda_device_count();
    if gpus == 0 {
        eprintln!("collective_bench: no CUDA device (or no libcuda) on this machine");
        std::process::exit(2);
    }
    let opts = CommOptions::from_env().expect("comm options");
    let rows = if std::env::var("RANK").is_ok() && std::env::var("WORLD_SIZE").is_ok() {
        let cfg = collectives::RendezvousConfig::from_env().expect("rendezvous config");
        let host = collectives::init_tcp(&cfg, opts).expect("TCP rendezvous");
        let rank = host.rank();
        let rows = run_rank(host, cfg.local_rank % gpus, &args);
        if rank == 0 { rows } else { Vec::new() }
    } else {
        let world = args.world.unwrap_or(gpus);
        let mut all = collectives::run_on_threads(world, opts, |host| {
            let r = host.rank();
            run_rank(host, r, &args)
        });
        all.swap_remove(0)
    };
    if !rows.is_empty() {
        print_table(&rows);
    }
}
