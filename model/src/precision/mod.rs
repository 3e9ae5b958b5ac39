//! Reduced-precision training: bf16 or FP8 (Transformer Engine's "hybrid" recipe) around the
//! linear layers, activations saved for backward in 8 bits, and frozen base weights in FP8.
//!
//! ```text
//!   forward   y  = Q₄₃(x; sₓ) · Q₄₃(W; s_w)ᵀ        Q₄₃: E4M3 quantise-dequantise
//!   backward  dx = Q₅₂(g; s_g) · Q₄₃(W; s_w)         Q₅₂: E5M2
//!             dW = Q₅₂(g; s_g)ᵀ · Q₄₃(x; sₓ)          (trainable W only: LoRA's A and B)
//! ```
//! Each scale comes from [`DelayedScaling`] (one per tensor role and layer). The frozen base
//! layers' `y` and `dx` GEMMs run on torch's `_scaled_mm` ([`scaled_mm`]: FP8 tensor cores on
//! CUDA sm_89+, oneDNN on the CPU), f32 accumulation, output in the activations' dtype. `dW`
//! exists only for trainable weights (LoRA's, which run in bf16: [`PrecisionSpec::for_adapters`];
//! an FP8 trainable weight, in tests, takes an f32 GEMM on the dequantised operands, which is
//! what an FP8 GEMM with f32 accumulation computes up to summation order).
//!
//! What is stored, and in which dtype:
//! - `compute = "fp8"`: a linear layer whose weight is trainable keeps its input for the
//!   weight gradient. With `fp8_activations` it keeps the E4M3 codes it computed with (1 byte,
//!   bit-identical gradients); without, the f32 input, quantised again in backward.
//! - `fp8_activations` also stores the SwiGLU inputs (gate and up, the MLP's largest saved
//!   tensors) as E4M3 with a per-tensor scale from their own amax (current scaling: the
//!   amax is at hand when they are written), and, for `compute` fp32/bf16, linear inputs.
//! - `fp8_weights` (with `compute = "fp8"`): frozen base weights are quantised once after
//!   loading (E4M3, scale from their exact amax) and the f32 copy is dropped; `compute =
//!   "bf16"` keeps frozen weights in bf16.
//!
//! Everything here is a LibTorch backend extension (CPU and CUDA); other backends run fp32.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::libtorch::TchTensor;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, AutodiffBackend, Backend, Dispatch, LibTorch, backend_extension};
use burn::tensor::Tensor;
use serde::{Deserialize, Serialize};
use tch::Kind;

use crate::fp8::{
    AmaxSpec, DelayedScaling, Fp8Format, amax_tch, dequantize_tch, dequantize_with, quantize_current_on_device,
    quantize_tch,
};
use scaled_mm::{Fp8Operand, fp8_gemm};

pub mod bf16;
pub mod blocked;
pub mod nf4;
pub mod scaled_mm;
mod spec;
pub(crate) mod weights;

pub use crate::shard::FrozenWeight;
pub use spec::{Compute, Nf4Spec, PrecisionSpec, Storage};
pub use weights::{Nf4Scales, StoredWeight};

/// Bytes of activations the ops in this module saved for backward since the last
/// [`take_saved_bytes`]; benchmarks read it to compare storage formats.
static SAVED_BYTES: AtomicUsize = AtomicUsize::new(0);

/// Returns the activation bytes saved for backward by this module's ops and resets the count.
pub fn take_saved_bytes() -> usize {
    SAVED_BYTES.swap(0, Ordering::Relaxed)
}

/// The delayed-scaling states of one linear layer, by tensor role.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LinearScales {
    /// Forward input (E4M3).
    pub input: DelayedScaling,
    /// Weight (E4M3; unused when the weight is stored in FP8).
    pub weight: DelayedScaling,
    /// Gradient of the output (E5M2).
    pub grad: DelayedScaling,
}

/// Which delayed-scaling state of a layer a tensor feeds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The forward input.
    Input,
    /// The weight.
    Weight,
    /// The output gradient.
    Grad,
}

impl Role {
    const ALL: [Role; 3] = [Role::Input, Role::Weight, Role::Grad];
}

impl LinearScales {
    /// The state of `role`.
    pub fn get_mut(&mut self, role: Role) -> &mut DelayedScaling {
        match role {
            Role::Input => &mut self.input,
            Role::Weight => &mut self.weight,
            Role::Grad => &mut self.grad,
        }
    }

    fn new() -> Self {
        Self {
            input: DelayedScaling::new(Fp8Format::E4M3),
            weight: DelayedScaling::new(Fp8Format::E4M3),
            grad: DelayedScaling::new(Fp8Format::E5M2),
        }
    }
}

/// The reduced-precision state of one linear layer, shared by the module and the autodiff
/// nodes of its uses (which record amaxes into it).
#[derive(Debug)]
pub struct LinearQuant {
    /// The precision it runs in.
    pub spec: PrecisionSpec,
    /// The delayed-scaling states.
    pub scales: Mutex<LinearScales>,
    /// Amaxes of this step still on the device (0-dim f32), per [`Role`]: delayed scaling needs
    /// them only at the step's end, where the model reads all of them at once
    /// (`LlamaForCausalLM::settle_fp8_amaxes`), not once per GEMM.
    lazy: Mutex<[Vec<tch::Tensor>; 3]>,
    /// The frozen weight, when it is kept here (reduced precision, or sharded) rather than in
    /// the layer's parameter.
    pub stored: Option<FrozenWeight>,
}

/// Elements converted at a time when storing a weight (16 MB of f32).
const CONVERT_CHUNK: usize = 1 << 22;

/// `max |x|` of host values, NaN if any is NaN (as [`amax_tch`]).
fn host_amax(values: &[f32]) -> f32 {
    let mut amax = 0.0f32;
    for &x in values {
        if x.is_nan() {
            return f32::NAN;
        }
        amax = amax.max(x.abs());
    }
    amax
}

