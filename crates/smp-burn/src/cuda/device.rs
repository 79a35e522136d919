//! The CUDA backends smp-burn serves and what the driver says about the devices, asked without
//! creating a CubeCL client (which would open a context on GPU 0 in every process of a launch).

use burn::tensor::{Tensor, TensorPrimitive, backend::Backend};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeBackend, FloatElement, IntElement};
use burn_cuda::{Cuda, CudaDevice};
use cubecl::cuda::CudaRuntime;
use cudarc::driver::{CudaContext, sys as ds};

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

/// Launches a kernel loaded from PTX with a 1-D grid and block on `stream`; a failure names
/// `what`.
///
/// # Safety
/// `params` must be pointers to the kernel's parameters, in order and of its types, and every
/// buffer they name must be live on `stream`'s device for the kernel's extent.
pub(crate) unsafe fn launch_ptx(
    what: &str,
    kernel: ds::CUfunction,
    blocks: (u32, u32),
    threads: u32,
    stream: ds::CUstream,
    params: &mut [*mut std::ffi::c_void],
) -> Result<(), SmpError> {
    // SAFETY: as the caller promises.
    unsafe {
        cudarc::driver::result::launch_kernel(
            kernel,
            (blocks.0, blocks.1, 1),
            (threads, 1, 1),
            0,
            stream,
            params,
        )
    }
    .map_err(|e| cuda_err(&format!("launching the {what}"), e))
}

pub(crate) fn cuda_err(what: &str, e: impl std::fmt::Debug) -> SmpError {
    SmpError::Cuda(format!("{what}: {e:?}"))
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
