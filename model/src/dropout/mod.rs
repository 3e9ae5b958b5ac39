//! Inverted dropout as one LibTorch op that keeps only a seed for backward.
//!
//! Burn's composite (`x · bernoulli_mask / (1 − p)`) draws an f32 mask, multiplies twice and
//! keeps the f32 mask for backward. Here `x · mask / (1 − p)` is one LibTorch kernel and the
//! mask is not kept at all: backward redraws it from the seed it was drawn with (a mask is a
//! byte per element: 64 MB per adapter of a 70B block at 8192 tokens, 7% of the block's saved
//! activations with the MLPerf job's two adapters). Against keeping the mask: the same bits,
//! less peak RSS, the same step time within noise (docs/performance.md, M7). Each mask's seed is
//! one draw from LibTorch's CPU generator, which `Device::seed` seeds, so runs stay
//! reproducible and resumable (the trainer reseeds per step, and per block when it recomputes).
//!
//! On CPU the mask bits come from ChaCha8 (rand_chacha), not from torch's `bernoulli_`: torch
//! draws its CPU Bernoulli masks one element at a time through a Mersenne Twister on one
//! thread (a visible share of a step in perf: docs/performance.md, M7), while ChaCha8 fills the words
//! at memory speed. On CUDA a bf16 input takes our kernel (`fused.rs`: the mask drawn from
//! Philox inside the one pass that reads the input, never stored); LibTorch's route, where
//! the kernel is refused or the input is f32, is `bernoulli_` on the device after seeding the
//! device's generator with the mask's seed (a host-made mask would cost a PCIe copy each way;
//! whether either ran on a GPU: docs/gpu.md).
//!
//! Under context parallelism each rank holds two chunks of the sequence; a mask drawn for its
//! local `[batch, local, in]` tensor would repeat the same bits at the same local offset on
//! every rank of the group (they share the micro-batch's seed), and differ from one process's.
//! Inside [`over_split`] (a decoder block's forward sets it) the mask is instead the rows of
//! the mask one process draws for the whole `[batch, seq, in]`: on the CPU by seeking the
//! ChaCha8 stream to each chunk's first element (word k is element k), on CUDA by drawing the
//! whole mask and keeping this rank's rows (a transient byte per element of the whole
//! sequence; our kernel draws only this rank's, from their indices in the whole). The run then
//! drops exactly what one process drops.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::libtorch::TchTensor;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, Dispatch, LibTorch, backend_extension};
use burn::tensor::{Device, Distribution, Tensor};
use std::cell::Cell;

use crate::context_parallel::ContextSplit;
use crate::fp8::SharedCodes;

pub(crate) mod fused;
mod philox;

thread_local! {
    /// The split of the sequence the current block runs on (see [`over_split`]).
    static SPLIT: Cell<Option<ContextSplit>> = const { Cell::new(None) };
    /// Where a dropout on our kernel hands its output's amax (see [`offering_amax`]).
    static OFFER: std::cell::RefCell<Option<SharedCodes>> = const { std::cell::RefCell::new(None) };
}

/// Runs `f`, whose dropout, where it takes our kernel, hands its output's amax to `to`,
/// taken in the same pass: the amax its reader's FP8 copy at current scaling needs (the
/// adapter's A GEMM keeps one with `fp8_activations`), which then takes no pass of its own.
/// Elsewhere nothing is handed over and the reader takes the amax itself: the same value.
pub(crate) fn offering_amax<T>(to: &SharedCodes, f: impl FnOnce() -> T) -> T {
    crate::scoped::with_value(&OFFER, Some(to.clone()), f)
}

/// Runs `f` with the dropout masks drawn inside it taken from the whole sequence's masks as
/// `split` lays the sequence out (the tensors' second-last dimension is this rank's tokens);
/// `None`: each mask is its tensor's own. The previous setting is restored after `f`, also
/// when it unwinds; nothing is borrowed while `f` runs.
pub(crate) fn over_split<T>(split: Option<ContextSplit>, f: impl FnOnce() -> T) -> T {
    crate::scoped::with(&SPLIT, split, f)
}

