#![allow(deprecated)] // Device::libtorch: burn-tch is deprecated upstream, and it is our backend.
//! Numerical parity with HF transformers + PEFT in training: loss, logits, every LoRA gradient and
//! three AdamW steps, in fp32 and bf16, with rsLoRA, DoRA, rank/alpha patterns, PEFT's target
//! patterns, GQA, Llama 3 style and fused qkv checkpoints.
//!
//! Fixtures come from `scripts/peer/fixtures.py` run with the project venv's Python, so that
//! what llora is compared with is computed by the reference libraries (`tests/common/peer.rs`).

use crate::common;

use common::peer::*;

#[test]
#[cfg_attr(not(has_peer), ignore = "needs the peer venv: ./scripts/setup.sh --parity")]
fn multi_head_matches_hf_peft() {
    let dir = fixture(
        "tiny-s64-b2",
        &["--preset", "tiny", "--seq-len", "64", "--batch", "2", "--lora-b", "normal", "--steps", "1"],
    );
    check_parity(&dir);
}

#[test]
#[cfg_attr(not(has_peer), ignore = "needs the peer venv: ./scripts/setup.sh --parity")]
fn grouped_query_matches_hf_peft() {
    let dir = fixture(
        "tiny-gqa-s96-b2",
        &["--preset", "tiny-gqa", "--seq-len", "96", "--batch", "2", "--lora-b", "normal", "--steps", "1"],
    );
    check_parity(&dir);
}

/// Per-module ranks and alphas and layer selection, on a GQA checkpoint: PEFT's
/// `rank_pattern` (a suffix key and a full-name key), `alpha_pattern` and `layers_to_transform`
/// give the same loss, logits and LoRA gradients in llora; an adapter llora builds from the same
/// settings loads in PEFT with its logits, and its merged export gives them in transformers.
#[test]
#[cfg_attr(not(has_peer), ignore = "needs the peer venv: ./scripts/setup.sh --parity")]
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
#[cfg_attr(not(has_peer), ignore = "needs the peer venv: ./scripts/setup.sh --parity")]
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
#[cfg_attr(not(has_peer), ignore = "needs the peer venv: ./scripts/setup.sh --parity")]
fn dora_matches_peft_in_training_and_out() {
    let targets = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj";
    let args = ["--preset", "tiny-gqa", "--seq-len", "64", "--batch", "2", "--lora-b", "normal", "--steps", "3"];
    let dir = fixture("tiny-gqa-s64-b2-dora-3steps", &[&args[..], &["--dora", "--targets", targets]].concat());
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("adapter_config.json")).unwrap()).unwrap();
    assert_eq!(config["use_dora"], true, "the fixture is PEFT's DoRA");
    check_parity(&dir);
    three_steps_match_torch_adamw(&dir, FusedOptim::On);
    let targets = targets.split(',').map(String::from).collect();
    adapter_and_merged_export_load_in_hf_with(
        &dir,
        llora_model::LoraSpec { dropout: 0.0, dora: true, targets, ..Default::default() },
    );
}

/// The Llama-3-style checkpoint's hidden states, logits, loss (1e-5) and LoRA
/// gradients equal HF + PEFT's.
#[test]
#[cfg_attr(not(has_peer), ignore = "needs the peer venv: ./scripts/setup.sh --parity")]
fn llama3_style_checkpoint_matches_hf_peft() {
    let dir = llama3_fixture();
    let config = llora_model::LlamaConfig::from_hf_dir(&dir).unwrap();
    assert!(config.rope_scaling.is_some() && config.tie_word_embeddings && config.head_dim * 8 != 256);
    check_parity(&dir);
}

/// Full fine-tuning of a tied-embedding model (Llama 3.2's layout, here the Llama-3-style
/// fixture): the one table's gradient is the sum of its uses as embedding and as head, as
/// torch accumulates it into the shared nn.Parameter; with and without recomputed blocks (whose
/// backward returns the two parts in different segments); no `lm_head` parameter is trained.
#[test]
#[cfg_attr(not(has_peer), ignore = "needs the peer venv: ./scripts/setup.sh --parity")]
fn tied_embedding_full_fine_tuning_gradients_match_transformers() {
    let names = [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
        "model.norm.weight",
    ];
    let hf = assert_full_fine_tuning_gradients_match_transformers(&llama3_fixture(), &names);
    assert_eq!(hf["head_is_embedding"], true);
}

