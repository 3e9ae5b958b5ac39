//! Batches as the trainer consumes them: padded, collated micro-batches of a global batch, made
//! ahead of use by prefetch workers ([`crate::prefetch`]) in a fixed order. A row holds one
//! sample, or with packing several whole ones ([`crate::packing`]).

use std::sync::Arc;

use crate::loader::{Position, SampleOrder};
use crate::packing::{PackedOrder, Packing, pack_in_order};
use crate::prefetch::{Prefetched, prefetch};
use crate::{IGNORE_INDEX, Sample};

/// How rows of a micro-batch are padded (right padding: pad id 0, label −100, so padding takes
/// no loss and, under a causal mask, cannot affect earlier positions).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Padding {
    /// To the longest row of the micro-batch.
    Longest,
    /// Every micro-batch to this length (fixed shapes, e.g. for CUDA graphs).
    MaxLength(usize),
}

/// A padded micro-batch, row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct Collated {
    /// `[batch, seq]` token ids.
    pub input_ids: Vec<i64>,
    /// `[batch, seq]` labels.
    pub labels: Vec<i64>,
    /// Rows.
    pub batch: usize,
    /// Columns after padding.
    pub seq: usize,
    /// Packed rows: the lengths of each row's samples (documents), in order; `None`: one
    /// sample per row.
    pub docs: Option<Vec<Vec<usize>>>,
    /// Preference pairs' precomputed reference loss sums, a row each
    /// ([`crate::preference::Pair::reference`]); `None`: none.
    pub reference: Option<Vec<f64>>,
}

/// Pads and stacks `samples` into one micro-batch, a sample a row.
pub fn collate(samples: &[&Sample], padding: Padding) -> Collated {
    let rows: Vec<Vec<&Sample>> = samples.iter().map(|s| vec![*s]).collect();
    collate_rows(&rows, padding, false)
}

/// Pads and stacks rows of samples into one micro-batch: each row's samples back to back, as
/// they are (a sample's first label never counts: the model's shift skips it, and a packed
/// document's first token is not predicted from the one before it); `packed` records where
/// they lie.
pub fn collate_rows(rows: &[Vec<&Sample>], padding: Padding, packed: bool) -> Collated {
    let len = |row: &Vec<&Sample>| row.iter().map(|x| x.input_ids.len()).sum::<usize>();
    let longest = rows.iter().map(len).max().unwrap_or(1);
    let seq = match padding {
        Padding::Longest => longest,
        Padding::MaxLength(n) => n.max(longest),
    };
    let mut input_ids = Vec::with_capacity(rows.len() * seq);
    let mut labels = Vec::with_capacity(rows.len() * seq);
    for row in rows {
        for x in row {
            input_ids.extend(x.input_ids.iter().map(|&t| t as i64));
            labels.extend(&x.labels);
        }
        input_ids.extend(std::iter::repeat_n(0i64, seq - len(row)));
        labels.extend(std::iter::repeat_n(IGNORE_INDEX, seq - len(row)));
    }
    let docs = packed.then(|| rows.iter().map(|row| row.iter().map(|x| x.input_ids.len()).collect()).collect());
    Collated { input_ids, labels, batch: rows.len(), seq, docs, reference: None }
}

/// The order rows are drawn in: a sample a row, or packed rows.
#[derive(Debug, Clone)]
pub enum RowOrder {
    /// One sample per row, in the sample order.
    Samples(SampleOrder),
    /// Whole samples packed into rows ([`PackedOrder`]).
    Packed(PackedOrder),
}

impl RowOrder {
    /// The next row's dataset indices.
    pub fn next_row(&mut self) -> Vec<usize> {
        match self {
            Self::Samples(o) => vec![o.next_index()],
            Self::Packed(o) => o.next_row(),
        }
    }

    /// Where the order continues (saved in checkpoints).
    pub fn position(&self) -> Position {
        match self {
            Self::Samples(o) => o.position(),
            Self::Packed(o) => o.position(),
        }
    }

    /// Whether rows are packed.
    pub fn is_packed(&self) -> bool {
        matches!(self, Self::Packed(_))
    }
}

/// One optimizer step's data, as one data-parallel rank sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct StepBatch {
    /// This rank's micro-batches of the global batch.
    pub micro_batches: Vec<Collated>,
    /// Index of this rank's first micro-batch within the global batch.
    pub first_micro: usize,
    /// Target tokens of the whole global batch (the loss normaliser).
    pub target_tokens: usize,
    /// Length of each sample of the global batch (each document of packed rows), in row order.
    pub lengths: Vec<usize>,
    /// Where the order continues after this batch (saved in checkpoints).
    pub position_after: Position,
}

/// How a global batch is cut: `global` rows in micro-batches of `micro`; rank `rank` of
/// `world` takes the `global / (micro · world)` consecutive micro-batches starting at
/// `rank · global / (micro · world)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    /// Rows per optimizer step over all ranks.
    pub global: usize,
    /// Rows per micro-batch.
    pub micro: usize,
    /// This rank.
    pub rank: usize,
    /// Data-parallel ranks.
    pub world: usize,
}

