//! Moving a value between two generic types that a `TypeId` comparison proved identical: how
//! the model-generic ops reach the CUDA fast paths without a backend-extension trait bound
//! (Rust has no specialization).

use std::any::Any;

/// Moves a value to another type that the caller proved identical with `TypeId`.
pub(crate) fn same<T: 'static, U: 'static>(t: T) -> U {
    *(Box::new(t) as Box<dyn Any>)
        .downcast::<U>()
        .unwrap_or_else(|_| unreachable!("TypeId checked by the caller"))
}
