//! Device values read by the host later, without draining the GPU's queue.
//!
//! A training loop that reads its loss (or gradient norm) at the end of every step makes the
//! host wait until the GPU has run everything queued, so the GPU then sits idle while the host
//! queues the first kernels of the next step, and the forward pass (many small ops) is issued
//! no faster than the GPU runs it. On a 1.2B model on one H200 that cost 5-10 ms of a 100 ms
//! step: ncu counted 90.7 ms of GPU time in steps of 95-102 ms (session 6, call BB).
//!
//! [`read_later`] queues the device-to-host copy now, on Burn's stream behind the work that
//! produces the value, and [`PendingRead::wait`] blocks only until that copy is done. Waited for
//! after the next step's work is queued, it costs nothing: PyTorch's loop logging `loss.item()`
//! of the previous step does the same.

use std::any::TypeId;
use std::future::Future;
use std::pin::Pin;

use burn::tensor::{DType, Tensor, backend::Backend};
use burn_cubecl::kernel::into_contiguous;
use cubecl::Runtime;
use cubecl::cuda::CudaRuntime;
use cubecl::device::Device;
use cubecl::device_handle::DeviceHandle;
use cubecl::server::{ComputeServer, CopyDescriptor, ServerError};
use cubecl::stream_id::StreamId;

use crate::cuda::CudaCube;
use crate::error::SmpError;

/// A queued device-to-host copy: waiting for it gives the bytes (one chunk per descriptor).
pub(crate) type BytesFuture =
    Pin<Box<dyn Future<Output = Result<Vec<cubecl::bytes::Bytes>, ServerError>> + Send>>;

/// Queues a copy of the first `bytes` bytes of a contiguous CUDA tensor's buffer to pinned host
/// memory, on Burn's stream behind the work that produces it, and returns at once. What
/// `ComputeClient::read_async` does, minus its future's borrow of the client: the server task
/// queues the copy and records a fence now; the returned future only waits for the fence (and
/// holds the device buffer until then).
pub(crate) fn queue_cuda_read(
    prim: burn_cubecl::tensor::CubeTensor<CudaRuntime>,
    bytes: usize,
) -> Result<BytesFuture, SmpError> {
    let stream = StreamId::current();
    let desc = CopyDescriptor::new(prim.handle.clone().binding(), [bytes].into(), [1].into(), 1);
    let server = DeviceHandle::<CudaServer>::new(prim.device.to_id());
    server
        .submit_blocking(move |server| server.read(vec![desc], stream))
        .map_err(|e| SmpError::Cuda(format!("reaching CubeCL's device thread: {e:?}")))
}

/// Waits for a copy queued by [`queue_cuda_read`]; `what` names it in the error.
pub(crate) fn wait_cuda_read(
    fut: BytesFuture,
    what: &str,
) -> Result<cubecl::bytes::Bytes, SmpError> {
    let mut chunks =
        cubecl::reader::read_sync(fut).map_err(|e| SmpError::Cuda(format!("{what}: {e:?}")))?;
    chunks
        .pop()
        .ok_or_else(|| SmpError::Cuda(format!("{what}: the copy returned no data")))
}

/// Allocates a contiguous CUDA tensor of `shape` and `dtype` on `device` and queues the copy of
/// `bytes` into it on Burn's stream, in order with the kernels, and returns at once. Why not
/// `Tensor::from_data`: CubeCL 0.10's `create_tensor` (under Burn 0.21) copies the bytes twice
/// on the host (into a staging buffer, then into a pageable `Vec`) and uploads from pageable
/// memory into a pitched layout, which moved a 32 MiB activation at 0.8 GB/s on an H200
/// (session 9, call DB). Here
/// pinned `bytes` (what [`queue_cuda_read`] returns) go up with one asynchronous copy; CubeCL
/// keeps them alive until the stream has passed the copy.
pub(crate) fn queue_cuda_upload(
    device: &<CudaRuntime as Runtime>::Device,
    bytes: cubecl::bytes::Bytes,
    shape: burn::tensor::Shape,
    dtype: DType,
) -> burn_cubecl::tensor::CubeTensor<CudaRuntime> {
    let client = CudaRuntime::client(device);
    let out = burn_cubecl::ops::numeric::empty_device_contiguous_dtype(
        client,
        device.clone(),
        shape,
        dtype,
    );
    let len = bytes.len();
    let desc = CopyDescriptor::new(out.handle.clone().binding(), [len].into(), [1].into(), 1);
    let stream = StreamId::current();
    DeviceHandle::<CudaServer>::new(device.to_id())
        .submit(move |server| server.write(vec![(desc, bytes)], stream));
    out
}

/// A 1-D device tensor's values on their way to the host (f32).
pub struct PendingRead {
    inner: Inner,
}

enum Inner {
    /// The copy is queued on the CUDA stream; the future waits for its fence. The count is the
    /// tensor's elements (the buffer may be padded).
    Cuda(BytesFuture, usize),
    /// Another backend: read when waited for (a synchronous read there costs no overlap).
    Deferred(Box<dyn FnOnce() -> Vec<f32> + Send>),
}

impl std::fmt::Debug for PendingRead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.inner {
            Inner::Cuda(..) => "cuda copy queued",
            Inner::Deferred(_) => "deferred read",
        };
        f.debug_struct("PendingRead").field("kind", &kind).finish()
    }
}

type CudaServer = <CudaRuntime as Runtime>::Server;

/// Starts reading `t` (any float dtype; returned as f32) to the host. On Burn's CUDA backend the
/// copy is queued now, behind the kernels that produce `t`; elsewhere `t` is kept and read by
/// [`PendingRead::wait`].
///
/// # Errors
/// If CubeCL's device thread cannot be reached.
pub fn read_later<B: Backend>(t: Tensor<B, 1>) -> Result<PendingRead, SmpError> {
    let t = t.cast(DType::F32);
    if TypeId::of::<B>() == TypeId::of::<CudaCube>() {
        let t: Tensor<CudaCube, 1> = crate::fast::same(t);
        let prim = into_contiguous(t.into_primitive().tensor());
        let len = prim.meta.num_elements();
        return Ok(PendingRead {
            inner: Inner::Cuda(queue_cuda_read(prim, len * 4)?, len),
        });
    }
    let read = move || {
        t.into_data()
            .convert::<f32>()
            .to_vec::<f32>()
            .expect("an f32 tensor converts to f32")
    };
    Ok(PendingRead {
        inner: Inner::Deferred(Box::new(read)),
    })
}

impl PendingRead {
    /// Waits for the values.
    ///
    /// # Errors
    /// If the device reports a failure of the copy or of the work before it.
    pub fn wait(self) -> Result<Vec<f32>, SmpError> {
        match self.inner {
            Inner::Deferred(read) => Ok(read()),
            Inner::Cuda(fut, len) => {
                let bytes = wait_cuda_read(fut, "reading a value back")?;
                Ok(bytes
                    .chunks_exact(4)
                    .map(|w| f32::from_le_bytes([w[0], w[1], w[2], w[3]]))
                    .take(len)
                    .collect())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn_ndarray::NdArray;

    /// Off CUDA the read is deferred to `wait`, which returns the values as f32 whatever the
    /// tensor's float dtype.
    #[test]
    fn deferred_read_returns_the_values() {
        let dev = Default::default();
        let t = Tensor::<NdArray<f32>, 1>::from_floats([1.5, -2.0, 3.25], &dev);
        let pending = read_later(t.clone() * 2.0).unwrap();
        assert_eq!(pending.wait().unwrap(), vec![3.0, -4.0, 6.5]);
    }
}
