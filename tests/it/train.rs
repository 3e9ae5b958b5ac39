//! `llora train` end to end on the embedded tiny config: the MLPerf result log it writes, its
//! stop conditions, and early failures on absent inputs.

use crate::common;
use common::{llora, text};

/// Keys the MLPerf checker requires exactly once for llama2_70b_lora under ruleset 6.1.0,
/// typed in from the checker's rules (mlperf-logging 4.1.68, training_6.1.0/closed_llama2_70b_lora.yaml).
const EXACTLY_ONCE: &[&str] = &[
    "submission_benchmark",
    "submission_division",
    "submission_org",
    "submission_platform",
    "init_stop",
    "run_start",
    "run_stop",
    "train_samples",
    "eval_samples",
    "global_batch_size",
    "gradient_accumulation_steps",
    "opt_base_learning_rate",
    "opt_learning_rate_training_steps",
    "opt_gradient_clip_norm",
    "opt_adamw_weight_decay",
    "lora_rank",
    "lora_alpha",
    "lowest_numerical_precision_in_linear",
    "lowest_numerical_precision_in_attn",
    "lowest_numerical_precision_in_comm",
    "tensor_parallelism",
    "pipeline_parallelism",
    "context_parallelism",
    "expert_parallelism",
    "micro_batch_size",
    "config_filename",
];

use common::{checkpoint_step, mllog, random_base_config, short_run_args, strs, train_args};

