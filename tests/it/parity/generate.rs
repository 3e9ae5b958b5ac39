#![allow(deprecated)] // Device::libtorch: burn-tch is deprecated upstream, and it is our backend.
//! `llora generate` against transformers' `generate`: greedy tokens with an adapter, in fp32 and
//! bf16, and a chat answer.
//!
//! Fixtures come from `scripts/peer/fixtures.py` run with the project venv's Python, so that
//! what llora is compared with is computed by the reference libraries (`tests/common/peer.rs`).

use crate::common;

use common::peer::*;

/// `llora generate` (KV-cached, greedy) continues a prompt exactly as HF
/// transformers' greedy `generate` does, 64 new tokens, on the Llama-3-style checkpoint with its
/// PEFT adapter.
#[test]
#[cfg_attr(
    not(all(has_peer, has_node)),
    ignore = "needs the peer venv (./scripts/setup.sh --parity), node and the npm registry"
)]
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
#[cfg_attr(
    not(all(has_peer, has_node)),
    ignore = "needs the peer venv (./scripts/setup.sh --parity), node and the npm registry"
)]
fn generate_in_bf16_equals_hf_generate_in_bf16() {
    let (ours, hf) = generate_against_hf("bf16", 32);
    assert_eq!(ours["ids"], hf["ids"], "bf16 greedy continuations differ");
    assert_eq!(ours["ids"].as_array().unwrap().len(), 32);
}

/// `llora generate --chat`: the conversation is rendered with the template's generation prompt
/// into transformers' `apply_chat_template(..., add_generation_prompt=True)` ids, and answered
/// as HF's greedy generate answers it.
#[test]
#[cfg_attr(
    not(all(has_peer, has_node)),
    ignore = "needs the peer venv (./scripts/setup.sh --parity), node and the npm registry"
)]
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
