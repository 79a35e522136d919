//! The bridge between Burn's CUDA runtime and NCCL.
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
//! Nothing here touches CUDA until a caller asks for it: [`cuda_device_count`] returns 0 on a
//! machine without libcuda, and the rest is only reached with CUDA tensors in hand.

pub mod adamw;
pub mod attention;
pub mod bridge;
pub mod embedding;
pub mod flash;
pub mod flat;
pub mod fused;
pub mod gemm;
mod kernel_cache;
pub(crate) mod transfer;
mod wgmma;
pub mod xent;
pub use kernel_cache::{
    configure_kernel_cache, kernel_cache_build, kernel_cache_dir, user_cubecl_config,
};

use std::any::Any;
use std::sync::{Arc, Mutex};

use burn::tensor::{DType as BurnDType, Tensor, TensorPrimitive, backend::Backend};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeBackend, FloatElement, IntElement};
use burn_cuda::{Cuda, CudaDevice};
use collectives::nccl::NcclComm;
use collectives::{CommError, Communicator, DType, ReduceOp};
use cubecl::Runtime;
use cubecl::cuda::CudaRuntime;
use cubecl::device::Device;
use cubecl::device_handle::DeviceHandle;
use cudarc::driver::{CudaContext, CudaStream, sys as ds};

use crate::comm::{PendingGather, TensorComm};
use crate::error::SmpError;

/// Burn's CubeCL CUDA backend without the fusion layer: the backend smp-burn trains on.
///
/// Fusion is left out on purpose: Burn 0.21's fusion code generator panics on the mixed-dtype
/// chains of bf16 compute with an f32 master (`burn-cubecl-fusion` `codegen/ir.rs:500`), and the
/// fast paths (cuBLAS GEMMs, flash attention) replace the large ops that fusion would not touch
/// anyway. Every tensor is a plain CubeCL buffer, so the bridge needs no fusion round trip.
pub type CudaCube<F = f32, I = i32> = CubeBackend<CudaRuntime, F, I, u8>;

/// Burn backends whose float tensors are CubeCL CUDA buffers underneath: burn-cuda's fused
/// `Cuda` and the plain [`CudaCube`]. The bridge (NCCL, cuBLAS) works on either.
pub trait CudaTensors: Backend<Device = CudaDevice> {
    /// The CubeCL tensor behind a float primitive. With fusion this drains the fusion queue for
    /// the tensor, so its buffer exists and every kernel writing it has reached CubeCL.
    fn cube_primitive(t: Self::FloatTensorPrimitive) -> CubeTensor<CudaRuntime>;
}

impl<F: FloatElement, I: IntElement> CudaTensors for Cuda<F, I> {
    fn cube_primitive(t: Self::FloatTensorPrimitive) -> CubeTensor<CudaRuntime> {
        let client = t.client.clone();
        client.resolve_tensor_float::<CudaCube<F, I>>(t)
    }
}

impl<F: FloatElement, I: IntElement> CudaTensors for CudaCube<F, I> {
    fn cube_primitive(t: Self::FloatTensorPrimitive) -> CubeTensor<CudaRuntime> {
        t
    }
}

/// The mesh `config` asks for with NCCL collectives on CUDA device `gpu` (groups of one rank
/// need none). Collective over `world`.
///
/// # Errors
/// Degrees that do not fit the world, or an NCCL communicator that cannot be created.
pub fn nccl_mesh<B: CudaTensors>(
    world: Arc<dyn Communicator>,
    config: &crate::ParallelConfig,
    gpu: usize,
) -> Result<crate::mesh::Mesh<B>, SmpError> {
    crate::mesh::Mesh::new(world, config, &mut |host| {
        Ok(if host.world_size() == 1 {
            Arc::new(crate::comm::HostTensorComm::new(host)) as Arc<dyn TensorComm<B>>
        } else {
            Arc::new(CudaTensorComm::new(host.as_ref(), gpu)?)
        })
    })
}

/// Number of CUDA devices visible to this process; 0 when libcuda is missing or fails to
/// initialize (never panics).
pub fn cuda_device_count() -> usize {
    // SAFETY: only tries to dlopen libcuda under its usual names.
    if !unsafe { ds::is_culib_present() } {
        return 0;
    }
    if cudarc::driver::result::init().is_err() {
        return 0;
    }
    CudaContext::device_count().map_or(0, |n| n.max(0) as usize)
}