#[test]
fn reaching_the_target_logs_an_mlperf_run() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let config = random_base_config(dir.path());
    let out = llora(&[
        "train",
        &config,
        "--set",
        &format!("run.dir=\"{}\"", run_dir.display()),
        "--set",
        "schedule.max_steps=8",
        "--set",
        "eval.every_samples=16",
        "--set",
        "eval.target_loss=100.0",
        "--set",
        "data.synthetic.train_samples=64",
        "--set",
        "data.synthetic.eval_samples=4",
        "--set",
        "data.max_seq_len=128",
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
    assert_eq!(lines.iter().find(|l| l["key"] == "data_packing").unwrap()["value"], false, "one sample a row");
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
        assert!(
            lines.iter().any(|l| l["key"] == k && l["metadata"]["samples_count"].is_u64()),
            "{k} with samples_count"
        );
    }
    // PEFT-format adapter and per-step metrics are left in the run directory.
    assert!(run_dir.join("adapter/adapter_model.safetensors").is_file());
    assert!(run_dir.join("adapter/adapter_config.json").is_file());
    // The adapter was in place before run_stop was logged (a kill between the two must
    // never leave a logged run_stop without its adapter), and no temporary folder is left.
    let mtime = |p: &std::path::Path| std::fs::metadata(p).unwrap().modified().unwrap();
    assert!(mtime(&run_dir.join("adapter/adapter_model.safetensors")) <= mtime(&run_dir.join("result_0.txt")));
    let stray: Vec<_> = std::fs::read_dir(&run_dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.') && n != ".llora-run.lock")
        .collect();
    assert!(stray.is_empty(), "{stray:?}");
    let metrics = std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap();
    assert!(metrics.lines().count() >= 2 && metrics.contains("\"grad_norm\""), "{metrics}");
}

#[test]
fn max_steps_without_the_target_is_an_aborted_run() {
    let dir = tempfile::tempdir().unwrap();
    let config = random_base_config(dir.path());
    let out = llora(&[
        "train",
        &config,
        "--set",
        &format!("run.dir=\"{}\"", dir.path().display()),
        "--set",
        "schedule.max_steps=2",
        "--set",
        "eval.every_samples=8",
        "--set",
        "eval.target_loss=0.001",
        "--set",
        "data.synthetic.train_samples=32",
        "--set",
        "data.synthetic.eval_samples=2",
        "--set",
        "data.max_seq_len=128",
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
    let out = llora(&[
        "train",
        "configs/llama2-70b-mlperf.toml",
        "--set",
        "run.device=cpu",
        "--set",
        &format!("run.dir=\"{}\"", dir.path().display()),
    ]);
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    assert!(stderr.contains("model.path") && stderr.contains("no such directory"), "{stderr}");
    assert!(started.elapsed().as_secs() < 30, "failing on a missing checkpoint must not load anything first");
}

/// The README's main job in small: pre-train the demo base, fine-tune it with LoRA to the
/// benchmark's 0.925, and hand the result log to the official MLPerf compliance checker. Then
/// the convergence check: the same run with FP8 compute, FP8 activation storage and FP8
/// base weights reaches the target within 15% more samples, and `llora plot` draws both.
/// All of it is `llora train` as the README runs it (embedded config, its relative paths, in a
/// scratch working directory), so it also shows that every run keeps the earlier ones
/// (`runs/tiny-cpu`, then `-2`, `-3`), and the plain command run again succeeds with the same
/// adapters, leaving the first run's files byte for byte as they were.
#[test]
fn demo_runs_in_fp32_and_fp8_pass_the_checker_and_converge_alike() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("runs/demo-base");
    let mut samples = Vec::new();
    for (name, sets) in [
        ("fp32", vec![]),
        ("fp8", vec!["precision.compute=\"fp8\"", "precision.fp8_activations=true", "precision.fp8_weights=true"]),
    ] {
        let run_dir = dir.path().join(if name == "fp32" { "runs/tiny-cpu" } else { "runs/tiny-cpu-2" });
        let mut args = vec!["train"];
        for s in &sets {
            args.extend(["--set", s]);
        }
        let out = common::llora_in(dir.path(), &args);
        let (stdout, stderr) = text(&out);
        assert!(out.status.success() && stdout.contains("status: success"), "{name}: {stdout}\n{stderr}");
        assert!(
            stdout.trim_end().ends_with(&format!("run.dir: {}", run_dir.strip_prefix(dir.path()).unwrap().display())),
            "{name} says where it wrote: {stdout}"
        );
        assert!(
            base.join("config.json").is_file() && base.join("model.safetensors").is_file(),
            "pre-trained base not saved"
        );
        // The last summary line is the LoRA run's (the first fp32 run also prints the
        // pre-training run's before it).
        let n: u64 = stdout
            .rsplit("samples: ")
            .next()
            .and_then(|r| r.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap();
        samples.push(n);
        let log = run_dir.join("result_0.txt");
        let (passed, said) = common::mlperf_check(&log);
        assert!(passed && said.contains("SUCCESS"), "official checker rejected {}:\n{said}", log.display());
        if name == "fp32" {
            // The checker is not a rubber stamp: the same log without a required key fails.
            let broken = dir.path().join("no_global_batch_size.txt");
            let text = std::fs::read_to_string(&log).unwrap();
            let kept: Vec<&str> = text.lines().filter(|l| !l.contains("\"global_batch_size\"")).collect();
            assert_eq!(kept.len() + 1, text.lines().count(), "the log has one global_batch_size line");
            std::fs::write(&broken, kept.join("\n") + "\n").unwrap();
            let (passed, said) = common::mlperf_check(&broken);
            assert!(!passed && said.contains("global_batch_size"), "a log without global_batch_size passed:\n{said}");
            // Another benchmark's log, a ruleset the checker lacks: one line each, no Python
            // traceback, no argparse usage.
            let other = dir.path().join("bert.txt");
            std::fs::write(&other, text.replace("llama2_70b_lora", "bert")).unwrap();
            let stderr_of = |out: &std::process::Output| String::from_utf8_lossy(&out.stderr).to_string();
            let (passed, said) = common::mlperf_check(&other);
            assert!(!passed && said.contains("\"bert\"") && !said.contains("Traceback"), "{said}");
            let out = llora(&["mlperf", "check", log.to_str().unwrap(), "--ruleset", "6.9.9"]);
            let said = stderr_of(&out);
            assert!(!out.status.success() && said.contains("choose one of") && said.contains("'6.1.0'"), "{said}");
            assert!(!said.contains("usage:"), "{said}");
            // Ruleset 2.0.0 predates this benchmark: the checker crashes; its exception is said.
            let out = llora(&["mlperf", "check", log.to_str().unwrap(), "--ruleset", "2.0.0"]);
            let said = stderr_of(&out);
            assert!(!out.status.success() && said.contains("a crash, not a verdict"), "{said}");
            assert!(said.contains("FileNotFoundError") && !said.contains("Traceback"), "{said}");
        }
        let linear = mllog(&log).into_iter().find(|e| e["key"] == "lowest_numerical_precision_in_linear").unwrap();
        assert_eq!(linear["value"], name, "the log must say what ran");
        // FP8 runs its activations, and so attention, in bf16.
        let attn = mllog(&log).into_iter().find(|e| e["key"] == "lowest_numerical_precision_in_attn").unwrap();
        assert_eq!(attn["value"], if name == "fp32" { "fp32" } else { "bfloat16" });
    }
    let (fp32, fp8) = (samples[0] as f64, samples[1] as f64);
    assert!(fp8 <= fp32 * 1.15, "FP8 needed {fp8} samples, fp32 {fp32} (more than 15% more)");
    let (first, fp8_dir) = (dir.path().join("runs/tiny-cpu"), dir.path().join("runs/tiny-cpu-2"));
    let svg = dir.path().join("fp8-vs-fp32.svg");
    let (a, b) = (format!("fp32={}", first.display()), format!("fp8={}", fp8_dir.display()));
    let out = llora(&["plot", &a, &b, "--out", svg.to_str().unwrap()]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains(&format!("\"samples_to_target\":{}", samples[1])), "{stdout}");
    let svg = std::fs::read_to_string(&svg).unwrap();
    assert!(svg.contains("fp32 eval") && svg.contains("fp8 eval"), "both curves are labelled");

    // The README's main command once more: a third run beside the two, the first untouched.
    let files = |d: &std::path::Path| {
        ["result_0.txt", "metrics.jsonl", "loss.svg", "adapter/adapter_model.safetensors"]
            .map(|f| std::fs::read(d.join(f)).unwrap())
    };
    let before = files(&first);
    let out = common::llora_in(dir.path(), &["train"]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success() && stdout.trim_end().ends_with("run.dir: runs/tiny-cpu-3"), "{stdout}\n{stderr}");
    assert!(files(&first) == before, "the first run's files changed");
    let again = dir.path().join("runs/tiny-cpu-3/adapter/adapter_model.safetensors");
    assert!(std::fs::read(again).unwrap() == before[3], "the same command (one thread) trains the same adapters");
}

/// End-to-end, as the README runs it (`scripts/demo-chat.sh`, here with the built binary):
/// the synthetic task as Llama-3-style conversations through the chat template, a tied,
/// llama3-RoPE model pre-trained (tied full fine-tuning) and LoRA-trained to the target, then
/// `llora generate --chat` answering held-out conversations it never trained on: each answer
/// opens with the abstract of its report's topic, word for word.
#[test]
fn llama3_chat_demo_reaches_the_target_and_answers_held_out_conversations() {
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new("bash")
        .arg(common::root().join("scripts/demo-chat.sh"))
        .args(["--set", "run.threads=1"])
        .current_dir(common::root())
        .env("LLORA", common::llora_bin())
        .env("OUT", dir.path())
        .env("THREADS", "1")
        .env("OMP_WAIT_POLICY", "PASSIVE")
        .env_remove("LD_LIBRARY_PATH")
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "demo-chat.sh failed:\n{stdout}\n{stderr}");
    let last: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert_eq!(last["status"], "success", "{stdout}");
    assert!(last["eval_loss"].as_f64().unwrap() <= 0.925, "{last}");
    let config = llora_model::LlamaConfig::from_hf_dir(&dir.path().join("demo-llama3-base")).unwrap();
    assert!(config.tie_word_embeddings && config.rope_scaling.is_some(), "the base is Llama-3-style");
    // Each answer opens with its report's topic's 24-word abstract (the topic recognised from
    // the report; a model that did not learn it would not produce one word of 24 in order).
    assert_eq!(last["answers"], 4);
    assert!(last["min_prefix"].as_u64().unwrap() >= 24, "an answer misses its topic's abstract:\n{stdout}");
}

#[test]
fn sigint_saves_a_checkpoint_and_says_how_to_resume() {
    let dir = tempfile::tempdir().unwrap();
    let config = random_base_config(dir.path());
    let run = dir.path().join("run");
    let mut args = short_run_args(&config, &run);
    args.extend(["--set".into(), "schedule.max_steps=1000".into()]);
    let out = common::signal_after_two_steps(&args, &run, "INT");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{stderr}");
    assert!(stderr.contains("interrupted after step") && stderr.contains("llora train --resume"), "{stderr}");
    let step = checkpoint_step(&run).expect("a checkpoint on SIGINT");
    assert!((2..1000).contains(&step), "checkpoint at step {step}");
    assert!(common::newest_checkpoint(&run).unwrap().join("adapter/adapter_model.safetensors").is_file());
}

/// A signal sent twice (coreutils `timeout` signals the child, then its group) still ends with
/// the step's checkpoint and exit 130, and the second is reported; a third exits at once without
/// the checkpoint, saying so, with 131: never a silent 130 with no checkpoint.
#[test]
fn repeated_signals_never_lose_the_checkpoint_silently() {
    let dir = tempfile::tempdir().unwrap();
    let config = random_base_config(dir.path());
    let run = dir.path().join("run");
    let mut args = short_run_args(&config, &run);
    args.extend(["--set".into(), "schedule.max_steps=1000".into()]);
    let out = common::signals_after_two_steps(&args, &run, "TERM", 2);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{stderr}");
    assert!(stderr.contains("signal again") && stderr.contains("interrupted after step"), "{stderr}");
    assert!(checkpoint_step(&run).is_some_and(|s| s >= 2), "a checkpoint after two signals: {stderr}");

    let run = dir.path().join("run-3");
    let mut args = short_run_args(&config, &run);
    args.extend(["--set".into(), "schedule.max_steps=1000".into()]);
    let out = common::signals_after_two_steps(&args, &run, "TERM", 3);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(131), "{stderr}");
    assert!(
        stderr.contains("signal a third time: exiting at once, without the checkpoint") && stderr.contains("exit 131"),
        "{stderr}"
    );
}

/// Golden losses, as torchtune's recipe tests do: the random `demo` base and LoRA with seed 1
/// on the synthetic set; the first five training losses of the 12-step run were recorded from
/// llora when this test was written, on this CPU with one thread. Step 1 does not depend on the adapters (B = 0) and
/// is ln(512) ≈ 6.238 plus the random base's bias; tests/it/parity/llama.rs ties the step itself to
/// PyTorch + PEFT. A change here means the recipe changed (data order, dropout seeding,
/// schedule, normalisation): update the values only on purpose (re-recorded when dropout
/// masks moved from torch's Bernoulli to ChaCha8, when they were seeded per micro-batch of
/// the global batch for data parallelism, and per decoder block for recomputation; step 1,
/// which has no dropout effect, kept its value to 1e-7 each time). The run has two warm-up
/// passes, which must not change it (they were not in the recording run).
#[test]
fn first_losses_match_the_golden_values() {
    const GOLDEN: [f64; 5] =
        [6.256290912628174, 6.15872448682785, 6.097109317779541, 6.0508280992507935, 6.05909526348114];
    let dir = tempfile::tempdir().unwrap();
    let config = random_base_config(dir.path());
    let run = dir.path().join("run");
    // Warm-up passes before run_start must change nothing of the run.
    let mut args = short_run_args(&config, &run);
    args.extend(["--set".into(), "train.warmup_batches=2".into()]);
    let out = llora(&strs(&args));
    let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap_or_else(|_| panic!("{}", text(&out).1));
    let losses: Vec<f64> = metrics
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter_map(|v| v["loss"].as_f64())
        .collect();
    assert_eq!(losses.len(), 12);
    for (i, (got, want)) in losses.iter().zip(GOLDEN).enumerate() {
        assert!(((got - want) / want).abs() < 1e-5, "step {}: loss {got}, golden {want}", i + 1);
    }
}

/// `llora mlperf run` makes seeded runs and scores them: three runs that converge at their
/// first evaluation, scored as the olympic mean of the middle one.
#[test]
fn mlperf_run_makes_seeded_logs_and_scores_them() {
    let dir = tempfile::tempdir().unwrap();
    let config = random_base_config(dir.path());
    let out_dir = dir.path().join("results");
    let out = llora(&[
        "mlperf",
        "run",
        &config,
        "--runs",
        "3",
        "--out",
        out_dir.to_str().unwrap(),
        "--set",
        "eval.every_samples=16",
        "--set",
        "eval.target_loss=100.0",
        "--set",
        "data.synthetic.train_samples=32",
        "--set",
        "data.synthetic.eval_samples=2",
        "--set",
        "data.max_seq_len=128",
    ]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let mut seeds = Vec::new();
    let mut minutes = Vec::new();
    for i in 0..3 {
        let lines = mllog(&out_dir.join(format!("result_{i}.txt")));
        seeds.push(lines.iter().find(|l| l["key"] == "seed").unwrap()["value"].as_u64().unwrap());
        let t = |k: &str| lines.iter().find(|l| l["key"] == k).unwrap()["time_ms"].as_f64().unwrap();
        minutes.push((t("run_stop") - t("run_start")) / 60_000.0);
    }
    assert_eq!(seeds, [1, 2, 3], "seeds run.seed + i");
    minutes.sort_by(f64::total_cmp);
    let last: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert!((last["score_min"].as_f64().unwrap() - minutes[1]).abs() < 1e-9, "{stdout}");
}

/// A diverging run (absurd learning rate) stops at the first non-finite loss or gradient norm
/// with an error naming the step, the likely causes and where the last checkpoint is (the
/// terser message of the step used to win), and its result log ends with run_stop `aborted`.
#[test]
fn non_finite_loss_aborts_naming_the_step() {
    let dir = tempfile::tempdir().unwrap();
    let config = random_base_config(dir.path());
    let run = dir.path().join("run");
    let mut args = short_run_args(&config, &run);
    args.extend(["--set".into(), "optim.lr=1e30".into(), "--set".into(), "optim.clip_grad_norm=0.0".into()]);
    let out = llora(&strs(&args));
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    let helpful = ["non-finite values", "the last checkpoint is still in", "an lr too high"];
    assert!(stderr.contains("step 2:") && helpful.iter().all(|h| stderr.contains(h)), "{stderr}");
    let lines = mllog(&run.join("result_0.txt"));
    let stop = lines.iter().find(|l| l["key"] == "run_stop").expect("run_stop logged");
    assert_eq!(stop["metadata"]["status"], "aborted");
}

/// `--resume` goes through the same validation as any config: an override the schema refuses
/// (`precision.compute = fp16`) stops the resumed run, naming the key, instead of silently
/// training in fp32.
#[test]
fn resume_validates_its_overrides() {
    let dir = tempfile::tempdir().unwrap();
    let config = random_base_config(dir.path());
    let run = dir.path().join("run");
    let mut args = short_run_args(&config, &run);
    args.extend(["--set".into(), "schedule.max_steps=2".into(), "--set".into(), "run.checkpoint_every=1".into()]);
    let _ = llora(&strs(&args));
    assert_eq!(checkpoint_step(&run), Some(2), "a checkpoint to resume from");
    let out = llora(&["train", "--resume", run.to_str().unwrap(), "--set", "precision.compute=fp16"]);
    let (_, stderr) = text(&out);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("`precision.compute` (from --set)") && stderr.contains("fp16"), "{stderr}");
    let out = llora(&["train", "--resume", run.to_str().unwrap(), "--set", "optim.lr=-1"]);
    assert!(!out.status.success() && text(&out).1.contains("`optim.lr` = -1.0"), "{}", text(&out).1);
}

/// A resumed run whose training file changed since its checkpoint (here: 8 rows where the
/// checkpoint had read 16 of 64) fails naming the file and the checkpoint's position (it
/// said only "position index 16 is past the shard's 8 samples").
#[test]
fn resuming_on_changed_data_names_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let config = random_base_config(dir.path());
    let data = dir.path().join("data");
    let d = data.to_str().unwrap();
    let synth = ["data", "synth", "--out", d, "--train", "64", "--eval", "4", "--max-seq-len", "128", "--vocab", "512"];
    assert!(llora(&synth).status.success());
    // The random-base config with files in place of its synthetic corpus.
    let mut table: toml::Table = toml::from_str(&std::fs::read_to_string(&config).unwrap()).unwrap();
    table["data"].as_table_mut().unwrap().remove("synthetic");
    std::fs::write(&config, toml::to_string(&table).unwrap()).unwrap();
    let run = dir.path().join("run");
    let sets = [
        format!("run.dir=\"{}\"", run.display()),
        format!("data.train=\"{d}/train.parquet\""),
        format!("data.eval=\"{d}/validation.parquet\""),
        "data.max_seq_len=128".into(),
        "eval.target_loss=0.001".into(),
        "schedule.max_steps=2".into(),
        "run.checkpoint_every=1".into(),
    ];
    let mut args = vec!["train", &config];
    for s in &sets {
        args.extend(["--set", s]);
    }
    let out = llora(&args);
    assert_eq!(checkpoint_step(&run), Some(2), "{}", text(&out).1);
    // As if killed after its checkpoint: no final adapter.
    std::fs::remove_dir_all(run.join("adapter")).unwrap();
    let small = [
        "data",
        "synth",
        "--out",
        d,
        "--train",
        "8",
        "--eval",
        "4",
        "--max-seq-len",
        "128",
        "--vocab",
        "512",
        "--overwrite",
    ];
    assert!(llora(&small).status.success());
    let out = llora(&["train", "--resume", run.to_str().unwrap(), "--set", "schedule.max_steps=4"]);
    let (_, stderr) = text(&out);
    assert!(!out.status.success(), "{stderr}");
    for want in [&format!("{d}/train.parquet: 8 samples"), "checkpoint's data position", "sample 16"] {
        assert!(stderr.contains(want), "missing {want:?}: {stderr}");
    }
}

