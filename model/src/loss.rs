//! Causal-LM cross-entropy over target tokens (labels != -100), as sums so that callers
//! choose the normalisation: per token over a whole global batch (training), or per sample.

use std::sync::Arc;

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::libtorch::TchTensor;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, Dispatch, LibTorch, backend_extension};
use burn::tensor::activation::log_softmax;
use burn::tensor::{Int, Tensor, TensorData};

use crate::packing::PackedRows;

/// Label value that takes no loss (prompt and padding), as in HF and PyTorch.
pub const IGNORE_INDEX: i64 = -100;

/// A batch's labels on the compute device, with the host values they were uploaded from when
/// the caller has them: [`target_rows_loss`] selects its rows on the host, and with the host
/// copy it reads nothing back from the device (a synchronisation per micro-batch otherwise).
#[derive(Debug, Clone)]
pub struct Labels {
    /// `[batch, seq]` on the compute device.
    pub tensor: Tensor<2, Int>,
    /// The same values, row-major, when known on the host.
    pub host: Option<Arc<[i64]>>,
}

impl Labels {
    /// Labels from host values (`[batch, seq]`, row-major), uploaded to `device`.
    pub fn from_host(values: Vec<i64>, shape: [usize; 2], device: &burn::tensor::Device) -> Self {
        let host: Arc<[i64]> = values.into();
        Self { tensor: Tensor::from_data(TensorData::new(host.to_vec(), shape), device), host: Some(host) }
    }

    /// The host values: the copy when there is one, else read back from the device (counted).
    fn host_values(self) -> Arc<[i64]> {
        match self.host {
            Some(h) => h,
            None => {
                crate::profile::to_host(self.tensor).convert::<i64>().into_vec::<i64>().expect("integer labels").into()
            }
        }
    }
}

impl From<Tensor<2, Int>> for Labels {
    fn from(tensor: Tensor<2, Int>) -> Self {
        Self { tensor, host: None }
    }
}

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

