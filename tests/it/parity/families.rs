#![allow(deprecated)] // Device::libtorch: burn-tch is deprecated upstream, and it is our backend.
//! Qwen 2 / 2.5, Qwen 3 and Mistral checkpoints against HF transformers + PEFT: small models of
//! each family made by transformers (its own config class and initialisation, biases and q/k
//! norm gains moved away from 0 and 1, sliding windows shorter than the rows), LoRA on every
//! linear; llora's hidden states, logits, loss and every LoRA gradient equal theirs (fp32: loss
//! and each gradient within 1e-5 relative).

use crate::common;

use common::peer::*;
use llora_model::{LlamaConfig, ModelType};

/// The fixture of a family preset (`scripts/peer/recipe.py`'s `FAMILIES`): 64-token rows, LoRA
/// on the seven linears with B away from zero.
fn family_fixture(preset: &str) -> PathBuf {
    let targets = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj";
    let args = ["--preset", preset, "--seq-len", "64", "--batch", "2", "--lora-b", "normal", "--steps", "1"];
    fixture(&format!("{preset}-s64-b2"), &[&args[..], &["--targets", targets]].concat())
}

/// Qwen 2: biases on q, k and v (none on o), tied embeddings, rope_theta 1e6, a 24-token window
/// on layer 1 only (`max_window_layers` = 1).
#[test]
#[cfg_attr(not(has_peer), ignore = "needs the peer venv: ./scripts/setup.sh --parity")]
fn qwen2_matches_hf_peft() {
    let dir = family_fixture("tiny-qwen2");
    let c = LlamaConfig::from_hf_dir(&dir).unwrap();
    assert_eq!(LlamaConfig::preset("tiny-qwen2").unwrap(), c, "the preset is the fixture's model");
    let f = &c.family;
    assert_eq!(f.model_type, ModelType::Qwen2);
    assert!(f.qkv_bias && !f.o_bias && !f.qk_norm && c.tie_word_embeddings && c.rope_theta == 1e6);
    assert_eq!((f.window_of(0), f.window_of(1)), (None, Some(24)));
    let worst = check_parity(&dir);
    assert!(worst <= 1e-5, "worst LoRA gradient relative error {worst:e}");
}

/// Qwen 3: per-head RMSNorm of q and k (gains away from 1), head_dim 40 (not d / heads = 32),
/// no biases, a 20-token window on layer 1.
#[test]
#[cfg_attr(not(has_peer), ignore = "needs the peer venv: ./scripts/setup.sh --parity")]
fn qwen3_matches_hf_peft() {
    let dir = family_fixture("tiny-qwen3");
    let c = LlamaConfig::from_hf_dir(&dir).unwrap();
    assert_eq!(LlamaConfig::preset("tiny-qwen3").unwrap(), c, "the preset is the fixture's model");
    let f = &c.family;
    assert_eq!(f.model_type, ModelType::Qwen3);
    assert!(f.qk_norm && !f.qkv_bias && c.head_dim == 40);
    assert_eq!((f.window_of(0), f.window_of(1)), (None, Some(20)));
    let worst = check_parity(&dir);
    assert!(worst <= 1e-5, "worst LoRA gradient relative error {worst:e}");
}

/// Mistral: a 16-token window on every layer, head_dim 24.
#[test]
#[cfg_attr(not(has_peer), ignore = "needs the peer venv: ./scripts/setup.sh --parity")]
fn mistral_matches_hf_peft() {
    let dir = family_fixture("tiny-mistral");
    let c = LlamaConfig::from_hf_dir(&dir).unwrap();
    assert_eq!(LlamaConfig::preset("tiny-mistral").unwrap(), c, "the preset is the fixture's model");
    assert_eq!(c.family.model_type, ModelType::Mistral);
    assert_eq!((c.family.window_of(0), c.family.window_of(1), c.head_dim), (Some(16), Some(16), 24));
    let worst = check_parity(&dir);
    assert!(worst <= 1e-5, "worst LoRA gradient relative error {worst:e}");
}

