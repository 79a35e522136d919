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
    /// A tensor-parallel collective failed inside a layer or the backward pass, or a layer was
    /// built with another tensor-parallel group than the engine's.
    #[error("tensor parallelism: {0}")]
    TensorParallel(String),
    /// The engine was used in a way that would give wrong results (a gradient left unreduced,
    /// a model whose shapes do not fit the mesh); the message says what and how to fix it.
    #[error("{0}")]
    Usage(String),
    /// A CUDA driver, cuBLAS or NCCL call failed.
    #[error("CUDA: {0}")]
    Cuda(String),
    /// A checkpoint could not be written or read: missing, damaged (a checksum that does not
    /// match names the file and byte range), or not for this model.
    #[error("checkpoint {}: {reason}", path.display())]
    Checkpoint {
        /// The checkpoint directory or file.
        path: std::path::PathBuf,
        /// What is wrong, with the values involved.
        reason: String,
    },
}