/// Three full optimizer steps (loss, global-norm clip at 0.3, torch AdamW) against PEFT +
/// torch.optim.AdamW: per-step losses and every LoRA weight after each update, with the
/// per-parameter update (the CPU's default) and with LibTorch's multi-tensor kernel (CUDA's).
#[test]
#[cfg_attr(not(has_peer), ignore = "needs the peer venv: ./scripts/setup.sh --parity")]
fn training_steps_match_torch_adamw() {
    let args = ["--preset", "tiny", "--seq-len", "64", "--batch", "2", "--lora-b", "normal", "--steps", "3"];
    let dir = fixture("tiny-s64-b2-3steps", &args);
    three_steps_match_torch_adamw(&dir, FusedOptim::Off);
    three_steps_match_torch_adamw(&dir, FusedOptim::On);
}

/// The 70B MLPerf config's targets (`qkv_proj`, `o_proj`, named for the
/// reference's fused checkpoint) on a GQA checkpoint that stores q, k and v apart (the usual
/// HF layout) adapt q, k, v and o in every layer, the saved adapter_config.json says so, and
/// PEFT loads that adapter onto the same base with the same logits.
#[test]
#[cfg_attr(not(has_peer), ignore = "needs the peer venv: ./scripts/setup.sh --parity")]
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
#[cfg_attr(not(has_peer), ignore = "needs the peer venv: ./scripts/setup.sh --parity")]
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
        let opts =
            StepOptions { lr: 4e-4, clip_grad_norm: 0.3, recompute_layers: 0, sync_phases: false, bucket_bytes: 0 };
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

/// bf16 for real: on a GQA checkpoint with adapters on every target, llora's bf16
/// (bf16 weights, activations and GEMMs; f32 adapters, norm statistics, softmax and loss)
/// against HF transformers + PEFT run in bf16 (the same base rounded to bf16, PEFT's f32
/// adapters), both measured from HF's fp32 run: the loss no further from fp32 than twice PEFT's
/// bf16 distance (+1e-4 relative), every LoRA gradient's cosine with fp32's ≥ 0.999, and the
/// gradients as a whole within 1.25x PEFT's bf16 distance from fp32's (see the bound below).
#[test]
#[cfg_attr(not(has_peer), ignore = "needs the peer venv: ./scripts/setup.sh --parity")]
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
#[cfg_attr(not(has_peer), ignore = "needs the peer venv: ./scripts/setup.sh --parity")]
fn bf16_adapters_match_hf_peft_with_bf16_adapters() {
    let dir = fixture("tiny-gqa-s96-b2-all-bf16-adapters", &bf16_fixture_args(true));
    assert_bf16_near_peft(&dir, llora_model::precision::AdapterCompute::Bf16, 1.25);
}

/// PEFT's adapter of the GQA fixture with its `adapter_config.json` rewritten to select modules
/// by pattern and exclusion (tensors of modules it no longer selects removed, as PEFT would
/// have saved them): llora's logits and merged export equal transformers + PEFT loading the same
/// directory; PEFT's key matching is the reference. Tensors of an excluded module are refused,
/// naming it.
#[test]
#[cfg_attr(not(has_peer), ignore = "needs the peer venv: ./scripts/setup.sh --parity")]
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

/// DPO on LoRA against TRL 1.16's `DPOTrainer` (`scripts/peer/dpo_trl.py`): a fresh PEFT adapter
/// whose B was then set away from zero (so the policy is not the reference from the start), the
/// reference the base with the adapters off, batch 1 (one pair, TRL's own tokenisation of its
/// text), three AdamW steps at a constant learning rate: each step's loss, log-probabilities,
/// rewards and margin (1e-5 of the log-probabilities they are differences of), accuracy and
/// pre-clip gradient norm, step 1's LoRA gradients (clipped, as TRL's optimizer receives them)
/// and the adapter after the last step (AdamW with eps 1e-3, see below) within 1e-5 relative;
/// on a Llama-style and a Qwen-style model, for sigmoid, IPO, hinge and
/// sigmoid with half TRL's SFT term. Every trainable tensor is compared (names checked both ways).
#[test]
#[cfg_attr(not(has_peer), ignore = "needs the peer venv: ./scripts/setup.sh --parity")]
fn dpo_matches_trl_with_the_base_as_reference() {
    for (preset, loss, weights) in [
        ("demo", "sigmoid", None),
        ("demo", "ipo", None),
        ("demo", "hinge", None),
        ("demo", "sigmoid,sft", Some("1.0,0.5")),
        ("tiny-qwen2", "sigmoid", None),
    ] {
        let mut args = vec!["--preset", preset, "--loss", loss, "--beta", "0.1", "--steps", "3"];
        if let Some(w) = weights {
            args.extend(["--weights", w]);
        }
        let dir = fixture_of("dpo_trl.py", &format!("dpo-{preset}-{}", loss.replace(',', "+")), &args);
        check_dpo_against_trl(&dir);
    }
}

