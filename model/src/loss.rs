//! Causal-LM cross-entropy over target tokens (labels != -100), as sums so that callers
//! choose the normalisation: per token over a whole global batch (training), or per sample.

use burn::tensor::activation::log_softmax;
use burn::tensor::{Int, Tensor};

/// Label value that takes no loss (prompt and padding), as in HF and PyTorch.
pub const IGNORE_INDEX: i64 = -100;

/// Per-sample sums of token losses and target-token counts.
#[derive(Debug, Clone)]
pub struct LossSums {
    /// Σ over target positions of −log p(label), per sample `[batch]`.
    pub loss_sum: Tensor<1>,
    /// Number of target positions per sample `[batch]`.
    pub tokens: Tensor<1>,
}

/// Cross-entropy of position t's logits against `labels[t+1]` (HF's shift).
///
/// Computed from f32 log-softmax. Positions whose shifted label is −100, and the last
/// position (nothing follows it), contribute nothing.
///
/// # Shapes
/// - logits: `[batch, seq, vocab]`
/// - labels: `[batch, seq]`
pub fn causal_lm_loss(logits: Tensor<3>, labels: Tensor<2, Int>) -> LossSums {
    let [b, s, v] = logits.dims();
    let logits = logits.narrow(1, 0, s - 1);
    let targets = labels.narrow(1, 1, s - 1);
    let mask = targets.clone().not_equal_elem(IGNORE_INDEX).float();
    // Ignored labels are clamped to a valid index; the mask zeroes what they pick.
    let index = targets.clamp(0, v as i64 - 1).unsqueeze_dim::<3>(2);
    let logp = log_softmax(logits, 2).gather(2, index).reshape([b, s - 1]);
    let loss_sum = (logp.neg() * mask.clone()).sum_dim(1).reshape([b]);
    let tokens = mask.sum_dim(1).reshape([b]);
    LossSums { loss_sum, tokens }
}
