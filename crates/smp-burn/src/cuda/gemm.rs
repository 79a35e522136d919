//! Linear layers through cuBLAS on Burn's own CUDA buffers, inside Burn's autodiff.
//!
//! Burn 0.21's CubeCL matmul reaches 185-217 TFLOP/s on Llama shapes where cuBLAS reaches
//! 724-809 on the same H200, and the GEMMs are three quarters of a transformer's FLOPs. Here the
//! forward `y = x w^T` and both backward GEMMs (`dx = dy w`, `dw = dy^T x`) run through
//! `cublasGemmEx` (bf16 or f32 inputs, f32 accumulation, output in the input dtype). The GEMMs
//! are issued as tasks on CubeCL's device-server thread, in queue order with Burn's kernel
//! launches, so the thread building the graph never waits for them; that thread keeps the
//! device's cuBLAS handles. With the workspace's vendored cubecl-cuda they run on Burn's own
//! CUDA stream; otherwise on a stream of ours, ordered with Burn's kernels on the GPU by context
//! events or a signal kernel (no host wait).

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::{Arc, Mutex};

use burn::backend::Autodiff;
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::{DType as BurnDType, Shape, Tensor, TensorPrimitive};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::Runtime;
use cubecl::cuda::{CudaDevice, CudaRuntime};
use cubecl::device::Device;
use cubecl::device_handle::DeviceHandle;
use cubecl::prelude::{CubeCount, CubeDim};
use cubecl::server::{Binding, ComputeServer};
use cubecl::stream_id::StreamId;
use cudarc::cublas::{CudaBlas, result as cbr, sys as cbs};
use cudarc::driver::sys as ds;

/// CubeCL's CUDA compute server, the state its device thread owns.
type CudaServer = <CudaRuntime as Runtime>::Server;

use super::bridge::{Arg, Cube, CubeFn, CubeInner};
use super::device::{CudaCube, cuda_err, launch_ptx};
use super::nccl::{StreamBridge, collectives_issued};
use crate::error::SmpError;

/// The autodiff backend the fast paths serve without fusion.
pub type CudaAutodiff = Autodiff<CudaCube>;

struct GemmEngine {
    bridge: StreamBridge,
    blas: CudaBlas,
    /// [`WAIT_PTX`]'s kernel, loaded in the bridge's context.
    wait: ds::CUfunction,
    /// One cuBLAS handle per Burn stream the GEMMs were issued on ([`GemmOrdering::Stream`]):
    /// a handle's workspace must not be shared by GEMMs that may run at the same time on
    /// different streams. Kept for the process's lifetime, as the engine is.
    stream_handles: RefCell<Vec<(ds::CUstream, cbs::cublasHandle_t)>>,
}

impl GemmEngine {
    /// The cuBLAS handle that issues on `stream`, created on first use.
    #[cfg_attr(not(cubecl_launch_stream), allow(dead_code))]
    fn handle_on(&self, stream: ds::CUstream) -> Result<cbs::cublasHandle_t, SmpError> {
        let mut handles = self.stream_handles.borrow_mut();
        if let Some((_, h)) = handles.iter().find(|(s, _)| *s == stream) {
            return Ok(*h);
        }
        self.bridge.bind()?;
        let handle = cbr::create_handle().map_err(|e| cuda_err("cublasCreate", e))?;
        // SAFETY: a live handle and a stream of the same context (CubeCL's, the device's
        // primary context, which `bind` made current).
        unsafe { cbr::set_stream(handle, stream as _) }
            .map_err(|e| cuda_err("cublasSetStream", e))?;
        handles.push((stream, handle));
        Ok(handle)
    }
}

/// One thread that spins until `*flag - value`, as a signed 32-bit difference, is no longer
/// negative (wrap-safe epoch comparison). Launched on the GEMM stream, it holds the GEMMs back
/// until Burn's stream has run the signal kernel of their epoch. Hand-written PTX, loaded by
/// the driver: no compiler needed. (`cuStreamWaitValue32` does this without a kernel, but the
/// driver refuses it on CubeCL's pool memory with `CUDA_ERROR_INVALID_VALUE`.)
const WAIT_PTX: &str = "
.version 7.0
.target sm_70
.address_size 64
.visible .entry smp_wait_geq(.param .u64 flag, .param .u32 value)
{
    .reg .pred p;
    .reg .b32 v, t, d;
    .reg .b64 a;
    ld.param.u64 a, [flag];
    cvta.to.global.u64 a, a;
    ld.param.u32 t, [value];
SPIN:
    ld.volatile.global.u32 v, [a];
    sub.s32 d, v, t;
    setp.lt.s32 p, d, 0;
    @p bra SPIN;
    ret;
}
\0";

thread_local! {
    // Lives on CubeCL's device-server thread (one per device), where the GEMMs are issued.
    static ENGINES: RefCell<HashMap<usize, Rc<GemmEngine>>> = RefCell::new(HashMap::new());
}

