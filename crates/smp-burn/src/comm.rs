//! Collectives on Burn tensors.
//!
//! [`TensorComm`] is what the parallel layers call. [`HostTensorComm`] runs on any backend by
//! moving the bytes through host memory (CPU training and the threads-as-ranks tests); the CUDA
//! implementation in [`crate::cuda`] calls NCCL on Burn's own device buffers instead, so a
//! CUDA tensor never makes a host round trip.

use std::sync::Arc;

use burn::tensor::{DType, Tensor, TensorData, backend::Backend};
use collectives::{Communicator, CommunicatorExt, ReduceOp};

use crate::error::SmpError;

/// Collectives over flat (1-D) Burn tensors, for one process group.
///
/// Flat tensors are enough: the parallel layers flatten and pad a unit's parameters once, and
/// one large collective costs far less latency than many small ones.
pub trait TensorComm<B: Backend>: Send + Sync + std::fmt::Debug {
    /// This rank's index in the group.
    fn rank(&self) -> usize;
    /// Number of ranks in the group.
    fn world_size(&self) -> usize;
    /// Concatenates every rank's `shard` in rank order. All shards must have the same length.
    fn all_gather(&self, shard: Tensor<B, 1>) -> Result<Tensor<B, 1>, SmpError>;
    /// Reduces `full` over the ranks and returns this rank's contiguous chunk of the result.
    /// `full`'s length must be divisible by the world size.
    fn reduce_scatter(&self, full: Tensor<B, 1>, op: ReduceOp) -> Result<Tensor<B, 1>, SmpError>;
    /// Reduces `t` over the ranks; every rank gets the same result.
    fn all_reduce(&self, t: Tensor<B, 1>, op: ReduceOp) -> Result<Tensor<B, 1>, SmpError>;
    /// Every rank gets `root`'s tensor.
    fn broadcast(&self, t: Tensor<B, 1>, root: usize) -> Result<Tensor<B, 1>, SmpError>;
    /// Starts an all-gather whose result [`PendingGather::wait`] hands out. Implementations that
    /// can run it beside the work queued between the two calls (CUDA) do; the default gathers
    /// at once.
    fn all_gather_start(&self, shard: Tensor<B, 1>) -> Result<PendingGather<B>, SmpError> {
        Ok(PendingGather::ready(self.all_gather(shard)?))
    }
    /// Starts a reduce-scatter (as [`Self::reduce_scatter`]) whose result
    /// [`PendingGather::wait`] hands out, so that FSDP can reduce one unit's gradients while
    /// the previous unit's backward runs. Until then the implementation may keep `full` alive.
    /// The default reduces at once.
    fn reduce_scatter_start(
        &self,
        full: Tensor<B, 1>,
        op: ReduceOp,
    ) -> Result<PendingCollective<B>, SmpError> {
        Ok(PendingGather::ready(self.reduce_scatter(full, op)?))
    }
    /// Device time of the collectives that finished since the last call, where the
    /// implementation measures it (CUDA events around each NCCL call); `None` elsewhere. Does
    /// not wait: a collective still running is counted by a later call (waiting here made the
    /// host wait for the whole backward every step, emptying the GPU's queue).
    fn take_device_time(&self) -> Result<Option<std::time::Duration>, SmpError> {
        Ok(None)
    }
}

/// A collective in flight: an all-gather ([`TensorComm::all_gather_start`]) or a
/// reduce-scatter ([`TensorComm::reduce_scatter_start`]); the name predates the second use. Its
/// output may be read only after [`Self::wait`]; dropping it unwaited still orders later work
/// after it.
pub struct PendingGather<B: Backend> {
    out: Option<Tensor<B, 1>>,
    finish: Option<Box<dyn FnOnce() -> Result<(), SmpError>>>,
}

/// [`PendingGather`] under a name that fits every collective started ahead of its use.
pub type PendingCollective<B> = PendingGather<B>;

impl<B: Backend> std::fmt::Debug for PendingGather<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingGather")
            .field("in_flight", &self.finish.is_some())
            .finish()
    }
}

impl<B: Backend> PendingGather<B> {
    /// A collective that has already completed.
    pub fn ready(out: Tensor<B, 1>) -> Self {
        Self {
            out: Some(out),
            finish: None,
        }
    }

