//! PEFT adapters: `adapter_config.json` read and written, `adapter_model.safetensors` loaded
//! onto a model and saved from it.
//!
//! Every key of PEFT's `LoraConfig` (peft 0.21) has a rule in [`LORA_CONFIG_KEYS`]: applied as
//! PEFT applies it, ignored because it does not change the math (names, versions, settings that
//! only act at initialisation), or refused when set, naming the key, because llora does not
//! implement it. A key PEFT may add later is refused unless it holds PEFT's "unset" (null, false,
//! empty), so a newer adapter is never evaluated differently from PEFT without a word.

use crate::params::MAGNITUDE;
use std::collections::{HashMap, HashSet};
use std::path::Path;

use anyhow::{Context, bail, ensure};
use burn::tensor::{Device, Tensor};
use serde_json::Value;

use crate::checkpoint::{Shard, safetensors_bytes_with, tensor_f32, write_atomic};
use crate::config::LlamaConfig;
use crate::layout::BlockLinear;
use crate::llama::LlamaForCausalLM;
use crate::lora::{LoraAdapter, LoraSpec};

/// How llora treats one key of PEFT's `LoraConfig`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KeyRule {
    /// Read and applied as PEFT applies it.
    Applied,
    /// Bookkeeping or initialisation-only: the saved weights already carry its effect.
    Ignored,
    /// Changes the math in a way llora does not implement; refused unless unset. The text says what it does.
    Refused(&'static str),
}

/// Every key of PEFT 0.21's `LoraConfig` and llora's rule for it.
pub const LORA_CONFIG_KEYS: &[(&str, KeyRule)] = &[
    ("peft_type", KeyRule::Applied),
    ("r", KeyRule::Applied),
    ("lora_alpha", KeyRule::Applied),
    ("lora_dropout", KeyRule::Applied),
    ("target_modules", KeyRule::Applied),
    ("exclude_modules", KeyRule::Applied),
    ("bias", KeyRule::Applied),
    ("fan_in_fan_out", KeyRule::Applied),
    ("init_lora_weights", KeyRule::Applied),
    ("use_rslora", KeyRule::Applied),
    ("rank_pattern", KeyRule::Applied),
    ("alpha_pattern", KeyRule::Applied),
    ("layers_to_transform", KeyRule::Applied),
    ("layers_pattern", KeyRule::Applied),
    ("use_dora", KeyRule::Applied),
    ("task_type", KeyRule::Ignored),
    ("auto_mapping", KeyRule::Ignored),
    ("peft_version", KeyRule::Ignored),
    ("base_model_name_or_path", KeyRule::Ignored),
    ("revision", KeyRule::Ignored),
    ("inference_mode", KeyRule::Ignored),
    ("megatron_core", KeyRule::Ignored),
    ("runtime_config", KeyRule::Ignored),
    ("qalora_group_size", KeyRule::Ignored),
    ("eva_config", KeyRule::Ignored),
    ("corda_config", KeyRule::Ignored),
    ("ensure_weight_tying", KeyRule::Ignored),
    ("modules_to_save", KeyRule::Refused("trains and saves whole modules beside the adapters")),
    ("trainable_token_indices", KeyRule::Refused("trains some embedding rows")),
    ("megatron_config", KeyRule::Refused("adapts Megatron's parallel linear layers")),
    ("loftq_config", KeyRule::Refused("quantises the base weights (LoftQ)")),
    ("lora_ga_config", KeyRule::Refused("changes the base weights at initialisation (LoRA-GA)")),
    ("velora_config", KeyRule::Refused("is the VeLoRA variant")),
    ("alora_invocation_tokens", KeyRule::Refused("activates the adapter only after given tokens (aLoRA)")),
    ("use_qalora", KeyRule::Refused("is the QA-LoRA variant")),
    ("monteclora_config", KeyRule::Refused("is the MonteCLoRA variant")),
    ("layer_replication", KeyRule::Refused("duplicates layers of the base")),
    ("lora_bias", KeyRule::Refused("adds a bias to lora_B")),
    ("target_parameters", KeyRule::Refused("adapts parameters rather than modules")),
    ("use_bdlora", KeyRule::Refused("is the block-diagonal BD-LoRA variant")),
    ("arrow_config", KeyRule::Refused("routes between several adapters (Arrow)")),
    ("kasa_config", KeyRule::Refused("is the KaSA variant, which truncates the base weights")),
];

/// `init_lora_weights` values that leave the base untouched (only A and B start differently).
/// The others (`pissa*`, `olora`, `corda`, `loftq`) rewrite the base weights too.
const INIT_KEEPING_THE_BASE: &[&str] = &["gaussian", "eva", "orthogonal"];