thread_local! {
    // The calling thread's handles to the device-server threads, looked up once.
    static SERVERS: RefCell<HashMap<usize, DeviceHandle<CudaServer>>> =
        RefCell::new(HashMap::new());
}

/// The first cuBLAS failure on each device, reported by the next GEMM issued there (the
/// server thread that hit it has no caller to return it to).
static ASYNC_ERRORS: Mutex<Vec<(usize, String)>> = Mutex::new(Vec::new());

fn engine(device: usize) -> Result<Rc<GemmEngine>, SmpError> {
    ENGINES.with(|m| {
        if let Some(e) = m.borrow().get(&device) {
            return Ok(e.clone());
        }
        let bridge = StreamBridge::new(device)?;
        let blas =
            CudaBlas::new(bridge.cuda_stream().clone()).map_err(|e| cuda_err("cublasCreate", e))?;
        bridge.bind()?;
        // SAFETY: a NUL-terminated PTX image; the module stays loaded for the process.
        let wait = unsafe {
            let module = cudarc::driver::result::module::load_data(WAIT_PTX.as_ptr().cast())
                .map_err(|e| cuda_err("loading the GEMM wait kernel (cuModuleLoadData)", e))?;
            cudarc::driver::result::module::get_function(
                module,
                std::ffi::CString::new("smp_wait_geq").expect("no NUL inside"),
            )
            .map_err(|e| cuda_err("cuModuleGetFunction", e))?
        };
        let e = Rc::new(GemmEngine {
            bridge,
            blas,
            wait,
            stream_handles: RefCell::new(Vec::new()),
        });
        m.borrow_mut().insert(device, e.clone());
        Ok(e)
    })
}

fn cublas_dtype(d: BurnDType) -> Option<cbs::cudaDataType> {
    match d {
        BurnDType::BF16 => Some(cbs::cudaDataType_t::CUDA_R_16BF),
        BurnDType::F16 => Some(cbs::cudaDataType_t::CUDA_R_16F),
        BurnDType::F32 => Some(cbs::cudaDataType_t::CUDA_R_32F),
        _ => None,
    }
}

/// Whether cuBLAS takes these operands as they are (same float dtype, one cuBLAS supports).
pub fn supports(x: BurnDType, w: BurnDType) -> bool {
    x == w && cublas_dtype(x).is_some()
}

/// One operand of a [`GemmCall`]: the CubeCL binding of its buffer (which keeps the memory
/// from being reused until the call is issued) and its leading dimension.
struct Operand {
    binding: Binding,
    ld: usize,
}

impl Operand {
    fn of(t: &CubeTensor<CudaRuntime>, ld: usize) -> Self {
        Self {
            binding: t.handle.clone().binding(),
            ld,
        }
    }
}

/// One column-major GEMM `C[m,n] = op(A) op(B)`, or `C += op(A) op(B)` with `accumulate`;
/// `C` in the operands' dtype, or f32 with `c_f32`.
pub(super) struct GemmCall {
    accumulate: bool,
    c_f32: bool,
    trans_a: bool,
    trans_b: bool,
    m: usize,
    n: usize,
    k: usize,
    a: Operand,
    b: Operand,
    c: Operand,
}

/// One unit of work queued on Burn's stream by [`submit_steps`]: a cuBLAS GEMM in the compute
/// dtype, or a step of an FP8 layer (casts and cuBLASLt GEMMs, [`super::fp8`]).
pub(super) enum Step {
    Gemm(GemmCall),
    Fp8(super::fp8::Fp8Step),
}

impl Step {
    fn bindings(&self) -> Vec<&Binding> {
        match self {
            Self::Gemm(c) => vec![&c.a.binding, &c.b.binding, &c.c.binding],
            Self::Fp8(s) => s.bindings(),
        }
    }
}

/// The first cuBLAS failure of any GEMM issued so far, as an error that names the device and
/// the cause. GEMMs are issued asynchronously (a failure surfaces at the next GEMM on the
/// device); a trainer that reads a result back, such as the step's loss, checks this too, so
/// that the last GEMMs of a run cannot fail unnoticed.
pub fn async_error() -> Result<(), SmpError> {
    first_async_error(|_| true)
}

fn first_async_error(on: impl Fn(usize) -> bool) -> Result<(), SmpError> {
    let errors = ASYNC_ERRORS.lock().unwrap_or_else(|e| e.into_inner());
    match errors.iter().find(|(d, _)| on(*d)) {
        Some((device, msg)) => Err(SmpError::Cuda(format!(
            "a cuBLAS GEMM on CUDA device {device} failed: {msg}"
        ))),
        None => Ok(()),
    }
}

/// Panics with the message of an earlier asynchronous GEMM failure on `device`, if any.
fn check_async_errors(device: usize) {
    if let Err(e) = first_async_error(|d| d == device) {
        panic!("{e}");
    }
}

