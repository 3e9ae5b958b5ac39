//! Sample packing: whole documents placed into rows of up to `seq_len` tokens, so that short
//! instruction and chat examples do not spend most of a padded row's compute on padding.
//!
//! The documents come in the run's sample order ([`SampleOrder`]: one order for every rank, so
//! the packed rows, and each rank's share of them, are the same for any world size). They are
//! drawn `window` at a time and each window is packed on its own by first-fit decreasing
//! (longest first, each into the first row it fits), which keeps rows full without holding
//! more than `window` documents' lengths: the corpus never needs to be in memory for packing.
//! A window's rows are then shuffled (first-fit decreasing opens them longest document first,
//! and a run should not see its long documents before its short ones), from a seed of the
//! window's place in the order. A window holds at most one epoch's worth of documents.
//! A document is never split across rows (a longer one was already truncated or refused when
//! the data was read: `max_seq_len`). The stream's position is the window's start in the
//! sample order and the rows already taken from it, so a resumed run packs the same rows.

use std::collections::VecDeque;

use crate::loader::{Position, SampleOrder};

/// How documents are packed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Packing {
    /// Tokens per row.
    pub seq_len: usize,
    /// Documents packed together (the bound on what packing holds at once).
    pub window: usize,
}

/// Documents per packing window unless set (`data.pack_window`): large enough that first-fit
/// decreasing leaves only the window's last rows part-empty, small enough to cost nothing.
pub const DEFAULT_WINDOW: usize = 1024;

/// First-fit decreasing: the documents of lengths `lengths` (each ≤ `seq_len`) as rows of
/// indices into `lengths`, each row's lengths summing to at most `seq_len`. Deterministic:
/// equal lengths keep their order; rows come in the order they were opened.
pub fn first_fit_decreasing(lengths: &[usize], seq_len: usize) -> Vec<Vec<usize>> {
    let mut by_length: Vec<usize> = (0..lengths.len()).collect();
    by_length.sort_by_key(|&i| std::cmp::Reverse(lengths[i]));
    let (mut rows, mut free): (Vec<Vec<usize>>, Vec<usize>) = (Vec::new(), Vec::new());
    for i in by_length {
        let len = lengths[i];
        assert!(len <= seq_len, "a document of {len} tokens cannot be packed into rows of {seq_len}");
        match free.iter().position(|&f| f >= len) {
            Some(r) => {
                rows[r].push(i);
                free[r] -= len;
            }
            None => {
                rows.push(vec![i]);
                free.push(seq_len - len);
            }
        }
    }
    rows
}

/// The endless stream of packed rows (dataset indices) over a sample order.
#[derive(Debug, Clone)]
pub struct PackedOrder {
    order: SampleOrder,
    /// Token count of every dataset sample.
    lengths: std::sync::Arc<Vec<usize>>,
    packing: Packing,
    /// Where the current window started in the sample order.
    window_start: Position,
    /// The window's rows not taken yet.
    rows: VecDeque<Vec<usize>>,
    /// The window's rows taken so far.
    taken: usize,
}

impl PackedOrder {
    /// The stream over samples of `lengths` drawn by `order` (at a window's start), resumed at
    /// `position` (a position this stream gave: its `packed_rows` rows of that window are
    /// skipped).
    pub fn new(
        order: SampleOrder,
        lengths: std::sync::Arc<Vec<usize>>,
        packing: Packing,
        packed_rows: usize,
    ) -> anyhow::Result<Self> {
        anyhow::ensure!(packing.window >= 1, "data.pack_window must be at least 1");
        let window_start = order.position();
        let mut s = Self { order, lengths, packing, window_start, rows: VecDeque::new(), taken: 0 };
        if packed_rows > 0 {
            s.fill();
            anyhow::ensure!(
                packed_rows < s.rows.len(),
                "the saved data position takes {packed_rows} rows of a packing window that has {} \
                 (another data set, data.max_seq_len or data.pack_window than the run that saved it)",
                s.rows.len()
            );
            s.rows.drain(..packed_rows);
            s.taken = packed_rows;
        }
        Ok(s)
    }