impl Geometry {
    /// Micro-batches per step on each rank (gradient accumulation steps).
    pub fn accumulation(&self) -> usize {
        self.global / (self.micro.max(1) * self.world.max(1))
    }
}

/// The endless stream of global batches drawn by `order` (one order for every rank, so a run is
/// the same for any world size), prepared by `workers` threads; each batch holds this rank's
/// micro-batches and the whole batch's token counts, which need no communication.
pub fn train_batches(
    data: Arc<Vec<Sample>>,
    mut order: RowOrder,
    geometry: Geometry,
    padding: Padding,
    workers: usize,
) -> Prefetched<StepBatch> {
    let packed = order.is_packed();
    let jobs = std::iter::from_fn(move || {
        let rows: Vec<Vec<usize>> = (0..geometry.global).map(|_| order.next_row()).collect();
        Some((rows, order.position()))
    });
    let accum = geometry.accumulation();
    let first_micro = geometry.rank * accum;
    prefetch(jobs, workers, 2, move |(indices, position_after): (Vec<Vec<usize>>, Position)| {
        let rows: Vec<Vec<&Sample>> = indices.iter().map(|row| row.iter().map(|&i| &data[i]).collect()).collect();
        let samples = || rows.iter().flatten();
        StepBatch {
            micro_batches: rows
                .chunks(geometry.micro.max(1))
                .skip(first_micro)
                .take(accum)
                .map(|m| collate_rows(m, padding, packed))
                .collect(),
            first_micro,
            target_tokens: samples().map(|s| s.target_tokens()).sum(),
            lengths: samples().map(|s| s.input_ids.len()).collect(),
            position_after,
        }
    })
}

/// The evaluation set's rows, in order: a sample each, or packed `packing.window` samples at a
/// time.
pub fn eval_rows(data: &[Sample], packing: Option<Packing>) -> Vec<Vec<usize>> {
    match packing {
        None => (0..data.len()).map(|i| vec![i]).collect(),
        Some(p) => pack_in_order(&data.iter().map(|s| s.input_ids.len()).collect::<Vec<_>>(), p),
    }
}

