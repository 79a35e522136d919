//! Packed documents: where each document starts in the rows of a micro-batch, so that attention
//! stays inside a document and rotary positions restart at each one.
//!
//! Pretraining packs documents back to back into fixed-length rows. Without a mask, a token
//! attends to the end of the previous, unrelated document, and at long sequence lengths most of
//! attention's work goes there. [`Documents`] describes the packing (`cu_seqlens` in
//! FlashAttention's varlen terms, or the lengths of each row's documents);
//! [`crate::ops::causal_attention_in_documents`] and [`crate::ops::rope_in_documents`] use it,
//! and the engine hands it to every unit in [`crate::engine::Cx::documents`].
//!
//! The attention runs document by document on the same kernels as unpacked attention (on CUDA
//! the flash kernels, on a slice of the row), so its work is the sum of the documents' causal
//! triangles rather than the row's; each document costs its own launches.

use std::ops::Range;

use crate::error::SmpError;

/// The documents packed into each row of a `[batch, seq_len]` micro-batch: every row is cut
/// into consecutive documents that cover it exactly.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Documents {
    seq_len: usize,
    /// Per row, the lengths of its documents in order (each at least 1, summing to `seq_len`).
    rows: Vec<Vec<usize>>,
}

impl Documents {
    /// From the lengths of each row's documents, in order.
    ///
    /// # Errors
    /// No row, `seq_len` 0, an empty document, or a row whose lengths do not sum to `seq_len`
    /// (the message names the row and the values).
    pub fn from_lengths(seq_len: usize, rows: Vec<Vec<usize>>) -> Result<Self, SmpError> {
        if rows.is_empty() || seq_len == 0 {
            return Err(SmpError::Usage(format!(
                "documents of {} rows of {seq_len} tokens: both must be at least 1",
                rows.len()
            )));
        }
        for (r, lengths) in rows.iter().enumerate() {
            if let Some(i) = lengths.iter().position(|&n| n == 0) {
                return Err(SmpError::Usage(format!(
                    "row {r}: document {i} is empty (lengths {lengths:?})"
                )));
            }
            let total: usize = lengths.iter().sum();
            if total != seq_len {
                return Err(SmpError::Usage(format!(
                    "row {r}: document lengths {lengths:?} sum to {total}, not the row's \
                     {seq_len} tokens"
                )));
            }
        }
        Ok(Self { seq_len, rows })
    }

    /// From FlashAttention's `cu_seqlens` over the flattened `[batch * seq_len]` tokens: the
    /// offsets where documents start, from 0 to `batch * seq_len`, increasing. Every row start
    /// must be among them (a document cannot span two rows).
    ///
    /// # Errors
    /// Offsets that do not start at 0, end at `batch * seq_len` or increase strictly, or that
    /// miss a row boundary (named in the message).
    pub fn from_cu_seqlens(
        batch: usize,
        seq_len: usize,
        cu_seqlens: &[usize],
    ) -> Result<Self, SmpError> {
        let total = batch * seq_len;
        if cu_seqlens.first() != Some(&0) || cu_seqlens.last() != Some(&total) {
            return Err(SmpError::Usage(format!(
                "cu_seqlens must run from 0 to batch * seq_len = {batch} * {seq_len} = {total}, \
                 got {:?} .. {:?}",
                cu_seqlens.first(),
                cu_seqlens.last()
            )));
        }
        if let Some(w) = cu_seqlens.windows(2).find(|w| w[1] <= w[0]) {
            return Err(SmpError::Usage(format!(
                "cu_seqlens must increase strictly, got {} then {}",
                w[0], w[1]
            )));
        }
        if seq_len == 0 {
            return Self::from_lengths(seq_len, vec![]);
        }
        let mut rows = vec![Vec::new(); batch];
        for w in cu_seqlens.windows(2) {
            let (start, end) = (w[0], w[1]);
            let row = start / seq_len;
            if (end - 1) / seq_len != row {
                return Err(SmpError::Usage(format!(
                    "cu_seqlens: the document at {start}..{end} crosses the start of row {} \
                     (offset {}); every row start must be a document start",
                    row + 1,
                    (row + 1) * seq_len
                )));
            }
            rows[row].push(end - start);
        }
        Self::from_lengths(seq_len, rows)
    }

    /// Cuts each row of `tokens` (row-major `[batch, seq_len]`) after every `separator`: the
    /// end-of-document token belongs to the document it ends, and the next token starts a new
    /// one. A row's first token starts a document (the tail of one cut by the row start).
    ///
    /// # Errors
    /// `tokens.len()` is not `batch * seq_len`, or either is 0.
    pub fn after_separator(
        tokens: &[i64],
        batch: usize,
        seq_len: usize,
        separator: i64,
    ) -> Result<Self, SmpError> {
        if tokens.len() != batch * seq_len {
            return Err(SmpError::Usage(format!(
                "{} tokens are not [batch, seq] = [{batch}, {seq_len}]",
                tokens.len()
            )));
        }
        if seq_len == 0 {
            return Self::from_lengths(seq_len, vec![]);
        }
        let rows = tokens
            .chunks(seq_len)
            .map(|row| {
                let mut lengths = Vec::new();
                let mut start = 0;
                for (i, &t) in row.iter().enumerate() {
                    if t == separator && i + 1 < seq_len {
                        lengths.push(i + 1 - start);
                        start = i + 1;
                    }
                }
                lengths.push(seq_len - start);
                lengths
            })
            .collect();
        Self::from_lengths(seq_len, rows)
    }

