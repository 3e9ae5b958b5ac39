//! Fuzz harness: proptest over config values, the file parsers (HF config.json,
//! safetensors headers and index, parquet, adapter_config.json), every command's flags (now
//! and then with standard output a closed pipe), LoRA pattern keys and repeated signals,
//! asserting no panic, no hang past a bound, and no success on input that is invalid by
//! construction. Cases run from a fixed seed so that CI is repeatable; `LLORA_FUZZ_SEED=N`
//! and `LLORA_FUZZ_CASES=N` explore further (a failure prints the input it found).

use crate::common;
use std::path::Path;
use std::time::{Duration, Instant};

use llora_data::parquet_io::{OnBadRow, ReadOptions, parquet_bytes, read_parquet};
use llora_model::checkpoint::{HfCheckpoint, read_safetensors_f32, safetensors_bytes};
use llora_model::config::LlamaConfig;
use llora_model::peft::read_peft_config;
use llora_trainer::config::{Config, Override};
use proptest::prelude::*;
use proptest::test_runner::{Config as Runner, RngSeed};

/// The runner: `cases` (times `LLORA_FUZZ_CASES / 100` when set) from the fixed seed.
fn runner(cases: u32) -> Runner {
    let env = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<u64>().ok());
    Runner {
        cases: env("LLORA_FUZZ_CASES").map_or(cases, |pct| (u64::from(cases) * pct / 100).max(1) as u32),
        rng_seed: RngSeed::Fixed(env("LLORA_FUZZ_SEED").unwrap_or(29)),
        failure_persistence: None,
        ..Runner::default()
    }
}

/// Counts the cases a property accepted: a positive control, so that a parser that refused
/// everything (and so never reached the assertions under `Ok`) fails the test.
#[derive(Default)]
struct Accepted(std::sync::atomic::AtomicUsize);

impl Accepted {
    fn one(&self) {
        self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// Fails unless at least one case reached `Ok`.
    fn assert_some(&self, what: &str) {
        let n = self.0.load(std::sync::atomic::Ordering::Relaxed);
        assert!(n > 0, "{what}: no case was accepted, so the properties under Ok never ran");
        eprintln!("{what}: {n} cases accepted");
    }
}

/// Values a hostile user types: numbers at and past every edge, non-numbers, paths, lists.
fn hostile_value() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("0".to_string()),
        Just("-1".to_string()),
        Just("NaN".to_string()),
        Just("inf".to_string()),
        Just("-inf".to_string()),
        Just("1e400".to_string()),
        Just("1e-46".to_string()),
        Just("18446744073709551616".to_string()),
        Just("\"\"".to_string()),
        Just("[]".to_string()),
        Just("true".to_string()),
        Just("\"../../etc/passwd\"".to_string()),
        "[0-9]{1,3}",
        "[0-9]{12,22}",
        "-?[0-9]{1,4}\\.[0-9]{1,4}(e-?[0-9]{1,3})?",
        "[a-z_:/]{1,10}",
        // A list whose strings a shell unquoted.
        "\\[[a-z_]{1,6}(,[a-z_]{1,6}){0,2}\\]",
    ]
}

