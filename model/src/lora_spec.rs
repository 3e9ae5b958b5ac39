//! `LoraSpec`: what adapters a run builds, as its config's `[lora]` section says (serde) and a
//! PEFT adapter config reads; checked in one place ([`LoraSpec::problems`]).

use std::collections::BTreeMap;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::layout::BlockLinear;
pub use crate::spec_problem::SpecProblem;
use crate::spec_problem::SpecProblems;

/// How to build adapters: the `[lora]` section of a config as written (TOML keys are the
/// field names, `layers` is `layers_to_transform`), and what a PEFT adapter config becomes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LoraSpec {
    /// Rank r.
    pub rank: usize,
    /// α (the update is scaled by α / r, or α / √r with `rslora`).
    pub alpha: f64,
    /// Dropout on the adapter input.
    pub dropout: f64,
    /// Module names that get an adapter (`q_proj`, `o_proj`, `gate_proj`, ...): a list, or
    /// one comma-separated string (as a `--set` override writes it).
    #[serde(deserialize_with = "string_or_list")]
    pub targets: Vec<String>,
    /// rsLoRA (Kalajdzievski 2023, PEFT's `use_rslora`): scale the update by α/√r, which keeps
    /// its size stable as the rank grows, instead of α/r.
    pub rslora: bool,
    /// Ranks of some modules, PEFT's `rank_pattern`: a key is a regular expression matching the
    /// end of a module's name (`q_proj`, `layers.0.self_attn.q_proj`, `layers\.[0-3]\..*`; see
    /// `patterns.rs`). A table in TOML.
    #[serde(with = "pattern_table")]
    pub rank_pattern: Vec<(String, usize)>,
    /// Alphas of some modules (PEFT's `alpha_pattern`; keys as `rank_pattern`).
    #[serde(with = "pattern_table")]
    pub alpha_pattern: Vec<(String, f64)>,
    /// Only these decoder layers get adapters (PEFT's `layers_to_transform`); `None`: all.
    #[serde(rename = "layers_to_transform")]
    pub layers: Option<Vec<usize>>,
    /// DoRA (PEFT's `use_dora`): a trainable magnitude per output row (see the module docs).
    pub dora: bool,
    /// A PEFT adapter directory training starts from instead of fresh adapters (its modules,
    /// ranks, scales and DoRA must be these); with preference tuning it is also the reference,
    /// frozen, as TRL keeps a copy of an existing adapter. Read by the trainer
    /// ([`crate::peft::load_adapter_values`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub init_from: Option<std::path::PathBuf>,
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
            dora: false,
            init_from: None,
        }
    }
}

/// Module names a LoRA target may be: the Llama projections, `qkv_proj` on fused-QKV checkpoints.
pub const TARGET_MODULES: &[&str] = &BlockLinear::NAMES;

impl LoraSpec {
    /// Everything wrong with these settings, each naming its key: the one check of a spec,
    /// which the config's `[lora]` section reports with its own key names.
    pub fn problems(&self) -> Vec<SpecProblem> {
        let mut out = SpecProblems::default();
        let mut check =
            |ok: bool, key: &str, value: &dyn std::fmt::Debug, allowed: &str| out.check(ok, key, value, allowed);
        let quoted = TARGET_MODULES.iter().map(|s| format!("{s:?}")).collect::<Vec<_>>().join(", ");
        check(self.rank >= 1, "rank", &self.rank, "must be at least 1");
        check(self.alpha.is_finite() && self.alpha > 0.0, "alpha", &self.alpha, "must be a finite number > 0");
        check((0.0..1.0).contains(&self.dropout), "dropout", &self.dropout, "must be in [0, 1)");
        let targets = &self.targets;
        check(!targets.is_empty(), "targets", targets, &format!("must name at least one of {quoted}"));
        for t in targets {
            check(TARGET_MODULES.contains(&t.as_str()), "targets", t, &format!("each must be one of {quoted}"));
        }
        let mut sorted = targets.clone();
        sorted.sort();
        sorted.dedup();
        check(sorted.len() == targets.len(), "targets", targets, "must not repeat a module");
        let kinds: Vec<BlockLinear> = targets.iter().filter_map(|t| BlockLinear::from_name(t)).collect();
        let fused = kinds.contains(&BlockLinear::Qkv);
        let separate = kinds.iter().any(|k| BlockLinear::Qkv.parts().contains(k));
        let why = "qkv_proj (fused checkpoints) and q_proj/k_proj/v_proj (separate) exclude each other";
        check(!(fused && separate), "targets", targets, why);
        for (key, r) in &self.rank_pattern {
            let ok = crate::patterns::check_keys(&[(key.clone(), ())]);
            check(ok.is_ok(), "rank_pattern", key, ok.err().as_deref().unwrap_or(""));
            check(*r >= 1, &format!("rank_pattern.{key}"), r, "must be at least 1");
        }
        for (key, a) in &self.alpha_pattern {
            let ok = crate::patterns::check_keys(&[(key.clone(), ())]);
            check(ok.is_ok(), "alpha_pattern", key, ok.err().as_deref().unwrap_or(""));
            check(a.is_finite() && *a > 0.0, &format!("alpha_pattern.{key}"), a, "must be a finite number > 0");
        }
        if let Some(layers) = &self.layers {
            check(!layers.is_empty(), "layers_to_transform", layers, "must list at least one layer (or be unset)");
        }
        out.0
    }

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