/// A `target_modules` / `exclude_modules` value, matched against a module's full name
/// (`model.layers.0.self_attn.q_proj`) as PEFT's `check_target_module_exists` does.
#[derive(Debug, Clone)]
pub enum ModulePattern {
    /// A list: a name equal to an entry, or ending in `.entry`.
    Names(Vec<String>),
    /// A string: a regular expression the whole name must match (Python's `re.fullmatch`).
    Regex(regex::Regex),
    /// `"all-linear"`: every linear layer but the output head.
    AllLinear,
}

impl ModulePattern {
    /// Reads `key`'s value; `None` when unset.
    fn parse(key: &str, v: &Value, targets: bool) -> anyhow::Result<Option<Self>> {
        Ok(Some(match v {
            Value::Null => return Ok(None),
            Value::String(s) if s.is_empty() => return Ok(None),
            Value::String(s) if targets && s.eq_ignore_ascii_case("all-linear") => Self::AllLinear,
            Value::String(s) => Self::Regex(regex::Regex::new(&format!("^(?:{s})$")).map_err(|e| {
                anyhow::anyhow!(
                    "{key} {s:?} is not a regular expression llora can read (no look-around or back-references): {e}"
                )
            })?),
            Value::Array(a) if a.is_empty() => return Ok(None),
            Value::Array(a) => Self::Names(
                a.iter()
                    .map(|x| x.as_str().filter(|s| !s.is_empty()).map(String::from))
                    .collect::<Option<_>>()
                    .with_context(|| format!("{key} {v} holds something other than a module name"))?,
            ),
            other => bail!("{key} {other} is neither a list of module names nor a regular expression"),
        }))
    }

    /// Whether module `name` matches.
    pub fn matches(&self, name: &str, linear: bool) -> bool {
        match self {
            Self::Names(list) => {
                list.iter().any(|t| name == t || name.strip_suffix(t.as_str()).is_some_and(|p| p.ends_with('.')))
            }
            Self::Regex(re) => re.is_match(name),
            Self::AllLinear => linear && name != "lm_head",
        }
    }
}

/// What kind of module a Llama module name is, for what an adapter on it would mean.
#[derive(Debug, Clone, Copy, PartialEq)]
enum ModuleKind {
    /// A decoder projection: llora adapts these.
    Projection,
    /// The embedding or the output head: PEFT can adapt them, llora cannot.
    EmbeddingOrHead,
    /// A container, a norm, the activation or the rotary table: PEFT refuses them as targets too.
    Other,
}

/// Every module name of a transformers `LlamaForCausalLM` with `config`, as `named_modules()`
/// lists them, with its kind.
fn llama_modules(config: &LlamaConfig) -> Vec<(String, ModuleKind)> {
    use ModuleKind::*;
    let mut out: Vec<(String, ModuleKind)> =
        ["", "model", "model.embed_tokens", "model.layers"].iter().map(|n| (n.to_string(), Other)).collect();
    out[2].1 = EmbeddingOrHead;
    let linears = BlockLinear::of(config.fused_qkv);
    let in_part = |part: &'static str| linears.iter().filter(move |k| k.part() == part);
    for l in 0..config.num_hidden_layers {
        let p = format!("model.layers.{l}");
        out.push((p.clone(), Other));
        out.push((format!("{p}.self_attn"), Other));
        out.extend(in_part("self_attn").map(|k| (k.path(l), Projection)));
        out.push((format!("{p}.mlp"), Other));
        out.extend(in_part("mlp").map(|k| (k.path(l), Projection)));
        out.push((format!("{p}.mlp.act_fn"), Other));
        out.push((format!("{p}.input_layernorm"), Other));
        out.push((format!("{p}.post_attention_layernorm"), Other));
    }
    out.extend([("model.norm".into(), Other), ("model.rotary_emb".into(), Other), ("lm_head".into(), EmbeddingOrHead)]);
    out
}

/// The modules a PEFT config adapts: `target_modules` minus `exclude_modules`.
#[derive(Debug, Clone)]
pub struct ModuleSelection {
    /// `target_modules`.
    pub targets: ModulePattern,
    /// `exclude_modules` (`None`: unset).
    pub exclude: Option<ModulePattern>,
    /// `layers_to_transform` (`None`: unset); PEFT applies it to list targets only.
    pub layers: Option<Vec<usize>>,
}