/// Every dotted key of the embedded config.
fn config_keys() -> Vec<String> {
    fn flatten(prefix: &str, v: &toml::Value, out: &mut Vec<String>) {
        match v {
            toml::Value::Table(t) => {
                for (k, v) in t {
                    flatten(&if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") }, v, out);
                }
            }
            _ => out.push(prefix.to_string()),
        }
    }
    let text = Config::load(None, &[]).unwrap().to_toml();
    let mut keys = Vec::new();
    flatten("", &toml::from_str(&text).unwrap(), &mut keys);
    keys
}

/// Any override of any config key: parsing never panics; what it accepts shows back as the
/// same config; a negative count is never accepted; an integer past i64 and a list whose
/// strings lost their quotes are refused naming the fix.
#[test]
fn config_overrides() {
    let keys = config_keys();
    let defaults: toml::Table = toml::from_str(&Config::load(None, &[]).unwrap().to_toml()).unwrap();
    // Positive control: a plain valid override is accepted.
    assert!(Config::load(None, &["optim.lr=1e-4".parse::<Override>().unwrap()]).is_ok());
    let accepted = Accepted::default();
    proptest!(runner(400), |(key in prop::sample::select(keys.clone()), value in hostile_value(), garbage in prop::bool::weighted(0.05))| {
        let key = if garbage { format!("{key}.x") } else { key };
        let parsed = format!("{key}={value}").parse::<Override>();
        // An integer past i64 and an unquoted list are refused saying how to write them.
        if value.len() >= 20 && value.bytes().all(|b| b.is_ascii_digit()) {
            prop_assert!(parsed.as_ref().is_err_and(|e| e.contains("out of range")), "{key}={value}: {parsed:?}");
        }
        if value.starts_with('[') && value.contains(|c: char| c.is_ascii_lowercase()) {
            prop_assert!(parsed.as_ref().is_err_and(|e| e.contains("quotes")), "{key}={value}: {parsed:?}");
        }
        let Ok(o) = parsed else { return Ok(()) };
        let parsed = Config::load(None, &[o]);
        if let Ok(c) = &parsed {
            accepted.one();
            let again = Config::parse("shown", &c.to_toml(), &[]);
            prop_assert!(again.as_ref().is_ok_and(|a| a == c), "{key}={value}: shown config does not parse back: {again:?}");
            let default = key.split('.').try_fold(toml::Value::Table(defaults.clone()), |v, k| v.get(k).cloned());
            let was_count = default.is_some_and(|v| v.as_integer().is_some_and(|i| i >= 0));
            prop_assert!(!(was_count && value.starts_with('-') && value.parse::<i64>().is_ok()), "{key}={value} accepted");
        }
    });
    accepted.assert_some("config overrides");
}

/// A valid `config.json` of a small Llama.
fn hf_config() -> serde_json::Value {
    serde_json::from_str(&LlamaConfig::demo().to_hf_json()).unwrap()
}

/// JSON values for a field of a parsed file.
fn hostile_json() -> impl Strategy<Value = serde_json::Value> {
    use serde_json::json;
    prop_oneof![
        Just(json!(null)),
        Just(json!(0)),
        Just(json!(-1)),
        Just(json!(1e300)),
        Just(json!(u64::MAX)),
        Just(json!("")),
        Just(json!("llama3")),
        Just(json!([])),
        Just(json!({})),
        Just(json!({"rope_type": "yarn", "factor": 8.0})),
        Just(json!(true)),
        (0i64..100_000).prop_map(|n| json!(n)),
        (-1e6f64..1e6).prop_map(|x| json!(x)),
    ]
}

/// `config.json` (Llama's, and a Qwen 2's with its window keys) with one field replaced or
/// removed: parsing never panics, what it accepts is a consistent model (the model's own
/// check passes, the head count divides the width), and a value of the wrong type is refused
/// naming its key (`"sliding_window": "8"` said only "invalid type: string, expected usize").
#[test]
fn hf_config_json() {
    let mut qwen = hf_config();
    for (k, v) in [
        ("model_type", "\"qwen2\""),
        ("use_sliding_window", "true"),
        ("sliding_window", "8"),
        ("max_window_layers", "2"),
    ] {
        qwen[k] = serde_json::from_str(v).unwrap();
    }
    let configs = vec![hf_config(), qwen.clone()];
    let extra = ["rope_scaling", "head_dim", "attention_bias", "mlp_bias", "layer_types", "rope_parameters"];
    let fields: Vec<String> = qwen.as_object().unwrap().keys().cloned().chain(extra.map(String::from)).collect();
    for c in &configs {
        assert!(LlamaConfig::from_hf_json(&c.to_string()).is_ok(), "the unmutated config.json {c}");
    }
    let (accepted, typed) = (Accepted::default(), Accepted::default());
    proptest!(runner(400), |(which in 0..2usize, field in prop::sample::select(fields), value in hostile_json(), remove in prop::bool::weighted(0.2))| {
        let mut json = configs[which].clone();
        let obj = json.as_object_mut().unwrap();
        if remove { obj.remove(&field); } else { obj.insert(field.clone(), value.clone()); }
        match LlamaConfig::from_hf_json(&json.to_string()) {
            Ok(c) => {
                accepted.one();
                prop_assert!(c.check().is_ok(), "{field} = {value}: accepted an inconsistent model {c:?}");
                prop_assert!(c.num_attention_heads > 0 && c.num_key_value_heads > 0 && c.num_attention_heads % c.num_key_value_heads == 0);
            }
            Err(e) => {
                let e = format!("{e:#}");
                if e.contains("invalid type") {
                    typed.one();
                    prop_assert!(e.contains(&format!("`{field}`")), "{field} = {value}: the key is not named: {e}");
                }
            }
        }
    });
    accepted.assert_some("config.json");
    typed.assert_some("config.json type errors");
}

/// Bytes of a valid file with one of the mutations a damaged download shows.
fn mutated(valid: Vec<u8>) -> impl Strategy<Value = Vec<u8>> {
    let n = valid.len();
    prop_oneof![
        (0..n).prop_map({
            let v = valid.clone();
            move |cut| v[..cut].to_vec()
        }),
        (0..n, any::<u8>()).prop_map({
            let v = valid.clone();
            move |(at, b)| {
                let mut v = v.clone();
                v[at] ^= b | 1;
                v
            }
        }),
        any::<u64>().prop_map({
            let v = valid.clone();
            move |len| {
                let mut v = v.clone();
                v[..8].copy_from_slice(&len.to_le_bytes());
                v
            }
        }),
        (8..n.min(200), "[ -~]{1,20}").prop_map({
            let v = valid;
            move |(at, s)| {
                let mut v = v.clone();
                let end = (at + s.len()).min(v.len());
                v.splice(at..end, s.bytes());
                v
            }
        }),
    ]
}

/// A damaged `model.safetensors` (and the same bytes read as an adapter or a resume file):
/// never a panic; a checkpoint that opens has every tensor the index promises.
#[test]
fn safetensors_files() {
    let valid = safetensors_bytes(&[
        ("model.embed_tokens.weight".into(), vec![4, 2], vec![0.5; 8]),
        ("model.norm.weight".into(), vec![2], vec![1.0; 2]),
    ])
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config.json"), LlamaConfig::demo().to_hf_json()).unwrap();
    let file = dir.path().join("model.safetensors");
    std::fs::write(&file, &valid).unwrap();
    assert!(read_safetensors_f32(&file).is_ok() && HfCheckpoint::open(dir.path()).is_ok(), "the unmutated file");
    let accepted = Accepted::default();
    proptest!(runner(300), |(bytes in mutated(valid.clone()))| {
        std::fs::write(&file, &bytes).unwrap();
        let _ = read_safetensors_f32(&file);
        if let Ok(ckpt) = HfCheckpoint::open(dir.path()) {
            accepted.one();
            let _ = ckpt.read("model.norm.weight", &[2]);
        }
    });
    accepted.assert_some("safetensors");
}

/// `model.safetensors.index.json` naming any file, inside or outside the directory: never a
/// panic, and nothing outside the model directory is ever opened.
#[test]
fn shard_index() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("model");
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("config.json"), LlamaConfig::demo().to_hf_json()).unwrap();
    let shard = safetensors_bytes(&[("model.norm.weight".into(), vec![2], vec![1.0; 2])]).unwrap();
    std::fs::write(dir.join("a.safetensors"), &shard).unwrap();
    std::fs::write(root.path().join("outside.safetensors"), &shard).unwrap();
    std::os::unix::fs::symlink(root.path().join("outside.safetensors"), dir.join("link.safetensors")).unwrap();
    let names = [
        "a.safetensors",
        "../outside.safetensors",
        "link.safetensors",
        "./a.safetensors",
        "sub/../a.safetensors",
        "missing.safetensors",
        "",
        "/etc/passwd",
        ".",
        "..",
    ];
    proptest!(runner(200), |(picks in prop::collection::vec(prop::sample::select(names.to_vec()), 1..3), raw in prop::bool::weighted(0.1), text in "[ -~]{0,40}")| {
        let map: serde_json::Map<String, serde_json::Value> = picks.iter().enumerate()
            .map(|(i, f)| (if i == 0 { "model.norm.weight".to_string() } else { format!("t{i}") }, serde_json::json!(f)))
            .collect();
        let index = if raw { text.clone() } else { serde_json::json!({"weight_map": map}).to_string() };
        std::fs::write(dir.join("model.safetensors.index.json"), &index).unwrap();
        match HfCheckpoint::open(&dir) {
            Ok(_) => prop_assert!(
                !raw && picks.iter().all(|f| !["../outside.safetensors", "link.safetensors", "/etc/passwd", "missing.safetensors", "", ".", ".."].contains(f)),
                "{index} opened"
            ),
            Err(e) => prop_assert!(!format!("{e:#}").contains("panicked"), "{e:#}"),
        }
    });
}