/// Zeroes each element with probability `p` and scales the rest by `1/(1−p)`.
///
/// # Shapes
/// - x: any; output: as x
pub fn dropout<const D: usize>(x: Tensor<D>, p: f64) -> Tensor<D> {
    if p <= 0.0 {
        return x;
    }
    if crate::precision::tch_device(&x.device()).is_some() {
        return Tensor::from_dispatch(<Dispatch as DropoutBackend>::dropout(x.into_dispatch(), p));
    }
    let keep = 1.0 - p;
    let mask = x.random_like(Distribution::Bernoulli(keep));
    x * mask.mul_scalar(1.0 / keep)
}

/// Backend extension: fused dropout.
#[backend_extension(Autodiff, LibTorch)]
pub trait DropoutBackend: Backend {
    /// See [`dropout`].
    fn dropout(x: FloatTensor<Self>, p: f64) -> FloatTensor<Self>;
}

/// The ChaCha8 stream is read this many bytes at a time (a multiple of 4, so the words are
/// those of one long stream), which keeps the transient at 16 KB instead of 4 bytes per element.
const CHUNK: usize = 16 * 1024;

/// A fresh seed: one draw from LibTorch's CPU generator (which `Device::seed` seeds). The
/// value is copied out of the CPU tensor, not read as a scalar op: it never waits for a GPU,
/// and the step's synchronisation count (`crate::profile`) leaves it out.
pub(crate) fn draw_seed() -> u64 {
    let t = tch::Tensor::randint(i64::MAX, [1], (tch::Kind::Int64, tch::Device::Cpu));
    let mut v = [0i64];
    t.copy_data(&mut v, 1);
    v[0] as u64
}

/// Writes into `keep` true with probability 1 − p: word k of the ChaCha8 stream seeded with
/// `seed` keeps element k when it is below (1 − p)·2³², exact to 2⁻³².
fn fill_keep(keep: &mut [bool], seed: u64, p: f64) {
    fill_keep_from(keep, seed, p, 0);
}

/// [`fill_keep`] of the elements from `first` on: `keep[j]` is element `first + j`.
fn fill_keep_from(keep: &mut [bool], seed: u64, p: f64, first: u64) {
    use rand::{RngCore, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    rng.set_word_pos(u128::from(first));
    let threshold = ((1.0 - p) * 4_294_967_296.0) as u64;
    let mut words = vec![0u8; CHUNK];
    for out in keep.chunks_mut(CHUNK / 4) {
        let bytes = &mut words[..4 * out.len()];
        rng.fill_bytes(bytes);
        for (k, w) in out.iter_mut().zip(bytes.chunks_exact(4)) {
            *k = u64::from(u32::from_le_bytes([w[0], w[1], w[2], w[3]])) < threshold;
        }
    }
}

/// `split` where a `size` tensor is this rank's tokens of it (`[.., local, in]`), else `None`:
/// the tensor gets its own mask. Every dropout input inside a block is `[.., local, in]` today;
/// one that is not makes a context-parallel run differ from one process, which is said once.
fn fitting(split: Option<ContextSplit>, size: &[i64]) -> Option<ContextSplit> {
    let fits = |sp: &ContextSplit| size.len() >= 2 && size[size.len() - 2] == sp.local_len() as i64;
    debug_assert!(split.as_ref().is_none_or(fits), "a dropout input of {size:?} under {split:?}");
    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if let Some(sp) = split.as_ref().filter(|sp| !fits(sp))
        && !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed)
    {
        tracing::warn!(
            "dropout input {size:?} is not this rank's {} tokens of the context-parallel split: \
             its mask is drawn for the tensor alone, so this run's dropout differs from one process's",
            sp.local_len()
        );
    }
    split.filter(fits)
}