    /// Draws and packs the next window, its rows in a shuffled order.
    fn fill(&mut self) {
        use rand::SeedableRng;
        use rand::seq::SliceRandom;
        self.window_start = self.order.position();
        let n = self.packing.window.min(self.lengths.len());
        let docs: Vec<usize> = (0..n).map(|_| self.order.next_index()).collect();
        let lengths: Vec<usize> = docs.iter().map(|&i| self.lengths[i]).collect();
        let mut rows: Vec<Vec<usize>> = first_fit_decreasing(&lengths, self.packing.seq_len)
            .into_iter()
            .map(|row| row.into_iter().map(|j| docs[j]).collect())
            .collect();
        let Position { epoch, index, .. } = self.window_start;
        let seed = (epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ index as u64).wrapping_add(docs[0] as u64);
        rows.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(seed));
        self.rows = rows.into();
        self.taken = 0;
    }

    /// The next row's dataset indices.
    pub fn next_row(&mut self) -> Vec<usize> {
        if self.rows.is_empty() {
            self.fill();
        }
        self.taken += 1;
        self.rows.pop_front().expect("a window packs at least one row")
    }

    /// Where the stream continues: the window's start and the rows taken from it (or, between
    /// windows, the sample order's position).
    pub fn position(&self) -> Position {
        if self.rows.is_empty() {
            Position { packed_rows: 0, ..self.order.position() }
        } else {
            Position { packed_rows: self.taken, ..self.window_start }
        }
    }
}

/// What packing a data set gives, for `llora data inspect`: rows, and their fill.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PackingStats {
    /// Documents packed.
    pub documents: usize,
    /// Rows they fill.
    pub rows: usize,
    /// Document tokens / (rows × `seq_len`).
    pub efficiency: f64,
}

/// Packs `lengths` in their order, `packing.window` at a time (the evaluation's packing, and the
/// training's for an unshuffled order).
pub fn pack_in_order(lengths: &[usize], packing: Packing) -> Vec<Vec<usize>> {
    let mut rows = Vec::new();
    for (w, window) in lengths.chunks(packing.window.max(1)).enumerate() {
        let base = w * packing.window.max(1);
        rows.extend(
            first_fit_decreasing(window, packing.seq_len)
                .into_iter()
                .map(|row| row.into_iter().map(|j| base + j).collect::<Vec<_>>()),
        );
    }
    rows
}

/// The fill of packing `lengths` in order.
pub fn stats(lengths: &[usize], packing: Packing) -> PackingStats {
    let rows = pack_in_order(lengths, packing).len();
    let tokens: usize = lengths.iter().sum();
    PackingStats { documents: lengths.len(), rows, efficiency: tokens as f64 / (rows.max(1) * packing.seq_len) as f64 }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Hand-worked: lengths 5, 3, 4, 2, 6 into rows of 8: 6 opens row 0 (2 free), 5 row 1
    /// (3 free), 4 row 2 (4 free), 3 fills row 1, 2 fills row 0.
    #[test]
    fn first_fit_decreasing_by_hand() {
        assert_eq!(first_fit_decreasing(&[5, 3, 4, 2, 6], 8), vec![vec![4, 3], vec![0, 1], vec![2]]);
    }

    proptest! {
        /// Every document lands in exactly one row, no row overflows, and no two rows could be
        /// merged into one (first fit leaves at most one row half-empty or less).
        #[test]
        fn rows_hold_every_document_once(lengths in proptest::collection::vec(1usize..=64, 1..200)) {
            let rows = first_fit_decreasing(&lengths, 64);
            let mut seen: Vec<usize> = rows.iter().flatten().copied().collect();
            seen.sort_unstable();
            prop_assert_eq!(seen, (0..lengths.len()).collect::<Vec<_>>());
            let fill: Vec<usize> = rows.iter().map(|r| r.iter().map(|&i| lengths[i]).sum()).collect();
            prop_assert!(fill.iter().all(|&f| f <= 64));
            prop_assert!(fill.iter().filter(|&&f| f <= 32).count() <= 1, "{:?}", fill);
        }

        /// A stream resumed at any position it reported continues with the same rows.
        #[test]
        fn resumed_stream_packs_the_same_rows(seed in any::<u64>(), before in 0usize..60, window in 1usize..20) {
            let lengths = std::sync::Arc::new((0..37).map(|i| 1 + (i * 7919) % 30).collect::<Vec<usize>>());
            let packing = Packing { seq_len: 32, window };
            let start = |p: Position| {
                let order = SampleOrder::new(37, seed, true, Position { packed_rows: 0, ..p }).unwrap();
                PackedOrder::new(order, lengths.clone(), packing, p.packed_rows).unwrap()
            };
            let mut full = start(Position::default());
            for _ in 0..before { full.next_row(); }
            let mut resumed = start(full.position());
            for _ in 0..40 { prop_assert_eq!(full.next_row(), resumed.next_row()); }
        }
    }

    #[test]
    fn stats_count_rows_and_fill() {
        let s = stats(&[5, 3, 4, 2, 6], Packing { seq_len: 8, window: 16 });
        assert_eq!((s.documents, s.rows), (5, 3));
        assert!((s.efficiency - 20.0 / 24.0).abs() < 1e-12);
    }
}
