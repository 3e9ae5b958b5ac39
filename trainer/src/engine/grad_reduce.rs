//! The data-parallel reduction of a step's gradients, on the device: [`Buckets`] of the
//! gradients summed over the ranks, each started as soon as it is full and waited for before
//! the optimizer. Fed by the last micro-batch's backward block by block
//! (`LlamaForCausalLM::loss_and_grads_streamed`), the buckets of the last blocks' adapters
//! cross the network while the blocks below run their backward, as PyTorch DDP's buckets and
//! NeMo's overlapped gradient reduction do; fed after the backward, it is one reduction of
//! everything (`dist.bucket_mb = 0`). Each parameter's sum over the rank's micro-batches is
//! taken in [`TreeSum`]'s order before its bucket starts, and the ranks' sums are added as one
//! flat reduction adds them (elementwise: how the parameters are grouped into buckets changes
//! no bit), so a run is bitwise the same with and without buckets, and world 2 the same as one
//! process. NCCL sums in place on the GPU; Gloo on the host (a CUDA bucket copied there and
//! back).
#![allow(deprecated)] // burn-tch is deprecated upstream, and it is our backend.

use burn::backend::LibTorch;
use burn::backend::libtorch::TchTensor;
use burn::tensor::Tensor;

use crate::dist::{Collective, DistError, PendingBytes, PendingSum};

/// A sum in a fixed binary tree over the order of its terms: ((g0+g1)+(g2+g3))+((g4+g5)+(g6+g7)).
///
/// Floating-point addition is not associative, so a plain running sum over a rank's
/// micro-batches, all-reduced, differs in the last bits from one process's running sum over all
/// of them, and AdamW magnifies that in parameters whose gradients are near zero. With the tree,
/// a rank's sum over its aligned block of 2^k micro-batches is exactly a subtree of the single
/// process's sum, and the two-rank all-reduce (a + b) is its root: world 1 and world 2 give
/// bitwise the same step. Larger power-of-two worlds gather the ranks' sums and add them in
/// the same tree ([`Buckets`]), so 4 or 8 ranks give it too when each rank's share
/// of micro-batches is a power of two.
pub(super) struct TreeSum<T> {
    /// Partial sums with their tree level, levels strictly decreasing towards the top.
    stack: Vec<(u32, T)>,
}

impl<T> Default for TreeSum<T> {
    fn default() -> Self {
        Self { stack: Vec::new() }
    }
}

impl<T> TreeSum<T> {
    /// Adds the next term, merging equal-level partial sums (left + right).
    pub(super) fn push(&mut self, x: T, add: impl Fn(T, T) -> T) {
        let mut cur = (0u32, x);
        while self.stack.last().is_some_and(|(level, _)| *level == cur.0) {
            let (level, left) = self.stack.pop().expect("checked");
            cur = (level + 1, add(left, cur.1));
        }
        self.stack.push(cur);
    }

    /// The total (None without terms); unequal partial sums are merged right to left.
    pub(super) fn finish(self, add: impl Fn(T, T) -> T) -> Option<T> {
        self.stack.into_iter().map(|(_, x)| x).rev().reduce(|right, left| add(left, right))
    }
}

/// The reduction of one step's gradients, bucket by bucket.
pub(super) struct Buckets<'a> {
    comm: &'a dyn Collective,
    /// A bucket starts once it holds this many bytes (f32).
    cap: usize,
    /// The rank's earlier micro-batches' gradients, per parameter, in their tree.
    earlier: TreeSum<Vec<Tensor<1>>>,
    /// The gradients in the bucket being filled: (parameter index, rank sum).
    filling: Vec<(usize, Tensor<1>)>,
    /// Bytes in `filling`.
    bytes: usize,
    /// The started buckets, in order: their parameters and lengths, and the sum in flight.
    started: Vec<(Vec<(usize, i64)>, Pending)>,
    /// The first failure (a bucket that could not start): the step returns it.
    failed: Option<anyhow::Error>,
}

/// One bucket's reduction in flight.
enum Pending {
    /// An all-reduce (two ranks, or a world that is no power of two).
    Sum(PendingSum),
    /// An all-gather of every rank's bucket (as bytes), its `n` f32 values added in
    /// [`TreeSum`]'s order once they arrive (a power-of-two world above two).
    Gather(PendingBytes, i64),
}

impl<'a> Buckets<'a> {
    /// Buckets of `cap_bytes` over `comm`, for the gradients still to come of a rank whose
    /// earlier micro-batches summed to `earlier`.
    pub(super) fn new(comm: &'a dyn Collective, cap_bytes: usize, earlier: TreeSum<Vec<Tensor<1>>>) -> Self {
        Self { comm, cap: cap_bytes.max(1), earlier, filling: Vec::new(), bytes: 0, started: Vec::new(), failed: None }
    }

    /// Parameter `i`'s gradient of the last micro-batch: its rank sum goes into the bucket, and
    /// a full bucket starts.
    ///
    /// # Shapes
    /// - g: `[n_i]`
    pub(super) fn ready(&mut self, i: usize, g: Tensor<1>) {
        let add = |a: Tensor<1>, b: Tensor<1>| a + b;
        let sum = if self.earlier.stack.is_empty() {
            g
        } else {
            let mut column = TreeSum { stack: self.earlier.stack.iter().map(|(l, v)| (*l, v[i].clone())).collect() };
            column.push(g, add);
            column.finish(add).expect("at least the last term")
        };
        self.bytes += 4 * sum.shape().num_elements();
        self.filling.push((i, sum));
        if self.bytes >= self.cap {
            self.start();
        }
    }

