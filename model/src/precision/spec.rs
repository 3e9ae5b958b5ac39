//! Which precision a model trains in: the GEMM format, what is stored in 8 bits, and the
//! dtypes that follow from them for activations, adapters and frozen weights.

use serde::{Deserialize, Serialize};

use crate::fp8::{AmaxAlgo, AmaxSpec};
use crate::spec_problem::{SpecProblem, SpecProblems};

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

/// The format of the LoRA adapters' GEMMs (`precision.adapter_compute`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum AdapterCompute {
    /// As the peers run them: f32 under fp32 and bf16 compute (PEFT's default
    /// `autocast_adapter_dtype`), bf16 under FP8 (NeMo / Transformer Engine, the MLPerf
    /// reference).
    #[default]
    Auto,
    /// f32 GEMMs on the upcast input, whatever the model computes in.
    Fp32,
    /// bf16 GEMMs on the bf16 input (f32 accumulation; the master weights stay f32), as PEFT
    /// runs adapters loaded in bf16 (`autocast_adapter_dtype=False`): no f32 copy of each
    /// adapted layer's input, at the cost of gradients a little further from fp32's.
    Bf16,
}

/// Which precision a model trains in: a config's `[precision]` section as written (serde,
/// through [`Section`]: the delayed-scaling settings are its flat `amax_*` keys); `nf4` is not
/// read from that section but from `[model]` (`model.quantize`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(from = "Section", into = "Section")]
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
    /// The adapters' GEMM format ([`Self::for_adapters`]).
    pub adapter_compute: AdapterCompute,
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

/// The `[precision]` section's shape: [`PrecisionSpec`]'s fields with [`AmaxSpec`]'s under
/// Transformer Engine's flat names. A private wire form because serde's `flatten` cannot be
/// combined with `deny_unknown_fields` (a misspelt key must be refused, not ignored).
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct Section {
    /// Linear-layer GEMM inputs: `"fp32"`, `"bf16"` or `"fp8"` (E4M3 forward, E5M2
    /// gradients, delayed scaling: Transformer Engine's hybrid recipe).
    compute: Compute,
    /// Keep activations saved for backward (linear inputs, SwiGLU inputs) as FP8 + scale.
    fp8_activations: bool,
    /// Keep frozen base weights as FP8 + scale (needs `compute = "fp8"`).
    fp8_weights: bool,
    /// With `fp8_weights` on CUDA: one layout per weight, transposed for every input-gradient GEMM.
    fp8_weights_one_layout: bool,
    /// LoRA adapters' GEMMs: `"auto"` (f32 under fp32/bf16 as PEFT, bf16 under FP8 as NeMo),
    /// `"fp32"` or `"bf16"`.
    adapter_compute: AdapterCompute,
    /// Delayed scaling: amaxes of this many past steps set each scale (1..=1024).
    amax_history_len: usize,
    /// How the history becomes one amax: `"max"` or `"most_recent"`.
    amax_compute_algo: AmaxAlgo,
    /// Scale = fp8_max / amax / 2^margin (0..=16).
    amax_margin: i32,
}

impl Default for Section {
    fn default() -> Self {
        PrecisionSpec::default().into()
    }
}

impl From<Section> for PrecisionSpec {
    fn from(s: Section) -> Self {
        let amax = AmaxSpec { history_len: s.amax_history_len, algo: s.amax_compute_algo, margin: s.amax_margin };
        let (fp8_activations, fp8_weights) = (s.fp8_activations, s.fp8_weights);
        Self {
            compute: s.compute,
            fp8_activations,
            fp8_weights,
            fp8_weights_one_layout: s.fp8_weights_one_layout,
            adapter_compute: s.adapter_compute,
            amax,
            nf4: None,
        }
    }
}

impl From<PrecisionSpec> for Section {
    fn from(p: PrecisionSpec) -> Self {
        Self {
            compute: p.compute,
            fp8_activations: p.fp8_activations,
            fp8_weights: p.fp8_weights,
            fp8_weights_one_layout: p.fp8_weights_one_layout,
            adapter_compute: p.adapter_compute,
            amax_history_len: p.amax.history_len,
            amax_compute_algo: p.amax.algo,
            amax_margin: p.amax.margin,
        }
    }
}

