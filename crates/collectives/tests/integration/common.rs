//! Runs the same test body on the thread and the TCP backend.

#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use collectives::{
    CommOptions, Communicator, RendezvousConfig, free_port, init_tcp, run_on_threads,
};

#[derive(Debug, Clone, Copy)]
pub enum Backend {
    Threads,
    Tcp,
}

pub const BACKENDS: [Backend; 2] = [Backend::Threads, Backend::Tcp];

pub fn opts() -> CommOptions {
    CommOptions::with_timeout(Duration::from_secs(5))
}

pub fn cfg(rank: usize, world: usize, port: u16, timeout: Duration) -> RendezvousConfig {
    RendezvousConfig {
        rank,
        world_size: world,
        local_rank: rank,
        local_world_size: world,
        master_addr: "127.0.0.1".into(),
        master_port: port,
        timeout,
        run_id: String::new(),
    }
}

/// Every TCP rank is a thread of this process going through the real rendezvous.
pub fn run_tcp<R: Send>(world: usize, f: impl Fn(Arc<dyn Communicator>) -> R + Sync) -> Vec<R> {
    let port = free_port().unwrap();
    let f = &f;
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..world)
            .map(|rank| {
                s.spawn(move || {
                    let comm = init_tcp(&cfg(rank, world, port, Duration::from_secs(5)), opts())
                        .unwrap_or_else(|e| panic!("rank {rank}: {e}"));
                    f(comm)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

pub fn run<R: Send>(
    backend: Backend,
    world: usize,
    f: impl Fn(Arc<dyn Communicator>) -> R + Sync,
) -> Vec<R> {
    match backend {
        Backend::Threads => run_on_threads(world, opts(), f),
        Backend::Tcp => run_tcp(world, f),
    }
}
