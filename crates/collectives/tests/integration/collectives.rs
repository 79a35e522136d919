//! Every collective against a serial reference, on threads and on TCP.

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use collectives::{
    CommError, CommOptions, Communicator, CommunicatorExt, DeviceMesh, ReduceOp, run_on_threads,
};
use common::{BACKENDS, run};
use half::bf16;

/// Awkward values so that summation order changes the result bits.
fn val(rank: usize, i: usize) -> f32 {
    let x = ((rank * 7919 + i * 104_729) % 1000) as f32;
    (x - 500.0) * 1.000_123_4 + 1e-3 * (rank as f32 + 1.0) * 1e4_f32.powi((i % 3) as i32)
}

fn serial_f32(world: usize, len: usize, op: ReduceOp) -> Vec<f32> {
    (0..len)
        .map(|i| {
            let mut acc = val(0, i);
            for r in 1..world {
                acc = match op {
                    ReduceOp::Max => acc.max(val(r, i)),
                    _ => acc + val(r, i),
                };
            }
            if op == ReduceOp::Avg {
                acc / world as f32
            } else {
                acc
            }
        })
        .collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// The whole suite from one rank's point of view; returns the all-reduce result so the
/// caller can compare ranks bit for bit.
fn suite(comm: Arc<dyn Communicator>) -> Vec<u32> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let mut first = Vec::new();
    for len in [0usize, 1, 5, 17, 1001] {
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
            let mut buf: Vec<f32> = (0..len).map(|i| val(rank, i)).collect();
            comm.all_reduce(&mut buf, op).unwrap();
            assert_eq!(
                bits(&buf),
                bits(&serial_f32(world, len, op)),
                "{op:?} len {len}"
            );
            if len == 1001 && op == ReduceOp::Sum {
                first = bits(&buf);
            }
        }
        // bf16 sums accumulate in f32 in rank order and round once.
        let mut b: Vec<bf16> = (0..len).map(|i| bf16::from_f32(val(rank, i))).collect();
        comm.all_reduce(&mut b, ReduceOp::Sum).unwrap();
        let want: Vec<bf16> = (0..len)
            .map(|i| {
                let s = (0..world).fold(0.0f32, |a, r| a + bf16::from_f32(val(r, i)).to_f32());
                bf16::from_f32(s)
            })
            .collect();
        assert_eq!(b, want, "bf16 len {len}");

        // reduce_scatter on len*world elements: rank r gets chunk r.
        let send: Vec<f32> = (0..len * world).map(|i| val(rank, i)).collect();
        let got = comm.reduce_scatter(&send, ReduceOp::Sum).unwrap();
        let full = serial_f32(world, len * world, ReduceOp::Sum);
        assert_eq!(bits(&got), bits(&full[rank * len..(rank + 1) * len]));
        let sendb: Vec<bf16> = send.iter().map(|&x| bf16::from_f32(x)).collect();
        let gotb = comm.reduce_scatter(&sendb, ReduceOp::Avg).unwrap();
        assert_eq!(gotb.len(), len);

        let mine: Vec<f32> = (0..len).map(|i| val(rank, i)).collect();
        let all = comm.all_gather(&mine).unwrap();
        let want: Vec<f32> = (0..world)
            .flat_map(|r| (0..len).map(move |i| val(r, i)))
            .collect();
        assert_eq!(bits(&all), bits(&want));
        let allb = comm.all_gather(&[bf16::from_f32(rank as f32); 2]).unwrap();
        assert_eq!(allb[2 * world - 1], bf16::from_f32((world - 1) as f32));
    }
    // Uneven lengths, including an empty contribution from rank 0.
    let mine: Vec<f32> = (0..rank * 3).map(|i| val(rank, i)).collect();
    let var = comm.all_gather_varlen(&mine).unwrap();
    assert_eq!(var.len(), world);
    for (r, v) in var.iter().enumerate() {
        assert_eq!(
            bits(v),
            bits(&(0..r * 3).map(|i| val(r, i)).collect::<Vec<_>>())
        );
    }
    // Not divisible by the group size.
    if world > 1 {
        let err = comm
            .reduce_scatter(&vec![1.0f32; world * 2 + 1], ReduceOp::Sum)
            .unwrap_err();
        assert!(matches!(err, CommError::SizeMismatch { .. }), "{err}");
        let msg = err.to_string();
        assert!(
            msg.contains(&format!("length {}", world * 2 + 1))
                && msg.contains(&format!("group size {world}")),
            "{msg}"
        );
    }
    for root in 0..world {
        let mut b: Vec<f32> = if rank == root {
            vec![root as f32 + 0.5; 7]
        } else {
            vec![0.0; 7]
        };
        comm.broadcast(&mut b, root).unwrap();
        assert_eq!(b, vec![root as f32 + 0.5; 7]);
    }
    let mut ints = vec![rank as i32 - 1, 10];
    comm.all_reduce(&mut ints, ReduceOp::Max).unwrap();
    assert_eq!(ints, vec![world as i32 - 2, 10]);
    comm.barrier().unwrap();
    first
}

#[test]
fn collectives_match_serial_reference_on_all_backends() {
    for backend in BACKENDS {
        for world in 1..=4 {
            let t = Instant::now();
            let results = run(backend, world, suite);
            // Deterministic reduction: every rank holds the same bits.
            assert!(
                results.windows(2).all(|w| w[0] == w[1]),
                "{backend:?} world {world}"
            );
            eprintln!("{backend:?} world {world}: {:?}", t.elapsed());
        }
    }
}

