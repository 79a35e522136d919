//! Rendezvous failures must be quick and say exactly what went wrong.

use crate::common;

use std::time::{Duration, Instant};

use collectives::{CommError, Store, free_port, init_tcp, init_tcp_with_store};
use common::{cfg, opts};

#[test]
fn wrong_world_size_fails_on_every_rank() {
    let port = free_port().unwrap();
    let t = Instant::now();
    let errs: Vec<String> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..3)
            .map(|rank| {
                s.spawn(move || {
                    let world = if rank == 2 { 4 } else { 3 };
                    init_tcp(&cfg(rank, world, port, Duration::from_secs(5)), opts())
                        .unwrap_err()
                        .to_string()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(
        t.elapsed() < Duration::from_secs(4),
        "took {:?}",
        t.elapsed()
    );
    for e in &errs {
        assert!(
            e.contains("rank 2 was started with WORLD_SIZE=4 but rank 0 has WORLD_SIZE=3"),
            "{e}"
        );
    }
}

#[test]
fn unreachable_master_names_address_and_timeout() {
    let port = free_port().unwrap();
    let t = Instant::now();
    let e = init_tcp(&cfg(1, 2, port, Duration::from_millis(500)), opts()).unwrap_err();
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "took {:?}",
        t.elapsed()
    );
    assert!(matches!(e, CommError::Rendezvous { .. }));
    let e = e.to_string();
    assert!(
        e.contains(&format!("127.0.0.1:{port}")) && e.contains("500ms"),
        "{e}"
    );
}

#[test]
fn missing_ranks_are_listed() {
    let port = free_port().unwrap();
    let errs: Vec<String> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|rank| {
                s.spawn(move || {
                    init_tcp(&cfg(rank, 4, port, Duration::from_secs(1)), opts())
                        .unwrap_err()
                        .to_string()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(
        errs[0],
        format!(
            "rendezvous at 127.0.0.1:{port} timed out after 1s: 2 of 4 ranks arrived; missing ranks [2, 3]"
        )
    );
    assert!(errs[1].contains("missing ranks [2, 3]"), "{}", errs[1]);
}

#[test]
fn store_is_usable_after_init() {
    let port = free_port().unwrap();
    let out: Vec<Vec<u8>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|rank| {
                s.spawn(move || {
                    let (comm, store) =
                        init_tcp_with_store(&cfg(rank, 2, port, Duration::from_secs(5)), opts())
                            .unwrap();
                    if rank == 0 {
                        store.set("nccl/id", b"unique").unwrap();
                    }
                    let v = store.get("nccl/id").unwrap();
                    // Keeps rank 0's store alive until rank 1 has read.
                    comm.barrier().unwrap();
                    v
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(out, vec![b"unique".to_vec(), b"unique".to_vec()]);
    let e = Store::connect(
        "127.0.0.1",
        free_port().unwrap(),
        Duration::from_millis(100),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("could not reach the store within 100ms"), "{e}");
}