/// A scale for a tensor of the given amax: recorded during training, looked up otherwise.
fn scale_of(state: &mut DelayedScaling, amax: f32, spec: &AmaxSpec, train: bool) -> f32 {
    if train {
        state.observe(amax, spec)
    } else if state.initialized {
        state.scale
    } else {
        // Never trained: use the tensor's own amax without recording it.
        crate::fp8::scale_for_amax(amax, state.format.max(), spec.margin).unwrap_or(1.0)
    }
}

/// What a linear layer keeps of its input for the weight gradient.
#[derive(Debug, Clone)]
enum SavedInput {
    /// As it came (f32 or bf16 activations), to be quantised again in backward.
    AsIs(TchTensor),
    /// bf16.
    Bf16(TchTensor),
    /// E4M3 codes and the inverse scale (delayed scaling: known on the host).
    Fp8(TchTensor, f32),
    /// E4M3 codes and the inverse scale as a 0-dim tensor on the device (current scaling,
    /// computed there: see [`crate::fp8::quantize_current_on_device`]).
    Fp8Current(TchTensor, TchTensor),
}

impl SavedInput {
    fn bytes(&self) -> usize {
        match self {
            Self::AsIs(t) | Self::Bf16(t) => t.tensor.numel() * t.tensor.kind().elt_size_in_bytes(),
            Self::Fp8(t, _) | Self::Fp8Current(t, _) => t.tensor.numel() + 4,
        }
    }
}

impl LinearQuant {
    /// A fresh state; `stored` is the frozen weight in reduced precision, if any.
    pub fn new(spec: PrecisionSpec, stored: Option<FrozenWeight>) -> Self {
        Self { spec, scales: Mutex::new(LinearScales::new()), lazy: Mutex::new(Default::default()), stored }
    }

    /// The scale to quantise `x` with as `role`, recording its amax in training. Once the
    /// role has a scale (every use after its first), the amax stays on the device until
    /// [`Self::take_lazy_amaxes`]: quantising waits for nothing. The first use, and evaluation
    /// of a never-trained layer, read the amax now ([`scale_of`]).
    fn scale_for(&self, role: Role, x: &tch::Tensor, train: bool) -> f32 {
        let mut st = self.scales.lock().unwrap();
        let state = st.get_mut(role);
        if train && state.initialized && x.numel() > 0 {
            let amax = crate::fp8::amax_on_device(x);
            self.lazy.lock().unwrap()[role as usize].push(amax);
            return state.scale;
        }
        scale_of(state, amax_tch(x), &self.spec.amax, train)
    }

    /// The amaxes recorded on the device since the last call, one 0-dim f32 tensor per role
    /// that has any: the largest finite one, or −1 where none is finite (non-finite amaxes are
    /// not recorded, as [`DelayedScaling::observe`] skips them).
    pub fn take_lazy_amaxes(&self) -> Vec<(Role, tch::Tensor)> {
        let mut lazy = self.lazy.lock().unwrap();
        let mut out = Vec::new();
        for role in Role::ALL {
            let list = std::mem::take(&mut lazy[role as usize]);
            if list.is_empty() {
                continue;
            }
            let all = tch::Tensor::stack(&list, 0);
            out.push((role, all.masked_fill(&all.isfinite().logical_not(), -1.0).max()));
        }
        out
    }

    /// Records an amax read back from [`Self::take_lazy_amaxes`] (negative: none finite).
    pub fn record_amax(&self, role: Role, amax: f32) {
        if amax >= 0.0 {
            let _ = self.scales.lock().unwrap().get_mut(role).observe(amax, &self.spec.amax);
        }
    }

    /// Stores a frozen `[out, in]` f32 weight, given as host values, as `spec` asks (bf16 for
    /// bf16 compute, E4M3 with its exact amax for FP8 weights) on `device`; `None` when it
    /// stays in f32. Rows are converted a few MB at a time, so the only full-size buffers are
    /// `values` and the result (what loading a checkpoint can afford at 70B).
    pub fn store_weight(
        spec: &PrecisionSpec,
        values: &[f32],
        dims: [usize; 2],
        device: tch::Device,
    ) -> Option<StoredWeight> {
        Self::store_weight_in_chunks(spec, values, dims, device, CONVERT_CHUNK)
    }

    /// [`Self::store_weight`] converting about `chunk` elements (whole rows) at a time.
    fn store_weight_in_chunks(
        spec: &PrecisionSpec,
        values: &[f32],
        dims: [usize; 2],
        device: tch::Device,
        chunk: usize,
    ) -> Option<StoredWeight> {
        if let Some(nf4) = spec.nf4 {
            let [out, inp] = dims;
            assert_eq!(values.len(), out * inp, "store_weight: {} values for {dims:?}", values.len());
            let q = nf4::Nf4::quantize(values, nf4.block, nf4.double);
            return Some(StoredWeight::from_nf4(&q, dims, device));
        }
        let (kind, scale) = match spec.compute {
            Compute::Bf16 => (Kind::BFloat16, 1.0),
            Compute::Fp8 if spec.fp8_weights => {
                let amax = host_amax(values);
                let scale = crate::fp8::scale_for_amax(amax, Fp8Format::E4M3.max(), 0).unwrap_or(1.0);
                (Fp8Format::E4M3.kind(), scale)
            }
            _ => return None,
        };
        let [out, inp] = dims;
        assert_eq!(values.len(), out * inp, "store_weight: {} values for {dims:?}", values.len());
        let stored = tch::Tensor::empty([out as i64, inp as i64], (kind, device));
        let rows = (chunk / inp.max(1)).max(1);
        for r0 in (0..out).step_by(rows) {
            let n = rows.min(out - r0);
            let src = tch::Tensor::from_slice(&values[r0 * inp..(r0 + n) * inp])
                .reshape([n as i64, inp as i64])
                .to_device(device);
            let converted = match kind {
                Kind::BFloat16 => src.to_kind(Kind::BFloat16),
                _ => quantize_tch(&src, scale, Fp8Format::E4M3),
            };
            stored.narrow(0, r0 as i64, n as i64).copy_(&converted);
        }
        Some(match kind {
            Kind::BFloat16 => StoredWeight::Bf16(TchTensor::new(stored)),
            _ => {
                let keep = device.is_cuda() && !spec.fp8_weights_one_layout;
                let transposed = keep.then(|| TchTensor::new(stored.tr().contiguous()));
                StoredWeight::Fp8 { codes: TchTensor::new(stored), scale_inv: 1.0 / scale, transposed }
            }
        })
    }

