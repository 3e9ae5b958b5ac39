//! What each of our CUDA kernels (`kernels/`) computes, in LibTorch ops: the reference its
//! first-use check and CUDA test hold it to, and what runs in its place on the CPU where the
//! CPU stands in for CUDA (`LLORA_CUDA_ROUTES_ON_CPU=1`, [`crate::routes::stands_in`]), so
//! that each route's control flow (first-use check, verdict, counting) runs in CI. A kernel's
//! launch returns `Ok(false)` for CPU tensors; its route then calls the stand-in here. The
//! arithmetic is each LibTorch route's: the scale in f32, clamp, cast. The quantiser's are in
//! [`quantize`], which names no route (the quantise route calls it).

use crate::fp8::format::Fp8Format;
use crate::kernels::args::DelayedCodes;
use crate::kernels::{rmsnorm_fp8, swiglu_fp8};

pub mod quantize;

#[cfg(test)]
mod kernels_on_cpu;

/// `rmsnorm_fp8.cu`: the norm's composite (`norm/composite.rs`), its 1/rms, and y's codes at
/// the delayed scale where asked.
pub fn rmsnorm(a: &rmsnorm_fp8::ForwardArgs<'_>) {
    use crate::norm::composite::{inv_rms, normalised};
    let _no_grad = tch::no_grad_guard();
    let r = inv_rms(a.x, a.eps);
    let y = normalised(a.x, &r) * a.w;
    a.inv_rms.shallow_clone().copy_(&r);
    a.y.shallow_clone().copy_(&y);
    if let Some(c) = &a.y_codes {
        write_delayed_codes(&y, c);
    }
}

/// `swiglu_fp8.cu`'s forward: `silu(gate) · up` (nodes.rs), gate and up at their current
/// scales as `Kept::keep` stores them in FP8, and h's codes at a delayed scale where asked.
pub fn swiglu_forward(a: &swiglu_fp8::ForwardArgs<'_>) {
    let _no_grad = tch::no_grad_guard();
    let h = a.gate.silu() * a.up;
    a.out.shallow_clone().copy_(&h);
    for (i, (x, codes)) in [(a.gate, a.gate_codes), (a.up, a.up_codes)].into_iter().enumerate() {
        let (q, scale_inv) = crate::fp8::quantize_current_on_device(x, Fp8Format::E4M3);
        codes.shallow_clone().copy_(&q);
        a.scale_inv.get(i as i64).copy_(&scale_inv);
        a.amax.get(i as i64).copy_(&crate::fp8::amax_on_device(x));
    }
    if let Some(hc) = &a.h {
        write_delayed_codes(&h, hc);
    }
}

/// `swiglu_fp8.cu`'s backward (nodes.rs `SwigluBackward` on the dequantised inputs).
pub fn swiglu_backward(a: &swiglu_fp8::BackwardArgs<'_>) {
    let _no_grad = tch::no_grad_guard();
    let kind = a.grad.kind();
    let gate = crate::fp8::dequantize(a.gate_codes, &a.scale_inv.get(0)).to_kind(kind);
    let up = crate::fp8::dequantize(a.up_codes, &a.scale_inv.get(1)).to_kind(kind);
    a.grad_up.shallow_clone().copy_(&(a.grad * gate.silu()));
    a.grad_gate.shallow_clone().copy_(&gate.silu_backward(&(a.grad * up)));
}

/// Writes `y`'s codes at `c`'s delayed scale (float(y) · scale, clamped, cast) and folds y's
/// amax into `c`'s, as the LibTorch route's quantiser does.
pub fn write_delayed_codes(y: &tch::Tensor, c: &DelayedCodes<'_>) {
    let _no_grad = tch::no_grad_guard();
    let limit = f64::from(c.format.max());
    let codes = (y.to_kind(tch::Kind::Float) * c.scale).clamp(-limit, limit).to_kind(c.format.kind());
    c.codes.shallow_clone().copy_(&codes);
    let folded = c.amax.maximum(&y.to_kind(tch::Kind::Float).abs().max().reshape([1]));
    c.amax.shallow_clone().copy_(&folded);
}
