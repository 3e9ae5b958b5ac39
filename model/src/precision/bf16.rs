//! Where bf16 GEMMs run natively, and what to do where they do not.
//!
//! torch runs a bf16 GEMM on oneDNN only where the CPU has bf16 support in oneDNN's sense
//! (x86: AVX-512 core or newer, bf16 native with AVX512-BF16 and AMX; arm64: the BF16
//! extension). Elsewhere (an AVX2-only x86 such as many AMD EPYC cloud cores) it falls back to
//! reference loops two orders of magnitude slower than f32 (docs/performance.md, M2). There the
//! bf16 GEMMs run as f32 GEMMs on the bf16 operands, rounded back to bf16: the products of
//! bf16 values are exact in f32, so this is a bf16 GEMM with f32 accumulation up to
//! summation order, and activations stay bf16 between the GEMMs.

use std::sync::OnceLock;

use tch::Kind;

/// Whether torch's bf16 GEMMs on `device` use fast kernels (always on CUDA).
pub fn native_bf16_gemm(device: tch::Device) -> bool {
    device.is_cuda() || native_on_this_cpu()
}

/// [`native_bf16_gemm`] for the CPU, read once.
pub fn native_on_this_cpu() -> bool {
    static NATIVE: OnceLock<bool> = OnceLock::new();
    *NATIVE.get_or_init(|| {
        let native = cpu_has_bf16_gemm();
        if !native {
            tracing::info!("this CPU has no bf16 GEMM kernels in torch: bf16 GEMMs run in f32 on bf16 operands");
        }
        native
    })
}

#[cfg(target_arch = "x86_64")]
fn cpu_has_bf16_gemm() -> bool {
    // oneDNN's `avx512_core`: what torch's `mkldnn_bf16_device_check` asks of an x86 CPU.
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512dq")
}

#[cfg(target_arch = "aarch64")]
fn cpu_has_bf16_gemm() -> bool {
    std::arch::is_aarch64_feature_detected!("bf16")
}

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
fn cpu_has_bf16_gemm() -> bool {
    false
}

/// The dtype to hand torch an operand of dtype `kind` in, for a GEMM (or a kernel made of
/// GEMMs, like CPU flash attention) on `device`: `kind` itself, except bf16 where torch has no
/// fast bf16 GEMMs: f32 there (exact for bf16 values; the caller rounds the result back).
pub fn operand_kind(kind: Kind, device: tch::Device) -> Kind {
    if kind == Kind::BFloat16 && !native_bf16_gemm(device) { Kind::Float } else { kind }
}

/// `a · b` for bf16 operands through f32 GEMMs, in `out`: `a` converted once, `b` one column
/// block at a time ([`super::blocked`]: whole f32 copies of a 70B MLP weight would be 0.94 GB
/// each).
///
/// # Shapes
/// - a: `[m, k]`, b: `[k, n]` (any layout), output: `[m, n]`
pub fn mm_via_f32(a: &tch::Tensor, b: &tch::Tensor, out: Kind) -> tch::Tensor {
    let a = a.to_kind(Kind::Float);
    super::blocked::by_column_blocks(a.size()[0], b, out, |blk| Ok(a.mm(&blk.to_kind(Kind::Float)).to_kind(out)))
        .expect("a GEMM of valid shapes")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The f32 route equals torch's bf16 GEMM on the same bf16 operands up to one bf16
    /// rounding of the f32 sums (whichever kernel torch picks on this machine).
    #[test]
    fn f32_route_equals_the_bf16_gemm() {
        tch::manual_seed(2);
        let cpu = (Kind::Float, tch::Device::Cpu);
        let a = tch::Tensor::randn([48, 64], cpu).to_kind(Kind::BFloat16);
        let b = tch::Tensor::randn([64, 40], cpu).to_kind(Kind::BFloat16);
        let native = a.mm(&b).to_kind(Kind::Float);
        let routed = a.to_kind(Kind::Float).mm(&b.to_kind(Kind::Float)).to_kind(Kind::BFloat16).to_kind(Kind::Float);
        let err = (&native - &routed).abs();
        let bound = native.abs() * 2f64.powi(-7) + 1e-6;
        assert!(bool::try_from(err.le_tensor(&bound).all()).unwrap(), "max error {}", err.max().double_value(&[]));
    }

    /// Cut into column blocks (a `Wᵀ` view, as the linear layers pass it), the result is the
    /// unblocked f32 GEMM's, rounded once to bf16.
    #[test]
    fn blocked_equals_one_f32_gemm() {
        tch::manual_seed(3);
        let cpu = (Kind::Float, tch::Device::Cpu);
        let k = 2048;
        let n = super::super::blocked::BLOCK_ELEMENTS / k * 2 + 7;
        let a = tch::Tensor::randn([8, k], cpu).to_kind(Kind::BFloat16);
        let w = tch::Tensor::randn([n, k], cpu).to_kind(Kind::BFloat16);
        let want = a.to_kind(Kind::Float).mm(&w.to_kind(Kind::Float).tr()).to_kind(Kind::BFloat16);
        let got = mm_via_f32(&a, &w.tr(), Kind::BFloat16);
        let diff = (got.to_kind(Kind::Float) - want.to_kind(Kind::Float)).abs();
        let bound = want.to_kind(Kind::Float).abs() * 2f64.powi(-7) + 1e-6;
        assert!(bool::try_from(diff.le_tensor(&bound).all()).unwrap(), "max error {}", diff.max().double_value(&[]));
    }
}
