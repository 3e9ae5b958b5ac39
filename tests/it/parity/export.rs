#![allow(deprecated)] // Device::libtorch: burn-tch is deprecated upstream, and it is our backend.
//! What llora writes and evaluates, read by HF transformers + PEFT: adapters that load in PEFT
//! with the same logits, merged and full checkpoints that load in transformers, and `llora eval`
//! against HF + PEFT's loss.
//!
//! Fixtures come from `scripts/peer/fixtures.py` run with the project venv's Python, so that
//! what llora is compared with is computed by the reference libraries (`tests/common/peer.rs`).

use crate::common;

use common::peer::*;

/// An adapter written by llora, loaded by PEFT onto the same base, gives the same logits; and
/// llora reads its own file back to the same values.
#[test]
#[cfg_attr(not(has_peer), ignore = "needs the peer venv: ./scripts/setup.sh --parity")]
fn llora_adapter_loads_in_peft_with_equal_logits() {
    adapter_and_merged_export_load_in_hf(&fixture(
        "tiny-s64-b2",
        &["--preset", "tiny", "--seq-len", "64", "--batch", "2", "--lora-b", "normal", "--steps", "1"],
    ));
}

/// On the Llama-3-style checkpoint, llora's adapter loads in PEFT with the same
/// logits, and its merged export (tied head, llama3 RoPE and eos list in config.json) loads in
/// transformers with them too.
#[test]
#[cfg_attr(not(has_peer), ignore = "needs the peer venv: ./scripts/setup.sh --parity")]
fn llama3_style_adapter_and_merged_export_load_in_hf() {
    let dir = llama3_fixture();
    adapter_and_merged_export_load_in_hf(&dir);
}

/// `llora eval --precision bf16` computes as bf16 training does: its loss is as close to the
/// fp32 loss as HF + PEFT's in bf16 (the parity bound of `bf16_matches_hf_peft_in_bf16`);
/// `--precision fp8 --fp8-weights` runs the FP8 GEMMs and stays within 2% of it.
#[test]
#[cfg_attr(not(has_peer), ignore = "needs the peer venv: ./scripts/setup.sh --parity")]
fn eval_command_computes_in_the_precision_asked() {
    let dir = fixture("tiny-gqa-s96-b2-all-bf16", &bf16_fixture_args(false));
    let fx = load_fixture(&dir);
    let fp32 = fx.json["losses"][0].as_f64().unwrap();
    let peft = fx.json["bf16_loss"].as_f64().unwrap();
    let bf16 = eval_fixture_batch(&dir, &fx, &["--precision", "bf16"])["loss_per_token"].as_f64().unwrap();
    assert!(
        (bf16 - fp32).abs() <= 2.0 * (peft - fp32).abs() + 1e-4 * fp32.abs(),
        "llora eval in bf16 {bf16} is further from fp32 {fp32} than twice PEFT's bf16 {peft}"
    );
    assert_ne!(bf16, eval_fixture_batch(&dir, &fx, &[])["loss_per_token"].as_f64().unwrap(), "bf16 ran as fp32");
    let fp8 =
        eval_fixture_batch(&dir, &fx, &["--precision", "fp8", "--fp8-weights"])["loss_per_token"].as_f64().unwrap();
    assert!(((fp8 - fp32) / fp32).abs() <= 0.02, "FP8 eval {fp8} against fp32 {fp32}");
    assert_ne!(fp8, bf16, "FP8 ran as bf16");
}

/// `llora eval` on HF's batch (written as MLPerf-schema parquet) prints HF + PEFT's loss.
#[test]
#[cfg_attr(not(has_peer), ignore = "needs the peer venv: ./scripts/setup.sh --parity")]
fn eval_command_reports_the_hf_peft_loss() {
    let dir = fixture(
        "tiny-s64-b2",
        &["--preset", "tiny", "--seq-len", "64", "--batch", "2", "--lora-b", "normal", "--steps", "1"],
    );
    let fx = load_fixture(&dir);
    let last = eval_fixture_batch(&dir, &fx, &[]);
    // Past the model's positions is refused, as train and generate refuse it.
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let past = (cfg["max_position_embeddings"].as_u64().unwrap() + 1).to_string();
    let d = dir.to_str().unwrap();
    let out = common::llora(&["eval", "--model", d, "--data", "unused.parquet", "--max-seq-len", &past]);
    let (_, stderr) = common::text(&out);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains(&format!("--max-seq-len {past} is past the model's max_position_embeddings")), "{stderr}");
    let reference = fx.json["losses"][0].as_f64().unwrap();
    let ours = last["loss_per_token"].as_f64().unwrap();
    assert!(((ours - reference) / reference).abs() <= 1e-5, "llora eval {ours} vs HF+PEFT {reference}");
    assert_eq!(last["target_tokens"].as_u64(), fx.json["n_target_tokens"].as_u64());
    assert_eq!(last["samples"], 2);
    // Both samples have the same number of targets, so the two averages coincide here.
    assert!((last["loss_per_sample"].as_f64().unwrap() - ours).abs() <= 1e-5);
}