    /// A collective whose `out` becomes readable once `finish` has run (it makes later work wait
    /// for the collective and releases what the collective held).
    pub fn in_flight(out: Tensor<B, 1>, finish: Box<dyn FnOnce() -> Result<(), SmpError>>) -> Self {
        Self {
            out: Some(out),
            finish: Some(finish),
        }
    }

    /// The collective's output, ordered after the collective.
    pub fn wait(mut self) -> Result<Tensor<B, 1>, SmpError> {
        if let Some(f) = self.finish.take() {
            f()?;
        }
        Ok(self.out.take().expect("output taken once"))
    }
}

impl<B: Backend> Drop for PendingGather<B> {
    fn drop(&mut self) {
        if let Some(f) = self.finish.take()
            && let Err(e) = f()
        {
            tracing::warn!("finishing an unwaited collective: {e}");
        }
    }
}

/// [`TensorComm`] for any backend, through host memory and a [`Communicator`].
#[derive(Debug, Clone)]
pub struct HostTensorComm {
    comm: Arc<dyn Communicator>,
}

impl HostTensorComm {
    /// Wraps a host communicator (threads or TCP).
    pub fn new(comm: Arc<dyn Communicator>) -> Self {
        Self { comm }
    }

    /// The host communicator underneath.
    pub fn communicator(&self) -> &Arc<dyn Communicator> {
        &self.comm
    }
}

/// Host copy of a flat tensor in its own dtype, so bf16 travels as 2 bytes an element.
enum HostBuf {
    F32(Vec<f32>),
    Bf16(Vec<half::bf16>),
}

fn to_host<B: Backend>(t: Tensor<B, 1>) -> HostBuf {
    let data = t.into_data();
    match data.dtype {
        DType::BF16 => HostBuf::Bf16(data.to_vec::<half::bf16>().expect("bf16 data")),
        _ => HostBuf::F32(data.convert::<f32>().to_vec::<f32>().expect("f32 data")),
    }
}

fn from_host<B: Backend>(buf: HostBuf, device: &B::Device) -> Tensor<B, 1> {
    let data = match buf {
        HostBuf::F32(v) => {
            let n = v.len();
            TensorData::new(v, [n])
        }
        HostBuf::Bf16(v) => {
            let n = v.len();
            TensorData::new(v, [n])
        }
    };
    Tensor::from_data(data, device)
}

impl<B: Backend> TensorComm<B> for HostTensorComm {
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    fn all_gather(&self, shard: Tensor<B, 1>) -> Result<Tensor<B, 1>, SmpError> {
        let device = shard.device();
        let out = match to_host(shard) {
            HostBuf::F32(v) => HostBuf::F32(self.comm.all_gather(&v)?),
            HostBuf::Bf16(v) => HostBuf::Bf16(self.comm.all_gather(&v)?),
        };
        Ok(from_host(out, &device))
    }

    fn reduce_scatter(&self, full: Tensor<B, 1>, op: ReduceOp) -> Result<Tensor<B, 1>, SmpError> {
        let device = full.device();
        let out = match to_host(full) {
            HostBuf::F32(v) => HostBuf::F32(self.comm.reduce_scatter(&v, op)?),
            HostBuf::Bf16(v) => HostBuf::Bf16(self.comm.reduce_scatter(&v, op)?),
        };
        Ok(from_host(out, &device))
    }

    fn all_reduce(&self, t: Tensor<B, 1>, op: ReduceOp) -> Result<Tensor<B, 1>, SmpError> {
        let device = t.device();
        let out = match to_host(t) {
            HostBuf::F32(mut v) => {
                self.comm.all_reduce(&mut v, op)?;
                HostBuf::F32(v)
            }
            HostBuf::Bf16(mut v) => {
                self.comm.all_reduce(&mut v, op)?;
                HostBuf::Bf16(v)
            }
        };
        Ok(from_host(out, &device))
    }

    fn broadcast(&self, t: Tensor<B, 1>, root: usize) -> Result<Tensor<B, 1>, SmpError> {
        let device = t.device();
        let out = match to_host(t) {
            HostBuf::F32(mut v) => {
                self.comm.broadcast(&mut v, root)?;
                HostBuf::F32(v)
            }
            HostBuf::Bf16(mut v) => {
                self.comm.broadcast(&mut v, root)?;
                HostBuf::Bf16(v)
            }
        };
        Ok(from_host(out, &device))
    }
}