    /// Ends a step: every amax recorded since the last update joins its history (amaxes still
    /// on the device are read here; the model reads all of its layers' at once before).
    pub fn update(&self) {
        for (role, amax) in self.take_lazy_amaxes() {
            self.record_amax(role, amax.double_value(&[]) as f32);
        }
        let mut s = self.scales.lock().unwrap();
        let spec = self.spec.amax;
        s.input.update(&spec);
        s.weight.update(&spec);
        s.grad.update(&spec);
    }

    /// `‖Wᵢ‖²` of each row of the weight as stored, accumulated in f32 (no f32 copy of a bf16
    /// weight; FP8 codes are dequantised).
    fn weight_row_sq(&self, w: &tch::Tensor) -> tch::Tensor {
        let _no_grad = tch::no_grad_guard();
        let w = match self.stored.as_ref().map(FrozenWeight::whole) {
            Some(StoredWeight::Bf16(t)) => t.tensor.shallow_clone(),
            Some(stored) => stored.dequantize(),
            None => w.shallow_clone(),
        };
        w.norm_scalaropt_dim_dtype(2.0, [1i64].as_slice(), false, Kind::Float).square()
    }

    /// `a·Wᵀ` in f32 with the weight as this layer's fp32/bf16 GEMM takes it (FP8 codes
    /// dequantised to f32: an FP8 GEMM would quantise `a` with the activations' scale).
    ///
    /// # Shapes
    /// - a: `[r, in]`; w: `[out, in]`; output: `[r, out]`
    fn times_weight_t(&self, a: &tch::Tensor, w: &tch::Tensor) -> tch::Tensor {
        let _no_grad = tch::no_grad_guard();
        self.gemm(a, &self.compute_weight(w).tr()).to_kind(Kind::Float)
    }

    /// The dtype of the GEMM operands of fp32 and bf16 compute.
    fn operand_kind(&self) -> Kind {
        if self.spec.compute == Compute::Bf16 { Kind::BFloat16 } else { Kind::Float }
    }

    /// The weight as an fp32 or bf16 GEMM uses it: f32, or bf16 (as stored, or an f32
    /// parameter cast).
    fn compute_weight(&self, w: &tch::Tensor) -> tch::Tensor {
        match self.stored.as_ref().map(FrozenWeight::whole) {
            Some(StoredWeight::Bf16(t)) if self.spec.compute == Compute::Bf16 => t.tensor.shallow_clone(),
            Some(stored) => stored.dequantize_to(self.operand_kind()),
            None => w.to_kind(self.operand_kind()),
        }
    }

    /// `a · b` for fp32 and bf16 compute, in the operands' dtype: bf16 operands on torch's bf16
    /// GEMM, or through f32 GEMMs where it has none ([`bf16`]).
    fn gemm(&self, a: &tch::Tensor, b: &tch::Tensor) -> tch::Tensor {
        let kind = self.operand_kind();
        let a = a.to_kind(kind);
        if bf16::operand_kind(kind, a.device()) != kind { bf16::mm_via_f32(&a, b, Kind::BFloat16) } else { a.matmul(b) }
    }

    /// The weight as FP8 GEMMs use it: the stored E4M3 codes, or the weight quantised with
    /// `scale` (the forward's, in backward) or, without one, its delayed scale.
    fn fp8_weight(&self, w: &tch::Tensor, scale: Option<f32>, train: bool) -> Fp8Weight {
        let whole = self.stored.as_ref().map(FrozenWeight::whole);
        let dequantized;
        let w = match &whole {
            Some(StoredWeight::Fp8 { codes, scale_inv, transposed }) => {
                return Fp8Weight {
                    codes: codes.tensor.shallow_clone(),
                    transposed: transposed.as_ref().map(|t| t.tensor.shallow_clone()),
                    scale_inv: *scale_inv,
                    scale: 1.0,
                };
            }
            // A sharded f32 (or bf16) weight is quantised as a parameter would be.
            Some(StoredWeight::F32(t) | StoredWeight::Bf16(t)) => &t.tensor,
            // Not reached: `PrecisionSpec::validate` refuses FP8 compute over NF4.
            Some(nf4 @ StoredWeight::Nf4 { .. }) => {
                dequantized = nf4.dequantize();
                &dequantized
            }
            None => w,
        };
        let s = scale.unwrap_or_else(|| self.scale_for(Role::Weight, w, train));
        Fp8Weight { codes: quantize_tch(w, s, Fp8Format::E4M3), transposed: None, scale_inv: 1.0 / s, scale: s }
    }

