//! The collective algorithms, written once over a point-to-point [`Transport`].
//!
//! Every collective is a direct exchange: each rank sends each peer exactly the bytes that
//! peer needs, so per-rank traffic matches a ring's `(n-1)/n` of the buffer while needing
//! a single round of latency. Messages are tagged with the group id and a per-group
//! sequence number, which lets sub-groups share one transport without coordination.

use std::fmt;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use crate::comm::{CommOptions, Communicator, GroupInfo};
use crate::dtype::{DType, ReduceOp, reduce_into};
use crate::error::{CommError, Result};
use crate::mailbox::{Mailbox, RecvFail};

/// Moves bytes between global ranks.
pub(crate) trait Transport: Send + Sync + fmt::Debug {
    /// This endpoint's global rank.
    fn global_rank(&self) -> usize;
    /// Where messages for this rank land.
    fn mailbox(&self) -> &Mailbox;
    /// Delivers `payload` to `dst`'s mailbox; the error is a human-readable reason the peer
    /// cannot be reached.
    fn send(
        &self,
        dst: usize,
        group: u64,
        tag: u64,
        payload: &[u8],
    ) -> std::result::Result<(), String>;
}

/// FNV-1a: stable across processes, builds and Rust versions, unlike `DefaultHasher`.
fn fnv(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for &b in p.iter().chain(&(p.len() as u64).to_le_bytes()) {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

fn ranks_bytes(r: &[usize]) -> Vec<u8> {
    r.iter().flat_map(|&x| (x as u64).to_le_bytes()).collect()
}

/// A group of ranks communicating over a shared transport.
pub(crate) struct GroupComm {
    transport: Arc<dyn Transport>,
    info: GroupInfo,
    id: u64,
    rank: usize,
    seq: AtomicU64,
    splits: AtomicU64,
    opts: CommOptions,
}

impl fmt::Debug for GroupComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GroupComm")
            .field("group", &self.info)
            .field("rank", &self.rank)
            .field("timeout", &self.opts.timeout)
            .finish()
    }
}

/// One exchange of a collective: its message tag and when to give up.
#[derive(Clone, Copy)]
struct Step {
    op: &'static str,
    tag: u64,
    deadline: Instant,
}

/// Byte ranges of an `elems`-element buffer split as evenly as possible over `n` ranks.
fn chunk_ranges(elems: usize, n: usize, elem_size: usize) -> Vec<Range<usize>> {
    (0..n)
        .map(|i| (i * elems / n) * elem_size..((i + 1) * elems / n) * elem_size)
        .collect()
}

impl GroupComm {
    /// The world group over all `world` global ranks of `transport`.
    pub(crate) fn world(transport: Arc<dyn Transport>, world: usize, opts: CommOptions) -> Self {
        let ranks: Vec<usize> = (0..world).collect();
        let id = fnv(&[b"world", &ranks_bytes(&ranks)]);
        GroupComm {
            rank: transport.global_rank(),
            transport,
            info: GroupInfo {
                name: "world".into(),
                global_ranks: ranks,
            },
            id,
            seq: AtomicU64::new(0),
            splits: AtomicU64::new(0),
            opts,
        }
    }

    fn n(&self) -> usize {
        self.info.global_ranks.len()
    }

    /// Tags distinguish the phases of one collective; 8 phases per sequence number.
    fn next_tag(&self) -> u64 {
        self.seq.fetch_add(1, Ordering::Relaxed) << 3
    }

    fn size_err(&self, op: &str, detail: String) -> CommError {
        CommError::SizeMismatch {
            op: op.into(),
            group: self.info.clone(),
            detail,
        }
    }

    fn arg_err(&self, op: &str, detail: String) -> CommError {
        CommError::InvalidArgument {
            op: op.into(),
            group: self.info.clone(),
            detail,
        }
    }

    fn send_to(&self, op: &str, peer: usize, tag: u64, payload: &[u8]) -> Result<()> {
        let g = self.info.global_ranks[peer];
        self.transport
            .send(g, self.id, tag, payload)
            .map_err(|reason| CommError::PeerClosed {
                op: op.into(),
                group: self.info.clone(),
                peer: g,
                reason,
            })
    }