impl PrecisionSpec {
    /// Everything wrong with this precision, each problem named by its config key
    /// (`precision.*`, and `model.quant_block_size` / `precision.compute` for the NF4 base):
    /// the one check of a precision, which the config and every command's flags report.
    pub fn problems(&self) -> Vec<SpecProblem> {
        let mut p = SpecProblems::default();
        let a = &self.amax;
        p.check(
            (1..=1024).contains(&a.history_len),
            "precision.amax_history_len",
            &a.history_len,
            "must be in 1..=1024",
        );
        p.check((0..=16).contains(&a.margin), "precision.amax_margin", &a.margin, "must be in 0..=16");
        let fp8 = self.compute == Compute::Fp8;
        p.check(
            !self.fp8_weights || fp8,
            "precision.fp8_weights",
            &self.fp8_weights,
            "needs precision.compute = \"fp8\"",
        );
        let why = "needs precision.fp8_weights = true";
        p.check(
            !self.fp8_weights_one_layout || self.fp8_weights,
            "precision.fp8_weights_one_layout",
            &self.fp8_weights_one_layout,
            why,
        );
        p.check(
            self.adapter_compute != AdapterCompute::Bf16 || self.compute != Compute::Fp32,
            "precision.adapter_compute",
            &"bf16",
            "needs precision.compute = \"bf16\" or \"fp8\" (an fp32 model's adapters read f32 inputs)",
        );
        if let Some(nf4) = self.nf4 {
            let why = "model.quantize = \"nf4\" needs precision.compute = \"fp32\" or \"bf16\": FP8 GEMMs over an NF4 \
                       base are not supported (the weight would be dequantised and quantised again every GEMM)";
            p.check(!fp8, "precision.compute", &self.compute.name(), why);
            let ok = nf4.block.is_power_of_two() && (32..=4096).contains(&nf4.block);
            let why = "must be a power of two in 32..=4096 (bitsandbytes' sizes) for model.quantize = \"nf4\"";
            p.check(ok, "model.quant_block_size", &nf4.block, why);
        }
        p.0
    }

    /// [`Self::problems`] as one message (`key = value: allowed`, joined), for callers that
    /// have no key names of their own (the model's loader).
    pub fn validate(&self) -> Result<(), String> {
        let problems = self.problems();
        let text: Vec<String> = problems.iter().map(|p| format!("{} = {}: {}", p.key, p.value, p.allowed)).collect();
        if text.is_empty() { Ok(()) } else { Err(text.join("; ")) }
    }