/// [`causal_lm_loss`] computed from the final hidden states, running the LM head only on the
/// positions that have a target: prompt, padding and last positions never reach the
/// vocabulary projection (in MLPerf's data about half of every row is prompt, and the LM
/// head is the largest GEMM of a small model). On LibTorch the cross-entropy is one fused op
/// keeping only the logits and a log-sum-exp per row for backward.
///
/// The sums are per sample: per row, or for `packed` rows per document (in row order), where a
/// position whose next token belongs to another document (or to padding) predicts nothing.
/// Under context parallelism (`split`) `hidden` holds this rank's tokens only, and the sums
/// are those of its positions (the group's sums add up to the whole sequence's).
///
/// # Shapes
/// - hidden: `[batch, seq, d]`, or `[batch, split.local_len(), d]`
/// - lm_head: `[vocab, d]`
/// - labels: `[batch, seq]`
/// - output: sums `[samples]` (rows, or packed documents)
pub fn target_rows_loss(
    hidden: Tensor<3>,
    lm_head: Tensor<2>,
    labels: impl Into<Labels>,
    packed: Option<&PackedRows>,
    split: Option<&crate::context_parallel::ContextSplit>,
) -> LossSums {
    let [b, local, d] = hidden.dims();
    let v = lm_head.dims()[0];
    let device = hidden.device();
    let host = labels.into().host_values();
    let s = host.len() / b.max(1);
    // The sample of each position: its row, or its packed document.
    let owners: Vec<Option<usize>> = match packed {
        Some(p) => p.owners(),
        None => (0..b * s).map(|i| Some(i / s)).collect(),
    };
    // The global position of each of `hidden`'s positions.
    let positions: Vec<usize> = split.map_or_else(|| (0..s).collect(), |c| c.local_positions());
    let samples = packed.map_or(b, PackedRows::num_docs);
    let (mut rows, mut targets, mut counts) = (Vec::new(), Vec::new(), vec![0f32; samples]);
    for i in 0..b {
        for (l, &t) in positions.iter().enumerate().filter(|(_, t)| **t + 1 < s) {
            let (at, label) = (i * s + t, host[i * s + t + 1]);
            if let Some(owner) = owners[at].filter(|&o| label != IGNORE_INDEX && owners[at + 1] == Some(o)) {
                rows.push((i * local + l) as i64);
                targets.push(label.clamp(0, v as i64 - 1));
                counts[owner] += 1.0;
            }
        }
    }
    let tokens = Tensor::<1>::from_data(TensorData::new(counts.clone(), [samples]), &device);
    if rows.is_empty() {
        // Zero loss that still reaches every parameter, so each gets a (zero) gradient.
        let zero = hidden.sum().cast(burn::tensor::DType::F32).mul_scalar(0.0);
        return LossSums { loss_sum: zero.expand([samples]), tokens };
    }
    let n = rows.len();
    let index = Tensor::<1, Int>::from_data(TensorData::new(rows, [n]), &device);
    let selected = hidden.reshape([b * local, d]).select(0, index);
    let row_loss = if crate::precision::tch_device(&device).is_some() && !lm_head.is_require_grad() {
        Tensor::from_dispatch(<Dispatch as FusedLossBackend>::linear_cross_entropy(
            selected.into_dispatch(),
            lm_head.into_dispatch(),
            Arc::new(targets),
        ))
    } else {
        // The logits in the activations' dtype, the loss in f32 (HF's `logits.float()`).
        let head = lm_head.cast(selected.dtype());
        cross_entropy(selected.matmul(head.transpose()).cast(burn::tensor::DType::F32), targets)
    };
    // Per-sample sums as a [samples, n] 0/1 matrix times the row losses (rows are in sample
    // order: rows in order, documents in order within them).
    let mut owner = vec![0f32; samples * n];
    let mut r = 0;
    for (i, &c) in counts.iter().enumerate() {
        for _ in 0..c as usize {
            owner[i * n + r] = 1.0;
            r += 1;
        }
    }
    let owner = Tensor::<2>::from_data(TensorData::new(owner, [samples, n]), &device);
    let loss_sum = owner.matmul(row_loss.unsqueeze_dim::<2>(1)).reshape([samples]);
    LossSums { loss_sum, tokens }
}

/// `logsumexp(logits[i]) − logits[i, targets[i]]` per row: −log p of each target.
///
/// # Shapes
/// - logits: `[rows, vocab]`
/// - output: `[rows]`
pub fn cross_entropy(logits: Tensor<2>, targets: Vec<i64>) -> Tensor<1> {
    if crate::precision::tch_device(&logits.device()).is_some() {
        return Tensor::from_dispatch(<Dispatch as FusedLossBackend>::cross_entropy(
            logits.into_dispatch(),
            Arc::new(targets),
        ));
    }
    let n = targets.len();
    let index = Tensor::<2, Int>::from_data(TensorData::new(targets, [n, 1]), &logits.device());
    log_softmax(logits, 1).gather(1, index).reshape([n]).neg()
}

/// Backend extension: the fused cross-entropy.
#[backend_extension(Autodiff, LibTorch)]
pub trait FusedLossBackend: Backend {
    /// See [`cross_entropy`].
    fn cross_entropy(logits: FloatTensor<Self>, targets: Arc<Vec<i64>>) -> FloatTensor<Self>;
    /// [`cross_entropy`] of `h·Wᵀ` for a frozen `W`, chunk by chunk (see [`lce_forward`]).
    fn linear_cross_entropy(h: FloatTensor<Self>, w: FloatTensor<Self>, targets: Arc<Vec<i64>>) -> FloatTensor<Self>;
}

/// Bytes of logits one chunk of [`lce_forward`] materialises (262 rows at a 32k vocabulary):
/// chosen under glibc's mmap threshold, when llora used glibc's malloc, so the buffer was reused
/// memory rather than fresh pages faulted in every step (`llora plan` counts one chunk). Each chunk's GEMMs repack the whole
/// LM head, so chunks must not be much smaller (docs/performance.md, M11).
const LCE_CHUNK_BYTES: usize = (32 << 20) - (64 << 10);

