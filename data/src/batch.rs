//! Batches as the trainer consumes them: padded, collated micro-batches of a global batch, made
//! ahead of use by prefetch workers ([`crate::prefetch`]) in a fixed order.

use std::sync::Arc;

use crate::loader::{Position, SampleOrder};
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
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Collated {
    /// `[batch, seq]` token ids.
    pub input_ids: Vec<i64>,
    /// `[batch, seq]` labels.
    pub labels: Vec<i64>,
    /// Rows.
    pub batch: usize,
    /// Columns after padding.
    pub seq: usize,
}

/// Pads and stacks `samples` into one micro-batch.
pub fn collate(samples: &[&Sample], padding: Padding) -> Collated {
    let longest = samples.iter().map(|x| x.input_ids.len()).max().unwrap_or(1);
    let seq = match padding {
        Padding::Longest => longest,
        Padding::MaxLength(n) => n.max(longest),
    };
    let mut input_ids = Vec::with_capacity(samples.len() * seq);
    let mut labels = Vec::with_capacity(samples.len() * seq);
    for x in samples {
        input_ids.extend(x.input_ids.iter().map(|&t| t as i64));
        input_ids.extend(std::iter::repeat_n(0i64, seq - x.input_ids.len()));
        labels.extend(&x.labels);
        labels.extend(std::iter::repeat_n(IGNORE_INDEX, seq - x.labels.len()));
    }
    Collated { input_ids, labels, batch: samples.len(), seq }
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
    /// Unpadded length of each sequence of the global batch.
    pub lengths: Vec<usize>,
    /// Where the order continues after this batch (saved in checkpoints).
    pub position_after: Position,
}

/// How a global batch is cut: `global` sequences in micro-batches of `micro`; rank `rank` of
/// `world` takes the `global / (micro · world)` consecutive micro-batches starting at
/// `rank · global / (micro · world)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    /// Sequences per optimizer step over all ranks.
    pub global: usize,
    /// Sequences per micro-batch.
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
    mut order: SampleOrder,
    geometry: Geometry,
    padding: Padding,
    workers: usize,
) -> Prefetched<StepBatch> {
    let jobs = std::iter::from_fn(move || {
        let indices: Vec<usize> = (0..geometry.global).map(|_| order.next_index()).collect();
        Some((indices, order.position()))
    });
    let accum = geometry.accumulation();
    let first_micro = geometry.rank * accum;
    prefetch(jobs, workers, 2, move |(indices, position_after): (Vec<usize>, Position)| {
        let rows: Vec<&Sample> = indices.iter().map(|&i| &data[i]).collect();
        StepBatch {
            micro_batches: rows
                .chunks(geometry.micro.max(1))
                .skip(first_micro)
                .take(accum)
                .map(|m| collate(m, padding))
                .collect(),
            first_micro,
            target_tokens: rows.iter().map(|s| s.target_tokens()).sum(),
            lengths: rows.iter().map(|s| s.input_ids.len()).collect(),
            position_after,
        }
    })
}

/// Rank `rank` of `world`'s share of the evaluation set: the set is cut in order into batches of
/// `batch` sequences (as one process would) and batch j goes to rank j mod world, so every
/// sample is evaluated once, in the same batch, whatever the world size. Prepared by `workers`
/// threads.
pub fn eval_batches(
    data: Arc<Vec<Sample>>,
    batch: usize,
    (rank, world): (usize, usize),
    padding: Padding,
    workers: usize,
) -> Prefetched<Collated> {
    let batch = batch.max(1);
    let starts = (0..data.len()).step_by(batch).skip(rank).step_by(world.max(1));
    prefetch(starts, workers, 2, move |start: usize| {
        let rows: Vec<&Sample> = data[start..(start + batch).min(data.len())].iter().collect();
        collate(&rows, padding)
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
            train_batches(data.clone(), order, geometry, Padding::Longest, workers).take(12).collect::<Vec<_>>()
        };
        let inline = take(0);
        assert_eq!(inline[0].micro_batches.len(), 4);
        assert_eq!(inline[0].target_tokens, 8);
        assert_eq!(inline[11].position_after, Position { epoch: 2, index: 22 });
        for w in [1, 2, 4] {
            assert_eq!(take(w), inline, "{w} workers");
        }
        let evals: Vec<Collated> = eval_batches(data.clone(), 8, (0, 1), Padding::Longest, 3).collect();
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
            train_batches(data.clone(), order, geometry, Padding::Longest, 1).take(6).collect::<Vec<_>>()
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
        let all: Vec<Collated> = eval_batches(data.clone(), 3, (0, 1), Padding::Longest, 0).collect();
        let e0: Vec<Collated> = eval_batches(data.clone(), 3, (0, 2), Padding::Longest, 0).collect();
        let e1: Vec<Collated> = eval_batches(data.clone(), 3, (1, 2), Padding::Longest, 2).collect();
        assert_eq!((all.len(), e0.len(), e1.len()), (13, 7, 6));
        for (j, b) in all.iter().enumerate() {
            assert_eq!(b, if j % 2 == 0 { &e0[j / 2] } else { &e1[j / 2] }, "eval batch {j}");
        }
    }
}