    /// Refuses pattern keys that set nothing: a `rank_pattern` / `alpha_pattern` key that
    /// matches none of `adapted` (the full names of the modules that got adapters) is a typo,
    /// another case, or a module not targeted, and would otherwise be ignored and still written
    /// to adapter_config.json.
    pub fn check_patterns_used(&self, adapted: &[String]) -> anyhow::Result<()> {
        use crate::patterns::value_for;
        let keys = self.rank_pattern.iter().map(|(k, _)| ("rank_pattern", k));
        for (what, key) in keys.chain(self.alpha_pattern.iter().map(|(k, _)| ("alpha_pattern", k))) {
            let alone = [(key.clone(), ())];
            let used = adapted.iter().any(|m| value_for(&alone, m).is_ok_and(|v| v.is_some()));
            anyhow::ensure!(
                used,
                "lora.{what} key {key:?} matches no adapted module (targets {:?}{}; e.g. {:?}): a typo, another \
                 case or an untargeted module; fix or remove it",
                self.targets,
                self.layers.as_ref().map_or(String::new(), |l| format!(", layers {l:?}")),
                adapted.first().map_or("none", String::as_str)
            );
        }
        Ok(())
    }

    /// The checks the model's loader makes of this spec, made before anything is built (what
    /// `llora plan` and a training run's start answer): the targets resolved for the model's
    /// layout ([`Self::for_layout`]), each adapted module's rank against its shape, and every
    /// pattern key matching an adapted module.
    pub fn check_for_model(&self, config: &crate::config::LlamaConfig) -> anyhow::Result<()> {
        let spec = self.for_layout(config.fused_qkv)?;
        let mut adapted = Vec::new();
        for layer in 0..config.num_hidden_layers {
            for kind in BlockLinear::of(config.fused_qkv).iter().copied() {
                let module = kind.path(layer);
                if spec.adapts(&module) {
                    spec.module_spec(&module)?.check_rank_fits(&module, kind.shape(config))?;
                    adapted.push(module);
                }
            }
        }
        spec.check_patterns_used(&adapted)
    }

    /// Refuses a rank above a module's smaller dimension (`out × in`): the update `B·A` cannot
    /// have a larger rank, and `r · (in + out)` values would be allocated for nothing.
    pub fn check_rank_fits(&self, module: &str, [out, inp]: [usize; 2]) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.rank <= out.min(inp),
            "lora rank {} for {module} ({out} × {inp}) is above its smaller dimension {}: lower lora.rank or its \
             rank_pattern entry",
            self.rank,
            out.min(inp)
        );
        Ok(())
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

    /// The adapted linears of a block, in forward order, as the model builds them: a target
    /// names every linear whose rows it overlaps (`qkv_proj` on separate projections adapts q,
    /// k and v; `q_proj` on a fused checkpoint, refused at load, counts as the fused one).
    pub fn adapted_kinds(&self, fused_qkv: bool) -> Vec<BlockLinear> {
        let targets: Vec<BlockLinear> = self.targets.iter().filter_map(|t| BlockLinear::from_name(t)).collect();
        let overlaps = |k: &BlockLinear| targets.iter().any(|t| t.parts().iter().any(|p| k.parts().contains(p)));
        BlockLinear::of(fused_qkv).iter().copied().filter(overlaps).collect()
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
            let kind = BlockLinear::from_name(t).expect("checked against TARGET_MODULES");
            let parts: Vec<&str> = match (kind, fused_qkv) {
                (BlockLinear::Qkv, false) => kind.parts().iter().map(|p| p.name()).collect(),
                (BlockLinear::Q | BlockLinear::K | BlockLinear::V, true) => anyhow::bail!(
                    "lora target {t:?}: this checkpoint stores q, k and v as one fused qkv_proj, which has no {t}; \
                     target \"qkv_proj\" (one adapter on the fused projection, as the MLPerf reference does)"
                ),
                _ => vec![kind.name()],
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

/// A list of module names, or one comma-separated string.
fn string_or_list<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(String),
        Many(Vec<String>),
    }
    match OneOrMany::deserialize(d)
        .map_err(|_| serde::de::Error::custom("expected a list of module names or one comma-separated string"))?
    {
        OneOrMany::One(s) => Ok(s.split(',').map(|x| x.trim().to_string()).filter(|x| !x.is_empty()).collect()),
        OneOrMany::Many(v) => Ok(v),
    }
}

/// A pattern list as a table (`{ "q_proj" = 4 }`), keys in order.
mod pattern_table {
    use super::*;

    pub fn serialize<S: Serializer, V: Serialize>(v: &[(String, V)], s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(v.iter().map(|(k, v)| (k, v)))
    }

    pub fn deserialize<'de, D: Deserializer<'de>, V: Deserialize<'de>>(d: D) -> Result<Vec<(String, V)>, D::Error> {
        Ok(BTreeMap::<String, V>::deserialize(d)?.into_iter().collect())
    }
}
