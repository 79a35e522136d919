//! Parity with Hugging Face `transformers`, checked without Python: the fixtures in
//! `tests/fixtures` were written by transformers 5.17 (`make_hf_fixture.py`, run on the GPU
//! machine).
//!
//! - `hf_tiny`: a checkpoint written by transformers (f32, GQA) with the logits transformers
//!   computed; we import it and must reproduce them.
//! - `ours_tiny`: a checkpoint written by `llama2_train --export-hf` (bf16); transformers loaded
//!   it with `from_pretrained` and computed logits, and tokenized a text with our tokenizer.json.
//!
//! Tolerance: both sides compute in f32 from identical weights; the differences are summation
//! order and transcendental-function rounding, ~1e-6 relative. We accept 1e-4 absolute on
//! logits of magnitude up to ~4.

use std::path::PathBuf;

use burn::backend::{Autodiff, NdArray};
use burn::tensor::{Int, Tensor, TensorData};
use collectives::{CommOptions, ThreadGroup};
use llama::hf;
use llama::parallel::{Build, build};
use llama::tokenizer::TextTokenizer;
use smp_burn::ParallelConfig;
use smp_burn::engine::Init;
use smp_burn::mesh::Mesh;

type B = Autodiff<NdArray<f32>>;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

fn load_json(path: PathBuf) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

/// Our logits `[seq, vocab]` for `tokens` from the checkpoint in `dir`.
fn our_logits(dir: &std::path::Path, tokens: &[i64]) -> Vec<Vec<f32>> {
    let config = hf::read_hf_config(dir).unwrap();
    let weights = hf::load_safetensors_dir(dir).unwrap();
    hf::check_tensors(&llama::model::parameter_shapes(&config), &weights, dir).unwrap();
    let comm = ThreadGroup::new(1, CommOptions::default()).remove(0);
    let mesh = Mesh::over_host(comm, &ParallelConfig::default()).unwrap();
    let device = Default::default();
    let init = Init::source(|info, range| Ok(weights[info.name].data[range].to_vec()));
    let how = Build {
        init,
        adamw: Default::default(),
        max_grad_norm: None,
    };
    let mut model = build::<B>(&config, &mesh, &device, how).unwrap();
    let input = Tensor::<B, 2, Int>::from_data(
        TensorData::new(tokens.to_vec(), [1, tokens.len()]),
        &device,
    );
    let logits = model.logits(input).unwrap();
    let vocab = config.vocab_size;
    let flat: Vec<f32> = logits.into_data().to_vec().unwrap();
    flat.chunks(vocab).map(|c| c.to_vec()).collect()
}

fn compare(ours: &[Vec<f32>], theirs: &serde_json::Value, what: &str) -> f64 {
    let theirs: Vec<Vec<f64>> = serde_json::from_value(theirs.clone()).unwrap();
    assert_eq!(ours.len(), theirs.len(), "{what}: sequence length");
    let mut max = 0f64;
    for (a, b) in ours.iter().zip(&theirs) {
        assert_eq!(a.len(), b.len(), "{what}: vocabulary");
        for (x, y) in a.iter().zip(b) {
            max = max.max((*x as f64 - y).abs());
        }
    }
    assert!(max < 1e-4, "{what}: max |ours - transformers| = {max:.3e}");
    max
}

#[test]
fn imports_a_transformers_checkpoint_with_the_same_logits() {
    let dir = fixture("hf_tiny");
    let expected = load_json(dir.join("expected_logits.json"));
    let tokens: Vec<i64> = serde_json::from_value(expected["tokens"].clone()).unwrap();
    let diff = compare(&our_logits(&dir, &tokens), &expected["logits"], "hf_tiny");
    println!("hf_tiny: max abs logit difference {diff:.2e}");
}

#[test]
fn transformers_reads_our_export_with_the_same_logits_and_tokens() {
    let dir = fixture("ours_tiny");
    let expected = load_json(fixture("ours_tiny_logits.json"));
    let tokens: Vec<i64> = serde_json::from_value(expected["tokens"].clone()).unwrap();
    let diff = compare(&our_logits(&dir, &tokens), &expected["logits"], "ours_tiny");
    println!("ours_tiny: max abs logit difference {diff:.2e}");
    let tok = TextTokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    let text = expected["text"].as_str().unwrap();
    let ids: Vec<u32> = serde_json::from_value(expected["text_ids"].clone()).unwrap();
    assert_eq!(
        tok.encode(text).unwrap(),
        ids,
        "transformers' tokenizer disagrees with ours"
    );
}
