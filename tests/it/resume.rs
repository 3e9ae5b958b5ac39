//! Resumed = uninterrupted: a run stopped by SIGKILL, and resumed from its last checkpoint, ends
//! with bitwise the adapters of the same run left alone, in every precision and data layout
//! that keeps state (FP8 scales, DoRA magnitudes, packing windows, preference pairs). The other
//! interruptions (damaged checkpoints, a full disk, preemption: `faults`; a lost rank or node:
//! `dist`) end with the same check, [`same_adapters`].

use crate::common;
use common::{checkpoint_step, llora, random_base_config, short_run_args, strs, text};
use std::path::Path;

/// The adapter file of a run directory, as bytes.
pub fn adapter(run: &Path) -> Vec<u8> {
    let f = run.join("adapter/adapter_model.safetensors");
    std::fs::read(&f).unwrap_or_else(|e| panic!("{}: {e}", f.display()))
}

/// The check every interrupted run ends with: its adapters are, byte for byte, those of the
/// uninterrupted run `whole` (`after` says what interrupted it, for the failure message).
pub fn same_adapters(whole: &Path, resumed: &Path, after: &str) {
    assert!(adapter(whole) == adapter(resumed), "adapters differ from the uninterrupted run's after {after}");
}

/// A run SIGKILLed after a step chosen by the seed and resumed from its
/// last checkpoint ends with bitwise the same adapters as an uninterrupted run (CPU, one thread).
#[test]
fn sigkilled_run_resumes_to_the_same_adapters() {
    kill_and_resume(&[]);
}

/// The same in FP8: the delayed-scaling state (amax histories, scales) is in the checkpoint,
/// or the resumed steps would quantise with other scales and the adapters would differ.
#[test]
fn sigkilled_fp8_run_resumes_to_the_same_adapters() {
    let dir =
        kill_and_resume(&["precision.compute=\"fp8\"", "precision.fp8_activations=true", "precision.fp8_weights=true"]);
    let checkpoint = common::newest_checkpoint(&dir.path().join("killed")).unwrap();
    let scales = std::fs::read_to_string(checkpoint.join("fp8_scales.json")).unwrap();
    let scales: serde_json::Value = serde_json::from_str(&scales).unwrap();
    let q = &scales["model.layers.0.self_attn.q_proj"];
    assert_eq!(q["grad"]["format"], "E5M2");
    assert_eq!(q["input"]["history"].as_array().unwrap().len(), 4, "history_len 4 after 12 steps");
    // The adapters' GEMMs run in bf16 under FP8 compute: they have no scales.
    assert!(scales.get("model.layers.0.self_attn.q_proj.lora_A").is_none(), "{scales}");
}

/// The same with DoRA in bf16: the magnitudes and their moments are in the
/// checkpoint, and the dropout branch's second base GEMM redraws the same mask on resume; the
/// adapter says `use_dora` and carries a magnitude per adapted module.
#[test]
fn sigkilled_dora_bf16_run_resumes_to_the_same_adapters() {
    let dir = kill_and_resume(&["lora.dora=true", "precision.compute=\"bf16\""]);
    let adapter = dir.path().join("whole/adapter");
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(adapter.join("adapter_config.json")).unwrap()).unwrap();
    assert_eq!(config["use_dora"], true);
    let bytes = std::fs::read(adapter.join("adapter_model.safetensors")).unwrap();
    let tensors = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let names = tensors.names();
    let count = |suffix: &str| names.iter().filter(|n| n.ends_with(suffix)).count();
    assert!(count("lora_A.weight") > 0);
    assert_eq!(count("lora_magnitude_vector"), count("lora_A.weight"), "{names:?}");
}

/// The same with packed rows: the data position inside a packing window (its start and
/// the rows taken) is in the checkpoint, so the resumed run packs and trains the same rows; the
/// steps took more documents than rows.
#[test]
fn sigkilled_packed_run_resumes_to_the_same_adapters() {
    let dir = kill_and_resume(&["data.packing=true", "data.max_seq_len=512"]);
    let metrics = std::fs::read_to_string(dir.path().join("whole/metrics.jsonl")).unwrap();
    let documents: Vec<u64> = metrics
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["documents"].as_u64())
        .collect();
    assert_eq!(documents.len(), 12, "{metrics}");
    assert!(documents.iter().all(|&d| d > 8), "every step's 8 rows hold more documents than rows: {documents:?}");
}

/// The same for preference tuning: the pairs' order position is the samples' (a pair is a
/// sample of the schedule), and the reference needs no state of its own (the base, adapters off).
#[test]
fn sigkilled_dpo_run_resumes_to_the_same_adapters() {
    kill_and_resume(&["train.objective=\"dpo\"", "mlperf.check=false"]);
}

/// The same in FP8 with the CPU standing in for CUDA (`LLORA_CUDA_ROUTES_ON_CPU=1`): every
/// route's first-use check runs again in the resumed run's first step, inside its first block,
/// where the dropout seeds are drawn (the adapters' dropout on our kernel's route); the checks'
/// random inputs must leave the generator those seeds come from where it was, or that step
/// drops other elements than the uninterrupted run's.
#[test]
fn sigkilled_fp8_run_on_the_cuda_routes_resumes_to_the_same_adapters() {
    let sets = ["precision.compute=\"fp8\"", "precision.fp8_activations=true", "precision.fp8_weights=true"];
    kill_and_resume_with(&[("LLORA_CUDA_ROUTES_ON_CPU", "1")], &sets);
}

