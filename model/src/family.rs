//! The model families llora runs besides Llama, as what each adds to the Llama decoder:
//! Qwen 2 / 2.5 (biases on q, k and v), Qwen 3 (per-head RMSNorm of q and k, biases as
//! `attention_bias` says) and Mistral (sliding-window attention), each read from its HF
//! `config.json` as transformers reads it.

use anyhow::bail;
use serde::{Deserialize, Serialize};

/// HF's `model_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ModelType {
    /// `LlamaForCausalLM`.
    #[default]
    Llama,
    /// `Qwen2ForCausalLM` (Qwen 2 and 2.5).
    Qwen2,
    /// `Qwen3ForCausalLM` (dense).
    Qwen3,
    /// `MistralForCausalLM`.
    Mistral,
}

impl ModelType {
    /// The `model_type` string.
    pub fn name(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Qwen2 => "qwen2",
            Self::Qwen3 => "qwen3",
            Self::Mistral => "mistral",
        }
    }

    /// The `architectures` entry transformers builds for it.
    pub fn architecture(self) -> &'static str {
        match self {
            Self::Llama => "LlamaForCausalLM",
            Self::Qwen2 => "Qwen2ForCausalLM",
            Self::Qwen3 => "Qwen3ForCausalLM",
            Self::Mistral => "MistralForCausalLM",
        }
    }
}

/// What a family adds to the Llama decoder (nothing, for Llama).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Family {
    /// The family.
    pub model_type: ModelType,
    /// Biases on q, k and v (frozen; PEFT's `bias = "none"`).
    pub qkv_bias: bool,
    /// A bias on o (Qwen 3 with `attention_bias`; Qwen 2's o has none).
    pub o_bias: bool,
    /// RMSNorm of each q and k head over `head_dim`, before RoPE (Qwen 3's `q_norm`, `k_norm`).
    pub qk_norm: bool,
    /// Sliding-window attention: a token attends to itself and the `W - 1` positions before it,
    /// in the layers from [`Self::window_from`] on; `None`: every layer attends to all before.
    pub sliding_window: Option<usize>,
    /// The first layer with the window (Qwen's `max_window_layers`; 0 for Mistral).
    pub window_from: usize,
}

/// The keys of `config.json` that tell a family apart, as transformers 4.x and 5.x write them.
#[derive(Debug, Deserialize)]
struct HfFamily {
    model_type: Option<String>,
    num_hidden_layers: usize,
    #[serde(default)]
    attention_bias: bool,
    #[serde(default)]
    mlp_bias: bool,
    #[serde(default)]
    use_sliding_window: bool,
    sliding_window: Option<usize>,
    max_window_layers: Option<usize>,
    layer_types: Option<Vec<String>>,
}

impl Family {
    /// The family of an HF `config.json`; whatever it sets that llora does not implement is
    /// refused, naming the key.
    pub fn from_hf_json(text: &str) -> anyhow::Result<Self> {
        Self::from_hf_value(&serde_json::from_str(text)?)
    }

    /// [`Self::from_hf_json`] of a config.json already parsed.
    pub fn from_hf_value(config: &serde_json::Value) -> anyhow::Result<Self> {
        let hf: HfFamily = read_keys(config)?;
        // transformers' configs default the window to 4096 when the key is absent (null: none).
        let hf = HfFamily {
            sliding_window: hf.sliding_window.or(config.get("sliding_window").is_none().then_some(4096)),
            ..hf
        };
        if hf.mlp_bias {
            bail!("mlp_bias = true is not supported: no family llora runs has MLP biases");
        }
        let model_type = match hf.model_type.as_deref().unwrap_or("llama") {
            "llama" => ModelType::Llama,
            "qwen2" => ModelType::Qwen2,
            "qwen3" => ModelType::Qwen3,
            "mistral" => ModelType::Mistral,
            other => bail!(
                "model_type {other:?} is not supported: llora runs \"llama\", \"qwen2\", \"qwen3\" and \"mistral\" models"
            ),
        };
        let bias = hf.attention_bias;
        let (qkv_bias, o_bias, qk_norm) = match model_type {
            ModelType::Llama | ModelType::Mistral if bias => {
                bail!("attention_bias = true is not supported for model_type {:?}", model_type.name())
            }
            ModelType::Llama | ModelType::Mistral => (false, false, false),
            // Qwen 2 always has q/k/v biases (its config has no switch) and none on o.
            ModelType::Qwen2 => (true, false, false),
            ModelType::Qwen3 => (bias, bias, true),
        };
        let (sliding_window, window_from) = windows(&hf, model_type)?;
        Ok(Self { model_type, qkv_bias, o_bias, qk_norm, sliding_window, window_from })
    }

