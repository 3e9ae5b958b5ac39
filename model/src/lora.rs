//! `LoraLinear`: a frozen linear layer plus a trainable low-rank update.
//!
//! ```text
//!            ┌──────────── W (frozen, [out, in]) ────────────┐
//!   x ──┬───▶│ x·Wᵀ                                          │──▶ (+) ──▶ y
//!       │    └───────────────────────────────────────────────┘     ▲
//!       └──▶ dropout(p) ──▶ A ([r, in]) ──▶ B ([out, r]) ──▶ ×(α/r) ┘
//! ```
//! `y = x·Wᵀ + (α/r)·B(A(dropout(x)))`, as PEFT's `lora.Linear` computes it. Unlike Burn's
//! built-in LoRA, the dense `W + (α/r)·B·A` is never materialised (at 70B that is a second copy
//! of every adapted weight per step) and the adapter input gets dropout, which MLPerf uses.
//! A starts Kaiming-uniform(a = √5) and B at zero, PEFT's default, so training starts from the
//! base model exactly.
//!
//! DoRA (Liu et al. 2024, PEFT's `use_dora`) adds a trainable magnitude `m` (`[out]`) and
//! rescales each output row of the adapted weight to it:
//! `y = m/‖W + s·B·A‖ ⊙ (x·Wᵀ + s·B(A(x)))`, the row norm treated as a constant in backward
//! (the paper's §4.3, and PEFT). With dropout in training PEFT feeds the dropped input to the
//! rescaled part only: `y = x·Wᵀ + (m/n − 1) ⊙ (x_d·Wᵀ) + (m/n) ⊙ s·B(A(x_d))`, one more base
//! GEMM; so does llora. The norm is never formed from a dense `W + s·B·A`: it is
//! `√(‖Wᵢ‖² + 2s·Bᵢ·(A·Wᵀ)ᵢ + s²·Bᵢ(A·Aᵀ)Bᵢᵀ)`, a rank-wide GEMM over the frozen weight.

use std::sync::Arc;

use burn::module::{Ignored, Module, Param};
use burn::tensor::{Device, Distribution, Tensor, TensorData};

use crate::config::LlamaConfig;
use crate::fp8::{SharedCodes, WriteCodes};
use crate::layout::{BlockLinear, LinearInput};
use crate::precision::{
    FrozenWeight, LinearPrecision, PrecisionSpec, StoredWeight, frozen_linear, precision_linear,
    precision_linear_reading,
};
use crate::saved::Saved;