    /// Buckets started so far.
    pub(super) fn started(&self) -> usize {
        self.started.len()
    }

    /// Starts the bucket being filled (nothing when it is empty or a bucket failed).
    fn start(&mut self) {
        if self.filling.is_empty() || self.failed.is_some() {
            return;
        }
        self.bytes = 0;
        let filled = std::mem::take(&mut self.filling);
        let params: Vec<(usize, i64)> = filled.iter().map(|(i, g)| (*i, g.shape().num_elements() as i64)).collect();
        let flat = Tensor::cat(filled.into_iter().map(|(_, g)| g.cast(burn::tensor::DType::F32)).collect(), 0);
        match to_tch(flat).and_then(|flat| self.launch(&flat)) {
            Ok(pending) => self.started.push((params, pending)),
            Err(e) => self.failed = Some(e),
        }
    }

    /// Starts the reduction of one flat f32 bucket.
    fn launch(&self, flat: &tch::Tensor) -> anyhow::Result<Pending> {
        let world = self.comm.world_size();
        Ok(if world > 2 && world.is_power_of_two() {
            Pending::Gather(self.comm.start_all_gather_bytes(&flat.view_dtype(tch::Kind::Uint8))?, flat.numel() as i64)
        } else {
            Pending::Sum(self.comm.start_all_reduce_sum(flat)?)
        })
    }

    /// Starts what is left, waits for every bucket in order and returns each of the `n`
    /// parameters' gradient summed over the ranks (f32), in parameter order; a bucket that
    /// failed, or a parameter whose gradient never came, is an error.
    pub(super) fn finish(mut self, n: usize) -> anyhow::Result<Vec<Tensor<1>>> {
        self.start();
        if let Some(e) = self.failed.take() {
            return Err(e);
        }
        let mut out: Vec<Option<Tensor<1>>> = vec![None; n];
        for (params, pending) in std::mem::take(&mut self.started) {
            let flat = self.wait(pending)?;
            let mut at = 0;
            for (i, len) in params {
                out[i] = Some(from_tch(flat.narrow(0, at, len)));
                at += len;
            }
        }
        out.into_iter()
            .enumerate()
            .map(|(i, g)| g.ok_or_else(|| anyhow::anyhow!("trainable parameter {i} got no gradient to reduce")))
            .collect()
    }

    /// The sum of one bucket over the ranks, once it has arrived.
    fn wait(&self, pending: Pending) -> Result<tch::Tensor, DistError> {
        match pending {
            Pending::Sum(p) => self.comm.wait_all_reduce_sum(p),
            Pending::Gather(p, n) => {
                let all = self.comm.wait_all_gather_bytes(p)?.view_dtype(tch::Kind::Float).view([-1, n]);
                let mut tree: TreeSum<tch::Tensor> = TreeSum::default();
                for rank in 0..all.size()[0] {
                    tree.push(all.get(rank), |a, b| a + b);
                }
                Ok(tree.finish(|a, b| a + b).expect("world > 2 parts"))
            }
        }
    }
}

/// Sums the ranks' gradients after the backward (the preference objective's step, and
/// `dist.bucket_mb = 0`): one bucket of all of them; the identity on one rank.
///
/// # Shapes
/// - grads: `[n_i]` each; output: the same, f32
pub(super) fn all_reduce_after_backward(
    comm: &dyn Collective,
    grads: Vec<Tensor<1>>,
) -> anyhow::Result<Vec<Tensor<1>>> {
    if comm.world_size() == 1 || grads.is_empty() {
        return Ok(grads);
    }
    let n = grads.len();
    let mut buckets = Buckets::new(comm, usize::MAX, TreeSum::default());
    for (i, g) in grads.into_iter().enumerate() {
        buckets.ready(i, g);
    }
    buckets.finish(n)
}

/// The LibTorch tensor of a plain (non-autodiff) `t`, contiguous.
fn to_tch(t: Tensor<1>) -> anyhow::Result<tch::Tensor> {
    let t: TchTensor = t.try_into_primitive::<LibTorch>().map_err(|_| anyhow::anyhow!("gradients off LibTorch"))?;
    Ok(t.tensor.contiguous())
}

/// A plain Burn tensor over `t`.
fn from_tch(t: tch::Tensor) -> Tensor<1> {
    Tensor::from_primitive::<LibTorch>(TchTensor::new(t))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tree's association, written out by hand for 8 and 5 terms; a rank's block of 4 is
    /// the left or right subtree of 8.
    #[test]
    fn tree_sum_associates_as_a_balanced_tree() {
        let sum = |xs: &[&str]| {
            let mut t = TreeSum::default();
            for x in xs {
                t.push(x.to_string(), |a, b| format!("({a}+{b})"));
            }
            t.finish(|a, b| format!("({a}+{b})")).unwrap()
        };
        let g: Vec<String> = (0..8).map(|i| format!("g{i}")).collect();
        let g: Vec<&str> = g.iter().map(String::as_str).collect();
        assert_eq!(sum(&g), "(((g0+g1)+(g2+g3))+((g4+g5)+(g6+g7)))");
        assert_eq!(format!("({}+{})", sum(&g[..4]), sum(&g[4..])), sum(&g));
        assert_eq!(sum(&g[..5]), "(((g0+g1)+(g2+g3))+g4)");
        assert_eq!(sum(&g[..1]), "g0");
    }
}
