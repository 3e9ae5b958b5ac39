//! `fp8_quantize.cu`'s CPU stand-ins (see the parent module): names no route, so the quantise
//! route that calls them is not imported back.

use crate::kernels::fp8_quantize::{CurrentArgs, QuantizeArgs};

/// `fp8_quantize.cu`'s delayed-scaling quantiser: codes at `a.scale`, their transpose and the
/// amax folded into `a.amax` where asked.
pub fn delayed(a: &QuantizeArgs<'_>) {
    let _no_grad = tch::no_grad_guard();
    let limit = f64::from(a.format.max());
    let codes = (a.x.to_kind(tch::Kind::Float) * f64::from(a.scale)).clamp(-limit, limit).to_kind(a.format.kind());
    a.out.shallow_clone().copy_(&codes);
    if let Some(out_t) = a.out_t {
        out_t.shallow_clone().copy_(&codes.tr());
    }
    if let Some(amax) = a.amax {
        let mine = a.x.to_kind(tch::Kind::Float).abs().max().reshape(amax.size());
        let folded = amax.maximum(&mine);
        amax.shallow_clone().copy_(&folded);
    }
}

/// `fp8_quantize.cu`'s current scaling: the amax, `max / amax` in f32 (1 where that is not
/// finite or zero), the codes through f32.
pub fn current(a: &CurrentArgs<'_>) {
    let _no_grad = tch::no_grad_guard();
    current_at(a, &a.x.to_kind(tch::Kind::Float).abs().max());
}

/// [`current`] with `a.amax` already holding x's amax (the codes' launch alone).
pub fn current_at_amax(a: &CurrentArgs<'_>) {
    let _no_grad = tch::no_grad_guard();
    current_at(a, &a.amax.reshape([] as [i64; 0]).shallow_clone());
}

/// Current scaling of `a.x` at the amax `amax` (0-dim f32), written into `a`.
fn current_at(a: &CurrentArgs<'_>, amax: &tch::Tensor) {
    let amax = amax.copy();
    let mut scale = amax.full_like(f64::from(a.format.max())) / &amax;
    let _ = scale.nan_to_num_(1.0, 1.0, 1.0);
    let _ = scale.g_add_(&scale.eq(0.0));
    a.amax.shallow_clone().copy_(&amax.reshape([1]));
    a.scale_inv.shallow_clone().copy_(&scale.reciprocal().reshape(a.scale_inv.size()));
    let limit = f64::from(a.format.max());
    let codes = (a.x.to_kind(tch::Kind::Float) * &scale).clamp(-limit, limit).to_kind(a.format.kind());
    a.out.shallow_clone().copy_(&codes);
}