/// `train.recompute_layers`: a run recomputing 3 of the 4 blocks ends with bitwise the adapters
/// of the same run without recomputation (dropout on); so does a Mistral-style model whose
/// window (16) is shorter than its rows, on a base with norm gains away from 1, one of its two
/// blocks recomputed (the masked window path's softmax used to round differently untracked);
/// and an FP8 run with the CPU standing in for CUDA, whose recomputed blocks redraw their
/// dropout masks on our kernel's route (the first-use checks inside the first step's blocks
/// leaving the seeds' generator where it was).
#[test]
fn recomputing_blocks_changes_nothing_of_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let config = random_base_config(dir.path());
    let mistral = common::family_base_away_from_0_and_1(dir.path(), "tiny-mistral");
    let mistral = [format!("model.path=\"{}\"", mistral.display()), "model.preset=\"tiny-mistral\"".into()];
    let fp8 = ["precision.compute=\"fp8\"".to_string(), "precision.fp8_activations=true".into()];
    let routes = [("LLORA_CUDA_ROUTES_ON_CPU", "1")];
    for (family, extra, recomputed, env) in
        [("demo", &[][..], "3", &[][..]), ("mistral", &mistral[..], "1", &[]), ("fp8-routes", &fp8[..], "3", &routes)]
    {
        let mut adapters = Vec::new();
        for (name, recompute) in [("plain", "0"), ("recomputed", recomputed)] {
            let run = dir.path().join(format!("{family}-{name}"));
            let mut args = short_run_args(&config, &run);
            args.extend(["--set".into(), "schedule.max_steps=4".into()]);
            args.extend(["--set".into(), format!("train.recompute_layers={recompute}")]);
            args.extend(extra.iter().flat_map(|s| ["--set".to_string(), s.clone()]));
            let out = common::llora_command(&common::root(), &strs(&args)).envs(env.iter().copied()).output().unwrap();
            let f = run.join("adapter/adapter_model.safetensors");
            adapters.push(std::fs::read(&f).unwrap_or_else(|e| panic!("{}: {e}\n{}", f.display(), text(&out).1)));
        }
        assert!(adapters[0] == adapters[1], "{family}: recomputation changed the adapters");
    }
}