/// The same with an existing adapter (B away from zero) as the starting point: TRL keeps a
/// frozen copy of it ("ref") as the reference, and so does llora (`lora.init_from`), so the
/// first step's rewards are zero and the later ones measure what training changed. Checked in
/// the model (as above) and end to end: `llora train` from the adapter on the pair's parquet
/// ends with TRL's adapter after three steps.
#[test]
#[cfg_attr(not(has_peer), ignore = "needs the peer venv: ./scripts/setup.sh --parity")]
fn dpo_matches_trl_with_an_existing_adapter_as_reference() {
    for (preset, loss) in [("demo", "sigmoid"), ("tiny-qwen2", "ipo")] {
        let args = ["--preset", preset, "--loss", loss, "--beta", "0.1", "--steps", "3", "--reference", "adapter"];
        let dir = fixture_of("dpo_trl.py", &format!("dpo-ref-{preset}-{loss}"), &args);
        check_dpo_against_trl(&dir);
        train_from_the_adapter_as_trl(&dir);
    }
}

/// `llora eval --dpo-beta B --dpo-loss L [--dpo-sft-weight W]` on the fixture's pair, written as
/// `llora data prepare --format preference` writes pairs, with the fixture's adapter: TRL's
/// metrics before its first step (loss, log-probabilities, rewards, margin, accuracy), within
/// the training check's bounds.
fn eval_cli_matches_trl(dir: &Path, rows: &[Vec<i64>; 2], prompt: usize, fx: &serde_json::Value) {
    let tmp = tempfile::tempdir().unwrap();
    let data = pair_parquet(tmp.path(), rows, prompt);
    let types: Vec<&str> = fx["loss_type"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    let sft = types.iter().position(|t| *t == "sft").map(|i| fx["loss_weights"][i].as_f64().unwrap().to_string());
    let beta = fx["beta"].as_f64().unwrap();
    let (d, data) = (dir.to_str().unwrap(), data.to_str().unwrap());
    let beta_arg = beta.to_string();
    let mut args = vec!["eval", "--model", d, "--adapter", d, "--data", data];
    args.extend(["--dpo-beta", &beta_arg, "--dpo-loss", types[0]]);
    if let Some(w) = &sft {
        args.extend(["--dpo-sft-weight", w]);
    }
    let out = crate::common::llora(&args);
    let (stdout, stderr) = crate::common::text(&out);
    assert!(out.status.success(), "{}: llora eval {args:?}: {stderr}", dir.display());
    let got: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    let log = &fx["logs"][0];
    let (ours, at) = (|k: &str| got[k].as_f64().unwrap(), |k: &str| log[k].as_f64().unwrap());
    let scale = beta * at("logps/chosen").abs().max(at("logps/rejected").abs());
    for (mine, theirs, bound) in [
        ("loss", "loss", 1e-5 * at("loss").abs().max(1e-3)),
        ("logps_chosen", "logps/chosen", 1e-5 * at("logps/chosen").abs()),
        ("logps_rejected", "logps/rejected", 1e-5 * at("logps/rejected").abs()),
        ("rewards_chosen", "rewards/chosen", 1e-5 * scale),
        ("rewards_rejected", "rewards/rejected", 1e-5 * scale),
        ("rewards_margin", "rewards/margins", 1e-5 * scale),
        ("rewards_accuracy", "rewards/accuracies", 0.0),
    ] {
        let (a, b) = (ours(mine), at(theirs));
        assert!((a - b).abs() <= bound, "{}: llora eval's {mine} {a}, TRL's {theirs} {b}", dir.display());
    }
    assert_eq!(got["pairs"], 1, "{got}");
}

/// The fixture's pair as `llora data prepare --format preference` writes pairs (`rows`: prompt +
/// chosen, prompt + rejected; labels on the completions), in `dir/pairs.parquet`.
fn pair_parquet(dir: &Path, rows: &[Vec<i64>; 2], prompt: usize) -> PathBuf {
    let sample = |row: &Vec<i64>| llora_data::Sample {
        input_ids: row.iter().map(|&t| t as u32).collect(),
        labels: row.iter().enumerate().map(|(i, &t)| if i >= prompt { t } else { -100 }).collect(),
    };
    let pair = llora_data::preference::Pair { chosen: sample(&rows[0]), rejected: sample(&rows[1]), reference: None };
    let data = dir.join("pairs.parquet");
    std::fs::write(&data, llora_data::preference::pairs_parquet_bytes(&[pair]).unwrap()).unwrap();
    data
}

/// `llora train` with `lora.init_from` = the fixture's adapter, DPO on its pair with TRL's
/// hyperparameters (the cosine over 10⁹ steps is TRL's constant rate to 1e-17; the run stops
/// after 3 pairs on an evaluation it passes), ends with TRL's adapter after three steps, each
/// tensor within 1e-5 relative.
fn train_from_the_adapter_as_trl(dir: &Path) {
    let fx: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let ids = |k: &str| fx[k].as_array().unwrap().iter().map(|v| v.as_i64().unwrap()).collect::<Vec<i64>>();
    let prompt = ids("prompt_ids");
    let rows = [[prompt.clone(), ids("chosen_ids")].concat(), [prompt.clone(), ids("rejected_ids")].concat()];
    let tmp = tempfile::tempdir().unwrap();
    let data = pair_parquet(tmp.path(), &rows, prompt.len());
    let text = std::fs::read_to_string(repo_root().join("configs/tiny-cpu.toml")).unwrap();
    let mut config: toml::Table = toml::from_str(&text).unwrap();
    let model = config.get_mut("model").unwrap().as_table_mut().unwrap();
    model.remove("pretrain");
    model.remove("preset");
    model.insert("path".into(), dir.display().to_string().into());
    config.get_mut("data").unwrap().as_table_mut().unwrap().remove("synthetic");
    let path = tmp.path().join("config.toml");
    std::fs::write(&path, toml::to_string(&config).unwrap()).unwrap();
    let (run, data) = (tmp.path().join("run"), data.display().to_string());
    let targets: Vec<String> = fx["lora"]["targets"].as_array().unwrap().iter().map(|t| t.to_string()).collect();
    let f = |k: &str| fx[k].as_f64().unwrap();
    let sets = [
        format!("run.dir=\"{}\"", run.display()),
        format!("lora.init_from=\"{}\"", dir.display()),
        format!("lora.rank={}", fx["lora"]["r"]),
        format!("lora.alpha={}", fx["lora"]["alpha"]),
        "lora.dropout=0.0".into(),
        format!("lora.targets=[{}]", targets.join(",")),
        "train.objective=\"dpo\"".into(),
        format!("dpo.beta={}", f("beta")),
        format!("dpo.loss={}", fx["loss_type"][0]),
        format!("data.train=\"{data}\""),
        format!("data.eval=\"{data}\""),
        "data.max_seq_len=128".into(),
        "train.global_batch_size=1".into(),
        format!("optim.lr={}", f("lr")),
        format!("optim.weight_decay={}", f("weight_decay")),
        format!("optim.eps={}", f("adam_eps")),
        format!("optim.clip_grad_norm={}", f("max_grad_norm")),
        "schedule.max_steps=1000000000".into(),
        "eval.every_samples=3".into(),
        "eval.target_loss=100.0".into(),
        "mlperf.check=false".into(),
    ];
    let args = crate::common::train_args(&path.display().to_string(), sets);
    let out = crate::common::llora(&crate::common::strs(&args));
    let (_, stderr) = crate::common::text(&out);
    assert!(out.status.success(), "{}: {stderr}", dir.display());
    let ours = read_all(&run.join("adapter/adapter_model.safetensors"));
    let theirs = read_all(&dir.join("expected.safetensors"));
    let f32s = |b: &[u8]| b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect::<Vec<f32>>();
    let mut checked = 0;
    for (name, (_, bytes, _)) in theirs.iter().filter(|(n, _)| n.starts_with("after.")) {
        let key = name.strip_prefix("after.").unwrap();
        let (_, mine, _) = ours.get(key).unwrap_or_else(|| panic!("{}: the run saved no {key}", dir.display()));
        let err = rel_err(&f32s(mine), &f32s(bytes));
        assert!(err <= 1e-5, "{}: llora train's {key} after 3 steps: relative error {err:e}", dir.display());
        checked += 1;
    }
    assert!(checked > 0 && checked == ours.len(), "{checked} of {} tensors compared", ours.len());
}

/// DPO in bf16 (bf16 activations and base GEMMs, f32 adapter masters) against TRL's fp32 step
/// and TRL's own bf16 autocast: llora's first-step loss, log-probabilities and LoRA gradients
/// are within twice TRL's bf16 distance from TRL's fp32 (+1e-4 relative for the scalars).
#[test]
#[cfg_attr(not(has_peer), ignore = "needs the peer venv: ./scripts/setup.sh --parity")]
fn dpo_in_bf16_is_within_twice_trls_bf16_distance() {
    let args = ["--preset", "demo", "--loss", "sigmoid", "--beta", "0.1", "--steps", "1"];
    let fp32 = fixture_of("dpo_trl.py", "dpo-1step-demo-sigmoid", &args);
    let bf16 = fixture_of("dpo_trl.py", "dpo-1step-demo-sigmoid-bf16", &[&args[..], &["--bf16"]].concat());
    let _rng = llora_model::device::torch_rng_lock();
    let json = |d: &Path| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(d.join("expected.json")).unwrap()).unwrap()
    };
    let (fx, fx_bf16) = (json(&fp32), json(&bf16));
    let device = Device::libtorch().autodiff();
    let mut model = HfCheckpoint::open(&fp32).unwrap().load_model(&BuildOptions::default(), &device).unwrap();
    load_peft_adapter(&mut model, &fp32, &device).unwrap();
    let spec =
        llora_model::precision::PrecisionSpec { compute: llora_model::precision::Compute::Bf16, ..Default::default() };
    model.set_precision(&spec).unwrap();
    let (beta, losses) = trl_objective(&fx);
    let objective = llora_model::PreferenceObjective { beta, losses, reference: llora_model::Reference::Base };
    let (g, stats) = model.preference_loss_and_grads(TrlPair::of(&fx).batch(&device), &objective, 1.0).unwrap();
    let (at, at_bf16) =
        (|k: &str| fx["logs"][0][k].as_f64().unwrap(), |k: &str| fx_bf16["logs"][0][k].as_f64().unwrap());
    let loss = f64::from(g.loss.clone().into_scalar::<f32>());
    for (name, ours) in [("loss", loss), ("logps/chosen", stats.logps_chosen), ("logps/rejected", stats.logps_rejected)]
    {
        let (want, trl) = (at(name), at_bf16(name));
        eprintln!("{name}: fp32 {want}, TRL bf16 {trl} ({:+e}), llora bf16 {ours} ({:+e})", trl - want, ours - want);
        assert!((ours - want).abs() <= 2.0 * (trl - want).abs() + 1e-4 * want.abs(), "{name}: llora bf16 {ours}");
    }
    // The gradients as the optimizer gets them (each side clipped by its own norm), all together.
    let grads: Vec<f32> = g.grads.iter().flat_map(|t| values(t.clone())).collect();
    let norm = grads.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>().sqrt();
    let coef = llora_trainer::engine::optim::clip_coefficient(norm, fx["max_grad_norm"].as_f64().unwrap()) as f32;
    let ours: Vec<f32> = grads.iter().map(|v| v * coef).collect();
    let names: Vec<String> = model.trainable_params_mut().into_iter().map(|(n, _)| n).collect();
    let stacked = |d: &Path| -> Vec<f32> {
        let all = read_all(&d.join("expected.safetensors"));
        names
            .iter()
            .flat_map(|n| {
                let (_, bytes, _) = &all[&format!("step1.grad.{n}")];
                bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect::<Vec<_>>()
            })
            .collect()
    };
    let (want, trl) = (stacked(&fp32), stacked(&bf16));
    let (d_ours, d_trl) = (rel_err(&ours, &want), rel_err(&trl, &want));
    eprintln!("LoRA gradients, relative distance from TRL fp32: llora bf16 {d_ours:e}, TRL bf16 {d_trl:e}");
    assert!(
        d_ours <= 2.0 * d_trl,
        "llora's bf16 gradients ({d_ours:e}) are further from fp32 than twice TRL's ({d_trl:e})"
    );
}

