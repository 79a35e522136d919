//! NCCL on Burn's CUDA tensors.
//!
//! Three pieces:
//! - [`pin_tensor`]: resolves a `Tensor<B, 1>` (Burn's `Fusion<CubeBackend>`) to the
//!   CubeCL buffer behind it, pins the allocation (CubeCL cannot reuse it while the guard
//!   lives) and returns its device pointer and dtype.
//! - [`StreamBridge`]: orders work on our own communication stream with the kernels Burn
//!   queues, on the GPU, without a host wait. Burn -> comm: a no-op task on CubeCL's
//!   device-server thread (so every kernel queued so far has been launched), `cuCtxRecordEvent` on the device's primary context, then
//!   `cuStreamWaitEvent` on the comm stream. Comm -> Burn: `cuEventRecord` on the comm stream,
//!   then `cuCtxWaitEvent`, so that everything submitted to the context afterwards waits.
//!   Measured in `shared/probe/interop.rs`: ~10-15 us per collective where a host
//!   synchronization loses a third of all-gather bandwidth. The price: a context event is
//!   device-wide, so compute queued after a collective waits for it (no overlap).
//! - [`CudaTensorComm`]: [`TensorComm`] for Burn CUDA tensors; NCCL reads and writes Burn's
//!   own buffers.
//!
//! Nothing here touches CUDA until a caller asks for it: [`cuda_device_count`](super::cuda_device_count) returns 0 on a
//! machine without libcuda, and the rest is only reached with CUDA tensors in hand.

use std::any::Any;
use std::sync::{Arc, Mutex};

use burn::tensor::{DType as BurnDType, Tensor, backend::Backend};
use burn_cuda::CudaDevice;
use collectives::nccl::NcclComm;
use collectives::{CommError, Communicator, DType, ReduceOp};
use cubecl::Runtime;
use cubecl::cuda::CudaRuntime;
use cubecl::device::Device;
use cubecl::device_handle::DeviceHandle;
use cudarc::driver::{CudaContext, CudaStream, sys as ds};

use super::device::{CudaTensors, cube_tensor, cuda_err};
use crate::comm::{PendingGather, TensorComm};
use crate::error::SmpError;

/// Maps a Burn dtype to the collectives' dtype, for the float types NCCL reduces.
pub fn comm_dtype(d: BurnDType) -> Result<DType, SmpError> {
    Ok(match d {
        BurnDType::F32 | BurnDType::Flex32 => DType::F32,
        BurnDType::F64 => DType::F64,
        BurnDType::BF16 => DType::BF16,
        BurnDType::F16 => DType::F16,
        other => {
            return Err(SmpError::Cuda(format!(
                "collectives on CUDA tensors support f32, f64, bf16 and f16, not {other:?}"
            )));
        }
    })
}

/// A Burn CUDA buffer pinned for foreign use: CubeCL will not hand the memory to another
/// tensor while this value lives, even if every Burn handle to it is dropped.
pub struct PinnedBuffer {
    /// Device address of the first element.
    pub ptr: u64,
    /// Number of elements.
    pub len: usize,
    /// Element type.
    pub dtype: DType,
    _guard: Box<dyn Any>,
}

impl std::fmt::Debug for PinnedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedBuffer")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("dtype", &self.dtype)
            .finish()
    }
}

/// Pins a contiguous 1-D Burn CUDA tensor and returns its device pointer (see
/// [`PinnedBuffer`]). Costs about 10 us (a round trip to CubeCL's server).
pub fn pin_tensor<B: CudaTensors>(t: &Tensor<B, 1>) -> Result<PinnedBuffer, SmpError> {
    let c = cube_tensor(t)?;
    let dtype = comm_dtype(c.dtype)?;
    let len = c.meta.shape().num_elements();
    let strides = c.meta.strides();
    if len > 1 && strides[0] != 1 {
        return Err(SmpError::Cuda(format!(
            "collectives need a contiguous tensor; this one has stride {}",
            strides[0]
        )));
    }
    let r = c
        .client
        .get_resource(c.handle.clone())
        .map_err(|e| cuda_err("pinning a Burn buffer (get_resource)", e))?;
    let ptr = r.resource().ptr;
    Ok(PinnedBuffer {
        ptr,
        len,
        dtype,
        _guard: Box::new(r),
    })
}

