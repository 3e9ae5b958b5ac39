//! `llora train` end to end on the embedded tiny config: the MLPerf result log it writes, its
//! stop conditions, and early failures on absent inputs.

mod common;
use common::{llora, text};

/// Keys the MLPerf checker requires exactly once for llama2_70b_lora under ruleset 6.1.0,
/// typed in from shared/docs/mlperf-llama2-70b-lora.md.
const EXACTLY_ONCE: &[&str] = &[
    "submission_benchmark", "submission_division", "submission_org", "submission_platform", "init_stop", "run_start",
    "run_stop", "train_samples", "eval_samples", "global_batch_size", "gradient_accumulation_steps",
    "opt_base_learning_rate", "opt_learning_rate_training_steps", "opt_gradient_clip_norm", "opt_adamw_weight_decay",
    "lora_rank", "lora_alpha", "lowest_numerical_precision_in_linear", "lowest_numerical_precision_in_attn",
    "lowest_numerical_precision_in_comm", "tensor_parallelism", "pipeline_parallelism", "context_parallelism",
    "expert_parallelism", "micro_batch_size", "config_filename",
];

/// The embedded tiny config without its pre-trained base (no `model.path`, no
/// `[model.pretrain]`): a random `demo` model, so short tests neither pre-train nor depend on a
/// base left in the working tree by an earlier run.
fn random_base_config(dir: &std::path::Path) -> String {
    let text = std::fs::read_to_string(common::root().join("configs/tiny-cpu.toml")).unwrap();
    let mut config: toml::Table = toml::from_str(&text).unwrap();
    let model = config.get_mut("model").unwrap().as_table_mut().unwrap();
    model.remove("path");
    model.remove("pretrain");
    let path = dir.join("random-base.toml");
    std::fs::write(&path, toml::to_string(&config).unwrap()).unwrap();
    path.display().to_string()
}

fn mllog(path: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .filter_map(|l| l.strip_prefix(":::MLLOG "))
        .map(|j| serde_json::from_str(j).expect("every MLLOG line is JSON"))
        .collect()
}

#[test]
fn reaching_the_target_logs_an_mlperf_run() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let config = random_base_config(dir.path());
    let out = llora(&[
        "train", &config, "--set", &format!("run.dir=\"{}\"", run_dir.display()), "--set", "schedule.max_steps=8",
        "--set", "eval.every_samples=16", "--set", "eval.target_loss=100.0", "--set", "data.synthetic.train_samples=64",
        "--set", "data.synthetic.eval_samples=4", "--set", "data.max_seq_len=128",
    ]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("status: success") && stdout.contains("time_to_train"), "{stdout}");

    let lines = mllog(&run_dir.join("result_0.txt"));
    for l in &lines {
        let md = l["metadata"].as_object().expect("metadata on every line");
        assert!(md.contains_key("file") && md.contains_key("lineno"), "{l}");
    }
    let count = |k: &str| lines.iter().filter(|l| l["key"] == k).count();
    for k in EXACTLY_ONCE {
        assert_eq!(count(k), 1, "key {k} must appear exactly once");
    }
    assert_eq!(lines.iter().find(|l| l["key"] == "lora_rank").unwrap()["value"], 16);
    assert_eq!(lines.iter().find(|l| l["key"] == "submission_benchmark").unwrap()["value"], "llama2_70b_lora");
    // The first evaluation (skip_first = 0) at 16 samples reaches the target of 100.
    let eval = lines.iter().find(|l| l["key"] == "eval_accuracy").unwrap();
    assert_eq!(eval["metadata"]["samples_count"], 16);
    let stop = lines.iter().find(|l| l["key"] == "run_stop").unwrap();
    assert_eq!(stop["metadata"]["status"], "success");
    assert_eq!(stop["metadata"]["samples_count"], 16);
    // Order: init_stop < run_start < eval_start < eval_stop < run_stop, and the data is read
    // (train_samples logged) only after run_start.
    let pos = |k: &str| lines.iter().position(|l| l["key"] == k).unwrap();
    assert!(pos("init_stop") < pos("run_start") && pos("run_start") < pos("train_samples"));
    assert!(pos("eval_start") < pos("eval_accuracy") && pos("eval_stop") < pos("run_stop"));
    for k in ["block_start", "block_stop", "eval_start", "eval_stop"] {
        assert!(lines.iter().any(|l| l["key"] == k && l["metadata"]["samples_count"].is_u64()), "{k} with samples_count");
    }
    // PEFT-format adapter and per-step metrics are left in the run directory.
    assert!(run_dir.join("adapter/adapter_model.safetensors").is_file());
    assert!(run_dir.join("adapter/adapter_config.json").is_file());
    let metrics = std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap();
    assert!(metrics.lines().count() >= 2 && metrics.contains("\"grad_norm\""), "{metrics}");
}

#[test]
fn max_steps_without_the_target_is_an_aborted_run() {
    let dir = tempfile::tempdir().unwrap();
    let config = random_base_config(dir.path());
    let out = llora(&[
        "train", &config, "--set", &format!("run.dir=\"{}\"", dir.path().display()), "--set", "schedule.max_steps=2",
        "--set", "eval.every_samples=8", "--set", "eval.target_loss=0.001", "--set", "data.synthetic.train_samples=32",
        "--set", "data.synthetic.eval_samples=2", "--set", "data.max_seq_len=128",
    ]);
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    assert!(stderr.contains("did not reach eval.target_loss"), "{stderr}");
    let lines = mllog(&dir.path().join("result_0.txt"));
    let stop = lines.iter().find(|l| l["key"] == "run_stop").unwrap();
    assert_eq!(stop["metadata"]["status"], "aborted");
    assert_eq!(lines.iter().filter(|l| l["key"] == "eval_accuracy").count(), 2);
}

#[test]
fn the_70b_config_fails_early_without_weights() {
    let dir = tempfile::tempdir().unwrap();
    let started = std::time::Instant::now();
    let out = llora(&["train", "configs/llama2-70b-mlperf.toml", "--set", "run.device=cpu", "--set", &format!("run.dir=\"{}\"", dir.path().display())]);
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    assert!(stderr.contains("model.path") && stderr.contains("no such directory"), "{stderr}");
    assert!(started.elapsed().as_secs() < 30, "failing on a missing checkpoint must not load anything first");
}

/// The README's main job in small: pre-train the demo base, fine-tune it with LoRA to the
/// benchmark's 0.925, and hand the result log to the official MLPerf compliance checker.
#[test]
fn demo_run_log_passes_the_official_mlperf_checker() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let base = dir.path().join("base");
    let out = llora(&["train", "--set", &format!("run.dir=\"{}\"", run_dir.display()), "--set", &format!("model.path=\"{}\"", base.display())]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(base.join("config.json").is_file() && base.join("model.safetensors").is_file(), "pre-trained base not saved");
    let log = run_dir.join("result_0.txt");
    let check = common::root().join("../shared/mlperf/check.sh");
    assert!(check.is_file(), "{} missing: this test needs shared/ beside the repository", check.display());
    let res = std::process::Command::new("bash").arg(&check).arg(&log).output().unwrap();
    let (c_out, c_err) = text(&res);
    assert!(res.status.success(), "official checker rejected {}:\n{c_out}\n{c_err}", log.display());
}
