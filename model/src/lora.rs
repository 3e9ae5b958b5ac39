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

use std::sync::Arc;

use burn::module::{Module, Param};
use burn::tensor::{Device, Distribution, Tensor, TensorData};

use crate::precision::{FrozenWeight, LinearQuant, PrecisionSpec, quant_linear};

/// A linear layer `y = x·Wᵀ` with frozen `W` and an optional LoRA adapter.
#[derive(Module, Debug)]
pub struct LoraLinear {
    /// Base weight, HF layout `[out, in]`; frozen unless full fine-tuning.
    pub weight: Param<Tensor<2>>,
    /// The adapter, when this module is a LoRA target.
    pub lora: Option<LoraAdapter>,
    /// Reduced-precision state (`None`: plain f32 through Burn's linear). When it stores the
    /// frozen weight, `weight` is an empty placeholder.
    #[module(skip)]
    pub quant: Option<Arc<LinearQuant>>,
}

/// The low-rank pair of a [`LoraLinear`].
#[derive(Module, Debug)]
pub struct LoraAdapter {
    /// Down projection A, `[r, in]` (PEFT's `lora_A.weight`).
    pub a: Param<Tensor<2>>,
    /// Up projection B, `[out, r]` (PEFT's `lora_B.weight`).
    pub b: Param<Tensor<2>>,
    /// The update's factor: α / r, or α / √r with rsLoRA ([`LoraSpec::scale`]).
    #[module(skip)]
    pub scale: f64,
    /// Dropout probability on the adapter input.
    #[module(skip)]
    pub dropout: f64,
    /// Reduced-precision states of the A and B GEMMs (`None`: f32).
    #[module(skip)]
    pub quant: Option<[Arc<LinearQuant>; 2]>,
}

/// How to build adapters.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraSpec {
    /// Rank r.
    pub rank: usize,
    /// α (the update is scaled by α / r, or α / √r with `rslora`).
    pub alpha: f64,
    /// Dropout on the adapter input.
    pub dropout: f64,
    /// Module names that get an adapter (`q_proj`, `o_proj`, `gate_proj`, ...).
    pub targets: Vec<String>,
    /// rsLoRA (Kalajdzievski 2023, PEFT's `use_rslora`): scale the update by α/√r, which keeps
    /// its size stable as the rank grows, instead of α/r.
    pub rslora: bool,
    /// Ranks of some modules (PEFT's `rank_pattern`: key → rank, see `patterns.rs`).
    pub rank_pattern: Vec<(String, usize)>,
    /// Alphas of some modules (PEFT's `alpha_pattern`).
    pub alpha_pattern: Vec<(String, f64)>,
    /// Only these decoder layers get adapters (PEFT's `layers_to_transform`); `None`: all.
    pub layers: Option<Vec<usize>>,
}

impl Default for LoraSpec {
    /// The MLPerf reference: r 16, α 32, dropout 0.1, attention projections.
    fn default() -> Self {
        Self {
            rank: 16,
            alpha: 32.0,
            dropout: 0.1,
            targets: ["q_proj", "k_proj", "v_proj", "o_proj"].map(String::from).to_vec(),
            rslora: false,
            rank_pattern: Vec::new(),
            alpha_pattern: Vec::new(),
            layers: None,
        }
    }
}