    /// Whether this is plain f32 (no extension op needed around the linear layers).
    pub fn is_fp32(&self) -> bool {
        self.compute == Compute::Fp32 && !self.fp8_activations && self.nf4.is_none()
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
    /// a step's FLOPs) on f32 master weights that change every step. With
    /// `adapter_compute = "auto"`:
    /// - `bf16`: f32 GEMMs on the upcast bf16 input, as PEFT runs its f32 adapters on a bf16
    ///   model (its default `autocast_adapter_dtype`): bf16 GEMMs there move the gradients
    ///   further from fp32's than PEFT's f32 adapters do (tests/it/parity/llama.rs), so they are opt-in
    ///   (`adapter_compute = "bf16"`, PEFT's numerics with adapters loaded in bf16);
    /// - `fp8`: bf16 GEMMs, as NeMo/Transformer Engine and the MLPerf reference run them (FP8
    ///   with delayed scales would buy nothing at rank 16).
    pub fn for_adapters(&self) -> PrecisionSpec {
        let compute = match (self.adapter_compute, self.compute) {
            (AdapterCompute::Bf16, _) | (AdapterCompute::Auto, Compute::Fp8) => Compute::Bf16,
            (AdapterCompute::Fp32, _) | (AdapterCompute::Auto, _) => Compute::Fp32,
        };
        PrecisionSpec { compute, fp8_weights: false, nf4: None, ..*self }
    }

    /// Bytes per element of the activations between the GEMMs (4 for f32; 2 for bf16 and FP8).
    pub fn activation_bytes(&self) -> f64 {
        self.activation_dtype().size() as f64
    }

    /// Bytes per element of a tensor saved for a GEMM's weight gradient or SwiGLU's backward:
    /// 1 with `fp8_activations`, else as the activations.
    pub fn saved_activation_bytes(&self) -> f64 {
        if self.fp8_activations { 1.0 } else { self.activation_bytes() }
    }

    /// Bytes per element of an adapter's output and rank-wide bottleneck as computed: the
    /// adapter GEMMs' dtype ([`Self::for_adapters`]: f32, or bf16 under FP8).
    pub fn adapter_output_bytes(&self) -> f64 {
        if self.for_adapters().compute == Compute::Bf16 { 2.0 } else { 4.0 }
    }

    /// Bytes per element of an adapter's bottleneck as kept for B's gradient: FP8 with
    /// `fp8_activations`, else [`Self::adapter_output_bytes`].
    pub fn adapter_bottleneck_bytes(&self) -> f64 {
        if self.fp8_activations { 1.0 } else { self.adapter_output_bytes() }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The `[precision]` section as a user writes it (Transformer Engine's flat `amax_*`
    /// names) reads into the spec, prints back the same, and refuses a misspelt key.
    #[test]
    fn the_section_reads_and_writes_flat_amax_keys() {
        let text =
            "compute = \"fp8\"\nfp8_weights = true\namax_history_len = 16\namax_compute_algo = \"most_recent\"\n";
        let spec: PrecisionSpec = toml::from_str(text).unwrap();
        let amax = AmaxSpec { history_len: 16, algo: AmaxAlgo::MostRecent, margin: 0 };
        assert_eq!(spec, PrecisionSpec { compute: Compute::Fp8, fp8_weights: true, amax, ..Default::default() });
        assert_eq!(toml::from_str::<PrecisionSpec>(&toml::to_string(&spec).unwrap()).unwrap(), spec);
        let err = toml::from_str::<PrecisionSpec>("amax_marg = 2").unwrap_err().to_string();
        assert!(err.contains("unknown field `amax_marg`") && err.contains("amax_margin"), "{err}");
        assert_eq!(toml::from_str::<PrecisionSpec>("").unwrap(), PrecisionSpec::default());
    }

    /// Each rule of the one check names its key: hand-built bad specs, one problem each.
    #[test]
    fn problems_name_their_keys() {
        let keys = |s: PrecisionSpec| s.problems().into_iter().map(|p| p.key).collect::<Vec<_>>();
        assert_eq!(keys(PrecisionSpec::default()), Vec::<String>::new());
        let d = PrecisionSpec::default();
        let amax = |history_len, margin| AmaxSpec { history_len, margin, ..AmaxSpec::default() };
        assert_eq!(keys(PrecisionSpec { amax: amax(0, 0), ..d }), ["precision.amax_history_len"]);
        assert_eq!(keys(PrecisionSpec { amax: amax(1024, 17), ..d }), ["precision.amax_margin"]);
        assert_eq!(keys(PrecisionSpec { fp8_weights: true, compute: Compute::Bf16, ..d }), ["precision.fp8_weights"]);
        assert_eq!(keys(PrecisionSpec { fp8_weights_one_layout: true, ..d }), ["precision.fp8_weights_one_layout"]);
        let bf16_adapters = PrecisionSpec { adapter_compute: AdapterCompute::Bf16, ..d };
        assert_eq!(keys(bf16_adapters), ["precision.adapter_compute"]);
        assert_eq!(keys(PrecisionSpec { compute: Compute::Bf16, ..bf16_adapters }), Vec::<String>::new());
        let nf4 = |block| Some(Nf4Spec { block, double: true });
        assert_eq!(keys(PrecisionSpec { nf4: nf4(64), compute: Compute::Fp8, ..d }), ["precision.compute"]);
        assert_eq!(keys(PrecisionSpec { nf4: nf4(96), compute: Compute::Bf16, ..d }), ["model.quant_block_size"]);
        assert_eq!(keys(PrecisionSpec { nf4: nf4(8192), ..d }), ["model.quant_block_size"]);
        assert!(PrecisionSpec { nf4: nf4(4096), ..d }.validate().is_ok());
    }
}
