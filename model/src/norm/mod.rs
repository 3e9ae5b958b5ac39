//! Root-mean-square layer norm, fused on LibTorch devices: one autodiff node that keeps the
//! input as it came (bf16 under bf16 compute) and one f32 statistic per row, where the
//! composite of Burn ops kept an f32 copy of the input (twice the bytes of a bf16 one) and the
//! normalised values for backward. Two norms per decoder block: at 70B and bf16 that is 16 KB
//! per token per norm instead of 32-48. On CUDA the node's forward and backward are LibTorch's
//! fused kernels (`cuda.rs`, one kernel each way); elsewhere a handful of LibTorch ops.

pub(crate) mod composite;
mod cuda;
pub mod fp8_route;

pub use cuda::ROUTE as FUSED_KERNELS_ROUTE;

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::libtorch::TchTensor;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, Dispatch, DispatchDevice, LibTorch, backend_extension};
use burn::module::{Module, Param};
use burn::tensor::{DType, Tensor};

use crate::fp8::WriteCodes;
use crate::precision::PrecisionSpec;
use crate::saved::Saved;

/// Root-mean-square layer norm `w · x / √(mean(x²) + ε)` (no mean subtraction, no bias).
#[derive(Module, Debug)]
pub struct RmsNorm {
    /// Per-channel gain `[d]`.
    pub weight: Param<Tensor<1>>,
    /// ε inside the square root.
    #[module(skip)]
    pub eps: f64,
}

impl RmsNorm {
    /// What the fused norm keeps for backward per token: its input as it came (`input` names
    /// it) and one f32 1/rms.
    pub fn saved_per_token(input: &str, d: usize, spec: &PrecisionSpec) -> [Saved; 2] {
        let why = "fused RMSNorm backward (its input as it came, model/src/norm)";
        [
            Saved::new(input, spec.activation_bytes() * d as f64, why),
            Saved::new(format!("{input}: 1/rms"), 4.0, "RMSNorm backward"),
        ]
    }

    /// Normalises over the last dimension.
    ///
    /// # Shapes
    /// - x: `[batch, seq, d]`
    /// - output: `[batch, seq, d]`
    ///
    /// In the input's dtype; a bf16 input is normalised in f32 and cast back before the gain,
    /// as HF's `LlamaRMSNorm` does (mean(x²) in bf16 would lose the small channels).
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        self.forward_fp8(x, None)
    }

    /// [`Self::forward`], also writing the output's E4M3 codes at `codes.scale` (the next FP8
    /// GEMMs' delayed input scale) where our kernel runs ([`fp8_route`]), handed to those
    /// GEMMs in `codes.to`.
    ///
    /// # Shapes
    /// As [`Self::forward`].
    pub fn forward_fp8(&self, x: Tensor<3>, codes: Option<WriteCodes>) -> Tensor<3> {
        if matches!(x.device().inner().as_dispatch(), DispatchDevice::LibTorch(_)) {
            Tensor::from_dispatch(<Dispatch as FusedRmsNormBackend>::rms_norm(
                x.into_dispatch(),
                self.weight.val().into_dispatch(),
                self.eps,
                codes,
            ))
        } else {
            self.composite(x)
        }
    }

    /// [`Self::forward`] as a composite of Burn ops (other backends; tests compare the two).
    ///
    /// # Shapes
    /// As [`Self::forward`].
    pub fn composite(&self, x: Tensor<3>) -> Tensor<3> {
        let dtype = x.dtype();
        let x = x.cast(DType::F32);
        let inv_rms = x.clone().square().mean_dim(2).add_scalar(self.eps).sqrt().recip();
        (x * inv_rms).cast(dtype) * self.weight.val().cast(dtype).unsqueeze::<3>()
    }
}

/// Backend extension: RMSNorm as one op with its own backward.
#[backend_extension(Autodiff, LibTorch)]
pub trait FusedRmsNormBackend: Backend {
    /// `w · x / √(mean(x²) + ε)` over the last dimension, in x's dtype (statistics in f32).
    /// With `codes`, the output's FP8 codes are handed to the next GEMMs where our kernel
    /// runs ([`RmsNorm::forward_fp8`]).
    fn rms_norm(x: FloatTensor<Self>, w: FloatTensor<Self>, eps: f64, codes: Option<WriteCodes>) -> FloatTensor<Self>;
}

