//! A byte-level BPE tokenizer (GPT-2 style) trained in-process and stored as a Hugging Face
//! `tokenizer.json`.
//!
//! Byte-level means every byte has a token, so any UTF-8 text encodes without `<unk>` and
//! decodes back to exactly the same bytes.

use std::path::Path;

use tokenizers::models::TrainerWrapper;
use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer};

use crate::error::{LlamaError, Result};

/// Special tokens in id order; Llama's ids (`<unk>` 0, `<s>` 1, `</s>` 2) so that exported
/// configs can keep `bos_token_id = 1`, `eos_token_id = 2`.
const SPECIAL_TOKENS: [&str; 3] = ["<unk>", "<s>", "</s>"];
/// Id of `<s>`.
const BOS_ID: u32 = 1;
/// Id of `</s>`.
const EOS_ID: u32 = 2;
/// The 256 byte symbols plus the special tokens: the smallest vocabulary that can still encode
/// every input.
const MIN_VOCAB: usize = 256 + SPECIAL_TOKENS.len();
/// Pieces smaller than this are not worth a separate rayon task.
const CHUNK_BYTES: usize = 16 * 1024;

/// A byte-level BPE tokenizer with Llama's special-token ids.
///
/// [`TextTokenizer::encode`] adds no special tokens: the data pipeline places `</s>` itself
/// between documents, and a saved `tokenizer.json` behaves the same way in Python.
#[derive(Clone)]
pub struct TextTokenizer {
    inner: Tokenizer,
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextTokenizer")
            .field("vocab_size", &self.vocab_size())
            .finish()
    }
}

fn tok_err(context: &str, e: impl std::fmt::Display) -> LlamaError {
    LlamaError::Tokenizer(format!("{context}: {e}"))
}

