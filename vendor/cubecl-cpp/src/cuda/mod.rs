pub mod arch;
pub mod convert;
pub mod dialect;
mod extension;
pub mod mma;
pub mod processors;
pub mod ptx;

pub use dialect::*;
use extension::*;