/// The norm's output and `inv_rms` (f32, `[.., 1]`), and whether the fused CUDA kernel made them.
///
/// # Shapes
/// - x: `[.., d]`; w: `[d]`; output: as x, in x's dtype
fn norm_forward(
    x: &tch::Tensor,
    w: &tch::Tensor,
    eps: f64,
    codes: Option<WriteCodes>,
) -> (tch::Tensor, tch::Tensor, bool) {
    if let Some(write) = codes.filter(|_| fp8_route::takes_kernel(x)) {
        match fp8_route::forward(x, w, eps, write.scale, false) {
            Ok(n) => {
                write.to.offer(n.codes, n.amax, write.scale);
                // LibTorch's fused backward reads the same 1/rms where it passed its check.
                return (n.y, n.inv_rms, cuda::usable(x));
            }
            Err(e) => tracing::warn!("our FP8 RMSNorm kernel failed, the norm runs as before: {e}"),
        }
    }
    let w = w.to_kind(x.kind());
    if cuda::usable(x) {
        match cuda::forward(x, &w, eps) {
            Ok((y, r)) => return (y, r, true),
            Err(e) => tracing::warn!("fused RMSNorm forward failed, using the composite: {e}"),
        }
    }
    let r = composite::inv_rms(x, eps);
    (composite::normalised(x, &r) * w, r, false)
}

impl FusedRmsNormBackend for LibTorch {
    fn rms_norm(x: TchTensor, w: TchTensor, eps: f64, codes: Option<WriteCodes>) -> TchTensor {
        TchTensor::new(norm_forward(&x.tensor, &w.tensor, eps, codes).0)
    }
}

/// Autodiff node of the fused norm.
#[derive(Debug)]
struct RmsNormBackward;

/// What the node keeps: the input (as it came), the gain, `inv_rms` (f32, one per row), and
/// whether the fused CUDA kernel ran forward (then its backward runs too).
#[derive(Debug, Clone)]
struct RmsNormState {
    x: TchTensor,
    w: TchTensor,
    r: TchTensor,
    fused: bool,
}

/// The fused kernel's (dx, dw) where the forward was fused: dw only where the gain is in x's
/// dtype (the kernel returns it in that dtype; an f32 gain's gradient stays f32 through the
/// composite). A failure leaves both to the composite.
fn fused_backward(
    dy: &tch::Tensor,
    st: &RmsNormState,
    [want_dx, want_dw]: [bool; 2],
) -> (Option<tch::Tensor>, Option<tch::Tensor>) {
    let (x, w) = (&st.x.tensor, &st.w.tensor);
    if !st.fused {
        return (None, None);
    }
    let want_dw = want_dw && w.kind() == x.kind();
    match cuda::backward(&dy.contiguous(), x, &st.r.tensor, &w.to_kind(x.kind()), [want_dx, want_dw]) {
        Ok(grads) => grads,
        Err(e) => {
            tracing::warn!("fused RMSNorm backward failed, using the composite: {e}");
            (None, None)
        }
    }
}

impl Backward<LibTorch, 2> for RmsNormBackward {
    type State = RmsNormState;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [node_x, node_w] = ops.parents;
        let dy = grads.consume::<LibTorch>(&ops.node).tensor;
        let (fused_dx, fused_dw) = fused_backward(&dy, &ops.state, [node_x.is_some(), node_w.is_some()]);
        let RmsNormState { x, w, r, .. } = ops.state;
        let (x, w, r) = (&x.tensor, &w.tensor, &r.tensor);
        if let Some(node) = node_w {
            let dw = fused_dw.map(|dw| dw.to_kind(w.kind())).unwrap_or_else(|| composite::dw(&dy, x, r, w.kind()));
            grads.register::<LibTorch>(node.id, TchTensor::new(dw));
        }
        if let Some(node) = node_x {
            let dx = fused_dx.unwrap_or_else(|| composite::dx(&dy, x, r, w));
            grads.register::<LibTorch>(node.id, TchTensor::new(dx));
        }
    }
}