/// The attention kernels the Mma flash path runs at `head_dim` on CUDA device 0, for the
/// trainer's log: the forward and backward tilings, and whether the backward's dQ is bitwise
/// reproducible. Why: the default at head dim 128 sums dQ with atomics (faster, run-to-run
/// rounding differences, as PyTorch's flash backward), and a user comparing two runs' losses
/// should see that up front; and which forward runs depends on the device and the build.
pub fn attention_summary(head_dim: usize) -> String {
    // The driver's compute capability, not a CubeCL client: a client would open a context on
    // GPU 0 in every process of a multi-process launch. CubeCL reports f32-pair atomics
    // (`flash::pair_atomics_supported`) and TMA (`flash::wgmma_supported`) from sm_90 on.
    let pair_atomics = cuda_compute_capability(0).is_some_and(|(major, _)| major >= 9);
    // Contiguous bf16 attention inputs at head dim 64 or 128 have the 16-byte rows it needs.
    let forward = flash::mma_tiling(head_dim, flash::WGMMA_BUILT && pair_atomics);
    let bulk_built = flash::BULK_REDUCE_BUILT && pair_atomics;
    let tiling = flash::mma_bwd_tiling(head_dim, pair_atomics, flash::WGMMA_BUILT && bulk_built);
    // Hopper's copy engine comes with sm_90, as the pair atomics do; the warpgroup kernel adds
    // its dQ rows by bulk reductions of its own.
    let bulk = tiling.wgmma || flash::bulk_dq_used(tiling, bulk_built);
    let reproducible = match (tiling.dq, bulk) {
        (flash::MmaDq::Atomic, true) => {
            "dQ summed by bulk asynchronous reductions, not bitwise reproducible; \
             SMP_BURN_DETERMINISTIC=1 for the deterministic kernels"
        }
        (flash::MmaDq::Atomic, false) => {
            "dQ summed with atomics, not bitwise reproducible; SMP_BURN_DETERMINISTIC=1 for \
             the deterministic kernels"
        }
        (flash::MmaDq::Split, _) => "deterministic",
    };
    format!("attention (head dim {head_dim}): forward {forward}; backward {tiling}, {reproducible}")
}

