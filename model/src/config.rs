//! `LlamaConfig`: the architecture, as HF `config.json` states it, plus llora's presets.

use std::path::Path;

use anyhow::{Context, bail};
use serde::{Deserialize, Serialize};

use crate::family::{Family, ModelType};
use crate::rope::Llama3Scaling;

/// Architecture hyperparameters of a Llama-family causal LM.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LlamaConfig {
    /// Vocabulary size V (rows of the embedding and of the LM head).
    pub vocab_size: usize,
    /// Residual width d.
    pub hidden_size: usize,
    /// SwiGLU inner width I.
    pub intermediate_size: usize,
    /// Decoder layers L.
    pub num_hidden_layers: usize,
    /// Query heads H.
    pub num_attention_heads: usize,
    /// Key/value heads KV (H / KV query heads share one; KV = H is plain multi-head attention).
    pub num_key_value_heads: usize,
    /// Per-head width hd (d / H unless the checkpoint says otherwise).
    pub head_dim: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base θ.
    pub rope_theta: f64,
    /// Llama 3.1+'s RoPE frequency scaling (`rope_type = "llama3"`); None: plain RoPE.
    pub rope_scaling: Option<Llama3Scaling>,
    /// Longest position the RoPE tables cover.
    pub max_position_embeddings: usize,
    /// Whether the LM head shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// Whether the checkpoint stores q/k/v as one `qkv_proj` (rows q, then k, then v).
    pub fused_qkv: bool,
    /// Beginning-of-sequence token id (1 in Llama 2, 128000 in Llama 3).
    pub bos_token_id: Option<u32>,
    /// Token ids that end generation (Llama 3.1+ lists several: end of text, of turn, of a
    /// tool call).
    pub eos_token_ids: Vec<u32>,
    /// What the model's family adds to the Llama decoder (Qwen's biases and q/k norms,
    /// Mistral's sliding window).
    #[serde(default)]
    pub family: Family,
}

/// The subset of an HF `config.json` llora reads, in both the 4.x and 5.x spellings.
#[derive(Debug, Deserialize)]
struct HfConfig {
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    #[serde(default = "default_eps")]
    rms_norm_eps: f64,
    /// transformers 4.x: top level, absent meaning 10000.
    rope_theta: Option<f64>,
    /// transformers 4.x: `{"type"/"rope_type": ..., "factor": ...}` or null.
    rope_scaling: Option<serde_json::Value>,
    /// transformers 5.x: `{"rope_type": "default", "rope_theta": ...}`.
    rope_parameters: Option<serde_json::Value>,
    #[serde(default = "default_max_pos")]
    max_position_embeddings: usize,
    #[serde(default)]
    tie_word_embeddings: bool,
    hidden_act: Option<String>,
    /// llora's marker for fused-QKV checkpoints (the MLPerf reference's conversion).
    #[serde(default)]
    fused_qkv: bool,
    bos_token_id: Option<u32>,
    /// A number or a list of numbers.
    eos_token_id: Option<serde_json::Value>,
}

fn default_eps() -> f64 {
    1e-6
}
fn default_max_pos() -> usize {
    4096
}

/// RoPE variants that keep the plain `theta^(-2j/hd)` frequencies.
const PLAIN_ROPE: &[&str] = &["default", "linear_none"];
/// The RoPE variants llora computes (others change frequencies or attention in ways it does not).
const KNOWN_ROPE: &str = "\"default\" and \"llama3\"";

fn rope_type(v: &serde_json::Value) -> Option<String> {
    v.get("rope_type").or_else(|| v.get("type")).and_then(|t| t.as_str()).map(str::to_string)
}