/// A short run's TensorBoard event files, read by TensorBoard's own reader (its
/// `EventAccumulator`, in the project venv), hold every number of `metrics.jsonl` at its step:
/// each step's loss, learning rate, gradient norm, tokens/s, step time, TFLOP/s, samples and
/// target tokens, and each evaluation's loss (as f32, TensorBoard's scalar type).
#[test]
#[cfg_attr(not(has_peer), ignore = "needs the peer venv: ./scripts/setup.sh --parity")]
fn tensorboard_reads_every_scalar_of_the_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let config = random_base_config(dir.path());
    let run = dir.path().join("run");
    let _ = llora(&strs(&short_run_args(&config, &run)));
    let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    let read = "import json, sys\n\
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator\n\
        acc = EventAccumulator(sys.argv[1], size_guidance={'scalars': 0}); acc.Reload()\n\
        print(json.dumps({t: [[e.step, e.value] for e in acc.Scalars(t)] for t in acc.Tags()['scalars']}))";
    let py = common::root().join(".venv/bin/python");
    let out = std::process::Command::new(&py).args(["-c", read]).arg(run.join("tensorboard")).output().unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "TensorBoard's reader (run ./scripts/setup.sh --parity): {stderr}");
    let scalars: serde_json::Map<String, serde_json::Value> = serde_json::from_str(&stdout).unwrap();
    let at = |tag: &str, step: u64| -> Option<f64> {
        scalars.get(tag)?.as_array()?.iter().find(|p| p[0] == step).and_then(|p| p[1].as_f64())
    };
    let (mut steps, mut evals) = (0, 0);
    for record in metrics.lines().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()) {
        let step = record["step"].as_u64().unwrap();
        let keys: Vec<&str> = match record.get("eval_loss") {
            Some(_) => vec!["eval_loss"],
            None => vec![
                "loss",
                "lr",
                "grad_norm",
                "tokens_per_s",
                "step_s",
                "model_tflops_per_s",
                "samples",
                "target_tokens",
            ],
        };
        for key in keys {
            let want = record[key].as_f64().unwrap() as f32;
            // As f32: serde_json's reading of Python's decimal may be one f64 ulp off.
            assert_eq!(at(key, step).map(|v| v as f32), Some(want), "{key} at step {step}: {stdout}");
        }
        if record.get("eval_loss").is_some() { evals += 1 } else { steps += 1 }
    }
    assert_eq!((steps, evals), (12, 3), "{metrics}");
    assert_eq!(scalars["loss"].as_array().unwrap().len(), 12, "one loss a step, none twice");
}