/// Damaged parquet files and rows with any ids: never a panic; rows read with `OnBadRow::Error`
/// are all valid for the vocabulary and length.
#[test]
fn parquet_files() {
    let rows: Vec<llora_data::Sample> = (0..6)
        .map(|i| llora_data::Sample { input_ids: vec![1, 2, 3 + i], labels: vec![-100, 2, 3 + i as i64] })
        .collect();
    let valid = parquet_bytes(&rows).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("t.parquet");
    let opts = ReadOptions { vocab: 16, max_seq_len: 8, on_bad_row: OnBadRow::Error };
    std::fs::write(&file, &valid).unwrap();
    assert_eq!(read_parquet(&file, &opts).map(|(r, _)| r.len()).ok(), Some(6), "the unmutated file");
    let accepted = Accepted::default();
    proptest!(runner(300), |(bytes in mutated(valid.clone()))| {
        std::fs::write(&file, &bytes).unwrap();
        if let Ok((read, _)) = read_parquet(&file, &opts) {
            accepted.one();
            for s in &read {
                prop_assert!(s.input_ids.len() <= 8 && s.input_ids.len() == s.labels.len());
                prop_assert!(s.input_ids.iter().all(|&t| (t as usize) < 16));
            }
        }
    });
    accepted.assert_some("parquet");
}

/// `adapter_config.json` with one field replaced or removed: never a panic; an accepted one has
/// a rank ≥ 1, a finite alpha and at least one target.
#[test]
fn adapter_config_json() {
    let valid = serde_json::json!({
        "peft_type": "LORA", "r": 16, "lora_alpha": 32, "lora_dropout": 0.1, "bias": "none",
        "target_modules": ["q_proj", "v_proj"], "base_model_name_or_path": "base", "task_type": "CAUSAL_LM",
        "alpha_pattern": {}, "rank_pattern": {}, "layers_to_transform": null, "use_dora": false,
    });
    let fields: Vec<String> = valid.as_object().unwrap().keys().cloned().collect();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("adapter_config.json"), valid.to_string()).unwrap();
    assert!(read_peft_config(dir.path()).is_ok(), "the unmutated adapter_config.json");
    let accepted = Accepted::default();
    proptest!(runner(300), |(field in prop::sample::select(fields), value in hostile_json(), remove in prop::bool::weighted(0.2))| {
        let mut json = valid.clone();
        let obj = json.as_object_mut().unwrap();
        if remove { obj.remove(&field); } else { obj.insert(field.clone(), value.clone()); }
        std::fs::write(dir.path().join("adapter_config.json"), json.to_string()).unwrap();
        if let Ok(spec) = read_peft_config(dir.path()).map(|c| c.spec) {
            accepted.one();
            prop_assert!(spec.rank >= 1 && spec.alpha.is_finite() && !spec.targets.is_empty(), "{field} = {value}: {spec:?}");
        }
    });
    accepted.assert_some("adapter_config.json");
}

