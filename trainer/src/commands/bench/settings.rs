//! What `llora bench` runs, as a [`Config`]: the peer's recipe written as config keys, the
//! bench's flags as spellings of keys (declared once, in [`FLAGS`]), and `--set` for any other.
//!
//! Training and the bench read one config type, validated by one check
//! ([`Config::validate`]); a problem with a value a flag set is named by the flag.

use clap::{Arg, ArgAction, ArgMatches, Command};

use crate::config::{Config, Override};

/// The peer's recipe (`scripts/peer/step_bench.py`): the bench's values of every key its
/// flags do not set. The bench draws random tokens: `[data.synthetic]` only satisfies the
/// data check (nothing reads it).
pub const PEER_RECIPE: &str = r#"
[model]
preset = "tiny"
[lora]
rank = 16
alpha = 32.0
dropout = 0.1
targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
[optim]
lr = 4e-4
weight_decay = 1e-4
clip_grad_norm = 0.3
[data]
max_seq_len = 512
[data.synthetic]
[run]
threads = 2
seed = 1234
"#;

/// How a flag's value becomes the key's TOML value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// A whole number.
    Count,
    /// A number (NaN and infinities pass, for the key's check to name them).
    Number,
    /// A word, taken as a string (`cpu`, `fp8`, `q_proj,v_proj`).
    Word,
    /// Present or not: `true` when given.
    Switch,
}

/// One flag of `llora bench`: `--{long}` sets config key `key`.
#[derive(Debug)]
pub struct Flag {
    /// The flag without its dashes.
    pub long: &'static str,
    /// The config key it sets.
    pub key: &'static str,
    kind: Kind,
    help: &'static str,
}

const fn flag(long: &'static str, key: &'static str, kind: Kind, help: &'static str) -> Flag {
    Flag { long, key, kind, help }
}

/// The flags that set config keys, each once.
pub const FLAGS: &[Flag] = &[
    flag(
        "preset",
        "model.preset",
        Kind::Word,
        "Model preset (random weights): tiny, tiny-gqa, small, llama2-70b-1layer, ...",
    ),
    flag("seq-len", "data.max_seq_len", Kind::Count, "Tokens per sequence."),
    flag("batch", "train.micro_batch_size", Kind::Count, "Sequences per micro-batch."),
    flag(
        "cp",
        "train.context_parallel",
        Kind::Count,
        "Split each sequence over this many of the launcher's ranks; the JSON then reports the K/V exchange's seconds per layer.",
    ),
    flag(
        "recompute-layers",
        "train.recompute_layers",
        Kind::Count,
        "Decoder blocks whose activations are recomputed in backward.",
    ),
    flag(
        "shard-frozen-weights",
        "train.shard_frozen_weights",
        Kind::Switch,
        "Shard the frozen weights over the launcher's ranks.",
    ),
    flag("threads", "run.threads", Kind::Count, "Intra-op threads (0 = one per core)."),
    flag("device", "run.device", Kind::Word, "`cpu`, `cuda:N` or `flex`."),
    flag("seed", "run.seed", Kind::Count, "Seed of the weights, adapters and dropout (tokens use seed + 1)."),
    flag("lora-r", "lora.rank", Kind::Count, "LoRA rank."),
    flag("lora-alpha", "lora.alpha", Kind::Number, "LoRA alpha."),
    flag("lora-dropout", "lora.dropout", Kind::Number, "LoRA dropout."),
    flag("targets", "lora.targets", Kind::Word, "Modules with adapters, comma-separated."),
    flag("dora", "lora.dora", Kind::Switch, "DoRA adapters: a trained magnitude per output row."),
    flag("lr", "optim.lr", Kind::Number, "AdamW learning rate."),
    flag("weight-decay", "optim.weight_decay", Kind::Number, "AdamW weight decay."),
    flag("max-grad-norm", "optim.clip_grad_norm", Kind::Number, "Global gradient-norm clip."),
    flag(
        "precision",
        "precision.compute",
        Kind::Word,
        "GEMM precision of the decoder's linear layers: fp32, bf16 or fp8.",
    ),
    flag("fp8-activations", "precision.fp8_activations", Kind::Switch, "Keep saved activations as FP8 + scale."),
    flag(
        "fp8-weights",
        "precision.fp8_weights",
        Kind::Switch,
        "Keep frozen base weights as FP8 + scale (needs `--precision fp8`).",
    ),
    flag(
        "fp8-weights-one-layout",
        "precision.fp8_weights_one_layout",
        Kind::Switch,
        "With `--fp8-weights` on CUDA: one layout, transposed for each backward GEMM.",
    ),
    flag("adapter-compute", "precision.adapter_compute", Kind::Word, "The LoRA adapters' GEMMs: auto, fp32 or bf16."),
];