/// Module names a LoRA target may be: the Llama projections, `qkv_proj` on fused-QKV checkpoints.
pub const TARGET_MODULES: &[&str] =
    &["q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "gate_proj", "up_proj", "down_proj"];

impl LoraSpec {
    /// The factor of the update `B·A·x`: α/r, or α/√r with rsLoRA.
    pub fn scale(&self) -> f64 {
        let r = self.rank as f64;
        if self.rslora { self.alpha / r.sqrt() } else { self.alpha / r }
    }

    /// The settings of module `name` (its full name, `model.layers.0.self_attn.q_proj`): rank
    /// and alpha from the patterns when a key matches, no patterns left.
    pub fn module_spec(&self, name: &str) -> anyhow::Result<LoraSpec> {
        use crate::patterns::value_for;
        let rank = value_for(&self.rank_pattern, name).map_err(|e| anyhow::anyhow!("rank_pattern: {e}"))?;
        let alpha = value_for(&self.alpha_pattern, name).map_err(|e| anyhow::anyhow!("alpha_pattern: {e}"))?;
        Ok(LoraSpec {
            rank: rank.unwrap_or(self.rank),
            alpha: alpha.unwrap_or(self.alpha),
            rank_pattern: Vec::new(),
            alpha_pattern: Vec::new(),
            layers: None,
            ..self.clone()
        })
    }

    /// Whether module `name` (full name) gets an adapter: its last part is a target and its
    /// layer is one of `layers` (when set).
    pub fn adapts(&self, name: &str) -> bool {
        let short = name.rsplit('.').next().unwrap_or_default();
        let layer_ok = match &self.layers {
            None => true,
            Some(l) => crate::patterns::layer_index(name).is_some_and(|i| l.contains(&i)),
        };
        self.targets(short) && layer_ok
    }

    /// Whether module `name` (e.g. `q_proj`) is a target.
    pub fn targets(&self, name: &str) -> bool {
        self.targets.iter().any(|t| t == name)
    }

    /// The targets as modules of a checkpoint whose attention input projection is fused
    /// (`qkv_proj`) or not (`q_proj`, `k_proj`, `v_proj`).
    ///
    /// `qkv_proj` on separate projections becomes `q_proj`, `k_proj`, `v_proj`: the MLPerf
    /// configs name the fused module of the reference's converted checkpoint, and on the usual
    /// HF layout (Llama-2-70b-hf) they mean "adapt q, k and v" (PEFT would otherwise refuse a
    /// name that matches nothing). The reverse cannot be mapped: one adapter on the fused
    /// weight is not three on its parts, so q/k/v targets on a fused checkpoint are refused,
    /// as is any name that is no module of the model. Never silently drops a target.
    pub fn for_layout(&self, fused_qkv: bool) -> anyhow::Result<LoraSpec> {
        anyhow::ensure!(!self.targets.is_empty(), "lora.targets is empty: name at least one module");
        let mut targets: Vec<String> = Vec::new();
        for t in &self.targets {
            anyhow::ensure!(
                TARGET_MODULES.contains(&t.as_str()),
                "lora target {t:?} is no module of a Llama model: expected some of {}",
                TARGET_MODULES.join(", ")
            );
            let parts: Vec<&str> = match (t.as_str(), fused_qkv) {
                ("qkv_proj", false) => vec!["q_proj", "k_proj", "v_proj"],
                ("q_proj" | "k_proj" | "v_proj", true) => anyhow::bail!(
                    "lora target {t:?}: this checkpoint stores q, k and v as one fused qkv_proj, which has no {t}; \
                     target \"qkv_proj\" (one adapter on the fused projection, as the MLPerf reference does)"
                ),
                (name, _) => vec![name],
            };
            for p in parts {
                if !targets.iter().any(|x| x == p) {
                    targets.push(p.to_string());
                }
            }
        }
        Ok(LoraSpec { targets, ..self.clone() })
    }
}

impl LoraAdapter {
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
            scale: spec.scale(),
            dropout: spec.dropout,
            quant: None,
        }
    }

    /// The adapter's contribution `(α/r)·B(A(dropout(x)))`.
    ///
    /// # Shapes
    /// - x: `[batch, seq, in]`
    /// - output: `[batch, seq, out]`
    pub fn forward(&self, x: Tensor<3>, train: bool) -> Tensor<3> {
        // Inverted dropout, as torch: kept values scaled by 1/(1-p) so eval needs no rescale.
        let x = if train { crate::dropout::dropout(x, self.dropout) } else { x };
        let up = match &self.quant {
            Some([qa, qb]) => quant_linear(quant_linear(x, self.a.val(), qa, train), self.b.val(), qb, train),
            None => linear_t(linear_t(x, self.a.val()), self.b.val()),
        };
        up.mul_scalar(self.scale)
    }

    /// The dense update `(α/r)·B·A`, `[out, in]`, for merging into the base weight.
    pub fn delta(&self) -> Tensor<2> {
        self.b.val().matmul(self.a.val()).mul_scalar(self.scale)
    }
}

impl LoraLinear {
    /// A frozen linear layer from a `[out, in]` weight; `trainable` unfreezes it (full FT).
    pub fn new(weight: Tensor<2>, trainable: bool) -> Self {
        let weight = Param::from_tensor(weight).set_require_grad(trainable);
        Self { weight, lora: None, quant: None }
    }