/// One bit per device index below 64: a collective has been issued on that device.
static COLLECTIVE_DEVICES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Records that a collective is being issued on device `index` (from now on a GEMM batch there
/// may have NCCL work in flight beside it).
fn note_collective(index: usize) {
    if index < 64 {
        COLLECTIVE_DEVICES.fetch_or(1 << index, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Whether any collective has been issued on device `index` by this process (always true for
/// indices the bit set cannot hold). A GEMM batch on a device without collectives can wait
/// for the whole context (one event, no kernels) without waiting for NCCL work by mistake.
pub(crate) fn collectives_issued(index: usize) -> bool {
    index >= 64 || COLLECTIVE_DEVICES.load(std::sync::atomic::Ordering::Relaxed) & (1 << index) != 0
}

/// A CUDA event handle owned by a [`StreamBridge`].
struct Event(ds::CUevent);

// SAFETY: CUevent is a plain driver handle, usable from any thread of the process.
unsafe impl Send for Event {}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: created by us, destroyed once; the driver defers the release if a record is
        // still pending.
        let _ = unsafe { cudarc::driver::result::event::destroy(self.0) };
    }
}

/// Orders a communication stream with Burn's CUDA work on one device, on the GPU.
///
/// See the module docs for the mechanism. One bridge per device and process group; the events
/// are reused (a wait captures the event's state when it is queued).
pub struct StreamBridge {
    server: DeviceHandle<<CudaRuntime as Runtime>::Server>,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    ev_to_comm: Event,
    ev_to_burn: Event,
}

impl std::fmt::Debug for StreamBridge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamBridge")
            .field("device", &self.server.device_id().index_id)
            .finish()
    }
}

impl StreamBridge {
    /// Creates the comm stream and events on CUDA device `index` (its primary context, the
    /// one CubeCL uses).
    pub fn new(index: usize) -> Result<Self, SmpError> {
        let ctx = CudaContext::new(index).map_err(|e| cuda_err("CUDA context", e))?;
        let stream = ctx.new_stream().map_err(|e| cuda_err("comm stream", e))?;
        ctx.bind_to_thread()
            .map_err(|e| cuda_err("cuCtxSetCurrent", e))?;
        let ev = || {
            cudarc::driver::result::event::create(ds::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                .map(Event)
                .map_err(|e| cuda_err("cuEventCreate", e))
        };
        Ok(Self {
            server: DeviceHandle::new(CudaDevice { index }.to_id()),
            ctx,
            stream,
            ev_to_comm: ev()?,
            ev_to_burn: ev()?,
        })
    }

    /// The communication stream (raw handle, for NCCL).
    pub fn stream(&self) -> ds::CUstream {
        self.stream.cu_stream()
    }

    /// The stream itself (cuBLAS binds its handle to it).
    pub fn cuda_stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The device's primary context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Makes the comm stream wait, on the GPU, for every Burn kernel queued so far.
    pub fn burn_to_comm(&self) -> Result<(), SmpError> {
        note_collective(self.server.device_id().index_id as usize);
        // CubeCL's device-server thread launches the kernels queued to it in order: a no-op
        // task run to completion there means every kernel queued so far has reached CUDA before
        // the context event captures the work. Not `client.flush()`: that also syncs the host
        // on a fence recorded at the previous flush (CubeCL's drop queue), which would keep the
        // host from running more than one collective or GEMM ahead of the GPU.
        self.server
            .submit_blocking(|_| ())
            .map_err(|e| cuda_err("reaching CubeCL's device thread", e))?;
        self.server_to_comm()
    }

    /// As [`StreamBridge::burn_to_comm`], called from CubeCL's device-server thread inside a
    /// queued task: every kernel queued before the task has already been launched there, so
    /// no flush (which would be a call back into the same thread) is needed.
    pub fn server_to_comm(&self) -> Result<(), SmpError> {
        self.bind()?;
        // SAFETY: the context, event and stream are live and belong to the same device.
        unsafe {
            ds::cuCtxRecordEvent(self.ctx.cu_ctx(), self.ev_to_comm.0)
                .result()
                .map_err(|e| cuda_err("cuCtxRecordEvent", e))?;
            ds::cuStreamWaitEvent(self.stream(), self.ev_to_comm.0, 0)
                .result()
                .map_err(|e| cuda_err("cuStreamWaitEvent", e))?;
        }
        Ok(())
    }

    /// Makes the bridge's context current on the calling thread.
    pub fn bind(&self) -> Result<(), SmpError> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| cuda_err("cuCtxSetCurrent", e))
    }

    /// Makes all work submitted to the device from now on (Burn's next kernels) wait, on the
    /// GPU, for everything queued so far on the comm stream.
    pub fn comm_to_burn(&self) -> Result<(), SmpError> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| cuda_err("cuCtxSetCurrent", e))?;
        // SAFETY: as in `burn_to_comm`.
        unsafe {
            ds::cuEventRecord(self.ev_to_burn.0, self.stream())
                .result()
                .map_err(|e| cuda_err("cuEventRecord", e))?;
            ds::cuCtxWaitEvent(self.ctx.cu_ctx(), self.ev_to_burn.0)
                .result()
                .map_err(|e| cuda_err("cuCtxWaitEvent", e))?;
        }
        Ok(())
    }
}