/// The RoPE a `rope_scaling` / `rope_parameters` value (`key`) describes: llama3 scaling or
/// none, and the `rope_theta` it carries; other kinds and partial rotation are refused.
fn rope_of(key: &str, v: &serde_json::Value, max_pos: usize) -> anyhow::Result<(Option<Llama3Scaling>, Option<f64>)> {
    let kind = rope_type(v).unwrap_or_else(|| "default".into());
    let scaling = if kind == "llama3" {
        Some(Llama3Scaling::from_hf(v, max_pos).with_context(|| format!("{key} (llama3)"))?)
    } else if PLAIN_ROPE.contains(&kind.as_str()) {
        None
    } else {
        bail!("{key}.rope_type = {kind:?} is not supported (llora implements {KNOWN_ROPE} RoPE)");
    };
    if let Some(f) = v.get("partial_rotary_factor").and_then(|f| f.as_f64()).filter(|&f| f != 1.0) {
        bail!("{key}.partial_rotary_factor = {f} is not supported (RoPE over the whole head only)");
    }
    Ok((scaling, v.get("rope_theta").and_then(|t| t.as_f64())))
}

impl LlamaConfig {
    /// Parses an HF `config.json` (transformers 4.x or 5.x).
    ///
    /// RoPE `default` and `llama3` (Llama 3.1+) are computed as transformers does; other
    /// scalings (linear, dynamic, yarn, longrope, ...) are rejected rather than mis-run.
    pub fn from_hf_json(text: &str) -> anyhow::Result<Self> {
        let value: serde_json::Value = serde_json::from_str(text).context("config.json is not JSON")?;
        let hf: HfConfig = crate::family::read_keys(&value).context("not a Llama-architecture config.json")?;
        let family = Family::from_hf_value(&value)?;
        if let Some(act) = &hf.hidden_act
            && act != "silu"
        {
            bail!("hidden_act {act:?} is not supported: every family llora runs uses \"silu\"");
        }
        // transformers (5.23) reads `rope_scaling` when a config has both and ignores
        // `rope_parameters`: so does llora, saying so when the two differ.
        let set = |v: &Option<serde_json::Value>| v.clone().filter(|v| !v.is_null());
        let (legacy, current) = (set(&hf.rope_scaling), set(&hf.rope_parameters));
        if let (Some(l), Some(c)) = (&legacy, &current)
            && l != c
        {
            tracing::warn!(rope_scaling = %l, rope_parameters = %c,
                "config.json has both rope_scaling and rope_parameters, and they differ: using rope_scaling, as transformers does");
        }
        let (rope_scaling, theta) = match (legacy, current) {
            (Some(l), _) => rope_of("rope_scaling", &l, hf.max_position_embeddings)?,
            (None, Some(c)) => rope_of("rope_parameters", &c, hf.max_position_embeddings)?,
            (None, None) => (None, None),
        };
        let theta = theta.or(hf.rope_theta);
        let eos_token_ids = match &hf.eos_token_id {
            None | Some(serde_json::Value::Null) => Vec::new(),
            Some(v) => serde_json::from_value::<u32>(v.clone())
                .map(|id| vec![id])
                .or_else(|_| serde_json::from_value::<Vec<u32>>(v.clone()))
                .map_err(|_| anyhow::anyhow!("eos_token_id = {v} is not a token id or a list of them"))?,
        };
        let heads = hf.num_attention_heads;
        let kv = hf.num_key_value_heads.unwrap_or(heads);
        let head_dim = hf.head_dim.unwrap_or(hf.hidden_size / heads.max(1));
        let config = Self {
            vocab_size: hf.vocab_size,
            hidden_size: hf.hidden_size,
            intermediate_size: hf.intermediate_size,
            num_hidden_layers: hf.num_hidden_layers,
            num_attention_heads: heads,
            num_key_value_heads: kv,
            head_dim,
            rms_norm_eps: hf.rms_norm_eps,
            rope_theta: theta.unwrap_or(10000.0),
            rope_scaling,
            max_position_embeddings: hf.max_position_embeddings,
            tie_word_embeddings: hf.tie_word_embeddings,
            fused_qkv: hf.fused_qkv,
            bos_token_id: hf.bos_token_id,
            eos_token_ids,
            family,
        };
        config.check()?;
        Ok(config)
    }

