//! NCCL backend: collectives on raw CUDA device pointers, ordered on a CUDA stream.
//!
//! An [`NcclComm`] is created collectively from a host [`Communicator`] of the same group:
//! rank 0 asks NCCL for a unique id, the 128 bytes travel over the host communicator, and every
//! rank joins with `ncclCommInitRank` on its CUDA device. The host communicator stays the
//! control plane (rendezvous, splits, errors); NCCL moves the tensor bytes.
//!
//! NCCL is loaded at run time (cudarc's dynamic loading): nothing here touches libnccl or libcuda
//! until [`NcclComm::new`] is called, so a binary that never asks for NCCL runs without them.
//!
//! # Dead peers
//!
//! Collectives are queued on a stream and return at once; a collective whose peer died would
//! spin on the GPU forever. Each communicator therefore has a watchdog thread that polls
//! `ncclCommGetAsyncError` and the completion event of every queued collective. When NCCL
//! reports an error, or a collective has not completed within the timeout
//! ([`NcclComm::with_timeout`], default [`DEFAULT_TIMEOUT`] or `SMP_NCCL_TIMEOUT_S`), it calls
//! `ncclCommAbort`, which makes the pending kernels return, so the streams (and Burn's stream,
//! when it waits on them) drain instead of hanging. Every later call on that communicator
//! returns [`CommError`] naming the op and the group. The collective that was running when the
//! abort happened has already returned `Ok` to its caller (it only queued work): its output is
//! garbage, and the error surfaces at the next call on the communicator.
//!
//! Limit: `ncclCommInitRank` itself blocks until every rank joined. A peer that dies after the
//! unique id went out over the host communicator but before it joined NCCL leaves the others
//! blocked in init (NCCL's own bootstrap timeout applies); the host broadcast before it fails
//! cleanly on a dead peer.

use std::collections::VecDeque;
use std::ffi::CStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, sys as ds};
use cudarc::nccl::sys as ns;

use crate::{CommError, Communicator, DType, GroupInfo, ReduceOp};

/// How long a queued collective may take before the watchdog aborts the communicator.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);

/// How often the watchdog looks at NCCL's async error and the pending collectives.
const POLL: Duration = Duration::from_millis(50);

/// A raw CUDA stream handle (`CUstream`), as NCCL and the CUDA driver take it.
pub type CuStream = ds::CUstream;

/// Whether NCCL's library can be loaded on this machine (false when libnccl is missing).
pub fn nccl_available() -> bool {
    // SAFETY: only tries to dlopen libnccl under its usual names; loads nothing else.
    unsafe { ns::is_culib_present() }
}

/// The NCCL library version (e.g. 22805 for 2.28.5), if libnccl can be loaded.
pub fn nccl_version() -> Option<i32> {
    if !nccl_available() {
        return None;
    }
    cudarc::nccl::result::get_nccl_version().ok()
}

fn nccl_dtype(d: DType) -> ns::ncclDataType_t {
    use ns::ncclDataType_t as T;
    match d {
        DType::F32 => T::ncclFloat32,
        DType::F64 => T::ncclFloat64,
        DType::BF16 => T::ncclBfloat16,
        DType::F16 => T::ncclFloat16,
        DType::I32 => T::ncclInt32,
        DType::I64 => T::ncclInt64,
        DType::U8 => T::ncclUint8,
    }
}

fn nccl_op(op: ReduceOp) -> ns::ncclRedOp_t {
    match op {
        ReduceOp::Sum => ns::ncclRedOp_t::ncclSum,
        ReduceOp::Avg => ns::ncclRedOp_t::ncclAvg,
        ReduceOp::Max => ns::ncclRedOp_t::ncclMax,
    }
}

fn describe(r: ns::ncclResult_t) -> String {
    // SAFETY: ncclGetErrorString returns a static NUL-terminated string for any result code.
    let s = unsafe { ns::ncclGetErrorString(r) };
    if s.is_null() {
        return format!("{r:?}");
    }
    // SAFETY: non-null, static, NUL-terminated (see above).
    let msg = unsafe { CStr::from_ptr(s) }.to_string_lossy();
    format!("{r:?} ({msg})")
}

