//! Packed rows: several documents in one row of a batch, each attending only to itself
//! (block-diagonal causal attention), its RoPE positions restarting at 0, and its loss its own.
//!
//! A row holds its documents back to back from position 0; what follows the last one is
//! padding. The model reads where each document lies from [`PackedRows`]: attention runs once
//! per document span (`attention::packed_causal_attention`: the work of the documents' own
//! lengths, `Σ sᵢ²`, and no `seq × seq` mask), RoPE takes each token's position within its
//! document ([`PackedRows::positions`]), and a position whose next token starts another
//! document predicts nothing (`loss::target_rows_loss`), so that every document's loss and
//! gradients are those it has alone.

/// Where the documents of each row of a packed batch lie.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackedRows {
    /// Per row, the lengths of its documents in order (each ≥ 1, summing to ≤ `seq`).
    docs: Vec<Vec<usize>>,
    /// Tokens per row (the batch's padded length).
    seq: usize,
}

impl PackedRows {
    /// The layout of `docs.len()` rows of `seq` tokens; refused when a row's documents do not
    /// fit it or a document is empty.
    pub fn new(docs: Vec<Vec<usize>>, seq: usize) -> anyhow::Result<Self> {
        for (r, row) in docs.iter().enumerate() {
            let used: usize = row.iter().sum();
            anyhow::ensure!(used <= seq, "packed row {r}: documents of {used} tokens in a row of {seq}");
            anyhow::ensure!(!row.contains(&0), "packed row {r}: an empty document");
        }
        Ok(Self { docs, seq })
    }

    /// Rows.
    pub fn rows(&self) -> usize {
        self.docs.len()
    }

    /// Tokens per row.
    pub fn seq(&self) -> usize {
        self.seq
    }

    /// The documents' lengths, per row.
    pub fn docs(&self) -> &[Vec<usize>] {
        &self.docs
    }

    /// Documents in the batch.
    pub fn num_docs(&self) -> usize {
        self.docs.iter().map(Vec::len).sum()
    }

    /// `(start, len)` spans that cover row `row`: its documents, then its padding as one more
    /// span (attended within itself only, so it reaches no document).
    pub fn spans(&self, row: usize) -> Vec<(usize, usize)> {
        let mut out = Vec::with_capacity(self.docs[row].len() + 1);
        let mut start = 0;
        for &len in &self.docs[row] {
            out.push((start, len));
            start += len;
        }
        if start < self.seq {
            out.push((start, self.seq - start));
        }
        out
    }

    /// Each token's RoPE position, row-major `[rows, seq]`: 0, 1, ... within each span.
    pub fn positions(&self) -> Vec<i64> {
        let mut out = Vec::with_capacity(self.rows() * self.seq);
        for r in 0..self.rows() {
            for (_, len) in self.spans(r) {
                out.extend(0..len as i64);
            }
        }
        out
    }

    /// The document (numbered over the batch, row by row) of each token, row-major
    /// `[rows, seq]`; `None` for padding.
    pub fn owners(&self) -> Vec<Option<usize>> {
        let mut out = Vec::with_capacity(self.rows() * self.seq);
        let mut doc = 0;
        for row in &self.docs {
            for &len in row {
                out.extend(std::iter::repeat_n(Some(doc), len));
                doc += 1;
            }
            out.extend(std::iter::repeat_n(None, self.seq - row.iter().sum::<usize>()));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Hand-derived: two rows of 6, documents [2, 3] and [6].
    #[test]
    fn spans_positions_and_owners_follow_the_documents() {
        let p = PackedRows::new(vec![vec![2, 3], vec![6]], 6).unwrap();
        assert_eq!(p.spans(0), [(0, 2), (2, 3), (5, 1)]);
        assert_eq!(p.spans(1), [(0, 6)]);
        assert_eq!(p.positions(), [0, 1, 0, 1, 2, 0, 0, 1, 2, 3, 4, 5]);
        let (a, b, c) = (Some(0), Some(1), Some(2));
        assert_eq!(p.owners(), [a, a, b, b, b, None, c, c, c, c, c, c]);
        assert_eq!(p.num_docs(), 3);
        assert!(PackedRows::new(vec![vec![4, 3]], 6).is_err());
        assert!(PackedRows::new(vec![vec![0, 3]], 6).is_err());
    }
}
