//! Gradient reduction across data-parallel ranks, behind one interface.
//!
//! The step normalises every rank's loss by the global batch's target-token count, so the
//! global gradient is the plain sum of the ranks' gradients; a data-parallel backend (NCCL via
//! LibTorch's process groups, or gloo on CPU) plugs in by implementing [`Collective`]. Only the
//! single-process identity exists today.

use burn::tensor::Tensor;

/// Collective operations the training step needs.
pub trait Collective {
    /// This process's rank in `0..world_size()`.
    fn rank(&self) -> usize;
    /// Number of data-parallel ranks.
    fn world_size(&self) -> usize;
    /// Replaces every tensor by its sum over all ranks (same order and shapes on every rank).
    ///
    /// # Shapes
    /// - each tensor: `[n]` (flattened parameter gradients), unchanged
    fn all_reduce_sum(&self, tensors: Vec<Tensor<1>>) -> Vec<Tensor<1>>;
    /// The sum of a scalar over all ranks (the loss, for logging).
    fn all_reduce_scalar(&self, x: f64) -> f64;
}

/// One process, one rank: every reduction is the identity.
#[derive(Debug, Clone, Copy, Default)]
pub struct SingleProcess;

impl Collective for SingleProcess {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn all_reduce_sum(&self, tensors: Vec<Tensor<1>>) -> Vec<Tensor<1>> {
        tensors
    }
    fn all_reduce_scalar(&self, x: f64) -> f64 {
        x
    }
}