/// The keep-mask of `seed`, shaped `size`, on `device`: the same mask every time it is asked.
/// With a `split`, `size` is `[.., local, in]` and the mask is this rank's rows of the mask of
/// `[.., seq, in]` (padding rows keep everything: no real token reaches them).
fn keep_mask(seed: u64, p: f64, size: &[i64], device: tch::Device, split: Option<ContextSplit>) -> tch::Tensor {
    if let Some(split) = fitting(split, size) {
        return keep_mask_split(seed, p, size, device, split);
    }
    if device.is_cuda() {
        // The device's own generator, seeded per mask: redrawing needs only the seed. Seeding
        // every device (not just the current one) leaves no doubt which generator the
        // kernel uses; nothing else in a step draws from them.
        tch::Cuda::manual_seed_all(seed);
        let mut mask = tch::Tensor::empty(size, (tch::Kind::Bool, device));
        let _ = mask.bernoulli_float_(1.0 - p);
        return mask;
    }
    let mut mask = tch::Tensor::empty(size, (tch::Kind::Bool, tch::Device::Cpu));
    // SAFETY: `mask` is fresh, contiguous, on the CPU, and referenced nowhere else.
    fill_keep(unsafe { bool_slice(&mut mask) }, seed, p);
    mask
}

/// The elements of a fresh contiguous CPU bool tensor as a slice.
///
/// # Safety
/// `mask` must be a contiguous CPU bool tensor that nothing else references while the slice
/// lives; a torch bool is one byte holding 0 or 1, as a Rust bool.
unsafe fn bool_slice(mask: &mut tch::Tensor) -> &mut [bool] {
    unsafe { std::slice::from_raw_parts_mut(mask.data_ptr() as *mut bool, mask.numel()) }
}

/// [`keep_mask`] of this rank's rows of the whole sequence's mask.
///
/// # Shapes
/// - size: `[.., split.local_len(), in]`; the whole mask: `[.., split.seq, in]`
fn keep_mask_split(seed: u64, p: f64, size: &[i64], device: tch::Device, split: ContextSplit) -> tch::Tensor {
    let d = size.len();
    let (width, seq) = (size[d - 1], split.seq as i64);
    let rows: i64 = size[..d - 2].iter().product();
    if device.is_cuda() {
        let whole = keep_mask(seed, p, &[rows, seq, width], device, None);
        let pad = tch::Tensor::ones([rows, split.padded as i64 - seq, width], (tch::Kind::Bool, device));
        return split.local_of(&tch::Tensor::cat(&[whole, pad], 1), 1).reshape(size);
    }
    let mut mask = tch::Tensor::ones(size, (tch::Kind::Bool, tch::Device::Cpu));
    // SAFETY: `mask` is fresh, contiguous, on the CPU, and referenced nowhere else.
    let keep = unsafe { bool_slice(&mut mask) };
    let (width, seq) = (width as usize, split.seq);
    let mut at = 0;
    for row in 0..rows as usize {
        for range in split.local_ranges() {
            // The chunk's real tokens are one run of the whole mask's words; padding stays true.
            let real = range.start.min(seq)..range.end.min(seq);
            let first = ((row * seq + real.start) * width) as u64;
            fill_keep_from(&mut keep[at..at + real.len() * width], seed, p, first);
            at += range.len() * width;
        }
    }
    mask
}

/// `x · mask / (1 − p)` and what draws the mask again; on our kernel, the output's amax handed
/// where [`offering_amax`] asks.
fn forward(x: &tch::Tensor, p: f64) -> (tch::Tensor, Mask) {
    let mask = Mask { seed: draw_seed(), p, split: SPLIT.with(Cell::get), kernel: fused::takes_kernel(x) };
    let offer = if mask.kernel { OFFER.with(|o| o.borrow().clone()) } else { None };
    let Some(to) = offer else { return (mask.apply(x), mask) };
    let amax = tch::Tensor::zeros([1], (tch::Kind::Float, x.device()));
    let y = fused::apply(x, (mask.seed, p), fitting(mask.split, &x.size()), Some(&amax));
    to.offer_input_amax(amax, y.numel() as i64);
    (y, mask)
}

/// What draws one dropout op's mask again: its seed, p, the split it ran under, and whether
/// our kernel drew it (Philox) or LibTorch's route (`bernoulli_`, ChaCha8 on the CPU).
#[derive(Debug, Clone, Copy)]
struct Mask {
    seed: u64,
    p: f64,
    split: Option<ContextSplit>,
    kernel: bool,
}

