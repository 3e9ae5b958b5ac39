//! The norm writing the next GEMMs' FP8 input: where the projections after a norm run FP8
//! GEMMs with a delayed input scale already made, our kernel (`kernels/rmsnorm_fp8.cu`) writes
//! the bf16 output, its 1/rms and the output's E4M3 codes and amax in one pass, and hands the
//! codes to the projections in the [`crate::fp8::SharedCodes`] the decoder block gives both:
//! q, k and v (or gate and up) then quantise nothing. Checked on first use against the
//! LibTorch route (logged either way); elsewhere the norm runs as before (status: docs/gpu.md).

use crate::fp8::format::Fp8Format;
use crate::fp8::stand_ins;
use crate::fp8::tensor::{CodesToWrite, Fp8Tensor};
use crate::kernels::args::host_bytes;
use crate::kernels::rmsnorm_fp8::{self, ForwardArgs};

/// What the kernel's first-use check is called, in logs and in `llora selftest`.
pub const CHECK: &str = "FP8 RMSNorm kernel (ours, NVRTC)";

crate::routes::declare_route! {
    /// The route: the verdict of [`check`] per device, and whether [`forward`] ran our kernel
    /// (not the reference).
    pub static ROUTE: Verdicts<tch::Device> = &crate::routes::RouteSpec {
        name: CHECK,
        fallback: "the norm runs as before and each GEMM quantises",
        order: 70,
        part: "norm",
        self_tests: &[crate::routes::SelfTest {
            name: CHECK,
            check: checked_on,
            passed: "1/rms, output and codes equal the LibTorch route's (a bf16 ulp, codes bit for bit)",
        }],
        counts_uses: true,
    };
}

/// Whether a norm of `x` takes our kernel: bf16 on a device taking the CUDA routes with
/// `LLORA_CUDA_FUSED_ROUTES` on, the kernel checked there.
pub fn takes_kernel(x: &tch::Tensor) -> bool {
    let device = x.device();
    x.kind() == tch::Kind::BFloat16
        && crate::routes::takes_cuda_routes(device)
        && crate::routes::fused_routes()
        && ROUTE.passed(device, || check(device))
}

/// [`check`] on `device` once per process, its result kept (`llora selftest`).
pub fn checked_on(device: tch::Device) -> Result<(), String> {
    ROUTE.check(device, || check(device))
}

/// What the kernel gives: the output, 1/rms per row, and the output's codes and amax.
pub struct Normed {
    /// `[.., d]` bf16.
    pub y: tch::Tensor,
    /// `[.., 1]` f32.
    pub inv_rms: tch::Tensor,
    /// `[rows, d]` E4M3 codes of y at the scale asked.
    pub codes: Fp8Tensor,
    /// y's amax, 0-dim f32.
    pub amax: tch::Tensor,
}

/// The norm of bf16 `x` (`[.., d]`) with gain `w` on our kernel, y's codes at `scale`.
/// `reference` runs the LibTorch route instead (the check's reference; the CPU stand-in).
pub fn forward(x: &tch::Tensor, w: &tch::Tensor, eps: f64, scale: f32, reference: bool) -> Result<Normed, String> {
    let d = *x.size().last().ok_or("a norm input has a last dimension")?;
    let x2 = x.contiguous().reshape([-1, d]);
    let w = w.to_kind(tch::Kind::BFloat16).contiguous();
    let rows = x2.size()[0];
    let y = x2.empty_like();
    let inv_rms = tch::Tensor::zeros([rows, 1], (tch::Kind::Float, x.device()));
    let codes = CodesToWrite::empty(&[rows, d], scale, Fp8Format::E4M3, x.device());
    let args = ForwardArgs { x: &x2, w: &w, y: &y, inv_rms: &inv_rms, eps, y_codes: Some(codes.args()) };
    if reference {
        stand_ins::rmsnorm(&args);
    } else {
        if !rmsnorm_fp8::forward(&args).map_err(|e| e.to_string())? {
            stand_ins::rmsnorm(&args);
        }
        ROUTE.mark_used();
    }
    let mut stat = x.size();
    *stat.last_mut().expect("checked above") = 1;
    let (codes, amax) = codes.written();
    Ok(Normed { y: y.reshape(x.size()), inv_rms: inv_rms.reshape(stat), codes, amax })
}