/// How [`CudaTensorComm`] orders NCCL with Burn's kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ordering {
    /// Context events on the GPU (the default; no host wait).
    Events,
    /// Wait on the host for Burn's queue before and for the collective after. Slow; for
    /// measuring what the events save.
    HostSync,
}

/// [`TensorComm`] for Burn's CUDA backend: NCCL on Burn's own buffers, ordered by a
/// [`StreamBridge`].
///
/// Outputs are fresh Burn tensors on the same device with the input's dtype; the inputs are
/// never written, so a tensor shared elsewhere stays intact.
pub struct CudaTensorComm {
    nccl: NcclComm,
    bridge: Mutex<StreamBridge>,
    ordering: Mutex<Ordering>,
    /// Timing events around each collective queued since the last `take_device_time`.
    timings: Mutex<Vec<(Event, Event)>>,
}

impl std::fmt::Debug for CudaTensorComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaTensorComm")
            .field("nccl", &self.nccl)
            .finish()
    }
}

impl CudaTensorComm {
    /// Creates the NCCL communicator of `host`'s group on CUDA device `device`. Collective over
    /// `host`.
    pub fn new(host: &dyn Communicator, device: usize) -> Result<Self, SmpError> {
        let nccl = NcclComm::new(host, device)?;
        Self::from_nccl(nccl)
    }

    /// Wraps an existing NCCL communicator.
    pub fn from_nccl(nccl: NcclComm) -> Result<Self, SmpError> {
        let bridge = StreamBridge::new(nccl.device())?;
        Ok(Self {
            nccl,
            bridge: Mutex::new(bridge),
            ordering: Mutex::new(Ordering::Events),
            timings: Mutex::new(Vec::new()),
        })
    }

    /// A communicator for a subgroup (a mesh axis), from that subgroup's host communicator.
    /// Collective over `host_sub`.
    pub fn split(&self, host_sub: &dyn Communicator) -> Result<Self, SmpError> {
        Self::from_nccl(self.nccl.split(host_sub)?)
    }

    /// The NCCL communicator underneath.
    pub fn nccl(&self) -> &NcclComm {
        &self.nccl
    }

