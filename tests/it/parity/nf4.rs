#![allow(deprecated)] // Device::libtorch: burn-tch is deprecated upstream, and it is our backend.
//! NF4 (QLoRA) against bitsandbytes: the format itself, and LoRA training on an NF4 base against
//! PEFT on bitsandbytes' base.
//!
//! Fixtures come from `scripts/peer/fixtures.py` run with the project venv's Python, so that
//! what llora is compared with is computed by the reference libraries (`tests/common/peer.rs`).

use crate::common;

use common::peer::*;

/// The format: llora's NF4 equals bitsandbytes' `quantize_4bit` (CPU, blocksize 64)
/// bit for bit on a 64·1001 + 37-value tensor (a last partial block, an odd count): packed
/// codes, absmaxes and dequantised values; the 8-bit dynamic map of double quantisation is
/// bitsandbytes' to the bit, and its scales dequantise within one 8-bit code step of
/// bitsandbytes' (measured: 0.2; the offset is torch's f32 mean there, an f64 mean rounded
/// once here).
#[test]
#[cfg_attr(not(has_peer), ignore = "needs the peer venv: ./scripts/setup.sh --parity")]
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
    assert!(run.status.code() != Some(3), "bitsandbytes is not in the project venv: ./scripts/setup.sh --parity");
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
/// (0.516 with double quantisation) against bf16's 2.
#[test]
#[cfg_attr(not(has_peer), ignore = "needs the peer venv: ./scripts/setup.sh --parity")]
fn qlora_matches_peft_on_the_bitsandbytes_base() {
    let dir = gqa_fixture();
    let config = llora_model::LlamaConfig::from_hf_dir(&dir).unwrap();
    let docs = documents(&[64, 40, 23], config.vocab_size);
    for double in [false, true] {
        let (tol, grad_tol) = if double { (1e-4, 1e-2) } else { (1e-5, 1e-5) };
        let bytes = if double { 0.516 } else { 0.5625 };
        assert_qlora_matches_bitsandbytes_base(&dir, &docs, double, bytes, [tol, grad_tol]);
    }
}