/// Preference tuning end to end on the CPU: `train.objective = "dpo"` on synthetic pairs (the
/// chosen summary under its report's topic's abstract, the rejected one under another topic's)
/// from a random base: held-out reward accuracy reaches 0.9 and the margin grows; every step
/// and evaluation records TRL's statistics in metrics.jsonl; the run is an ordinary run
/// directory with its adapter.
#[test]
fn dpo_on_synthetic_pairs_learns_the_preferred_rule() {
    let dir = tempfile::tempdir().unwrap();
    let config = random_base_config(dir.path());
    let run = dir.path().join("run");
    let args = train_args(
        &config,
        [
            format!("run.dir=\"{}\"", run.display()),
            "train.objective=\"dpo\"".into(),
            "mlperf.check=false".into(),
            "schedule.max_steps=24".into(),
            "eval.every_samples=64".into(),
            "eval.target_loss=0.001".into(),
            "data.synthetic.train_samples=256".into(),
            "data.synthetic.eval_samples=32".into(),
            "data.max_seq_len=128".into(),
        ],
    );
    let out = llora(&strs(&args));
    let (_, stderr) = text(&out);
    assert!(stderr.contains("reward_accuracy="), "{stderr}");
    let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    let records: Vec<serde_json::Value> = metrics.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let evals: Vec<&serde_json::Value> = records.iter().filter(|r| r.get("eval_loss").is_some()).collect();
    assert_eq!(evals.len(), 3, "{metrics}");
    let accuracy: Vec<f64> = evals.iter().map(|r| r["eval_rewards_accuracy"].as_f64().unwrap()).collect();
    let margin: Vec<f64> = evals.iter().map(|r| r["eval_rewards_margin"].as_f64().unwrap()).collect();
    assert!(accuracy[2] >= 0.9, "held-out reward accuracy {accuracy:?}");
    assert!(margin[0] < margin[2] && margin[2] > 0.0, "margin {margin:?}");
    for r in records.iter().filter(|r| r.get("loss").is_some()) {
        for key in [
            "rewards_chosen",
            "rewards_rejected",
            "rewards_accuracy",
            "rewards_margin",
            "logps_chosen",
            "logps_rejected",
        ] {
            assert!(r[key].is_f64(), "{key} missing from {r}");
        }
    }
    assert!(run.join("adapter/adapter_model.safetensors").is_file());
}