    /// Forward of `y = x·Wᵀ` on LibTorch tensors; with `keep_input`, also what backward needs
    /// for the weight gradient. The output is in the activations' dtype.
    fn forward(&self, x_in: &TchTensor, w: &tch::Tensor, train: bool, keep_input: bool) -> LinearForward {
        // Kept inputs are clones of `x_in` (sharing its storage count), never fresh wrappers:
        // burn-tch writes in place into storage it believes unique.
        let x = &x_in.tensor;
        let size = x.size();
        let d_in = *size.last().unwrap();
        let x2 = x.reshape([-1, d_in]);
        let fp8_store = self.spec.fp8_activations;
        let (y, saved, w_scale) = match self.spec.compute {
            Compute::Fp8 => {
                let s = self.scale_for(Role::Input, &x2, train);
                let q = quantize_tch(&x2, s, Fp8Format::E4M3);
                let wq = self.fp8_weight(w, None, train);
                // E4M3 x E4M3 on `_scaled_mm`, out in the activations' dtype.
                let y = fp8_gemm(
                    Fp8Operand { codes: &q, scale_inv: 1.0 / s },
                    Fp8Operand { codes: &wq.codes.tr(), scale_inv: wq.scale_inv },
                    x.kind(),
                    true,
                );
                let saved = keep_input.then(|| {
                    if fp8_store { SavedInput::Fp8(TchTensor::new(q), 1.0 / s) } else { SavedInput::AsIs(x_in.clone()) }
                });
                (y, saved.map(|sv| (sv, s)), wq.scale)
            }
            compute => {
                // bf16: the GEMM takes bf16 operands (a no-op cast for bf16 activations) and
                // returns bf16, accumulating in f32 inside the kernel. fp32 on bf16 activations
                // (an adapter of a bf16 layer) upcasts them, as PEFT does.
                let saved = keep_input.then(|| {
                    if fp8_store {
                        let (q, scale_inv) = quantize_current_on_device(&x2, Fp8Format::E4M3);
                        SavedInput::Fp8Current(TchTensor::new(q), TchTensor::new(scale_inv))
                    } else if compute == Compute::Bf16 && x.kind() == Kind::BFloat16 {
                        // The activation itself: no copy.
                        SavedInput::Bf16(x_in.clone())
                    } else if compute == Compute::Bf16 {
                        SavedInput::Bf16(TchTensor::new(x2.to_kind(Kind::BFloat16)))
                    } else {
                        SavedInput::AsIs(x_in.clone())
                    }
                });
                // The GEMM gives its operands' dtype.
                (self.gemm(&x2, &self.compute_weight(w).tr()), saved.map(|sv| (sv, 1.0)), 1.0)
            }
        };
        let mut out_size = size.clone();
        *out_size.last_mut().unwrap() = *y.size().last().unwrap();
        LinearForward { y: y.reshape(&out_size), saved, w_scale }
    }

    /// The saved input as the weight-gradient GEMM uses it, `[N, in]`, in f32: weight
    /// gradients are f32 GEMMs on the (bf16- or FP8-valued) operands, as PEFT computes its f32
    /// adapters' gradients; one operand of an adapter's is rank-wide, so this costs little.
    fn input_for_backward(&self, saved: &SavedInput, in_scale: f32) -> tch::Tensor {
        match saved {
            SavedInput::AsIs(x) => {
                let x = x.tensor.reshape([-1, *x.tensor.size().last().unwrap()]);
                match self.spec.compute {
                    Compute::Fp8 => dequantize_tch(&quantize_tch(&x, in_scale, Fp8Format::E4M3), 1.0 / in_scale),
                    _ => x.to_kind(Kind::Float),
                }
            }
            SavedInput::Bf16(x) => x.tensor.reshape([-1, *x.tensor.size().last().unwrap()]).to_kind(Kind::Float),
            SavedInput::Fp8(q, scale_inv) => dequantize_tch(&q.tensor, *scale_inv),
            SavedInput::Fp8Current(q, scale_inv) => dequantize_with(&q.tensor, &scale_inv.tensor),
        }
    }

    /// Backward: `(dx, dW)` for the output gradient `g`, each only when asked (layer 0's
    /// input needs no gradient, a frozen weight neither). dx is in the activations' dtype, dW
    /// in the parameter's.
    fn backward(
        &self,
        g: &tch::Tensor,
        w: &tch::Tensor,
        st: &LinearState,
        want_dx: bool,
        want_dw: bool,
    ) -> (Option<tch::Tensor>, Option<tch::Tensor>) {
        let d_out = *g.size().last().unwrap();
        let g2 = g.reshape([-1, d_out]);
        let (dx, fp8_grad) = match self.spec.compute {
            Compute::Fp32 | Compute::Bf16 => (want_dx.then(|| self.gemm(&g2, &self.compute_weight(w))), None),
            Compute::Fp8 => {
                let s = self.scale_for(Role::Grad, &g2, true);
                let q = quantize_tch(&g2, s, Fp8Format::E5M2);
                // E5M2 x E4M3 on `_scaled_mm`, with the weight quantised as in forward.
                let dx = want_dx.then(|| {
                    let wq = self.fp8_weight(w, Some(st.w_scale), true);
                    let w_col = match &wq.transposed {
                        Some(t) => t.tr(),
                        None => wq.codes.tr().contiguous().tr(),
                    };
                    fp8_gemm(
                        Fp8Operand { codes: &q, scale_inv: 1.0 / s },
                        Fp8Operand { codes: &w_col, scale_inv: wq.scale_inv },
                        st.x_kind,
                        false,
                    )
                });
                (dx, Some((q, s)))
            }
        };
        let dx = dx.map(|dx| dx.reshape(&st.x_size).to_kind(st.x_kind));
        let dw = match (&st.saved, want_dw) {
            (Some((saved, in_scale)), true) => {
                let x = self.input_for_backward(saved, *in_scale);
                // The gradient as the weight-gradient GEMM sees it (under FP8 its quantised
                // values), made only here: a frozen base weight's backward never makes an f32
                // copy of its `[tokens, out]` gradient.
                let gd = match &fp8_grad {
                    Some((q, s)) => dequantize_tch(q, 1.0 / s),
                    None => g2.to_kind(Kind::Float),
                };
                Some(gd.tr().matmul(&x).to_kind(w.kind()))
            }
            _ => None,
        };
        (dx, dw)
    }
}

