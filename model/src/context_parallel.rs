//! Context parallelism: one sequence's tokens split over the ranks of a group, each rank
//! running every layer on its share and exchanging keys and values in attention.
//!
//! The split is the load-balanced one of Megatron's and torchtitan's context parallelism: the
//! (padded) sequence is cut into `2N` chunks and rank `i` of `N` holds chunks `i` and
//! `2N-1-i`, so that under the causal mask every rank attends over the same number of
//! key-query pairs. RoPE positions stay global, packed rows keep their documents, and the loss
//! of each position is counted on the rank that holds it (the ranks' sums add up to one
//! process's). Attention itself is `attention/gathered_kv.rs`.
//!
//! The group is the trainer's (c10d): the model sees it through [`ContextGroup`].

use std::ops::Range;
use std::sync::{Arc, Mutex};

/// The collectives context-parallel attention needs, over the ranks that share one sequence.
pub trait ContextGroup: Send + Sync {
    /// This rank in `0..size()`.
    fn rank(&self) -> usize;
    /// Ranks sharing a sequence.
    fn size(&self) -> usize;
    /// Every rank's `x` (contiguous, the same shape and dtype on every rank, on this rank's
    /// device), stacked along a new first dimension in rank order.
    ///
    /// # Shapes
    /// - x: `[..]`; output: `[size, ..]`
    fn all_gather(&self, x: &tch::Tensor) -> anyhow::Result<tch::Tensor>;
    /// `x` (f32) summed elementwise over the group; the sum is returned (the same on every
    /// rank).
    fn all_reduce_sum(&self, x: &tch::Tensor) -> anyhow::Result<tch::Tensor>;
}

impl std::fmt::Debug for dyn ContextGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ContextGroup(rank {} of {})", self.rank(), self.size())
    }
}

/// The first failed collective of the group (a lost rank, a timeout), kept until the trainer
/// takes it: attention runs inside autodiff ops, which cannot return an error, so a failure is
/// recorded here, the op gives zeros, and no later collective of the step starts (each would
/// wait out the timeout on a group that lost a rank).
static FAILURE: Mutex<Option<String>> = Mutex::new(None);

/// Records `message` as the group's failure unless one is recorded already.
pub fn record_failure(message: String) {
    let mut f = FAILURE.lock().unwrap_or_else(|e| e.into_inner());
    if f.is_none() {
        tracing::error!("context-parallel group failed: {message}");
        *f = Some(message);
    }
}

/// Whether a failure is recorded (collectives are skipped from then on).
pub fn failed() -> bool {
    FAILURE.lock().unwrap_or_else(|e| e.into_inner()).is_some()
}

/// The recorded failure, as an error to return from the step (and cleared).
pub fn take_failure() -> anyhow::Result<()> {
    match FAILURE.lock().unwrap_or_else(|e| e.into_inner()).take() {
        Some(message) => Err(anyhow::anyhow!("context-parallel attention: {message}")),
        None => Ok(()),
    }
}

/// How one batch's sequence is split over the group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContextSplit {
    /// This rank in the group.
    pub rank: usize,
    /// Ranks in the group (N).
    pub size: usize,
    /// The sequence length as the batch has it.
    pub seq: usize,
    /// The padded length: the next multiple of `2N` (padding positions have no target and sit
    /// after every real token, so causal attention never reaches them from a real one).
    pub padded: usize,
}

impl ContextSplit {
    /// The split of a `seq`-token sequence for rank `rank` of `size`.
    pub fn new(seq: usize, rank: usize, size: usize) -> Self {
        assert!(size >= 1 && rank < size, "rank {rank} of a context-parallel group of {size}");
        let unit = 2 * size;
        Self { rank, size, seq, padded: seq.div_ceil(unit) * unit }
    }

    /// Tokens per chunk (`padded / 2N`).
    pub fn chunk(&self) -> usize {
        self.padded / (2 * self.size)
    }

    /// Tokens this rank holds (two chunks).
    pub fn local_len(&self) -> usize {
        2 * self.chunk()
    }

    /// The global chunks rank `rank` holds, in its local order: `rank` and `2N-1-rank`.
    pub fn chunks_of(&self, rank: usize) -> [usize; 2] {
        [rank, 2 * self.size - 1 - rank]
    }