fn mesh_body(world: Arc<dyn Communicator>) -> (usize, Vec<i64>, Vec<i64>) {
    let g = world.rank();
    let mesh = DeviceMesh::new(world, &[("replicate", 2), ("shard", 2), ("tensor", 1)]).unwrap();
    assert_eq!(mesh.axis_names(), ["replicate", "shard", "tensor"]);
    assert_eq!(mesh.coord("replicate"), g / 2);
    assert_eq!(mesh.coord("shard"), g % 2);
    assert_eq!(mesh.degree("tensor"), 1);
    let shard = mesh.axis("shard").unwrap();
    let rep = mesh.axis("replicate").unwrap();
    assert_eq!(shard.rank(), g % 2);
    assert_eq!(shard.group().global_ranks, vec![g / 2 * 2, g / 2 * 2 + 1]);
    let mut s = [g as i64 + 1];
    shard.all_reduce(&mut s, ReduceOp::Sum).unwrap();
    let r = rep.all_gather(&[g as i64]).unwrap();
    let t = mesh.axis("tensor").unwrap();
    let mut x = [g as i64];
    t.all_reduce(&mut x, ReduceOp::Sum).unwrap();
    assert_eq!(x[0], g as i64);
    // A split of a split, with each rank naming only its own sub-group.
    let me = shard.rank();
    let solo = shard.split("solo", &[me]).unwrap();
    assert_eq!(solo.world_size(), 1);
    solo.barrier().unwrap();
    // Interleave collectives on overlapping groups to exercise demultiplexing.
    mesh.world().barrier().unwrap();
    let rs = rep.reduce_scatter(&[g as i64; 4], ReduceOp::Sum).unwrap();
    let dp = mesh.flatten(&["replicate", "shard"]).unwrap();
    assert_eq!(dp.world_size(), 4);
    assert_eq!(dp.group().name, "replicate+shard");
    let mut one = [1i32];
    dp.all_reduce(&mut one, ReduceOp::Sum).unwrap();
    assert_eq!(one[0], 4);
    let rt = mesh.flatten(&["replicate", "tensor"]).unwrap();
    assert_eq!(rt.group().global_ranks, vec![g % 2, g % 2 + 2]);
    let unknown = mesh.axis("pipeline").unwrap_err().to_string();
    assert!(
        unknown.contains("'pipeline'") && unknown.contains("shard"),
        "{unknown}"
    );
    (g, vec![s[0]], r.into_iter().chain(rs).collect())
}

#[test]
fn mesh_sub_groups_on_2x2() {
    for backend in BACKENDS {
        for (g, s, r) in run(backend, 4, mesh_body) {
            let pair = g / 2 * 2;
            assert_eq!(s, vec![(pair + 1 + pair + 2) as i64]);
            let col = g % 2;
            let sum = (col + col + 2) as i64;
            assert_eq!(r, vec![col as i64, col as i64 + 2, sum, sum]);
        }
    }
}

#[test]
fn mesh_validation_names_values() {
    let errs = run_on_threads(4, common::opts(), |w| {
        let a = DeviceMesh::new(w.clone(), &[("replicate", 3), ("shard", 2)]).unwrap_err();
        let b = DeviceMesh::new(w.clone(), &[("replicate", 4), ("shard", 0)]).unwrap_err();
        let c = DeviceMesh::new(w.clone(), &[("x", 2), ("x", 2)]).unwrap_err();
        [a, b, c].map(|e| {
            assert!(matches!(e, CommError::InvalidMesh { .. }));
            e.to_string()
        })
    });
    let [a, b, c] = &errs[0];
    assert!(
        a.contains("replicate=3")
            && a.contains("shard=2")
            && a.contains("is 6")
            && a.contains("world size is 4"),
        "{a}"
    );
    assert!(b.contains("'shard' has degree 0"), "{b}");
    assert!(c.contains("'x' appears more than once"), "{c}");
}

#[test]
fn timeout_names_the_missing_rank() {
    let opts = CommOptions::with_timeout(Duration::from_millis(300));
    let out = run_on_threads(3, opts, |c| {
        if c.rank() == 2 {
            std::thread::sleep(Duration::from_millis(800));
            return None;
        }
        Some(c.all_gather(&[1.0f32]).unwrap_err())
    });
    for e in out.into_iter().flatten() {
        assert!(matches!(&e, CommError::Timeout { waiting_for, .. } if waiting_for == &[2]));
        assert_eq!(
            e.to_string(),
            "all_gather on group 'world' (global ranks [0, 1, 2]) timed out after 300ms waiting for ranks [2]"
        );
    }
}

#[test]
fn panicking_rank_propagates_and_does_not_hang_peers() {
    let t = Instant::now();
    let seen = std::sync::Mutex::new(None);
    let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        run_on_threads(2, CommOptions::with_timeout(Duration::from_secs(30)), |c| {
            if c.rank() == 1 {
                panic!("rank 1 blew up");
            }
            *seen.lock().unwrap() = Some(c.all_reduce(&mut [1.0f32], ReduceOp::Sum));
        })
    }));
    assert!(res.is_err(), "the panic must propagate");
    let err = seen.into_inner().unwrap().unwrap().unwrap_err();
    assert!(
        matches!(err, CommError::PeerClosed { peer: 1, .. }),
        "{err}"
    );
    assert!(t.elapsed() < Duration::from_secs(10));
}

#[test]
fn mismatched_sizes_between_ranks_are_reported() {
    let out = run_on_threads(2, common::opts(), |c| {
        let mine = vec![0u8; 2 + c.rank()];
        c.all_gather(&mine).err().map(|e| e.to_string())
    });
    let msg = out[0].as_ref().expect("rank 0 must notice");
    assert!(
        msg.contains("sent 3 bytes") && msg.contains("expected 2"),
        "{msg}"
    );
}