impl TextTokenizer {
    /// Trains a byte-level BPE vocabulary of exactly `vocab_size` tokens (fewer only if the text
    /// runs out of pairs to merge) on `texts`.
    ///
    /// The whole input is used; the 5 MB Shakespeare corpus trains in a few seconds, so no
    /// sampling is needed. Long texts are cut into pieces at boundaries the pre-tokenizer would
    /// split at anyway, so the word counts (and hence the merges) are those of the whole text
    /// while the counting runs in parallel.
    pub fn train_byte_level_bpe<'a>(
        texts: impl IntoIterator<Item = &'a str>,
        vocab_size: usize,
    ) -> Result<Self> {
        if vocab_size < MIN_VOCAB {
            return Err(LlamaError::Tokenizer(format!(
                "vocab_size {vocab_size} is too small for a byte-level BPE tokenizer: it needs at \
                 least {MIN_VOCAB} (256 bytes + {} special tokens)",
                SPECIAL_TOKENS.len()
            )));
        }
        let mut inner = Tokenizer::new(BPE::default());
        inner.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
        inner.with_decoder(Some(ByteLevel::default()));
        inner.with_post_processor(Some(ByteLevel::new(false, true, true)));

        let specials = SPECIAL_TOKENS
            .iter()
            .map(|t| AddedToken::from(*t, true))
            .collect();
        let trainer = BpeTrainerBuilder::new()
            .vocab_size(vocab_size)
            .min_frequency(0)
            .show_progress(false)
            .special_tokens(specials)
            .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
            .build();
        let mut trainer = TrainerWrapper::BpeTrainer(trainer);

        let pieces: Vec<&str> = texts.into_iter().flat_map(split_at_safe_points).collect();
        if pieces.iter().all(|p| p.is_empty()) {
            return Err(LlamaError::Tokenizer(
                "cannot train a tokenizer on empty text".into(),
            ));
        }
        inner
            .train(&mut trainer, pieces.into_iter())
            .map_err(|e| tok_err("training", e))?;

        let tok = TextTokenizer { inner };
        for (id, t) in SPECIAL_TOKENS.iter().enumerate() {
            if tok.inner.token_to_id(t) != Some(id as u32) {
                return Err(LlamaError::Tokenizer(format!(
                    "special token {t} did not get id {id} after training"
                )));
            }
        }
        Ok(tok)
    }

    /// Loads a `tokenizer.json` (ours or any other Hugging Face fast tokenizer).
    ///
    /// `<s>` and `</s>` must exist in its vocabulary, since the data pipeline and exported
    /// configs rely on them.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        if !path.exists() {
            return Err(LlamaError::io(
                path,
                std::io::Error::new(std::io::ErrorKind::NotFound, "tokenizer file not found"),
            ));
        }
        // The tokenizers crate panics on some damaged files (found by the fuzz tests).
        let inner = crate::guard::catch(|| Tokenizer::from_file(path))
            .map_err(|panic| {
                LlamaError::Tokenizer(format!(
                    "{} is not a valid tokenizer.json: {panic}",
                    path.display()
                ))
            })?
            .map_err(|e| tok_err(&format!("loading {}", path.display()), e))?;
        for t in &SPECIAL_TOKENS[1..] {
            if inner.token_to_id(t).is_none() {
                return Err(LlamaError::Tokenizer(format!(
                    "{} has no {t} token; the Llama pipeline needs <s> and </s>",
                    path.display()
                )));
            }
        }
        Ok(TextTokenizer { inner })
    }

    /// Writes `tokenizer.json`, loadable by `PreTrainedTokenizerFast(tokenizer_file=...)`.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(|e| LlamaError::io(parent, e))?;
        }
        self.inner
            .save(path, false)
            .map_err(|e| tok_err(&format!("saving {}", path.display()), e))
    }

    /// Token ids of `text`, without special tokens.
    ///
    /// Long texts are encoded in parallel pieces cut only where the pre-tokenizer splits too, so
    /// the result is identical to encoding the text in one piece (as Python would).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self.encode_batch(&[text])?.pop().unwrap_or_default())
    }

    /// Token ids of each text, computed in parallel; same result as [`TextTokenizer::encode`]
    /// on each.
    pub fn encode_batch<S: AsRef<str>>(&self, texts: &[S]) -> Result<Vec<Vec<u32>>> {
        let mut pieces = Vec::new();
        let mut counts = Vec::with_capacity(texts.len());
        for t in texts {
            let before = pieces.len();
            pieces.extend(split_at_safe_points(t.as_ref()).filter(|p| !p.is_empty()));
            counts.push(pieces.len() - before);
        }
        let encodings = self
            .inner
            .encode_batch_fast(pieces, false)
            .map_err(|e| tok_err("encoding", e))?;
        let mut encodings = encodings.into_iter();
        Ok(counts
            .into_iter()
            .map(|n| {
                encodings
                    .by_ref()
                    .take(n)
                    .flat_map(|e| e.get_ids().to_vec())
                    .collect()
            })
            .collect())
    }

    /// The text of `ids`; special tokens are kept (as `<s>`, `</s>`) so that document
    /// boundaries stay visible in samples. Bytes that do not form valid UTF-8 (a sampled
    /// sequence can stop mid-character) become U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        let vocab = self.vocab_size();
        if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(LlamaError::Tokenizer(format!(
                "token id {bad} is outside the vocabulary of {vocab} tokens"
            )));
        }
        self.inner
            .decode(ids, false)
            .map_err(|e| tok_err("decoding", e))
    }

    /// Number of tokens, special tokens included (the model's `vocab_size` must be at least this).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Id of `<s>`.
    pub fn bos_id(&self) -> u32 {
        self.inner
            .token_to_id(SPECIAL_TOKENS[BOS_ID as usize])
            .unwrap_or(BOS_ID)
    }

    /// Id of `</s>`.
    pub fn eos_id(&self) -> u32 {
        self.inner
            .token_to_id(SPECIAL_TOKENS[EOS_ID as usize])
            .unwrap_or(EOS_ID)
    }

    /// The wrapped Hugging Face tokenizer, for anything this wrapper does not expose.
    pub fn inner(&self) -> &Tokenizer {
        &self.inner
    }
}

