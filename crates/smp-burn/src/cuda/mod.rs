//! Everything that touches CUDA: the backends served, NCCL on Burn's tensors, and the kernels
//! of the fast paths.
//!
//! Layers, each using only the ones listed before it:
//! - [`device`]: the backend types ([`CudaCube`], [`CudaTensors`]) and driver queries that need
//!   no context; [`kernel_cache`](configure_kernel_cache) points CubeCL's caches at the user's
//!   cache folder.
//! - [`nccl`]: NCCL collectives on Burn's own buffers, ordered with Burn's stream on the GPU.
//! - [`bridge`]: runs a kernel on the CubeCL tensors behind either CUDA backend (directly on
//!   [`CudaCube`], as a fusion custom op on `burn::backend::Cuda`).
//! - the kernels: [`gemm`] (cuBLAS on Burn's stream), [`flash`] and its autodiff op
//!   [`attention`], [`fp8`] (FP8 linear layers: casts and cuBLASLt GEMMs), [`fused`] (RMSNorm,
//!   RoPE, SwiGLU), [`xent`] and [`embedding`] (the LM-head
//!   loss and the embedding gradient), [`flat`] and [`adamw`] (FSDP's flat gradients and the
//!   optimizer step on shards), `accumulate` (gradients summed in place) and [`init`] (seeded
//!   initialization drawn on the GPU).
//!
//! Nothing here touches CUDA until a caller asks for it: [`cuda_device_count`] returns 0 on a
//! machine without libcuda, and the rest is only reached with CUDA tensors in hand. Which
//! kernels run is [`crate::KernelConfig`]'s to say.

pub(crate) mod accumulate;
pub mod adamw;
pub mod attention;
pub mod bridge;
pub mod device;
pub mod embedding;
pub mod flash;
pub mod flat;
pub mod fp8;
pub mod fused;
pub mod gemm;
pub mod init;
mod kernel_cache;
pub mod nccl;
pub(crate) mod transfer;
pub mod xent;

pub use attention::attention_summary;
pub use device::{
    CudaCube, CudaTensors, cube_tensor, cuda_compute_capability, cuda_device_count,
    cuda_device_memory, memory_in_use,
};
pub use kernel_cache::{
    configure_kernel_cache, kernel_cache_build, kernel_cache_dir, user_cubecl_config,
};
pub use nccl::{CudaTensorComm, Ordering, PinnedBuffer, StreamBridge, comm_dtype, pin_tensor};