/// A base written by llora's HF checkpoint writer (what full fine-tuning and the demo's
/// pre-training save) loads in transformers and, with PEFT's adapter, gives HF's loss.
#[test]
#[cfg_attr(not(has_peer), ignore = "needs the peer venv: ./scripts/setup.sh --parity")]
fn saved_hf_checkpoint_loads_in_transformers() {
    let dir = fixture(
        "tiny-s64-b2",
        &["--preset", "tiny", "--seq-len", "64", "--batch", "2", "--lora-b", "normal", "--steps", "1"],
    );
    let fx = load_fixture(&dir);
    let device = Device::libtorch();
    let mut model = HfCheckpoint::open(&dir).unwrap().load_model(&BuildOptions::default(), &device).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let (base, adapter) = (tmp.path().join("base"), tmp.path().join("adapter"));
    llora_model::checkpoint::save_hf_checkpoint(&mut model, &base).unwrap();
    std::fs::create_dir(&adapter).unwrap();
    for f in ["adapter_config.json", "adapter_model.safetensors"] {
        std::fs::copy(dir.join(f), adapter.join(f)).unwrap();
    }
    let out = tmp.path().join("out.safetensors");
    let status = Command::new(python())
        .arg(repo_root().join("scripts/peft_forward.py"))
        .args([&base, &adapter, &dir.join("batch.safetensors"), &out])
        .status()
        .unwrap();
    assert!(status.success(), "peft_forward.py failed on llora's checkpoint");
    let res = read_all(&out);
    let loss = f32::from_le_bytes(res["loss"].1[..4].try_into().unwrap());
    let reference = fx.json["losses"][0].as_f64().unwrap() as f32;
    assert!(
        ((loss - reference) / reference).abs() <= 1e-6,
        "transformers on llora's checkpoint: {loss} vs {reference}"
    );
}

/// A config.json that ties the head to the embedding while the file holds a head of its own
/// (what a transformers-5 save of an untied model relabelled, or a hand-edited config, looks
/// like): transformers 5 keeps the file's head, untied, with a warning, and so does llora, in
/// `llora eval` (the loss HF + PEFT computes on the same files, and the warning) and in `llora
/// export --merged` (its config.json says untied; transformers and llora read the export alike).
#[test]
#[cfg_attr(not(has_peer), ignore = "needs the peer venv: ./scripts/setup.sh --parity")]
fn a_tied_config_with_its_own_head_keeps_the_files_head_as_transformers_does() {
    let fixture = fixture(
        "tiny-s64-b2",
        &["--preset", "tiny", "--seq-len", "64", "--batch", "2", "--lora-b", "normal", "--steps", "1"],
    );
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("tied");
    std::fs::create_dir(&dir).unwrap();
    for f in ["model.safetensors", "adapter_config.json", "adapter_model.safetensors", "batch.safetensors"] {
        std::fs::copy(fixture.join(f), dir.join(f)).unwrap();
    }
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture.join("config.json")).unwrap()).unwrap();
    config["tie_word_embeddings"] = true.into();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let fx = load_fixture(&fixture);
    // transformers takes a directory holding an adapter for the adapter: the base alone.
    let base = base_only_copy(&dir, tmp.path());
    let hf = transformers_loss(&base, &dir, &dir.join("batch.safetensors"), tmp.path());
    let ours = eval_fixture_batch(&dir, &fx, &[])["loss_per_token"].as_f64().unwrap();
    assert!(((ours - hf) / hf).abs() <= 1e-5, "llora eval {ours} vs transformers {hf} on a tied config with a head");
    let tied_loss = fx.json["losses"][0].as_f64().unwrap();
    assert!(
        ((ours - tied_loss) / tied_loss).abs() <= 1e-5,
        "the file's head is the fixture's own: {ours} vs {tied_loss}"
    );
    let out = common::llora(&["eval", "--model", dir.to_str().unwrap(), "--data", "absent.parquet"]);
    let (_, stderr) = common::text(&out);
    assert!(stderr.contains("using the file's head, untied, as transformers does"), "no warning:\n{stderr}");

    let merged = tmp.path().join("merged");
    let out = export_merged(&base, &dir, &merged);
    assert!(out.status.success(), "{}", common::text(&out).1);
    let written: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(merged.join("config.json")).unwrap()).unwrap();
    assert_eq!(written["tie_word_embeddings"], false, "the export says what llora read");
    let hf_merged = transformers_loss(&merged, Path::new("-"), &dir.join("batch.safetensors"), tmp.path());
    assert!(((hf_merged - hf) / hf).abs() <= 1e-5, "transformers on the export {hf_merged} vs on base + adapter {hf}");
}

/// The HF causal-LM loss of `batch` through transformers (+ PEFT with `adapter`; `-`: none).
fn transformers_loss(base: &Path, adapter: &Path, batch: &Path, tmp: &Path) -> f64 {
    let out = tmp.join("hf-loss.safetensors");
    let status = Command::new(python())
        .arg(repo_root().join("scripts/peft_forward.py"))
        .args([base, adapter, batch, &out])
        .status()
        .unwrap();
    assert!(status.success(), "peft_forward.py failed on {}", base.display());
    f32::from_le_bytes(read_all(&out)["loss"].1[..4].try_into().unwrap()) as f64
}