/// A weight as FP8 GEMMs take it.
struct Fp8Weight {
    /// E4M3 codes `[out, in]`, row-major.
    codes: tch::Tensor,
    /// The codes transposed and contiguous, when kept (see [`StoredWeight::Fp8`]).
    transposed: Option<tch::Tensor>,
    /// `1 / scale`.
    scale_inv: f32,
    /// The scale it was quantised with now (1 for stored codes: nothing to repeat).
    scale: f32,
}

/// A forward's output and what its backward needs.
struct LinearForward {
    y: tch::Tensor,
    saved: Option<(SavedInput, f32)>,
    w_scale: f32,
}

/// `x·Wᵀ` in the precision of `quant`, Burn-facing.
///
/// `train` records amaxes for delayed scaling (evaluation does not).
///
/// # Shapes
/// - x: `[batch, seq, in]`
/// - w: `[out, in]` (ignored, may be empty, when `quant` stores the weight)
/// - output: `[batch, seq, out]`
pub fn quant_linear(x: Tensor<3>, w: Tensor<2>, quant: &Arc<LinearQuant>, train: bool) -> Tensor<3> {
    Tensor::from_dispatch(<Dispatch as LowPrecisionBackend>::quant_linear(
        x.into_dispatch(),
        w.into_dispatch(),
        quant.clone(),
        train,
    ))
}

/// The frozen weight's part of DoRA's row norms (`LoraLinear::dora_norm`), without autodiff:
/// `‖Wᵢ‖²` per row and `A·Wᵀ`, both f32, from the weight as `quant` stores it.
///
/// # Shapes
/// - a: `[r, in]`; w: `[out, in]` (ignored when `quant` stores the weight)
/// - output: `[out]` and `[r, out]`
pub fn weight_row_terms(a: Tensor<2>, w: Tensor<2>, quant: &Arc<LinearQuant>) -> (Tensor<1>, Tensor<2>) {
    let w = w.detach();
    let row_sq = <Dispatch as LowPrecisionBackend>::weight_row_sq(w.clone().into_dispatch(), quant.clone());
    let aw =
        <Dispatch as LowPrecisionBackend>::times_weight_t(a.detach().into_dispatch(), w.into_dispatch(), quant.clone());
    (Tensor::from_dispatch(row_sq), Tensor::from_dispatch(aw))
}

/// `silu(gate) · up`, keeping gate and up for backward in `storage` (the only tensors its
/// backward needs; Burn's composite keeps more, in f32).
///
/// # Shapes
/// - gate, up: `[batch, seq, I]`
/// - output: `[batch, seq, I]`
pub fn swiglu(gate: Tensor<3>, up: Tensor<3>, storage: Storage) -> Tensor<3> {
    Tensor::from_dispatch(<Dispatch as LowPrecisionBackend>::swiglu(gate.into_dispatch(), up.into_dispatch(), storage))
}

/// Backend extension: the reduced-precision ops.
#[backend_extension(Autodiff, LibTorch)]
pub trait LowPrecisionBackend: Backend {
    /// See [`quant_linear`].
    fn quant_linear(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        quant: Arc<LinearQuant>,
        train: bool,
    ) -> FloatTensor<Self>;
    /// See [`swiglu`].
    fn swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>, storage: Storage) -> FloatTensor<Self>;
    /// `‖Wᵢ‖²` per row, f32, untracked (see [`weight_row_terms`]).
    fn weight_row_sq(w: FloatTensor<Self>, quant: Arc<LinearQuant>) -> FloatTensor<Self>;
    /// `a·Wᵀ`, f32, untracked (see [`weight_row_terms`]).
    fn times_weight_t(a: FloatTensor<Self>, w: FloatTensor<Self>, quant: Arc<LinearQuant>) -> FloatTensor<Self>;
}

impl LowPrecisionBackend for LibTorch {
    fn quant_linear(x: TchTensor, w: TchTensor, quant: Arc<LinearQuant>, train: bool) -> TchTensor {
        TchTensor::new(quant.forward(&x, &w.tensor, train, false).y)
    }

    fn swiglu(gate: TchTensor, up: TchTensor, _storage: Storage) -> TchTensor {
        TchTensor::new(gate.tensor.silu() * &up.tensor)
    }

    fn weight_row_sq(w: TchTensor, quant: Arc<LinearQuant>) -> TchTensor {
        TchTensor::new(quant.weight_row_sq(&w.tensor))
    }

    fn times_weight_t(a: TchTensor, w: TchTensor, quant: Arc<LinearQuant>) -> TchTensor {
        TchTensor::new(quant.times_weight_t(&a.tensor, &w.tensor))
    }
}

/// State of a quantised linear node.
#[derive(Debug, Clone)]
struct LinearState {
    quant: Arc<LinearQuant>,
    /// The weight parameter (shares the model's storage; no copy).
    w: TchTensor,
    /// The saved input and the scale it was quantised with (weight gradient only).
    saved: Option<(SavedInput, f32)>,
    w_scale: f32,
    x_size: Vec<i64>,
    x_kind: Kind,
}

#[derive(Debug)]
struct QuantLinearBackward;

impl Backward<LibTorch, 2> for QuantLinearBackward {
    type State = LinearState;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [node_x, node_w] = ops.parents;
        let grad = grads.consume::<LibTorch>(&ops.node);
        let st = ops.state;
        let (dx, dw) = st.quant.backward(&grad.tensor, &st.w.tensor, &st, node_x.is_some(), node_w.is_some());
        if let (Some(node), Some(dx)) = (node_x, dx) {
            grads.register::<LibTorch>(node.id, TchTensor::new(dx));
        }
        if let (Some(node), Some(dw)) = (node_w, dw) {
            grads.register::<LibTorch>(node.id, TchTensor::new(dw));
        }
    }
}

