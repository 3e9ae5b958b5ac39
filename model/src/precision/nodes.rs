//! The reduced-precision ops as autodiff nodes (a LibTorch backend extension): the quantised
//! linear layer, DoRA's weight terms, and SwiGLU keeping its inputs in the storage asked for.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::libtorch::TchTensor;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, AutodiffBackend, Backend, Dispatch, LibTorch, backend_extension};
use burn::tensor::Tensor;
use tch::Kind;

use super::linear::{LinearPrecision, LinearState, LinearWeight};
use super::spec::Storage;
use crate::fp8::{Fp8Format, Fp8Tensor, SharedCodes, WriteCodes};
use crate::shard::FrozenWeight;

/// Bytes of activations the ops in this module saved for backward since the last
/// [`take_saved_bytes`]; benchmarks read it to compare storage formats.
static SAVED_BYTES: AtomicUsize = AtomicUsize::new(0);

/// Returns the activation bytes saved for backward by this module's ops and resets the count.
pub fn take_saved_bytes() -> usize {
    SAVED_BYTES.swap(0, Ordering::Relaxed)
}

/// `x·Wᵀ` in the precision of `quant`, Burn-facing.
///
/// `train` records amaxes for delayed scaling (evaluation does not).
///
/// # Shapes
/// - x: `[batch, seq, in]`
/// - w: `[out, in]`, a parameter (trainable or not)
/// - output: `[batch, seq, out]`
pub fn precision_linear(x: Tensor<3>, w: Tensor<2>, quant: &Arc<LinearPrecision>, train: bool) -> Tensor<3> {
    precision_linear_reading(x, w, quant, train, None)
}

/// [`precision_linear`] taking its input's FP8 codes from `shared` where another reader of `x`
/// made them (or its writer handed them over).
///
/// # Shapes
/// As [`precision_linear`].
pub fn precision_linear_reading(
    x: Tensor<3>,
    w: Tensor<2>,
    quant: &Arc<LinearPrecision>,
    train: bool,
    shared: Option<&SharedCodes>,
) -> Tensor<3> {
    Tensor::from_dispatch(<Dispatch as PrecisionBackend>::precision_linear(
        x.into_dispatch(),
        w.into_dispatch(),
        quant.clone(),
        train,
        shared.cloned(),
    ))
}

/// [`precision_linear`] of a frozen weight stored in reduced precision or sharded: no gradient
/// for the weight, none kept of the input.
/// The input's FP8 codes are taken from `shared` as [`precision_linear_reading`] takes them.
///
/// # Shapes
/// - x: `[batch, seq, in]`; w: `[out, in]`
/// - output: `[batch, seq, out]`
pub fn frozen_linear(
    x: Tensor<3>,
    w: &FrozenWeight,
    quant: &Arc<LinearPrecision>,
    train: bool,
    shared: Option<&SharedCodes>,
) -> Tensor<3> {
    Tensor::from_dispatch(<Dispatch as PrecisionBackend>::frozen_linear(
        x.into_dispatch(),
        w.clone(),
        quant.clone(),
        train,
        shared.cloned(),
    ))
}

/// The frozen weight's part of DoRA's row norms (`LoraLinear::dora_norm`), without autodiff:
/// `‖Wᵢ‖²` per row and `A·Wᵀ`, both f32, from the weight as `quant` stores it.
///
/// # Shapes
/// - a: `[r, in]`; w: `[out, in]`, a parameter
/// - output: `[out]` and `[r, out]`
pub fn weight_row_terms(a: Tensor<2>, w: Tensor<2>, quant: &Arc<LinearPrecision>) -> (Tensor<1>, Tensor<2>) {
    let w = w.detach();
    let row_sq = <Dispatch as PrecisionBackend>::weight_row_sq(w.clone().into_dispatch(), quant.clone());
    let aw =
        <Dispatch as PrecisionBackend>::times_weight_t(a.detach().into_dispatch(), w.into_dispatch(), quant.clone());
    (Tensor::from_dispatch(row_sq), Tensor::from_dispatch(aw))
}