/// Queues `calls` behind every Burn kernel queued so far and makes Burn's later kernels wait
/// for them, without blocking the caller.
///
/// The calls run as a task on CubeCL's device-server thread, the thread that launches Burn's
/// kernels: by the time it runs, every earlier kernel has reached CUDA, so a context event
/// captures them, and the buffers' device addresses are resolved there too. Issuing from the
/// rank thread instead would take a blocking round trip per operand and a flush per batch (four
/// to six per linear layer), each waiting until the server has launched everything queued
/// before it: the rank thread could never run ahead of the server.
fn submit_ordered(device: usize, dtype: BurnDType, calls: Vec<GemmCall>) {
    submit_steps(device, dtype, calls.into_iter().map(Step::Gemm).collect());
}

/// [`submit_ordered`] for any steps; `dtype` is that of the cuBLAS GEMMs among them.
pub(super) fn submit_steps(device: usize, dtype: BurnDType, calls: Vec<Step>) {
    check_async_errors(device);
    let dt =
        cublas_dtype(dtype).unwrap_or_else(|| panic!("cuBLAS linear: unsupported dtype {dtype:?}"));
    let handle = SERVERS.with(|m| {
        m.borrow_mut()
            .entry(device)
            .or_insert_with(|| DeviceHandle::new(CudaDevice { index: device }.to_id()))
            .clone()
    });
    let ordering = gemm_ordering(device);
    if ordering == GemmOrdering::Stream {
        // Burn's stream for this thread: its kernels and these GEMMs then run in issue order.
        let stream = StreamId::current();
        handle.submit(move |server| {
            if let Err(e) = issue_on_launch_stream(server, device, dt, stream, &calls) {
                note_async_error(device, e);
            }
        });
        return;
    }
    let signal = (ordering == GemmOrdering::Signal).then(|| device_signal(device));
    // Epochs must reach the server in the order they are taken: hold the device's lock across
    // both.
    let mut guard = signal
        .as_ref()
        .map(|s| s.lock().unwrap_or_else(|e| e.into_inner()));
    let after = guard.as_mut().map(|s| s.signal());
    handle.submit(move |server| {
        if let Err(e) = issue_on_server(server, device, dt, after, &calls) {
            note_async_error(device, e);
        }
    });
    drop(guard);
}

/// Keeps the first asynchronous GEMM failure on `device` for [`async_error`].
fn note_async_error(device: usize, e: SmpError) {
    let mut errors = ASYNC_ERRORS.lock().unwrap_or_else(|e| e.into_inner());
    if !errors.iter().any(|(d, _)| *d == device) {
        errors.push((device, e.to_string()));
    }
}

/// How a GEMM batch waits for the Burn kernels before it ([`gemm_ordering`] picks one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GemmOrdering {
    /// The GEMMs run on Burn's own stream (`CudaServer::launch_stream`, which only the
    /// workspace's vendor/cubecl-cuda has): no crossing at all, so neither the GPU's idle time
    /// at each event crossing (5-13 us on an H200) nor a wait for the comm streams.
    Stream,
    /// A one-thread kernel on Burn's stream writes an epoch to a flag that a one-thread kernel
    /// on the GEMM stream spins on ([`WAIT_PTX`]): the GEMMs wait for Burn's stream alone, not
    /// for the collectives in flight on the comm streams.
    Signal,
    /// A context-wide event (`cuCtxRecordEvent`): no kernel launches, but the GEMMs also wait
    /// for every collective in flight, which would serialize FSDP's prefetched all-gathers and
    /// overlapped reduce-scatters with the compute they are meant to run beside.
    Context,
}

/// Whether this build issues the GEMMs on Burn's own CUDA stream: with the workspace's
/// vendor/cubecl-cuda (`build.rs` detects it), not with upstream CubeCL 0.10, which keeps its
/// streams private.
pub const LAUNCH_STREAM_BUILT: bool = cfg!(cubecl_launch_stream);

/// The ordering of the next GEMM batch on `device`: [`GemmOrdering::Stream`] where built;
/// otherwise [`GemmOrdering::Context`] until the first collective on the device (a single-GPU
/// run has nothing but Burn's stream to wait for, and the signal costs two small kernels per
/// batch, about 1 ms of a 1.2B model's step), [`GemmOrdering::Signal`] from then on.
fn gemm_ordering(device: usize) -> GemmOrdering {
    if LAUNCH_STREAM_BUILT {
        GemmOrdering::Stream
    } else if collectives_issued(device) {
        GemmOrdering::Signal
    } else {
        GemmOrdering::Context
    }
}

/// How this process orders its cuBLAS GEMMs with Burn's kernels, for the trainer's log. Why
/// log it: the orderings differ in speed by a few percent of a step, and only the stream one
/// needs the workspace's vendored CubeCL.
///
/// # Errors
/// None: the ordering follows from the build.
pub fn gemm_ordering_summary() -> Result<String, SmpError> {
    Ok(if LAUNCH_STREAM_BUILT {
        "cuBLAS GEMMs run on Burn's CUDA stream"
    } else {
        "cuBLAS GEMMs run on a stream of their own, ordered by context events (by signal \
         kernels once collectives run)"
    }
    .to_string())
}