/// Runs the binary with `args` and a deadline: it must end by itself, with llora's error exit
/// (1), clap's usage exit (2) or success, and without a panic or C++ frames. With
/// `closed_stdout` its standard output is a pipe whose reader is gone (`llora ... | head -c0`):
/// every write fails with EPIPE, which must end nothing badly either.
fn run_bounded(dir: &Path, args: &[String], closed_stdout: bool) -> Result<i32, String> {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let stdout = if closed_stdout { std::process::Stdio::piped() } else { std::process::Stdio::null() };
    let mut child = common::llora_command(dir, &args)
        .stdout(stdout)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| e.to_string())?;
    drop(child.stdout.take());
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().map_err(|e| e.to_string())? {
            break s;
        }
        if start.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            return Err(format!("{args:?} still running after 30 s"));
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut stderr).ok();
    let code = status.code().ok_or_else(|| format!("{args:?} killed by a signal: {stderr}"))?;
    if ![0, 1, 2].contains(&code) || stderr.contains("panicked") || stderr.contains("frame #") {
        return Err(format!("{args:?} exit {code}: {stderr}"));
    }
    Ok(code)
}

/// Every command with hostile flag values (numbers past every edge, non-numbers, paths that do
/// not exist), its standard output now and then a closed pipe: each ends within a minute,
/// exit 0, 1 or 2, no panic; `--threads`, `--workers`, `--batch-size` of 0 or absurd sizes are
/// never accepted.
#[test]
fn command_flags() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap().to_string();
    // Each command line a flag is fuzzed on, with valid values for the others.
    let eval = format!("eval --model {d}/none --data {d}/none.parquet");
    let synth = format!("data synth --out {d}/synth --overwrite --eval 1");
    let generate = format!("generate --model {d}/none --tokenizer {d}/none --prompt hi");
    let prepare = format!("data prepare --input {d}/none.jsonl --tokenizer {d}/none --out {d}/out.parquet");
    let templates: Vec<(&str, String)> = vec![
        ("--set", "plan".into()),
        ("--set", "config show".into()),
        ("--device-memory", "plan configs/llama2-70b-mlperf.toml".into()),
        ("--world", "plan configs/llama2-70b-mlperf.toml".into()),
        ("--batch-size", eval.clone()),
        ("--max-seq-len", eval.clone()),
        ("--threads", eval),
        ("--vocab", format!("data inspect {d}/none.parquet")),
        ("--train", format!("{synth} --max-seq-len 128 --vocab 512")),
        ("--vocab", format!("{synth} --train 2 --max-seq-len 128")),
        ("--max-seq-len", format!("{synth} --train 2")),
        ("--topics", format!("{synth} --train 2 --max-seq-len 128 --vocab 512")),
        ("--steps", "bench --preset tiny --seq-len 16 --warmup 0".into()),
        ("--max-new-tokens", generate.clone()),
        ("--temperature", generate.clone()),
        ("--top-p", generate.clone()),
        ("--threads", generate),
        ("--format", prepare.clone()),
        ("--max-seq-len", format!("{prepare} --format chat")),
        ("--seq-len", "bench --preset tiny --steps 1 --warmup 0".into()),
    ];
    let keys = config_keys();
    // A failing case reruns while shrinking, each up to the deadline: a few are enough.
    proptest!(Runner { max_shrink_iters: 8, ..runner(40) }, |(t in 0..templates.len(), value in hostile_value(), key in prop::sample::select(keys), closed in prop::bool::weighted(0.3))| {
        let (flag, base) = &templates[t];
        let mut args: Vec<String> = base.split_whitespace().map(String::from).collect();
        let v = value.trim_matches('"').to_string();
        // bench runs for real when its flags are valid (10^15 steps is a valid, long request):
        // valid values become small ones.
        let small = match *flag { "--seq-len" => Some("16"), "--steps" => Some("1"), _ => None };
        let v = match small {
            Some(s) if v.parse::<u64>().is_ok_and(|n| n >= 1) => s.to_string(),
            _ => v,
        };
        if *flag == "--set" { args.extend(["--set".into(), format!("{key}={value}")]); } else { args.extend([flag.to_string(), v.clone()]); }
        eprintln!("fuzz: llora {}", args.join(" "));
        let code = run_bounded(dir.path(), &args, closed);
        prop_assert!(code.is_ok(), "{}", code.unwrap_err());
        if ["--threads", "--batch-size", "--max-new-tokens"].contains(flag) && (v == "0" || v.len() > 10) {
            prop_assert!(code.unwrap() != 0, "{args:?} accepted");
        }
    });
}

/// Pattern keys a hostile (or careless) user writes: module names in other cases, typos,
/// suffixes that end no name at a dot, layer paths past the model, regular expressions good
/// and broken, empty keys.
fn pattern_key() -> impl Strategy<Value = String> {
    prop_oneof![
        prop::sample::select(vec![
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
            "qkv_proj"
        ])
        .prop_map(String::from),
        Just("Q_PROJ".to_string()),
        Just("v_prj".to_string()),
        Just("proj".to_string()),
        Just("_proj".to_string()),
        Just(String::new()),
        Just(".*".to_string()),
        Just("[".to_string()),
        Just("self_attn.q_proj".to_string()),
        Just(r"layers\.[0-1]\..*".to_string()),
        Just(r"layers\.[5-9]\..*".to_string()),
        (0usize..4, prop::sample::select(vec!["self_attn.q_proj", "self_attn.v_proj", "mlp.up_proj"]))
            .prop_map(|(l, m)| format!("layers.{l}.{m}")),
        "[a-z_.]{1,12}",
    ]
}