impl ModuleSelection {
    /// The full names of the projections of a model with `config` that get an adapter, in
    /// model order. A selected module llora cannot adapt (the head, the embedding, a norm or
    /// a container) is an error naming it, as is a selection of nothing.
    pub fn modules(&self, config: &LlamaConfig) -> anyhow::Result<Vec<String>> {
        let mut out = Vec::new();
        for (name, kind) in llama_modules(config) {
            let linear = kind == ModuleKind::Projection || name == "lm_head";
            if self.exclude.as_ref().is_some_and(|e| e.matches(&name, linear)) || !self.targets.matches(&name, linear) {
                continue;
            }
            if let (ModulePattern::Names(_), Some(layers)) = (&self.targets, &self.layers)
                && !crate::patterns::layer_index(&name).is_some_and(|i| layers.contains(&i))
            {
                continue;
            }
            match kind {
                ModuleKind::Projection => out.push(name),
                ModuleKind::EmbeddingOrHead => bail!(
                    "target_modules selects {name}: PEFT can adapt it, llora adapts only the decoder's linear projections"
                ),
                ModuleKind::Other => {
                    bail!("target_modules selects {name:?}, which is not a linear layer (PEFT refuses it too)")
                }
            }
        }
        if let (ModulePattern::Names(_), Some(layers)) = (&self.targets, &self.layers) {
            let n = config.num_hidden_layers;
            let outside: Vec<usize> = layers.iter().copied().filter(|&l| l >= n).collect();
            ensure!(
                outside.is_empty(),
                "layers_to_transform = {layers:?} names layer(s) {outside:?}, but this model has {n} (0..{n}): \
                 an adapter for another model, or a wrong layer index"
            );
        }
        ensure!(!out.is_empty(), "target_modules (less exclude_modules) selects no module of this model");
        Ok(out)
    }
}

/// A PEFT adapter's `adapter_config.json`, as llora applies it.
#[derive(Debug, Clone)]
pub struct PeftConfig {
    /// Rank, alpha, dropout; `targets` as written (a list, or the one pattern string).
    pub spec: LoraSpec,
    /// Which modules carry the adapter.
    pub select: ModuleSelection,
}

/// Whether `v` is PEFT's "unset" for a key: null, false, or empty.
fn unset(v: &Value) -> bool {
    match v {
        Value::Null | Value::Bool(false) => true,
        Value::Object(m) => m.is_empty(),
        Value::Array(a) => a.is_empty(),
        Value::String(s) => s.is_empty(),
        _ => false,
    }
}

/// Refuses keys llora does not apply and values of applied keys it does not implement.
fn audit_keys(v: &serde_json::Map<String, Value>) -> anyhow::Result<()> {
    for (key, value) in v {
        match LORA_CONFIG_KEYS.iter().find(|(k, _)| k == key).map(|(_, r)| *r) {
            Some(KeyRule::Applied | KeyRule::Ignored) => {}
            Some(KeyRule::Refused(what)) => ensure!(unset(value), "{key} = {value} is not supported: it {what}"),
            None => ensure!(
                unset(value),
                "{key} = {value} is no LoraConfig key llora knows (a newer PEFT?); refused rather than ignored"
            ),
        }
    }
    if let Some(bias) = v.get("bias").filter(|b| !b.is_null()) {
        ensure!(bias == "none", "bias = {bias} is not supported (only \"none\")");
    }
    if let Some(f) = v.get("fan_in_fan_out").filter(|f| !unset(f)) {
        bail!("fan_in_fan_out = {f} is not supported: Llama's linear weights are [out, in]");
    }
    match v.get("init_lora_weights") {
        None | Some(Value::Null | Value::Bool(_)) => {}
        Some(Value::String(s)) if INIT_KEEPING_THE_BASE.contains(&s.as_str()) => {}
        Some(other) => bail!(
            "init_lora_weights = {other} is not supported: that initialisation rewrites the base weights; save the \
             adapter with PEFT's path_initial_model_for_weight_conversion to get a plain LoRA adapter"
        ),
    }
    Ok(())
}

/// Reads a PEFT `adapter_config.json`; every error names the file.
pub fn read_peft_config(dir: &Path) -> anyhow::Result<PeftConfig> {
    let path = dir.join("adapter_config.json");
    let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
    let v: Value = serde_json::from_str(&text).with_context(|| format!("{}: invalid JSON", path.display()))?;
    parse_config(&v).with_context(|| path.display().to_string())
}

