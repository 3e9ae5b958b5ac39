//! One linear layer in reduced precision: its state (spec and scaling; the weight is the
//! layer's, passed in as a [`LinearWeight`]), and the forward and backward GEMMs on LibTorch
//! tensors that the autodiff nodes (`nodes.rs`) run.

use std::sync::{Arc, Mutex};

use burn::backend::libtorch::TchTensor;
use tch::Kind;

use super::bf16;
use super::spec::{Compute, PrecisionSpec};
use super::weights::StoredWeight;
use crate::fp8::gemm::fp8_gemm;
use crate::fp8::scaling_state::{LinearScales, Role, scale_of};
use crate::fp8::tensor::Fp8Tensor;
use crate::fp8::{Fp8Format, Quantizer, SharedCodes, amax_tch};
use crate::shard::FrozenWeight;

/// The reduced-precision state of one linear layer, shared by the module and the autodiff
/// nodes of its uses (which record amaxes into it).
#[derive(Debug)]
pub struct LinearPrecision {
    /// The precision it runs in.
    pub spec: PrecisionSpec,
    /// The delayed-scaling states.
    pub scales: Mutex<LinearScales>,
    /// Amaxes of this step still on the device (0-dim f32), per [`Role`]: delayed scaling needs
    /// them only at the step's end, where the model reads all of them at once
    /// (`LlamaForCausalLM::settle_fp8_amaxes`), not once per GEMM.
    lazy: Mutex<[Vec<tch::Tensor>; 3]>,
}

/// A linear layer's weight as its GEMMs read it.
#[derive(Debug, Clone)]
pub enum LinearWeight {
    /// A parameter's tensor, cast or quantised at each use as the precision asks.
    Param(TchTensor),
    /// A frozen weight stored in reduced precision, or sharded (read while gathered).
    Stored(FrozenWeight),
}

impl LinearWeight {
    /// The stored weight, whole (a sharded one while gathered); `None` for a parameter.
    fn stored(&self) -> Option<StoredWeight> {
        match self {
            Self::Param(_) => None,
            Self::Stored(w) => Some(w.whole()),
        }
    }
}

/// What a linear layer keeps of its input for the weight gradient.
#[derive(Debug, Clone)]
pub(super) enum SavedInput {
    /// As it came (f32 or bf16 activations), to be quantised again in backward.
    AsIs(TchTensor),
    /// bf16.
    Bf16(TchTensor),
    /// E4M3 codes: at the GEMM's delayed scale (FP8 compute), or at the input's own scale
    /// computed on the device (current scaling: [`crate::fp8::quantize_current_on_device`]).
    Fp8(Fp8Tensor),
}

impl SavedInput {
    pub(super) fn bytes(&self) -> usize {
        match self {
            Self::AsIs(t) | Self::Bf16(t) => t.tensor.numel() * t.tensor.kind().elt_size_in_bytes(),
            Self::Fp8(q) => q.bytes(),
        }
    }
}

impl LinearPrecision {
    /// A fresh state.
    pub fn new(spec: PrecisionSpec) -> Self {
        Self { spec, scales: Mutex::new(LinearScales::new()), lazy: Mutex::new(Default::default()) }
    }

    /// `x` quantised to `format` as `role` with its delayed scale, and that scale; its amax
    /// recorded in training. Once the role has a scale (every use after its first), the amax
    /// is taken in the same pass as the codes where our kernel runs
    /// ([`crate::fp8::quantize_and_amax`]) and stays on the device until
    /// [`Self::take_lazy_amaxes`]: quantising waits for nothing; with `shared`, codes another
    /// reader of `x` made (or its writer handed over) are taken instead. The first use, and
    /// evaluation of a never-trained layer, read the amax first ([`scale_of`]). No lock is held
    /// while quantising (its first use runs the routes' checks).
    fn quantize_delayed(
        &self,
        role: Role,
        x: &tch::Tensor,
        format: Fp8Format,
        train: bool,
        shared: Option<&SharedCodes>,
    ) -> (Fp8Tensor, f32) {
        let (ready, scale) = {
            let st = self.scales.lock().unwrap();
            let state = st.get(role);
            (train && state.initialized && x.numel() > 0, state.scale)
        };
        if ready {
            let make = || Quantizer::quantize_with_amax(scale, format, x);
            let (codes, amax) = match shared {
                Some(shared) => shared.get_or_make(x, scale, format, make),
                None => make(),
            };
            self.lazy.lock().unwrap()[role as usize].push(amax);
            return (codes, scale);
        }
        let amax = amax_tch(x);
        let scale = scale_of(self.scales.lock().unwrap().get_mut(role), amax, &self.spec.amax, train);
        (Quantizer::Delayed { scale, format }.quantize(x), scale)
    }