    /// Chooses how collectives are ordered with Burn's work (see [`Ordering`]).
    pub fn set_ordering(&self, ordering: Ordering) {
        *self.ordering.lock().unwrap_or_else(|p| p.into_inner()) = ordering;
    }

    /// Waits on the host until every queued collective has run (bounded by the NCCL timeout).
    pub fn synchronize(&self) -> Result<(), SmpError> {
        let b = self.bridge.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: the bridge's stream lives as long as the bridge, on the communicator's device.
        Ok(unsafe { self.nccl.synchronize(b.stream()) }?)
    }

    fn check_device(&self, op: &str, d: &CudaDevice) -> Result<(), SmpError> {
        if d.index != self.nccl.device() {
            return Err(SmpError::Cuda(format!(
                "{op}: tensor is on cuda:{} but the communicator of group {} runs on cuda:{}",
                d.index,
                self.nccl.group(),
                self.nccl.device()
            )));
        }
        Ok(())
    }

    /// The shared path of every collective: checks the device, allocates an output of
    /// `out_len` elements in the input's dtype, pins both buffers and runs `call(input pointer,
    /// output pointer, dtype, stream)` ordered with Burn's kernels. Both buffers stay pinned
    /// until the comm -> Burn wait is queued and live on the communicator's device.
    fn collective<B: CudaTensors>(
        &self,
        op: &str,
        input: Tensor<B, 1>,
        out_len: usize,
        call: impl FnOnce(u64, u64, DType, ds::CUstream) -> Result<(), CommError>,
    ) -> Result<Tensor<B, 1>, SmpError> {
        let device = input.device();
        let (out, pins) = self.prepare(op, &input, out_len)?;
        let Some((src, dst)) = pins else {
            return Ok(out);
        };
        let (sp, dp, dt) = (src.ptr, dst.ptr, src.dtype);
        self.ordered::<B>(&device, vec![src, dst], |s| call(sp, dp, dt, s))?;
        Ok(out)
    }

