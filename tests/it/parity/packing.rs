#![allow(deprecated)] // Device::libtorch: burn-tch is deprecated upstream, and it is our backend.
//! Packed rows against HF + PEFT running each document alone: every document's loss and LoRA
//! gradients, Llama 2 and Llama 3 style.
//!
//! Fixtures come from `scripts/peer/fixtures.py` run with the project venv's Python, so that
//! what llora is compared with is computed by the reference libraries (`tests/common/peer.rs`).

use crate::common;

use common::peer::*;

/// Packed rows give every document the loss and LoRA gradients it has alone in
/// HF transformers + PEFT (fp32, 1e-5): a row that one document fills, a row whose two
/// documents end exactly at its end, a row of nine tiny documents and padding; and the same
/// documents unpacked (a row each, padded) give the same per-document sums and gradients.
#[test]
#[cfg_attr(not(has_peer), ignore = "needs the peer venv: ./scripts/setup.sh --parity")]
fn packed_documents_match_hf_peft_each_run_alone() {
    packed_documents_match_hf_peft_on(&gqa_fixture(), true);
}

/// The same on the Llama-3-style checkpoint (llama3 RoPE scaling: each document's positions
/// from 0 through the scaled table; tied head; 128k vocabulary).
#[test]
#[cfg_attr(not(has_peer), ignore = "needs the peer venv: ./scripts/setup.sh --parity")]
fn packed_llama3_documents_match_hf_peft_each_run_alone() {
    packed_documents_match_hf_peft_on(&llama3_fixture(), false);
}