/// Elements of a bf16 LM head converted to f32 at a time where bf16 GEMMs run through f32
/// (32 MB in f32, as much as a chunk of logits). `llora plan` counts one block.
pub const LCE_HEAD_BLOCK_ELEMENTS: i64 = 1 << 23;

/// Cross-entropy of `h·Wᵀ` against `targets`, a chunk of rows at a time, so the `[rows,
/// vocab]` logits never exist whole. With `want_dh`, each chunk's gradient with respect to h
/// (`(softmax − one-hot)·W`, for an upstream gradient of 1) is computed while its logits are
/// at hand; backward only scales it per row. Returns (losses `[rows]` f32, dh `[rows, d]` in
/// h's dtype).
///
/// For bf16 h the GEMMs run in bf16 (W cast when it is not stored so) and the softmax in f32,
/// as HF computes `lm_head(h).float()` and its cross-entropy.
fn lce_forward(h: &tch::Tensor, w: &tch::Tensor, targets: &[i64], want_dh: bool) -> (tch::Tensor, Option<tch::Tensor>) {
    let chunk = (LCE_CHUNK_BYTES / (4 * w.size()[0] as usize)).max(1) as i64;
    lce_forward_chunked(h, w, targets, want_dh, chunk)
}

fn lce_forward_chunked(
    h: &tch::Tensor,
    w: &tch::Tensor,
    targets: &[i64],
    want_dh: bool,
    chunk: i64,
) -> (tch::Tensor, Option<tch::Tensor>) {
    let n = h.size()[0];
    let chunk = chunk.min(n.max(1));
    let t_all = tch::Tensor::from_slice(targets).to_device(h.device());
    // The GEMMs' operands: the activations' dtype, or f32 for bf16 where torch has no fast bf16
    // GEMM (precision/bf16.rs); the logits are f32 either way. A bf16 head routed through f32
    // is converted a column block at a time inside each GEMM, never whole (small's head in f32
    // is 131 MB, a 128k-vocabulary 8B's 2.1 GB).
    let kind = crate::precision::bf16::operand_kind(h.kind(), h.device());
    let by_blocks = kind == tch::Kind::Float && w.kind() != kind;
    let w = &if by_blocks { w.shallow_clone() } else { w.to_kind(kind) };
    let wt = w.tr();
    let gemm = |a: &tch::Tensor, b: &tch::Tensor, out: tch::Kind| {
        if by_blocks {
            crate::precision::blocked::by_column_blocks_of(LCE_HEAD_BLOCK_ELEMENTS, a.size()[0], b, out, |blk| {
                a.f_mm(&blk.to_kind(kind)).map(|y| y.to_kind(out))
            })
            .expect("a GEMM of valid shapes")
        } else {
            a.mm(b).to_kind(out)
        }
    };
    let (mut losses, mut dhs) = (Vec::new(), Vec::new());
    let mut start = 0;
    while start < n {
        let len = chunk.min(n - start);
        // One [len, vocab] buffer, worked on in place: logits → exp(logits − max) → softmax
        // → softmax − one-hot (torch's logsumexp would allocate a second one and the
        // softmax would take a second exp pass).
        let mut p = gemm(&h.narrow(0, start, len).to_kind(kind), &wt, tch::Kind::Float);
        let t = t_all.narrow(0, start, len).unsqueeze(1);
        let picked = p.gather(1, &t, false);
        let max = p.amax([-1i64].as_slice(), true);
        let _ = p.g_sub_(&max).exp_();
        let sum = p.sum_dim_intlist([-1i64].as_slice(), true, tch::Kind::Float);
        losses.push((&max + sum.log() - picked).squeeze_dim(1));
        if want_dh {
            let _ = p.g_div_(&sum);
            let _ = p.scatter_add_(1, &t, &(-tch::Tensor::ones([len, 1], (p.kind(), p.device()))));
            dhs.push(gemm(&p.to_kind(kind), w, h.kind()));
        }
        start += len;
    }
    (tch::Tensor::cat(&losses, 0), want_dh.then(|| tch::Tensor::cat(&dhs, 0)))
}

