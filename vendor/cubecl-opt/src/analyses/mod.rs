mod base;
pub mod dominance;
pub mod integer_range;
pub mod liveness;
pub mod post_order;
pub mod uniformity;
pub mod writes;

pub use base::*;