/// The config keys the command line set through [`FLAGS`], in the table's order.
#[derive(Debug, Clone, Default)]
pub struct KeyFlags(pub Vec<(&'static Flag, Override)>);

/// The peer recipe's value of `key`, for the help text (the recipe parsed once, the first
/// time a command line is built).
fn recipe_value(key: &str) -> Option<String> {
    static RECIPE: std::sync::OnceLock<Option<toml::Value>> = std::sync::OnceLock::new();
    let value = RECIPE.get_or_init(|| {
        let config = Config::parse("the peer recipe", PEER_RECIPE, &[]).ok()?;
        toml::Value::try_from(&config).ok()
    });
    let found = key.split('.').try_fold(value.as_ref()?, |v, part| v.get(part))?;
    Some(match found {
        toml::Value::String(s) => s.clone(),
        toml::Value::Array(items) => items.iter().filter_map(|i| i.as_str()).collect::<Vec<_>>().join(","),
        other => other.to_string(),
    })
}

impl clap::Args for KeyFlags {
    fn augment_args(cmd: Command) -> Command {
        FLAGS.iter().fold(cmd, |cmd, f| {
            let help = match (f.kind, recipe_value(f.key)) {
                (Kind::Switch, _) | (_, None) => format!("{} (config key `{}`)", f.help, f.key),
                (_, Some(v)) => format!("{} (config key `{}`) [default: {v}]", f.help, f.key),
            };
            let arg = Arg::new(f.long).long(f.long).help(help);
            cmd.arg(match f.kind {
                Kind::Switch => arg.action(ArgAction::SetTrue),
                Kind::Count => arg.value_name("N").value_parser(clap::value_parser!(u64)),
                Kind::Number => arg.value_name("NUMBER").value_parser(clap::value_parser!(f64)),
                Kind::Word => arg.value_name("WORD"),
            })
        })
    }

    fn augment_args_for_update(cmd: Command) -> Command {
        Self::augment_args(cmd)
    }
}

impl clap::FromArgMatches for KeyFlags {
    fn from_arg_matches(m: &ArgMatches) -> Result<Self, clap::Error> {
        let mut set = Vec::new();
        for f in FLAGS {
            let value = match f.kind {
                Kind::Switch => m.get_flag(f.long).then_some(toml::Value::Boolean(true)),
                Kind::Count => m.get_one::<u64>(f.long).map(|&n| count(n)).transpose()?,
                Kind::Number => m.get_one::<f64>(f.long).map(|&x| toml::Value::Float(x)),
                Kind::Word => m.get_one::<String>(f.long).map(|s| toml::Value::String(s.clone())),
            };
            if let Some(value) = value {
                set.push((f, Override { key: f.key.to_string(), value }));
            }
        }
        Ok(Self(set))
    }

    fn update_from_arg_matches(&mut self, m: &ArgMatches) -> Result<(), clap::Error> {
        *self = Self::from_arg_matches(m)?;
        Ok(())
    }
}

/// A count as TOML's integer (at most `i64::MAX`).
fn count(n: u64) -> Result<toml::Value, clap::Error> {
    i64::try_from(n).map(toml::Value::Integer).map_err(|_| {
        clap::Error::raw(
            clap::error::ErrorKind::ValueValidation,
            format!("{n} is out of range (at most {})\n", i64::MAX),
        )
    })
}

/// The bench's config: the peer's recipe, then the flags' keys, then `extra` (the NF4 flags'
/// and `--set`'s), with `accum` micro-batches per step; every problem named by the flag that set
/// its key (or the key).
pub fn config(flags: &KeyFlags, extra: &[Override], accum: usize) -> anyhow::Result<Config> {
    refuse_keys_the_bench_does_not_read(extra)?;
    let overrides: Vec<Override> = flags.0.iter().map(|(_, o)| o.clone()).chain(extra.iter().cloned()).collect();
    let name = "llora bench";
    let by_flag = |lines: Vec<String>| {
        let lines: Vec<String> = lines.iter().map(|l| named_by_flags(l, flags)).collect();
        anyhow::anyhow!("invalid llora bench settings:\n  - {}", lines.join("\n  - "))
    };
    let mut config = Config::from_toml_str(name, PEER_RECIPE, &overrides).map_err(|e| by_flag(e.problems))?;
    // A checkpoint (`--set model.path=DIR`) is the model: the recipe's preset would only check
    // it, unless `--preset` asked for that.
    if config.model.path.is_some() && !flags.0.iter().any(|(f, _)| f.key == "model.preset") {
        config.model.preset = None;
    }
    // One rank's step; the launcher's data-parallel groups multiply it (checked at start-up).
    config.train.global_batch_size = config.train.micro_batch_size.max(1).saturating_mul(accum.max(1));
    config.validate().map_err(by_flag)?;
    Ok(config)
}

/// Keys `--set` may name that the bench has no use for, with what to do instead: it draws
/// random tokens (no corpus) and measures one rank's step of `--accum` micro-batches.
const NOT_READ_BY_THE_BENCH: &[(&str, &str)] = &[
    ("data.train", "the bench draws random tokens of --seq-len: it reads no corpus (drop this key)"),
    ("data.eval", "the bench draws random tokens of --seq-len: it reads no corpus (drop this key)"),
    ("data.synthetic", "the bench draws random tokens of --seq-len: it reads no corpus (drop this key)"),
    (
        "train.global_batch_size",
        "the bench times one rank's step of --accum micro-batches of --batch sequences: set those instead",
    ),
];

/// Refuses `--set` keys the bench would ignore, by key.
fn refuse_keys_the_bench_does_not_read(extra: &[Override]) -> anyhow::Result<()> {
    let lines: Vec<String> = extra
        .iter()
        .filter_map(|o| {
            let (key, why) =
                NOT_READ_BY_THE_BENCH.iter().find(|(k, _)| o.key == *k || o.key.starts_with(&format!("{k}.")))?;
            Some(format!("config key `{}` (from --set): {why} [{key}]", o.key))
        })
        .collect();
    anyhow::ensure!(lines.is_empty(), "invalid llora bench settings:\n  - {}", lines.join("\n  - "));
    Ok(())
}

/// `line` with each key a flag set written as that flag (`--lora-r` for `lora.rank`).
fn named_by_flags(line: &str, flags: &KeyFlags) -> String {
    let mut sorted: Vec<&Flag> = flags.0.iter().map(|(f, _)| *f).collect();
    // A key before any key it begins (`fp8_weights_one_layout` before `fp8_weights`).
    sorted.sort_by_key(|f| std::cmp::Reverse(f.key.len()));
    sorted.iter().fold(line.to_string(), |text, f| {
        let long = format!("--{}", f.long);
        text.replace(&format!("config key `{}` (from --set)", f.key), &format!("`{long}`"))
            .replace(&format!("config key `{}`", f.key), &format!("`{long}`"))
            .replace(f.key, &long)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{CommandFactory, FromArgMatches, Parser};

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        keys: KeyFlags,
    }

    fn parse(args: &[&str]) -> KeyFlags {
        let m = Cli::command().try_get_matches_from([&["bench"], args].concat()).unwrap();
        Cli::from_arg_matches(&m).unwrap().keys
    }

    /// The config's value of `key`.
    fn value_of(config: &Config, key: &str) -> toml::Value {
        let value = toml::Value::try_from(config).unwrap();
        key.split('.').try_fold(value, |v, part| v.get(part).cloned()).unwrap_or(toml::Value::Boolean(false))
    }

    /// Every flag sets the key it names, to the value given, as that key's type.
    #[test]
    fn every_flag_sets_its_key() {
        let recipe = Config::parse("t", PEER_RECIPE, &[]).unwrap();
        for f in FLAGS {
            let long = format!("--{}", f.long);
            let word = match f.long {
                "preset" => "small",
                "targets" => "v_proj",
                "device" => "flex",
                _ => "bf16",
            };
            let value = match f.kind {
                Kind::Switch => None,
                Kind::Count => Some("3"),
                Kind::Number => Some("0.5"),
                Kind::Word => Some(word),
            };
            let flags = parse(&[&[long.as_str()][..], value.as_slice()].concat());
            assert_eq!(flags.0.len(), 1, "{long}");
            let got = Config::from_toml_str("t", PEER_RECIPE, &[flags.0[0].1.clone()])
                .unwrap_or_else(|e| panic!("{long}: {:?}", e.problems));
            assert_ne!(value_of(&got, f.key), value_of(&recipe, f.key), "{long} left {} as it was", f.key);
        }
    }

    /// The recipe is the peer's, as `scripts/peer/step_bench.py` writes it.
    #[test]
    fn the_recipe_is_the_peers() {
        let c = Config::parse("t", PEER_RECIPE, &[]).unwrap();
        assert_eq!((c.lora.rank, c.lora.alpha, c.lora.dropout), (16, 32.0, 0.1));
        assert_eq!(c.lora.targets, ["q_proj", "k_proj", "v_proj", "o_proj"]);
        assert_eq!((c.optim.lr, c.optim.weight_decay, c.optim.clip_grad_norm), (4e-4, 1e-4, 0.3));
        assert_eq!((c.data.max_seq_len, c.train.micro_batch_size, c.run.threads, c.run.seed), (512, 1, 2, 1234));
    }

    #[test]
    fn flags_set_their_keys_and_problems_name_the_flag() {
        let flags = parse(&["--lora-r", "8", "--fp8-activations", "--targets", "q_proj,v_proj", "--lr", "1e-3"]);
        let c = config(&flags, &[], 2).unwrap();
        assert_eq!(
            (c.lora.rank, c.optim.lr, c.lora.targets.clone()),
            (8, 1e-3, vec!["q_proj".into(), "v_proj".into()])
        );
        assert!(c.precision.fp8_activations && !c.precision.fp8_weights);
        assert_eq!(c.train.global_batch_size, 2);
        let err = config(&parse(&["--lora-r", "0"]), &[], 1).unwrap_err().to_string();
        assert!(err.contains("`--lora-r` = 0"), "{err}");
        let err = config(&parse(&["--precision", "fp9"]), &[], 1).unwrap_err().to_string();
        assert!(err.contains("`--precision`") && err.contains("fp9"), "{err}");
        // A key set by --set keeps its config name.
        let set: Override = "lora.rank=0".parse().unwrap();
        let err = config(&parse(&[]), &[set], 1).unwrap_err().to_string();
        assert!(err.contains("config key `lora.rank` = 0"), "{err}");
    }

    /// Keys the bench has no use for are refused by key with what to set instead (the global
    /// batch was ignored; a corpus was refused naming `data.synthetic`).
    #[test]
    fn keys_the_bench_would_ignore_are_refused_by_key() {
        for (set, want) in [
            ("train.global_batch_size=8", "--accum"),
            ("data.train=\"x.parquet\"", "reads no corpus"),
            ("data.synthetic.train_samples=4", "reads no corpus"),
        ] {
            let key = set.split('=').next().unwrap();
            let err = config(&parse(&[]), &[set.parse().unwrap()], 1).unwrap_err().to_string();
            assert!(err.contains(&format!("`{key}`")) && err.contains(want), "{set}: {err}");
        }
        config(&parse(&[]), &["data.max_seq_len=64".parse().unwrap()], 1).unwrap();
    }
}