thread_local! {
    /// Whether the adapters are switched off on this thread (see [`without_adapters`]).
    static ADAPTERS_OFF: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` with every adapter switched off on this thread: each [`LoraLinear`] computes its
/// base layer alone (DoRA's magnitude too is the adapter's), as PEFT's `disable_adapter()`
/// does. The reference policy of preference tuning is the base: the same network, the
/// adapters off. The earlier setting is restored after `f`, also when it unwinds.
pub fn without_adapters<R>(f: impl FnOnce() -> R) -> R {
    crate::scoped::with(&ADAPTERS_OFF, true, f)
}

/// A linear layer `y = x·Wᵀ` with frozen `W` and an optional LoRA adapter.
#[derive(Module, Debug)]
pub struct LoraLinear {
    /// Base weight, HF layout `[out, in]`; frozen unless full fine-tuning.
    pub weight: BaseWeight,
    /// The adapter, when this module is a LoRA target.
    pub lora: Option<LoraAdapter>,
    /// The base layer's bias `[out]` (Qwen's attention projections), f32: frozen with the
    /// base (PEFT's `bias = "none"`), trained only under full fine-tuning.
    pub bias: Option<Param<Tensor<1>>>,
    /// Precision and scaling state of the layer's GEMMs (`None`: plain f32 through Burn's
    /// linear, on backends other than LibTorch).
    #[module(skip)]
    pub quant: Option<Arc<LinearPrecision>>,
}

/// A linear layer's base weight, in the one place it lives.
#[derive(Module, Debug)]
pub enum BaseWeight {
    /// A Burn parameter: f32, trainable under full fine-tuning, else frozen.
    Param(Param<Tensor<2>>),
    /// Frozen and stored outside Burn: bf16, FP8 codes, NF4, or this rank's shard of one.
    Stored(Ignored<FrozenWeight>),
}

impl BaseWeight {
    /// `[out, in]`.
    pub fn dims(&self) -> [usize; 2] {
        match self {
            Self::Param(p) => p.shape().dims(),
            Self::Stored(w) => w.0.dims(),
        }
    }

    /// The parameter, when the weight is one.
    pub fn param(&self) -> Option<&Param<Tensor<2>>> {
        match self {
            Self::Param(p) => Some(p),
            Self::Stored(_) => None,
        }
    }

    /// The parameter, mutably, when the weight is one.
    pub fn param_mut(&mut self) -> Option<&mut Param<Tensor<2>>> {
        match self {
            Self::Param(p) => Some(p),
            Self::Stored(_) => None,
        }
    }

    /// The stored weight, when the weight is one.
    pub fn stored(&self) -> Option<&FrozenWeight> {
        match self {
            Self::Param(_) => None,
            Self::Stored(w) => Some(&w.0),
        }
    }
}

/// The low-rank pair of a [`LoraLinear`].
#[derive(Module, Debug)]
pub struct LoraAdapter {
    /// Down projection A, `[r, in]` (PEFT's `lora_A.weight`).
    pub a: Param<Tensor<2>>,
    /// Up projection B, `[out, r]` (PEFT's `lora_B.weight`).
    pub b: Param<Tensor<2>>,
    /// DoRA's magnitude `m`, `[out]` (PEFT's `lora_magnitude_vector`); `None`: plain LoRA.
    pub magnitude: Option<Param<Tensor<1>>>,
    /// The update's factor: α / r, or α / √r with rsLoRA ([`LoraSpec::scale`]).
    #[module(skip)]
    pub scale: f64,
    /// Dropout probability on the adapter input.
    #[module(skip)]
    pub dropout: f64,
    /// Reduced-precision states of the A and B GEMMs (`None`: f32).
    #[module(skip)]
    pub quant: Option<[Arc<LinearPrecision>; 2]>,
}

pub use crate::lora_spec::{LoraSpec, TARGET_MODULES};

impl LoraAdapter {
    /// What the adapter on linear `kind` keeps for backward per token: its input for A's
    /// gradient (the dropped-out input, one per adapter, with dropout (the mask is redrawn
    /// from its seed, model/src/dropout/mod.rs); otherwise once for all adapters reading it,
    /// listed by the first (`shared` holds the inputs already listed): an FP8 copy with
    /// `fp8_activations`, else the activation itself, which for the attention output attention
    /// keeps already), its bottleneck for B's gradient, and DoRA's
    /// ([`Self::dora_saved_per_token`]).
    pub fn saved_per_token(
        kind: BlockLinear,
        c: &LlamaConfig,
        lora: &LoraSpec,
        spec: &PrecisionSpec,
        shared: &mut Vec<LinearInput>,
    ) -> Vec<Saved> {
        let (name, input, n_in) = (kind.name(), kind.input(), kind.shape(c)[1] as f64);
        let input_name = format!("{name} adapter input");
        let mut out = Vec::new();
        if lora.dropout > 0.0 {
            let why = "LoRA A gradient (the dropped-out input, one per adapter)";
            out.push(Saved::new(input_name, n_in * spec.saved_activation_bytes(), why));
        } else if !shared.contains(&input) && spec.fp8_activations {
            shared.push(input);
            out.push(Saved::new(input_name, n_in, "LoRA A gradient (FP8 copy, one per input)"));
        } else if !shared.contains(&input) && input != LinearInput::AttnOut {
            shared.push(input);
            out.push(Saved::new(input_name, n_in * spec.activation_bytes(), "LoRA A gradient"));
        }
        let bottleneck = lora.rank as f64 * spec.adapter_bottleneck_bytes();
        out.push(Saved::new(format!("{name} adapter bottleneck"), bottleneck, "LoRA B gradient"));
        out.extend(Self::dora_saved_per_token(kind, c, lora, spec));
        out
    }

    /// What DoRA adds per token on linear `kind`: the product with m/‖W'‖ keeps its other
    /// factor for the magnitude's gradient, x·Wᵀ + s·B·A·x in the adapter output's dtype (with
    /// dropout the dropped input's two parts apart); `None` without DoRA.
    pub fn dora_saved_per_token(
        kind: BlockLinear,
        c: &LlamaConfig,
        lora: &LoraSpec,
        spec: &PrecisionSpec,
    ) -> Option<Saved> {
        let parts = if lora.dropout > 0.0 { 2.0 } else { 1.0 };
        let bytes = parts * kind.shape(c)[0] as f64 * spec.adapter_output_bytes();
        lora.dora.then(|| Saved::new(format!("{} DoRA rescale input", kind.name()), bytes, "DoRA magnitude gradient"))
    }

    /// A fresh adapter for a `[out, in]` weight: A ~ Kaiming-uniform(a=√5), B = 0 (PEFT).
    pub fn new(d_in: usize, d_out: usize, spec: &LoraSpec, device: &Device) -> Self {
        // kaiming_uniform_(a=√5) on A [r, in]: fan_in = in, gain = √(2/(1+a²)) = √(1/3),
        // bound = gain·√(3/fan_in) = 1/√in.
        let bound = 1.0 / (d_in as f64).sqrt();
        let a = Tensor::<2>::random([spec.rank, d_in], Distribution::Uniform(-bound, bound), device);
        let b = Tensor::<2>::zeros([d_out, spec.rank], device);
        Self::from_tensors(a, b, spec)
    }

    /// An adapter with given weights (e.g. loaded from a PEFT file); both become trainable.
    pub fn from_tensors(a: Tensor<2>, b: Tensor<2>, spec: &LoraSpec) -> Self {
        Self {
            a: Param::from_tensor(a),
            b: Param::from_tensor(b),
            magnitude: None,
            scale: spec.scale(),
            dropout: spec.dropout,
            quant: None,
        }
    }

    /// With DoRA's magnitude `m` (`[out]`, trainable).
    pub fn with_magnitude(mut self, m: Tensor<1>) -> Self {
        self.magnitude = Some(Param::from_tensor(m));
        self
    }

    /// The update `(α/r)·B(A(x))` of an input that already had its dropout.
    ///
    /// # Shapes
    /// - x: `[batch, seq, in]`
    /// - output: `[batch, seq, out]`
    pub fn update(&self, x: Tensor<3>, train: bool) -> Tensor<3> {
        self.update_reading(x, train, None)
    }

    /// [`Self::update`] with A's GEMM taking what `shared` holds of `x` (the amax its dropout
    /// took, for the FP8 copy A keeps with `fp8_activations`).
    ///
    /// # Shapes
    /// As [`Self::update`].
    pub fn update_reading(&self, x: Tensor<3>, train: bool, shared: Option<&SharedCodes>) -> Tensor<3> {
        let up = match &self.quant {
            Some([qa, qb]) => {
                let down = precision_linear_reading(x, self.a.val(), qa, train, shared);
                precision_linear(down, self.b.val(), qb, train)
            }
            None => linear_t(linear_t(x, self.a.val()), self.b.val()),
        };
        up.mul_scalar(self.scale)
    }

    /// Whether A's GEMM keeps an FP8 copy of its input at current scaling (`fp8_activations`
    /// on a GEMM that is not FP8 itself): what the input's dropout can take the amax for.
    fn keeps_fp8_input(&self) -> bool {
        self.quant
            .as_ref()
            .is_some_and(|[qa, _]| qa.spec.fp8_activations && qa.spec.compute != crate::precision::Compute::Fp8)
    }

    /// Trainable values: A, B and DoRA's magnitude.
    pub fn num_params(&self) -> usize {
        self.a.shape().num_elements()
            + self.b.shape().num_elements()
            + self.magnitude.as_ref().map_or(0, |m| m.shape().num_elements())
    }
}

impl LoraLinear {
    /// A frozen linear layer from a `[out, in]` weight; `trainable` unfreezes it (full FT).
    pub fn new(weight: Tensor<2>, trainable: bool) -> Self {
        let weight = BaseWeight::Param(Param::from_tensor(weight).set_require_grad(trainable));
        Self { weight, lora: None, bias: None, quant: None }
    }

    /// A frozen layer whose weight is already stored in reduced precision or sharded.
    pub fn from_stored(stored: FrozenWeight, spec: &PrecisionSpec) -> Self {
        Self {
            weight: BaseWeight::Stored(Ignored(stored)),
            lora: None,
            bias: None,
            quant: Some(Arc::new(LinearPrecision::new(*spec))),
        }
    }

    /// Attaches the base layer's bias `[out]`, trainable as `trainable` says.
    pub fn with_bias(mut self, bias: Tensor<1>, trainable: bool) -> Self {
        self.bias = Some(Param::from_tensor(bias).set_require_grad(trainable));
        self
    }

    /// `y + bias` in y's dtype (y itself without a bias).
    ///
    /// # Shapes
    /// - y: `[batch, seq, out]`; output: as y
    fn plus_bias(&self, y: Tensor<3>) -> Tensor<3> {
        let Some(bias) = &self.bias else { return y };
        let [out] = bias.shape().dims();
        let dtype = y.dtype();
        y + cast(bias.val(), dtype).reshape([1, 1, out])
    }

    /// Attaches an adapter.
    pub fn with_adapter(mut self, adapter: LoraAdapter) -> Self {
        self.lora = Some(adapter);
        self
    }

    /// `[out, in]` of the base weight.
    pub fn dims(&self) -> [usize; 2] {
        self.weight.dims()
    }

    /// The base weight in f32 (dequantised when it is stored in reduced precision), on `device`.
    pub fn base_weight(&self, device: &Device) -> Tensor<2> {
        match &self.weight {
            BaseWeight::Stored(stored) => {
                let w = stored.0.whole().dequantize();
                let values = Vec::<f32>::try_from(&w.flatten(0, -1)).expect("f32 weight");
                Tensor::from_data(TensorData::new(values, self.dims()), device)
            }
            BaseWeight::Param(p) => p.val(),
        }
    }

    /// Bytes the base weight occupies.
    pub fn base_weight_bytes(&self) -> usize {
        match &self.weight {
            BaseWeight::Stored(stored) => stored.0.bytes(),
            BaseWeight::Param(p) => p.shape().num_elements() * p.val().dtype().size(),
        }
    }

    /// Switches the layer (and its adapter) to `spec`, through the LibTorch op of
    /// [`precision_linear`] (f32 included: one code path for every precision on LibTorch): frozen
    /// base weights are stored in bf16 or FP8 when `spec` asks, dropping the f32 parameter. On
    /// other devices only plain f32 is possible, and the layer stays on Burn's linear.
    pub fn set_precision(&mut self, spec: &PrecisionSpec, device: &Device) {
        let Some(tch_device) = crate::precision::tch_device(device) else {
            assert!(spec.is_fp32(), "reduced precision needs a LibTorch device");
            self.quant = None;
            if let Some(a) = &mut self.lora {
                a.quant = None;
            }
            return;
        };
        if let BaseWeight::Param(p) = &self.weight
            && !p.is_require_grad()
            && spec.stores_frozen_weights()
        {
            let values = p.val().to_data().convert::<f32>().into_vec::<f32>().expect("f32 weight");
            if let Some(stored) = StoredWeight::store(spec, &values, self.dims(), tch_device) {
                self.weight = BaseWeight::Stored(Ignored(FrozenWeight::Whole(stored)));
            }
        }
        self.quant = Some(Arc::new(LinearPrecision::new(*spec)));
        if let Some(a) = &mut self.lora {
            let adapters = spec.for_adapters();
            a.quant = Some([Arc::new(LinearPrecision::new(adapters)), Arc::new(LinearPrecision::new(adapters))]);
        }
    }

    /// Attaches a fresh adapter built from `spec` (A and B as PEFT initialises them), and with
    /// DoRA its magnitude `‖W + s·B·A‖` per row, which is `‖W‖` as B starts at zero (PEFT's
    /// initialisation): training starts from the base model exactly.
    pub fn with_new_adapter(self, spec: &LoraSpec, device: &Device) -> Self {
        let [out, inp] = self.dims();
        let adapter = LoraAdapter::new(inp, out, spec, device);
        let adapter = if spec.dora {
            let m = self.dora_norm(&adapter);
            adapter.with_magnitude(m)
        } else {
            adapter
        };
        self.with_adapter(adapter)
    }

    /// `x·Wᵀ` of the frozen (or fully trained) base weight alone.
    ///
    /// # Shapes
    /// - x: `[batch, seq, in]`
    /// - output: `[batch, seq, out]`
    fn base(&self, x: Tensor<3>, train: bool, shared: Option<&SharedCodes>) -> Tensor<3> {
        match (&self.weight, &self.quant) {
            (BaseWeight::Param(w), Some(q)) => precision_linear_reading(x, w.val(), q, train, shared),
            (BaseWeight::Param(w), None) => linear_t(x, w.val()),
            (BaseWeight::Stored(w), Some(q)) => frozen_linear(x, &w.0, q, train, shared),
            (BaseWeight::Stored(_), None) => unreachable!("a stored weight is built with its precision state"),
        }
    }

    /// `‖W + s·B·A‖` of each output row, f32, without autodiff (DoRA treats it as a constant).
    /// Computed as `√(‖Wᵢ‖² + 2s·Bᵢ·(A·Wᵀ)ᵢ + s²·Bᵢ(A·Aᵀ)Bᵢᵀ)`: the frozen weight enters only
    /// through a rank-wide GEMM and its row norms, as the layer stores it (f32, bf16, FP8 codes
    /// dequantised, or a gathered shard), so no dense `[out, in]` sum is formed.
    ///
    /// # Shapes
    /// - output: `[out]`
    pub fn dora_norm(&self, adapter: &LoraAdapter) -> Tensor<1> {
        let (a, b) = (adapter.a.val().detach(), adapter.b.val().detach());
        let [out, _] = self.dims();
        let (w_sq, aw) = match (&self.weight, &self.quant) {
            (BaseWeight::Param(w), Some(q)) => crate::precision::weight_row_terms(a.clone(), w.val(), q),
            (BaseWeight::Stored(w), Some(q)) => crate::precision::stored_row_terms(a.clone(), &w.0, q),
            (BaseWeight::Param(w), None) => {
                let w = w.val().detach();
                (w.clone().powi_scalar(2).sum_dim(1).reshape([out]), a.clone().matmul(w.transpose()))
            }
            (BaseWeight::Stored(_), None) => unreachable!("a stored weight is built with its precision state"),
        };
        let s = adapter.scale;
        let cross = (aw.transpose() * b.clone()).sum_dim(1).reshape([out]);
        let gram = a.clone().matmul(a.transpose());
        let quad = (b.clone().matmul(gram) * b).sum_dim(1).reshape([out]);
        (w_sq + cross.mul_scalar(2.0 * s) + quad.mul_scalar(s * s)).clamp_min(0.0).sqrt().detach()
    }

    /// The delayed scale this layer's base GEMM will quantise its input with in training
    /// (FP8, every step after the first): what a norm writing that input's codes uses.
    pub fn fp8_input_scale(&self, train: bool) -> Option<f32> {
        self.quant.as_ref()?.ready_input_scale(train)
    }

    /// What the op writing this layer's input is asked to write beside it for the base GEMM
    /// (its codes at [`Self::fp8_input_scale`], handed over in `to`); `None` where the GEMM
    /// will not quantise with a delayed scale.
    pub fn codes_to_write(&self, train: bool, to: &SharedCodes) -> Option<WriteCodes> {
        Some(WriteCodes { scale: self.fp8_input_scale(train)?, to: to.clone() })
    }

    /// `x·Wᵀ (+ bias) (+ adapter)`, PEFT's `lora.Linear` forward (with DoRA, its `DoraLinearVariant`).
    ///
    /// # Shapes
    /// - x: `[batch, seq, in]`
    /// - output: `[batch, seq, out]`
    pub fn forward(&self, x: Tensor<3>, train: bool) -> Tensor<3> {
        self.forward_reading(x, None, train)
    }

    /// [`Self::forward`] with the base GEMM taking `x`'s FP8 codes from `shared`, where
    /// another reader of `x` made them or its writer handed them over (quantised once for
    /// q/k/v, gate/up).
    ///
    /// # Shapes
    /// As [`Self::forward`].
    pub fn forward_reading(&self, x: Tensor<3>, shared: Option<&SharedCodes>, train: bool) -> Tensor<3> {
        let adapter = self.lora.as_ref().filter(|_| !ADAPTERS_OFF.with(std::cell::Cell::get));
        // Inverted dropout, as torch: kept values scaled by 1/(1-p) so eval needs no rescale.
        let dropped = adapter.is_some_and(|a| train && a.dropout > 0.0);
        // Where A keeps an FP8 copy of its input, the op writing that input takes its amax: the
        // dropout; without one, the codes of x made for the base GEMM carry x's amax.
        let keeps = adapter.is_some_and(|a| train && a.keeps_fp8_input());
        let own = (keeps && !dropped && shared.is_none()).then(SharedCodes::new);
        let shared = shared.or(own.as_ref());
        let base = self.base(x.clone(), train, shared);
        let Some(adapter) = adapter else { return self.plus_bias(base) };
        let amax_to = match (keeps, dropped) {
            (true, true) => Some(SharedCodes::new()),
            (true, false) => shared.cloned(),
            (false, _) => None,
        };
        let xa = match (&amax_to, dropped) {
            (Some(to), true) => crate::dropout::offering_amax(to, || crate::dropout::dropout(x, adapter.dropout)),
            (None, true) => crate::dropout::dropout(x, adapter.dropout),
            (_, false) => x,
        };
        let update = adapter.update_reading(xa.clone(), train, amax_to.as_ref());
        // Summed in the adapter's dtype and rounded once: PEFT adds its f32 adapter's output to
        // a bf16 layer's result in f32.
        let dtype = base.dtype();
        let wide = update.dtype();
        let sum = match &adapter.magnitude {
            // PEFT adds the update to the base layer's output, bias included.
            None => cast(self.plus_bias(base), wide) + update,
            Some(m) => {
                let [out, _] = self.dims();
                let g = cast(m.val() / self.dora_norm(adapter), wide).reshape([1, 1, out]);
                // DoRA rescales the weight's product, never the bias (PEFT subtracts it first).
                let scaled = if dropped {
                    let base_dropped = cast(self.base(xa, train, None), wide);
                    cast(base, wide) + base_dropped * g.clone().sub_scalar(1.0) + update * g
                } else {
                    (cast(base, wide) + update) * g
                };
                self.plus_bias(scaled)
            }
        };
        cast(sum, dtype)
    }
}

/// `t` in `dtype`, untouched (no autodiff node) when it already is.
fn cast<const D: usize>(t: Tensor<D>, dtype: burn::tensor::DType) -> Tensor<D> {
    if t.dtype() == dtype { t } else { t.cast(dtype) }
}

/// `x·Wᵀ` for an HF-layout weight `[out, in]`.
///
/// Burn's `linear` saves its input for backward only when the weight needs a gradient, so a
/// frozen base weight costs no saved activation here.
///
/// # Shapes
/// - x: `[batch, seq, in]`
/// - w: `[out, in]`
/// - output: `[batch, seq, out]`
pub fn linear_t(x: Tensor<3>, w: Tensor<2>) -> Tensor<3> {
    burn::tensor::module::linear(x, w.transpose(), None)
}

#[cfg(test)]
mod tests {
    #![allow(deprecated)] // Device::libtorch: burn-tch is deprecated upstream, and it is our backend.
    use super::*;
    use crate::precision::Compute;
    use burn::tensor::Distribution::Normal;

    /// `max |a − b| / max |b|`.
    fn rel(a: Tensor<1>, b: Tensor<1>) -> f32 {
        let scale = b.clone().abs().max().into_scalar::<f32>();
        (a - b).abs().max().into_scalar::<f32>() / scale
    }

    /// With the adapters off, a DoRA layer with a trained adapter (B and the magnitude away from
    /// their start) and a bias gives bit for bit what the same weight and bias without any adapter
    /// give, in f32, bf16 and FP8 and in training; back on after the scope, it differs again.
    #[test]
    fn adapters_off_is_the_layer_without_an_adapter() {
        let _rng = crate::device::torch_rng_lock();
        let device = Device::libtorch().autodiff();
        device.seed(9);
        let (out, inp) = (12, 20);
        let spec = LoraSpec { rank: 4, alpha: 8.0, dora: true, ..LoraSpec::default() };
        let w = Tensor::<2>::random([out, inp], Normal(0.0, 0.2), &device);
        let bias = Tensor::<1>::random([out], Normal(0.0, 0.5), &device);
        let x = Tensor::<3>::random([2, 3, inp], Normal(0.0, 1.0), &device);
        for compute in [Compute::Fp32, Compute::Bf16, Compute::Fp8] {
            let spec_p = PrecisionSpec { compute, ..PrecisionSpec::default() };
            let mut plain = LoraLinear::new(w.clone(), true);
            plain.bias = Some(Param::from_tensor(bias.clone()));
            plain.set_precision(&spec_p, &device);
            let mut adapted = LoraLinear::new(w.clone(), true).with_new_adapter(&spec, &device);
            adapted.bias = Some(Param::from_tensor(bias.clone()));
            let a = adapted.lora.as_mut().unwrap();
            a.b = Param::from_tensor(Tensor::random([out, spec.rank], Normal(0.0, 0.3), &device));
            a.magnitude = Some(Param::from_tensor(Tensor::random([out], Distribution::Uniform(0.5, 2.0), &device)));
            adapted.set_precision(&spec_p, &device);
            let bits = |t: Tensor<3>| t.into_data().convert::<f32>().into_vec::<f32>().unwrap();
            for train in [false, true] {
                let off = without_adapters(|| adapted.forward(x.clone(), train));
                assert_eq!(bits(off), bits(plain.forward(x.clone(), train)), "{compute:?} train {train}");
            }
            assert_ne!(
                bits(adapted.forward(x.clone(), false)),
                bits(plain.forward(x.clone(), false)),
                "{compute:?}: on again"
            );
        }
    }

    /// DoRA as the paper defines it, with `W' = W + s·B·A` formed densely: the row norm of every
    /// stored form of the weight (f32 through Burn or LibTorch, bf16, FP8 codes) is `‖W'ᵢ‖`;
    /// the output is `m/‖W'‖ ⊙ x·W'ᵀ` in evaluation and in training through the dropout branch
    /// (p so small that all is kept: `x·Wᵀ + (g−1)·x·Wᵀ + g·u = g·(x·Wᵀ + u)`); the magnitude's
    /// gradient of `Σy` is `Σ_tokens (x·W'ᵀ)/‖W'‖`; a fresh adapter's magnitude is `‖W‖`.
    #[test]
    fn dora_rescales_each_row_to_its_magnitude() {
        let _rng = crate::device::torch_rng_lock();
        let device = Device::libtorch().autodiff();
        device.seed(5);
        let (out, inp) = (24, 40);
        let spec = LoraSpec { rank: 4, alpha: 8.0, dropout: 1e-12, dora: true, ..LoraSpec::default() };
        let w = Tensor::<2>::random([out, inp], Normal(0.0, 0.2), &device);
        let x = Tensor::<3>::random([2, 3, inp], Normal(0.0, 1.0), &device);
        let fresh = LoraLinear::new(w.clone(), false).with_new_adapter(&spec, &device);
        let m0 = fresh.lora.as_ref().unwrap().magnitude.as_ref().unwrap().val();
        assert!(rel(m0, w.clone().powi_scalar(2).sum_dim(1).sqrt().reshape([out])) < 1e-6, "initial magnitude");

        let with_state = |precision: Option<Compute>| {
            let mut layer = LoraLinear::new(w.clone(), false).with_new_adapter(&spec, &device);
            let a = layer.lora.as_mut().unwrap();
            a.b = Param::from_tensor(Tensor::random([out, spec.rank], Normal(0.0, 0.3), &device));
            a.magnitude = Some(Param::from_tensor(Tensor::random([out], Distribution::Uniform(0.5, 2.0), &device)));
            if let Some(compute) = precision {
                let fp8 = compute == Compute::Fp8;
                layer.set_precision(&PrecisionSpec { compute, fp8_weights: fp8, ..PrecisionSpec::default() }, &device);
            }
            layer
        };
        for (precision, tol) in
            [(None, 1e-6), (Some(Compute::Fp32), 1e-6), (Some(Compute::Bf16), 1e-2), (Some(Compute::Fp8), 1e-6)]
        {
            let layer = with_state(precision);
            let a = layer.lora.as_ref().unwrap();
            let dense = layer.base_weight(&device) + a.b.val().matmul(a.a.val()).mul_scalar(a.scale);
            let norm = dense.clone().powi_scalar(2).sum_dim(1).sqrt().reshape([out]);
            // bf16: A·Wᵀ is a bf16 GEMM (A rounded), as PEFT's bf16 computes its whole norm.
            let err = rel(layer.dora_norm(a), norm.clone());
            assert!(err < tol, "{precision:?}: row norm relative error {err:e}");
        }
        let layer = with_state(None);
        let a = layer.lora.as_ref().unwrap();
        let m = a.magnitude.as_ref().unwrap().val();
        let dense = w.clone() + a.b.val().matmul(a.a.val()).mul_scalar(a.scale);
        let norm = dense.clone().powi_scalar(2).sum_dim(1).sqrt().reshape([out]);
        let unscaled = linear_t(x.clone(), dense).detach();
        let want = unscaled.clone() * (m.clone() / norm.clone()).reshape([1, 1, out]);
        let want_grad = unscaled.sum_dim(0).sum_dim(1).reshape([out]) / norm;
        for train in [false, true] {
            let y = layer.forward(x.clone(), train);
            let err = rel(y.clone().flatten(0, 2), want.clone().flatten(0, 2));
            assert!(err < 1e-5, "train {train}: output relative error {err:e}");
            let grads = y.sum().backward();
            let err = rel(m.grad(&grads).unwrap(), want_grad.clone());
            assert!(err < 1e-5, "train {train}: magnitude gradient relative error {err:e}");
        }
    }

    /// Without dropout, an adapter's A GEMM keeps its FP8 copy of x at the amax taken with the
    /// codes that x's FP8 base GEMM made (no amax pass of its own: counted as quantised at its
    /// writer's amax, once the base has a delayed scale), and A's and B's gradients are bit for
    /// bit those of a bf16 base, which makes no codes, so that A takes its own amax pass.
    #[test]
    fn without_dropout_a_keeps_its_fp8_input_at_the_amax_of_the_base_codes() {
        use crate::fp8::take_quantiser_counts;
        use crate::precision::AdapterCompute;
        let _rng = crate::device::torch_rng_lock();
        let device = Device::libtorch().autodiff();
        device.seed(13);
        let (out, inp, rank) = (24, 64, 4);
        let spec = LoraSpec { rank, alpha: 8.0, dropout: 0.0, ..LoraSpec::default() };
        let w = Tensor::<2>::random([out, inp], Normal(0.0, 0.2), &device);
        let (a0, b0) = (
            Tensor::<2>::random([rank, inp], Normal(0.0, 0.3), &device),
            Tensor::random([out, rank], Normal(0.0, 0.3), &device),
        );
        let x = Tensor::<3>::random([2, 5, inp], Normal(0.0, 3.0), &device);
        let g = Tensor::<3>::random([2, 5, out], Normal(0.0, 1.0), &device);
        let bits = |t: Tensor<2>| t.into_data().convert::<f32>().into_vec::<f32>().unwrap();
        let run = |compute: Compute| {
            let mut layer = LoraLinear::new(w.clone(), false).with_new_adapter(&spec, &device);
            let adapter = layer.lora.as_mut().unwrap();
            (adapter.a, adapter.b) = (Param::from_tensor(a0.clone()), Param::from_tensor(b0.clone()));
            let precision = PrecisionSpec {
                compute,
                fp8_activations: true,
                adapter_compute: AdapterCompute::Bf16,
                ..PrecisionSpec::default()
            };
            layer.set_precision(&precision, &device);
            // The first step makes the base's delayed input scale.
            let _ = layer.forward(x.clone(), true);
            layer.quant.as_ref().unwrap().update();
            let _ = take_quantiser_counts();
            let y = layer.forward(x.clone(), true);
            let handed = take_quantiser_counts().at_writers_amax;
            let grads = (y * g.clone()).sum().backward();
            let adapter = layer.lora.as_ref().unwrap();
            (handed, bits(adapter.a.grad(&grads).unwrap()), bits(adapter.b.grad(&grads).unwrap()))
        };
        let (handed, a, b) = run(Compute::Fp8);
        let (own, want_a, want_b) = run(Compute::Bf16);
        assert_eq!((handed, own), (1, 0), "A's copy at the base codes' amax, then at its own");
        assert_eq!(a, want_a, "A's gradient");
        assert_eq!(b, want_b, "B's gradient");
    }

    /// Adapters reading one input without dropout (q, k and v; gate and up) keep one FP8 copy
    /// of it between them: handed the same `SharedCodes`, two layers quantise x once (twice
    /// with a handle each), and each A's gradient is bit for bit the one it gets from a copy of
    /// its own.
    #[test]
    fn adapters_reading_one_input_keep_one_fp8_copy_of_it() {
        use crate::fp8::take_quantiser_counts;
        use crate::precision::AdapterCompute;
        let _rng = crate::device::torch_rng_lock();
        let device = Device::libtorch().autodiff();
        device.seed(17);
        let (out, inp) = (16, 48);
        let spec = LoraSpec { rank: 4, alpha: 8.0, dropout: 0.0, ..LoraSpec::default() };
        let precision = PrecisionSpec {
            compute: Compute::Bf16,
            fp8_activations: true,
            adapter_compute: AdapterCompute::Bf16,
            ..PrecisionSpec::default()
        };
        let layer = || {
            let w = Tensor::<2>::random([out, inp], Normal(0.0, 0.2), &device);
            let mut layer = LoraLinear::new(w, false).with_new_adapter(&spec, &device);
            let adapter = layer.lora.as_mut().unwrap();
            adapter.b = Param::from_tensor(Tensor::random([out, 4], Normal(0.0, 0.3), &device));
            layer.set_precision(&precision, &device);
            layer
        };
        let (q, k) = (layer(), layer());
        let x = Tensor::<3>::random([2, 5, inp], Normal(0.0, 3.0), &device);
        let g = Tensor::<3>::random([2, 5, out], Normal(0.0, 1.0), &device);
        let bits = |t: Tensor<2>| t.into_data().convert::<f32>().into_vec::<f32>().unwrap();
        let run = |handles: [&SharedCodes; 2]| {
            let _ = take_quantiser_counts();
            let y = q.forward_reading(x.clone(), Some(handles[0]), true)
                + k.forward_reading(x.clone(), Some(handles[1]), true).mul_scalar(2.0);
            let n = take_quantiser_counts();
            let grads = (y * g.clone()).sum().backward();
            let a_grad = |l: &LoraLinear| bits(l.lora.as_ref().unwrap().a.grad(&grads).unwrap());
            (n.kernel + n.two_pass + n.via_f32, a_grad(&q), a_grad(&k))
        };
        let one = SharedCodes::new();
        let (once, q_shared, k_shared) = run([&one, &one]);
        let (twice, q_own, k_own) = run([&SharedCodes::new(), &SharedCodes::new()]);
        // x once or twice, and each B's input (A's output, the bottleneck) its own.
        assert_eq!((once, twice), (1 + 2, 2 + 2), "quantisations");
        assert_eq!(q_shared, q_own, "q's A gradient");
        assert_eq!(k_shared, k_own, "k's A gradient");
    }

    fn spec(targets: &[&str]) -> LoraSpec {
        LoraSpec { targets: targets.iter().map(|t| t.to_string()).collect(), ..LoraSpec::default() }
    }

    #[test]
    fn targets_resolve_to_the_checkpoint_layout_or_are_refused() {
        // The MLPerf config on separate projections: q, k, v take qkv_proj's place, in order.
        let got = spec(&["qkv_proj", "o_proj"]).for_layout(false).unwrap();
        assert_eq!(got.targets, ["q_proj", "k_proj", "v_proj", "o_proj"]);
        // Named twice (explicitly and through qkv_proj): once.
        let got = spec(&["q_proj", "qkv_proj", "down_proj"]).for_layout(false).unwrap();
        assert_eq!(got.targets, ["q_proj", "k_proj", "v_proj", "down_proj"]);
        // Fused: qkv_proj stays, q/k/v parts cannot be adapted alone.
        assert_eq!(spec(&["qkv_proj", "o_proj"]).for_layout(true).unwrap().targets, ["qkv_proj", "o_proj"]);
        let err = spec(&["q_proj", "v_proj"]).for_layout(true).unwrap_err().to_string();
        assert!(err.contains("\"q_proj\"") && err.contains("qkv_proj"), "{err}");
        for bad in [&["foo"][..], &["o_proj", "lm_head"], &[]] {
            assert!(spec(bad).for_layout(false).is_err(), "{bad:?} accepted");
        }
    }
}