/// PEFT's rank and alpha patterns and layer selection on Qwen 3 (LoRA on all seven linears of its
/// windowed layer 1 only; a suffix key, a full-name key, an MLP key): loss, logits and every LoRA
/// gradient equal HF + PEFT's within 1e-5, with the patterns' ranks.
#[test]
#[cfg_attr(not(has_peer), ignore = "needs the peer venv: ./scripts/setup.sh --parity")]
fn rank_alpha_patterns_on_qwen3_match_peft() {
    let targets = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj";
    let args = ["--preset", "tiny-qwen3", "--seq-len", "64", "--batch", "2", "--lora-b", "normal", "--steps", "1"];
    let patterns = [
        "--targets",
        targets,
        "--rank-pattern",
        r#"{"v_proj": 4, "layers.1.self_attn.q_proj": 8, "down_proj": 2}"#,
        "--alpha-pattern",
        r#"{"o_proj": 8, "up_proj": 4}"#,
        "--layers",
        "1",
    ];
    let dir = fixture("tiny-qwen3-s64-b2-patterns", &[&args[..], &patterns].concat());
    let worst = check_parity(&dir);
    assert!(worst <= 1e-5, "worst LoRA gradient relative error {worst:e}");
    let device = Device::libtorch();
    let mut model = HfCheckpoint::open(&dir).unwrap().load_model(&BuildOptions::default(), &device).unwrap();
    load_peft_adapter(&mut model, &dir, &device).unwrap();
    let ranks: Vec<(String, usize)> =
        model.adapters().iter().map(|(n, a)| (n.rsplit('.').next().unwrap().to_string(), a.a.dims()[0])).collect();
    let want = [("q_proj", 8), ("k_proj", 16), ("v_proj", 4), ("o_proj", 16), ("gate_proj", 16), ("up_proj", 16)];
    let want: Vec<(String, usize)> = want.iter().chain(&[("down_proj", 2)]).map(|(n, r)| (n.to_string(), *r)).collect();
    assert_eq!(ranks, want, "layer 1 only, with the patterns' ranks");
}

/// Full fine-tuning of Qwen 2 (its q/k/v biases trained) and Qwen 3 (its q/k head norms
/// trained): transformers' loss and the gradients of those parameters (and a weight, the final
/// norm) within 1e-4, with and without recomputed blocks.
#[test]
#[cfg_attr(not(has_peer), ignore = "needs the peer venv: ./scripts/setup.sh --parity")]
fn full_fine_tuning_trains_biases_and_head_norms_as_transformers() {
    let qwen2 = ["model.layers.1.self_attn.q_proj.bias", "model.layers.0.self_attn.v_proj.bias", "model.norm.weight"];
    let qwen3 = [
        "model.layers.1.self_attn.q_norm.weight",
        "model.layers.0.self_attn.k_norm.weight",
        "model.layers.1.self_attn.k_proj.weight",
    ];
    for (preset, names) in [("tiny-qwen2", &qwen2), ("tiny-qwen3", &qwen3)] {
        eprintln!("{preset}:");
        assert_full_fine_tuning_gradients_match_transformers(&family_fixture(preset), names);
    }
}

/// Each family's adapter written by llora loads in PEFT onto the HF model with llora's logits,
/// and the merged export (biases, q/k norms and the family's config.json carried) loads in
/// transformers with them too.
#[test]
#[cfg_attr(not(has_peer), ignore = "needs the peer venv: ./scripts/setup.sh --parity")]
fn adapters_and_merged_exports_load_in_hf() {
    for preset in ["tiny-qwen2", "tiny-qwen3", "tiny-mistral"] {
        adapter_and_merged_export_load_in_hf(&family_fixture(preset));
    }
}

/// bf16 for each family, as `tests/it/parity/llama.rs` holds Llama to it: llora's bf16 step (bf16
/// weights, activations, biases and q/k norms; f32 adapters) against HF + PEFT's bf16 twin, both
/// measured from HF's fp32 step: the loss within twice PEFT's distance (+1e-4), each LoRA
/// gradient's cosine with fp32's >= 0.999, and all of them within 1.25x PEFT's 1 - cosine.
#[test]
#[cfg_attr(not(has_peer), ignore = "needs the peer venv: ./scripts/setup.sh --parity")]
fn bf16_matches_hf_peft_in_bf16_for_each_family() {
    let targets = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj";
    for preset in ["tiny-qwen2", "tiny-qwen3", "tiny-mistral"] {
        let args = ["--preset", preset, "--seq-len", "64", "--batch", "2", "--lora-b", "normal", "--steps", "1"];
        let dir =
            fixture(&format!("{preset}-s64-b2-bf16"), &[&args[..], &["--targets", targets, "--bf16-twin"]].concat());
        assert_bf16_near_peft(&dir, llora_model::precision::AdapterCompute::Auto, 1.25);
    }
}

/// A Qwen-style tokenizer made by HF's `tokenizers` (`scripts/peer/family_tokenizers.py`:
/// byte-level BPE with Qwen 2's pre-tokenizer, ChatML's special tokens and Qwen 2's chat
/// template) in `dir`.
fn qwen_tokenizer(dir: &Path) -> PathBuf {
    made_tokenizer(dir, "make", "qwen-tokenizer")
}

/// A tokenizer `family_tokenizers.py COMMAND` makes in `dir/name`.
fn made_tokenizer(dir: &Path, command: &str, name: &str) -> PathBuf {
    let tok = dir.join(name);
    let out = peer_tokenizer(&[command, tok.to_str().unwrap()], None);
    assert!(out["vocab"].as_u64().unwrap() <= 1000, "the family presets' vocabulary is 1000");
    tok
}