/// PEFT's rule for a pattern key, written here from its `get_pattern_key`
/// (`re.match(rf"(.*\.)?({key})$", name)`), independently of `patterns.rs`.
fn peft_key_matches(key: &str, name: &str) -> bool {
    regex::Regex::new(&format!(r"^(?:.*\.)?(?:{key})$")).is_ok_and(|r| r.is_match(name))
}

/// `rank_pattern` / `alpha_pattern` with hostile keys and values, built on a 2-layer `demo`
/// (d 128, KV width 64): never a panic; a model that builds has every key matching an adapted
/// module by PEFT's rule, each adapter's rank what the matching key says (or `lora.rank`), no
/// rank above its module's smaller dimension, and finite positive scales (pattern keys).
#[test]
#[allow(deprecated)] // Device::libtorch: burn-tch is deprecated upstream, and it is our backend.
fn pattern_keys() {
    use burn::tensor::Device;
    use llora_model::LoraSpec;
    use llora_model::llama::{BuildOptions, LlamaForCausalLM};
    let config = LlamaConfig { num_hidden_layers: 2, ..LlamaConfig::demo() };
    let device = Device::libtorch();
    let build = |spec: &LoraSpec| {
        let problems = spec.problems();
        if !problems.is_empty() {
            return Err(anyhow::anyhow!("{problems:?}"));
        }
        LlamaForCausalLM::random(&config, &BuildOptions { lora: Some(spec), ..Default::default() }, &device)
    };
    let base =
        LoraSpec { rank: 4, targets: vec!["q_proj".into(), "v_proj".into(), "up_proj".into()], ..LoraSpec::default() };
    // Positive control: keys that each match an adapted module are accepted and applied.
    let control = LoraSpec {
        rank_pattern: vec![("v_proj".into(), 8)],
        alpha_pattern: vec![("layers.1.mlp.up_proj".into(), 3.0)],
        ..base.clone()
    };
    let model = build(&control).expect("the control spec");
    let v0 = model.layers[0].linear(llora_model::BlockLinear::V).unwrap();
    assert_eq!(v0.lora.as_ref().unwrap().a.val().dims(), [8, 128]);
    let ranks = prop_oneof![Just(0usize), Just(1), Just(8), Just(64), Just(65), Just(129), Just(100_000), 1usize..200];
    let alphas = prop_oneof![Just(0.0f64), Just(-1.0), Just(f64::NAN), Just(f64::INFINITY), Just(1e300), 0.5f64..64.0];
    let accepted = Accepted::default();
    let cases =
        (prop::collection::vec((pattern_key(), ranks), 0..3), prop::collection::vec((pattern_key(), alphas), 0..3));
    proptest!(runner(200), |((rank_pattern, alpha_pattern) in cases)| {
        let spec = LoraSpec { rank_pattern: rank_pattern.clone(), alpha_pattern: alpha_pattern.clone(), ..base.clone() };
        let Ok(model) = build(&spec) else { return Ok(()) };
        accepted.one();
        let mut adapted = Vec::new();
        for (l, layer) in model.layers.iter().enumerate() {
            for (kind, linear) in layer.linears() {
                let Some(adapter) = &linear.lora else { continue };
                let name = kind.path(l);
                let [r, inp] = adapter.a.val().dims();
                let out = adapter.b.val().dims()[0];
                let want = rank_pattern.iter().find(|(k, _)| peft_key_matches(k, &name)).map_or(base.rank, |(_, r)| *r);
                prop_assert_eq!(r, want, "{} got rank {}, its key says {}", name, r, want);
                prop_assert!(r <= out.min(inp), "{name}: rank {r} on {out} x {inp}");
                prop_assert!(adapter.scale.is_finite() && adapter.scale > 0.0, "{name}: scale {}", adapter.scale);
                adapted.push(name);
            }
        }
        for (key, _) in rank_pattern.iter().map(|(k, _)| (k, ())).chain(alpha_pattern.iter().map(|(k, _)| (k, ()))) {
            prop_assert!(adapted.iter().any(|m| peft_key_matches(key, m)), "key {key:?} sets nothing and was accepted");
        }
    });
    accepted.assert_some("pattern keys");
}

/// Training sent SIGINT or SIGTERM one to three times, at random gaps after its second step
/// (so that later signals land in the step, the checkpoint write or the exit): never a silent
/// loss. One or two signals end 130 with a checkpoint and the resume hint; a third may take
/// the hard exit, 131, saying the checkpoint was not written (signals twice).
#[test]
fn repeated_signals() {
    let dir = tempfile::tempdir().unwrap();
    let config = common::random_base_config(dir.path());
    let n = std::sync::atomic::AtomicUsize::new(0);
    let gaps = prop::collection::vec(0u64..400, 0..3);
    proptest!(Runner { max_shrink_iters: 2, ..runner(5) }, |(signal in prop::sample::select(vec!["INT", "TERM"]), gaps in gaps)| {
        let run = dir.path().join(format!("run-{}", n.fetch_add(1, std::sync::atomic::Ordering::Relaxed)));
        let mut args = common::short_run_args(&config, &run);
        args.extend(["--set".into(), "schedule.max_steps=1000".into()]);
        let gaps: Vec<Duration> = gaps.iter().map(|&ms| Duration::from_millis(ms)).collect();
        eprintln!("fuzz: SIG{signal} then {} more after {gaps:?}", gaps.len());
        let out = common::signals_after_steps(&args, &run, signal, &gaps);
        let stderr = String::from_utf8_lossy(&out.stderr);
        let checkpoint = common::newest_checkpoint(&run).is_some();
        match out.status.code() {
            Some(130) => prop_assert!(checkpoint && stderr.contains("llora train --resume"), "130 without a checkpoint: {stderr}"),
            Some(131) => prop_assert!(gaps.len() == 2 && stderr.contains("without the checkpoint"), "131: {stderr}"),
            other => prop_assert!(false, "exit {other:?} after {} signals: {stderr}", gaps.len() + 1),
        }
    });
}