/// Checks the kernel against the LibTorch route on `device` (bf16 rows of 1000 over ±40 and a
/// zero row): 1/rms within 1e-6 relative, y within one bf16 ulp, the codes bit for bit those of
/// the kernel's own y, the amax that of its y. Calls the kernel and the reference directly.
pub fn check(device: tch::Device) -> Result<(), String> {
    let _guard = tch::no_grad_guard();
    let values: Vec<f32> = (0..7000).map(|i| ((i * 7919) % 4001) as f32 / 50.0 - 40.0).collect();
    let x = tch::Tensor::from_slice(&values).view([7, 1000]).to_kind(tch::Kind::BFloat16).to_device(device);
    let _ = x.get(3).zero_();
    let w = (tch::Tensor::arange(1000, (tch::Kind::Float, device)) / 1000.0 + 0.5).to_kind(tch::Kind::BFloat16);
    let (got, want) = (forward(&x, &w, 1e-5, 2.0, false)?, forward(&x, &w, 1e-5, 2.0, true)?);
    let rel = ((&got.inv_rms - &want.inv_rms) / &want.inv_rms).abs().max().double_value(&[]);
    if rel.is_nan() || rel > 1e-6 {
        return Err(format!("1/rms differs from the LibTorch route by {rel} relative"));
    }
    let (y, y_want) = (got.y.to_kind(tch::Kind::Float), want.y.to_kind(tch::Kind::Float));
    if ((&y - &y_want).abs() - y_want.abs() * 2f64.powi(-7)).max().double_value(&[]) > 0.0 {
        return Err("the output differs from the LibTorch route by more than a bf16 ulp".into());
    }
    let own = (y.reshape([7, 1000]) * 2.0).clamp(-448.0, 448.0).to_kind(Fp8Format::E4M3.kind());
    let bits = host_bytes;
    if bits(got.codes.codes()) != bits(&own) {
        return Err("the codes differ from the output's own codes".into());
    }
    if got.amax.double_value(&[]) != y.abs().max().double_value(&[]) {
        return Err("the amax differs from the output's".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(deprecated)] // Device::libtorch: burn-tch is deprecated upstream, and it is our backend.
    use burn::module::Param;
    use burn::tensor::{DType, Device, Distribution, Tensor};

    use crate::fp8::AmaxSpec;
    use crate::fp8::SharedCodes;
    use crate::lora::LoraLinear;
    use crate::norm::RmsNorm;
    use crate::precision::{Compute, PrecisionSpec};

    /// On the CPU standing in for CUDA: the norm's codes reach the projection after it. Two
    /// FP8 layers read the norm's output; once their input scale exists, the norm writes the
    /// codes into the handle both layers are given and neither layer quantises its input (no
    /// quantisation counted: the norm's kernel wrote them), and their outputs are bit for bit
    /// those of the layers quantising the same norm output themselves.
    #[test]
    fn the_norm_offers_its_codes_to_the_projections() {
        let _rng = crate::device::torch_rng_lock();
        let _on = crate::routes::on_cpu_for_this_thread(true);
        let device = Device::libtorch().autodiff();
        device.seed(3);
        let (d, m) = (48, 16);
        let spec =
            PrecisionSpec { compute: Compute::Fp8, fp8_weights: true, amax: AmaxSpec::default(), ..Default::default() };
        let layer = || {
            let mut l = LoraLinear::new(Tensor::random([m, d], Distribution::Normal(0.0, 0.2), &device), false);
            l.set_precision(&spec, &device);
            l
        };
        let (q, k) = (layer(), layer());
        let norm = RmsNorm {
            weight: Param::from_tensor(Tensor::random([d], Distribution::Uniform(0.5, 1.5), &device)),
            eps: 1e-5,
        };
        let x = Tensor::<3>::random([2, 5, d], Distribution::Normal(0.0, 2.0), &device).cast(DType::BF16);
        // Step 1 makes the input scales (equal: one amax history).
        let n = norm.forward(x.clone());
        let _ = (q.forward(n.clone(), true), k.forward(n, true));
        for l in [&q, &k] {
            l.quant.as_ref().unwrap().update();
        }
        let scale = q.fp8_input_scale(true);
        assert!(scale.is_some() && scale == k.fp8_input_scale(true));
        let _ = crate::fp8::take_quantiser_counts();
        let codes = SharedCodes::new();
        let n = norm.forward_fp8(x.clone(), q.codes_to_write(true, &codes));
        let (yq, yk) =
            (q.forward_reading(n.clone(), Some(&codes), true), k.forward_reading(n.clone(), Some(&codes), true));
        let counts = crate::fp8::take_quantiser_counts();
        assert_eq!(counts.kernel + counts.two_pass + counts.via_f32, 0, "{counts:?}: the layers quantised their input");
        assert!(super::ROUTE.used());
        let bits = |t: Tensor<3>| {
            t.cast(DType::F32).into_data().into_vec::<f32>().unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        };
        // Without the handle each layer quantises the same norm output itself.
        assert_eq!(bits(yq), bits(q.forward(n.clone(), true)));
        assert_eq!(bits(yk), bits(k.forward(n, true)));
        assert!(crate::fp8::take_quantiser_counts().kernel >= 2);
    }
}