    /// [`Self::collective`] started ahead of its use: `call` is queued on the comm stream after
    /// Burn's queued kernels, then a `done` event is recorded, and only the returned handle's
    /// wait makes Burn's later kernels wait for it (`cuCtxWaitEvent`), so the kernels queued in
    /// between run beside the collective. Input and output stay pinned (and `input` alive) until
    /// that wait. With [`Ordering::HostSync`] it runs at once, as [`Self::collective`].
    fn collective_start<B: CudaTensors>(
        &self,
        op: &str,
        input: Tensor<B, 1>,
        out_len: usize,
        call: impl FnOnce(u64, u64, DType, ds::CUstream) -> Result<(), CommError>,
    ) -> Result<PendingGather<B>, SmpError> {
        let ordering = *self.ordering.lock().unwrap_or_else(|p| p.into_inner());
        if ordering != Ordering::Events {
            return Ok(PendingGather::ready(
                self.collective(op, input, out_len, call)?,
            ));
        }
        let (out, pins) = self.prepare(op, &input, out_len)?;
        let Some((src, dst)) = pins else {
            return Ok(PendingGather::ready(out));
        };
        let done =
            cudarc::driver::result::event::create(ds::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                .map(Event)
                .map_err(|e| cuda_err("cuEventCreate", e))?;
        let b = self.bridge.lock().unwrap_or_else(|p| p.into_inner());
        b.burn_to_comm()?;
        let (sp, dp, dt) = (src.ptr, dst.ptr, src.dtype);
        self.timed_on_comm(&b, |stream| call(sp, dp, dt, stream))?;
        // SAFETY: a live event and the comm stream of the bridge's (current) context.
        unsafe { cudarc::driver::result::event::record(done.0, b.stream()) }
            .map_err(|e| cuda_err("cuEventRecord", e))?;
        let ctx = b.ctx.clone();
        drop(b);
        let keep = (src, dst, input);
        Ok(PendingGather::in_flight(
            out,
            Box::new(move || {
                ctx.bind_to_thread()
                    .map_err(|e| cuda_err("cuCtxSetCurrent", e))?;
                // SAFETY: `done` was recorded on the comm stream of this context.
                unsafe { ds::cuCtxWaitEvent(ctx.cu_ctx(), done.0) }
                    .result()
                    .map_err(|e| cuda_err("cuCtxWaitEvent", e))?;
                // Released only now that every later kernel waits for the collective.
                drop(keep);
                drop(done);
                Ok(())
            }),
        ))
    }

    /// Elements of each rank's chunk of a reduce-scatter of `full`; an error unless `full`'s
    /// length is divisible by the group size.
    fn reduce_scatter_len<B: Backend>(&self, full: &Tensor<B, 1>) -> Result<usize, SmpError> {
        let total = full.dims()[0];
        let world = self.nccl.world_size();
        if !total.is_multiple_of(world) {
            return Err(CommError::SizeMismatch {
                op: "reduce_scatter".into(),
                group: self.nccl.group().clone(),
                detail: format!("length {total} is not divisible by the group size {world}"),
            }
            .into());
        }
        Ok(total / world)
    }

    /// Checks the device and allocates a collective's output of `out_len` elements in the
    /// input's dtype; pins input and output unless either is empty (nothing to run then).
    fn prepare<B: CudaTensors>(
        &self,
        op: &str,
        input: &Tensor<B, 1>,
        out_len: usize,
    ) -> Result<(Tensor<B, 1>, Option<InputOutputPins>), SmpError> {
        let device = input.device();
        self.check_device(op, &device)?;
        let out = Tensor::empty([out_len], (&device, input.dtype()));
        if out_len == 0 || input.dims()[0] == 0 {
            return Ok((out, None));
        }
        let pins = (pin_tensor(input)?, pin_tensor(&out)?);
        Ok((out, Some(pins)))
    }

    /// Runs `f` (which queues NCCL work on the comm stream) between a pair of timing events,
    /// kept for [`TensorComm::take_device_time`]. The start event runs once the comm stream
    /// has waited for Burn's work, so the pair times NCCL alone.
    fn timed_on_comm(
        &self,
        b: &StreamBridge,
        f: impl FnOnce(ds::CUstream) -> Result<(), CommError>,
    ) -> Result<(), SmpError> {
        let timing = (timing_event()?, timing_event()?);
        // SAFETY: live events and stream of the bridge's (current) context.
        unsafe { cudarc::driver::result::event::record(timing.0.0, b.stream()) }
            .map_err(|e| cuda_err("cuEventRecord", e))?;
        f(b.stream())?;
        // SAFETY: as above.
        unsafe { cudarc::driver::result::event::record(timing.1.0, b.stream()) }
            .map_err(|e| cuda_err("cuEventRecord", e))?;
        self.timings
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(timing);
        Ok(())
    }

    /// Orders `f` (which queues NCCL work on the comm stream) after Burn's queued kernels and
    /// before Burn's next ones. The pins in `keep` are released only after the comm -> Burn
    /// wait is queued, so CubeCL cannot reuse the memory while NCCL still uses it.
    fn ordered<B: CudaTensors>(
        &self,
        device: &CudaDevice,
        keep: Vec<PinnedBuffer>,
        f: impl FnOnce(ds::CUstream) -> Result<(), CommError>,
    ) -> Result<(), SmpError> {
        let ordering = *self.ordering.lock().unwrap_or_else(|p| p.into_inner());
        let b = self.bridge.lock().unwrap_or_else(|p| p.into_inner());
        match ordering {
            Ordering::Events => {
                b.burn_to_comm()?;
                self.timed_on_comm(&b, f)?;
                b.comm_to_burn()?;
            }
            Ordering::HostSync => {
                B::sync(device).map_err(|e| cuda_err("Burn sync", e))?;
                f(b.stream())?;
                // SAFETY: as in `synchronize`.
                unsafe { self.nccl.synchronize(b.stream()) }?;
            }
        }
        drop(keep);
        Ok(())
    }
}

/// A collective's pinned input and output.
type InputOutputPins = (PinnedBuffer, PinnedBuffer);

fn timing_event() -> Result<Event, SmpError> {
    cudarc::driver::result::event::create(ds::CUevent_flags::CU_EVENT_DEFAULT)
        .map(Event)
        .map_err(|e| cuda_err("cuEventCreate", e))
}

impl<B: CudaTensors> TensorComm<B> for CudaTensorComm {
    /// Queues the all-gather on the comm stream after Burn's queued work, but does not make
    /// Burn's later work wait for it until [`PendingGather::wait`]: kernels queued in between
    /// run beside the collective. The buffers stay pinned until then.
    fn all_gather_start(&self, shard: Tensor<B, 1>) -> Result<PendingGather<B>, SmpError> {
        let n = shard.dims()[0];
        let world = self.nccl.world_size();
        self.collective_start("all_gather", shard, n * world, |sp, dp, dt, s| {
            // SAFETY: `collective_start`'s contract; the buffers hold n and n * world elements.
            unsafe { self.nccl.all_gather(sp, dp, n, dt, s) }
        })
    }