fn kill_and_resume(sets: &[&str]) -> tempfile::TempDir {
    kill_and_resume_with(&[], sets)
}

/// [`kill_and_resume`] with `env` set for every run.
fn kill_and_resume_with(env: &[(&str, &str)], sets: &[&str]) -> tempfile::TempDir {
    let llora =
        |args: &[&str]| common::llora_command(&common::root(), args).envs(env.iter().copied()).output().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = random_base_config(dir.path());
    let (whole, killed) = (dir.path().join("whole"), dir.path().join("killed"));
    let extra = |mut args: Vec<String>| {
        for s in sets {
            args.extend(["--set".into(), s.to_string()]);
        }
        args
    };
    let out = llora(&strs(&extra(short_run_args(&config, &whole))));
    assert!(whole.join("adapter/adapter_model.safetensors").is_file(), "{}", text(&out).1);

    // The run SIGKILLs itself after step 2..=10 (LLORA_FAULT_KILL_AT_STEP), before that step's
    // checkpoint: the step comes from LLORA_TEST_SEED, else the clock, and every failure names
    // the seed to replay it with.
    let seed: u64 = std::env::var("LLORA_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        u64::from(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos())
    });
    let kill_at = 2 + seed % 9;
    let replay = format!("kill after step {kill_at}; replay with LLORA_TEST_SEED={seed}");
    let mut args = extra(short_run_args(&config, &killed));
    args.extend(["--set".into(), "run.checkpoint_every=1".into()]);
    let status = common::llora_command(&common::root(), &strs(&args))
        .envs(env.iter().copied())
        .env("LLORA_FAULT_KILL_AT_STEP", kill_at.to_string())
        .stderr(std::process::Stdio::null())
        .status()
        .unwrap();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(9), "the run was not SIGKILLed ({status}); {replay}");
    let at = checkpoint_step(&killed).unwrap();
    assert_eq!(at, kill_at - 1, "the last checkpoint is the step before the kill; {replay}");

    let out = llora(&["train", "--resume", killed.to_str().unwrap()]);
    let (stdout, stderr) = text(&out);
    assert!(stdout.contains("samples: 96"), "resumed from step {at} ({replay}):\n{stdout}\n{stderr}");
    same_adapters(&whole, &killed, &format!("a SIGKILL after step {kill_at} and resume ({sets:?}; {replay})"));
    // The resumed run continued the same metrics file: steps 1..=12 once each, also those the
    // killed run made after its checkpoint (made again by the resumed run).
    let metrics = std::fs::read_to_string(killed.join("metrics.jsonl")).unwrap();
    let steps: Vec<u64> = metrics
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|r| r.get("loss").is_some())
        .map(|r| r["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, (1..=12).collect::<Vec<_>>(), "{replay}");
    dir
}

/// Preference tuning from an existing adapter resumes against the same frozen reference: the
/// checkpoint records the adapter's fingerprint, and a resume after the adapter file changed is
/// refused naming `lora.init_from` (nothing trained against another reference); with the
/// adapter put back it resumes.
#[test]
fn a_changed_reference_adapter_is_refused_on_resume() {
    let dir = tempfile::tempdir().unwrap();
    let config = random_base_config(dir.path());
    let sft = |name: &str, steps: &str| {
        let run = dir.path().join(name);
        let mut args = short_run_args(&config, &run);
        args.extend(["--set".into(), format!("schedule.max_steps={steps}")]);
        let out = llora(&strs(&args));
        // Short of the target: "aborted", with its adapter saved.
        assert!(run.join("adapter/adapter_model.safetensors").is_file(), "{}", text(&out).1);
        run.join("adapter")
    };
    let (start, other) = (sft("sft", "2"), sft("other", "3"));
    let dpo = dir.path().join("dpo");
    let mut args = short_run_args(&config, &dpo);
    for set in [
        "train.objective=\"dpo\"".to_string(),
        "mlperf.check=false".into(),
        format!("lora.init_from=\"{}\"", start.display()),
        "run.checkpoint_every=1".into(),
    ] {
        args.extend(["--set".into(), set]);
    }
    let status = common::llora_command(&common::root(), &strs(&args))
        .env("LLORA_FAULT_KILL_AT_STEP", "3")
        .stderr(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(!status.success() && checkpoint_step(&dpo) == Some(2), "{status}");
    let file = start.join("adapter_model.safetensors");
    let original = std::fs::read(&file).unwrap();
    std::fs::copy(other.join("adapter_model.safetensors"), &file).unwrap();
    let out = llora(&["train", "--resume", dpo.to_str().unwrap()]);
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("lora.init_from") && stderr.contains("changed since the run started"), "{stderr}");
    assert_eq!(checkpoint_step(&dpo), Some(2), "nothing trained");
    std::fs::write(&file, original).unwrap();
    let out = llora(&["train", "--resume", dpo.to_str().unwrap()]);
    let (stdout, stderr) = text(&out);
    assert!(stdout.contains("samples: 96"), "the resumed run did not train to its end:\n{stdout}\n{stderr}");
}