    /// A frozen layer whose weight is already stored in reduced precision or sharded
    /// (`weight` is then an empty placeholder on `device`).
    pub fn from_stored(stored: FrozenWeight, spec: &PrecisionSpec, device: &Device) -> Self {
        let placeholder = Tensor::<2>::zeros([0, stored.dims()[1]], device);
        Self {
            weight: Param::from_tensor(placeholder).set_require_grad(false),
            lora: None,
            quant: Some(Arc::new(LinearQuant::new(*spec, Some(stored)))),
        }
    }

    /// Attaches an adapter.
    pub fn with_adapter(mut self, adapter: LoraAdapter) -> Self {
        self.lora = Some(adapter);
        self
    }

    /// `[out, in]` of the base weight.
    pub fn dims(&self) -> [usize; 2] {
        match self.quant.as_ref().and_then(|q| q.stored.as_ref()) {
            Some(stored) => stored.dims(),
            None => self.weight.shape().dims(),
        }
    }

    /// The base weight in f32 (dequantised when it is stored in reduced precision).
    pub fn base_weight(&self) -> Tensor<2> {
        match self.quant.as_ref().and_then(|q| q.stored.as_ref()) {
            Some(stored) => {
                let w = stored.whole().dequantize();
                let values = Vec::<f32>::try_from(&w.flatten(0, -1)).expect("f32 weight");
                Tensor::from_data(TensorData::new(values, self.dims()), &self.weight.device())
            }
            None => self.weight.val(),
        }
    }

    /// Bytes the base weight occupies.
    pub fn base_weight_bytes(&self) -> usize {
        match self.quant.as_ref().and_then(|q| q.stored.as_ref()) {
            Some(stored) => stored.bytes(),
            None => self.weight.shape().num_elements() * self.weight.val().dtype().size(),
        }
    }

    /// Switches the layer (and its adapter) to `spec`, through the LibTorch op of
    /// [`quant_linear`] (f32 included: one code path for every precision on LibTorch): frozen
    /// base weights are stored in bf16 or FP8 when `spec` asks, dropping the f32 copy. On
    /// other devices only plain f32 is possible, and the layer stays on Burn's linear.
    pub fn set_precision(&mut self, spec: &PrecisionSpec) {
        if crate::precision::tch_device(&self.weight.device()).is_none() {
            assert!(spec.is_fp32(), "reduced precision needs a LibTorch device");
            self.quant = None;
            if let Some(a) = &mut self.lora {
                a.quant = None;
            }
            return;
        }
        let frozen = !self.weight.is_require_grad();
        let stored = if frozen && spec.stores_frozen_weights() && self.quant.as_ref().is_none_or(|q| q.stored.is_none())
        {
            let w = self.weight.val();
            let values = w.to_data().convert::<f32>().into_vec::<f32>().expect("f32 weight");
            let device = crate::precision::tch_device(&w.device()).expect("reduced precision needs a LibTorch device");
            LinearQuant::store_weight(spec, &values, self.dims(), device).map(FrozenWeight::Whole)
        } else {
            self.quant.as_ref().and_then(|q| q.stored.clone())
        };
        if stored.is_some() {
            let device = self.weight.device();
            let placeholder = Tensor::<2>::zeros([0, self.dims()[1]], &device);
            self.weight = Param::initialized(self.weight.id, placeholder.set_require_grad(false));
        }
        self.quant = Some(Arc::new(LinearQuant::new(*spec, stored)));
        if let Some(a) = &mut self.lora {
            let adapters = spec.for_adapters();
            a.quant = Some([Arc::new(LinearQuant::new(adapters, None)), Arc::new(LinearQuant::new(adapters, None))]);
        }
    }

    /// `x·Wᵀ (+ adapter)`.
    ///
    /// # Shapes
    /// - x: `[batch, seq, in]`
    /// - output: `[batch, seq, out]`
    pub fn forward(&self, x: Tensor<3>, train: bool) -> Tensor<3> {
        let base = match &self.quant {
            Some(q) => quant_linear(x.clone(), self.weight.val(), q, train),
            None => linear_t(x.clone(), self.weight.val()),
        };
        match &self.lora {
            Some(adapter) => {
                let update = adapter.forward(x, train);
                let dtype = base.dtype();
                if update.dtype() == dtype {
                    base + update
                } else {
                    // An f32 adapter on a bf16 layer: summed in f32 and rounded once, as PEFT
                    // adds its f32 adapter's output to the bf16 result.
                    (base.cast(update.dtype()) + update).cast(dtype)
                }
            }
            None => base,
        }
    }
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
    use super::*;

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
