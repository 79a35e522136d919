//! Llama 2 on smp-burn: the model, Hugging Face checkpoints, tokenizer and data, and the trainer
//! behind the `llama2_train` example.

pub mod config;
pub mod convert;
pub mod data;
pub mod error;
pub mod guard;
pub mod hf;
pub mod metrics;
pub mod model;
pub mod parallel;
pub mod plan;
pub mod tokenizer;
pub mod train;

pub use config::LlamaConfig;
pub use error::{LlamaError, Result};