/// What one tensor saved by SwiGLU became.
#[derive(Debug, Clone)]
enum Kept {
    /// As computed, or cast to bf16.
    Plain(TchTensor),
    /// E4M3 codes and the inverse scale (current scaling, a 0-dim tensor on the device).
    Fp8(TchTensor, TchTensor),
}

impl Kept {
    fn keep(x: TchTensor, storage: Storage) -> Self {
        match storage {
            Storage::F32 => Self::Plain(x),
            Storage::Bf16 => Self::Plain(TchTensor::new(x.tensor.to_kind(Kind::BFloat16))),
            Storage::Fp8 => {
                let (q, scale_inv) = quantize_current_on_device(&x.tensor, Fp8Format::E4M3);
                Self::Fp8(TchTensor::new(q), TchTensor::new(scale_inv))
            }
        }
    }

    /// The tensor in `kind` (the activations' dtype).
    fn get(&self, kind: Kind) -> tch::Tensor {
        match self {
            Self::Plain(t) => t.tensor.to_kind(kind),
            Self::Fp8(q, scale_inv) => dequantize_with(&q.tensor, &scale_inv.tensor).to_kind(kind),
        }
    }

    fn bytes(&self) -> usize {
        match self {
            Self::Plain(t) => t.tensor.numel() * t.tensor.kind().elt_size_in_bytes(),
            Self::Fp8(q, _) => q.tensor.numel() + 4,
        }
    }
}

#[derive(Debug)]
struct SwigluBackward;