/// The raw communicator handle, shared with the watchdog thread.
struct Handle {
    comm: ns::ncclComm_t,
    /// Set once the communicator was aborted; the handle must not be used after that.
    aborted: Option<String>,
}

// SAFETY: an ncclComm_t may be used from any thread as long as calls on it are not concurrent;
// every use goes through the `Mutex<Handle>` below.
unsafe impl Send for Handle {}

/// A CUDA event handle.
#[derive(Clone, Copy)]
struct Event(ds::CUevent);

// SAFETY: CUevent handles are plain driver handles valid from any thread of the process.
unsafe impl Send for Event {}

/// A completion event of one queued collective, checked by the watchdog.
struct Pending {
    event: Event,
    queued: Instant,
    op: &'static str,
}

struct Shared {
    handle: Mutex<Handle>,
    pending: Mutex<VecDeque<Pending>>,
    /// Spare completion events, so queuing a collective does not create one each time.
    free_events: Mutex<Vec<Event>>,
    stop: AtomicBool,
    wake: Condvar,
    wake_lock: Mutex<()>,
    ctx: Arc<CudaContext>,
    group: String,
    timeout: Duration,
}

/// An NCCL communicator for one process group, bound to one CUDA device.
///
/// The collectives are `unsafe`: they take raw device pointers and a raw stream and only queue
/// work; the caller keeps the buffers alive and unaliased until the stream has run it.
pub struct NcclComm {
    shared: Arc<Shared>,
    rank: usize,
    world: usize,
    device: usize,
    group: GroupInfo,
    watchdog: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm")
            .field("group", &self.shared.group)
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("device", &self.device)
            .finish()
    }
}

fn err(group: &str, op: &str, msg: impl std::fmt::Display) -> CommError {
    CommError::Nccl(format!("NCCL {op} on group {group}: {msg}"))
}

impl NcclComm {
    /// Creates the NCCL communicator of `host`'s group on CUDA device `device` (an ordinal on
    /// this machine). Collective over `host`: every rank of the group must call it.
    pub fn new(host: &dyn Communicator, device: usize) -> Result<Self, CommError> {
        let timeout = std::env::var("SMP_NCCL_TIMEOUT_S")
            .ok()
            .and_then(|s| s.parse::<f64>().ok())
            .map(Duration::from_secs_f64)
            .unwrap_or(DEFAULT_TIMEOUT);
        Self::with_timeout(host, device, timeout)
    }