/// [`weight_row_terms`] of a stored (or sharded) frozen weight.
///
/// # Shapes
/// As [`weight_row_terms`].
pub fn stored_row_terms(a: Tensor<2>, w: &FrozenWeight, quant: &Arc<LinearPrecision>) -> (Tensor<1>, Tensor<2>) {
    let a = a.detach();
    let row_sq = <Dispatch as PrecisionBackend>::stored_row_sq(a.clone().into_dispatch(), w.clone(), quant.clone());
    let aw = <Dispatch as PrecisionBackend>::stored_times_weight_t(a.into_dispatch(), w.clone(), quant.clone());
    (Tensor::from_dispatch(row_sq), Tensor::from_dispatch(aw))
}

/// `silu(gate) · up`, keeping gate and up for backward in `storage` (the only tensors its
/// backward needs; Burn's composite keeps more, in f32).
///
/// # Shapes
/// - gate, up: `[batch, seq, I]`
/// - output: `[batch, seq, I]`
pub fn swiglu(gate: Tensor<3>, up: Tensor<3>, storage: Storage, h_codes: Option<WriteCodes>) -> Tensor<3> {
    Tensor::from_dispatch(<Dispatch as PrecisionBackend>::swiglu(
        gate.into_dispatch(),
        up.into_dispatch(),
        storage,
        h_codes,
    ))
}

/// Backend extension: the reduced-precision ops.
#[backend_extension(Autodiff, LibTorch)]
pub trait PrecisionBackend: Backend {
    /// See [`precision_linear`].
    fn precision_linear(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        quant: Arc<LinearPrecision>,
        train: bool,
        shared: Option<SharedCodes>,
    ) -> FloatTensor<Self>;
    /// See [`frozen_linear`].
    fn frozen_linear(
        x: FloatTensor<Self>,
        w: FrozenWeight,
        quant: Arc<LinearPrecision>,
        train: bool,
        shared: Option<SharedCodes>,
    ) -> FloatTensor<Self>;
    /// See [`swiglu`].
    fn swiglu(
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        storage: Storage,
        h_codes: Option<WriteCodes>,
    ) -> FloatTensor<Self>;
    /// `‖Wᵢ‖²` per row, f32, untracked (see [`weight_row_terms`]).
    fn weight_row_sq(w: FloatTensor<Self>, quant: Arc<LinearPrecision>) -> FloatTensor<Self>;
    /// `a·Wᵀ`, f32, untracked (see [`weight_row_terms`]).
    fn times_weight_t(a: FloatTensor<Self>, w: FloatTensor<Self>, quant: Arc<LinearPrecision>) -> FloatTensor<Self>;
    /// `‖Wᵢ‖²` of a stored weight, f32, untracked, on `like`'s device (see [`stored_row_terms`]).
    fn stored_row_sq(like: FloatTensor<Self>, w: FrozenWeight, quant: Arc<LinearPrecision>) -> FloatTensor<Self>;
    /// `a·Wᵀ` of a stored weight, f32, untracked (see [`stored_row_terms`]).
    fn stored_times_weight_t(a: FloatTensor<Self>, w: FrozenWeight, quant: Arc<LinearPrecision>) -> FloatTensor<Self>;
}

impl PrecisionBackend for LibTorch {
    fn precision_linear(
        x: TchTensor,
        w: TchTensor,
        quant: Arc<LinearPrecision>,
        train: bool,
        shared: Option<SharedCodes>,
    ) -> TchTensor {
        TchTensor::new(quant.forward(&x, &LinearWeight::Param(w), train, false, shared.as_ref()).y)
    }