    /// The reduce-scatter queued like [`Self::all_gather_start`]: FSDP's backward queues the
    /// previous unit's kernels before waiting, so they run beside it. `full` (the unit's whole
    /// gradient) stays pinned and alive until [`PendingGather::wait`].
    fn reduce_scatter_start(
        &self,
        full: Tensor<B, 1>,
        op: ReduceOp,
    ) -> Result<PendingGather<B>, SmpError> {
        let n = self.reduce_scatter_len(&full)?;
        self.collective_start("reduce_scatter", full, n, |sp, dp, dt, s| {
            // SAFETY: `collective_start`'s contract; `full` holds n * world elements, the
            // output n.
            unsafe { self.nccl.reduce_scatter(sp, dp, n, dt, op, s) }
        })
    }

    fn take_device_time(&self) -> Result<Option<std::time::Duration>, SmpError> {
        let pairs = std::mem::take(&mut *self.timings.lock().unwrap_or_else(|p| p.into_inner()));
        let b = self.bridge.lock().unwrap_or_else(|p| p.into_inner());
        b.ctx
            .bind_to_thread()
            .map_err(|e| cuda_err("cuCtxSetCurrent", e))?;
        let mut ms = 0.0f64;
        let mut running = Vec::new();
        for (start, end) in pairs {
            // SAFETY: both events were recorded on the comm stream of this context.
            let done = match unsafe { cudarc::driver::result::event::query(end.0) } {
                Ok(()) => true,
                Err(e) if e.0 == ds::cudaError_enum::CUDA_ERROR_NOT_READY => false,
                Err(e) => return Err(cuda_err("cuEventQuery", e)),
            };
            if done {
                // SAFETY: as above; `end` has completed, so `start` (before it) has too.
                ms += unsafe { cudarc::driver::result::event::elapsed(start.0, end.0) }
                    .map_err(|e| cuda_err("cuEventElapsedTime", e))? as f64;
            } else {
                running.push((start, end));
            }
        }
        drop(b);
        // Collectives still running keep their events for the next call, before any newer ones.
        let mut timings = self.timings.lock().unwrap_or_else(|p| p.into_inner());
        running.append(&mut timings);
        *timings = running;
        Ok(Some(std::time::Duration::from_secs_f64(ms / 1e3)))
    }

    fn rank(&self) -> usize {
        self.nccl.rank()
    }

    fn world_size(&self) -> usize {
        self.nccl.world_size()
    }

