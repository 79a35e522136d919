//! Throughput of large all-reduces; ignored by default (`cargo test --release -p
//! collectives --test integration bench -- --ignored --nocapture`).

use crate::common;

use std::time::Instant;

use collectives::{CommunicatorExt, ReduceOp};
use common::{BACKENDS, run};

#[test]
#[ignore = "benchmark"]
fn large_all_reduce_throughput() {
    let elems = 16 << 20;
    for backend in BACKENDS {
        for world in [2, 4] {
            let secs = run(backend, world, |c| {
                let mut buf = vec![c.rank() as f32; elems];
                c.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
                let t = Instant::now();
                for _ in 0..3 {
                    c.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
                }
                t.elapsed().as_secs_f64() / 3.0
            });
            let worst = secs.iter().cloned().fold(0.0, f64::max);
            eprintln!(
                "{backend:?} world {world}: {} MiB f32 all_reduce in {:.3}s ({:.2} GB/s algorithm bandwidth)",
                (elems * 4) >> 20,
                worst,
                (elems * 4) as f64 / worst / 1e9
            );
        }
    }
}