    /// Rows of the micro-batch.
    pub fn batch(&self) -> usize {
        self.rows.len()
    }

    /// Tokens per row.
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    /// Whether some row holds more than one document (otherwise plain causal attention is the
    /// same thing).
    pub fn is_packed(&self) -> bool {
        self.rows.iter().any(|r| r.len() > 1)
    }

    /// The documents of `row`, as position ranges within the row.
    pub fn spans(&self, row: usize) -> impl Iterator<Item = Range<usize>> + '_ {
        self.rows[row].iter().scan(0, |start, &len| {
            let span = *start..*start + len;
            *start += len;
            Some(span)
        })
    }

    /// FlashAttention's `cu_seqlens` over the flattened `[batch * seq_len]` tokens.
    pub fn cu_seqlens(&self) -> Vec<usize> {
        let mut out = vec![0];
        for (r, _) in self.rows.iter().enumerate() {
            out.extend(self.spans(r).map(|s| r * self.seq_len + s.end));
        }
        out
    }

    /// Each token's position within its document, row-major `[batch, seq_len]`.
    pub fn positions(&self) -> Vec<i64> {
        (0..self.rows.len())
            .flat_map(|r| self.spans(r).flat_map(|s| 0..s.len() as i64))
            .collect()
    }

    /// The (query, key) pairs causal attention computes inside the documents, against the
    /// whole rows': the share of attention's work that packing leaves (1 without packing).
    pub fn attention_share(&self) -> f64 {
        let tri = |n: usize| (n * (n + 1) / 2) as f64;
        let inside: f64 = self.rows.iter().flatten().map(|&n| tri(n)).sum();
        inside / (tri(self.seq_len) * self.rows.len() as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn separators_end_their_documents() {
        // Row 0: [5 0 | 7 8 0 | 9], row 1: [0 | 1 2 3 4] (a separator first ends a document
        // of one token); a separator in the last position ends nothing new.
        let tokens = [5, 0, 7, 8, 0, 9, 0, 1, 2, 3, 4, 0];
        let d = Documents::after_separator(&tokens, 2, 6, 0).unwrap();
        assert_eq!(d.spans(0).collect::<Vec<_>>(), vec![0..2, 2..5, 5..6]);
        assert_eq!(d.spans(1).collect::<Vec<_>>(), vec![0..1, 1..6]);
        assert_eq!(d.cu_seqlens(), vec![0, 2, 5, 6, 7, 12]);
        assert_eq!(d.positions(), vec![0, 1, 0, 1, 2, 0, 0, 0, 1, 2, 3, 4]);
        assert!(d.is_packed());
        assert_eq!(
            Documents::from_cu_seqlens(2, 6, &d.cu_seqlens()).unwrap(),
            d
        );
        // Triangles 3 + 6 + 1 and 1 + 15 of 2 * 21.
        assert!((d.attention_share() - 26.0 / 42.0).abs() < 1e-12);
        let one = Documents::after_separator(&[1, 2, 3], 1, 3, 0).unwrap();
        assert!(!one.is_packed());
        assert_eq!(one.attention_share(), 1.0);
    }

    #[test]
    fn bad_packings_name_their_values() {
        let e = Documents::from_lengths(6, vec![vec![2, 3]])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("[2, 3]") && e.contains("sum to 5") && e.contains('6'),
            "{e}"
        );
        let e = Documents::from_lengths(4, vec![vec![4], vec![0, 4]])
            .unwrap_err()
            .to_string();
        assert!(e.contains("row 1") && e.contains("empty"), "{e}");
        let e = Documents::from_cu_seqlens(2, 4, &[0, 3, 6, 8])
            .unwrap_err()
            .to_string();
        assert!(e.contains("3..6") && e.contains("offset 4"), "{e}");
        let e = Documents::from_cu_seqlens(2, 4, &[0, 3, 3, 8])
            .unwrap_err()
            .to_string();
        assert!(e.contains("increase"), "{e}");
        let e = Documents::from_cu_seqlens(2, 4, &[0, 4, 7])
            .unwrap_err()
            .to_string();
        assert!(e.contains("8") && e.contains("Some(7)"), "{e}");
        let e = Documents::after_separator(&[1, 2, 3], 2, 2, 0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("3 tokens") && e.contains("[2, 2]"), "{e}");
    }
}
