//! Device-to-host and host-to-device copies on Burn's CUDA stream, in order with the kernels and
//! without a host wait: what [`crate::readback`] and [`crate::offload`] use on CUDA.

use std::future::Future;
use std::pin::Pin;

use burn::tensor::DType;
use cubecl::Runtime;
use cubecl::cuda::CudaRuntime;
use cubecl::device::Device;
use cubecl::device_handle::DeviceHandle;
use cubecl::server::{ComputeServer, CopyDescriptor, ServerError};
use cubecl::stream_id::StreamId;

use crate::error::SmpError;

type CudaServer = <CudaRuntime as Runtime>::Server;

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
/// memory into a pitched layout, which moves a 32 MiB activation at 0.8 GB/s on an H200. Here
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
