//! The one error type of `smp-burn`.

/// Errors of the parallel layer: invalid degrees, collective failures, checkpoint mismatches.
#[derive(Debug, thiserror::Error)]
pub enum SmpError {
    /// A parallel configuration that does not fit the world (degrees, divisibility).
    #[error("invalid parallel configuration: {0}")]
    Config(String),
    /// A collective failed (timeout, dead peer, size mismatch).
    #[error(transparent)]
    Comm(#[from] collectives::CommError),
    /// A CUDA driver, cuBLAS or NCCL call failed.
    #[error("CUDA: {0}")]
    Cuda(String),
}
