//! Per-rank inbox that demultiplexes incoming messages by (group, source, tag).

use std::collections::{HashMap, VecDeque};
use std::sync::{Condvar, Mutex};
use std::time::Instant;

/// Why a receive gave up.
#[derive(Debug)]
pub(crate) enum RecvFail {
    /// These global ranks had not delivered by the deadline.
    Timeout(Vec<usize>),
    /// This global rank's connection is closed and it had not delivered.
    Closed(usize, String),
}

type Key = (u64, usize, u64);

#[derive(Default, Debug)]
struct State {
    queues: HashMap<Key, VecDeque<Vec<u8>>>,
    closed: HashMap<usize, String>,
}

/// Messages addressed to one rank, from any group and any peer.
#[derive(Default, Debug)]
pub(crate) struct Mailbox {
    state: Mutex<State>,
    cv: Condvar,
}

impl Mailbox {
    pub(crate) fn push(&self, group: u64, src: usize, tag: u64, payload: Vec<u8>) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.queues
            .entry((group, src, tag))
            .or_default()
            .push_back(payload);
        self.cv.notify_all();
    }

    /// Records that nothing more will come from `src`; waiters on it fail once its queued
    /// messages are used up.
    pub(crate) fn close(&self, src: usize, reason: String) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.closed.entry(src).or_insert(reason);
        self.cv.notify_all();
    }

    /// Waits for one message per source in `srcs` (global ranks), returned in that order.
    ///
    /// On failure the error names every source still missing (timeout) or the first closed
    /// one, so callers can report precisely which peers held the collective up.
    pub(crate) fn recv_many(
        &self,
        group: u64,
        srcs: &[usize],
        tag: u64,
        deadline: Instant,
    ) -> Result<Vec<Vec<u8>>, RecvFail> {
        let mut got: Vec<Option<Vec<u8>>> = vec![None; srcs.len()];
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            for (slot, &src) in got.iter_mut().zip(srcs) {
                if slot.is_none()
                    && let Some(q) = st.queues.get_mut(&(group, src, tag))
                    && let Some(msg) = q.pop_front()
                {
                    if q.is_empty() {
                        st.queues.remove(&(group, src, tag));
                    }
                    *slot = Some(msg);
                }
            }
            let missing: Vec<usize> = got
                .iter()
                .zip(srcs)
                .filter(|(g, _)| g.is_none())
                .map(|(_, &s)| s)
                .collect();
            if missing.is_empty() {
                return Ok(got.into_iter().map(|g| g.unwrap_or_default()).collect());
            }
            if let Some((&src, why)) = missing.iter().find_map(|s| st.closed.get_key_value(s)) {
                return Err(RecvFail::Closed(src, why.clone()));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(RecvFail::Timeout(missing));
            }
            st = self
                .cv
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}