    /// Receives one message from each group rank in `peers`, checking its length.
    fn recv_from(
        &self,
        op: &str,
        peers: &[usize],
        tag: u64,
        expect_len: impl Fn(usize) -> usize,
        deadline: Instant,
    ) -> Result<Vec<Vec<u8>>> {
        let globals: Vec<usize> = peers.iter().map(|&p| self.info.global_ranks[p]).collect();
        let msgs = self
            .transport
            .mailbox()
            .recv_many(self.id, &globals, tag, deadline)
            .map_err(|f| match f {
                RecvFail::Timeout(waiting_for) => CommError::Timeout {
                    op: op.into(),
                    group: self.info.clone(),
                    waiting_for,
                    after: self.opts.timeout,
                },
                RecvFail::Closed(peer, reason) => CommError::PeerClosed {
                    op: op.into(),
                    group: self.info.clone(),
                    peer,
                    reason,
                },
            })?;
        for (m, &p) in msgs.iter().zip(peers) {
            let want = expect_len(p);
            if m.len() != want {
                return Err(self.size_err(
                    op,
                    format!(
                        "rank {} (group rank {p}) sent {} bytes where this rank (group rank {}) \
                         expected {want}; ranks passed different buffer sizes",
                        self.info.global_ranks[p],
                        m.len(),
                        self.rank
                    ),
                ));
            }
        }
        Ok(msgs)
    }

    fn peers(&self) -> Vec<usize> {
        (0..self.n()).filter(|&p| p != self.rank).collect()
    }

    /// Each rank reduces the chunk it owns (`ranges[rank]`) over every rank's `data`.
    fn reduce_scatter_ranges(
        &self,
        data: &[u8],
        ranges: &[Range<usize>],
        out: &mut [u8],
        dtype: DType,
        rop: ReduceOp,
        step: Step,
    ) -> Result<()> {
        let Step { op, tag, deadline } = step;
        let peers = self.peers();
        for &p in &peers {
            self.send_to(op, p, tag, &data[ranges[p].clone()])?;
        }
        let mine = ranges[self.rank].clone();
        let msgs = self.recv_from(op, &peers, tag, |_| mine.len(), deadline)?;
        let mut msgs = msgs.into_iter();
        let parts: Vec<Vec<u8>> = (0..self.n())
            .map(|p| {
                if p == self.rank {
                    Vec::new()
                } else {
                    msgs.next().unwrap_or_default()
                }
            })
            .collect();
        let refs: Vec<&[u8]> = (0..self.n())
            .map(|p| {
                if p == self.rank {
                    &data[mine.clone()]
                } else {
                    &parts[p][..]
                }
            })
            .collect();
        reduce_into(dtype, rop, out, &refs);
        Ok(())
    }

    /// Every rank contributes `own` (which belongs at `ranges[rank]`) to `out`.
    fn all_gather_ranges(
        &self,
        own: &[u8],
        ranges: &[Range<usize>],
        out: &mut [u8],
        step: Step,
    ) -> Result<()> {
        let Step { op, tag, deadline } = step;
        let peers = self.peers();
        for &p in &peers {
            self.send_to(op, p, tag, own)?;
        }
        let msgs = self.recv_from(op, &peers, tag, |p| ranges[p].len(), deadline)?;
        for (m, &p) in msgs.iter().zip(&peers) {
            out[ranges[p].clone()].copy_from_slice(m);
        }
        out[ranges[self.rank].clone()].copy_from_slice(own);
        Ok(())
    }

    fn check_elems(&self, op: &str, len: usize, dtype: DType) -> Result<usize> {
        let sz = dtype.size_in_bytes();
        if !len.is_multiple_of(sz) {
            return Err(self.size_err(
                op,
                format!("buffer of {len} bytes is not a whole number of {dtype:?} elements ({sz} bytes each)"),
            ));
        }
        Ok(len / sz)
    }
}