impl Mask {
    /// `t · mask / (1 − p)` for `t` shaped and placed as the input was (the input forward,
    /// its gradient backward): the same mask both times.
    fn apply(&self, t: &tch::Tensor) -> tch::Tensor {
        if self.kernel {
            return fused::apply(t, (self.seed, self.p), fitting(self.split, &t.size()), None);
        }
        let mask = keep_mask(self.seed, self.p, &t.size(), t.device(), self.split);
        tch::Tensor::native_dropout_backward(t, &mask, 1.0 / (1.0 - self.p))
    }
}

impl DropoutBackend for LibTorch {
    fn dropout(x: TchTensor, p: f64) -> TchTensor {
        TchTensor::new(forward(&x.tensor, p).0)
    }
}

#[derive(Debug)]
struct DropoutBackward;

impl Backward<LibTorch, 1> for DropoutBackward {
    /// What draws the mask: backward redraws it rather than keeping it.
    type State = Mask;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [node] = ops.parents;
        let grad = grads.consume::<LibTorch>(&ops.node);
        if let Some(node) = node {
            grads.register::<LibTorch>(node.id, TchTensor::new(ops.state.apply(&grad.tensor)));
        }
    }
}

impl<C: CheckpointStrategy> DropoutBackend for Autodiff<LibTorch, C> {
    fn dropout(x: FloatTensor<Self>, p: f64) -> FloatTensor<Self> {
        match DropoutBackward.prepare::<C>([x.node()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let (out, mask) = forward(&x.into_primitive().tensor, p);
                prep.finish(mask, TchTensor::new(out))
            }
            OpsKind::UnTracked(prep) => prep.finish(TchTensor::new(forward(&x.into_primitive().tensor, p).0)),
        }
    }
}

/// Dropout seeds per decoder block of one forward pass: one draw from the device's generator
/// (which the trainer seeds per micro-batch), then block k reseeds the generator from it and k.
/// A block's masks then do not depend on what ran before it, so a recomputed block draws the
/// same masks again.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BlockSeeds(Option<u64>);

impl BlockSeeds {
    /// A base seed for a training pass on a LibTorch device (None otherwise: no reseeding).
    pub(crate) fn draw(device: &Device, train: bool) -> Self {
        if !train || crate::precision::tch_device(device).is_none() {
            return Self(None);
        }
        Self(Some(draw_seed()))
    }