/// Preference tuning composes with bf16, FP8 weights and activations, an NF4 base, DoRA with
/// rsLoRA and a rank pattern, and the Qwen and Mistral families: each short run's first loss
/// is ln 2 (fresh adapters, B = 0: the policy is the reference, so every pair's loss is
/// −log σ(0)), and its later losses are finite and below it on average (each step's pairs
/// differ, so single steps are noisy).
#[test]
fn dpo_composes_with_precisions_adapter_kinds_and_families() {
    let dir = tempfile::tempdir().unwrap();
    let config = random_base_config(dir.path());
    for (i, sets) in [
        &["precision.compute=\"bf16\""][..],
        &["precision.compute=\"fp8\"", "precision.fp8_activations=true", "precision.fp8_weights=true"],
        &["model.quantize=\"nf4\""],
        &["lora.dora=true", "lora.rslora=true", r#"lora.rank_pattern={"v_proj"=4}"#],
        &["model.preset=\"tiny-qwen2\""],
        &["model.preset=\"tiny-mistral\""],
    ]
    .iter()
    .enumerate()
    {
        let run = dir.path().join(format!("run-{i}"));
        let common = [
            format!("run.dir=\"{}\"", run.display()),
            "train.objective=\"dpo\"".into(),
            "mlperf.check=false".into(),
            "schedule.max_steps=6".into(),
            "train.global_batch_size=4".into(),
            "eval.every_samples=1000".into(),
            "data.synthetic.train_samples=64".into(),
            "data.synthetic.eval_samples=4".into(),
            "data.max_seq_len=128".into(),
        ];
        let args = train_args(&config, common.into_iter().chain(sets.iter().map(|s| s.to_string())));
        let out = llora(&strs(&args));
        let (_, stderr) = text(&out);
        let metrics =
            std::fs::read_to_string(run.join("metrics.jsonl")).unwrap_or_else(|e| panic!("{sets:?}: {e}\n{stderr}"));
        let losses: Vec<f64> = metrics
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"].as_f64())
            .collect();
        assert_eq!(losses.len(), 6, "{sets:?}: {metrics}\n{stderr}");
        assert!((losses[0] - std::f64::consts::LN_2).abs() < 1e-3, "{sets:?}: first loss {} is not ln 2", losses[0]);
        let later = losses[1..].iter().sum::<f64>() / 5.0;
        assert!(losses.iter().all(|l| l.is_finite()) && later < losses[0], "{sets:?}: {losses:?}");
    }
}

/// `dpo.precompute_reference`: the reference's log-probabilities computed once before training
/// (in evaluation batches) train as the per-step reference forward does (each step's loss
/// within 1e-5, the held-out metrics too); they are cached beside `data.train`, and a second
/// run reads the cache and ends with bitwise the adapters of the run that made it.
#[test]
fn precomputed_reference_trains_as_the_reference_forward_and_is_cached() {
    use llora_data::preference::{pairs_parquet_bytes, synthetic_pairs};
    use llora_data::synth::{Synth, SynthConfig};
    let dir = tempfile::tempdir().unwrap();
    let path = random_base_config(dir.path());
    let mut table: toml::Table = toml::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    table.get_mut("data").unwrap().as_table_mut().unwrap().remove("synthetic");
    std::fs::write(&path, toml::to_string(&table).unwrap()).unwrap();
    let config = path;
    let synth = Synth::new(SynthConfig { max_seq_len: 128, ..SynthConfig::default() }).unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir(&data).unwrap();
    for (name, split, n) in [("train.parquet", 0, 32), ("eval.parquet", 1, 8)] {
        std::fs::write(data.join(name), pairs_parquet_bytes(&synthetic_pairs(&synth, split, n)).unwrap()).unwrap();
    }
    let run = |name: &str, precompute: bool| -> (Vec<serde_json::Value>, Vec<u8>, String) {
        let run = dir.path().join(name);
        let (train, eval) = (data.join("train.parquet"), data.join("eval.parquet"));
        let args = train_args(
            &config,
            [
                format!("run.dir=\"{}\"", run.display()),
                format!("data.train=\"{}\"", train.display()),
                format!("data.eval=\"{}\"", eval.display()),
                "train.objective=\"dpo\"".into(),
                format!("dpo.precompute_reference={precompute}"),
                "mlperf.check=false".into(),
                "schedule.max_steps=4".into(),
                "train.global_batch_size=4".into(),
                "eval.every_samples=8".into(),
                "eval.target_loss=0.001".into(),
                "data.max_seq_len=128".into(),
            ],
        );
        let out = llora(&strs(&args));
        let (_, stderr) = text(&out);
        let metrics =
            std::fs::read_to_string(run.join("metrics.jsonl")).unwrap_or_else(|e| panic!("{name}: {e}\n{stderr}"));
        let records = metrics.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        (records, std::fs::read(run.join("adapter/adapter_model.safetensors")).unwrap(), stderr)
    };
    let (each_step, _, _) = run("forward", false);
    let (made, adapter, log) = run("precomputed", true);
    assert!(log.contains("reference log-probabilities computed"), "{log}");
    assert_eq!(each_step.len(), made.len());
    for (a, b) in each_step.iter().zip(&made) {
        // A margin is β times a difference of log-probabilities: held to 1e-5 of those.
        let logps = |prefix: &str| a[format!("{prefix}logps_rejected")].as_f64().map(|l| 0.1 * l.abs());
        for (key, scale) in [
            ("loss", Some(1e-2)),
            ("rewards_margin", logps("")),
            ("eval_loss", Some(1e-2)),
            ("eval_rewards_margin", logps("eval_")),
        ] {
            if let (Some(x), Some(y), Some(scale)) = (a[key].as_f64(), b[key].as_f64(), scale) {
                assert!((x - y).abs() <= 1e-5 * x.abs().max(scale), "{key}: {x} with the forward, {y} precomputed");
            }
        }
    }
    let cached: Vec<_> = std::fs::read_dir(&data)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("train.parquet.llora-reference-"))
        .collect();
    assert_eq!(cached.len(), 1, "{cached:?}");
    let (_, again, log) = run("cached", true);
    assert!(log.contains("read from the cache"), "{log}");
    assert!(again == adapter, "the cached sums train other adapters");
}
