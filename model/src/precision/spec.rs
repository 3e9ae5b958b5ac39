//! Which precision a model trains in: the GEMM format, what is stored in 8 bits, and the
//! dtypes that follow from them for activations, adapters and frozen weights.

use serde::{Deserialize, Serialize};

use crate::fp8::AmaxSpec;

/// The number format of the linear layers' GEMM inputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Compute {
    /// f32 everywhere.
    #[default]
    Fp32,
    /// bf16 activations and bf16 GEMMs (f32 accumulation); frozen weights stored in bf16.
    Bf16,
    /// E4M3 forward / E5M2 backward GEMM inputs with delayed scaling.
    Fp8,
}

impl Compute {
    /// The name MLPerf's `lowest_numerical_precision_*` keys use.
    pub fn name(self) -> &'static str {
        match self {
            Self::Fp32 => "fp32",
            Self::Bf16 => "bf16",
            Self::Fp8 => "fp8",
        }
    }
}

/// Which precision a model trains in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PrecisionSpec {
    /// GEMM input format of the linear layers (base and LoRA).
    pub compute: Compute,
    /// Store saved activations (linear inputs, SwiGLU inputs) as FP8 + scale.
    pub fp8_activations: bool,
    /// Store frozen base weights as FP8 + scale (needs `compute = Fp8`).
    pub fp8_weights: bool,
    /// With `fp8_weights` on CUDA, keep each weight's codes in one layout and transpose them
    /// for every input-gradient GEMM, instead of keeping the transpose too: half the weights'
    /// bytes (65 of 130 GB for Llama 2 70B) for one copy per weight per backward.
    pub fp8_weights_one_layout: bool,
    /// Delayed-scaling settings.
    pub amax: AmaxSpec,
    /// Store frozen base weights in NF4 (QLoRA; `model.quantize = "nf4"`), dequantised for
    /// each GEMM in the compute format (fp32 or bf16).
    pub nf4: Option<Nf4Spec>,
}

/// QLoRA's NF4 storage of the frozen weights (see [`super::nf4`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Nf4Spec {
    /// Values per absmax (`model.quant_block_size`; QLoRA and bitsandbytes use 64).
    pub block: usize,
    /// Quantise the absmaxes too (`model.double_quant`).
    pub double: bool,
}

impl Nf4Spec {
    /// Bytes stored per weight value: half a byte of code, and a block's scale shared by its
    /// values (4 bytes; double quantisation: 1 byte, and 4 per 256 blocks).
    pub fn bytes_per_value(&self) -> f64 {
        let block = self.block as f64;
        let scale = if self.double { (1.0 + 4.0 / super::nf4::DOUBLE_BLOCK as f64) / block } else { 4.0 / block };
        0.5 + scale
    }
}

impl Default for Nf4Spec {
    /// QLoRA's: blocks of 64, double quantisation.
    fn default() -> Self {
        Self { block: super::nf4::BLOCK, double: true }
    }
}

impl PrecisionSpec {
    /// Whether this is plain f32 (no extension op needed around the linear layers).
    pub fn is_fp32(&self) -> bool {
        self.compute == Compute::Fp32 && !self.fp8_activations && self.nf4.is_none()
    }

    /// Checks the combination; the message names the offending keys.
    pub fn validate(&self) -> Result<(), String> {
        if self.fp8_weights && self.compute != Compute::Fp8 {
            return Err(format!(
                "precision.fp8_weights = true needs precision.compute = \"fp8\" (it is {:?})",
                self.compute.name()
            ));
        }
        self.validate_nf4()?;
        if !(1..=1024).contains(&self.amax.history_len) {
            return Err(format!("precision.amax_history_len must be in 1..=1024, got {}", self.amax.history_len));
        }
        if !(0..=16).contains(&self.amax.margin) {
            return Err(format!("precision.amax_margin must be in 0..=16, got {}", self.amax.margin));
        }
        Ok(())
    }

    /// Checks the NF4 storage against the rest: its block size, and no FP8 compute over it.
    pub fn validate_nf4(&self) -> Result<(), String> {
        if let Some(nf4) = self.nf4 {
            if self.compute == Compute::Fp8 {
                return Err("model.quantize = \"nf4\" needs precision.compute = \"fp32\" or \"bf16\": FP8 GEMMs \
                            over an NF4 base are not supported (the weight would be dequantised and quantised again \
                            every GEMM)"
                    .into());
            }
            if !nf4.block.is_power_of_two() || !(32..=4096).contains(&nf4.block) {
                return Err(format!(
                    "model.quant_block_size must be a power of two in 32..=4096 (bitsandbytes' sizes) for \
                     model.quantize = \"nf4\", got {}",
                    nf4.block
                ));
            }
        }
        Ok(())
    }

    /// The format the activations (and attention) compute in: fp32, or bf16 for bf16 and FP8.
    pub fn activation_compute(&self) -> Compute {
        if self.compute == Compute::Fp32 { Compute::Fp32 } else { Compute::Bf16 }
    }

    /// The dtype of the activations between the linear layers: f32 for `fp32`; bf16 for
    /// `bf16` and `fp8` (FP8 is the GEMM operands' format, not the activations', as in
    /// Transformer Engine: its GEMMs take bf16 in and give bf16 out).
    pub fn activation_dtype(&self) -> burn::tensor::DType {
        match self.compute {
            Compute::Fp32 => burn::tensor::DType::F32,
            Compute::Bf16 | Compute::Fp8 => burn::tensor::DType::BF16,
        }
    }

    /// The precision of a layer's LoRA adapter GEMMs. Adapters are rank-r GEMMs (under 1% of
    /// a step's FLOPs) on f32 master weights that change every step:
    /// - `bf16`: f32 GEMMs on the upcast bf16 input, as PEFT runs its f32 adapters on a bf16
    ///   model (its default `autocast_adapter_dtype`): bf16 GEMMs there measurably moved the
    ///   gradients further from fp32's than PEFT's (cosine 0.99995 vs 0.99996, tests/parity.rs),
    ///   for no speed that matters;
    /// - `fp8`: bf16 GEMMs, as NeMo/Transformer Engine and the MLPerf reference run them (FP8
    ///   with delayed scales would buy nothing at rank 16).
    pub fn for_adapters(&self) -> PrecisionSpec {
        let compute = if self.compute == Compute::Fp8 { Compute::Bf16 } else { Compute::Fp32 };
        PrecisionSpec { compute, fp8_weights: false, nf4: None, ..*self }
    }

    /// Whether frozen base weights are kept in reduced precision (bf16, FP8 + scale, or NF4).
    pub fn stores_frozen_weights(&self) -> bool {
        self.compute == Compute::Bf16 || (self.compute == Compute::Fp8 && self.fp8_weights) || self.nf4.is_some()
    }

    /// How the SwiGLU inputs are stored for backward.
    pub fn activation_storage(&self) -> Storage {
        match (self.fp8_activations, self.compute) {
            (true, _) => Storage::Fp8,
            (false, Compute::Bf16) => Storage::Bf16,
            _ => Storage::F32,
        }
    }
}

/// The dtype a tensor saved for backward is kept in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Storage {
    /// As computed (4 bytes per element).
    #[default]
    F32,
    /// bf16 (2 bytes).
    Bf16,
    /// E4M3 + per-tensor scale (1 byte).
    Fp8,
}
