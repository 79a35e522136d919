//! Every parser of outside input, fed damaged copies of a valid input: nothing may panic, every
//! damaged input is either read or refused with an error.
//!
//! The damage is seeded (the same cases every run): truncations, flipped and inserted bytes,
//! digits replaced by huge or negative numbers, and duplicated or deleted spans: what a
//! truncated copy, a disk error or a hand edit produces. Each target runs a few hundred cases;
//! `SMP_FUZZ_CASES` raises the count for a longer search.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;

use llama::LlamaConfig;
use llama::data::{DataSource, load_texts};
use llama::hf::{CheckpointReader, HostTensor, SaveDType, TensorMap, read_hf_config, save_hf_dir};
use llama::tokenizer::TextTokenizer;

/// xorshift64*: small, seeded, and the same on every platform.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

fn cases() -> usize {
    std::env::var("SMP_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200)
}

/// One damaged copy of `good`.
fn mutate(good: &[u8], rng: &mut Rng) -> Vec<u8> {
    let mut b = good.to_vec();
    for _ in 0..1 + rng.below(3) {
        let at = rng.below(b.len() + 1);
        match rng.below(7) {
            0 => b.truncate(at),
            1 if !b.is_empty() => {
                let i = at.min(b.len() - 1);
                b[i] ^= 1 << rng.below(8);
            }
            2 => {
                let junk: Vec<u8> = (0..1 + rng.below(16)).map(|_| rng.next() as u8).collect();
                b.splice(at..at, junk);
            }
            3 => {
                // A number where a number was: the values that overflow or go negative.
                if let Some(i) = (at..b.len()).find(|&i| b[i].is_ascii_digit()) {
                    let end = (i..b.len())
                        .find(|&j| !b[j].is_ascii_digit())
                        .unwrap_or(b.len());
                    let huge: &[&[u8]] = &[
                        b"0",
                        b"-1",
                        b"18446744073709551616",
                        b"99999999999999999999999",
                        b"1e308",
                        b"4294967296",
                    ];
                    b.splice(i..end, huge[rng.below(huge.len())].iter().copied());
                }
            }
            4 => {
                let end = (at + rng.below(64)).min(b.len());
                b.drain(at..end);
            }
            5 => {
                let end = (at + rng.below(64)).min(b.len());
                let span = b[at..end].to_vec();
                b.splice(at..at, span);
            }
            _ => {
                // The 8-byte little-endian length that opens a safetensors file.
                if b.len() >= 8 {
                    let v = [0u64, 1, 7, u64::MAX, u64::MAX / 2, (b.len() as u64) * 2];
                    b[..8].copy_from_slice(&v[rng.below(v.len())].to_le_bytes());
                }
            }
        }
    }
    b
}

/// Runs `parse` on `cases()` damaged copies of `good` written to `file`; fails on any panic.
fn fuzz(name: &str, good: &[u8], file: &Path, seed: u64, parse: impl Fn(&Path) -> bool) {
    let mut rng = Rng(seed);
    let (mut read, mut refused) = (0, 0);
    for case in 0..cases() {
        let bad = mutate(good, &mut rng);
        std::fs::write(file, &bad).unwrap();
        match catch_unwind(AssertUnwindSafe(|| parse(file))) {
            Ok(true) => read += 1,
            Ok(false) => refused += 1,
            Err(_) => {
                let keep = file.with_extension("panicked");
                std::fs::write(&keep, &bad).unwrap();
                panic!(
                    "{name}: case {case} panicked; the input is kept at {}",
                    keep.display()
                );
            }
        }
    }
    eprintln!("{name}: {read} damaged inputs read, {refused} refused, none panicked");
    assert!(
        refused > 0,
        "{name}: no damaged input was refused: the damage does nothing"
    );
}

fn tiny_checkpoint(dir: &Path) -> LlamaConfig {
    let cfg = LlamaConfig::preset("tiny").unwrap();
    let mut tensors = TensorMap::new();
    let h = cfg.hidden_size;
    tensors.insert(
        "model.norm.weight".into(),
        HostTensor::new(vec![h], vec![1.0; h]).unwrap(),
    );
    tensors.insert(
        "model.embed_tokens.weight".into(),
        HostTensor::new(vec![4, h], (0..4 * h).map(|i| i as f32).collect()).unwrap(),
    );
    save_hf_dir(dir, &cfg, &tensors, SaveDType::BF16, 1 << 30, None).unwrap();
    cfg
}

#[test]
fn hf_config_and_safetensors_headers() {
    let root = tempfile::tempdir().unwrap();
    let good_dir = root.path().join("good");
    tiny_checkpoint(&good_dir);
    let config = std::fs::read(good_dir.join("config.json")).unwrap();
    let weights = std::fs::read(good_dir.join("model.safetensors")).unwrap();

    let dir = root.path().join("bad");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("model.safetensors"), &weights).unwrap();
    fuzz("config.json", &config, &dir.join("config.json"), 1, |p| {
        read_hf_config(p.parent().unwrap()).is_ok()
    });

    std::fs::write(dir.join("config.json"), &config).unwrap();
    fuzz(
        "model.safetensors",
        &weights,
        &dir.join("model.safetensors"),
        2,
        |p| {
            let Ok(reader) = CheckpointReader::open(p.parent().unwrap()) else {
                return false;
            };
            // Every tensor the damaged header lists is read in full and in part.
            reader.shapes().iter().all(|(name, shape)| {
                let n: usize = shape.iter().product();
                reader.read(name, 0..n).is_ok() && reader.read(name, n / 2..n).is_ok()
            })
        },
    );
}

#[test]
fn tokenizer_files() {
    let root = tempfile::tempdir().unwrap();
    let text = "to be or not to be, that is the question: whether 'tis nobler in the mind";
    let tok = TextTokenizer::train_byte_level_bpe([text], 300).unwrap();
    let good = root.path().join("tokenizer.json");
    tok.save(&good).unwrap();
    let bytes = std::fs::read(&good).unwrap();
    fuzz(
        "tokenizer.json",
        &bytes,
        &root.path().join("bad.json"),
        3,
        |p| match TextTokenizer::from_file(p) {
            Ok(t) => t.encode(text).is_ok_and(|ids| t.decode(&ids).is_ok()),
            Err(_) => false,
        },
    );
}

#[test]
fn data_files() {
    let root = tempfile::tempdir().unwrap();
    let jsonl = b"{\"text\": \"first document\"}\n{\"text\": \"second\", \"id\": 7}\n".to_vec();
    fuzz(
        "data .jsonl",
        &jsonl,
        &root.path().join("d.jsonl"),
        4,
        |p| load_texts(&DataSource::Path(p.to_path_buf()), "text").is_ok(),
    );
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    std::io::Write::write_all(&mut gz, b"some text to train on\nand a second line\n").unwrap();
    let gz = gz.finish().unwrap();
    fuzz("data .txt.gz", &gz, &root.path().join("d.txt.gz"), 5, |p| {
        load_texts(&DataSource::Path(p.to_path_buf()), "text").is_ok()
    });
}