    /// As [`NcclComm::new`], with the watchdog's deadline for one collective.
    pub fn with_timeout(
        host: &dyn Communicator,
        device: usize,
        timeout: Duration,
    ) -> Result<Self, CommError> {
        let info = host.group().clone();
        let group = info.to_string();
        let (rank, world) = (host.rank(), host.world_size());

        // Rank 0 sends an all-zero id when it cannot create one, so that the other ranks fail
        // with an error instead of waiting for a broadcast that never comes.
        let mut id = [0u8; 128];
        let mut local_err = None;
        if rank == 0 {
            if !nccl_available() {
                local_err = Some("libnccl could not be loaded".to_string());
            } else {
                match cudarc::nccl::result::get_uniqueid() {
                    Ok(u) => {
                        for (d, s) in id.iter_mut().zip(u.internal.iter()) {
                            *d = *s as u8;
                        }
                    }
                    Err(e) => local_err = Some(describe(e.0)),
                }
            }
        }
        host.broadcast_raw(&mut id, 0)?;
        if let Some(e) = local_err {
            return Err(err(&group, "ncclGetUniqueId", e));
        }
        if id.iter().all(|b| *b == 0) {
            return Err(err(
                &group,
                "init",
                "rank 0 could not create an NCCL unique id",
            ));
        }
        let ctx = CudaContext::new(device).map_err(|e| err(&group, "init", format!("{e:?}")))?;
        ctx.bind_to_thread()
            .map_err(|e| err(&group, "init", format!("{e:?}")))?;
        let mut uid = ns::ncclUniqueId { internal: [0; 128] };
        for (d, s) in uid.internal.iter_mut().zip(id.iter()) {
            *d = *s as _;
        }
        let mut comm: ns::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` is a valid out-pointer; the device's context is current on this thread,
        // which is how NCCL picks the device.
        let r = unsafe { ns::ncclCommInitRank(&mut comm, world as i32, uid, rank as i32) };
        if r != ns::ncclResult_t::ncclSuccess {
            return Err(err(&group, "ncclCommInitRank", describe(r)));
        }
        let shared = Arc::new(Shared {
            handle: Mutex::new(Handle {
                comm,
                aborted: None,
            }),
            pending: Mutex::new(VecDeque::new()),
            free_events: Mutex::new(Vec::new()),
            stop: AtomicBool::new(false),
            wake: Condvar::new(),
            wake_lock: Mutex::new(()),
            ctx,
            group,
            timeout,
        });
        let wd = shared.clone();
        let watchdog = std::thread::Builder::new()
            .name(format!("nccl-watchdog-{}", info.name))
            .spawn(move || watchdog(wd))
            .map_err(|e| CommError::Nccl(format!("spawning the NCCL watchdog: {e}")))?;
        Ok(Self {
            shared,
            rank,
            world,
            device,
            group: info,
            watchdog: Some(watchdog),
        })
    }

    /// Creates a communicator for a subgroup (a mesh axis). Collective over `host_sub`, the host
    /// communicator of that subgroup (e.g. from [`Communicator::split`]); each subgroup gets its
    /// own NCCL unique id, so disjoint subgroups initialize independently.
    pub fn split(&self, host_sub: &dyn Communicator) -> Result<Self, CommError> {
        Self::with_timeout(host_sub, self.device, self.shared.timeout)
    }

    /// This rank's index in the group.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks in the group.
    pub fn world_size(&self) -> usize {
        self.world
    }

    /// The CUDA device ordinal this communicator runs on.
    pub fn device(&self) -> usize {
        self.device
    }

    /// The group (name and members' global ranks), as the host communicator's.
    pub fn group(&self) -> &GroupInfo {
        &self.group
    }

    /// The CUDA context (the device's primary context) the communicator was created in.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.shared.ctx
    }

    /// Returns an error if NCCL reported an asynchronous error or the watchdog aborted the
    /// communicator.
    pub fn check(&self) -> Result<(), CommError> {
        let h = self.shared.handle.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(why) = &h.aborted {
            return Err(err(&self.shared.group, "check", why));
        }
        async_error(h.comm).map_err(|e| err(&self.shared.group, "async error", e))
    }

    /// Aborts the communicator: pending NCCL kernels return, later calls fail.
    pub fn abort(&self, why: &str) {
        abort(&self.shared, why);
    }

    /// Runs `f` with the live communicator handle, then queues a completion event on `stream`
    /// for the watchdog.
    fn queue(
        &self,
        op: &'static str,
        stream: CuStream,
        f: impl FnOnce(ns::ncclComm_t) -> ns::ncclResult_t,
    ) -> Result<(), CommError> {
        let s = &self.shared;
        let h = s.handle.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(why) = &h.aborted {
            return Err(err(
                &s.group,
                op,
                format!("communicator was aborted: {why}"),
            ));
        }
        let r = f(h.comm);
        if r != ns::ncclResult_t::ncclSuccess {
            return Err(err(&s.group, op, describe(r)));
        }
        drop(h);
        let event = match s
            .free_events
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop()
        {
            Some(e) => e,
            None => {
                s.ctx
                    .bind_to_thread()
                    .map_err(|e| err(&s.group, op, format!("{e:?}")))?;
                Event(
                    cudarc::driver::result::event::create(
                        ds::CUevent_flags::CU_EVENT_DISABLE_TIMING,
                    )
                    .map_err(|e| err(&s.group, op, format!("cuEventCreate: {e:?}")))?,
                )
            }
        };
        // SAFETY: `event` belongs to this device's context and `stream` to the same context
        // (caller's contract).
        unsafe { ds::cuEventRecord(event.0, stream) }
            .result()
            .map_err(|e| err(&s.group, op, format!("cuEventRecord: {e:?}")))?;
        s.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push_back(Pending {
                event,
                queued: Instant::now(),
                op,
            });
        Ok(())
    }

    /// Sums (or averages, maxes) `count` elements of `send` over the ranks into `recv`.
    ///
    /// # Safety
    /// `send` and `recv` are device pointers on this communicator's device to at least `count`
    /// elements of `dtype` (they may be equal, for in place); `stream` is a live stream of the
    /// same context; both buffers stay allocated and untouched by other work until `stream` has
    /// run the collective. Every rank calls the same sequence of collectives.
    pub unsafe fn all_reduce(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
        op: ReduceOp,
        stream: CuStream,
    ) -> Result<(), CommError> {
        self.queue("all_reduce", stream, |c| {
            // SAFETY: the caller's contract above.
            unsafe {
                ns::ncclAllReduce(
                    send as *const _,
                    recv as *mut _,
                    count,
                    nccl_dtype(dtype),
                    nccl_op(op),
                    c,
                    stream as _,
                )
            }
        })
    }

    /// Gathers `send_count` elements from every rank into `recv` (`world_size * send_count`
    /// elements, rank order).
    ///
    /// # Safety
    /// As [`NcclComm::all_reduce`]; `recv` holds `world_size * send_count` elements.
    pub unsafe fn all_gather(
        &self,
        send: u64,
        recv: u64,
        send_count: usize,
        dtype: DType,
        stream: CuStream,
    ) -> Result<(), CommError> {
        self.queue("all_gather", stream, |c| {
            // SAFETY: the caller's contract above.
            unsafe {
                ns::ncclAllGather(
                    send as *const _,
                    recv as *mut _,
                    send_count,
                    nccl_dtype(dtype),
                    c,
                    stream as _,
                )
            }
        })
    }

    /// Reduces `send` (`world_size * recv_count` elements) over the ranks; this rank receives
    /// its chunk of `recv_count` elements in `recv`.
    ///
    /// # Safety
    /// As [`NcclComm::all_reduce`]; `send` holds `world_size * recv_count` elements.
    pub unsafe fn reduce_scatter(
        &self,
        send: u64,
        recv: u64,
        recv_count: usize,
        dtype: DType,
        op: ReduceOp,
        stream: CuStream,
    ) -> Result<(), CommError> {
        self.queue("reduce_scatter", stream, |c| {
            // SAFETY: the caller's contract above.
            unsafe {
                ns::ncclReduceScatter(
                    send as *const _,
                    recv as *mut _,
                    recv_count,
                    nccl_dtype(dtype),
                    nccl_op(op),
                    c,
                    stream as _,
                )
            }
        })
    }

    /// Copies `root`'s `send` into every rank's `recv` (`send` is read on `root` only).
    ///
    /// # Safety
    /// As [`NcclComm::all_reduce`].
    pub unsafe fn broadcast(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
        root: usize,
        stream: CuStream,
    ) -> Result<(), CommError> {
        if root >= self.world {
            return Err(err(
                &self.shared.group,
                "broadcast",
                format!("root {root} out of range for world size {}", self.world),
            ));
        }
        self.queue("broadcast", stream, |c| {
            // SAFETY: the caller's contract above.
            unsafe {
                ns::ncclBroadcast(
                    send as *const _,
                    recv as *mut _,
                    count,
                    nccl_dtype(dtype),
                    root as i32,
                    c,
                    stream as _,
                )
            }
        })
    }

    /// Blocks until `stream` has run everything queued on it, failing (and aborting the
    /// communicator) if that takes longer than the timeout or NCCL reports an error. For tests
    /// and benchmarks; the training path orders work on the GPU instead of waiting here.
    ///
    /// # Safety
    /// `stream` is a live stream of this communicator's context.
    pub unsafe fn synchronize(&self, stream: CuStream) -> Result<(), CommError> {
        let t0 = Instant::now();
        loop {
            // SAFETY: `stream` is a live stream of this context (caller's contract).
            match unsafe { ds::cuStreamQuery(stream) } {
                ds::CUresult::CUDA_SUCCESS => return self.check(),
                ds::CUresult::CUDA_ERROR_NOT_READY => {}
                e => return Err(err(&self.shared.group, "cuStreamQuery", format!("{e:?}"))),
            }
            self.check()?;
            if t0.elapsed() > self.shared.timeout {
                let why = format!("stream not done after {:?}", self.shared.timeout);
                self.abort(&why);
                return Err(err(&self.shared.group, "synchronize", why));
            }
            std::thread::yield_now();
        }
    }
}

fn async_error(comm: ns::ncclComm_t) -> Result<(), String> {
    let mut r = ns::ncclResult_t::ncclSuccess;
    // SAFETY: `comm` is live (callers hold the handle lock and checked it was not aborted).
    let q = unsafe { ns::ncclCommGetAsyncError(comm, &mut r) };
    if q != ns::ncclResult_t::ncclSuccess {
        return Err(describe(q));
    }
    match r {
        ns::ncclResult_t::ncclSuccess | ns::ncclResult_t::ncclInProgress => Ok(()),
        e => Err(describe(e)),
    }
}

fn abort(s: &Shared, why: &str) {
    let mut h = s.handle.lock().unwrap_or_else(|p| p.into_inner());
    if h.aborted.is_some() {
        return;
    }
    tracing::error!(group = %s.group, "aborting NCCL communicator: {why}");
    // SAFETY: the handle is live and no other call on it runs (we hold the lock); it is never
    // used again (aborted is set).
    unsafe { ns::ncclCommAbort(h.comm) };
    h.aborted = Some(why.to_string());
}

fn watchdog(s: Arc<Shared>) {
    if s.ctx.bind_to_thread().is_err() {
        return;
    }
    while !s.stop.load(Ordering::Acquire) {
        {
            let g = s.wake_lock.lock().unwrap_or_else(|p| p.into_inner());
            let _ = s.wake.wait_timeout(g, POLL);
        }
        if s.stop.load(Ordering::Acquire) {
            break;
        }
        // Retire the collectives that completed; look at the oldest one still running.
        let overdue = {
            let mut p = s.pending.lock().unwrap_or_else(|p| p.into_inner());
            while let Some(front) = p.front() {
                // SAFETY: the event is live (created in this context, destroyed only at drop).
                let done = unsafe { ds::cuEventQuery(front.event.0) }
                    != ds::CUresult::CUDA_ERROR_NOT_READY;
                if !done {
                    break;
                }
                let e = p.pop_front().map(|x| x.event);
                if let Some(e) = e {
                    s.free_events
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push(e);
                }
            }
            p.front()
                .filter(|f| f.queued.elapsed() > s.timeout)
                .map(|f| format!("{} not complete after {:?}", f.op, s.timeout))
        };
        let failed = {
            let h = s.handle.lock().unwrap_or_else(|p| p.into_inner());
            if h.aborted.is_some() {
                break;
            }
            async_error(h.comm).err()
        };
        if let Some(why) = failed.or(overdue) {
            abort(&s, &why);
            break;
        }
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        self.shared.wake.notify_all();
        if let Some(w) = self.watchdog.take() {
            let _ = w.join();
        }
        let s = &self.shared;
        let _ = s.ctx.bind_to_thread();
        let h = s.handle.lock().unwrap_or_else(|p| p.into_inner());
        if h.aborted.is_none() {
            // SAFETY: the handle is live and the watchdog has stopped; nothing uses it after this.
            unsafe { ns::ncclCommDestroy(h.comm) };
        }
        let pending = std::mem::take(&mut *s.pending.lock().unwrap_or_else(|p| p.into_inner()));
        let free = std::mem::take(&mut *s.free_events.lock().unwrap_or_else(|p| p.into_inner()));
        for e in pending.into_iter().map(|p| p.event).chain(free) {
            // SAFETY: events created in this context and no longer referenced; destroying an
            // event whose record is still pending is allowed (resources are freed on completion).
            let _ = unsafe { cudarc::driver::result::event::destroy(e.0) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dtype_and_op_mapping() {
        assert_eq!(nccl_dtype(DType::BF16), ns::ncclDataType_t::ncclBfloat16);
        assert_eq!(nccl_dtype(DType::F32), ns::ncclDataType_t::ncclFloat32);
        assert_eq!(nccl_op(ReduceOp::Avg), ns::ncclRedOp_t::ncclAvg);
    }

    #[test]
    fn probing_nccl_never_panics() {
        // On machines without libnccl this is None; on GPU machines a version.
        let _ = nccl_version();
    }
}