fn parse_config(v: &Value) -> anyhow::Result<PeftConfig> {
    let obj = v.as_object().context("not a JSON object")?;
    let field = |k: &str| v.get(k).with_context(|| format!("missing key {k:?}"));
    let peft_type = field("peft_type")?.as_str().unwrap_or_default();
    ensure!(peft_type == "LORA", "peft_type {peft_type:?} is not supported (LORA only)");
    audit_keys(obj)?;
    let targets = ModulePattern::parse("target_modules", field("target_modules")?, true)?
        .with_context(|| format!("target_modules {} names no module", v["target_modules"]))?;
    let exclude = match v.get("exclude_modules") {
        Some(e) => ModulePattern::parse("exclude_modules", e, false)?,
        None => None,
    };
    let rank = field("r")?.as_u64().filter(|r| (1..=1 << 16).contains(r));
    let rank = rank.with_context(|| format!("r = {} is not a rank in 1..=65536", v["r"]))? as usize;
    let alpha = field("lora_alpha")?.as_f64().filter(|a| a.is_finite());
    let alpha = alpha.with_context(|| format!("lora_alpha = {} is not a finite number", v["lora_alpha"]))?;
    let dropout = match v.get("lora_dropout") {
        None | Some(Value::Null) => 0.0,
        Some(d) => d
            .as_f64()
            .filter(|d| (0.0..1.0).contains(d))
            .with_context(|| format!("lora_dropout = {d} is not a probability in [0, 1)"))?,
    };
    let flag = |key: &str| match v.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(other) => Err(anyhow::anyhow!("{key} = {other} is not true or false")),
    };
    let (rslora, dora) = (flag("use_rslora")?, flag("use_dora")?);
    let rank_pattern =
        pattern(v, "rank_pattern", |x| x.as_u64().filter(|r| (1..=1 << 16).contains(r)).map(|r| r as usize))?;
    let alpha_pattern = pattern(v, "alpha_pattern", |x| x.as_f64().filter(|a| a.is_finite()))?;
    let layers = match v.get("layers_to_transform") {
        None | Some(Value::Null) => None,
        Some(Value::Array(a)) if a.is_empty() => None,
        Some(l) => Some(
            match l {
                Value::Array(a) => a.iter().map(|x| x.as_u64().map(|i| i as usize)).collect::<Option<Vec<_>>>(),
                x => x.as_u64().map(|i| vec![i as usize]),
            }
            .with_context(|| format!("layers_to_transform = {l} is not a layer index or a list of them"))?,
        ),
    };
    match v.get("layers_pattern") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) if s.is_empty() || s == "layers" => {}
        Some(Value::Array(a)) if a.is_empty() || a.iter().all(|x| x == "layers") => {}
        Some(other) => bail!("layers_pattern = {other} is not supported: a Llama model's layers are `model.layers`"),
    }
    let written = match &v["target_modules"] {
        Value::String(s) => vec![s.clone()],
        Value::Array(a) => a.iter().filter_map(|x| x.as_str().map(String::from)).collect(),
        _ => Vec::new(),
    };
    Ok(PeftConfig {
        spec: LoraSpec {
            rank,
            alpha,
            dropout,
            targets: written,
            rslora,
            rank_pattern,
            alpha_pattern,
            layers: layers.clone(),
            dora,
            init_from: None,
        },
        select: ModuleSelection { targets, exclude, layers },
    })
}

/// A `rank_pattern` / `alpha_pattern` object as (key, value) pairs, each value read by `read`
/// and each key a regular expression llora can compile.
fn pattern<T>(v: &Value, key: &str, read: impl Fn(&Value) -> Option<T>) -> anyhow::Result<Vec<(String, T)>> {
    let Some(p) = v.get(key).filter(|p| !p.is_null()) else { return Ok(Vec::new()) };
    let map = p.as_object().with_context(|| format!("{key} = {p} is not an object of module patterns"))?;
    let out: Vec<(String, T)> = map
        .iter()
        .map(|(k, x)| {
            read(x).map(|x| (k.clone(), x)).with_context(|| format!("{key}[{k:?}] = {x} is not a valid value"))
        })
        .collect::<anyhow::Result<_>>()?;
    crate::patterns::check_keys(&out).map_err(|e| anyhow::anyhow!("{key}: {e}"))?;
    Ok(out)
}

/// The distinct last components of module names (`q_proj`, ...), in first-seen order.
fn short_names<'a>(modules: impl IntoIterator<Item = &'a str>) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for m in modules {
        let short = m.rsplit('.').next().unwrap_or_default();
        if !out.iter().any(|x| x == short) {
            out.push(short.to_string());
        }
    }
    out
}