#[derive(Debug)]
struct LinearCrossEntropyBackward;

impl Backward<LibTorch, 2> for LinearCrossEntropyBackward {
    /// dh for an upstream gradient of 1.
    type State = TchTensor;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [node_h, node_w] = ops.parents;
        assert!(node_w.is_none(), "linear_cross_entropy is only used with a frozen weight");
        let grad = grads.consume::<LibTorch>(&ops.node);
        if let Some(node) = node_h {
            // Scaled in f32, returned in h's dtype.
            let dh = &ops.state.tensor;
            let scaled = dh.to_kind(tch::Kind::Float) * grad.tensor.unsqueeze(1);
            grads.register::<LibTorch>(node.id, TchTensor::new(scaled.to_kind(dh.kind())));
        }
    }
}

fn ce_forward(logits: &tch::Tensor, targets: &[i64]) -> (tch::Tensor, tch::Tensor, tch::Tensor) {
    let t = tch::Tensor::from_slice(targets).to_device(logits.device());
    let lse = logits.logsumexp([-1i64].as_slice(), false);
    let picked = logits.gather(1, &t.unsqueeze(1), false).squeeze_dim(1);
    (&lse - picked, lse, t)
}

impl FusedLossBackend for LibTorch {
    fn cross_entropy(logits: TchTensor, targets: Arc<Vec<i64>>) -> TchTensor {
        TchTensor::new(ce_forward(&logits.tensor, &targets).0)
    }

    fn linear_cross_entropy(h: TchTensor, w: TchTensor, targets: Arc<Vec<i64>>) -> TchTensor {
        TchTensor::new(lce_forward(&h.tensor, &w.tensor, &targets, false).0)
    }
}

#[derive(Debug)]
struct CrossEntropyBackward;

impl Backward<LibTorch, 1> for CrossEntropyBackward {
    /// (logits, log-sum-exp per row, targets).
    type State = (TchTensor, TchTensor, TchTensor);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [node] = ops.parents;
        let grad = grads.consume::<LibTorch>(&ops.node);
        let Some(node) = node else { return };
        let (logits, lse, t) = &ops.state;
        // softmax − one-hot, times the upstream gradient of each row.
        let g = grad.tensor.unsqueeze(1);
        let mut d = (&logits.tensor - lse.tensor.unsqueeze(1)).exp();
        let _ = d.scatter_add_(
            1,
            &t.tensor.unsqueeze(1),
            &(-tch::Tensor::ones_like(&t.tensor.unsqueeze(1)).to_kind(d.kind())),
        );
        grads.register::<LibTorch>(node.id, TchTensor::new(d * g));
    }
}

impl<C: CheckpointStrategy> FusedLossBackend for Autodiff<LibTorch, C> {
    fn cross_entropy(logits: FloatTensor<Self>, targets: Arc<Vec<i64>>) -> FloatTensor<Self> {
        match CrossEntropyBackward.prepare::<C>([logits.node()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let logits = logits.into_primitive();
                let (loss, lse, t) = ce_forward(&logits.tensor, &targets);
                prep.finish((logits, TchTensor::new(lse), TchTensor::new(t)), TchTensor::new(loss))
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(TchTensor::new(ce_forward(&logits.into_primitive().tensor, &targets).0))
            }
        }
    }