    /// The window of decoder layer `layer`, if it has one.
    pub fn window_of(&self, layer: usize) -> Option<usize> {
        self.sliding_window.filter(|_| layer >= self.window_from)
    }

    /// The keys [`Self::from_hf_json`] reads, as transformers 4.x writes them (5.x reads them).
    pub fn hf_keys(&self, layers: usize) -> serde_json::Value {
        let mut v = serde_json::json!({
            "architectures": [self.model_type.architecture()],
            "model_type": self.model_type.name(),
            "attention_bias": self.model_type == ModelType::Qwen3 && self.qkv_bias,
            "mlp_bias": false,
        });
        match self.model_type {
            ModelType::Llama => {}
            ModelType::Mistral => v["sliding_window"] = serde_json::json!(self.sliding_window),
            ModelType::Qwen2 | ModelType::Qwen3 => {
                v["use_sliding_window"] = serde_json::json!(self.sliding_window.is_some());
                v["sliding_window"] = serde_json::json!(self.sliding_window);
                v["max_window_layers"] = serde_json::json!(self.window_from.min(layers));
            }
        }
        v
    }
}

/// The keys of a parsed config.json as `T`, an error naming the key whose value does not fit
/// (`"sliding_window": "8"` is "key `sliding_window`: invalid type: string \"8\", expected usize").
pub(crate) fn read_keys<T: serde::de::DeserializeOwned>(value: &serde_json::Value) -> anyhow::Result<T> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let key = e.path().to_string();
        let inner = e.into_inner();
        match key.as_str() {
            "." | "" => anyhow::anyhow!("{inner}"),
            key => anyhow::anyhow!("key `{key}`: {inner}"),
        }
    })
}