    fn frozen_linear(
        x: TchTensor,
        w: FrozenWeight,
        quant: Arc<LinearPrecision>,
        train: bool,
        shared: Option<SharedCodes>,
    ) -> TchTensor {
        TchTensor::new(quant.forward(&x, &LinearWeight::Stored(w), train, false, shared.as_ref()).y)
    }

    fn swiglu(gate: TchTensor, up: TchTensor, _storage: Storage, _h_codes: Option<WriteCodes>) -> TchTensor {
        TchTensor::new(gate.tensor.silu() * &up.tensor)
    }

    fn weight_row_sq(w: TchTensor, quant: Arc<LinearPrecision>) -> TchTensor {
        TchTensor::new(quant.weight_row_sq(&LinearWeight::Param(w)))
    }

    fn times_weight_t(a: TchTensor, w: TchTensor, quant: Arc<LinearPrecision>) -> TchTensor {
        TchTensor::new(quant.times_weight_t(&a.tensor, &LinearWeight::Param(w)))
    }

    fn stored_row_sq(_like: TchTensor, w: FrozenWeight, quant: Arc<LinearPrecision>) -> TchTensor {
        TchTensor::new(quant.weight_row_sq(&LinearWeight::Stored(w)))
    }

    fn stored_times_weight_t(a: TchTensor, w: FrozenWeight, quant: Arc<LinearPrecision>) -> TchTensor {
        TchTensor::new(quant.times_weight_t(&a.tensor, &LinearWeight::Stored(w)))
    }
}

#[derive(Debug)]
struct PrecisionLinearBackward;

impl Backward<LibTorch, 2> for PrecisionLinearBackward {
    type State = LinearState;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [node_x, node_w] = ops.parents;
        let grad = grads.consume::<LibTorch>(&ops.node);
        let st = ops.state;
        let (dx, dw) = st.quant.backward(&grad.tensor, &st.w, &st, node_x.is_some(), node_w.is_some());
        if let (Some(node), Some(dx)) = (node_x, dx) {
            grads.register::<LibTorch>(node.id, TchTensor::new(dx));
        }
        if let (Some(node), Some(dw)) = (node_w, dw) {
            grads.register::<LibTorch>(node.id, TchTensor::new(dw));
        }
    }
}

/// The backward of [`frozen_linear`]: the input's gradient only.
#[derive(Debug)]
struct FrozenLinearBackward;

impl Backward<LibTorch, 1> for FrozenLinearBackward {
    type State = LinearState;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [node_x] = ops.parents;
        let grad = grads.consume::<LibTorch>(&ops.node);
        let (Some(node), st) = (node_x, ops.state) else { return };
        if let (Some(dx), _) = st.quant.backward(&grad.tensor, &st.w, &st, true, false) {
            grads.register::<LibTorch>(node.id, TchTensor::new(dx));
        }
    }
}

/// What one tensor saved by SwiGLU became.
#[derive(Debug, Clone)]
enum Kept {
    /// As computed, or cast to bf16.
    Plain(TchTensor),
    /// E4M3 codes at current scaling (the inverse scale a 0-dim tensor on the device).
    Fp8(Fp8Tensor),
}

impl Kept {
    fn keep(x: TchTensor, storage: Storage) -> Self {
        match storage {
            Storage::F32 => Self::Plain(x),
            Storage::Bf16 => Self::Plain(TchTensor::new(x.tensor.to_kind(Kind::BFloat16))),
            Storage::Fp8 => Self::Fp8(crate::fp8::Quantizer::Current(Fp8Format::E4M3).quantize(&x.tensor)),
        }
    }

    /// The tensor in `kind` (the activations' dtype).
    fn get(&self, kind: Kind) -> tch::Tensor {
        match self {
            Self::Plain(t) => t.tensor.to_kind(kind),
            Self::Fp8(q) => q.dequantize().to_kind(kind),
        }
    }