/// Saves the model's adapters in PEFT format: `adapter_config.json` and
/// `adapter_model.safetensors` with PEFT's names
/// (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` `[r, in]`, `lora_B` `[out, r]`).
pub fn save_peft_adapter(
    model: &LlamaForCausalLM,
    spec: &LoraSpec,
    dir: &Path,
    base_model: &str,
) -> anyhow::Result<()> {
    let mut tensors = Vec::new();
    for (name, adapter) in model.adapters() {
        let (sa, va) = tensor_f32(&adapter.a.val());
        let (sb, vb) = tensor_f32(&adapter.b.val());
        tensors.push((format!("{name}.lora_A.weight"), sa, va));
        tensors.push((format!("{name}.lora_B.weight"), sb, vb));
        if let Some(m) = &adapter.magnitude {
            let (sm, vm) = tensor_f32(&m.val());
            tensors.push((format!("{name}.{MAGNITUDE}"), sm, vm));
        }
    }
    ensure!(!tensors.is_empty(), "the model has no adapters to save");
    // The modules that carry adapters, not the names asked for: `qkv_proj` on a checkpoint with
    // separate projections was adapted as q/k/v_proj, and PEFT must look for those. Short names
    // when every layer has the same set, else the full names (PEFT matches them exactly).
    let adapted: Vec<String> = model.adapters().into_iter().map(|(name, _)| name).collect();
    let shorts = short_names(adapted.iter().map(String::as_str));
    let layers = spec.layers.as_ref().map_or(model.config.num_hidden_layers, Vec::len);
    let modules = if adapted.len() == shorts.len() * layers {
        shorts
    } else {
        adapted.iter().map(|n| n.strip_prefix("base_model.model.").unwrap_or(n).to_string()).collect()
    };
    let config = serde_json::json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": modules,
        "exclude_modules": null,
        "bias": "none",
        "fan_in_fan_out": false,
        "inference_mode": true,
        "init_lora_weights": true,
        "use_rslora": spec.rslora,
        "use_dora": model.adapters().iter().any(|(_, a)| a.magnitude.is_some()),
        "modules_to_save": null,
        "layers_to_transform": spec.layers,
        "rank_pattern": spec.rank_pattern.iter().map(|(k, r)| (k.clone(), Value::from(*r))).collect::<serde_json::Map<_, _>>(),
        "alpha_pattern": spec.alpha_pattern.iter().map(|(k, a)| (k.clone(), Value::from(*a))).collect::<serde_json::Map<_, _>>(),
    });
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let metadata = nf4_base(model).map(|b| HashMap::from([(BASE_QUANTIZATION.to_string(), b)]));
    write_atomic(&dir.join("adapter_model.safetensors"), &safetensors_bytes_with(&tensors, metadata)?)?;
    write_atomic(&dir.join("adapter_config.json"), serde_json::to_string_pretty(&config)?.as_bytes())
}

/// The adapter file's metadata key (llora's) saying the base it was trained on was quantised:
/// `nf4 block 64`. `export --merged` reads it.
pub const BASE_QUANTIZATION: &str = "llora.base_quantization";

/// `nf4 block B` when the model's frozen linear weights are NF4 (QLoRA).
fn nf4_base(model: &LlamaForCausalLM) -> Option<String> {
    let block = model.named_linears().into_iter().find_map(|(_, l)| l.weight.stored()?.nf4_block())?;
    Some(format!("nf4 block {block}"))
}

/// What the adapter in `dir` says of its base's quantisation ([`BASE_QUANTIZATION`]), if anything.
pub fn base_quantization(dir: &Path) -> anyhow::Result<Option<String>> {
    let shard = Shard::open(&dir.join("adapter_model.safetensors"))?;
    Ok(shard.meta.metadata().as_ref().and_then(|m| m.get(BASE_QUANTIZATION).cloned()))
}

/// A PEFT adapter file's tensors by PEFT name without the adapter name
/// (`...q_proj.lora_A.weight`, `...q_proj.lora_magnitude_vector`), mapped to their stored names
/// (`lora_A.default.weight` or not; the magnitude also as the module state dict names it,
/// `lora_magnitude_vector[.default].weight`).
pub(crate) fn adapter_tensor_names(shard: &Shard) -> HashMap<String, String> {
    shard
        .meta
        .tensors()
        .into_keys()
        .map(|n| {
            let name = n.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.");
            let name = match name.strip_suffix(".default.weight").or_else(|| name.strip_suffix(".weight")) {
                Some(module) if module.ends_with(MAGNITUDE) => module.to_string(),
                _ => name,
            };
            (name, n)
        })
        .collect()
}

/// The error for an adapter tensor that no selected module takes: either its module exists
/// but the config does not select it, or the base has no such module.
pub fn stray_tensor_error(path: &Path, tensor: &str, config: &LlamaConfig) -> anyhow::Error {
    let module = tensor.trim_start_matches("base_model.model.").split(".lora_").next().unwrap_or_default();
    if llama_modules(config).iter().any(|(m, k)| m == module && *k == ModuleKind::Projection) {
        anyhow::anyhow!(
            "{}: tensor {tensor} belongs to {module}, which adapter_config.json's target_modules/exclude_modules do not select",
            path.display()
        )
    } else {
        anyhow::anyhow!(
            "{}: tensor {tensor} matches no module of the base model (wrong base, or a target llora does not know)",
            path.display()
        )
    }
}