/// Compute capability (major, minor) of CUDA device `index`, or `None` without a driver or
/// device. Needs no context.
pub fn cuda_compute_capability(index: usize) -> Option<(i32, i32)> {
    if cuda_device_count() <= index {
        return None;
    }
    let dev = cudarc::driver::result::device::get(index as i32).ok()?;
    let attribute = |a| {
        // SAFETY: `dev` is a valid device handle from the initialized driver.
        unsafe { cudarc::driver::result::device::get_attribute(dev, a) }.ok()
    };
    Some((
        attribute(ds::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
        attribute(ds::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
    ))
}

/// Total memory of CUDA device `index` in bytes, or `None` without a driver or device.
pub fn cuda_device_memory(index: usize) -> Option<u64> {
    if cuda_device_count() <= index {
        return None;
    }
    let dev = cudarc::driver::result::device::get(index as i32).ok()?;
    // SAFETY: `dev` is a valid device handle from the initialized driver.
    unsafe { cudarc::driver::result::device::total_mem(dev) }
        .ok()
        .map(|b| b as u64)
}

/// A probe of the memory in use on CUDA device `gpu`, in bytes: the driver's view (total minus
/// free), so it counts CubeCL's pools and caches and every other process on the device. Burn
/// 0.21 exposes no peak-allocation counter. The probe returns `None` if the driver call fails.
///
/// # Errors
/// If the device's context cannot be created.
pub fn memory_in_use(gpu: usize) -> Result<impl Fn() -> Option<u64> + Send + Sync, SmpError> {
    let ctx = CudaContext::new(gpu).map_err(|e| cuda_err(&format!("CUDA device {gpu}"), e))?;
    Ok(move || {
        ctx.bind_to_thread().ok()?;
        let (free, total) = cudarc::driver::result::mem_get_info().ok()?;
        Some((total - free) as u64)
    })
}

fn cuda_err(what: &str, e: impl std::fmt::Debug) -> SmpError {
    SmpError::Cuda(format!("{what}: {e:?}"))
}

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

/// The CubeCL tensor (client, buffer handle, strides, dtype) behind a Burn CUDA tensor (see
/// [`CudaTensors::cube_primitive`]).
pub fn cube_tensor<B: CudaTensors, const D: usize>(
    t: &Tensor<B, D>,
) -> Result<CubeTensor<CudaRuntime>, SmpError> {
    match t.clone().into_primitive() {
        TensorPrimitive::Float(p) => Ok(B::cube_primitive(p)),
        TensorPrimitive::QFloat(_) => {
            Err(SmpError::Cuda("quantized tensors are not supported".into()))
        }
    }
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

/// Whether `SMP_BURN_LEGACY_FLUSH=1` asks for the ordering of sessions 2-4: a CubeCL flush
/// (with its host wait on the previous flush's fence) before every collective and GEMM batch.
/// For measuring what dropping it gained.
pub fn legacy_flush() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SMP_BURN_LEGACY_FLUSH").is_ok_and(|v| v == "1"))
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

/// The ordering of sessions 2-4 ([`legacy_flush`]): CubeCL's flush of device `index`, which
/// waits on the host for the fence of the previous flush.
pub(crate) fn flush_with_fence_wait(index: usize) -> Result<(), SmpError> {
    CudaRuntime::client(&CudaDevice { index })
        .flush()
        .map_err(|e| cuda_err("CubeCL flush", e))
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
        // on a fence recorded at the previous flush (CubeCL's drop queue), which kept the host
        // from ever running more than one collective or GEMM ahead of the GPU.
        if legacy_flush() {
            flush_with_fence_wait(self.server.device_id().index_id as usize)?;
        } else {
            self.server
                .submit_blocking(|_| ())
                .map_err(|e| cuda_err("reaching CubeCL's device thread", e))?;
        }
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

/// The autodiff tensor type of [`gemm::CudaAutodiff`], named to build the lookup key of
/// [`take_grad_for_accumulation`] (Burn's `AutodiffTensor` is not exported by name).
type AutodiffCudaTensor =
    <burn::backend::Autodiff<CudaCube> as burn::tensor::backend::BackendTypes>::FloatTensorPrimitive;

/// The gradient already registered for parent `parent` of an op, taken out of `grads` as a
/// contiguous buffer of `shape` and `like`'s dtype that the op may add its own contribution
/// into (and then register, which finds the slot empty). Without this, Burn registers the
/// contribution as a new tensor and adds the two in a separate pass: five full-size adds per
/// Llama layer in the backward (the inputs of q/k/v and of gate/up, and the residual stream at
/// both norms).
///
/// `None` when the `accumulate` fast path is off, when that parent takes no gradient or none is
/// registered yet (the op writes a fresh one), and when the registered one has another shape
/// or dtype (left in place; the op registers as usual). A buffer that another tensor still
/// holds is copied first, so the result never depends on whether the add could run in place.
pub(crate) fn take_grad_for_accumulation<S, const N: usize>(
    ops: &burn::backend::autodiff::ops::Ops<S, N>,
    parent: usize,
    grads: &mut burn::backend::autodiff::grads::Gradients,
    like: &CubeTensor<CudaRuntime>,
    shape: &burn::tensor::Shape,
) -> Option<CubeTensor<CudaRuntime>> {
    if !crate::fast::fast_paths().accumulate {
        return None;
    }
    let node = ops.parents[parent].as_ref()?;
    // The container is keyed by the node's id alone; `primitive` only fills the struct.
    let key = AutodiffCudaTensor {
        primitive: like.clone(),
        node: node.clone(),
        rc: Arc::new(node.id),
    };
    let old = grads.remove::<CudaCube>(&key)?;
    if old.meta.shape() != shape || old.dtype != like.dtype {
        grads.register::<CudaCube>(node.id, old);
        return None;
    }
    if old.is_contiguous() && old.can_mut() {
        return Some(old);
    }
    // Contiguous or not, a fresh buffer of its values (`into_contiguous` would return a
    // shared contiguous buffer unchanged).
    let (client, device, dtype) = (old.client.clone(), old.device.clone(), old.dtype);
    let copy = cubecl::std::tensor::into_contiguous(&client, old.binding(), dtype.into());
    Some(CubeTensor::new(
        client,
        copy.handle,
        *copy.metadata,
        device,
        dtype,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

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