/// Two ranks of one job with the launcher's variables, `args_of(rank)` each; kills rank
/// `kill.0` after `kill.1` when asked. Returns each rank's (exit code, stderr), failing on a
/// rank still running after `limit` (a hang), a signal other than the one sent, a panic or C++
/// frames.
fn two_ranks(
    dir: &Path,
    args_of: impl Fn(usize) -> Vec<String>,
    kill: Option<(usize, Duration)>,
    limit: Duration,
) -> Result<Vec<(Option<i32>, String)>, String> {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string();
    let mut children = Vec::new();
    for rank in 0..2 {
        let args = args_of(rank);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let child = common::llora_command(dir, &args)
            .envs([("RANK", rank.to_string()), ("LOCAL_RANK", rank.to_string())])
            .envs([("WORLD_SIZE", "2"), ("LOCAL_WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1")])
            .env("MASTER_PORT", &port)
            .env("OMP_WAIT_POLICY", "PASSIVE")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .map_err(|e| e.to_string())?;
        children.push(child);
    }
    let start = Instant::now();
    let mut killed = false;
    while children.iter_mut().any(|c| c.try_wait().ok().flatten().is_none()) {
        if let Some((victim, after)) = kill
            && !killed
            && start.elapsed() >= after
        {
            let _ = children[victim].kill();
            killed = true;
        }
        if start.elapsed() > limit {
            children.iter_mut().for_each(|c| drop(c.kill()));
            return Err(format!("a rank still running after {limit:?}"));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut out = Vec::new();
    for (rank, child) in children.into_iter().enumerate() {
        let o = child.wait_with_output().map_err(|e| e.to_string())?;
        let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
        let victim = kill.is_some_and(|(v, _)| v == rank);
        if (o.status.code().is_none() && !victim) || stderr.contains("panicked") || stderr.contains("frame #") {
            return Err(format!("rank {rank} ended {:?}: {stderr}", o.status));
        }
        out.push((o.status.code(), stderr));
    }
    Ok(out)
}

/// Ranks that disagree on one config key (rank 1 given a hostile value of any key): both end
/// within a bound, neither panics; a value rank 1 refuses is named by rank 0 as rank 1's
/// start-up failure, one it takes that changes the config makes both refuse naming the key
/// (or, for the context-parallel size, saying the ranks differ).
#[test]
fn ranks_that_disagree_on_a_key() {
    let dir = tempfile::tempdir().unwrap();
    let config = common::random_base_config(dir.path());
    let keys: Vec<String> = config_keys().into_iter().filter(|k| !k.starts_with("dist.")).collect();
    let base = Config::load(Some(Path::new(&config)), &[]).unwrap();
    let n = std::sync::atomic::AtomicUsize::new(0);
    proptest!(Runner { max_shrink_iters: 2, ..runner(6) }, |(key in prop::sample::select(keys), value in hostile_value())| {
        let run = dir.path().join(format!("run-{}", n.fetch_add(1, std::sync::atomic::Ordering::Relaxed)));
        let set = format!("{key}={value}");
        let args_of = |rank: usize| {
            let mut args = common::short_run_args(&config, &run);
            args.extend(["--set".into(), "schedule.max_steps=1".into(), "--set".into(), "dist.timeout_s=30".into()]);
            if rank == 1 {
                args.extend(["--set".into(), set.clone()]);
            }
            args
        };
        eprintln!("fuzz: rank 1 with --set {set}");
        let ranks = two_ranks(dir.path(), args_of, None, Duration::from_secs(90));
        prop_assert!(ranks.is_ok(), "--set {set}: {}", ranks.unwrap_err());
        let ranks = ranks.unwrap();
        let alone = set.parse::<Override>().map_err(|e| e.to_string()).and_then(|o| {
            Config::load(Some(Path::new(&config)), &[o]).map_err(|e| e.to_string())
        });
        let stderr0 = &ranks[0].1;
        match alone {
            Err(_) => prop_assert!(stderr0.contains("rank 1 failed at start-up"), "--set {set}: {stderr0}"),
            Ok(c) if c.to_toml() != base.to_toml() && key != "run.dir" => {
                prop_assert!(ranks.iter().all(|(code, _)| *code == Some(1)), "--set {set}: {ranks:?}");
                let named = stderr0.contains(key.as_str()) || stderr0.contains("rank 1 failed at start-up");
                prop_assert!(named, "--set {set}: rank 0 does not name it: {stderr0}");
            }
            Ok(_) => {}
        }
    });
}

/// A rank that dies during start-up (its config missing, or SIGKILLed 0-3 s in): the other
/// ends within a bound naming a rank, without a panic or C++ frames.
#[test]
fn a_rank_dying_at_start_up() {
    let dir = tempfile::tempdir().unwrap();
    let config = common::random_base_config(dir.path());
    let n = std::sync::atomic::AtomicUsize::new(0);
    proptest!(Runner { max_shrink_iters: 2, ..runner(4) }, |(victim in 0usize..2, missing in prop::bool::ANY, after_ms in 0u64..3000)| {
        let run = dir.path().join(format!("run-{}", n.fetch_add(1, std::sync::atomic::Ordering::Relaxed)));
        let args_of = |rank: usize| {
            let file = if rank == victim && missing { "missing.toml".to_string() } else { config.clone() };
            let mut args = common::short_run_args(&file, &run);
            args.extend(["--set".into(), "schedule.max_steps=1000".into(), "--set".into(), "dist.timeout_s=10".into()]);
            args
        };
        let kill = (!missing).then_some((victim, Duration::from_millis(after_ms)));
        eprintln!("fuzz: rank {victim} {}", if missing { "without its config".into() } else { format!("killed after {after_ms} ms") });
        let ranks = two_ranks(dir.path(), args_of, kill, Duration::from_secs(60));
        prop_assert!(ranks.is_ok(), "{}", ranks.unwrap_err());
        let ranks = ranks.unwrap();
        let (code, stderr) = &ranks[1 - victim];
        prop_assert!(*code == Some(1), "the other rank: {code:?} {stderr}");
        let names = [format!("rank {victim} failed at start-up"), format!("lost rank {victim}"), format!("ranks [{victim}] did not start")];
        let named = names.iter().any(|n| stderr.contains(n.as_str())) || stderr.contains("cannot reach the store");
        prop_assert!(named, "the other rank does not name rank {victim}: {stderr}");
    });
}

/// gpu-check's variables (`--check`: validated, nothing run) with hostile values, against the
/// rules its --help states, rewritten here: 0/1 switches, whole numbers of 1 to 9 digits above
/// 0, PRESET:SEQ_LEN shapes, fp32/bf16/fp8 precisions. Exit 0 exactly when every value keeps
/// the rules, else 2 naming a variable that breaks one; never a bash error or a traceback.
#[test]
fn gpu_check_variables() {
    let switches = ["TESTS", "PARITY", "PACKING", "E2E", "WHOLE_70B", "TRACE"];
    let numbers = ["LIMIT_S", "L_TEST", "L_BENCH", "L_PEER", "STEPS", "WHOLE_STEPS", "PACKING_DOCS"];
    let lists = ["SHAPES", "PRECISIONS", "E2E_PRECISIONS"];
    let vars: Vec<&str> = switches.iter().chain(&numbers).chain(&lists).copied().collect();
    let values = prop_oneof![
        Just(String::new()),
        Just("0".to_string()),
        Just("1".to_string()),
        Just("08".to_string()),
        Just("-5".to_string()),
        Just("5.5".to_string()),
        Just("yes".to_string()),
        Just("tiny".to_string()),
        Just("tiny:128 small:2048".to_string()),
        Just("bf16 fp8".to_string()),
        Just("fp16".to_string()),
        Just("18446744073709551616".to_string()),
        Just("*".to_string()),
        Just("$(echo x):1".to_string()),
        "[0-9]{1,12}",
        "[a-z0-9:. ]{0,12}",
    ];
    let ok = |var: &str, value: &str| -> bool {
        let words: Vec<&str> = value.split_whitespace().collect();
        if switches.contains(&var) {
            // TESTS=1 needs test executables; TEST_BINS below is an empty folder.
            return value.is_empty() || value == "0" || (value == "1" && var != "TESTS");
        }
        if numbers.contains(&var) {
            let digits = value.trim_start_matches('0');
            return value.is_empty() || (value.bytes().all(|b| b.is_ascii_digit()) && (1..=9).contains(&digits.len()));
        }
        if var == "SHAPES" {
            return words.iter().all(|w| {
                w.split_once(':').is_some_and(|(p, n)| {
                    !p.is_empty()
                        && p.bytes().all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b))
                        && !n.is_empty()
                        && n.bytes().all(|b| b.is_ascii_digit())
                })
            });
        }
        words.iter().all(|w| ["fp32", "bf16", "fp8"].contains(w))
    };
    let dir = tempfile::tempdir().unwrap();
    let script = common::root().join("scripts/gpu-check.sh");
    let assignments = prop::collection::vec((prop::sample::select(vars), values), 1..4);
    proptest!(runner(96), |(set in assignments)| {
        let mut cmd = std::process::Command::new(&script);
        cmd.args(["--cpu", "--check"]).current_dir(dir.path()).env("TEST_BINS", dir.path());
        for (var, value) in &set {
            cmd.env(var, value);
        }
        let out = cmd.output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        // The last assignment of a variable is the one the script sees.
        let seen: std::collections::BTreeMap<&str, &str> = set.iter().map(|(v, x)| (*v, x.as_str())).collect();
        let bad: Vec<&str> = seen.iter().filter(|(v, x)| !ok(v, x)).map(|(v, _)| *v).collect();
        for noise in ["unbound variable", "syntax error", "Traceback", "command not found"] {
            prop_assert!(!stderr.contains(noise), "{set:?}: {stderr}");
        }
        if bad.is_empty() {
            prop_assert!(out.status.code() == Some(0), "{set:?} refused: {stderr}");
        } else {
            prop_assert!(out.status.code() == Some(2), "{set:?} accepted (bad: {bad:?}): {stderr}");
            let named = bad.iter().any(|v| stderr.contains(v)) || (bad.iter().any(|v| v.ends_with("PRECISIONS")) && stderr.contains("PRECISIONS"));
            prop_assert!(named, "{set:?}: names none of {bad:?}: {stderr}");
        }
    });
}

