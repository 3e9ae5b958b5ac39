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

use burn::module::{Module, Param};
use burn::tensor::{Device, Distribution, Tensor};

/// A linear layer `y = x·Wᵀ` with frozen `W` and an optional LoRA adapter.
#[derive(Module, Debug)]
pub struct LoraLinear {
    /// Base weight, HF layout `[out, in]`; frozen unless full fine-tuning.
    pub weight: Param<Tensor<2>>,
    /// The adapter, when this module is a LoRA target.
    pub lora: Option<LoraAdapter>,
}

/// The low-rank pair of a [`LoraLinear`].
#[derive(Module, Debug)]
pub struct LoraAdapter {
    /// Down projection A, `[r, in]` (PEFT's `lora_A.weight`).
    pub a: Param<Tensor<2>>,
    /// Up projection B, `[out, r]` (PEFT's `lora_B.weight`).
    pub b: Param<Tensor<2>>,
    /// α / r.
    #[module(skip)]
    pub scale: f64,
    /// Dropout probability on the adapter input.
    #[module(skip)]
    pub dropout: f64,
}

/// How to build adapters.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraSpec {
    /// Rank r.
    pub rank: usize,
    /// α (the update is scaled by α / r).
    pub alpha: f64,
    /// Dropout on the adapter input.
    pub dropout: f64,
    /// Module names that get an adapter (`q_proj`, `o_proj`, `gate_proj`, ...).
    pub targets: Vec<String>,
}

impl Default for LoraSpec {
    /// The MLPerf reference: r 16, α 32, dropout 0.1, attention projections.
    fn default() -> Self {
        Self {
            rank: 16,
            alpha: 32.0,
            dropout: 0.1,
            targets: ["q_proj", "k_proj", "v_proj", "o_proj"].map(String::from).to_vec(),
        }
    }
}

impl LoraSpec {
    /// Whether module `name` (e.g. `q_proj`) is a target.
    pub fn targets(&self, name: &str) -> bool {
        self.targets.iter().any(|t| t == name)
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
            scale: spec.alpha / spec.rank as f64,
            dropout: spec.dropout,
        }
    }

    /// The adapter's contribution `(α/r)·B(A(dropout(x)))`.
    ///
    /// # Shapes
    /// - x: `[batch, seq, in]`
    /// - output: `[batch, seq, out]`
    pub fn forward(&self, x: Tensor<3>, train: bool) -> Tensor<3> {
        let x = if train && self.dropout > 0.0 {
            // Inverted dropout, as torch: kept values scaled by 1/(1-p) so eval needs no rescale.
            let keep = 1.0 - self.dropout;
            let mask = x.random_like(Distribution::Bernoulli(keep));
            x * mask.mul_scalar(1.0 / keep)
        } else {
            x
        };
        let down = linear_t(x, self.a.val());
        linear_t(down, self.b.val()).mul_scalar(self.scale)
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
        Self { weight, lora: None }
    }

    /// Attaches an adapter.
    pub fn with_adapter(mut self, adapter: LoraAdapter) -> Self {
        self.lora = Some(adapter);
        self
    }

    /// `[out, in]` of the base weight.
    pub fn dims(&self) -> [usize; 2] {
        self.weight.shape().dims()
    }

    /// `x·Wᵀ (+ adapter)`.
    ///
    /// # Shapes
    /// - x: `[batch, seq, in]`
    /// - output: `[batch, seq, out]`
    pub fn forward(&self, x: Tensor<3>, train: bool) -> Tensor<3> {
        let base = linear_t(x.clone(), self.weight.val());
        match &self.lora {
            Some(adapter) => base + adapter.forward(x, train),
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