mod signal {
    use cubecl::prelude::*;

    /// Writes `value` to `flag[0]`: Burn's stream reached this point.
    #[cube(launch_unchecked)]
    pub fn signal_kernel(flag: &mut Tensor<u32>, value: u32) {
        if ABSOLUTE_POS == 0 {
            flag[0] = value;
        }
    }
}

/// The flag Burn's stream writes on one device and the last epoch written to it.
struct DeviceSignal {
    flag: CubeTensor<CudaRuntime>,
    epoch: u32,
}

/// One signal per device, each behind its own lock, so that ranks driving different devices
/// never wait for each other here (a submit can block while that device's queue is full).
static SIGNALS: Mutex<Vec<(usize, Arc<Mutex<DeviceSignal>>)>> = Mutex::new(Vec::new());

/// `device`'s signal, created (a zeroed flag) on first use.
fn device_signal(device: usize) -> Arc<Mutex<DeviceSignal>> {
    let mut all = SIGNALS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, s)) = all.iter().find(|(d, _)| *d == device) {
        return s.clone();
    }
    let client = CudaRuntime::client(&CudaDevice { index: device });
    let handle = client.create_from_slice(&[0u8; 4]);
    let flag = CubeTensor::new_contiguous(
        client,
        CudaDevice { index: device },
        [1].into(),
        handle,
        BurnDType::U32,
    );
    let s = Arc::new(Mutex::new(DeviceSignal { flag, epoch: 0 }));
    all.push((device, s.clone()));
    s
}

impl DeviceSignal {
    /// Queues the next epoch's signal kernel and returns the flag and epoch the GEMM stream
    /// must wait for.
    fn signal(&mut self) -> (Binding, u32) {
        // Wraps after four billion batches; an epoch is only compared with its neighbours.
        self.epoch = self.epoch.wrapping_add(1).max(1);
        // SAFETY: one cube of one thread writes element 0 of a one-element tensor.
        unsafe {
            signal::signal_kernel::launch_unchecked::<CudaRuntime>(
                &self.flag.client,
                CubeCount::Static(1, 1, 1),
                CubeDim::new_1d(1),
                self.flag.clone().into_tensor_arg(),
                self.epoch,
            );
        }
        (self.flag.handle.clone().binding(), self.epoch)
    }
}

/// Runs on the server thread: resolves the operands and issues the GEMMs between the two
/// event crossings of the engine's bridge.
fn issue_on_server(
    server: &mut CudaServer,
    device: usize,
    dt: cbs::cudaDataType,
    after: Option<(Binding, u32)>,
    calls: &[Step],
) -> Result<(), SmpError> {
    let e = engine(device)?;
    let stream = StreamId::current();
    let mut ptr = |binding: &Binding| device_ptr(server, binding, stream);
    match after {
        Some((flag, epoch)) => {
            let (flag, _guard) = ptr(&flag)?;
            e.bridge.bind()?;
            let (mut flag, mut epoch) = (flag, epoch);
            let mut params = [
                (&mut flag as *mut u64).cast::<std::ffi::c_void>(),
                (&mut epoch as *mut u32).cast::<std::ffi::c_void>(),
            ];
            // SAFETY: the kernel takes (u64 pointer, u32) as passed; `flag` is a live 4-byte
            // device buffer of this context (the guard and the signal state hold it); the
            // stream is the engine's own.
            unsafe {
                launch_ptx(
                    "GEMM wait kernel",
                    e.wait,
                    (1, 1),
                    1,
                    e.bridge.stream(),
                    &mut params,
                )?;
            }
        }
        None => e.bridge.server_to_comm()?,
    }
    issue_steps(
        *e.blas.handle(),
        e.bridge.stream(),
        device,
        dt,
        calls,
        &mut ptr,
    )?;
    // Kernels launched after this (by the server, in queue order) wait for the GEMMs, so the
    // operands' memory may be reused once the bindings drop.
    e.bridge.comm_to_burn()
}

/// The device address of `binding`'s buffer for work on `stream` (CubeCL first makes the stream
/// wait for the one that last used the buffer, as for a launch), with the guard that keeps the
/// buffer alive until the GEMM reading it is issued.
fn device_ptr(
    server: &mut CudaServer,
    binding: &Binding,
    stream: StreamId,
) -> Result<(u64, impl Sized + use<>), SmpError> {
    server
        .get_resource(binding.clone(), stream)
        .map(|r| (r.resource().ptr, r))
        .map_err(|e| cuda_err("resolving a Burn buffer for cuBLAS", e))
}

