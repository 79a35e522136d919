//! Panics of third-party parsers turned into errors.
//!
//! Some libraries panic on malformed input instead of returning an error (the `tokenizers`
//! crate does on some damaged `tokenizer.json` files). Loading such a file must end in an error
//! that names it, not a crash; and a program whose panic hook stops the process on any panic
//! (as `llama2_train` does, so that a panicked rank cannot hang its peers) asks [`active`]
//! whether the panic is one of these before stopping.

use std::cell::Cell;
use std::panic::{AssertUnwindSafe, catch_unwind};

thread_local! {
    static DEPTH: Cell<usize> = const { Cell::new(0) };
}

/// Whether the current thread is inside [`catch`]: a panic hook should then stay quiet and
/// let the panic unwind into the error that [`catch`] returns.
pub fn active() -> bool {
    DEPTH.with(Cell::get) > 0
}

/// Runs `f`, returning its panic's message as an error instead of unwinding further.
pub fn catch<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    DEPTH.with(|d| d.set(d.get() + 1));
    let result = catch_unwind(AssertUnwindSafe(f));
    DEPTH.with(|d| d.set(d.get() - 1));
    result.map_err(|payload| {
        payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "a panic without a message".into())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_becomes_an_error_and_the_guard_ends() {
        assert!(!active());
        let e = catch(|| -> u32 { panic!("bad input {}", 7) }).unwrap_err();
        assert_eq!(e, "bad input 7");
        assert!(!active());
        assert_eq!(catch(active), Ok(true));
    }
}