    /// Reads `DIR/config.json`.
    pub fn from_hf_dir(dir: &Path) -> anyhow::Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
        Self::from_hf_json(&text).with_context(|| format!("in {}", path.display()))
    }

    /// The HF `config.json` text (transformers 4.x keys, which 5.x also reads).
    pub fn to_hf_json(&self) -> String {
        let mut v = serde_json::json!({
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "torch_dtype": "float32",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": match self.eos_token_ids.as_slice() {
                [] => serde_json::Value::Null,
                [one] => serde_json::json!(one),
                many => serde_json::json!(many),
            },
        });
        if let (Some(all), serde_json::Value::Object(family)) =
            (v.as_object_mut(), self.family.hf_keys(self.num_hidden_layers))
        {
            all.extend(family);
        }
        if let Some(s) = &self.rope_scaling {
            v["rope_scaling"] = serde_json::json!({
                "rope_type": "llama3",
                "factor": s.factor,
                "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings,
            });
        }
        serde_json::to_string_pretty(&v).expect("json")
    }

    /// Shape consistency checks, with the offending field named.
    pub fn check(&self) -> anyhow::Result<()> {
        let c = self;
        for (name, v) in [
            ("vocab_size", c.vocab_size),
            ("hidden_size", c.hidden_size),
            ("intermediate_size", c.intermediate_size),
            ("num_hidden_layers", c.num_hidden_layers),
            ("num_attention_heads", c.num_attention_heads),
            ("num_key_value_heads", c.num_key_value_heads),
            ("head_dim", c.head_dim),
        ] {
            if v == 0 {
                bail!("{name} must be > 0");
            }
        }
        if !c.num_attention_heads.is_multiple_of(c.num_key_value_heads) {
            bail!(
                "num_attention_heads ({}) must be a multiple of num_key_value_heads ({})",
                c.num_attention_heads,
                c.num_key_value_heads
            );
        }
        if c.fused_qkv && c.family.model_type != crate::family::ModelType::Llama {
            bail!(
                "fused_qkv is llora's marker for Llama checkpoints with one qkv_proj: not for {:?}",
                c.family.model_type.name()
            );
        }
        if !c.head_dim.is_multiple_of(2) {
            bail!("head_dim ({}) must be even for RoPE", c.head_dim);
        }
        // A stop id the model can never produce would let generation run to the length limit.
        let outside = |id: u32| id as usize >= c.vocab_size;
        if let Some(id) = c.eos_token_ids.iter().copied().find(|&id| outside(id)) {
            bail!("eos_token_id {id} is outside the vocabulary (vocab_size {})", c.vocab_size);
        }
        if let Some(id) = c.bos_token_id.filter(|&id| outside(id)) {
            bail!("bos_token_id {id} is outside the vocabulary (vocab_size {})", c.vocab_size);
        }
        // A negative ε makes mean(x²) + ε reach 0 or below: the norm's 1/√ is NaN or inf.
        if !(c.rms_norm_eps.is_finite() && c.rms_norm_eps >= 0.0) {
            bail!("rms_norm_eps ({}) must be a finite number >= 0", c.rms_norm_eps);
        }
        if !(c.rope_theta.is_finite() && c.rope_theta > 0.0) {
            bail!("rope_theta ({}) must be a finite number > 0", c.rope_theta);
        }
        Ok(())
    }

    /// Query heads per key/value head.
    pub fn group_size(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads
    }

    /// Parameters of the base model (embeddings, layers, norm, head).
    pub fn num_parameters(&self) -> usize {
        let (d, i, v) = (self.hidden_size, self.intermediate_size, self.vocab_size);
        let q = self.num_attention_heads * self.head_dim;
        let kv = self.num_key_value_heads * self.head_dim;
        let f = &self.family;
        let biases = if f.qkv_bias { q + 2 * kv } else { 0 } + if f.o_bias { d } else { 0 };
        let qk_norms = if f.qk_norm { 2 * self.head_dim } else { 0 };
        let layer = d * (q + 2 * kv) + q * d + 3 * d * i + 2 * d + biases + qk_norms;
        let head = if self.tie_word_embeddings { 0 } else { v * d };
        v * d + self.num_hidden_layers * layer + d + head
    }

    fn build(v: usize, d: usize, i: usize, l: usize, h: usize, kv: usize, max_pos: usize) -> Self {
        Self {
            vocab_size: v,
            hidden_size: d,
            intermediate_size: i,
            num_hidden_layers: l,
            num_attention_heads: h,
            num_key_value_heads: kv,
            head_dim: d / h,
            rms_norm_eps: 1e-5,
            rope_theta: 10000.0,
            rope_scaling: None,
            max_position_embeddings: max_pos,
            tie_word_embeddings: false,
            fused_qkv: false,
            // Llama 2's ids (its tokenizer: <s> 1, </s> 2).
            bos_token_id: Some(1),
            eos_token_ids: vec![2],
            family: Family::default(),
        }
    }

    /// Llama 2 70B with MLPerf's 8192 positions: 80 layers, d 8192, 64 heads, 8 KV heads.
    pub fn llama2_70b() -> Self {
        Self::build(32000, 8192, 28672, 80, 64, 8, 8192)
    }

    /// Llama 2 7B: 32 layers, d 4096, 32 heads (no GQA).
    pub fn llama2_7b() -> Self {
        Self::build(32000, 4096, 11008, 32, 32, 32, 4096)
    }

    /// The peer benchmark's `tiny`: vocab 32000, d 256, 4 layers, 8 heads, I 688.
    pub fn tiny() -> Self {
        Self::build(32000, 256, 688, 4, 8, 8, 4096)
    }

    /// `tiny` with grouped-query attention (2 layers, 8 heads, 2 KV heads).
    pub fn tiny_gqa() -> Self {
        Self::build(32000, 256, 688, 2, 8, 2, 4096)
    }

    /// The peer benchmark's `small`: d 1024, 8 layers, 16 heads, 4 KV heads, I 2816.
    pub fn small() -> Self {
        Self::build(32000, 1024, 2816, 8, 16, 4, 4096)
    }

    /// One Llama 2 70B decoder layer (real shapes) with its embedding and head.
    pub fn llama2_70b_1layer() -> Self {
        Self { num_hidden_layers: 1, ..Self::llama2_70b() }
    }

    /// The CPU demo's model: vocab 512 (the synthetic corpus), d 128, 4 layers, 4 heads, 2 KV heads.
    pub fn demo() -> Self {
        Self::build(512, 128, 344, 4, 4, 2, 1024)
    }

    /// The chat demo's Llama-3-style model: `demo`'s shape over the synthetic words plus Llama
    /// 3's 16 named special tokens (vocab 528, `llora_data::synth_chat`), tied embeddings,
    /// Llama 3.1's RoPE (theta 500000, llama3 scaling by 8 past 64 positions: the demo's
    /// 256-token rows reach 4x into the extended range, as 131072 is 16x Llama 3.1's 8192) and
    /// its eos list (`<|end_of_text|>`, `<|eom_id|>`, `<|eot_id|>`).
    pub fn demo_llama3() -> Self {
        Self {
            rope_theta: 500000.0,
            rope_scaling: Some(Llama3Scaling {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 64,
            }),
            tie_word_embeddings: true,
            bos_token_id: Some(512),
            eos_token_ids: vec![513, 520, 521],
            ..Self::build(528, 128, 344, 4, 4, 2, 1024)
        }
    }

    /// `demo-llama3` made for long sequences: Llama 3.1's own RoPE (theta 500000, scaling by 8
    /// past 8192 positions) and its 131072 positions, on the demo's shape: sequences of 32k
    /// tokens and more on a CPU, as context parallelism splits them (`train.context_parallel`).
    pub fn demo_llama3_long() -> Self {
        let scaling = Llama3Scaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        };
        Self { rope_scaling: Some(scaling), max_position_embeddings: 131072, ..Self::demo_llama3() }
    }

    /// `small`'s shape (d 1024, 8 layers, 16 heads over 4 K/V heads) in Llama 3.1's style: its
    /// RoPE (theta 500000, scaling by 8 over 8192 positions) and 131072 positions, for long
    /// sequences on a CPU. The vocabulary stays 32000: Llama 3's 128256 would make the head 4x
    /// and tell nothing more about splitting a sequence.
    pub fn small_llama3_long() -> Self {
        let long = Self::demo_llama3_long();
        Self {
            rope_theta: long.rope_theta,
            rope_scaling: long.rope_scaling,
            max_position_embeddings: long.max_position_embeddings,
            ..Self::small()
        }
    }

    /// A family's model of `build`'s shape with `head_dim` and the family's traits.
    #[allow(clippy::too_many_arguments)]
    fn family_model(family: Family, shape: [usize; 7], head_dim: usize, theta: f64, eps: f64, tie: bool) -> Self {
        let [v, d, i, l, h, kv, max_pos] = shape;
        Self {
            head_dim,
            rope_theta: theta,
            rms_norm_eps: eps,
            tie_word_embeddings: tie,
            family,
            ..Self::build(v, d, i, l, h, kv, max_pos)
        }
    }

    /// Qwen 2.5 7B Instruct (its published config.json): 28 layers, d 3584, 28 heads over 4 KV
    /// heads, q/k/v biases, rope_theta 1e6, no sliding window in use.
    pub fn qwen2_5_7b() -> Self {
        let family = Family { model_type: ModelType::Qwen2, qkv_bias: true, ..Family::default() };
        let c = Self::family_model(family, [152064, 3584, 18944, 28, 28, 4, 32768], 128, 1e6, 1e-6, false);
        Self { bos_token_id: Some(151643), eos_token_ids: vec![151645], ..c }
    }

    /// Qwen 3 8B (its published config.json): 36 layers, d 4096, 32 heads over 8 KV heads of
    /// 128, q/k head norms, no biases, rope_theta 1e6.
    pub fn qwen3_8b() -> Self {
        let family = Family { model_type: ModelType::Qwen3, qk_norm: true, ..Family::default() };
        let c = Self::family_model(family, [151936, 4096, 12288, 36, 32, 8, 40960], 128, 1e6, 1e-6, false);
        Self { bos_token_id: Some(151643), eos_token_ids: vec![151645], ..c }
    }

    /// Mistral 7B v0.3 (its published config.json): 32 layers, d 4096, 32 heads over 8 KV
    /// heads, rope_theta 1e6, vocabulary 32768, no sliding window (v0.1's was 4096).
    pub fn mistral_7b() -> Self {
        let family = Family { model_type: ModelType::Mistral, ..Family::default() };
        Self::family_model(family, [32768, 4096, 14336, 32, 32, 8, 32768], 128, 1e6, 1e-5, false)
    }

    /// The small model of a family for CPU demos and tests (`scripts/peer/recipe.py`'s `FAMILIES`:
    /// vocab 1000, d 128, 2 layers, 4 heads over 2, a window shorter than a 64-token row).
    pub fn tiny_family(model_type: ModelType) -> Self {
        let shape = [1000, 128, 344, 2, 4, 2, 4096];
        let windowed = |w| Family { sliding_window: Some(w), window_from: 1, model_type, ..Family::default() };
        let (family, head_dim, theta, tie) = match model_type {
            ModelType::Qwen2 => (Family { qkv_bias: true, ..windowed(24) }, 32, 1e6, true),
            ModelType::Qwen3 => (Family { qk_norm: true, ..windowed(20) }, 40, 1e6, true),
            ModelType::Mistral | ModelType::Llama => (Family { window_from: 0, ..windowed(16) }, 24, 1e4, false),
        };
        let c = Self::family_model(family, shape, head_dim, theta, 1e-6, tie);
        match model_type {
            // transformers' defaults: Qwen's configs name no ids, Mistral's <s> 1 and </s> 2.
            ModelType::Qwen2 | ModelType::Qwen3 => Self { bos_token_id: None, eos_token_ids: Vec::new(), ..c },
            ModelType::Mistral | ModelType::Llama => c,
        }
    }

    /// Looks a preset up by the name configs use.
    pub fn preset(name: &str) -> anyhow::Result<Self> {
        Ok(match name {
            "demo" => Self::demo(),
            "demo-llama3" => Self::demo_llama3(),
            "demo-llama3-long" => Self::demo_llama3_long(),
            "tiny" => Self::tiny(),
            "tiny-gqa" => Self::tiny_gqa(),
            "small" => Self::small(),
            "small-llama3-long" => Self::small_llama3_long(),
            "llama2-7b" => Self::llama2_7b(),
            "llama2-70b" => Self::llama2_70b(),
            "llama2-70b-1layer" => Self::llama2_70b_1layer(),
            "qwen2.5-7b" => Self::qwen2_5_7b(),
            "qwen3-8b" => Self::qwen3_8b(),
            "mistral-7b" => Self::mistral_7b(),
            "tiny-qwen2" => Self::tiny_family(ModelType::Qwen2),
            "tiny-qwen3" => Self::tiny_family(ModelType::Qwen3),
            "tiny-mistral" => Self::tiny_family(ModelType::Mistral),
            _ => bail!("unknown model preset {name:?}: expected one of {}", PRESETS.join(", ")),
        })
    }
}

