//! The communicator traits and their typed helpers.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::dtype::{DType, Element, ReduceOp};
use crate::error::{CommError, Result};

/// Identity of a communication group, used in error messages and to derive group ids.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct GroupInfo {
    /// Name given at creation (`world`, a mesh axis name, a split name).
    pub name: String,
    /// Global rank of each member, indexed by rank within the group.
    pub global_ranks: Vec<usize>,
}

impl fmt::Display for GroupInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "'{}' (global ranks {:?})", self.name, self.global_ranks)
    }
}

/// Options shared by every communicator of a backend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommOptions {
    /// How long one collective may wait for peers before failing with
    /// [`CommError::Timeout`].
    pub timeout: Duration,
}

impl Default for CommOptions {
    fn default() -> Self {
        CommOptions {
            timeout: Duration::from_secs(300),
        }
    }
}

impl CommOptions {
    /// Defaults, with the timeout taken from `SMP_COMM_TIMEOUT_SECS` when set.
    pub fn from_env() -> Result<Self> {
        let mut opts = CommOptions::default();
        if let Some(t) =
            crate::rendezvous::env_secs(&|k: &str| std::env::var(k).ok(), "SMP_COMM_TIMEOUT_SECS")?
        {
            opts.timeout = t;
        }
        Ok(opts)
    }

    /// These options with another timeout.
    pub fn with_timeout(timeout: Duration) -> Self {
        CommOptions { timeout }
    }
}

/// Object-safe core; byte-level so it works as `Arc<dyn Communicator>`.
///
/// Every method is a collective: all members of the group call it, in the same order, with
/// matching sizes. Results of reductions are bitwise identical on every rank.
pub trait Communicator: Send + Sync + fmt::Debug {
    /// Rank within this group.
    fn rank(&self) -> usize;
    /// Number of members of this group.
    fn world_size(&self) -> usize;
    /// Name and global ranks of this group.
    fn group(&self) -> &GroupInfo;
    /// Reduces `buf` element-wise across the group, in place.
    fn all_reduce_raw(&self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()>;
    /// Gathers every rank's `send` into `recv` (`send.len() * world` bytes, rank-major).
    fn all_gather_raw(&self, send: &[u8], recv: &mut [u8]) -> Result<()>;
    /// Reduces `send` (`recv.len() * world` bytes) across the group; rank `r` gets chunk `r`.
    fn reduce_scatter_raw(
        &self,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()>;
    /// Copies `buf` from group rank `root` to every other rank.
    fn broadcast_raw(&self, buf: &mut [u8], root: usize) -> Result<()>;
    /// Returns once every member has entered the barrier.
    fn barrier(&self) -> Result<()>;
    /// Collective over this group: every member calls it with the same arguments in the same order.
    /// `members` are ranks of THIS group; the caller must be one of them. Returns the sub-group communicator.
    ///
    /// No messages are exchanged: the sub-group's identity is derived from this group, the
    /// number of earlier splits, the name and the members. Ranks may therefore also pass
    /// different member lists (each its own sub-group, as a mesh does) as long as every
    /// member of this group makes the same number of `split` calls in the same order.
    fn split(&self, name: &str, members: &[usize]) -> Result<Arc<dyn Communicator>>;
}

impl<C: Communicator + ?Sized> Communicator for Arc<C> {
    fn rank(&self) -> usize {
        (**self).rank()
    }
    fn world_size(&self) -> usize {
        (**self).world_size()
    }
    fn group(&self) -> &GroupInfo {
        (**self).group()
    }
    fn all_reduce_raw(&self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        (**self).all_reduce_raw(buf, dtype, op)
    }
    fn all_gather_raw(&self, send: &[u8], recv: &mut [u8]) -> Result<()> {
        (**self).all_gather_raw(send, recv)
    }
    fn reduce_scatter_raw(
        &self,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        (**self).reduce_scatter_raw(send, recv, dtype, op)
    }
    fn broadcast_raw(&self, buf: &mut [u8], root: usize) -> Result<()> {
        (**self).broadcast_raw(buf, root)
    }
    fn barrier(&self) -> Result<()> {
        (**self).barrier()
    }
    fn split(&self, name: &str, members: &[usize]) -> Result<Arc<dyn Communicator>> {
        (**self).split(name, members)
    }
}

/// Typed helpers, blanket-implemented for every `Communicator` (and for `Arc<dyn Communicator>` / `dyn Communicator`).
pub trait CommunicatorExt {
    /// Reduces `buf` element-wise across the group, in place.
    fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()>;
    /// Concatenation of every rank's `send`, in rank order (all ranks pass equal lengths).
    fn all_gather<T: Element>(&self, send: &[T]) -> Result<Vec<T>>;
    /// Every rank's `send`, indexed by rank; lengths may differ between ranks.
    fn all_gather_varlen<T: Element>(&self, send: &[T]) -> Result<Vec<Vec<T>>>;
    /// Reduces `send` across the group and returns this rank's `send.len() / world` chunk.
    ///
    /// A length not divisible by the group size is a [`CommError::SizeMismatch`].
    fn reduce_scatter<T: Element>(&self, send: &[T], op: ReduceOp) -> Result<Vec<T>>;
    /// Copies `buf` from group rank `root` to every other rank.
    fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()>;
}

impl<C: Communicator + ?Sized> CommunicatorExt for C {
    fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.all_reduce_raw(bytemuck::cast_slice_mut(buf), T::DTYPE, op)
    }

    fn all_gather<T: Element>(&self, send: &[T]) -> Result<Vec<T>> {
        let mut out = vec![T::zeroed(); send.len() * self.world_size()];
        self.all_gather_raw(
            bytemuck::cast_slice(send),
            bytemuck::cast_slice_mut(&mut out),
        )?;
        Ok(out)
    }

    fn all_gather_varlen<T: Element>(&self, send: &[T]) -> Result<Vec<Vec<T>>> {
        // Two rounds (lengths, then padded data) keep the byte-level core fixed-size.
        let lens = self.all_gather(&[send.len() as i64])?;
        let max = lens.iter().copied().max().unwrap_or(0) as usize;
        let mut padded = send.to_vec();
        padded.resize(max, T::zeroed());
        let all = self.all_gather(&padded)?;
        Ok(lens
            .iter()
            .enumerate()
            .map(|(r, &len)| all[r * max..r * max + len as usize].to_vec())
            .collect())
    }

    fn reduce_scatter<T: Element>(&self, send: &[T], op: ReduceOp) -> Result<Vec<T>> {
        let world = self.world_size();
        if !send.len().is_multiple_of(world) {
            return Err(CommError::SizeMismatch {
                op: "reduce_scatter".into(),
                group: self.group().clone(),
                detail: format!(
                    "input length {} is not divisible by the group size {world}",
                    send.len()
                ),
            });
        }
        let mut out = vec![T::zeroed(); send.len() / world];
        self.reduce_scatter_raw(
            bytemuck::cast_slice(send),
            bytemuck::cast_slice_mut(&mut out),
            T::DTYPE,
            op,
        )?;
        Ok(out)
    }

    fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.broadcast_raw(bytemuck::cast_slice_mut(buf), root)
    }
}