/// The sliding window and the first layer it applies to, as transformers decides them: Mistral's
/// `sliding_window` (null: none) on every layer; Qwen's only with `use_sliding_window`, on the
/// layers from `max_window_layers`; an explicit `layer_types` list is read when it is one run of
/// full layers then one of sliding ones.
fn windows(hf: &HfFamily, model_type: ModelType) -> anyhow::Result<(Option<usize>, usize)> {
    let window = match model_type {
        ModelType::Llama => return Ok((None, 0)),
        ModelType::Mistral => hf.sliding_window,
        ModelType::Qwen2 | ModelType::Qwen3 => hf.sliding_window.filter(|_| hf.use_sliding_window),
    };
    if window == Some(0) {
        bail!("sliding_window = 0 leaves a token nothing to attend to: it must be at least 1 (or null)");
    }
    let from = match model_type {
        ModelType::Mistral => 0,
        // transformers' default when the key is absent.
        _ => hf.max_window_layers.unwrap_or(28),
    };
    let Some(types) = &hf.layer_types else {
        // A window from a layer past the last (Qwen's default `max_window_layers` of 28 on a
        // smaller model) applies to none: the model has no window.
        return Ok(match window {
            Some(w) if from < hf.num_hidden_layers => (Some(w), from),
            _ => (None, 0),
        });
    };
    if types.len() != hf.num_hidden_layers {
        bail!("layer_types has {} entries for {} layers", types.len(), hf.num_hidden_layers);
    }
    let sliding: Vec<bool> = types
        .iter()
        .map(|t| match t.as_str() {
            "full_attention" => Ok(false),
            "sliding_attention" => Ok(true),
            other => bail!("layer_types entry {other:?} is not supported (\"full_attention\", \"sliding_attention\")"),
        })
        .collect::<anyhow::Result<_>>()?;
    let first = sliding.iter().position(|&s| s).unwrap_or(sliding.len());
    if sliding[first..].iter().any(|&s| !s) {
        bail!("layer_types interleaves full and sliding layers: llora runs full layers then sliding ones only");
    }
    match (window, first < sliding.len()) {
        (Some(w), true) => Ok((Some(w), first)),
        (_, false) => Ok((None, 0)),
        (None, true) => bail!("layer_types has sliding_attention layers but sliding_window is null"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn family(extra: &str) -> anyhow::Result<Family> {
        Family::from_hf_json(&format!(r#"{{"num_hidden_layers": 4, {extra}}}"#))
    }

    /// Each family's traits as transformers' config classes set them.
    #[test]
    fn each_family_reads_as_transformers_builds_it() {
        let llama = family(r#""model_type": "llama""#).unwrap();
        assert_eq!(llama, Family::default());
        let qwen2 = family(r#""model_type": "qwen2", "use_sliding_window": false, "sliding_window": 131072"#).unwrap();
        assert!(qwen2.qkv_bias && !qwen2.o_bias && !qwen2.qk_norm && qwen2.sliding_window.is_none());
        let qwen3 = family(r#""model_type": "qwen3", "attention_bias": false"#).unwrap();
        assert!(!qwen3.qkv_bias && qwen3.qk_norm);
        let biased = family(r#""model_type": "qwen3", "attention_bias": true"#).unwrap();
        assert!(biased.qkv_bias && biased.o_bias);
        let mistral = family(r#""model_type": "mistral", "sliding_window": 4096"#).unwrap();
        assert_eq!((mistral.window_of(0), mistral.window_of(3)), (Some(4096), Some(4096)));
        let windowed =
            family(r#""model_type": "qwen2", "use_sliding_window": true, "sliding_window": 8, "max_window_layers": 2"#)
                .unwrap();
        assert_eq!((windowed.window_of(1), windowed.window_of(2)), (None, Some(8)));
        let listed = family(
            r#""model_type": "qwen3", "use_sliding_window": true, "sliding_window": 8,
            "layer_types": ["full_attention", "sliding_attention", "sliding_attention", "sliding_attention"]"#,
        )
        .unwrap();
        assert_eq!((listed.window_of(0), listed.window_of(1)), (None, Some(8)));
    }

    /// The window transformers 5.23 takes when config.json names none (its config classes'
    /// default 4096; `null` is no window) or places it past the last layer (no window).
    #[test]
    fn a_missing_window_key_is_transformers_default_and_a_window_past_the_layers_is_none() {
        let mistral = family(r#""model_type": "mistral""#).unwrap();
        assert_eq!((mistral.sliding_window, mistral.window_of(0)), (Some(4096), Some(4096)));
        assert_eq!(family(r#""model_type": "mistral", "sliding_window": null"#).unwrap().sliding_window, None);
        let qwen = family(r#""model_type": "qwen2", "use_sliding_window": true, "max_window_layers": 1"#).unwrap();
        assert_eq!((qwen.window_of(0), qwen.window_of(1)), (None, Some(4096)));
        assert_eq!(family(r#""model_type": "qwen2""#).unwrap().sliding_window, None, "use_sliding_window false");
        // transformers' default max_window_layers (28) on a 4-layer model: no layer has the window.
        let past = family(r#""model_type": "qwen3", "use_sliding_window": true, "sliding_window": 8"#).unwrap();
        assert_eq!((past.sliding_window, past.window_from), (None, 0));
        let past = r#""model_type": "qwen2", "use_sliding_window": true, "sliding_window": 8, "max_window_layers": 4"#;
        assert_eq!(family(past).unwrap().sliding_window, None);
    }

    /// A value of the wrong type is refused naming its key.
    #[test]
    fn a_mistyped_value_names_its_key() {
        let err = format!("{:#}", family(r#""model_type": "mistral", "sliding_window": "8""#).unwrap_err());
        assert!(err.contains("`sliding_window`") && err.contains("invalid type"), "{err}");
    }

    /// What llora does not implement is refused, naming the key.
    #[test]
    fn what_is_not_implemented_is_refused_by_name() {
        for (extra, key) in [
            (r#""model_type": "gemma""#, "model_type"),
            (r#""model_type": "mistral", "attention_bias": true"#, "attention_bias"),
            (r#""model_type": "qwen2", "mlp_bias": true"#, "mlp_bias"),
            (r#""model_type": "mistral", "sliding_window": 0"#, "sliding_window"),
            (
                r#""model_type": "qwen3", "use_sliding_window": true, "sliding_window": 8,
                "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]"#,
                "layer_types",
            ),
        ] {
            let err = family(extra).unwrap_err().to_string();
            assert!(err.contains(key), "{extra}: {err}");
        }
    }

    /// The keys written back read as the same family.
    #[test]
    fn written_keys_read_back_as_the_same_family() {
        for extra in [
            r#""model_type": "qwen2", "use_sliding_window": true, "sliding_window": 8, "max_window_layers": 2"#,
            r#""model_type": "qwen3", "attention_bias": true"#,
            r#""model_type": "mistral", "sliding_window": 16"#,
            r#""model_type": "llama""#,
        ] {
            let f = family(extra).unwrap();
            let mut v = f.hf_keys(4);
            v["num_hidden_layers"] = 4.into();
            assert_eq!(Family::from_hf_json(&v.to_string()).unwrap(), f, "{extra}");
        }
    }
}