    /// The delayed scale this layer's forward GEMM will quantise its input with, where it is
    /// an FP8 GEMM in training with a scale already made (every step after the first);
    /// `None` otherwise.
    pub fn ready_input_scale(&self, train: bool) -> Option<f32> {
        let st = self.scales.lock().unwrap();
        (train && self.spec.compute == Compute::Fp8 && st.input.initialized).then_some(st.input.scale)
    }

    /// The amaxes recorded on the device since the last call, per role that has any (one per
    /// use: a role used by several micro-batches has several). [`read_amaxes`] reads them.
    pub fn take_lazy_amaxes(&self) -> Vec<(Role, Vec<tch::Tensor>)> {
        let mut lazy = self.lazy.lock().unwrap();
        let taken = Role::ALL.map(|role| (role, std::mem::take(&mut lazy[role as usize])));
        taken.into_iter().filter(|(_, list)| !list.is_empty()).collect()
    }

    /// Records an amax read back by [`read_amaxes`] (negative: none finite).
    pub fn record_amax(&self, role: Role, amax: f32) {
        if amax >= 0.0 {
            let _ = self.scales.lock().unwrap().get_mut(role).observe(amax, &self.spec.amax);
        }
    }

    /// Ends a step: every amax recorded since the last update joins its history (amaxes still
    /// on the device are read here; the model reads all of its layers' at once before).
    pub fn update(&self) {
        let (roles, lists): (Vec<Role>, Vec<Vec<tch::Tensor>>) = self.take_lazy_amaxes().into_iter().unzip();
        for (role, amax) in roles.into_iter().zip(read_amaxes(lists)) {
            self.record_amax(role, amax);
        }
        let mut s = self.scales.lock().unwrap();
        let spec = self.spec.amax;
        s.input.update(&spec);
        s.weight.update(&spec);
        s.grad.update(&spec);
    }

    /// `‖Wᵢ‖²` of each row of the weight as stored, accumulated in f32 (no f32 copy of a bf16
    /// weight; FP8 codes are dequantised).
    pub(super) fn weight_row_sq(&self, w: &LinearWeight) -> tch::Tensor {
        let _no_grad = tch::no_grad_guard();
        let w = match (w, w.stored()) {
            (_, Some(StoredWeight::Bf16(t))) => t.tensor.shallow_clone(),
            (_, Some(stored)) => stored.dequantize(),
            (LinearWeight::Param(w), None) => w.tensor.shallow_clone(),
            (LinearWeight::Stored(_), None) => unreachable!("a stored weight has its whole"),
        };
        w.norm_scalaropt_dim_dtype(2.0, [1i64].as_slice(), false, Kind::Float).square()
    }

    /// `a·Wᵀ` in f32 with the weight as this layer's fp32/bf16 GEMM takes it (FP8 codes
    /// dequantised to f32: an FP8 GEMM would quantise `a` with the activations' scale).
    ///
    /// # Shapes
    /// - a: `[r, in]`; w: `[out, in]`; output: `[r, out]`
    pub(super) fn times_weight_t(&self, a: &tch::Tensor, w: &LinearWeight) -> tch::Tensor {
        let _no_grad = tch::no_grad_guard();
        self.gemm(a, &self.compute_weight(w).tr()).to_kind(Kind::Float)
    }

    /// The dtype of the GEMM operands of fp32 and bf16 compute.
    fn operand_kind(&self) -> Kind {
        if self.spec.compute == Compute::Bf16 { Kind::BFloat16 } else { Kind::Float }
    }