    fn all_gather(&self, shard: Tensor<B, 1>) -> Result<Tensor<B, 1>, SmpError> {
        let n = shard.dims()[0];
        let world = self.nccl.world_size();
        self.collective("all_gather", shard, n * world, |sp, dp, dt, s| {
            // SAFETY: `collective`'s contract; the buffers hold n and n * world elements.
            unsafe { self.nccl.all_gather(sp, dp, n, dt, s) }
        })
    }

    fn reduce_scatter(&self, full: Tensor<B, 1>, op: ReduceOp) -> Result<Tensor<B, 1>, SmpError> {
        let n = self.reduce_scatter_len(&full)?;
        self.collective("reduce_scatter", full, n, |sp, dp, dt, s| {
            // SAFETY: `collective`'s contract; `full` holds n * world elements, the output n.
            unsafe { self.nccl.reduce_scatter(sp, dp, n, dt, op, s) }
        })
    }

    fn all_reduce(&self, t: Tensor<B, 1>, op: ReduceOp) -> Result<Tensor<B, 1>, SmpError> {
        let n = t.dims()[0];
        self.collective("all_reduce", t, n, |sp, dp, dt, s| {
            // SAFETY: `collective`'s contract; both buffers hold n elements.
            unsafe { self.nccl.all_reduce(sp, dp, n, dt, op, s) }
        })
    }

    fn broadcast(&self, t: Tensor<B, 1>, root: usize) -> Result<Tensor<B, 1>, SmpError> {
        let n = t.dims()[0];
        self.collective("broadcast", t, n, |sp, dp, dt, s| {
            // SAFETY: `collective`'s contract; both buffers hold n elements.
            unsafe { self.nccl.broadcast(sp, dp, n, dt, root, s) }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::device::cuda_device_count;
    use burn_cuda::Cuda;

    #[test]
    fn device_count_never_panics() {
        // 0 on machines without a GPU or libcuda; the count on GPU machines.
        let n = cuda_device_count();
        assert!(n < 1024);
    }

    #[test]
    fn dtype_mapping() {
        assert_eq!(comm_dtype(BurnDType::BF16).unwrap(), DType::BF16);
        assert_eq!(comm_dtype(BurnDType::F32).unwrap(), DType::F32);
        assert!(comm_dtype(BurnDType::I32).is_err());
    }

    /// Two GPUs, one thread each: every collective through Burn tensors against the host
    /// result, with no host synchronization between Burn and NCCL.
    #[test]
    #[ignore = "needs 2 GPUs"]
    fn collectives_on_two_gpus() {
        type B = Cuda<f32, i32>;
        assert!(cuda_device_count() >= 2, "needs 2 GPUs");
        collectives::run_on_threads(2, collectives::CommOptions::default(), |host| {
            let r = host.rank();
            let dev = CudaDevice { index: r };
            let comm = CudaTensorComm::new(host.as_ref(), r).unwrap();
            let x = Tensor::<B, 1>::from_floats([1.0 + r as f32, 2.0, 3.0, 4.0], &dev);
            let g = TensorComm::<B>::all_gather(&comm, x.clone()).unwrap();
            let s = TensorComm::<B>::all_reduce(&comm, x.clone(), ReduceOp::Sum).unwrap();
            let rs = TensorComm::<B>::reduce_scatter(&comm, x.clone(), ReduceOp::Sum).unwrap();
            let b = TensorComm::<B>::broadcast(&comm, x * (r as f32 + 1.0), 1).unwrap();
            let v = |t: Tensor<B, 1>| t.into_data().to_vec::<f32>().unwrap();
            assert_eq!(v(g), vec![1.0, 2.0, 3.0, 4.0, 2.0, 2.0, 3.0, 4.0]);
            assert_eq!(v(s.clone()), vec![3.0, 4.0, 6.0, 8.0]);
            assert_eq!(
                v(rs),
                if r == 0 {
                    vec![3.0, 4.0]
                } else {
                    vec![6.0, 8.0]
                }
            );
            assert_eq!(v(b), vec![4.0, 4.0, 6.0, 8.0]);
        });
    }
}