    fn bytes(&self) -> usize {
        match self {
            Self::Plain(t) => t.tensor.numel() * t.tensor.kind().elt_size_in_bytes(),
            Self::Fp8(q) => q.bytes(),
        }
    }
}

#[derive(Debug)]
struct SwigluBackward;

/// SwiGLU's backward on our kernel (`swiglu_route.rs`), reading gate's and up's E4M3 codes
/// directly: `None` where they are not both codes, the route is not taken, or it fails
/// (logged; the LibTorch ops run).
fn kernel_backward(kept: &(Kept, Kept), grad: &tch::Tensor) -> Option<(tch::Tensor, tch::Tensor)> {
    let (Kept::Fp8(gate), Kept::Fp8(up)) = kept else { return None };
    if !super::swiglu_route::takes_kernel(grad, Storage::Fp8) {
        return None;
    }
    super::swiglu_route::backward(gate, up, grad)
        .inspect_err(|e| tracing::warn!("our FP8 SwiGLU backward failed, LibTorch's runs: {e}"))
        .ok()
}

/// SwiGLU's forward on our kernel, keeping gate and up as its E4M3 codes and, with `h_codes`
/// (down_proj's delayed input scale and the handle down_proj reads), handing over h's codes:
/// `None` where the route is not taken or fails (logged; the LibTorch ops run).
fn kernel_forward(
    gate: &TchTensor,
    up: &TchTensor,
    storage: Storage,
    h_codes: Option<&WriteCodes>,
) -> Option<(TchTensor, (Kept, Kept))> {
    if !super::swiglu_route::takes_kernel(&gate.tensor, storage) {
        return None;
    }
    let f = super::swiglu_route::forward(&gate.tensor, &up.tensor, h_codes.map(|w| w.scale))
        .inspect_err(|e| tracing::warn!("our FP8 SwiGLU forward failed, LibTorch's runs: {e}"))
        .ok()?;
    if let (Some(hc), Some(write)) = (f.h_codes, h_codes) {
        let (codes, amax) = hc.written();
        write.to.offer(codes, amax, write.scale);
    }
    Some((TchTensor::new(f.h), (Kept::Fp8(f.gate), Kept::Fp8(f.up))))
}

impl Backward<LibTorch, 2> for SwigluBackward {
    type State = (Kept, Kept);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [node_gate, node_up] = ops.parents;
        let grad = grads.consume::<LibTorch>(&ops.node);
        // Gradients in the activations' dtype, computed as torch's autograd does for
        // `silu(gate) * up`: torch's `silu_backward` kernel (f32 math inside, one pass). At most
        // three `[tokens, I]` tensors live at once besides the kept inputs (at 70B and 8192
        // tokens each is 0.47 GB in bf16).
        if let Some((grad_gate, grad_up)) = kernel_backward(&ops.state, &grad.tensor) {
            if let Some(node) = node_up {
                grads.register::<LibTorch>(node.id, TchTensor::new(grad_up));
            }
            if let Some(node) = node_gate {
                grads.register::<LibTorch>(node.id, TchTensor::new(grad_gate));
            }
            return;
        }
        let kind = grad.tensor.kind();
        let gate = ops.state.0.get(kind);
        if let Some(node) = node_up {
            grads.register::<LibTorch>(node.id, TchTensor::new(&grad.tensor * gate.silu()));
        }
        if let Some(node) = node_gate {
            let grad_up = &grad.tensor * ops.state.1.get(kind);
            grads.register::<LibTorch>(node.id, TchTensor::new(gate.silu_backward(&grad_up)));
        }
    }
}

