//! Error type shared by every backend.

use std::time::Duration;

use crate::comm::GroupInfo;

/// Result alias used throughout the crate.
pub type Result<T> = std::result::Result<T, CommError>;

/// Everything that can go wrong in a collective, a rendezvous or a mesh.
///
/// Messages name the concrete values involved (ranks, sizes, addresses, timeouts) because
/// in a distributed job the error text is usually all an operator has to go on.
#[derive(thiserror::Error, Debug)]
pub enum CommError {
    /// Peers did not deliver their part of a collective before the deadline.
    #[error("{op} on group {group} timed out after {after:?} waiting for ranks {waiting_for:?}")]
    Timeout {
        /// The collective, e.g. `all_gather`.
        op: String,
        /// The group the collective ran on.
        group: GroupInfo,
        /// Global ranks whose messages never arrived.
        waiting_for: Vec<usize>,
        /// The timeout that expired.
        after: Duration,
    },
    /// The connection to a peer closed (its process exited or crashed) during a collective.
    #[error("{op} on group {group} failed: rank {peer} is gone (its connection closed: {reason})")]
    PeerClosed {
        /// The collective, e.g. `all_reduce`.
        op: String,
        /// The group the collective ran on.
        group: GroupInfo,
        /// Global rank of the peer that went away.
        peer: usize,
        /// How the loss was noticed.
        reason: String,
    },
    /// Buffer sizes are inconsistent, locally or between ranks.
    #[error("{op} on group {group}: {detail}")]
    SizeMismatch {
        /// The collective, e.g. `reduce_scatter`.
        op: String,
        /// The group the collective ran on.
        group: GroupInfo,
        /// Which sizes disagree, with their values.
        detail: String,
    },
    /// An argument that is wrong regardless of sizes (bad root, bad split members ...).
    #[error("{op} on group {group}: {detail}")]
    InvalidArgument {
        /// The operation.
        op: String,
        /// The group it ran on.
        group: GroupInfo,
        /// What was wrong, with the values.
        detail: String,
    },
    /// A device mesh cannot be built or queried as asked.
    #[error("invalid device mesh: {detail}")]
    InvalidMesh {
        /// What was wrong, naming degrees, products and world size.
        detail: String,
    },
    /// Rendezvous through the store failed.
    #[error("rendezvous at {addr} {detail}")]
    Rendezvous {
        /// `host:port` of the store.
        addr: String,
        /// What went wrong, e.g. `timed out after 10s: 2 of 4 ranks arrived; missing ranks [2, 3]`.
        detail: String,
    },
    /// Configuration (usually environment variables) is missing or invalid.
    #[error("configuration error: {detail}")]
    Config {
        /// Names the variable and its value.
        detail: String,
    },
    /// A peer sent bytes that do not follow the wire protocol.
    #[error("protocol error: {detail}")]
    Protocol {
        /// What was received instead of what was expected.
        detail: String,
    },
    /// An operating-system I/O error with no better classification.
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
    /// An NCCL or CUDA call failed; the message names the call, the op and the group.
    #[error("{0}")]
    Nccl(String),
}

impl CommError {
    pub(crate) fn config(detail: impl Into<String>) -> Self {
        CommError::Config {
            detail: detail.into(),
        }
    }

    pub(crate) fn mesh(detail: impl Into<String>) -> Self {
        CommError::InvalidMesh {
            detail: detail.into(),
        }
    }
}