    /// The weight as an fp32 or bf16 GEMM uses it: f32, or bf16 (as stored, or an f32
    /// parameter cast).
    fn compute_weight(&self, w: &LinearWeight) -> tch::Tensor {
        match (w, w.stored()) {
            (_, Some(StoredWeight::Bf16(t))) if self.spec.compute == Compute::Bf16 => t.tensor.shallow_clone(),
            (_, Some(stored)) => stored.dequantize_to(self.operand_kind()),
            (LinearWeight::Param(w), None) => w.tensor.to_kind(self.operand_kind()),
            (LinearWeight::Stored(_), None) => unreachable!("a stored weight has its whole"),
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
    /// Returns the codes and the scale they were made with now (1 for stored codes: nothing to
    /// repeat).
    fn fp8_weight(&self, w: &LinearWeight, scale: Option<f32>, train: bool) -> (Fp8Tensor, f32) {
        let whole = w.stored();
        let dequantized;
        let w = match &whole {
            Some(StoredWeight::Fp8(codes)) => return (codes.clone(), 1.0),
            // A sharded f32 (or bf16) weight is quantised as a parameter would be.
            Some(StoredWeight::F32(t) | StoredWeight::Bf16(t)) => &t.tensor,
            // Not reached: `PrecisionSpec::validate` refuses FP8 compute over NF4.
            Some(nf4 @ StoredWeight::Nf4 { .. }) => {
                dequantized = nf4.dequantize();
                &dequantized
            }
            None => match w {
                LinearWeight::Param(w) => &w.tensor,
                LinearWeight::Stored(_) => unreachable!("a stored weight has its whole"),
            },
        };
        match scale {
            Some(s) => (Quantizer::Delayed { scale: s, format: Fp8Format::E4M3 }.quantize(w), s),
            None => self.quantize_delayed(Role::Weight, w, Fp8Format::E4M3, train, None),
        }
    }

    /// Forward of `y = x·Wᵀ` on LibTorch tensors; with `keep_input`, also what backward needs
    /// for the weight gradient; an FP8 GEMM takes its input's codes from `shared` where they
    /// are there. The output is in the activations' dtype.
    pub(super) fn forward(
        &self,
        x_in: &TchTensor,
        w: &LinearWeight,
        train: bool,
        keep_input: bool,
        shared: Option<&SharedCodes>,
    ) -> LinearForward {
        // Kept inputs are clones of `x_in` (sharing its storage count), never fresh wrappers:
        // burn-tch writes in place into storage it believes unique.
        let x = &x_in.tensor;
        let size = x.size();
        let d_in = *size.last().unwrap();
        let x2 = x.reshape([-1, d_in]);
        let fp8_store = self.spec.fp8_activations;
        let (y, saved, w_scale) = match self.spec.compute {
            Compute::Fp8 => {
                let (q, s) = self.quantize_delayed(Role::Input, &x2, Fp8Format::E4M3, train, shared);
                let (wq, w_scale) = self.fp8_weight(w, None, train);
                // E4M3 x E4M3 on `_scaled_mm`, out in the activations' dtype.
                let y = fp8_gemm(&q, &wq.t(), x.kind(), true);
                let saved =
                    keep_input.then(|| if fp8_store { SavedInput::Fp8(q) } else { SavedInput::AsIs(x_in.clone()) });
                (y, saved.map(|sv| (sv, s)), w_scale)
            }
            compute => {
                // bf16: the GEMM takes bf16 operands (a no-op cast for bf16 activations) and
                // returns bf16, accumulating in f32 inside the kernel. fp32 on bf16 activations
                // (an adapter of a bf16 layer) upcasts them, as PEFT does.
                let saved = keep_input.then(|| {
                    if fp8_store {
                        // At the amax its writer took where one was handed over (the adapters'
                        // dropout on our kernel, the codes of the base GEMM): the same codes
                        // without an amax pass; made once for every reader of x that keeps it.
                        let make = || match shared.and_then(|s| s.input_amax(&x2)) {
                            Some(amax) => Quantizer::quantize_current_at_amax(Fp8Format::E4M3, &x2, &amax),
                            None => Quantizer::Current(Fp8Format::E4M3).quantize(&x2),
                        };
                        SavedInput::Fp8(match shared {
                            Some(shared) => shared.current_copy(&x2, make),
                            None => make(),
                        })
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
                    Compute::Fp8 => crate::fp8::Quantizer::Delayed { scale: in_scale, format: Fp8Format::E4M3 }
                        .quantize(&x)
                        .dequantize(),
                    _ => x.to_kind(Kind::Float),
                }
            }
            SavedInput::Bf16(x) => x.tensor.reshape([-1, *x.tensor.size().last().unwrap()]).to_kind(Kind::Float),
            SavedInput::Fp8(q) => q.dequantize(),
        }
    }

    /// Backward: `(dx, dW)` for the output gradient `g`, each only when asked (layer 0's
    /// input needs no gradient, a frozen weight neither). dx is in the activations' dtype, dW
    /// in the parameter's.
    pub(super) fn backward(
        &self,
        g: &tch::Tensor,
        w: &LinearWeight,
        st: &LinearState,
        want_dx: bool,
        want_dw: bool,
    ) -> (Option<tch::Tensor>, Option<tch::Tensor>) {
        let d_out = *g.size().last().unwrap();
        let g2 = g.reshape([-1, d_out]);
        let (dx, fp8_grad) = match self.spec.compute {
            Compute::Fp32 | Compute::Bf16 => (want_dx.then(|| self.gemm(&g2, &self.compute_weight(w))), None),
            Compute::Fp8 => {
                let (q, _) = self.quantize_delayed(Role::Grad, &g2, Fp8Format::E5M2, true, None);
                // E5M2 x E4M3 on `_scaled_mm`, with the weight quantised as in forward.
                let dx = want_dx.then(|| {
                    let (wq, _) = self.fp8_weight(w, Some(st.w_scale), true);
                    fp8_gemm(&q, &wq.col_major(), st.x_kind, false)
                });
                (dx, Some(q))
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
                    Some(q) => q.dequantize(),
                    None => g2.to_kind(Kind::Float),
                };
                let kind = match w {
                    LinearWeight::Param(w) => w.tensor.kind(),
                    LinearWeight::Stored(_) => unreachable!("a stored weight is frozen: no gradient"),
                };
                Some(gd.tr().matmul(&x).to_kind(kind))
            }
            _ => None,
        };
        (dx, dw)
    }
}

/// A forward's output and what its backward needs.
pub(super) struct LinearForward {
    pub(super) y: tch::Tensor,
    pub(super) saved: Option<(SavedInput, f32)>,
    pub(super) w_scale: f32,
}

/// State of a quantised linear node.
#[derive(Debug, Clone)]
pub(super) struct LinearState {
    pub(super) quant: Arc<LinearPrecision>,
    /// The weight (a parameter shares the model's storage; no copy).
    pub(super) w: LinearWeight,
    /// The saved input and the scale it was quantised with (weight gradient only).
    pub(super) saved: Option<(SavedInput, f32)>,
    pub(super) w_scale: f32,
    pub(super) x_size: Vec<i64>,
    pub(super) x_kind: Kind,
}

/// The largest finite amax of each group, or −1 where none is finite (non-finite amaxes are not
/// recorded, as [`crate::fp8::scaling_state::DelayedScaling::observe`] skips them): every
/// group's device amaxes (0-dim or `[1]` f32) read back in one host-device transfer and
/// reduced on the host, so a step's end costs one concatenation on the device, not a stack,
/// a mask and a max per role of every layer (at 70B, ~5,000 launches).
pub fn read_amaxes(groups: Vec<Vec<tch::Tensor>>) -> Vec<f32> {
    let lens: Vec<usize> = groups.iter().map(Vec::len).collect();
    let parts: Vec<tch::Tensor> = groups.into_iter().flatten().map(|a| a.reshape([1]).to_kind(Kind::Float)).collect();
    if parts.is_empty() {
        return vec![];
    }
    crate::profile::count_host_read();
    let values = Vec::<f32>::try_from(tch::Tensor::cat(&parts, 0).to_device(tch::Device::Cpu)).expect("f32 amaxes");
    let mut rest = values.as_slice();
    lens.into_iter()
        .map(|n| {
            let (group, tail) = rest.split_at(n);
            rest = tail;
            group.iter().copied().filter(|a| a.is_finite()).fold(-1.0, f32::max)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A step's amaxes, hand-picked: each group's largest finite one (0-dim and `[1]` tensors
    /// alike, over the micro-batches' uses), −1 where none is finite, all read in one
    /// host-device transfer.
    #[test]
    fn a_steps_amaxes_are_read_at_once_each_roles_largest_finite_one() {
        let zero_dim = |v: f32| tch::Tensor::from(v);
        let one = |v: f32| tch::Tensor::from_slice(&[v]);
        let groups = vec![
            vec![zero_dim(1.0), zero_dim(f32::NAN), one(3.0)],
            vec![one(f32::INFINITY), zero_dim(f32::NAN)],
            vec![zero_dim(0.0)],
            vec![one(2.5), zero_dim(7.0), one(f32::NEG_INFINITY), zero_dim(4.0)],
        ];
        let counter = crate::profile::Counter::start().unwrap();
        let read = read_amaxes(groups);
        let counts = counter.finish();
        assert_eq!(read, [3.0, -1.0, 0.0, 7.0]);
        assert_eq!(counts.host_syncs, 1, "{counts:?}");
        assert!(read_amaxes(vec![]).is_empty());
    }
}