    fn linear_cross_entropy(h: FloatTensor<Self>, w: FloatTensor<Self>, targets: Arc<Vec<i64>>) -> FloatTensor<Self> {
        match LinearCrossEntropyBackward.prepare::<C>([h.node(), w.node()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let (loss, dh) = lce_forward(&h.into_primitive().tensor, &w.into_primitive().tensor, &targets, true);
                prep.finish(TchTensor::new(dh.expect("dh was asked for")), TchTensor::new(loss))
            }
            OpsKind::UnTracked(prep) => prep.finish(TchTensor::new(
                lce_forward(&h.into_primitive().tensor, &w.into_primitive().tensor, &targets, false).0,
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Device, Distribution, Tolerance};

    /// The target-rows loss equals the full-logits reference in value and in the gradients of
    /// the hidden states and the LM head, with prompt (-100) rows and a row without targets.
    #[test]
    fn target_rows_loss_matches_full_logits() {
        let _rng = crate::device::torch_rng_lock();
        let device = Device::libtorch().autodiff();
        device.seed(11);
        let (b, s, d, v) = (3, 9, 16, 40);
        let h0 = Tensor::<3>::random([b, s, d], Distribution::Normal(0.0, 1.0), &device);
        let w0 = Tensor::<2>::random([v, d], Distribution::Normal(0.0, 0.5), &device);
        let mut labels: Vec<i64> = (0..b * s).map(|i| (i * 7 % v) as i64).collect();
        labels[..4].fill(IGNORE_INDEX); // sample 0: prompt; labels 1..=3 of its 8 shifted targets
        for t in 0..s {
            labels[2 * s + t] = IGNORE_INDEX; // sample 2: nothing to predict
        }
        let labels = Tensor::<2, Int>::from_data(TensorData::new(labels, [b, s]), &device);
        let run = |fused: bool| {
            let (h, w) = (h0.clone().require_grad(), w0.clone().require_grad());
            let sums = if fused {
                target_rows_loss(h.clone(), w.clone(), labels.clone(), None, None)
            } else {
                causal_lm_loss(h.clone().matmul(w.clone().transpose().unsqueeze()), labels.clone())
            };
            // Different weights per sample, so per-sample sums are checked through the gradient.
            let weights = Tensor::<1>::from_data(TensorData::new(vec![1.0f32, 0.5, 2.0], [3]), &device);
            let grads = (sums.loss_sum.clone() * weights).sum().backward();
            (sums.loss_sum.inner(), sums.tokens.inner(), h.grad(&grads).unwrap(), w.grad(&grads).unwrap())
        };
        // A frozen LM head takes the chunked linear + cross-entropy op (few rows per chunk
        // here, so several chunks run).
        let frozen = |fused: bool| {
            let h = h0.clone().require_grad();
            let sums = if fused {
                target_rows_loss(h.clone(), w0.clone(), labels.clone(), None, None)
            } else {
                causal_lm_loss(h.clone().matmul(w0.clone().transpose().unsqueeze()), labels.clone())
            };
            let grads = sums.loss_sum.clone().sum().backward();
            (sums.loss_sum.inner(), h.grad(&grads).unwrap())
        };
        let (f, fr) = (frozen(true), frozen(false));
        // Chunking changes nothing: 3 rows per chunk against one chunk.
        let (h, w) = (
            tch::Tensor::randn([10, 8], (tch::Kind::Float, tch::Device::Cpu)),
            tch::Tensor::randn([30, 8], (tch::Kind::Float, tch::Device::Cpu)),
        );
        let t: Vec<i64> = (0..10).map(|i| i * 3 % 30).collect();
        let (l3, d3) = lce_forward_chunked(&h, &w, &t, true, 3);
        let (l1, d1) = lce_forward_chunked(&h, &w, &t, true, 100);
        assert!(l3.allclose(&l1, 1e-6, 1e-6, false) && d3.unwrap().allclose(&d1.unwrap(), 1e-6, 1e-6, false));
        let tol = Tolerance::<f32>::relative(1e-5).set_absolute(1e-6);
        f.0.into_data().assert_approx_eq::<f32>(&fr.0.into_data(), tol);
        f.1.into_data().assert_approx_eq::<f32>(&fr.1.into_data(), tol);
        let (a, r) = (run(true), run(false));
        let tol = Tolerance::<f32>::relative(1e-5).set_absolute(1e-6);
        a.0.into_data().assert_approx_eq::<f32>(&r.0.into_data(), tol);
        assert_eq!(a.1.clone().into_data().to_vec::<f32>().unwrap(), vec![5.0, 8.0, 0.0]);
        a.1.into_data().assert_approx_eq::<f32>(&r.1.into_data(), tol);
        a.2.into_data().assert_approx_eq::<f32>(&r.2.into_data(), tol);
        a.3.into_data().assert_approx_eq::<f32>(&r.3.into_data(), tol);
    }
}