/// Cuts `text` into pieces of roughly [`CHUNK_BYTES`] that pre-tokenize exactly as the whole.
///
/// A cut is made after a `\n` that has a non-whitespace character on both sides. In the GPT-2
/// split pattern, whitespace is only ever matched by the whitespace alternatives, so such a
/// `\n` is a piece of its own in the whole text and also at the end of a piece (its
/// `(?!\S)` look-ahead is the only context-dependent part, and a lone `\n` matches either way);
/// nothing in the pattern looks backwards, so the next piece starts the same as well.
fn split_at_safe_points(text: &str) -> impl Iterator<Item = &str> {
    let mut rest = text;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let bytes = rest.as_bytes();
        let mut cut = rest.len();
        let mut i = CHUNK_BYTES.min(rest.len());
        while i < bytes.len() {
            // Requiring visible ASCII neighbours is stricter than "not whitespace" (it also
            // rules out Unicode spaces) but loses only a few cut points.
            if bytes[i] == b'\n'
                && i > 0
                && i + 1 < bytes.len()
                && bytes[i - 1].is_ascii_graphic()
                && bytes[i + 1].is_ascii_graphic()
            {
                cut = i + 1;
                break;
            }
            i += 1;
        }
        let (piece, tail) = rest.split_at(cut);
        rest = tail;
        Some(piece)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    fn corpus() -> String {
        let gz = include_bytes!("../../../data/shakespeare.txt.gz");
        let mut s = String::new();
        flate2::read::GzDecoder::new(&gz[..])
            .read_to_string(&mut s)
            .unwrap();
        s
    }

    fn small_tokenizer() -> (TextTokenizer, String) {
        let text = corpus();
        let sample = text[..400_000].to_string();
        (
            TextTokenizer::train_byte_level_bpe([sample.as_str()], 600).unwrap(),
            text,
        )
    }

    #[test]
    fn round_trip_and_vocab_size() {
        let (tok, text) = small_tokenizer();
        assert_eq!(tok.vocab_size(), 600);
        assert_eq!(
            (tok.inner.token_to_id("<unk>"), tok.bos_id(), tok.eos_id()),
            (Some(0), 1, 2)
        );
        // Lines from far past the training sample, plus text the sample never saw.
        for line in text[3_000_000..3_020_000]
            .lines()
            .chain(["  naïve — café\t\r\n x", ""])
        {
            let ids = tok.encode(line).unwrap();
            assert_eq!(tok.decode(&ids).unwrap(), line);
        }
        let ids = tok.encode("To be, or not to be").unwrap();
        assert!(ids.len() < 19, "BPE should merge common words: {ids:?}");
    }

    #[test]
    fn chunked_encoding_equals_whole_encoding() {
        let (tok, text) = small_tokenizer();
        let part = &text[1_000_000..1_200_000];
        assert!(split_at_safe_points(part).count() > 5);
        let whole = tok
            .inner
            .encode_fast(part, false)
            .unwrap()
            .get_ids()
            .to_vec();
        assert_eq!(tok.encode(part).unwrap(), whole);
        assert_eq!(tok.decode(&whole).unwrap(), part);
    }

    #[test]
    fn save_load_and_errors() {
        let (tok, _) = small_tokenizer();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/tokenizer.json");
        tok.save(&path).unwrap();
        let back = TextTokenizer::from_file(&path).unwrap();
        let s = "Now is the winter of our discontent";
        assert_eq!(back.encode(s).unwrap(), tok.encode(s).unwrap());
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(json["model"]["type"], "BPE");
        assert_eq!(json["pre_tokenizer"]["type"], "ByteLevel");
        assert_eq!(json["added_tokens"][2]["content"], "</s>");

        let missing = TextTokenizer::from_file(dir.path().join("nope.json")).unwrap_err();
        assert!(missing.to_string().contains("nope.json"), "{missing}");
        assert!(TextTokenizer::train_byte_level_bpe(["abc"], 100).is_err());
        assert!(
            tok.decode(&[5000])
                .unwrap_err()
                .to_string()
                .contains("5000")
        );
    }

    /// Timing of the full-corpus training the example does; `--ignored` because it takes
    /// seconds.
    #[test]
    #[ignore]
    fn full_corpus_timing() {
        let text = corpus();
        let t = std::time::Instant::now();
        let tok = TextTokenizer::train_byte_level_bpe([text.as_str()], 4096).unwrap();
        let train_s = t.elapsed().as_secs_f64();
        let t = std::time::Instant::now();
        let ids = tok.encode(&text).unwrap();
        let enc_s = t.elapsed().as_secs_f64();
        println!(
            "train 4096 on {} bytes: {train_s:.2}s; encode: {enc_s:.2}s, {} tokens",
            text.len(),
            ids.len()
        );
        assert_eq!(tok.decode(&ids).unwrap(), text);
    }
}