impl Communicator for GroupComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.n()
    }

    fn group(&self) -> &GroupInfo {
        &self.info
    }

    fn all_reduce_raw(&self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        const OP: &str = "all_reduce";
        let elems = self.check_elems(OP, buf.len(), dtype)?;
        let deadline = Instant::now() + self.opts.timeout;
        let tag = self.next_tag();
        let ranges = chunk_ranges(elems, self.n(), dtype.size_in_bytes());
        let mut mine = vec![0u8; ranges[self.rank].len()];
        self.reduce_scatter_ranges(
            buf,
            &ranges,
            &mut mine,
            dtype,
            op,
            Step {
                op: OP,
                tag,
                deadline,
            },
        )?;
        let step = Step {
            op: OP,
            tag: tag | 1,
            deadline,
        };
        self.all_gather_ranges(&mine, &ranges, buf, step)
    }

    fn all_gather_raw(&self, send: &[u8], recv: &mut [u8]) -> Result<()> {
        const OP: &str = "all_gather";
        if recv.len() != send.len() * self.n() {
            return Err(self.size_err(
                OP,
                format!(
                    "receive buffer has {} bytes but send buffer of {} bytes x group size {} needs {}",
                    recv.len(),
                    send.len(),
                    self.n(),
                    send.len() * self.n()
                ),
            ));
        }
        let deadline = Instant::now() + self.opts.timeout;
        let tag = self.next_tag();
        let ranges: Vec<_> = (0..self.n())
            .map(|i| i * send.len()..(i + 1) * send.len())
            .collect();
        self.all_gather_ranges(
            send,
            &ranges,
            recv,
            Step {
                op: OP,
                tag,
                deadline,
            },
        )
    }

    fn reduce_scatter_raw(
        &self,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        const OP: &str = "reduce_scatter";
        if send.len() != recv.len() * self.n() {
            return Err(self.size_err(
                OP,
                format!(
                    "send buffer has {} bytes but receive buffer of {} bytes x group size {} needs {}",
                    send.len(),
                    recv.len(),
                    self.n(),
                    recv.len() * self.n()
                ),
            ));
        }
        self.check_elems(OP, recv.len(), dtype)?;
        let deadline = Instant::now() + self.opts.timeout;
        let tag = self.next_tag();
        let ranges: Vec<_> = (0..self.n())
            .map(|i| i * recv.len()..(i + 1) * recv.len())
            .collect();
        self.reduce_scatter_ranges(
            send,
            &ranges,
            recv,
            dtype,
            op,
            Step {
                op: OP,
                tag,
                deadline,
            },
        )
    }

    fn broadcast_raw(&self, buf: &mut [u8], root: usize) -> Result<()> {
        const OP: &str = "broadcast";
        if root >= self.n() {
            return Err(self.arg_err(
                OP,
                format!("root {root} is not a rank of a group of size {}", self.n()),
            ));
        }
        let deadline = Instant::now() + self.opts.timeout;
        let tag = self.next_tag();
        if self.rank == root {
            for p in self.peers() {
                self.send_to(OP, p, tag, buf)?;
            }
        } else {
            let len = buf.len();
            let msg = self.recv_from(OP, &[root], tag, |_| len, deadline)?;
            buf.copy_from_slice(&msg[0]);
        }
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        const OP: &str = "barrier";
        let deadline = Instant::now() + self.opts.timeout;
        let tag = self.next_tag();
        let peers = self.peers();
        for &p in &peers {
            self.send_to(OP, p, tag, &[])?;
        }
        self.recv_from(OP, &peers, tag, |_| 0, deadline)?;
        Ok(())
    }

    fn split(&self, name: &str, members: &[usize]) -> Result<Arc<dyn Communicator>> {
        const OP: &str = "split";
        // Counted before validation so a rejected call still keeps every rank's count equal.
        let k = self.splits.fetch_add(1, Ordering::Relaxed);
        if let Some(&bad) = members.iter().find(|&&m| m >= self.n()) {
            return Err(self.arg_err(
                OP,
                format!(
                    "member {bad} of '{name}' {members:?} is not a rank of a group of size {}",
                    self.n()
                ),
            ));
        }
        let mut sorted = members.to_vec();
        sorted.sort_unstable();
        if sorted.windows(2).any(|w| w[0] == w[1]) {
            return Err(self.arg_err(OP, format!("members of '{name}' {members:?} repeat a rank")));
        }
        let Some(new_rank) = members.iter().position(|&m| m == self.rank) else {
            return Err(self.arg_err(
                OP,
                format!(
                    "calling rank {} is not among the members of '{name}' {members:?}",
                    self.rank
                ),
            ));
        };
        let global: Vec<usize> = members.iter().map(|&m| self.info.global_ranks[m]).collect();
        let id = fnv(&[
            &self.id.to_le_bytes(),
            &k.to_le_bytes(),
            name.as_bytes(),
            &ranks_bytes(&global),
        ]);
        Ok(Arc::new(GroupComm {
            transport: self.transport.clone(),
            info: GroupInfo {
                name: name.into(),
                global_ranks: global,
            },
            id,
            rank: new_rank,
            seq: AtomicU64::new(0),
            splits: AtomicU64::new(0),
            opts: self.opts.clone(),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_uneven_buffers() {
        let r = chunk_ranges(10, 4, 4);
        assert_eq!(r, vec![0..8, 8..20, 20..28, 28..40]);
        let r = chunk_ranges(1, 3, 2);
        assert_eq!(r, vec![0..0, 0..0, 0..2]);
    }
}