    /// The global positions of this rank's two chunks, in local order.
    pub fn local_ranges(&self) -> [Range<usize>; 2] {
        let c = self.chunk();
        self.chunks_of(self.rank).map(|k| k * c..(k + 1) * c)
    }

    /// The global position of each local token.
    pub fn local_positions(&self) -> Vec<usize> {
        self.local_ranges().into_iter().flatten().collect()
    }

    /// This rank's tokens of `x` along `dim` (of the padded length).
    ///
    /// # Shapes
    /// - x: `padded` along `dim`; output: `local_len()` along `dim`
    pub fn local_of(&self, x: &tch::Tensor, dim: i64) -> tch::Tensor {
        let parts: Vec<tch::Tensor> =
            self.local_ranges().iter().map(|r| x.narrow(dim, r.start as i64, r.len() as i64)).collect();
        tch::Tensor::cat(&parts, dim)
    }

    /// The whole sequence from every rank's local tokens as [`ContextGroup::all_gather`]
    /// stacks them (rank-major), in global order along `dim` (of the per-rank tensors).
    ///
    /// # Shapes
    /// - gathered: `[N, ..]` with `local_len()` along `dim + 1`; output: `[..]` with `padded`
    ///   along `dim`
    pub fn global_of(&self, gathered: &tch::Tensor, dim: i64) -> tch::Tensor {
        let c = self.chunk() as i64;
        let parts: Vec<tch::Tensor> = (0..2 * self.size)
            .map(|k| {
                // Chunk k is the first chunk of rank k, or the second of rank 2N-1-k.
                let (rank, second) = if k < self.size { (k, 0) } else { (2 * self.size - 1 - k, 1) };
                gathered.get(rank as i64).narrow(dim, second * c, c)
            })
            .collect();
        tch::Tensor::cat(&parts, dim)
    }
}

/// A model's context-parallel group (`LlamaForCausalLM::context`), with the split of each
/// batch it runs.
#[derive(Clone)]
pub struct ContextParallel {
    /// The group.
    pub group: Arc<dyn ContextGroup>,
}

impl std::fmt::Debug for ContextParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ContextParallel({:?})", &*self.group)
    }
}

impl ContextParallel {
    /// The split of a `seq`-token batch for this rank.
    pub fn split(&self, seq: usize) -> ContextSplit {
        ContextSplit::new(seq, self.group.rank(), self.group.size())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Hand-derived: 10 tokens over 2 ranks pad to 12, chunks of 3; rank 0 holds chunks 0 and
    /// 3 (positions 0-2, 9-11), rank 1 chunks 1 and 2 (3-8); gathering both and reordering
    /// gives 0..12 back.
    #[test]
    fn chunks_are_balanced_and_gather_back_in_order() {
        let (a, b) = (ContextSplit::new(10, 0, 2), ContextSplit::new(10, 1, 2));
        assert_eq!((a.padded, a.chunk(), a.local_len()), (12, 3, 6));
        assert_eq!(a.local_positions(), [0, 1, 2, 9, 10, 11]);
        assert_eq!(b.local_positions(), [3, 4, 5, 6, 7, 8]);
        let x = tch::Tensor::arange(12, (tch::Kind::Int64, tch::Device::Cpu)).view([1, 12]);
        let locals = [a.local_of(&x, 1), b.local_of(&x, 1)];
        assert_eq!(Vec::<i64>::try_from(locals[0].view([-1])).unwrap(), [0, 1, 2, 9, 10, 11]);
        let back = a.global_of(&tch::Tensor::stack(&locals, 0), 1);
        assert_eq!(Vec::<i64>::try_from(back.view([-1])).unwrap(), (0..12).collect::<Vec<i64>>());
        // Four ranks: every position exactly once, the causal work (Σ positions + 1) equal.
        let work: Vec<usize> =
            (0..4).map(|r| ContextSplit::new(32, r, 4).local_positions().iter().map(|p| p + 1).sum()).collect();
        assert!(work.iter().all(|&w| w == work[0]), "{work:?}");
        let mut all: Vec<usize> = (0..4).flat_map(|r| ContextSplit::new(32, r, 4).local_positions()).collect();
        all.sort_unstable();
        assert_eq!(all, (0..32).collect::<Vec<_>>());
    }
}