/// Runs on the server thread: issues the GEMMs on the CUDA stream of Burn's `stream`
/// ([`GemmOrdering::Stream`]), after the waits a kernel launch there would get.
#[cfg(cubecl_launch_stream)]
fn issue_on_launch_stream(
    server: &mut CudaServer,
    device: usize,
    dt: cbs::cudaDataType,
    stream: StreamId,
    calls: &[Step],
) -> Result<(), SmpError> {
    let e = engine(device)?;
    let bindings = calls.iter().flat_map(Step::bindings);
    let cu_stream = server
        .launch_stream(stream, bindings)
        .map_err(|err| cuda_err("resolving Burn's stream for cuBLAS", err))?;
    let handle = e.handle_on(cu_stream)?;
    e.bridge.bind()?;
    let mut ptr = |binding: &Binding| device_ptr(server, binding, stream);
    // Later kernels on the stream follow the GEMMs, so the operands' memory may be reused once
    // the bindings drop.
    issue_steps(handle, cu_stream, device, dt, calls, &mut ptr)
}

/// Without vendor/cubecl-cuda [`gemm_ordering`] never picks [`GemmOrdering::Stream`], so this
/// is never called.
#[cfg(not(cubecl_launch_stream))]
fn issue_on_launch_stream(
    _server: &mut CudaServer,
    _device: usize,
    _dt: cbs::cudaDataType,
    _stream: StreamId,
    _calls: &[Step],
) -> Result<(), SmpError> {
    Err(SmpError::Cuda(
        "issuing GEMMs on Burn's stream needs the workspace's vendor/cubecl-cuda".into(),
    ))
}

