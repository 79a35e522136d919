//! The crate's integration tests as one binary (each test binary links the whole crate: one
//! link instead of four on a cold build). Ranks are threads of this process or, in `launcher`,
//! processes started by `smp-run`.

mod bench;
mod collectives;
mod common;
mod launcher;
mod rendezvous;
mod store_fuzz;
