//! The one error type of the `llama` crate.

use std::path::PathBuf;

/// Everything that can go wrong while building, loading, saving or training a Llama model.
///
/// Messages name the offending values (tensor, file, shape) so that a user can act on them
/// without reading the source.
#[derive(Debug, thiserror::Error)]
pub enum LlamaError {
    /// A configuration that cannot describe a valid model or run.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A file or directory could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file involved.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A checkpoint does not match the model or is damaged.
    #[error("checkpoint {path}: {message}")]
    Checkpoint {
        /// The file involved.
        path: PathBuf,
        /// What is wrong, naming the tensor where there is one.
        message: String,
    },
    /// The tokenizer could not be trained, loaded or used.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The training data could not be read or is unusable.
    #[error("data: {0}")]
    Data(String),
    /// A collective or parallel-layout error from the lower layers.
    #[error(transparent)]
    Parallel(#[from] smp_burn::SmpError),
    /// A command line clap rejects, or `--help`: [`clap::Error::exit`] prints it as clap
    /// formats it and exits with clap's status (0 for help).
    #[error(transparent)]
    Usage(#[from] clap::Error),
}

impl LlamaError {
    /// Wraps an I/O error with the path it concerns.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        LlamaError::Io {
            path: path.into(),
            source,
        }
    }
    /// A checkpoint error for `path`.
    pub fn checkpoint(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        LlamaError::Checkpoint {
            path: path.into(),
            message: message.into(),
        }
    }
}

/// Result alias of the `llama` crate.
pub type Result<T> = std::result::Result<T, LlamaError>;