/// Issues `steps` on `stream` of `device`, the GEMMs with cuBLAS `handle` (bound to that
/// stream), resolving each operand's device address with `ptr`, which also returns a guard
/// that keeps the buffer alive until the step is issued.
fn issue_steps<G>(
    handle: cbs::cublasHandle_t,
    stream: ds::CUstream,
    device: usize,
    dt: cbs::cudaDataType,
    steps: &[Step],
    ptr: &mut impl FnMut(&Binding) -> Result<(u64, G), SmpError>,
) -> Result<(), SmpError> {
    let op = |t: bool| {
        if t {
            cbs::cublasOperation_t::CUBLAS_OP_T
        } else {
            cbs::cublasOperation_t::CUBLAS_OP_N
        }
    };
    let dim = |v: usize| {
        i32::try_from(v).map_err(|_| SmpError::Cuda(format!("GEMM dimension {v} exceeds i32")))
    };
    let (alpha, overwrite, add) = (1.0f32, 0.0f32, 1.0f32);
    for step in steps {
        let c = match step {
            Step::Gemm(c) => c,
            Step::Fp8(s) => {
                s.issue(device, stream, ptr)?;
                continue;
            }
        };
        let ((a, _ga), (b, _gb), (out, _gc)) =
            (ptr(&c.a.binding)?, ptr(&c.b.binding)?, ptr(&c.c.binding)?);
        // SAFETY: the pointers come from live allocations (the bindings hold them) of at least
        // the sizes the leading dimensions and extents describe (checked by the callers' shape
        // logic), on `device`, whose context the bridge made current; the stream is the
        // handle's own, ordered after every kernel launched so far.
        unsafe {
            cbr::gemm_ex(
                handle,
                op(c.trans_a),
                op(c.trans_b),
                dim(c.m)?,
                dim(c.n)?,
                dim(c.k)?,
                (&alpha as *const f32).cast(),
                a as *const _,
                dt,
                dim(c.a.ld)?,
                b as *const _,
                dt,
                dim(c.b.ld)?,
                (if c.accumulate { &add } else { &overwrite } as *const f32).cast(),
                out as *mut _,
                if c.c_f32 {
                    cbs::cudaDataType_t::CUDA_R_32F
                } else {
                    dt
                },
                dim(c.c.ld)?,
                cbs::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cbs::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
            .map_err(|err| cuda_err("cublasGemmEx", err))?;
        }
    }
    Ok(())
}

/// Rows (product of the leading dimensions) and columns (the last) of a tensor.
pub(super) fn rows_cols(shape: &Shape) -> (usize, usize) {
    let dims = shape.as_slice();
    let cols = *dims.last().unwrap_or(&1);
    let rows = dims[..dims.len().saturating_sub(1)].iter().product();
    (rows, cols)
}

fn check_dtype(what: &str, a: &CubeTensor<CudaRuntime>, b: &CubeTensor<CudaRuntime>) {
    assert!(
        supports(a.dtype, b.dtype),
        "cuBLAS {what}: operands must share a float dtype cuBLAS supports, got {:?} and {:?}",
        a.dtype,
        b.dtype
    );
}

/// `y = x w^T` with `x: [..., k]` and `w: [n, k]` (PyTorch's layout); `y: [..., n]`.
///
/// # Panics
/// On mismatched shapes or dtypes (an autodiff op has no error channel), naming the values,
/// and on a cuBLAS error of an earlier call on the device (GEMMs are issued asynchronously, so
/// the next one reports it).
pub fn linear_forward(
    x: CubeTensor<CudaRuntime>,
    w: CubeTensor<CudaRuntime>,
) -> CubeTensor<CudaRuntime> {
    check_dtype("linear", &x, &w);
    let (x, w) = (into_contiguous(x), into_contiguous(w));
    let (m, k) = rows_cols(x.meta.shape());
    let [n, kw] = w.meta.shape().dims::<2>();
    assert_eq!(
        k,
        kw,
        "linear: input {:?} does not match weight {:?}",
        x.meta.shape(),
        w.meta.shape()
    );
    let mut out_dims = x.meta.shape().as_slice().to_vec();
    *out_dims.last_mut().expect("input has a dimension") = n;
    let y = empty_device_contiguous_dtype(
        x.client.clone(),
        x.device.clone(),
        Shape::from(out_dims),
        x.dtype,
    );
    if m * n * k > 0 {
        // Row-major y[m,n] is column-major y^T[n,m] = w[n,k] (stored as w^T, k x n) ^T · x^T.
        let call = GemmCall {
            accumulate: false,
            c_f32: false,
            trans_a: true,
            trans_b: false,
            m: n,
            n: m,
            k,
            a: Operand::of(&w, k),
            b: Operand::of(&x, k),
            c: Operand::of(&y, n),
        };
        submit_ordered(x.device.index, x.dtype, vec![call]);
    }
    y
}

/// The two backward GEMMs of [`linear_forward`]: `dx = dy w` (when `w` is given) and
/// `dw = dy^T x` (when `x` is given), in one ordered batch. With `dx_into` (a contiguous
/// buffer of `x_shape` that no other tensor holds), `dx` is added into it in the GEMM's
/// epilogue (cuBLAS `beta = 1`, the sum rounded once) and returned. With `dw_into` (a
/// contiguous f32 buffer of the weight's element count), `dw` is added into it in f32 and not
/// returned: a gradient sum over micro-batches.
///
/// # Panics
/// As [`linear_forward`].
pub fn linear_backward(
    dy: CubeTensor<CudaRuntime>,
    x: Option<CubeTensor<CudaRuntime>>,
    w: Option<CubeTensor<CudaRuntime>>,
    x_shape: &Shape,
    dx_into: Option<CubeTensor<CudaRuntime>>,
    dw_into: Option<CubeTensor<CudaRuntime>>,
) -> (
    Option<CubeTensor<CudaRuntime>>,
    Option<CubeTensor<CudaRuntime>>,
) {
    let dy = into_contiguous(dy);
    let (m, n) = rows_cols(dy.meta.shape());
    let (_, k) = rows_cols(x_shape);
    let mut calls = Vec::new();
    let alloc = |shape: Shape| {
        empty_device_contiguous_dtype(dy.client.clone(), dy.device.clone(), shape, dy.dtype)
    };
    let dx = w.map(|w| {
        check_dtype("linear backward (dx)", &dy, &w);
        let w = into_contiguous(w);
        let (dx, accumulate) = dx_buffer(&dy, x_shape, dx_into);
        // dx^T (k x m, column-major) = w^T (k x n, stored as w) · dy^T (n x m, stored as dy).
        calls.push(GemmCall {
            accumulate,
            c_f32: false,
            trans_a: false,
            trans_b: false,
            m: k,
            n: m,
            k: n,
            a: Operand::of(&w, k),
            b: Operand::of(&dy, n),
            c: Operand::of(&dx, k),
        });
        dx
    });
    let dw = x.and_then(|x| {
        check_dtype("linear backward (dw)", &dy, &x);
        let x = into_contiguous(x);
        let (dw, into_sum) = match dw_into {
            Some(sum) => {
                assert!(
                    sum.meta.num_elements() == n * k
                        && sum.is_contiguous()
                        && sum.dtype == BurnDType::F32,
                    "linear backward: weight gradient sum {:?} {:?} does not match the weight \
                     [{n}, {k}] (f32, contiguous)",
                    sum.meta.shape(),
                    sum.dtype
                );
                (sum, true)
            }
            None => (alloc(Shape::from(vec![n, k])), false),
        };
        // dw^T (k x n, column-major) = x^T (k x m, stored as x) · dy (m x n, stored as dy^T).
        calls.push(GemmCall {
            accumulate: into_sum,
            c_f32: into_sum,
            trans_a: false,
            trans_b: true,
            m: k,
            n,
            k: m,
            a: Operand::of(&x, k),
            b: Operand::of(&dy, n),
            c: Operand::of(&dw, k),
        });
        // A sum's binding in the call keeps its buffer until the GEMM is issued.
        (!into_sum).then_some(dw)
    });
    if m * n * k > 0 {
        submit_ordered(dy.device.index, dy.dtype, calls);
    }
    (dx, dw)
}

/// The buffer `dx` is written to, and whether the GEMM adds into it: `dx_into` (checked to be
/// a contiguous buffer of `x_shape` in `dy`'s dtype) or a fresh one.
///
/// # Panics
/// On an accumulator that does not match, naming both.
pub(super) fn dx_buffer(
    dy: &CubeTensor<CudaRuntime>,
    x_shape: &Shape,
    dx_into: Option<CubeTensor<CudaRuntime>>,
) -> (CubeTensor<CudaRuntime>, bool) {
    match dx_into {
        Some(acc) => {
            assert!(
                acc.meta.shape() == x_shape && acc.is_contiguous() && acc.dtype == dy.dtype,
                "linear backward: accumulator {:?} {:?} does not match x {x_shape:?} {:?}",
                acc.meta.shape(),
                acc.dtype,
                dy.dtype
            );
            (acc, true)
        }
        None => (
            empty_device_contiguous_dtype(
                dy.client.clone(),
                dy.device.clone(),
                x_shape.clone(),
                dy.dtype,
            ),
            false,
        ),
    }
}

/// Registers a linear layer's input and weight gradients with the parents that want them.
pub(super) fn register_linear_grads<I: CubeInner>(
    grads: &mut Gradients,
    [node_x, node_w]: [Option<NodeId>; 2],
    dx: Option<I::FloatTensorPrimitive>,
    dw: Option<I::FloatTensorPrimitive>,
) {
    if let (Some(node), Some(dx)) = (node_x, dx) {
        grads.register::<I>(node, dx);
    }
    if let (Some(node), Some(dw)) = (node_w, dw) {
        grads.register::<I>(node, dw);
    }
}

#[derive(Debug)]
struct LinearBackward;

/// The backward GEMMs on backend `I`: `dy`, then `x` and `w` where given, then the buffers `dx`
/// and `dw` add into (plain backend only; `dw` is then not returned).
fn linear_backward_on<I: CubeInner>(
    dy: I::FloatTensorPrimitive,
    x: Option<I::FloatTensorPrimitive>,
    w: Option<I::FloatTensorPrimitive>,
    x_shape: Shape,
    dx_into: Option<I::FloatTensorPrimitive>,
    dw_into: Option<I::FloatTensorPrimitive>,
) -> (
    Option<I::FloatTensorPrimitive>,
    Option<I::FloatTensorPrimitive>,
) {
    use burn::tensor::TensorMetadata;
    let dtype = dy.dtype();
    let dy_shape = dy.shape();
    let n = dy_shape[dy_shape.num_dims() - 1];
    let k = x_shape[x_shape.num_dims() - 1];
    let (has_x, has_w) = (x.is_some(), w.is_some());
    let (has_acc, has_sum) = (dx_into.is_some(), dw_into.is_some());
    let returns_dw = has_x && !has_sum;
    let mut outputs = Vec::new();
    if has_w {
        outputs.push((x_shape.clone(), dtype));
    }
    if returns_dw {
        outputs.push((Shape::new([n, k]), dtype));
    }
    let args = [Some(dy), x, w, dx_into, dw_into]
        .into_iter()
        .flatten()
        .map(Arg::Float)
        .collect();
    let f: CubeFn = Arc::new(move |inputs: Vec<Cube>| {
        let mut inputs = inputs.into_iter();
        let dy = inputs.next().expect("dy");
        let x = has_x.then(|| inputs.next().expect("x"));
        let w = has_w.then(|| inputs.next().expect("w"));
        let acc = has_acc.then(|| inputs.next().expect("dx accumulator"));
        let sum = has_sum.then(|| inputs.next().expect("dw sum"));
        let (dx, dw) = linear_backward(dy, x, w, &x_shape, acc, sum);
        dx.into_iter().chain(dw).collect()
    });
    let mut out = I::run("smp_burn.linear_backward", args, outputs, f).into_iter();
    let dx = has_w.then(|| out.next().expect("dx"));
    let dw = returns_dw.then(|| out.next().expect("dw"));
    (dx, dw)
}

/// `x w^T` on backend `I`.
fn linear_forward_on<I: CubeInner>(
    x: I::FloatTensorPrimitive,
    w: I::FloatTensorPrimitive,
) -> I::FloatTensorPrimitive {
    use burn::tensor::TensorMetadata;
    let dtype = x.dtype();
    let mut dims = x.shape().as_slice().to_vec();
    *dims.last_mut().expect("input has a dimension") = w.shape()[0];
    let f: CubeFn = Arc::new(|inputs: Vec<Cube>| {
        let [x, w]: [Cube; 2] = inputs.try_into().expect("two inputs");
        vec![linear_forward(x, w)]
    });
    let outputs = vec![(Shape::from(dims), dtype)];
    I::run(
        "smp_burn.linear",
        vec![Arg::Float(x), Arg::Float(w)],
        outputs,
        f,
    )
    .pop()
    .expect("one output")
}

impl<I: CubeInner> Backward<I, 2> for LinearBackward {
    /// Checkpointed input (needed for dw), checkpointed weight (needed for dx), input shape.
    type State = (Option<NodeId>, Option<NodeId>, Shape);

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let dy = grads.consume::<I>(&ops.node);
        let (x_id, w_id) = (ops.state.0, ops.state.1);
        let x = x_id.map(|id| checkpointer.retrieve_node_output::<I::FloatTensorPrimitive>(id));
        let w = w_id.map(|id| checkpointer.retrieve_node_output::<I::FloatTensorPrimitive>(id));
        // `dx` adds into the input's gradient registered so far (the other projections of a
        // shared input, whose backward ran first) instead of a separate add. On the plain
        // backend only: under fusion the registered gradient is a lazy tensor of its stream.
        let dx_into = match (I::as_cube(&dy), &w) {
            (Some(like), Some(_)) => {
                super::accumulate::take_grad_for_accumulation(&ops, 0, grads, like, &ops.state.2)
                    .map(crate::downcast::same::<Cube, I::FloatTensorPrimitive>)
            }
            _ => None,
        };
        // `dw` adds into FSDP's gradient sum over micro-batches where the unit registered one
        // for this weight (plain backend only, as above).
        let dw_into = match (I::as_cube(&dy), &x, &ops.parents[1]) {
            (Some(dy_cube), Some(_), Some(node)) => {
                let (_, n) = rows_cols(dy_cube.meta.shape());
                let (_, k) = rows_cols(&ops.state.2);
                super::accumulate::weight_grad_target(node.id, n * k)
                    .map(crate::downcast::same::<Cube, I::FloatTensorPrimitive>)
            }
            _ => None,
        };
        let x_shape = ops.state.2;
        let (dx, dw) = linear_backward_on::<I>(dy, x, w, x_shape, dx_into, dw_into);
        register_linear_grads::<I>(grads, ops.parents.map(|p| p.map(|n| n.id)), dx, dw);
    }
}