/// The fixture's pair as TRL's collator lays it out: prompt + chosen, prompt + rejected,
/// right-padded to `seq`, labels −100 outside the completions.
struct TrlPair {
    rows: [Vec<i64>; 2],
    prompt: usize,
    seq: usize,
    ids: Vec<i64>,
    labels: Vec<i64>,
}

impl TrlPair {
    fn of(fx: &serde_json::Value) -> Self {
        let ids = |k: &str| fx[k].as_array().unwrap().iter().map(|v| v.as_i64().unwrap()).collect::<Vec<i64>>();
        let (prompt, pad) = (ids("prompt_ids"), fx["pad_token_id"].as_i64().unwrap());
        let rows = [[prompt.clone(), ids("chosen_ids")].concat(), [prompt.clone(), ids("rejected_ids")].concat()];
        let seq = rows.iter().map(Vec::len).max().unwrap();
        let (mut flat_ids, mut labels) = (Vec::new(), Vec::new());
        for row in &rows {
            for t in 0..seq {
                flat_ids.push(row.get(t).copied().unwrap_or(pad));
                labels.push(if t >= prompt.len() && t < row.len() { row[t] } else { -100 });
            }
        }
        Self { prompt: prompt.len(), rows, seq, ids: flat_ids, labels }
    }