/// Loads a PEFT adapter directory onto `model`: the modules its config selects get its
/// adapters, every other module loses any it had. Returns the adapter's spec with `targets` the
/// adapted modules' short names.
///
/// Accepts PEFT's on-disk names with or without the adapter name (`lora_A.weight` or
/// `lora_A.default.weight`). Every selected module must have both tensors in the right shape;
/// a tensor that no selected module takes is an error too (a wrong base, or a config that
/// excludes what was trained).
pub fn load_peft_adapter(model: &mut LlamaForCausalLM, dir: &Path, device: &Device) -> anyhow::Result<LoraSpec> {
    let PeftConfig { spec, select } = read_peft_config(dir)?;
    let config_path = dir.join("adapter_config.json");
    let selected: HashSet<String> =
        select.modules(&model.config).with_context(|| config_path.display().to_string())?.into_iter().collect();
    let path = dir.join("adapter_model.safetensors");
    let shard = Shard::open(&path)?;
    let mut names = adapter_tensor_names(&shard);
    let mut adapted = Vec::new();
    for (module, layer) in model.named_linears_mut() {
        if !selected.contains(&module) {
            layer.lora = None;
            continue;
        }
        let peft = format!("base_model.model.{module}");
        let [out, inp] = layer.dims();
        let mut take = |which: &str, shape: [usize; 2]| -> anyhow::Result<Tensor<2>> {
            let key = format!("{peft}.{which}.weight");
            let stored =
                names.remove(&key).with_context(|| format!("tensor {key} is missing from {}", path.display()))?;
            let data = shard.read_f32(&stored, &shape)?;
            Ok(Tensor::from_data(data, device))
        };
        // Its own rank and alpha (rank_pattern, alpha_pattern).
        let m = spec.module_spec(&module).with_context(|| config_path.display().to_string())?;
        let a = take("lora_A", [m.rank, inp])?;
        let b = take("lora_B", [out, m.rank])?;
        let mut adapter = LoraAdapter::from_tensors(a, b, &m);
        if spec.dora {
            let key = format!("{peft}.{MAGNITUDE}");
            let stored = names
                .remove(&key)
                .with_context(|| format!("tensor {key} is missing from {} (use_dora)", path.display()))?;
            adapter = adapter.with_magnitude(Tensor::from_data(shard.read_f32(&stored, &[out])?, device));
        }
        layer.lora = Some(adapter);
        adapted.push(module);
    }
    if let Some(extra) = names.keys().filter(|n| !spec.dora && n.ends_with(MAGNITUDE)).min() {
        bail!("{}: tensor {extra} is DoRA's magnitude, but adapter_config.json has no use_dora = true", path.display());
    }
    if let Some(extra) = names.keys().min() {
        return Err(stray_tensor_error(&path, extra, &model.config));
    }
    let targets = short_names(adapted.iter().map(String::as_str));
    Ok(LoraSpec { targets, ..spec })
}