/// Rank `rank` of `world`'s share of the evaluation set's `rows` ([`eval_rows`]): they are cut
/// in order into batches of `batch` rows (as one process would) and batch j goes to rank j mod
/// world, so every sample is evaluated once, in the same batch, whatever the world size.
/// Prepared by `workers` threads.
pub fn eval_batches(
    data: Arc<Vec<Sample>>,
    rows: Arc<Vec<Vec<usize>>>,
    batch: usize,
    (rank, world): (usize, usize),
    (padding, packed): (Padding, bool),
    workers: usize,
) -> Prefetched<Collated> {
    let batch = batch.max(1);
    let starts = (0..rows.len()).step_by(batch).skip(rank).step_by(world.max(1));
    prefetch(starts, workers, 2, move |start: usize| {
        let take: Vec<Vec<&Sample>> = rows[start..(start + batch).min(rows.len())]
            .iter()
            .map(|row| row.iter().map(|&i| &data[i]).collect())
            .collect();
        collate_rows(&take, padding, packed)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(ids: &[u32], labels: &[i64]) -> Sample {
        Sample { input_ids: ids.to_vec(), labels: labels.to_vec() }
    }

    #[test]
    fn pads_right_with_ignored_labels() {
        let (a, b) = (s(&[1, 5, 6], &[-100, 5, 6]), s(&[1, 7], &[-100, 7]));
        let c = collate(&[&a, &b], Padding::Longest);
        assert_eq!((c.batch, c.seq), (2, 3));
        assert_eq!(c.input_ids, vec![1, 5, 6, 1, 7, 0]);
        assert_eq!(c.labels, vec![-100, 5, 6, -100, 7, -100]);
        let c = collate(&[&b], Padding::MaxLength(4));
        assert_eq!(c.input_ids, vec![1, 7, 0, 0]);
        assert_eq!(c.labels, vec![-100, 7, -100, -100]);
    }

    /// Workers change nothing: the batches (and positions) equal the inline stream's.
    #[test]
    fn train_stream_is_the_same_with_any_workers() {
        let data: Arc<Vec<Sample>> =
            Arc::new((0..37u32).map(|i| s(&[1, i + 2, i + 3], &[-100, (i + 2) as i64, -100])).collect());
        let take = |workers| {
            let order = SampleOrder::new(data.len(), 9, true, Position::default()).unwrap();
            let geometry = Geometry { global: 8, micro: 2, rank: 0, world: 1 };
            train_batches(data.clone(), RowOrder::Samples(order), geometry, Padding::Longest, workers)
                .take(12)
                .collect::<Vec<_>>()
        };
        let inline = take(0);
        assert_eq!(inline[0].micro_batches.len(), 4);
        assert_eq!(inline[0].target_tokens, 8);
        assert_eq!(inline[11].position_after, Position { epoch: 2, index: 22, packed_rows: 0 });
        for w in [1, 2, 4] {
            assert_eq!(take(w), inline, "{w} workers");
        }
        let rows = Arc::new(eval_rows(&data, None));
        let evals: Vec<Collated> = eval_batches(data.clone(), rows, 8, (0, 1), (Padding::Longest, false), 3).collect();
        assert_eq!(evals.len(), 5);
        assert_eq!(evals[4].batch, 5);
    }

    /// Two ranks' shares of a step are the single process's micro-batches, split in order, with
    /// the same token counts; two ranks' eval shares are its eval batches, interleaved.
    #[test]
    fn ranks_split_the_single_process_batches() {
        let data: Arc<Vec<Sample>> =
            Arc::new((0..37u32).map(|i| s(&[1, i + 2, i + 3], &[-100, (i + 2) as i64, (i % 3) as i64 - 1])).collect());
        let stream = |rank, world| {
            let order = SampleOrder::new(data.len(), 4, true, Position::default()).unwrap();
            let geometry = Geometry { global: 8, micro: 2, rank, world };
            train_batches(data.clone(), RowOrder::Samples(order), geometry, Padding::Longest, 1)
                .take(6)
                .collect::<Vec<_>>()
        };
        let (one, r0, r1) = (stream(0, 1), stream(0, 2), stream(1, 2));
        for ((a, b), c) in one.iter().zip(&r0).zip(&r1) {
            assert_eq!((b.first_micro, c.first_micro), (0, 2));
            assert_eq!([&b.micro_batches[..], &c.micro_batches[..]].concat(), a.micro_batches);
            assert_eq!(
                (b.target_tokens, &b.lengths, b.position_after),
                (a.target_tokens, &a.lengths, a.position_after)
            );
            assert_eq!((c.target_tokens, c.position_after), (a.target_tokens, a.position_after));
        }
        let rows = Arc::new(eval_rows(&data, None));
        let eval = |share, workers| {
            eval_batches(data.clone(), rows.clone(), 3, share, (Padding::Longest, false), workers).collect::<Vec<_>>()
        };
        let (all, e0, e1) = (eval((0, 1), 0), eval((0, 2), 0), eval((1, 2), 2));
        assert_eq!((all.len(), e0.len(), e1.len()), (13, 7, 6));
        for (j, b) in all.iter().enumerate() {
            assert_eq!(b, if j % 2 == 0 { &e0[j / 2] } else { &e1[j / 2] }, "eval batch {j}");
        }
    }

    /// Packed rows: samples back to back with their lengths recorded, padding after the last;
    /// two ranks' shares of packed steps are the single process's, split in order, and each
    /// step counts its documents and their target tokens.
    #[test]
    fn packed_rows_hold_whole_samples_and_split_like_plain_ones() {
        let (a, b) = (s(&[1, 5, 6], &[-100, 5, 6]), s(&[1, 7], &[-100, 7]));
        let c = collate_rows(&[vec![&a, &b], vec![&b]], Padding::Longest, true);
        assert_eq!((c.batch, c.seq), (2, 5));
        assert_eq!(c.input_ids, vec![1, 5, 6, 1, 7, 1, 7, 0, 0, 0]);
        assert_eq!(c.labels, vec![-100, 5, 6, -100, 7, -100, 7, -100, -100, -100]);
        assert_eq!(c.docs, Some(vec![vec![3, 2], vec![2]]));
        let data: Arc<Vec<Sample>> = Arc::new(
            (0..37u32).map(|i| s(&vec![1; 2 + (i as usize * 7) % 11], &vec![3; 2 + (i as usize * 7) % 11])).collect(),
        );
        let lengths = Arc::new(data.iter().map(|x| x.input_ids.len()).collect::<Vec<_>>());
        let stream = |rank, world| {
            let order = SampleOrder::new(data.len(), 4, true, Position::default()).unwrap();
            let packed = PackedOrder::new(order, lengths.clone(), Packing { seq_len: 16, window: 10 }, 0).unwrap();
            let geometry = Geometry { global: 4, micro: 1, rank, world };
            train_batches(data.clone(), RowOrder::Packed(packed), geometry, Padding::MaxLength(16), 1)
                .take(8)
                .collect::<Vec<_>>()
        };
        let (one, r0, r1) = (stream(0, 1), stream(0, 2), stream(1, 2));
        for ((a, b), c) in one.iter().zip(&r0).zip(&r1) {
            assert_eq!([&b.micro_batches[..], &c.micro_batches[..]].concat(), a.micro_batches);
            assert_eq!(
                (b.target_tokens, &b.lengths, b.position_after),
                (a.target_tokens, &a.lengths, a.position_after)
            );
            let docs: Vec<usize> = a.micro_batches.iter().flat_map(|m| m.docs.clone().unwrap()).flatten().collect();
            assert_eq!(docs, a.lengths);
            assert_eq!(
                a.target_tokens,
                docs.iter().map(|n| n - 1).sum::<usize>(),
                "every label after the first counts"
            );
            assert!(a.micro_batches.iter().all(|m| m.seq == 16));
        }
    }
}
