//! Inverted dropout as one LibTorch op that keeps a 1-byte mask for backward.
//!
//! Burn's composite (`x · bernoulli_mask / (1 − p)`) draws an f32 mask, multiplies twice and
//! keeps the f32 mask for backward. Here the mask is a bool tensor and `x · mask / (1 − p)` one
//! LibTorch kernel. The mask bits come from ChaCha8 (rand_chacha), not from torch's
//! `bernoulli_`: torch draws its CPU Bernoulli masks one element at a time through a
//! Mersenne Twister on one thread (4% of a tiny step, ~0.25 s of a `small` one in perf),
//! while ChaCha8 fills the words at memory speed. Each mask's ChaCha seed is one draw from
//! LibTorch's generator, which `Device::seed` seeds, so runs stay reproducible and resumable
//! (the trainer reseeds per step).

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::libtorch::TchTensor;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, Dispatch, LibTorch, backend_extension};
use burn::tensor::{Distribution, Tensor};

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

/// A keep-mask (true with probability 1 − p) shaped like `x`, on x's device.
fn keep_mask(x: &tch::Tensor, p: f64) -> tch::Tensor {
    use rand::{RngCore, SeedableRng};
    let seed = tch::Tensor::randint(i64::MAX, [1], (tch::Kind::Int64, tch::Device::Cpu)).int64_value(&[0]) as u64;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let n = x.numel();
    let mut bytes = vec![0u8; 4 * n];
    rng.fill_bytes(&mut bytes);
    // Keep when a uniform 32-bit word is below (1 − p)·2³²: exact to 2⁻³².
    let threshold = ((1.0 - p) * 4_294_967_296.0) as u64;
    let keep: Vec<u8> = bytes
        .chunks_exact(4)
        .map(|w| u8::from(u64::from(u32::from_le_bytes([w[0], w[1], w[2], w[3]])) < threshold))
        .collect();
    tch::Tensor::from_slice(&keep).to_kind(tch::Kind::Bool).reshape(x.size()).to_device(x.device())
}

/// `(x · mask / (1 − p), mask)`; `native_dropout_backward` is exactly that product.
fn forward(x: &tch::Tensor, p: f64) -> (tch::Tensor, tch::Tensor) {
    if x.device().is_cuda() {
        // CUDA's Bernoulli is a fast parallel Philox; a host-made mask would cost a copy.
        return x.native_dropout(p, true);
    }
    let mask = keep_mask(x, p);
    (tch::Tensor::native_dropout_backward(x, &mask, 1.0 / (1.0 - p)), mask)
}

impl DropoutBackend for LibTorch {
    fn dropout(x: TchTensor, p: f64) -> TchTensor {
        TchTensor::new(forward(&x.tensor, p).0)
    }
}

#[derive(Debug)]
struct DropoutBackward;

impl Backward<LibTorch, 1> for DropoutBackward {
    /// The bool mask and 1/(1−p).
    type State = (TchTensor, f64);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [node] = ops.parents;
        let grad = grads.consume::<LibTorch>(&ops.node);
        if let Some(node) = node {
            let (mask, scale) = &ops.state;
            grads.register::<LibTorch>(
                node.id,
                TchTensor::new(tch::Tensor::native_dropout_backward(&grad.tensor, &mask.tensor, *scale)),
            );
        }
    }
}

impl<C: CheckpointStrategy> DropoutBackend for Autodiff<LibTorch, C> {
    fn dropout(x: FloatTensor<Self>, p: f64) -> FloatTensor<Self> {
        match DropoutBackward.prepare::<C>([x.node()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let (out, mask) = forward(&x.into_primitive().tensor, p);
                prep.finish((TchTensor::new(mask), 1.0 / (1.0 - p)), TchTensor::new(out))
            }
            OpsKind::UnTracked(prep) => prep.finish(TchTensor::new(forward(&x.into_primitive().tensor, p).0)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Device;

    /// Kept elements are x/(1−p), dropped ones 0, about p of them dropped, and the gradient is
    /// the same mask and scale; the same seed gives the same mask.
    #[test]
    fn drops_scales_and_backpropagates_the_same_mask() {
        let device = Device::libtorch().autodiff();
        let x0 = Tensor::<2>::ones([64, 256], &device).mul_scalar(3.0);
        let run = || {
            device.seed(42);
            let x = x0.clone().require_grad();
            let y = dropout(x.clone(), 0.25);
            let grads = y.clone().sum().backward();
            (
                y.inner().into_data().to_vec::<f32>().unwrap(),
                x.grad(&grads).unwrap().into_data().to_vec::<f32>().unwrap(),
            )
        };
        let (y, g) = run();
        assert!(y.iter().all(|&v| v == 0.0 || v == 4.0), "values other than 0 and 3/(1−0.25)");
        let dropped = y.iter().filter(|&&v| v == 0.0).count() as f64 / y.len() as f64;
        assert!((dropped - 0.25).abs() < 0.02, "dropped {dropped}");
        let expect: Vec<f32> = y.iter().map(|&v| v / 3.0).collect();
        assert_eq!(g, expect, "gradient = mask / (1 − p)");
        assert_eq!(run().0, y, "same seed, same mask");
    }
}