impl<C: CheckpointStrategy> PrecisionBackend for Autodiff<LibTorch, C> {
    fn precision_linear(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        quant: Arc<LinearPrecision>,
        train: bool,
        shared: Option<SharedCodes>,
    ) -> FloatTensor<Self> {
        use burn::backend::ops::FloatTensorOps;
        let w_trainable = <Self as FloatTensorOps<Self>>::float_is_require_grad(&w);
        let nodes = [x.node(), w.node()];
        match PrecisionLinearBackward.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let (x, w) = (x.into_primitive(), w.into_primitive());
                let (x_size, x_kind) = (x.tensor.size(), x.tensor.kind());
                let w = LinearWeight::Param(w);
                let fwd = quant.forward(&x, &w, train, w_trainable, shared.as_ref());
                if let Some((saved, _)) = &fwd.saved {
                    SAVED_BYTES.fetch_add(saved.bytes(), Ordering::Relaxed);
                }
                let state = LinearState { quant, w, saved: fwd.saved, w_scale: fwd.w_scale, x_size, x_kind };
                prep.finish(state, TchTensor::new(fwd.y))
            }
            OpsKind::UnTracked(prep) => {
                let (x, w) = (x.into_primitive(), w.into_primitive());
                prep.finish(TchTensor::new(quant.forward(&x, &LinearWeight::Param(w), train, false, shared.as_ref()).y))
            }
        }
    }

    fn frozen_linear(
        x: FloatTensor<Self>,
        w: FrozenWeight,
        quant: Arc<LinearPrecision>,
        train: bool,
        shared: Option<SharedCodes>,
    ) -> FloatTensor<Self> {
        let w = LinearWeight::Stored(w);
        match FrozenLinearBackward.prepare::<C>([x.node()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let x = x.into_primitive();
                let (x_size, x_kind) = (x.tensor.size(), x.tensor.kind());
                let fwd = quant.forward(&x, &w, train, false, shared.as_ref());
                let state = LinearState { quant, w, saved: None, w_scale: fwd.w_scale, x_size, x_kind };
                prep.finish(state, TchTensor::new(fwd.y))
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(TchTensor::new(quant.forward(&x.into_primitive(), &w, train, false, shared.as_ref()).y))
            }
        }
    }

    fn weight_row_sq(w: FloatTensor<Self>, quant: Arc<LinearPrecision>) -> FloatTensor<Self> {
        Self::from_inner(LibTorch::weight_row_sq(Self::inner(w), quant))
    }

    fn times_weight_t(a: FloatTensor<Self>, w: FloatTensor<Self>, quant: Arc<LinearPrecision>) -> FloatTensor<Self> {
        Self::from_inner(LibTorch::times_weight_t(Self::inner(a), Self::inner(w), quant))
    }

    fn stored_row_sq(like: FloatTensor<Self>, w: FrozenWeight, quant: Arc<LinearPrecision>) -> FloatTensor<Self> {
        Self::from_inner(LibTorch::stored_row_sq(Self::inner(like), w, quant))
    }

    fn stored_times_weight_t(a: FloatTensor<Self>, w: FrozenWeight, quant: Arc<LinearPrecision>) -> FloatTensor<Self> {
        Self::from_inner(LibTorch::stored_times_weight_t(Self::inner(a), w, quant))
    }

    fn swiglu(
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        storage: Storage,
        h_codes: Option<WriteCodes>,
    ) -> FloatTensor<Self> {
        let nodes = [gate.node(), up.node()];
        match SwigluBackward.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let (gate, up) = (gate.into_primitive(), up.into_primitive());
                let (out, state) = kernel_forward(&gate, &up, storage, h_codes.as_ref()).unwrap_or_else(|| {
                    (
                        TchTensor::new(gate.tensor.silu() * &up.tensor),
                        (Kept::keep(gate, storage), Kept::keep(up, storage)),
                    )
                });
                SAVED_BYTES.fetch_add(state.0.bytes() + state.1.bytes(), Ordering::Relaxed);
                prep.finish(state, out)
            }
            OpsKind::UnTracked(prep) => {
                let (gate, up) = (gate.into_primitive(), up.into_primitive());
                prep.finish(TchTensor::new(gate.tensor.silu() * &up.tensor))
            }
        }
    }
}