/// `x w^T` through cuBLAS on an autodiff CUDA backend; differentiable in both operands.
pub fn linear_autodiff<I: CubeInner, const D: usize>(
    x: Tensor<Autodiff<I>, D>,
    w: Tensor<Autodiff<I>, 2>,
) -> Tensor<Autodiff<I>, D> {
    let x = x.into_primitive().tensor();
    let w = w.into_primitive().tensor();
    let (x_tracked, w_tracked) = (x.is_tracked(), w.is_tracked());
    let x_shape = burn::tensor::TensorMetadata::shape(&x.primitive);
    let out = match LinearBackward
        .prepare::<NoCheckpointing>([x.node.clone(), w.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(mut prep) => {
            let x_state = w_tracked.then(|| prep.checkpoint(&x));
            let w_state = x_tracked.then(|| prep.checkpoint(&w));
            let y = linear_forward_on::<I>(x.primitive, w.primitive);
            prep.finish((x_state, w_state, x_shape), y)
        }
        OpsKind::UnTracked(prep) => prep.finish(linear_forward_on::<I>(x.primitive, w.primitive)),
    };
    Tensor::from_primitive(TensorPrimitive::Float(out))
}

/// `x w^T` through cuBLAS on a plain CUDA backend (evaluation, sampling).
pub fn linear_plain<I: CubeInner, const D: usize>(
    x: Tensor<I, D>,
    w: Tensor<I, 2>,
) -> Tensor<I, D> {
    let y = linear_forward_on::<I>(x.into_primitive().tensor(), w.into_primitive().tensor());
    Tensor::from_primitive(TensorPrimitive::Float(y))
}

/// The input gradients of a linear layer (`dx = dy w`, `dw = dy^T x`, as requested) in one
/// ordered batch on a plain CUDA backend (the chunked loss's backward runs on the inner
/// backend).
#[allow(clippy::type_complexity)]
pub fn linear_grads<I: CubeInner>(
    dy: Tensor<I, 2>,
    x: Option<Tensor<I, 2>>,
    w: Option<Tensor<I, 2>>,
    x_shape: Shape,
) -> (Option<Tensor<I, 2>>, Option<Tensor<I, 2>>) {
    let prim = |t: Tensor<I, 2>| t.into_primitive().tensor();
    let (dx, dw) = linear_backward_on::<I>(prim(dy), x.map(prim), w.map(prim), x_shape, None, None);
    let wrap = |t| Tensor::from_primitive(TensorPrimitive::Float(t));
    (dx.map(wrap), dw.map(wrap))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Where the workspace vendors cubecl-cuda, smp-burn must have been built against it (its
    /// `[patch.crates-io]` entry): otherwise every GEMM batch silently crosses streams through
    /// two context events.
    #[test]
    fn workspace_build_has_the_launch_stream() {
        let vendored = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../vendor/cubecl-cuda")
            .is_dir();
        assert!(
            !vendored || LAUNCH_STREAM_BUILT,
            "vendor/cubecl-cuda exists but smp-burn was built against another cubecl-cuda (is \
             its [patch.crates-io] entry in the workspace Cargo.toml?)"
        );
    }
}