impl Backward<LibTorch, 2> for SwigluBackward {
    type State = (Kept, Kept);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [node_gate, node_up] = ops.parents;
        let grad = grads.consume::<LibTorch>(&ops.node);
        // Gradients in the activations' dtype, computed as torch's autograd does for
        // `silu(gate) * up`: torch's `silu_backward` kernel (f32 math inside, one pass). At most
        // three `[tokens, I]` tensors live at once besides the kept inputs (at 70B and 8192
        // tokens each is 0.47 GB in bf16).
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

impl<C: CheckpointStrategy> LowPrecisionBackend for Autodiff<LibTorch, C> {
    fn quant_linear(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        quant: Arc<LinearQuant>,
        train: bool,
    ) -> FloatTensor<Self> {
        use burn::backend::ops::FloatTensorOps;
        let w_trainable = <Self as FloatTensorOps<Self>>::float_is_require_grad(&w);
        let nodes = [x.node(), w.node()];
        match QuantLinearBackward.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let (x, w) = (x.into_primitive(), w.into_primitive());
                let (x_size, x_kind) = (x.tensor.size(), x.tensor.kind());
                let fwd = quant.forward(&x, &w.tensor, train, w_trainable);
                if let Some((saved, _)) = &fwd.saved {
                    SAVED_BYTES.fetch_add(saved.bytes(), Ordering::Relaxed);
                }
                let state = LinearState { quant, w, saved: fwd.saved, w_scale: fwd.w_scale, x_size, x_kind };
                prep.finish(state, TchTensor::new(fwd.y))
            }
            OpsKind::UnTracked(prep) => {
                let (x, w) = (x.into_primitive(), w.into_primitive());
                prep.finish(TchTensor::new(quant.forward(&x, &w.tensor, train, false).y))
            }
        }
    }

    fn weight_row_sq(w: FloatTensor<Self>, quant: Arc<LinearQuant>) -> FloatTensor<Self> {
        Self::from_inner(LibTorch::weight_row_sq(Self::inner(w), quant))
    }

    fn times_weight_t(a: FloatTensor<Self>, w: FloatTensor<Self>, quant: Arc<LinearQuant>) -> FloatTensor<Self> {
        Self::from_inner(LibTorch::times_weight_t(Self::inner(a), Self::inner(w), quant))
    }

    fn swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>, storage: Storage) -> FloatTensor<Self> {
        let nodes = [gate.node(), up.node()];
        match SwigluBackward.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let (gate, up) = (gate.into_primitive(), up.into_primitive());
                let out = TchTensor::new(gate.tensor.silu() * &up.tensor);
                let state = (Kept::keep(gate, storage), Kept::keep(up, storage));
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

/// The LibTorch device behind a Burn device, if it is one.
pub fn tch_device(device: &burn::tensor::Device) -> Option<tch::Device> {
    use burn::backend::{DispatchDevice, LibTorchDevice};
    match device.clone().inner().as_dispatch() {
        DispatchDevice::LibTorch(LibTorchDevice::Cpu) => Some(tch::Device::Cpu),
        DispatchDevice::LibTorch(LibTorchDevice::Cuda(n)) => Some(tch::Device::Cuda(*n)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lora::LoraLinear;
    use burn::tensor::{Device, Distribution, TensorData, Tolerance};

    fn fp8_spec(fp8_activations: bool, fp8_weights: bool) -> PrecisionSpec {
        PrecisionSpec {
            compute: Compute::Fp8,
            fp8_activations,
            fp8_weights,
            fp8_weights_one_layout: false,
            amax: AmaxSpec::default(),
            nf4: None,
        }
    }

    fn host(t: &Tensor<2>) -> Vec<f32> {
        t.to_data().into_vec::<f32>().unwrap()
    }

    fn amax(xs: &[f32]) -> f32 {
        xs.iter().fold(0.0f32, |m, x| m.max(x.abs()))
    }

    /// Quantise-dequantise on the host with the scalar emulation.
    fn qdq(xs: &[f32], scale: f32, f: Fp8Format) -> Vec<f32> {
        f.dequantize_slice(&f.quantize_slice(xs, scale), 1.0 / scale)
    }

    /// `a [n, k] · bᵀ ([m, k])` on the host, in f64.
    fn matmul_t(a: &[f32], b: &[f32], n: usize, k: usize, m: usize) -> Vec<f32> {
        let mut out = vec![0.0f32; n * m];
        for i in 0..n {
            for j in 0..m {
                out[i * m + j] = (0..k).map(|l| f64::from(a[i * k + l]) * f64::from(b[j * k + l])).sum::<f64>() as f32;
            }
        }
        out
    }

    fn transpose(a: &[f32], r: usize, c: usize) -> Vec<f32> {
        (0..c * r).map(|i| a[(i % r) * c + i / r]).collect()
    }

    fn assert_close(got: &[f32], want: &[f32], what: &str) {
        let scale = amax(want).max(1e-12);
        let err = got.iter().zip(want).fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(err / scale < 2e-6, "{what}: max error {err:e} against max |value| {scale:e}");
    }

    /// One step of the hybrid recipe through the op equals a host computation built from the
    /// scalar emulation: E4M3 input and weight (scales from their first amax), E5M2 gradient.
    #[test]
    fn fp8_linear_matches_the_emulated_recipe() {
        let device = Device::libtorch().autodiff();
        device.seed(3);
        let (n, k, m) = (6, 16, 8);
        let x0 = Tensor::<2>::random([n, k], Distribution::Normal(0.0, 1.5), &device);
        let w0 = Tensor::<2>::random([m, k], Distribution::Normal(0.0, 0.2), &device);
        let g0 = Tensor::<2>::random([n, m], Distribution::Normal(0.0, 1e-3), &device);
        for fp8_activations in [false, true] {
            let quant = Arc::new(LinearQuant::new(fp8_spec(fp8_activations, false), None));
            let (x, w) = (x0.clone().require_grad(), w0.clone().require_grad());
            let _ = scaled_mm::take_gemm_counts();
            let y = quant_linear(x.clone().unsqueeze::<3>(), w.clone(), &quant, true).squeeze::<2>();
            let grads = (y.clone() * g0.clone()).sum().backward();
            let (dx, dw) = (x.grad(&grads).unwrap(), w.grad(&grads).unwrap());
            // y and dx ran as FP8 GEMMs (on the CPU: `_scaled_mm` or its emulation, whichever
            // the probe chose); dW (a trainable FP8 weight) is emulated in f32.
            let c = scaled_mm::take_gemm_counts();
            assert_eq!((c.scaled_mm + c.emulated, c.fallback), (2, 0), "{c:?}");

            let (xh, wh, gh) = (host(&x0), host(&w0), host(&g0));
            let xq = qdq(&xh, 448.0 / amax(&xh), Fp8Format::E4M3);
            let wq = qdq(&wh, 448.0 / amax(&wh), Fp8Format::E4M3);
            let gq = qdq(&gh, 57344.0 / amax(&gh), Fp8Format::E5M2);
            assert_close(&host(&y.clone().inner()), &matmul_t(&xq, &wq, n, k, m), "y");
            assert_close(&host(&dx), &matmul_t(&gq, &transpose(&wq, m, k), n, m, k), "dx");
            assert_close(&host(&dw), &matmul_t(&transpose(&gq, n, m), &transpose(&xq, n, k), m, n, k), "dW");
            // The quantisation is visible: f32 would differ by far more than the tolerance.
            let exact = matmul_t(&xh, &wh, n, k, m);
            let diff = host(&y.inner()).iter().zip(&exact).fold(0.0f32, |a, (p, q)| a.max((p - q).abs()));
            assert!(diff > 1e-3 * amax(&exact), "FP8 output equals f32 ({diff:e})");
            // A trainable weight keeps its input: 1 byte + scale in FP8, else 4 bytes.
            let _ = take_saved_bytes();
            let _y = quant_linear(x0.clone().unsqueeze::<3>(), w0.clone().require_grad(), &quant, true);
            assert_eq!(take_saved_bytes(), if fp8_activations { n * k + 4 } else { n * k * 4 });
        }
    }

    /// On bf16 activations (as training in FP8 runs them) the FP8 GEMMs write bf16: y and dx
    /// are the emulated recipe's, rounded once to bf16.
    #[test]
    fn fp8_linear_on_bf16_activations_writes_bf16() {
        use burn::tensor::DType;
        let device = Device::libtorch().autodiff();
        device.seed(4);
        let (n, k, m) = (32, 48, 16);
        let x0 = Tensor::<2>::random([n, k], Distribution::Normal(0.0, 1.5), &device).cast(DType::BF16);
        let w0 = Tensor::<2>::random([m, k], Distribution::Normal(0.0, 0.2), &device);
        let g0 = Tensor::<2>::random([n, m], Distribution::Normal(0.0, 1e-3), &device).cast(DType::BF16);
        let quant = Arc::new(LinearQuant::new(fp8_spec(true, false), None));
        let x = x0.clone().require_grad();
        let y = quant_linear(x.clone().unsqueeze::<3>(), w0.clone(), &quant, true).squeeze::<2>();
        assert_eq!(y.dtype(), DType::BF16);
        let grads = (y.clone() * g0.clone()).sum().backward();
        let dx = x.grad(&grads).unwrap();
        assert_eq!(dx.dtype(), DType::BF16);
        let f32_host = |t: Tensor<2>| host(&t.cast(DType::F32));
        let (xh, wh, gh) = (f32_host(x0), host(&w0), f32_host(g0));
        let xq = qdq(&xh, 448.0 / amax(&xh), Fp8Format::E4M3);
        let wq = qdq(&wh, 448.0 / amax(&wh), Fp8Format::E4M3);
        let gq = qdq(&gh, 57344.0 / amax(&gh), Fp8Format::E5M2);
        for (got, want, what) in [
            (f32_host(y.inner()), matmul_t(&xq, &wq, n, k, m), "y"),
            (f32_host(dx), matmul_t(&gq, &transpose(&wq, m, k), n, m, k), "dx"),
        ] {
            // One bf16 rounding: within half an ulp (2^-9 relative) of each value.
            for (a, b) in got.iter().zip(&want) {
                assert!((a - b).abs() <= b.abs() * 2f32.powi(-8) + 1e-30, "{what}: {a} against {b}");
            }
        }
    }

    /// Delayed scaling in use: step 2 quantises with the scale from step 1's amax, so a larger
    /// input saturates at step 1's range.
    #[test]
    fn the_next_step_uses_the_previous_amax() {
        let device = Device::libtorch().autodiff();
        let quant = Arc::new(LinearQuant::new(fp8_spec(false, false), None));
        let w = Tensor::<2>::from_data(TensorData::new(vec![1.0f32], [1, 1]), &device);
        let run = |v: f32| {
            host(
                &quant_linear(
                    Tensor::<3>::from_data(TensorData::new(vec![v, -v / 2.0], [1, 2, 1]), &device),
                    w.clone(),
                    &quant,
                    true,
                )
                .reshape([2, 1])
                .inner(),
            )
        };
        assert_eq!(run(2.0), vec![2.0, -1.0]);
        quant.update();
        // Scale 448/2 = 224: 4·224 saturates to 448 → 2; −2·224 = −448 is exact.
        assert_eq!(run(4.0), vec![2.0, -2.0]);
        quant.update();
        assert_eq!(quant.scales.lock().unwrap().input.scale, 448.0 / 4.0);
        assert_eq!(run(4.0), vec![4.0, -2.0]);
    }

    /// The fused SwiGLU equals Burn's composite in value and gradients (f32 storage), keeps
    /// 2 tensors, and with FP8 storage keeps 1 byte per element at a gradient error of the
    /// order of E4M3's resolution.
    #[test]
    fn swiglu_matches_composite_and_stores_fp8() {
        let device = Device::libtorch().autodiff();
        device.seed(5);
        let shape = [2, 7, 24];
        let g0 = Tensor::<3>::random(shape, Distribution::Normal(0.0, 2.0), &device);
        let u0 = Tensor::<3>::random(shape, Distribution::Normal(0.0, 1.0), &device);
        let w = Tensor::<3>::random(shape, Distribution::Normal(0.0, 1.0), &device);
        let run = |fused: Option<Storage>| {
            let (g, u) = (g0.clone().require_grad(), u0.clone().require_grad());
            let out = match fused {
                Some(storage) => swiglu(g.clone(), u.clone(), storage),
                None => burn::tensor::activation::silu(g.clone()) * u.clone(),
            };
            let grads = (out.clone() * w.clone()).sum().backward();
            (out.inner(), g.grad(&grads).unwrap(), u.grad(&grads).unwrap())
        };
        let _ = take_saved_bytes();
        let reference = run(None);
        let fused = run(Some(Storage::F32));
        assert_eq!(take_saved_bytes(), 2 * 2 * 7 * 24 * 4);
        let tol = Tolerance::<f32>::relative(1e-5).set_absolute(1e-6);
        fused.0.into_data().assert_approx_eq::<f32>(&reference.0.clone().into_data(), tol);
        fused.1.into_data().assert_approx_eq::<f32>(&reference.1.clone().into_data(), tol);
        fused.2.into_data().assert_approx_eq::<f32>(&reference.2.clone().into_data(), tol);
        let fp8 = run(Some(Storage::Fp8));
        assert_eq!(take_saved_bytes(), 2 * (2 * 7 * 24 + 4));
        for (got, want) in [(fp8.1, reference.1), (fp8.2, reference.2)] {
            let rel = (got - want.clone()).abs().max().into_scalar::<f32>() / want.abs().max().into_scalar::<f32>();
            assert!(rel > 1e-4 && rel < 0.1, "FP8-stored gradient error {rel}");
        }
    }

    /// FP8 frozen weights: 1 byte per element + scale, the f32 copy gone, the forward equal to
    /// the weight quantised with its exact amax; bf16 keeps 2 bytes.
    #[test]
    fn frozen_weights_are_stored_in_fp8() {
        let device = Device::libtorch().autodiff();
        device.seed(9);
        let w = Tensor::<2>::random([12, 20], Distribution::Normal(0.0, 0.05), &device);
        let x = Tensor::<2>::random([3, 20], Distribution::Normal(0.0, 1.0), &device);
        let mut linear = LoraLinear::new(w.clone(), false);
        assert_eq!(linear.base_weight_bytes(), 12 * 20 * 4);
        linear.set_precision(&fp8_spec(true, true));
        assert_eq!(linear.base_weight_bytes(), 12 * 20 + 4);
        assert_eq!(linear.weight.shape().num_elements(), 0);
        assert_eq!(linear.dims(), [12, 20]);
        let (wh, xh) = (host(&w), host(&x));
        let wq = qdq(&wh, 448.0 / amax(&wh), Fp8Format::E4M3);
        assert_eq!(host(&linear.base_weight()), wq);
        let y = linear.forward(x.clone().unsqueeze::<3>(), true).squeeze::<2>();
        let xq = qdq(&xh, 448.0 / amax(&xh), Fp8Format::E4M3);
        assert_close(&host(&y.inner()), &matmul_t(&xq, &wq, 3, 20, 12), "y");

        // Converted two rows at a time: the same codes and scale as in one piece.
        let spec = fp8_spec(true, true);
        let chunked = LinearQuant::store_weight_in_chunks(&spec, &wh, [12, 20], tch::Device::Cpu, 40).unwrap();
        assert_eq!(Vec::<f32>::try_from(&chunked.dequantize().flatten(0, -1)).unwrap(), wq);

        let mut bf = LoraLinear::new(w, false);
        bf.set_precision(&PrecisionSpec { compute: Compute::Bf16, ..Default::default() });
        assert_eq!(bf.base_weight_bytes(), 12 * 20 * 2);
    }
}
