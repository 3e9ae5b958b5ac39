//! Batches as the trainer consumes them: padded, collated micro-batches of a global batch, made
//! ahead of use by prefetch workers ([`crate::prefetch`]) in a fixed order.

use std::sync::Arc;

use crate::loader::{Position, ShardedOrder};
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

/// One optimizer step's data.
#[derive(Debug, Clone, PartialEq)]
pub struct StepBatch {
    /// The global batch split into micro-batches.
    pub micro_batches: Vec<Collated>,
    /// Target tokens of the whole global batch (the loss normaliser).
    pub target_tokens: usize,
    /// Unpadded length of each sequence.
    pub lengths: Vec<usize>,
    /// Where the order continues after this batch (saved in checkpoints).
    pub position_after: Position,
}

/// The endless stream of global batches drawn by `order`, prepared by `workers` threads.
pub fn train_batches(
    data: Arc<Vec<Sample>>,
    mut order: ShardedOrder,
    global: usize,
    micro: usize,
    padding: Padding,
    workers: usize,
) -> Prefetched<StepBatch> {
    let jobs = std::iter::from_fn(move || {
        let indices: Vec<usize> = (0..global).map(|_| order.next_index()).collect();
        Some((indices, order.position()))
    });
    prefetch(jobs, workers, 2, move |(indices, position_after): (Vec<usize>, Position)| {
        let rows: Vec<&Sample> = indices.iter().map(|&i| &data[i]).collect();
        StepBatch {
            micro_batches: rows.chunks(micro.max(1)).map(|m| collate(m, padding)).collect(),
            target_tokens: rows.iter().map(|s| s.target_tokens()).sum(),
            lengths: rows.iter().map(|s| s.input_ids.len()).collect(),
            position_after,
        }
    })
}

/// The evaluation set in order, `batch` sequences per micro-batch, prepared by `workers` threads.
pub fn eval_batches(data: Arc<Vec<Sample>>, batch: usize, padding: Padding, workers: usize) -> Prefetched<Collated> {
    let batch = batch.max(1);
    let starts = (0..data.len()).step_by(batch);
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
            let order = ShardedOrder::new(data.len(), 9, 0, 1, true, Position::default()).unwrap();
            train_batches(data.clone(), order, 8, 2, Padding::Longest, workers).take(12).collect::<Vec<_>>()
        };
        let inline = take(0);
        assert_eq!(inline[0].micro_batches.len(), 4);
        assert_eq!(inline[0].target_tokens, 8);
        assert_eq!(inline[11].position_after, Position { epoch: 2, index: 22 });
        for w in [1, 2, 4] {
            assert_eq!(take(w), inline, "{w} workers");
        }
        let evals: Vec<Collated> = eval_batches(data.clone(), 8, Padding::Longest, 3).collect();
        assert_eq!(evals.len(), 5);
        assert_eq!(evals[4].batch, 5);
    }
}