impl<C: CheckpointStrategy> FusedRmsNormBackend for Autodiff<LibTorch, C> {
    fn rms_norm(x: FloatTensor<Self>, w: FloatTensor<Self>, eps: f64, codes: Option<WriteCodes>) -> FloatTensor<Self> {
        let nodes = [x.node(), w.node()];
        let (x, w) = (x.into_primitive(), w.into_primitive());
        let (y, r, fused) = norm_forward(&x.tensor, &w.tensor, eps, codes);
        let y = TchTensor::new(y);
        match RmsNormBackward.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish(RmsNormState { x, w, r: TchTensor::new(r), fused }, y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Device, Distribution};

    /// The fused norm equals the composite one in value and in both gradients (input and
    /// gain), in f32 and in bf16 (the composite's gradients in bf16 are themselves rounded, so
    /// bf16 is compared within 1% of the largest value).
    #[test]
    fn fused_matches_composite_forward_and_backward() {
        fused_matches_composite(&Device::libtorch().autodiff());
    }

    /// The same through the CUDA route's plumbing on the CPU standing in for CUDA
    /// (`_fused_rms_norm` forward, the composite backward): the node's fused branch, its saved
    /// statistics and both gradients.
    #[test]
    fn the_cuda_route_matches_composite_on_the_cpu_standing_in() {
        crate::routes::tests::on_cpu_within(120, "the fused norm node on the CPU", || {
            fused_matches_composite(&Device::libtorch().autodiff());
            assert!(FUSED_KERNELS_ROUTE.used());
        });
    }

    /// The same on a CUDA device, where the node runs LibTorch's fused kernels (and they ran).
    #[test]
    #[ignore = "needs CUDA"]
    fn cuda_fused_matches_composite_forward_and_backward() {
        assert!(tch::Cuda::is_available(), "needs a CUDA device");
        fused_matches_composite(&Device::libtorch_cuda(0).autodiff());
        assert!(FUSED_KERNELS_ROUTE.used());
    }

    fn fused_matches_composite(device: &Device) {
        let _rng = crate::device::torch_rng_lock();
        device.seed(3);
        let (b, s, d) = (2, 5, 64);
        let x0 = Tensor::<3>::random([b, s, d], Distribution::Normal(0.0, 3.0), device);
        let w0 = Tensor::<1>::random([d], Distribution::Normal(1.0, 0.2), device);
        let g = Tensor::<3>::random([b, s, d], Distribution::Normal(0.0, 1.0), device);
        for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 1e-2)] {
            let run = |fused: bool| {
                let x = x0.clone().cast(dtype).require_grad();
                let norm = RmsNorm { weight: Param::from_tensor(w0.clone().require_grad()), eps: 1e-5 };
                let y = if fused { norm.forward(x.clone()) } else { norm.composite(x.clone()) };
                assert_eq!(y.dtype(), dtype);
                let grads = (y.clone().cast(DType::F32) * g.clone()).sum().backward();
                let dw = norm.weight.val().grad(&grads).unwrap();
                [y.cast(DType::F32), x.grad(&grads).unwrap().cast(DType::F32), dw.unsqueeze::<3>()]
            };
            let (f, c) = (run(true), run(false));
            for (name, got, want) in [("y", &f[0], &c[0]), ("dx", &f[1], &c[1]), ("dw", &f[2], &c[2])] {
                let err = (got.clone() - want.clone()).abs().max().into_scalar::<f32>();
                let scale = want.clone().abs().max().into_scalar::<f32>();
                assert!(err <= tol * scale, "{name} in {dtype:?}: error {err:e} of {scale:e}");
            }
        }
    }

    /// Hand-derived: x = (3, 4) has mean(x²) = 12.5, so with ε = 0 and gain (1, 2) the output
    /// is (3, 8) / √12.5.
    #[test]
    fn normalises_a_hand_checked_row() {
        let device = Device::libtorch();
        let x = Tensor::<3>::from_data([[[3.0f32, 4.0]]], &device);
        let norm = RmsNorm { weight: Param::from_tensor(Tensor::from_data([1.0f32, 2.0], &device)), eps: 0.0 };
        let y = norm.forward(x).into_data().to_vec::<f32>().unwrap();
        let r = 12.5f32.sqrt();
        assert!((y[0] - 3.0 / r).abs() < 1e-6 && (y[1] - 8.0 / r).abs() < 1e-6, "{y:?}");
    }
}
