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
//! at memory speed. On CUDA the mask is `bernoulli_` on the device after seeding the device's
//! generator with the mask's seed (a host-made mask would cost a PCIe copy each way); that
//! path is compiled but untested (no GPU here).

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::libtorch::TchTensor;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, Dispatch, LibTorch, backend_extension};
use burn::tensor::{Device, Distribution, Tensor};

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
    use rand::{RngCore, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
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

/// The keep-mask of `seed`, shaped `size`, on `device`: the same mask every time it is asked.
fn keep_mask(seed: u64, p: f64, size: &[i64], device: tch::Device) -> tch::Tensor {
    if device.is_cuda() {
        // The device's own generator, seeded per mask: redrawing needs only the seed. Seeding
        // every device (not just the current one) leaves no doubt which generator the
        // kernel uses; nothing else in a step draws from them.
        tch::Cuda::manual_seed_all(seed);
        let mut mask = tch::Tensor::empty(size, (tch::Kind::Bool, device));
        let _ = mask.bernoulli_float_(1.0 - p);
        return mask;
    }
    let mask = tch::Tensor::empty(size, (tch::Kind::Bool, tch::Device::Cpu));
    let n = mask.numel();
    // SAFETY: `mask` is a fresh contiguous CPU bool tensor of n elements that nothing else
    // references; a torch bool is one byte holding 0 or 1, as a Rust bool.
    let keep = unsafe { std::slice::from_raw_parts_mut(mask.data_ptr() as *mut bool, n) };
    fill_keep(keep, seed, p);
    mask
}

/// `x · mask / (1 − p)` and the seed of the mask; `native_dropout_backward` is that product.
fn forward(x: &tch::Tensor, p: f64) -> (tch::Tensor, u64) {
    let seed = draw_seed();
    let mask = keep_mask(seed, p, &x.size(), x.device());
    (tch::Tensor::native_dropout_backward(x, &mask, 1.0 / (1.0 - p)), seed)
}

impl DropoutBackend for LibTorch {
    fn dropout(x: TchTensor, p: f64) -> TchTensor {
        TchTensor::new(forward(&x.tensor, p).0)
    }
}

#[derive(Debug)]
struct DropoutBackward;

impl Backward<LibTorch, 1> for DropoutBackward {
    /// The mask's seed and p: backward redraws the mask rather than keeping it.
    type State = (u64, f64);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [node] = ops.parents;
        let grad = grads.consume::<LibTorch>(&ops.node);
        if let Some(node) = node {
            let (seed, p) = ops.state;
            let g = &grad.tensor;
            let mask = keep_mask(seed, p, &g.size(), g.device());
            grads.register::<LibTorch>(
                node.id,
                TchTensor::new(tch::Tensor::native_dropout_backward(g, &mask, 1.0 / (1.0 - p))),
            );
        }
    }
}

impl<C: CheckpointStrategy> DropoutBackend for Autodiff<LibTorch, C> {
    fn dropout(x: FloatTensor<Self>, p: f64) -> FloatTensor<Self> {
        match DropoutBackward.prepare::<C>([x.node()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let (out, seed) = forward(&x.into_primitive().tensor, p);
                prep.finish((seed, p), TchTensor::new(out))
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
mod tests {
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