/// Conversations as users bring them (a system message or not, turns in any order, reasoning
/// blocks, blank lines, padding spaces) through real checkpoints' chat templates (TRL 1.16's
/// copies of Qwen 2.5's, Qwen 3's and Llama 3.1's own, Qwen 3's with `{% generation %}`
/// markup) and Mistral v3's rule: a sample is made or the row refused with a reason, never a
/// panic; a sample labels no word of a user or system message, and every word of each
/// assistant message's answer (what follows its reasoning). 42 of 64 Qwen 3 rows used to be
/// refused.
#[test]
#[cfg_attr(not(has_peer), ignore = "needs the peer venv: ./scripts/setup.sh --parity")]
fn conversations_through_real_chat_templates() {
    use llora_data::chat::{ChatTemplate, Message, chat_sample};
    let trl = common::trl_chat_templates();
    let dir = tempfile::tempdir().unwrap();
    let mut templates = Vec::new();
    for (name, source) in [
        ("qwen2.5", std::fs::read_to_string(trl.join("qwen2_5.jinja")).unwrap()),
        ("qwen3", std::fs::read_to_string(trl.join("qwen3.jinja")).unwrap()),
        ("qwen3-training", std::fs::read_to_string(trl.join("qwen3_training.jinja")).unwrap()),
        ("llama3.1", std::fs::read_to_string(trl.join("llama3_1.jinja")).unwrap()),
        ("mistral-v3", common::MISTRAL_V3_STYLE.to_string()),
    ] {
        let d = dir.path().join(name);
        std::fs::create_dir(&d).unwrap();
        std::fs::write(d.join("chat_template.jinja"), source).unwrap();
        std::fs::write(d.join("tokenizer_config.json"), r#"{"bos_token": "<s>", "eos_token": "</s>"}"#).unwrap();
        templates.push((name, ChatTemplate::from_tokenizer_dir(&d).unwrap()));
    }
    // The synthetic vocabulary, split at punctuation too: an answer word glued to an end-of-turn
    // marker (`selo<|im_end|>`) is still its own token.
    let mut tok = llora_data::synth_chat::tokenizer(64).unwrap();
    tok.with_pre_tokenizer(Some(tokenizers::pre_tokenizers::whitespace::Whitespace));
    let word = |k: u32| llora_data::synth::word(llora_data::synth::FIRST_CONTENT + k);
    // Users' and systems' words 0..10, assistants' 20..30: a label on a word < 10 is a leak.
    let text = |base: u32| {
        (prop::collection::vec(0u32..10, 1..4), 0usize..4).prop_map(move |(ks, shape)| {
            let words: Vec<String> = ks.iter().map(|&k| word(base + k)).collect();
            let line = words.join(" ");
            match (base, shape) {
                (20, 0) => format!("<think>\n{}\n</think>\n\n{line}", word(base + 9)),
                (_, 1) => format!("  {line}\n"),
                (_, 2) => format!("{line}\n\n{line}"),
                _ => line,
            }
        })
    };
    let message = prop_oneof![
        text(0).prop_map(|c| Message { role: "user".into(), content: c }),
        text(20).prop_map(|c| Message { role: "assistant".into(), content: c }),
    ];
    let conversation = (prop::option::of(text(0)), prop::collection::vec(message, 1..6)).prop_map(|(system, rest)| {
        let mut all: Vec<Message> = system.map(|c| Message { role: "system".into(), content: c }).into_iter().collect();
        all.extend(rest);
        all
    });
    let ids_of =
        |t: &str| -> Vec<i64> { tok.encode(t, false).unwrap().get_ids().iter().map(|&i| i64::from(i)).collect() };
    let user_ids: Vec<i64> = (0..10).flat_map(|k| ids_of(&word(k))).collect();
    let accepted = Accepted::default();
    proptest!(runner(150), |(t in 0..templates.len(), messages in conversation)| {
        let (name, template) = &templates[t];
        if !messages.iter().any(|m| m.role == "assistant") {
            return Ok(());
        }
        let Ok(sample) = chat_sample(&tok, template, &messages) else { return Ok(()) };
        accepted.one();
        let labelled: Vec<i64> = sample.labels.iter().copied().filter(|&l| l != -100).collect();
        prop_assert!(!labelled.iter().any(|l| user_ids.contains(l)), "{name}: a user or system word labelled: {messages:?}");
        for m in messages.iter().filter(|m| m.role == "assistant") {
            let answer = m.content.rsplit_once("</think>").map_or(m.content.as_str(), |(_, a)| a);
            for id in ids_of(answer) {
                prop_assert!(labelled.contains(&id), "{name}: an answer word is not labelled: {messages:?}");
            }
        }
    });
    accepted.assert_some("conversations through real chat templates");
}
