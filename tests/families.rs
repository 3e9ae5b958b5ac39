#![allow(deprecated)] // Device::libtorch: burn-tch is deprecated upstream, and it is our backend.
//! Qwen 2 / 2.5, Qwen 3 and Mistral checkpoints against HF transformers + PEFT: small models of
//! each family made by transformers (its own config class and initialisation, biases and q/k
//! norm gains moved away from 0 and 1, sliding windows shorter than the rows), LoRA on every
//! linear; llora's hidden states, logits, loss and every LoRA gradient equal theirs (fp32).

mod common;

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
fn qwen2_matches_hf_peft() {
    let dir = family_fixture("tiny-qwen2");
    let c = LlamaConfig::from_hf_dir(&dir).unwrap();
    let f = &c.family;
    assert_eq!(f.model_type, ModelType::Qwen2);
    assert!(f.qkv_bias && !f.o_bias && !f.qk_norm && c.tie_word_embeddings && c.rope_theta == 1e6);
    assert_eq!((f.window_of(0), f.window_of(1)), (None, Some(24)));
    check_parity(&dir);
}

/// Qwen 3: per-head RMSNorm of q and k (gains away from 1), head_dim 40 (not d / heads = 32),
/// no biases, a 20-token window on layer 1.
#[test]
fn qwen3_matches_hf_peft() {
    let dir = family_fixture("tiny-qwen3");
    let c = LlamaConfig::from_hf_dir(&dir).unwrap();
    let f = &c.family;
    assert_eq!(f.model_type, ModelType::Qwen3);
    assert!(f.qk_norm && !f.qkv_bias && c.head_dim == 40);
    assert_eq!((f.window_of(0), f.window_of(1)), (None, Some(20)));
    check_parity(&dir);
}

/// Mistral: a 16-token window on every layer, head_dim 24.
#[test]
fn mistral_matches_hf_peft() {
    let dir = family_fixture("tiny-mistral");
    let c = LlamaConfig::from_hf_dir(&dir).unwrap();
    assert_eq!(c.family.model_type, ModelType::Mistral);
    assert_eq!((c.family.window_of(0), c.family.window_of(1), c.head_dim), (Some(16), Some(16), 24));
    check_parity(&dir);
}

/// Each family's adapter written by llora loads in PEFT onto the HF model with llora's logits,
/// and the merged export (biases, q/k norms and the family's config.json carried) loads in
/// transformers with them too.
#[test]
fn adapters_and_merged_exports_load_in_hf() {
    for preset in ["tiny-qwen2", "tiny-qwen3", "tiny-mistral"] {
        adapter_and_merged_export_load_in_hf(&family_fixture(preset));
    }
}

/// bf16 for each family, as `tests/parity.rs` holds Llama to it: llora's bf16 step (bf16
/// weights, activations, biases and q/k norms; f32 adapters) against HF + PEFT's bf16 twin, both
/// measured from HF's fp32 step: the loss within twice PEFT's distance (+1e-4), each LoRA
/// gradient's cosine with fp32's >= 0.999, and all of them within 1.25x PEFT's 1 - cosine.
#[test]
fn bf16_matches_hf_peft_in_bf16_for_each_family() {
    let targets = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj";
    for preset in ["tiny-qwen2", "tiny-qwen3", "tiny-mistral"] {
        let args = ["--preset", preset, "--seq-len", "64", "--batch", "2", "--lora-b", "normal", "--steps", "1"];
        let dir =
            fixture(&format!("{preset}-s64-b2-bf16"), &[&args[..], &["--targets", targets, "--bf16-twin"]].concat());
        assert_bf16_near_peft(&dir, llora_model::precision::AdapterCompute::Auto, 1.25);
    }
}