/// Names [`LlamaConfig::preset`] accepts.
pub const PRESETS: &[&str] = &[
    "demo",
    "demo-llama3",
    "demo-llama3-long",
    "tiny",
    "tiny-gqa",
    "small",
    "small-llama3-long",
    "llama2-7b",
    "llama2-70b",
    "llama2-70b-1layer",
    "qwen2.5-7b",
    "qwen3-8b",
    "mistral-7b",
    "tiny-qwen2",
    "tiny-qwen3",
    "tiny-mistral",
];

#[cfg(test)]
mod tests {
    use super::*;

    /// The family presets are their models' published config.json files, as llora reads them.
    #[test]
    fn family_presets_are_the_published_configs() {
        let qwen25 = r#"{"architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
            "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02,
            "intermediate_size": 18944, "max_position_embeddings": 32768, "max_window_layers": 28,
            "model_type": "qwen2", "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
            "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": false,
            "torch_dtype": "bfloat16", "use_cache": true, "use_sliding_window": false, "vocab_size": 152064}"#;
        let qwen3 = r#"{"architectures": ["Qwen3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
            "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
            "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 12288,
            "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
            "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
            "rope_scaling": null, "rope_theta": 1000000, "sliding_window": null, "tie_word_embeddings": false,
            "torch_dtype": "bfloat16", "use_cache": true, "use_sliding_window": false, "vocab_size": 151936}"#;
        let mistral = r#"{"architectures": ["MistralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
            "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
            "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mistral",
            "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
            "rope_theta": 1000000.0, "sliding_window": null, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
            "use_cache": true, "vocab_size": 32768}"#;
        for (name, text) in [("qwen2.5-7b", qwen25), ("qwen3-8b", qwen3), ("mistral-7b", mistral)] {
            assert_eq!(LlamaConfig::preset(name).unwrap(), LlamaConfig::from_hf_json(text).unwrap(), "{name}");
        }
        // 7.6 B and 8.2 B parameters, as their model cards say; Mistral 7B's 7.25 B.
        let billions = |name: &str| LlamaConfig::preset(name).unwrap().num_parameters() as f64 / 1e9;
        assert!((billions("qwen2.5-7b") - 7.62).abs() < 0.01, "{}", billions("qwen2.5-7b"));
        assert!((billions("qwen3-8b") - 8.19).abs() < 0.01, "{}", billions("qwen3-8b"));
        assert!((billions("mistral-7b") - 7.25).abs() < 0.01, "{}", billions("mistral-7b"));
    }

    #[test]
    fn reads_transformers_4_and_5_spellings() {
        let v4 = r#"{"model_type":"llama","vocab_size":32000,"hidden_size":8192,"intermediate_size":28672,
            "num_hidden_layers":80,"num_attention_heads":64,"num_key_value_heads":8,"rms_norm_eps":1e-5,
            "max_position_embeddings":8192,"rope_scaling":null,"bos_token_id":1,"eos_token_id":2}"#;
        let c = LlamaConfig::from_hf_json(v4).unwrap();
        assert_eq!(c, LlamaConfig::llama2_70b());
        let v5 = r#"{"vocab_size":10,"hidden_size":8,"intermediate_size":16,"num_hidden_layers":1,
            "num_attention_heads":2,"rope_parameters":{"rope_type":"default","rope_theta":500000.0}}"#;
        let c = LlamaConfig::from_hf_json(v5).unwrap();
        assert_eq!((c.rope_theta, c.num_key_value_heads, c.head_dim), (500000.0, 2, 4));
    }

    /// With both keys, transformers 5.23's `LlamaConfig.from_pretrained`
    /// (checked by hand: llama3 `rope_scaling` + top-level `rope_theta` 500000 beside
    /// `rope_parameters` `{"rope_type": "default", "rope_theta": 10000}` gives llama3 and
    /// 500000) takes `rope_scaling`; so does llora, in both orders of disagreement.
    #[test]
    fn rope_scaling_wins_over_rope_parameters_as_in_transformers() {
        let both = r#"{"vocab_size":100,"hidden_size":64,"intermediate_size":128,"num_hidden_layers":1,
            "num_attention_heads":2,"max_position_embeddings":16384,"rope_theta":500000.0,
            "rope_scaling":{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,
                "original_max_position_embeddings":8192},
            "rope_parameters":{"rope_type":"default","rope_theta":10000.0}}"#;
        let c = LlamaConfig::from_hf_json(both).unwrap();
        assert_eq!((c.rope_scaling.map(|s| s.factor), c.rope_theta), (Some(8.0), 500000.0));
        let plain_legacy = r#"{"vocab_size":100,"hidden_size":64,"intermediate_size":128,"num_hidden_layers":1,
            "num_attention_heads":2,"rope_scaling":{"rope_type":"default"},
            "rope_parameters":{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0}}"#;
        assert_eq!(LlamaConfig::from_hf_json(plain_legacy).unwrap().rope_scaling, None);
        // A factor given as a string is said to be one, not "missing".
        let text = r#"{"vocab_size":100,"hidden_size":64,"intermediate_size":128,"num_hidden_layers":1,
            "num_attention_heads":2,"rope_scaling":{"rope_type":"llama3","factor":"8","low_freq_factor":1.0,"high_freq_factor":4.0}}"#;
        let e = format!("{:#}", LlamaConfig::from_hf_json(text).unwrap_err());
        assert!(e.contains("factor = \"8\" is not a number"), "{e}");
    }

    /// A stop or start id outside the vocabulary is refused, naming it.
    #[test]
    fn special_ids_must_be_in_the_vocabulary() {
        let with = |ids: &str| {
            LlamaConfig::from_hf_json(&format!(
                r#"{{"vocab_size":100,"hidden_size":64,"intermediate_size":128,"num_hidden_layers":1,
                "num_attention_heads":2,{ids}}}"#
            ))
        };
        with(r#""bos_token_id":1,"eos_token_id":[2,99]"#).unwrap();
        for (ids, want) in
            [(r#""eos_token_id":[2,100]"#, "eos_token_id 100"), (r#""bos_token_id":128000"#, "bos_token_id 128000")]
        {
            let e = with(ids).unwrap_err().to_string();
            assert!(e.contains(want) && e.contains("vocab_size 100"), "{e}");
        }
    }

    #[test]
    fn rejects_rope_scalings_it_does_not_implement() {
        for kind in ["linear", "dynamic", "yarn", "longrope"] {
            let j = format!(
                r#"{{"vocab_size":10,"hidden_size":8,"intermediate_size":16,"num_hidden_layers":1,
                "num_attention_heads":2,"rope_scaling":{{"rope_type":"{kind}","factor":8.0}}}}"#
            );
            let e = LlamaConfig::from_hf_json(&j).unwrap_err().to_string();
            assert!(e.contains("rope_scaling") && e.contains(kind) && e.contains("llama3"), "{e}");
        }
        let partial = r#"{"vocab_size":10,"hidden_size":8,"intermediate_size":16,"num_hidden_layers":1,
            "num_attention_heads":2,"rope_parameters":{"rope_type":"default","partial_rotary_factor":0.5}}"#;
        assert!(LlamaConfig::from_hf_json(partial).unwrap_err().to_string().contains("partial_rotary_factor"));
    }

    /// A value of the wrong type is refused naming its key, in the architecture's keys and the
    /// family's.
    #[test]
    fn mistyped_values_name_their_key() {
        let base = r#""vocab_size":10,"hidden_size":8,"intermediate_size":16,"num_attention_heads":2"#;
        for (extra, key) in [
            (r#""num_hidden_layers":"1""#, "`num_hidden_layers`"),
            (r#""num_hidden_layers":1,"rms_norm_eps":"1e-6""#, "`rms_norm_eps`"),
            (r#""num_hidden_layers":1,"model_type":"mistral","sliding_window":"8""#, "`sliding_window`"),
            (r#""num_hidden_layers":1,"model_type":"qwen2","use_sliding_window":"yes""#, "`use_sliding_window`"),
        ] {
            let e = format!("{:#}", LlamaConfig::from_hf_json(&format!("{{{base},{extra}}}")).unwrap_err());
            assert!(e.contains(key) && e.contains("invalid type"), "{extra}: {e}");
        }
    }

    /// Llama 3.2 1B's config.json (transformers 4.x spelling), and back through to_hf_json.
    #[test]
    fn reads_llama_3_2_configs() {
        let j = r#"{"architectures":["LlamaForCausalLM"],"bos_token_id":128000,"eos_token_id":[128001,128008,128009],
            "head_dim":64,"hidden_act":"silu","hidden_size":2048,"intermediate_size":8192,"max_position_embeddings":131072,
            "model_type":"llama","num_attention_heads":32,"num_hidden_layers":16,"num_key_value_heads":8,
            "rms_norm_eps":1e-05,"rope_scaling":{"factor":32.0,"high_freq_factor":4.0,"low_freq_factor":1.0,
            "original_max_position_embeddings":8192,"rope_type":"llama3"},"rope_theta":500000.0,
            "tie_word_embeddings":true,"vocab_size":128256}"#;
        let c = LlamaConfig::from_hf_json(j).unwrap();
        assert_eq!((c.head_dim, c.rope_theta, c.tie_word_embeddings), (64, 500000.0, true));
        assert_eq!(c.eos_token_ids, [128001, 128008, 128009]);
        let s = c.rope_scaling.unwrap();
        assert_eq!((s.factor, s.original_max_position_embeddings), (32.0, 8192));
        // Meta's model card: 1.24B parameters (1,235,814,400 with the tied head).
        assert_eq!(c.num_parameters(), 1_235_814_400);
        assert_eq!(LlamaConfig::from_hf_json(&c.to_hf_json()).unwrap(), c);
    }

    #[test]
    fn rejects_bad_gqa() {
        let j = r#"{"vocab_size":10,"hidden_size":12,"intermediate_size":16,"num_hidden_layers":1,
            "num_attention_heads":3,"num_key_value_heads":2}"#;
        assert!(LlamaConfig::from_hf_json(j).unwrap_err().to_string().contains("multiple"));
    }

    #[test]
    fn llama2_70b_parameter_count() {
        // Meta's Llama 2 70B has 68,976,648,192 parameters (HF model card / num_parameters()).
        assert_eq!(LlamaConfig::llama2_70b().num_parameters(), 68_976_648_192);
    }

    #[test]
    fn json_round_trip() {
        let c = LlamaConfig::tiny_gqa();
        assert_eq!(LlamaConfig::from_hf_json(&c.to_hf_json()).unwrap(), c);
    }
}
