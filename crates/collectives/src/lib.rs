//! Collective communication for distributed training.
//!
//! The collective algorithms ([`Communicator`]) are written once over a point-to-point
//! transport; two transports exist: threads inside one process ([`ThreadGroup`],
//! [`run_on_threads`]) and TCP between processes ([`init_tcp`]), which rendezvous through a
//! small key-value [`Store`] hosted by rank 0. [`DeviceMesh`] arranges a world communicator
//! into named axes (replicate / shard / tensor ...). The `smp-run` binary launches a job the
//! way `torchrun` does.
//!
//! Reductions are deterministic: every contribution is combined in rank order `0..n`, so all
//! ranks receive bitwise-identical results equal to a serial reduction in rank order.
//!
//! ```
//! use collectives::{CommOptions, CommunicatorExt, DeviceMesh, ReduceOp, run_on_threads};
//!
//! let sums = run_on_threads(4, CommOptions::default(), |world| {
//!     let mesh = DeviceMesh::new(world.clone(), &[("replicate", 2), ("shard", 2)]).unwrap();
//!     let mut grad = vec![world.rank() as f32; 3];
//!     mesh.axis("shard").unwrap().all_reduce(&mut grad, ReduceOp::Sum).unwrap();
//!     grad[0]
//! });
//! assert_eq!(sums, vec![1.0, 1.0, 5.0, 5.0]);
//! ```
//!
//! A training program started by `smp-run --nproc-per-node 4 -- ./train` calls
//! [`init_from_env`] to get its world communicator.

mod algo;
mod comm;
mod dtype;
mod error;
mod mailbox;
mod mesh;
#[cfg(feature = "nccl")]
pub mod nccl;
mod rendezvous;
mod store;
mod tcp;
mod threads;

pub use comm::{CommOptions, Communicator, CommunicatorExt, GroupInfo};
pub use dtype::{DType, Element, ReduceOp};
pub use error::{CommError, Result};
pub use mesh::DeviceMesh;
pub use rendezvous::{RendezvousConfig, expand_nodelist, free_port};
pub use store::Store;
pub use tcp::{init_from_env, init_tcp, init_tcp_with_store};
pub use threads::{ThreadGroup, run_on_threads};
