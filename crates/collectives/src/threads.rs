//! In-process transport: each rank is a thread, messages are copied between mailboxes.

use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::Arc;

use crate::algo::{GroupComm, Transport};
use crate::comm::{CommOptions, Communicator};
use crate::mailbox::Mailbox;

#[derive(Debug)]
struct Fabric {
    boxes: Vec<Mailbox>,
}

impl Fabric {
    /// Tells every other rank that `rank` will send nothing more, so they fail fast with
    /// `PeerClosed` instead of waiting out their timeout.
    fn close(&self, rank: usize, reason: &str) {
        for (i, b) in self.boxes.iter().enumerate() {
            if i != rank {
                b.close(rank, reason.to_string());
            }
        }
    }
}

#[derive(Debug)]
struct Endpoint {
    rank: usize,
    fabric: Arc<Fabric>,
}

impl Transport for Endpoint {
    fn global_rank(&self) -> usize {
        self.rank
    }

    fn mailbox(&self) -> &Mailbox {
        &self.fabric.boxes[self.rank]
    }

    fn send(&self, dst: usize, group: u64, tag: u64, payload: &[u8]) -> Result<(), String> {
        self.fabric.boxes[dst].push(group, self.rank, tag, payload.to_vec());
        Ok(())
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        // Dropping the last communicator of a rank is the thread analogue of a process
        // exiting: its TCP connections would close.
        self.fabric
            .close(self.rank, "its communicators were all dropped");
    }
}

/// Communicators for ranks that are threads of this process.
#[derive(Debug)]
pub struct ThreadGroup;

impl ThreadGroup {
    /// One world communicator per rank, index = rank; hand each to its own thread.
    #[allow(
        clippy::new_ret_no_self,
        reason = "the agreed API: one communicator per rank"
    )]
    pub fn new(world: usize, opts: CommOptions) -> Vec<Arc<dyn Communicator>> {
        let fabric = Arc::new(Fabric {
            boxes: (0..world).map(|_| Mailbox::default()).collect(),
        });
        (0..world)
            .map(|rank| {
                let t: Arc<dyn Transport> = Arc::new(Endpoint {
                    rank,
                    fabric: fabric.clone(),
                });
                Arc::new(GroupComm::world(t, world, opts.clone())) as Arc<dyn Communicator>
            })
            .collect()
    }
}

/// Runs `f` on `world` scoped threads, each with its rank's world communicator; rank `i`'s
/// result is at index `i`.
///
/// A rank that returns or panics is marked gone, so ranks still waiting on it fail with
/// [`CommError::PeerClosed`](crate::CommError::PeerClosed) rather than hang. The first
/// panic (lowest rank) is re-raised after every thread has been joined.
pub fn run_on_threads<R: Send>(
    world: usize,
    opts: CommOptions,
    f: impl Fn(Arc<dyn Communicator>) -> R + Sync,
) -> Vec<R> {
    let fabric = Arc::new(Fabric {
        boxes: (0..world).map(|_| Mailbox::default()).collect(),
    });
    let f = &f;
    let outcomes: Vec<std::thread::Result<R>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let fabric = fabric.clone();
                let opts = opts.clone();
                std::thread::Builder::new()
                    .name(format!("rank-{rank}"))
                    .spawn_scoped(s, move || {
                        let t: Arc<dyn Transport> = Arc::new(Endpoint {
                            rank,
                            fabric: fabric.clone(),
                        });
                        let comm: Arc<dyn Communicator> =
                            Arc::new(GroupComm::world(t, world, opts));
                        let out = catch_unwind(AssertUnwindSafe(|| f(comm)));
                        let why = if out.is_ok() { "returned" } else { "panicked" };
                        fabric.close(rank, &format!("rank {rank} {why}"));
                        out
                    })
                    .expect("spawning a rank thread")
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(Err))
            .collect()
    });
    let mut results = Vec::with_capacity(world);
    let mut panic = None;
    for o in outcomes {
        match o {
            Ok(r) => results.push(r),
            Err(p) => {
                panic.get_or_insert(p);
            }
        }
    }
    if let Some(p) = panic {
        resume_unwind(p);
    }
    results
}