    fn batch(&self, device: &Device) -> MicroBatch {
        MicroBatch {
            ids: Tensor::<2, Int>::from_data(TensorData::new(self.ids.clone(), [2, self.seq]), device),
            labels: Tensor::<2, Int>::from_data(TensorData::new(self.labels.clone(), [2, self.seq]), device).into(),
            packed: None,
            seed: None,
        }
    }
}

/// TRL's β and its losses with their weights, as the fixture ran them.
fn trl_objective(fx: &serde_json::Value) -> (f64, Vec<(llora_model::PreferenceLoss, f64)>) {
    use llora_model::PreferenceLoss;
    let kind = |name: &str| match name {
        "sigmoid" => PreferenceLoss::Sigmoid,
        "ipo" => PreferenceLoss::Ipo,
        "hinge" => PreferenceLoss::Hinge,
        "sft" => PreferenceLoss::Sft,
        other => panic!("no {other}"),
    };
    let types: Vec<&str> = fx["loss_type"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    let weights: Vec<f64> = match fx["loss_weights"].as_array() {
        Some(w) => w.iter().map(|v| v.as_f64().unwrap()).collect(),
        None => vec![1.0; types.len()],
    };
    (fx["beta"].as_f64().unwrap(), types.iter().map(|t| kind(t)).zip(weights).collect())
}

fn check_dpo_against_trl(dir: &Path) {
    use llora_model::PreferenceObjective;
    use llora_trainer::engine::optim::clip_coefficient;
    let _rng = llora_model::device::torch_rng_lock();
    let fx: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let bytes = std::fs::read(dir.join("expected.safetensors")).unwrap();
    let expected = SafeTensors::deserialize(&bytes).unwrap();
    let reference = |key: &str| -> Vec<f32> {
        let t = expected.tensor(key).unwrap_or_else(|_| panic!("{}: no {key}", dir.display()));
        t.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
    };
    let device = Device::libtorch().autodiff();
    let mut model = HfCheckpoint::open(dir).unwrap().load_model(&BuildOptions::default(), &device).unwrap();
    load_peft_adapter(&mut model, dir, &device).unwrap();
    let pair = TrlPair::of(&fx);
    let (rows, prompt) = (pair.rows.clone(), pair.prompt);
    let batch = || pair.batch(&device);
    let (beta, losses) = trl_objective(&fx);
    let objective = PreferenceObjective {
        beta,
        losses,
        reference: match fx["reference"].as_str() {
            Some("adapter") => llora_model::Reference::Adapters(std::sync::Arc::new(model.frozen_trainable_values())),
            _ => llora_model::Reference::Base,
        },
    };
    if fx["reference"] != "adapter" {
        // `llora eval` measures an adapter against the base.
        eval_cli_matches_trl(dir, &rows, prompt, &fx);
    }
    let (lr, clip) = (fx["lr"].as_f64().unwrap(), fx["max_grad_norm"].as_f64().unwrap());
    let weight_decay = fx["weight_decay"].as_f64().unwrap();
    let config = OptimConfig { lr, weight_decay, eps: fx["adam_eps"].as_f64().unwrap(), ..OptimConfig::default() };
    let mut optim = AdamW::new(config);
    let close = |got: f64, want: f64, what: &str| {
        assert!(
            (got - want).abs() <= 1e-5 * want.abs().max(1e-3),
            "{}: {what}: llora {got}, TRL {want}",
            dir.display()
        );
    };
    for (step, log) in fx["logs"].as_array().unwrap().iter().enumerate() {
        let (g, stats) = model.preference_loss_and_grads(batch(), &objective, 1.0).unwrap();
        let at = |k: &str| log[k].as_f64().unwrap();
        close(f64::from(g.loss.clone().into_scalar::<f32>()), at("loss"), &format!("step {} loss", step + 1));
        for (name, ours) in [("logps/chosen", stats.logps_chosen), ("logps/rejected", stats.logps_rejected)] {
            close(ours, at(name), &format!("step {} {name}", step + 1));
        }
        // A reward is β times a difference of two log-probabilities that nearly cancel: held to
        // 1e-5 of the log-probabilities it is made of.
        let scale = objective.beta * at("logps/chosen").abs().max(at("logps/rejected").abs());
        for (name, ours) in [
            ("rewards/chosen", stats.rewards_chosen),
            ("rewards/rejected", stats.rewards_rejected),
            ("rewards/margins", stats.rewards_margin),
        ] {
            let want = at(name);
            assert!(
                (ours - want).abs() <= 1e-5 * scale,
                "{}: step {} {name}: llora {ours}, TRL {want}",
                dir.display(),
                step + 1
            );
        }
        assert_eq!(stats.rewards_accuracy, at("rewards/accuracies"), "step {}", step + 1);
        let grads: Vec<Vec<f32>> = g.grads.iter().map(|t| values(t.clone())).collect();
        let norm = grads.iter().flatten().map(|v| f64::from(*v).powi(2)).sum::<f64>().sqrt();
        close(norm, at("grad_norm"), &format!("step {} gradient norm", step + 1));
        if step == 0 {
            // TRL's callback sees them as the optimizer does: clipped.
            let coef = clip_coefficient(norm, clip) as f32;
            let names: Vec<String> = model.trainable_params_mut().into_iter().map(|(n, _)| n).collect();
            for (name, ours) in names.iter().zip(&grads) {
                let clipped: Vec<f32> = ours.iter().map(|v| v * coef).collect();
                let err = rel_err(&clipped, &reference(&format!("step1.grad.{name}")));
                assert!(err <= 1e-5, "{}: step 1 gradient of {name}: relative error {err:e}", dir.display());
            }
        }
        optim.step(model.trainable_params_mut(), g.grads, clip_coefficient(norm, clip), lr).unwrap();
    }
    // AdamW with eps 1e-3 (the peer's default): at 1e-8 its first steps are ~lr·sign(g) per
    // element, and an element whose gradient is ~0 moves by up to lr on a rounding difference;
    // with 1e-3 the update follows g, so the weights compare all three steps' gradients.
    let (mut worst, mut checked) = (0f32, 0);
    for (name, p) in model.trainable_params_mut() {
        let err = rel_err(&values(p.flat()), &reference(&format!("after.{name}")));
        worst = worst.max(err);
        assert!(err <= 1e-5, "{}: {name} after the last step: relative error {err:e}", dir.display());
        checked += 1;
    }
    assert_eq!(
        checked,
        expected.names().iter().filter(|n| n.starts_with("after.")).count(),
        "the same tensors trained"
    );
    eprintln!("{}: adapters after the last step within {worst:e} of TRL's", dir.display());
}