/// Runs `scripts/peer/family_tokenizers.py ARGS` with `input` as JSON on its stdin; its JSON
/// answer.
fn peer_tokenizer(args: &[&str], input: Option<&serde_json::Value>) -> serde_json::Value {
    let mut child = Command::new(python())
        .arg(repo_root().join("scripts/peer/family_tokenizers.py"))
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let text = input.map(|v| v.to_string()).unwrap_or_default();
    std::io::Write::write_all(&mut child.stdin.take().unwrap(), text.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "family_tokenizers.py {args:?} failed");
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The byte-level BPE tokenizer.json encodes a mixed-script corpus (Latin with diacritics,
/// Cyrillic, CJK, Arabic, emoji, code, whitespace runs, contractions, digits) to the ids the
/// `tokenizers` library gives.
#[test]
#[cfg_attr(not(has_peer), ignore = "needs the peer venv: ./scripts/setup.sh --parity")]
fn a_byte_level_bpe_tokenizer_encodes_as_the_tokenizers_library() {
    let dir = tempfile::tempdir().unwrap();
    let tok = qwen_tokenizer(dir.path());
    let corpus: Vec<String> = [
        "The GAO's report: agencies spent $4,200,000 in FY2023 (up 12%).",
        "Ärzte, Bürger und Öffentlichkeit — naïve café",
        "Правительство опубликовало отчёт",
        "政府问责局报告称，联邦机构花费了四十二亿美元。会計検査院",
        "الحكومة نشرت تقريرا",
        "🙂🚀 👩‍👩‍👧 ≤≥→∑ “quoted” …",
        "fn main() {\n    println!(\"{}\", 1 + 2);\n}\n",
        "  leading spaces,\ttabs\t\tand\r\n\r\nblank lines   ",
        "they'll we've I'd it's don't",
        "1234567890 3.14159 -0.5e-3",
        "",
    ]
    .map(String::from)
    .to_vec();
    let theirs: Vec<Vec<u32>> =
        serde_json::from_value(peer_tokenizer(&["encode", tok.to_str().unwrap()], Some(&serde_json::json!(corpus))))
            .unwrap();
    let ours = llora_data::tokenizer::load_tokenizer(&tok).unwrap();
    for (text, want) in corpus.iter().zip(&theirs) {
        let got = ours.encode(text.as_str(), false).unwrap().get_ids().to_vec();
        assert_eq!(&got, want, "{text:?}");
    }
}

/// `llora data prepare --format chat` with Qwen's ChatML template: each conversation's ids are
/// transformers' `apply_chat_template` ids (the default system turn added where there is none),
/// and exactly the assistant turns are labelled (their content, `<|im_end|>` and the newline the
/// template writes after it).
#[test]
#[cfg_attr(not(has_peer), ignore = "needs the peer venv: ./scripts/setup.sh --parity")]
fn chatml_conversations_prepare_as_apply_chat_template() {
    let dir = tempfile::tempdir().unwrap();
    let tok = qwen_tokenizer(dir.path());
    let m = |r: &str, c: &str| serde_json::json!({"role": r, "content": c});
    let chats = vec![
        serde_json::json!([m("user", "What is 2+2?"), m("assistant", "Four.")]),
        serde_json::json!([
            m("system", "You are terse."),
            m("user", "Summarise: the GAO found 12 of 30 agencies had no plan."),
            m("assistant", "40% lack plans."),
            m("user", "And the rest?"),
            m("assistant", "18 have one.\nSee the report."),
        ]),
        serde_json::json!([m("user", "中文呢？ Привет 🙂"), m("assistant", "天真的咖啡馆")]),
    ];
    assert_prepared_as_apply_chat_template(dir.path(), &tok, &chats, "<|im_end|>\n");
}

/// `llora data prepare --format chat` with Mistral Instruct's `[INST]` template
/// (`<s>[INST] user [/INST]assistant</s>...`, `[INST]` and `[/INST]` special as in v0.3): the
/// ids are `apply_chat_template`'s and exactly each assistant turn and its `</s>` are labelled.
#[test]
#[cfg_attr(not(has_peer), ignore = "needs the peer venv: ./scripts/setup.sh --parity")]
fn mistral_inst_conversations_prepare_as_apply_chat_template() {
    let dir = tempfile::tempdir().unwrap();
    let tok = made_tokenizer(dir.path(), "make-mistral", "mistral-tokenizer");
    let m = |r: &str, c: &str| serde_json::json!({"role": r, "content": c});
    let chats = vec![
        serde_json::json!([m("user", "What is 2+2?"), m("assistant", "Four.")]),
        serde_json::json!([
            m("user", "Summarise: the GAO found 12 of 30 agencies had no plan."),
            m("assistant", "40% lack plans."),
            m("user", "And the rest?"),
            m("assistant", "18 have one.\nSee the report."),
        ]),
    ];
    assert_prepared_as_apply_chat_template(dir.path(), &tok, &chats, "</s>");
}

/// Prepares `chats` with `llora data prepare --format chat` and the tokenizer (and template) in
/// `tok`, and checks each conversation's ids against transformers' `apply_chat_template` and
/// that its labelled tokens decode to exactly its assistant turns, each followed by `turn_end`.
fn assert_prepared_as_apply_chat_template(dir: &Path, tok: &Path, chats: &[serde_json::Value], turn_end: &str) {
    let lines: Vec<String> = chats.iter().map(|c| serde_json::json!({"messages": c}).to_string()).collect();
    let input = dir.join("chat.jsonl");
    std::fs::write(&input, lines.join("\n")).unwrap();
    let out = dir.join("chat.parquet");
    let (i, t, o) = (input.to_str().unwrap(), tok.to_str().unwrap(), out.to_str().unwrap());
    let res = common::llora(&["data", "prepare", "--format", "chat", "--input", i, "--tokenizer", t, "--out", o]);
    assert!(res.status.success(), "{}", common::text(&res).1);
    let opts = llora_data::parquet_io::ReadOptions {
        vocab: 1000,
        max_seq_len: 4096,
        on_bad_row: llora_data::parquet_io::OnBadRow::Error,
    };
    let samples = llora_data::parquet_io::read_parquet(&out, &opts).unwrap().0;
    assert_eq!(samples.len(), chats.len());
    let reference = peer_tokenizer(&["chat", t], Some(&serde_json::json!(chats)));
    let decoder = llora_data::tokenizer::load_tokenizer(tok).unwrap();
    for (k, (sample, chat)) in samples.iter().zip(chats).enumerate() {
        let want: Vec<u32> = serde_json::from_value(reference[k].clone()).unwrap();
        assert_eq!(sample.input_ids, want, "conversation {k}: ids differ from apply_chat_template");
        let mut runs: Vec<Vec<u32>> = Vec::new();
        for (j, (&id, &l)) in sample.input_ids.iter().zip(&sample.labels).enumerate() {
            assert!(l == -100 || l == id as i64, "a label differs from its token");
            let starts = l != -100 && (j == 0 || sample.labels[j - 1] == -100);
            if starts {
                runs.push(Vec::new());
            }
            if l != -100 {
                runs.last_mut().unwrap().push(id);
            }
        }
        let assistant: Vec<String> = chat
            .as_array()
            .unwrap()
            .iter()
            .filter(|m| m["role"] == "assistant")
            .map(|m| format!("{}{turn_end}", m["content"].as_str().unwrap()))
            .collect();
        let got: Vec<String> = runs.iter().map(|r| decoder.decode(r, false).unwrap()).collect();
        assert_eq!(got, assistant, "conversation {k}: labelled tokens are not the assistant turns");
    }
}

/// Decoding with the KV cache past each family's window: the fixture's first row fed one token at
/// a time after an 8-token prefill gives, at every position, HF + PEFT's logsumexp of the logits
/// and the next token's logit (the fixture's, from transformers' full forward): each new position
/// attends to the last W keys only, in the layers that slide.
#[test]
#[cfg_attr(not(has_peer), ignore = "needs the peer venv: ./scripts/setup.sh --parity")]
fn cached_decoding_past_the_window_equals_hf() {
    for preset in ["tiny-qwen2", "tiny-qwen3", "tiny-mistral"] {
        let dir = family_fixture(preset);
        let fx = load_fixture(&dir);
        let device = Device::libtorch();
        let mut model = HfCheckpoint::open(&dir).unwrap().load_model(&BuildOptions::default(), &device).unwrap();
        load_peft_adapter(&mut model, &dir, &device).unwrap();
        let s = fx.input_ids.0[1];
        let row: Vec<i64> = fx.input_ids.1[..s].to_vec();
        let ids = |t: &[i64]| Tensor::<2, Int>::from_data(TensorData::new(t.to_vec(), [1, t.len()]), &device);
        let mut cache = llora_model::generate::KvCache::new(&model);
        let mut logits = vec![values(model.decode(ids(&row[..8]), &mut cache).unwrap())];
        for t in 8..s {
            logits.push(values(model.decode(ids(&row[t..=t]), &mut cache).unwrap()));
        }
        let lse: Vec<f32> = logits.iter().map(|l| l.iter().map(|x| x.exp()).sum::<f32>().ln()).collect();
        let want = &fx.expected["step1.logsumexp"].1[7..s];
        let err = rel_err(&lse, want);
        // Position p's logits score the row's token p + 1 (the fixture's target logit where
        // the label is kept: the second half of the row).
        let next: Vec<f32> = (s / 2..s - 1).map(|p| logits[p - 7][row[p + 1] as usize]).collect();
        let target_err = rel_err(&next, &fx.expected["step1.target_logit"].1[s / 2..s - 1]);
        eprintln!("{preset}: cached decoding, logsumexp relative error {err:e}, next-token logit {target_err:e}");
        assert!(err <= 1e-5 && target_err <= 1e-4, "{preset}: {err:e} {target_err:e}");
    }
}

/// `llora generate` (KV-cached, greedy) on the Qwen 2 fixture with its adapter and the Qwen-style
/// tokenizer (no beginning-of-sequence token) continues a prompt as transformers' greedy
/// `generate` does, 48 new tokens.
#[test]
#[cfg_attr(not(has_peer), ignore = "needs the peer venv: ./scripts/setup.sh --parity")]
fn generate_past_the_sliding_window_equals_hf_generate() {
    let dir = family_fixture("tiny-qwen2");
    let tmp = tempfile::tempdir().unwrap();
    let base = base_only_copy(&dir, tmp.path());
    let tok = qwen_tokenizer(tmp.path());
    let (b, d, t) = (base.to_str().unwrap(), dir.to_str().unwrap(), tok.to_str().unwrap());
    let prompt = "The Government Accountability Office reported that";
    let ours =
        llora_generate(&["--model", b, "--adapter", d, "--tokenizer", t, "--prompt", prompt, "--max-new-tokens", "48"]);
    let hf = hf_generate(&base, &dir, &ours["prompt_ids"], 48);
    assert!(ours["prompt_ids"].as_array().unwrap().len() + 48 > 2 * 24, "the continuation passes the window");
    assert_eq!(ours["ids"], hf["ids"], "greedy continuations differ");
    assert_eq!(ours["ids"].as_array().unwrap().len(), 48);
}

/// The README's main job with a Qwen 3 model: the tiny Qwen 3 preset (q/k head norms, a 20-token
/// window on layer 1, rows of up to 256 tokens) is pre-trained on the demo's corpus, saved as a
/// Qwen 3 checkpoint transformers reads, then fine-tuned with LoRA to the demo's target; the
/// official MLPerf checker accepts the result log.
#[test]
#[cfg_attr(not(has_peer), ignore = "needs the peer venv: ./scripts/setup.sh --parity")]
fn a_tiny_qwen3_fine_tunes_to_its_target_with_a_log_the_checker_accepts() {
    let dir = tempfile::tempdir().unwrap();
    let sets =
        ["model.preset=\"tiny-qwen3\"", "model.path=\"runs/qwen3-base\"", "run.dir=\"runs/qwen3\"", "run.threads=2"];
    let args: Vec<&str> = ["train"].into_iter().chain(sets.iter().flat_map(|s| ["--set", s])).collect();
    let out = common::llora_in(dir.path(), &args);
    let (stdout, stderr) = common::text(&out);
    assert!(out.status.success() && stdout.contains("status: success"), "{stdout}\n{stderr}");
    let base = dir.path().join("runs/qwen3-base");
    let config = LlamaConfig::from_hf_dir(&base).unwrap();
    assert_eq!(config, LlamaConfig::preset("tiny-qwen3").unwrap(), "the saved base is the preset's model");
    let (passed, said) = common::mlperf_check(&dir.path().join("runs/qwen3/result_0.txt"));
    assert!(passed && said.contains("SUCCESS"), "official checker rejected the log:\n{said}");
    // transformers reads the saved base as a Qwen 3 model with llora's loss on the fixture-free
    // batch it makes itself: the base's own logits through PEFT-free transformers.
    let tmp = tempfile::tempdir().unwrap();
    let batch = tmp.path().join("batch.safetensors");
    let ids: Vec<i64> = (0..96).map(|i| (i * 37 % 500) as i64).collect();
    let labels = ids.clone();
    let bytes = |v: &[i64]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let (ib, lb) = (bytes(&ids), bytes(&labels));
    let views = [
        ("input_ids", safetensors::tensor::TensorView::new(safetensors::Dtype::I64, vec![1, 96], &ib).unwrap()),
        ("labels", safetensors::tensor::TensorView::new(safetensors::Dtype::I64, vec![1, 96], &lb).unwrap()),
    ];
    safetensors::serialize_to_file(views, None, &batch).unwrap();
    let hf_out = tmp.path().join("hf.safetensors");
    let status = Command::new(python())
        .arg(repo_root().join("scripts/peft_forward.py"))
        .args([base.as_os_str(), "-".as_ref(), batch.as_os_str(), hf_out.as_os_str()])
        .status()
        .unwrap();
    assert!(status.success(), "transformers could not run the saved Qwen 3 base");
    let hf: Vec<f32> =
        read_all(&hf_out)["logits"].1.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    let device = Device::libtorch();
    let model = HfCheckpoint::open(&base).unwrap().load_model(&BuildOptions::default(), &device).unwrap();
    let ours =
        values(model.forward(Tensor::<2, Int>::from_data(TensorData::new(ids, [1, 96]), &device), false).unwrap());
    let err = rel_err(&ours, &hf);
    assert!(err <= 1e-5, "the saved base's logits in transformers differ from llora's: {err:e}");
}

/// Every precision and storage runs each family (their biases and q/k head norms on the bf16,
/// FP8 and NF4 paths): two `llora bench` steps end within 0.2% of fp32's loss, also bf16 with the
/// CPU standing in for CUDA, where the window runs on flash attention's window route (one
/// variable-length launch per layer, its kernel the CPU's under a band mask); a window shorter
/// than the rows is refused under context parallelism, naming both keys, before anything runs.
#[test]
fn each_family_runs_in_every_precision_and_refuses_a_window_across_ranks() {
    let all = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj";
    for preset in ["tiny-qwen2", "tiny-qwen3", "tiny-mistral"] {
        let bench = ["bench", "--preset", preset, "--seq-len", "64", "--batch", "2", "--warmup", "0", "--steps", "2"];
        let run = |extra: &[&str], cuda_routes: bool| -> serde_json::Value {
            let args = [&bench[..], &["--threads", "1", "--targets", all], extra].concat();
            let mut cmd = common::llora_command(&common::root(), &args);
            if cuda_routes {
                cmd.env("LLORA_CUDA_ROUTES_ON_CPU", "1");
            }
            let out = cmd.output().unwrap();
            let (stdout, stderr) = common::text(&out);
            assert!(out.status.success(), "{preset} {extra:?}: {stderr}");
            serde_json::from_str(stdout.lines().last().unwrap()).unwrap()
        };
        let fp32 = run(&[], false)["final_loss"].as_f64().unwrap();
        for (extra, cuda_routes) in [
            (&["--precision", "bf16"][..], false),
            (&["--precision", "fp8", "--fp8-weights", "--fp8-activations"], false),
            (&["--quantize", "nf4"], false),
            (&["--precision", "bf16"], true),
        ] {
            let record = run(extra, cuda_routes);
            let got = record["final_loss"].as_f64().unwrap();
            assert!(((got - fp32) / fp32).abs() < 2e-3, "{preset} {extra:?} {cuda_routes}: loss {got} vs fp32 {fp32}");
            let kernels = record["attn_impl"].to_string();
            assert_eq!(kernels.contains("cuda-flash-window"), cuda_routes, "{preset} {extra:?}: {kernels}");
        }
    }
    // The embedded config without its base (a demo run leaves one in runs/, whose config.json
    // would be read instead of the preset's).
    let dir = tempfile::tempdir().unwrap();
    let config = common::random_base_config(dir.path());
    let sets = ["model.preset=\"tiny-mistral\"", "train.context_parallel=2", "data.max_seq_len=64"];
    let args: Vec<&str> =
        ["plan", &config, "--world", "2"].into_iter().chain(sets.iter().flat_map(|s| ["--set", s])).collect();
    let out = common::llora(&args);
    let stderr = common::text(&out).1;
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("sliding_window = 16") && stderr.contains("train.context_parallel"), "{stderr}");
}

/// Packed rows of each family: documents of 64, 30 and 34 tokens (past every window) and short
/// ones packed together give each document's loss and LoRA gradients as HF + PEFT running it
/// alone: the window slides within each document, never across one.
#[test]
#[cfg_attr(not(has_peer), ignore = "needs the peer venv: ./scripts/setup.sh --parity")]
fn packed_documents_match_hf_peft_each_run_alone() {
    for preset in ["tiny-qwen2", "tiny-qwen3", "tiny-mistral"] {
        packed_documents_match_hf_peft_on(&family_fixture(preset), false);
    }
}

/// `llora eval` with each family's PEFT adapter, on HF's batch written as MLPerf-schema parquet,
/// prints HF + PEFT's loss.
#[test]
#[cfg_attr(not(has_peer), ignore = "needs the peer venv: ./scripts/setup.sh --parity")]
fn eval_command_reports_the_hf_peft_loss_for_each_family() {
    for preset in ["tiny-qwen2", "tiny-qwen3", "tiny-mistral"] {
        let dir = family_fixture(preset);
        let fx = load_fixture(&dir);
        let last = eval_fixture_batch(&dir, &fx, &[]);
        let reference = fx.json["losses"][0].as_f64().unwrap();
        let ours = last["loss_per_token"].as_f64().unwrap();
        assert!(((ours - reference) / reference).abs() <= 1e-5, "{preset}: llora eval {ours} vs HF+PEFT {reference}");
        assert_eq!(last["target_tokens"].as_u64(), fx.json["n_target_tokens"].as_u64());
    }
}

/// QLoRA on Qwen 2 (its q/k/v biases kept as they are, the seven linears NF4 in blocks of 64,
/// single quantisation, a window shorter than the 64-token document): per-document loss sums
/// and every LoRA gradient equal HF + PEFT's on the same base through bitsandbytes' NF4 round
/// trip, within 1e-5 as for Llama (`tests/it/parity/nf4.rs`; one family: each costs two Python peers).
#[test]
#[cfg_attr(not(has_peer), ignore = "needs the peer venv: ./scripts/setup.sh --parity")]
fn qlora_on_qwen2_matches_peft_on_the_bitsandbytes_base() {
    let docs = documents(&[64, 40, 23], 1000);
    assert_qlora_matches_bitsandbytes_base(&family_fixture("tiny-qwen2"), &docs, false, 0.5625, [1e-5, 1e-5]);
}

/// DoRA and rsLoRA on Qwen 2, whose q/k/v biases DoRA must leave unscaled (PEFT subtracts the
/// bias before rescaling each row to its magnitude): PEFT's loss, logits and LoRA (and magnitude)
/// gradients within 1e-5; the DoRA adapter llora saves loads in PEFT, and its merged export (each
/// row rescaled, the bias as it was) in transformers, with llora's logits.
#[test]
#[cfg_attr(not(has_peer), ignore = "needs the peer venv: ./scripts/setup.sh --parity")]
fn dora_and_rslora_with_biases_match_peft() {
    let targets = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj";
    let args = ["--preset", "tiny-qwen2", "--seq-len", "64", "--batch", "2", "--lora-b", "normal", "--steps", "1"];
    for (flag, name) in [("--dora", "dora"), ("--rslora", "rslora")] {
        let dir = fixture(&format!("tiny-qwen2-s64-b2-{name}"), &[&args[..], &[flag, "--targets", targets]].concat());
        let worst = check_parity(&dir);
        assert!(worst <= 1e-5, "{name}: worst LoRA gradient relative error {worst:e}");
    }
    let dir = fixture("tiny-qwen2-s64-b2-dora", &[&args[..], &["--dora", "--targets", targets]].concat());
    let targets = targets.split(',').map(String::from).collect();
    adapter_and_merged_export_load_in_hf_with(
        &dir,
        llora_model::LoraSpec { dropout: 0.0, dora: true, targets, ..Default::default() },
    );
}

/// Real checkpoints' chat templates, each saved by transformers 5 (into `chat_template.jinja`,
/// which llora used to miss): TRL 1.16's copies of Qwen 2.5's, Qwen 3's and Llama 3.1's own,
/// Qwen 3's training variant with `{% generation %}` markup, and Mistral v3's rule. On
/// multi-turn conversations with a system message, with reasoning blocks (which Qwen 3 drops
/// from earlier turns), and starting with the assistant: where transformers renders a
/// conversation, `llora data prepare --format chat` gives `apply_chat_template`'s ids; where
/// the template marks generation, exactly transformers' assistant mask is labelled; elsewhere
/// one run of labels per assistant turn, holding its visible answer, ending in the template's
/// end of turn, and no user or system text. Where the template refuses one, so does llora (by
/// the template's own message). 42 of 64 Qwen 3 and 22 of 64 Mistral v0.3 rows were refused.
#[test]
#[cfg_attr(not(has_peer), ignore = "needs the peer venv: ./scripts/setup.sh --parity")]
fn real_chat_templates_prepare_as_apply_chat_template() {
    let dir = tempfile::tempdir().unwrap();
    let qwen = qwen_tokenizer(dir.path());
    let mistral = made_tokenizer(dir.path(), "make-mistral", "mistral-tokenizer");
    let mistral_template = dir.path().join("mistral-v3-style.jinja");
    std::fs::write(&mistral_template, common::MISTRAL_V3_STYLE).unwrap();
    let m = |r: &str, c: &str| serde_json::json!({"role": r, "content": c});
    let chats = vec![
        serde_json::json!([
            m("system", "You answer in one line."),
            m("user", "What is 2+2?"),
            m("assistant", "Four."),
            m("user", "And 3+3?"),
            m("assistant", "Six, as\nthe report says."),
        ]),
        serde_json::json!([
            m("user", "Summarise: the GAO found 12 of 30 agencies had no plan."),
            m("assistant", "<think>\n12 of 30 is 40%.\n</think>\n\n40% lack plans."),
            m("user", "And the rest?"),
            m("assistant", "<think>\n30 - 12 = 18.\n</think>\n\n18 have one."),
        ]),
        serde_json::json!([
            m("assistant", "Ask me about the report."),
            m("user", "Who wrote it?"),
            m("assistant", "The GAO.")
        ]),
    ];
    let templates: [(&str, &Path, String, &str); 5] = [
        ("qwen2.5", &qwen, "trl:qwen2_5.jinja".into(), "<|im_end|>\n"),
        ("qwen3", &qwen, "trl:qwen3.jinja".into(), "<|im_end|>\n"),
        ("qwen3-training", &qwen, "trl:qwen3_training.jinja".into(), ""),
        ("llama3.1", &qwen, "trl:llama3_1.jinja".into(), "<|eot_id|>"),
        ("mistral-v3", &mistral, mistral_template.display().to_string(), "</s>"),
    ];
    for (name, base, template, turn_end) in templates {
        let tok = dir.path().join(format!("{name}-tokenizer"));
        let saved = peer_tokenizer(&["retemplate", base.to_str().unwrap(), &template, tok.to_str().unwrap()], None);
        assert!(saved["saved"].as_array().unwrap().contains(&"chat_template.jinja".into()), "{name}: {saved}");
        let reference = peer_tokenizer(&["chat-mask", tok.to_str().unwrap()], Some(&serde_json::json!(chats)));
        for (k, chat) in chats.iter().enumerate() {
            let what = format!("{name}, conversation {k}");
            let prepared = prepare_one_chat(dir.path(), &tok, chat, &format!("{name}-{k}"));
            let want = &reference[k];
            if let Some(refusal) = want["error"].as_str() {
                let err = prepared.expect_err(&format!("{what}: transformers refused it ({refusal})"));
                assert!(err.contains(refusal.split('.').next().unwrap()), "{what}: {err} vs {refusal}");
                continue;
            }
            let sample = prepared.unwrap_or_else(|e| panic!("{what}: {e}"));
            let ids: Vec<u32> = serde_json::from_value(want["ids"].clone()).unwrap();
            assert_eq!(sample.input_ids, ids, "{what}: ids differ from apply_chat_template");
            match want["mask"].as_array() {
                Some(mask) => {
                    let labels: Vec<i64> =
                        ids.iter().zip(mask).map(|(&id, m)| if m == 1 { i64::from(id) } else { -100 }).collect();
                    assert_eq!(sample.labels, labels, "{what}: labels differ from transformers' assistant mask");
                }
                None => assert_labels_are_the_answers(&tok, &sample, chat, turn_end, &what),
            }
        }
    }
}

/// `llora data prepare --format chat` of one conversation with the tokenizer in `tok`: the
/// sample, or the error it printed.
fn prepare_one_chat(
    dir: &Path,
    tok: &Path,
    chat: &serde_json::Value,
    name: &str,
) -> Result<llora_data::Sample, String> {
    let input = dir.join(format!("{name}.jsonl"));
    std::fs::write(&input, serde_json::json!({"messages": chat}).to_string()).unwrap();
    let out = dir.join(format!("{name}.parquet"));
    let (i, t, o) = (input.to_str().unwrap(), tok.to_str().unwrap(), out.to_str().unwrap());
    let res = common::llora(&["data", "prepare", "--format", "chat", "--input", i, "--tokenizer", t, "--out", o]);
    if !res.status.success() {
        return Err(common::text(&res).1);
    }
    let opts = llora_data::parquet_io::ReadOptions {
        vocab: 1000,
        max_seq_len: 4096,
        on_bad_row: llora_data::parquet_io::OnBadRow::Error,
    };
    let mut samples = llora_data::parquet_io::read_parquet(&out, &opts).unwrap().0;
    assert_eq!(samples.len(), 1);
    Ok(samples.remove(0))
}

/// One run of labels per assistant message, each holding the message's visible answer (what
/// follows a reasoning block) and ending in `turn_end`; no user or system text labelled.
fn assert_labels_are_the_answers(
    tok: &Path,
    sample: &llora_data::Sample,
    chat: &serde_json::Value,
    turn_end: &str,
    what: &str,
) {
    let decoder = llora_data::tokenizer::load_tokenizer(tok).unwrap();
    let mut runs: Vec<Vec<u32>> = Vec::new();
    for (j, (&id, &l)) in sample.input_ids.iter().zip(&sample.labels).enumerate() {
        assert!(l == -100 || l == i64::from(id), "{what}: a label differs from its token");
        if l != -100 && (j == 0 || sample.labels[j - 1] == -100) {
            runs.push(Vec::new());
        }
        if l != -100 {
            runs.last_mut().unwrap().push(id);
        }
    }
    let messages = chat.as_array().unwrap();
    let answers: Vec<&str> = messages
        .iter()
        .filter(|m| m["role"] == "assistant")
        .map(|m| m["content"].as_str().unwrap())
        .map(|c| c.rsplit_once("</think>").map_or(c, |(_, a)| a.trim()))
        .collect();
    assert_eq!(runs.len(), answers.len(), "{what}: one labelled run per assistant turn");
    for (run, answer) in runs.iter().zip(&answers) {
        let text = decoder.decode(run, false).unwrap();
        assert!(text.contains(answer) && text.ends_with(turn_end), "{what}: labelled {text:?} for {answer:?}");
        for m in messages.iter().filter(|m| m["role"] != "assistant") {
            assert!(!text.contains(m["content"].as_str().unwrap()), "{what}: {:?} text labelled", m["role"]);
        }
    }
}
