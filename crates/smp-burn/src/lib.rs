//! smp-burn: sharded data parallelism, tensor parallelism, mixed precision and fused kernels
//! for Burn models.
//!
//! The parts: [`config`] (an SMP-style [`ParallelConfig`] and the validated mesh shape),
//! [`comm`] (collectives on Burn tensors), [`fsdp`] (sharded units with fp32 master weights and
//! AdamW on shards), [`tp`] (tensor and sequence parallelism: autodiff-aware collectives over
//! the tensor-parallel group), [`init`] (counter-based initialization so each rank builds only
//! its shard),
//! [`ops`] (reference transformer ops every fused kernel must match), [`documents`] (packed
//! documents: attention and rotary positions per document), [`readback`] (device values
//! read later without draining the GPU's queue), [`offload`] (activations kept in host memory
//! between forward and backward), [`fast`] (the switchable
//! dispatch from those ops to cuBLAS and our kernels on CUDA) and [`cuda`] (the bridge to
//! Burn's CUDA runtime for NCCL and cuBLAS).

pub mod autodiff;
pub mod checkpoint;
pub mod comm;
pub mod config;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod documents;
mod downcast;
pub mod engine;
pub mod error;
pub mod fast;
pub mod fp8;
pub mod fsdp;
pub mod init;
pub mod kernel_config;
pub mod loss;
pub mod mesh;
pub mod offload;
pub mod ops;
pub mod optim;
mod packed_attention;
pub mod plan;
pub mod readback;
pub mod selective;
pub mod tp;

/// The guide's complete program runs as a doc test, so the guide cannot drift from the API.
#[cfg(doctest)]
#[doc = include_str!("../../../docs/guide.md")]
pub struct GuideProgram;

pub use comm::{HostTensorComm, PendingCollective, PendingGather, TensorComm};
pub use config::{ActivationCheckpointing, ParallelConfig, ParallelDims, Precision};
pub use documents::Documents;
pub use error::SmpError;
pub use fp8::Fp8Recipe;
pub use kernel_config::{FlashBackward, FlashForward, KernelConfig};
pub use loss::{Loss, LossScope};