/// Sets `model`'s adapters to the values of the PEFT adapter in `dir` (training continued from
/// an existing adapter: `lora.init_from`), each keeping its precision and dropout. The file
/// must adapt exactly the modules `model` adapts, each with the same shapes, scale and DoRA; a
/// difference is an error naming the module.
pub fn load_adapter_values(model: &mut LlamaForCausalLM, dir: &Path, device: &Device) -> anyhow::Result<()> {
    // The file's adapters on a copy that shares the base's tensors.
    let mut read = model.clone();
    load_peft_adapter(&mut read, dir, device)?;
    let theirs: HashMap<String, &crate::lora::LoraAdapter> = read.adapters().into_iter().collect();
    let ours = model.adapters_mut();
    let mut missing: Vec<&String> = theirs.keys().filter(|k| !ours.iter().any(|(n, _)| n == *k)).collect();
    missing.sort();
    ensure!(
        missing.is_empty(),
        "{}: adapts {} which the run's [lora] does not: set [lora] as the adapter was trained",
        dir.display(),
        missing.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", ")
    );
    for (name, adapter) in ours {
        let from = theirs.get(&name).with_context(|| {
            format!(
                "{}: has no adapter for {name}, which the run's [lora] adapts: set [lora] as the adapter was trained",
                dir.display()
            )
        })?;
        let same = adapter.a.dims() == from.a.dims()
            && adapter.b.dims() == from.b.dims()
            && adapter.magnitude.is_some() == from.magnitude.is_some()
            && adapter.scale == from.scale;
        ensure!(
            same,
            "{}: {name} has rank {}, scale {} and DoRA {}, the run's [lora] rank {}, scale {} and DoRA {}: \
             set [lora] as the adapter was trained",
            dir.display(),
            from.a.dims()[0],
            from.scale,
            from.magnitude.is_some(),
            adapter.a.dims()[0],
            adapter.scale,
            adapter.magnitude.is_some()
        );
        let set2 = |p: &mut burn::module::Param<Tensor<2>>, v: Tensor<2>| {
            let trainable = p.val().is_require_grad();
            *p = burn::module::Param::initialized(p.id, v.detach().set_require_grad(trainable));
        };
        set2(&mut adapter.a, from.a.val());
        set2(&mut adapter.b, from.b.val());
        if let (Some(m), Some(f)) = (adapter.magnitude.as_mut(), from.magnitude.as_ref()) {
            let trainable = m.val().is_require_grad();
            *m = burn::module::Param::initialized(m.id, f.val().detach().set_require_grad(trainable));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An adapter trained on an NF4 base says so in its file's metadata, which
    /// `export --merged` reads; one trained on a full-precision base says nothing.
    #[test]
    fn an_adapter_records_an_nf4_base() {
        use crate::precision::{Compute, Nf4Spec, PrecisionSpec};
        let _rng = crate::device::torch_rng_lock();
        let device = burn::tensor::Device::default();
        let config = LlamaConfig::preset("tiny").unwrap();
        let spec = LoraSpec { rank: 2, ..LoraSpec::default() };
        let nf4 = PrecisionSpec {
            compute: Compute::Bf16,
            nf4: Some(Nf4Spec { block: 64, double: true }),
            ..PrecisionSpec::default()
        };
        for (precision, want) in [(Some(nf4), Some("nf4 block 64")), (None, None)] {
            let opts = crate::BuildOptions { lora: Some(&spec), precision, ..Default::default() };
            let model = LlamaForCausalLM::random(&config, &opts, &device).unwrap();
            let dir = tempfile::tempdir().unwrap();
            save_peft_adapter(&model, &spec, dir.path(), "base").unwrap();
            assert_eq!(base_quantization(dir.path()).unwrap().as_deref(), want);
        }
    }

    fn config(extra: &str) -> anyhow::Result<PeftConfig> {
        let text = format!(
            r#"{{"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], "rank_pattern": {{}},
               "alpha_pattern": {{}}, "layers_to_transform": null, "modules_to_save": null{extra}}}"#
        );
        parse_config(&serde_json::from_str(&text).unwrap())
    }

    fn llama(layers: usize, fused_qkv: bool) -> LlamaConfig {
        LlamaConfig { num_hidden_layers: layers, fused_qkv, ..LlamaConfig::tiny() }
    }

    /// Every key PEFT 0.21's LoraConfig has is in the table once (the list is PEFT's dataclass
    /// fields, written out by hand from `dataclasses.fields(LoraConfig)`).
    #[test]
    fn every_lora_config_key_has_a_rule() {
        let peft = "task_type peft_type auto_mapping peft_version base_model_name_or_path revision inference_mode r \
            target_modules exclude_modules lora_alpha lora_dropout fan_in_fan_out bias use_rslora modules_to_save \
            init_lora_weights layers_to_transform layers_pattern rank_pattern alpha_pattern megatron_config megatron_core \
            trainable_token_indices loftq_config eva_config corda_config lora_ga_config use_dora velora_config \
            alora_invocation_tokens use_qalora qalora_group_size monteclora_config layer_replication runtime_config \
            lora_bias target_parameters use_bdlora arrow_config kasa_config ensure_weight_tying";
        let ours: Vec<&str> = LORA_CONFIG_KEYS.iter().map(|(k, _)| *k).collect();
        for key in peft.split_whitespace() {
            assert_eq!(ours.iter().filter(|k| **k == key).count(), 1, "{key}");
        }
        assert_eq!(ours.len(), peft.split_whitespace().count());
    }

    /// Keys that would change the math are refused with the key named; PEFT's defaults (empty,
    /// null, false) load; an unknown key is refused only when set.
    #[test]
    fn math_changing_peft_keys_are_refused() {
        assert_eq!(config("").unwrap().spec.rank, 8);
        let c = config(r#", "rank_pattern": {"q_proj": 4}, "alpha_pattern": {"layers.1.self_attn.q_proj": 2.5}, "layers_to_transform": 1, "layers_pattern": "layers""#).unwrap();
        assert_eq!(
            (c.spec.rank_pattern, c.spec.alpha_pattern, c.spec.layers),
            (vec![("q_proj".to_string(), 4)], vec![("layers.1.self_attn.q_proj".to_string(), 2.5)], Some(vec![1]))
        );
        for ok in [
            r#", "use_dora": false, "lora_bias": false, "target_parameters": null, "layers_pattern": """#,
            r#", "init_lora_weights": "gaussian", "eva_config": {"rho": 2}, "task_type": "CAUSAL_LM""#,
            r#", "future_peft_key": null, "other_new_key": false"#,
            r#", "use_dora": true"#,
        ] {
            config(ok).unwrap_or_else(|e| panic!("{ok}: {e:#}"));
        }
        for (extra, key) in [
            (r#", "alpha_pattern": {"q_proj": "big"}"#, "alpha_pattern"),
            (r#", "rank_pattern": {"(q_proj": 4}"#, "rank_pattern"),
            (r#", "rank_pattern": {"q_proj": 0}"#, "rank_pattern"),
            (r#", "layers_to_transform": [0, "one"]"#, "layers_to_transform"),
            (r#", "layers_pattern": "blocks""#, "layers_pattern"),
            (r#", "modules_to_save": ["lm_head"]"#, "modules_to_save"),
            (r#", "bias": "all""#, "bias"),
            (r#", "use_rslora": "yes""#, "use_rslora"),
            (r#", "use_dora": 1"#, "use_dora"),
            (r#", "lora_bias": true"#, "lora_bias"),
            (r#", "layer_replication": [[0, 2]]"#, "layer_replication"),
            (r#", "trainable_token_indices": [5]"#, "trainable_token_indices"),
            (r#", "alora_invocation_tokens": [1, 2]"#, "alora_invocation_tokens"),
            (r#", "fan_in_fan_out": true"#, "fan_in_fan_out"),
            (r#", "init_lora_weights": "pissa""#, "init_lora_weights"),
            (r#", "init_lora_weights": "loftq""#, "init_lora_weights"),
            (r#", "future_peft_key": 3"#, "future_peft_key"),
            (r#", "exclude_modules": "(unclosed""#, "exclude_modules"),
            (r#", "exclude_modules": 7"#, "exclude_modules"),
        ] {
            let err = format!("{:#}", config(extra).unwrap_err());
            assert!(err.contains(key), "{key}: {err}");
        }
    }

    /// The selection follows PEFT's `check_target_module_exists`: a list entry matches a full
    /// name or a `.`-suffix, a string is a full-match regex, `all-linear` is every projection,
    /// `exclude_modules` removes (list or regex); the cases below were worked out by hand from
    /// PEFT's rules on a 2-layer model.
    #[test]
    fn module_selection_follows_peft() {
        let sel = |targets: &str, exclude: &str| {
            let v = format!(
                r#"{{"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": {targets}, "exclude_modules": {exclude}}}"#
            );
            parse_config(&serde_json::from_str(&v).unwrap()).and_then(|c| c.select.modules(&llama(2, false)))
        };
        let l = |i: usize, m: &str| format!("model.layers.{i}.{m}");
        assert_eq!(sel(r#"["q_proj"]"#, "null").unwrap(), [l(0, "self_attn.q_proj"), l(1, "self_attn.q_proj")]);
        assert_eq!(
            sel(r#"["q_proj", "v_proj"]"#, r#"["model.layers.1.self_attn.v_proj"]"#).unwrap(),
            [l(0, "self_attn.q_proj"), l(0, "self_attn.v_proj"), l(1, "self_attn.q_proj")]
        );
        // A suffix must start at a dot: "proj" is no module, "_proj" neither.
        assert!(sel(r#"["proj"]"#, "null").is_err());
        assert_eq!(sel(r#"["layers.1.mlp.down_proj"]"#, "null").unwrap(), [l(1, "mlp.down_proj")]);
        assert_eq!(
            sel(r#"".*\\.1\\.self_attn\\.(q|k)_proj""#, "null").unwrap(),
            [l(1, "self_attn.q_proj"), l(1, "self_attn.k_proj")]
        );
        // A layer past the model's is named as such, not blamed on the targets.
        let with_layers = |layers: &str| {
            let v = format!(
                r#"{{"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "layers_to_transform": {layers}}}"#
            );
            parse_config(&serde_json::from_str(&v).unwrap()).and_then(|c| c.select.modules(&llama(2, false)))
        };
        let err = with_layers("[1, 5]").unwrap_err().to_string();
        assert!(err.contains("layers_to_transform") && err.contains("[5]") && err.contains("0..2"), "{err}");
        assert!(!err.contains("target_modules"), "{err}");
        assert_eq!(with_layers("[1]").unwrap(), [l(1, "self_attn.q_proj")]);
        // A regex must match the whole name: "q_proj" alone matches nothing.
        assert!(sel(r#""q_proj""#, "null").unwrap_err().to_string().contains("selects no module"));
        assert_eq!(sel(r#""all-linear""#, r#"".*mlp.*""#).unwrap().len(), 8);
        assert_eq!(sel(r#""ALL-LINEAR""#, "null").unwrap().len(), 14);
        assert_eq!(
            sel(r#"["q_proj", "o_proj"]"#, r#""model\\.layers\\.0\\..*""#).unwrap(),
            [l(1, "self_attn.q_proj"), l(1, "self_attn.o_proj")]
        );
        for (targets, named) in [
            (r#"["lm_head"]"#, "lm_head"),
            (r#"["embed_tokens"]"#, "embed_tokens"),
            (r#"["self_attn"]"#, "self_attn"),
            (r#"".*norm""#, "norm"),
        ] {
            let err = sel(targets, "null").unwrap_err().to_string();
            assert!(err.contains(named), "{targets}: {err}");
        }
        // A fused checkpoint has qkv_proj and no q_proj.
        let fused = parse_config(
            &serde_json::json!({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["qkv_proj"]}),
        )
        .unwrap();
        assert_eq!(fused.select.modules(&llama(1, true)).unwrap(), [l(0, "self_attn.qkv_proj")]);
    }
}
