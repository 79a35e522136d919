//! Checks the TCP backend end to end when started by `smp-run` (or any torchrun-style
//! launcher): collectives against serial references, and, with `--die-rank R`, that the
//! surviving ranks report rank R's death instead of hanging.

use std::process::ExitCode;

use collectives::{
    CommOptions, Communicator, CommunicatorExt, DeviceMesh, ReduceOp, RendezvousConfig, init_tcp,
};
use half::bf16;

fn value(rank: usize, i: usize) -> f32 {
    ((rank * 31 + i * 7) % 97) as f32 * 0.37 - 11.0
}

fn check(comm: &dyn Communicator, elems: usize) -> Result<(), String> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let mut buf: Vec<f32> = (0..elems).map(|i| value(rank, i)).collect();
    comm.all_reduce(&mut buf, ReduceOp::Sum)
        .map_err(|e| e.to_string())?;
    for (i, got) in buf.iter().enumerate() {
        let want = (0..world).fold(0.0f32, |acc, r| acc + value(r, i));
        if got.to_bits() != want.to_bits() {
            return Err(format!("all_reduce element {i}: got {got}, want {want}"));
        }
    }
    let mut b: Vec<bf16> = (0..elems).map(|i| bf16::from_f32(value(rank, i))).collect();
    comm.all_reduce(&mut b, ReduceOp::Avg)
        .map_err(|e| e.to_string())?;
    let gathered = comm.all_gather(&[rank as i64]).map_err(|e| e.to_string())?;
    if gathered != (0..world as i64).collect::<Vec<_>>() {
        return Err(format!("all_gather of ranks gave {gathered:?}"));
    }
    let mut root = vec![rank as f32; 3];
    comm.broadcast(&mut root, world - 1)
        .map_err(|e| e.to_string())?;
    if root != vec![(world - 1) as f32; 3] {
        return Err(format!("broadcast gave {root:?}"));
    }
    println!(
        "all_reduce ok: world {world}, {elems} elements, sum[0] = {}",
        buf[0]
    );
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let flag = |name: &str| -> Option<usize> {
        let i = args.iter().position(|a| a == name)?;
        args.get(i + 1).and_then(|v| v.parse().ok())
    };
    let die_rank = flag("--die-rank");
    let elems = flag("--elems").unwrap_or(1000);
    let run = || -> Result<(), String> {
        let cfg = RendezvousConfig::from_env().map_err(|e| e.to_string())?;
        let opts = CommOptions::from_env().map_err(|e| e.to_string())?;
        let comm = init_tcp(&cfg, opts).map_err(|e| e.to_string())?;
        check(&*comm, elems)?;
        if die_rank == Some(cfg.rank) {
            eprintln!("exiting abruptly as asked by --die-rank");
            std::process::exit(17);
        }
        if comm.world_size() % 2 == 0 {
            let mesh = DeviceMesh::new(comm.clone(), &[("a", 2), ("b", comm.world_size() / 2)])
                .map_err(|e| e.to_string())?;
            check(&*mesh.axis("b").map_err(|e| e.to_string())?, elems)?;
        }
        comm.barrier().map_err(|e| e.to_string())?;
        check(&*comm, elems)?;
        println!("selftest passed");
        Ok(())
    };
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("selftest failed: {e}");
            // A rank that fails because a peer died should not exit before the peer is
            // seen to have died: the launcher reports whichever failure it sees first.
            std::thread::sleep(std::time::Duration::from_millis(500));
            ExitCode::from(1)
        }
    }
}