    /// Reseeds the generator for block `k`.
    pub(crate) fn seed(self, device: &Device, k: usize) {
        if let Some(base) = self.0 {
            device.seed(base.wrapping_add((k as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)));
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use burn::tensor::Device;

    /// Kept elements are x/(1−p), dropped ones 0, about p of them dropped; backward redraws
    /// each op's own mask (two dropouts of one input, a third drawn between forward and
    /// backward to move the generator on); the same seed gives the same mask.
    #[test]
    fn drops_scales_and_backpropagates_the_same_mask() {
        let _rng = crate::device::torch_rng_lock();
        let device = Device::libtorch().autodiff();
        let x0 = Tensor::<2>::ones([64, 256], &device).mul_scalar(3.0);
        let values = |t: Tensor<2>| t.into_data().to_vec::<f32>().unwrap();
        let run = || {
            device.seed(42);
            let x = x0.clone().require_grad();
            let (y1, y2) = (dropout(x.clone(), 0.25), dropout(x.clone(), 0.25));
            let _ = dropout(x0.clone(), 0.25);
            let grads = (y1.clone().sum() + y2.clone().sum().mul_scalar(2.0)).backward();
            (values(y1.inner()), values(y2.inner()), values(x.grad(&grads).unwrap()))
        };
        let (y1, y2, g) = run();
        assert!(y1.iter().all(|&v| v == 0.0 || v == 4.0), "values other than 0 and 3/(1−0.25)");
        let dropped = y1.iter().filter(|&&v| v == 0.0).count() as f64 / y1.len() as f64;
        assert!((dropped - 0.25).abs() < 0.02, "dropped {dropped}");
        assert_ne!(y1, y2, "two draws, two masks");
        let expect: Vec<f32> = y1.iter().zip(&y2).map(|(a, b)| a / 3.0 + 2.0 * b / 3.0).collect();
        assert_eq!(g, expect, "gradient = Σ weight · mask / (1 − p), each op its own mask");
        assert_eq!(run().0, y1, "same seed, same mask");
    }

    /// Under a context-parallel split (10 tokens over 2 and over 4 ranks, so the last chunk
    /// holds padding) each rank's dropout, run inside `over_split` and backpropagated outside
    /// it, keeps and scales exactly its tokens' rows of one process's dropout of the whole
    /// `[2, 10, 5]` input with the same seed; padding rows are kept. Hand-laid rows: the
    /// global position of each local token (`ContextSplit::local_positions`).
    #[test]
    fn split_dropout_is_the_rows_of_the_whole_sequence_dropout() {
        split_dropout_is_rows_of_whole(Device::libtorch().autodiff(), burn::tensor::DType::F32);
    }

    /// [`split_dropout_is_the_rows_of_the_whole_sequence_dropout`] on CUDA (the whole mask
    /// drawn by the device's generator, this rank's rows kept).
    #[test]
    #[ignore = "needs CUDA"]
    fn split_dropout_is_the_rows_of_the_whole_sequence_dropout_on_cuda() {
        assert!(tch::Cuda::is_available(), "this test needs a CUDA device");
        split_dropout_is_rows_of_whole(Device::libtorch_cuda(0).autodiff(), burn::tensor::DType::F32);
    }

    /// The split test on `device` with inputs of `dtype` (bf16 takes the kernel's route where
    /// the device takes the CUDA routes).
    pub(super) fn split_dropout_is_rows_of_whole(device: Device, dtype: burn::tensor::DType) {
        let _rng = crate::device::torch_rng_lock();
        let (b, seq, w) = (2, 10, 5);
        let values = |t: Tensor<3>| t.cast(burn::tensor::DType::F32).into_data().to_vec::<f32>().unwrap();
        let run = |len: usize, split: Option<ContextSplit>| {
            device.seed(9);
            let x = Tensor::<3>::ones([b, len, w], &device).cast(dtype).require_grad();
            let y = over_split(split, || dropout(x.clone(), 0.5));
            let grads = y.clone().sum().backward();
            (values(y.inner()), values(x.grad(&grads).unwrap()))
        };
        let (whole, whole_grad) = run(seq, None);
        assert_eq!(whole, whole_grad, "the gradient of a sum is the scaled mask");
        for size in [2, 4] {
            for rank in 0..size {
                let split = ContextSplit::new(seq, rank, size);
                let (y, g) = run(split.local_len(), Some(split));
                let mut expect = Vec::new();
                for row in 0..b {
                    for p in split.local_positions() {
                        let at = (row * seq + p) * w;
                        expect.extend(if p < seq { whole[at..at + w].to_vec() } else { vec![2.0; w] });
                    }
                }
                assert_eq!(y, expect, "rank {rank} of {size}");
                assert_eq!(g, expect, "rank {rank} of {size}: backward redraws the split mask");
            }
        }
        assert!(whole.contains(&0.0) && whole.contains(&2.0));
    }

    /// Reading the stream in chunks gives the words of one long stream (the mask does not
    /// depend on the chunk size), including a tail shorter than a chunk.
    #[test]
    fn chunked_mask_is_one_stream() {
        use rand::{RngCore, SeedableRng};
        let n = 3 * CHUNK / 4 + 5;
        let mut whole = vec![0u8; 4 * n];
        rand_chacha::ChaCha8Rng::seed_from_u64(7).fill_bytes(&mut whole);
        let expect: Vec<bool> =
            whole.chunks_exact(4).map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]) < 3 << 30).collect();
        let mut keep = vec![false; n];
        fill_keep(&mut keep, 7, 0.25);
        assert_eq!(keep, expect);
    }
}
