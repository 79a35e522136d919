//! The cross-crate tests as one binary: each test binary links Burn, smp-burn and the Llama
//! crate, so one binary instead of eight saves minutes of linking on a cold build. Run one
//! group with `cargo test --release -p smp-burn-tests --test all <module>::`.

mod checkpoint;
mod e2e;
mod fsdp_parity;
mod fuzz;
mod gpt_parity;
mod launcher_training;
mod mesh8;
mod tp_e2e;
mod tp_parity;
