//! Selective activation recomputation: a layer that recomputes its forward in the backward
//! keeps what its attention computed in the forward (the output and, on the flash path, the
//! per-row log-sum-exp the flash backward needs), so the recomputation runs everything but
//! attention's forward: the linear layers, norms, RoPE and the MLP.
//!
//! At long sequences attention's forward is the costliest part of a layer (at S=32,768 with
//! Llama 2 7B's widths about 40 % of its forward FLOPs) and the cheapest to keep: one
//! `seq x hidden` tensor plus `heads x seq` f32 statistics per layer, the size of the input a
//! recomputed layer keeps anyway. This is the reverse of Megatron's `selective` granularity,
//! which keeps the linear layers' outputs and recomputes attention's core: with flash
//! attention nothing of size `seq x seq` is kept, so the attention output is the one
//! activation worth keeping.
//!
//! The engine wraps a recomputed layer's forward in [`record`] and its recomputation in
//! [`replay`]; [`crate::ops::causal_attention`] keeps its result while recording and takes it
//! back, in the same order, while replaying. The flash path then builds its backward from the
//! kept output and statistics; the reference path (CPU, or where the flash kernels do not run)
//! recomputes attention to differentiate it and takes the kept output as the value, so the
//! pairing is exercised there too but only the flash path saves time.

use std::any::Any;
use std::cell::RefCell;
use std::collections::VecDeque;

use crate::error::SmpError;

/// What the attention calls of one layer's forward kept, in call order.
#[derive(Default)]
pub struct AttentionStash {
    entries: VecDeque<Box<dyn Any>>,
}

impl std::fmt::Debug for AttentionStash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AttentionStash")
            .field("entries", &self.entries.len())
            .finish()
    }
}

impl AttentionStash {
    /// How many attention results it holds.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

enum Mode {
    Record(AttentionStash),
    Replay {
        stash: AttentionStash,
        /// An attention call found no kept entry of its type (the forward differed).
        missed: usize,
    },
}

thread_local! {
    // A thread per rank: each rank's engine records and replays its own layers.
    static MODE: RefCell<Option<Mode>> = const { RefCell::new(None) };
}

/// Leaves record or replay mode however the closure ends (a panic included).
struct Reset;

impl Drop for Reset {
    fn drop(&mut self) {
        MODE.with(|m| m.borrow_mut().take());
    }
}

/// Runs `forward` (a recomputed layer's forward without a graph) keeping what its attention
/// calls compute.
pub fn record<R>(forward: impl FnOnce() -> R) -> (R, AttentionStash) {
    MODE.with(|m| *m.borrow_mut() = Some(Mode::Record(AttentionStash::default())));
    let reset = Reset;
    let out = forward();
    let stash = match MODE.with(|m| m.borrow_mut().take()) {
        Some(Mode::Record(stash)) => stash,
        _ => AttentionStash::default(),
    };
    drop(reset);
    (out, stash)
}

/// Runs `forward` (the same layer's recomputation with a graph), its attention calls taking
/// back what [`record`] kept.
///
/// # Errors
/// When the recomputation's attention calls do not match the recorded ones (a call found
/// nothing kept, or kept results were left over): the layer's forward is not the same
/// sequence of attention calls twice, which selective recomputation needs.
pub fn replay<R>(
    stash: AttentionStash,
    layer: usize,
    forward: impl FnOnce() -> R,
) -> Result<R, SmpError> {
    let kept = stash.len();
    MODE.with(|m| *m.borrow_mut() = Some(Mode::Replay { stash, missed: 0 }));
    let reset = Reset;
    let out = forward();
    let (left, missed) = match MODE.with(|m| m.borrow_mut().take()) {
        Some(Mode::Replay { stash, missed }) => (stash.len(), missed),
        _ => (0, 0),
    };
    drop(reset);
    if left > 0 || missed > 0 {
        return Err(SmpError::Usage(format!(
            "selective recomputation: layer {layer}'s forward kept {kept} attention results, \
             its recomputation used {} and found none for {missed} more calls; the layer must \
             call attention the same way in both (turn selective recomputation off otherwise)",
            kept - left
        )));
    }
    Ok(out)
}

/// Whether attention calls on this thread should [`keep`] their results.
pub(crate) fn recording() -> bool {
    MODE.with(|m| matches!(*m.borrow(), Some(Mode::Record(_))))
}

/// Keeps an attention result while recording (nothing otherwise).
pub(crate) fn keep<T: 'static>(entry: T) {
    MODE.with(|m| {
        if let Some(Mode::Record(stash)) = &mut *m.borrow_mut() {
            stash.entries.push_back(Box::new(entry));
        }
    });
}

/// The next kept attention result while replaying; `None` when not replaying, or (counted as
/// a mismatch that [`replay`] reports) when the next entry is missing or of another type.
pub(crate) fn take<T: 'static>() -> Option<T> {
    MODE.with(|m| match &mut *m.borrow_mut() {
        Some(Mode::Replay { stash, missed }) => {
            match stash.entries.pop_front().map(|e| e.downcast::<T>()) {
                Some(Ok(entry)) => Some(*entry),
                _ => {
                    *missed += 1;
                    None
                }
            }
        }
        _ => None,
    })
}

/// Counts an attention call whose kept result did not fit it (another shape) while replaying.
pub(crate) fn mismatch() {
    MODE.with(|m| {
        if let Some(Mode::Replay { missed, .. }) = &mut *m.borrow_mut() {
            *missed += 1;
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replays_in_order_and_reports_mismatches() {
        let ((), stash) = record(|| {
            assert!(recording());
            keep(1u32);
            keep(2u32);
        });
        assert!(!recording());
        assert_eq!(stash.len(), 2);
        let got = replay(stash, 0, || (take::<u32>(), take::<u32>())).unwrap();
        assert_eq!(got, (Some(1), Some(2)));
        // Outside replay nothing is taken and nothing counts.
        assert_eq!(take::<u32>(), None);

        let ((), stash) = record(|| keep(1u32));
        let e = replay(stash, 3, take::<u64>).unwrap_err().to_string();
        assert!(e.contains("layer 3") && e.contains("1 more"), "{e}");
        let ((), stash) = record(|| keep(1u32));
        let e = replay(stash, 4, || ()).unwrap_err().to_string();
        assert!(e.contains("kept 1") && e.contains("used 0"), "{e}");
    }
}
