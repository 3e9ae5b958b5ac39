//! SwiGLU's FP8 route: with `fp8_activations` on a device taking the CUDA routes, our kernel
//! (`kernels/swiglu_fp8.cu`) writes h and keeps gate and up as E4M3 codes in one pass, and its
//! backward reads the codes directly; where the kernel has not passed its first-use check
//! (once per device, against the LibTorch route, logged either way) LibTorch's ops run
//! (`nodes.rs` `Kept`). Status on GPUs: docs/gpu.md.

use crate::fp8::format::Fp8Format;
use crate::fp8::stand_ins;
use crate::fp8::tensor::{CodesToWrite, Fp8Tensor};
use crate::kernels::args::host_bytes;
use crate::kernels::swiglu_fp8::{self, BackwardArgs, ForwardArgs};

use super::spec::Storage;

/// What the kernel's first-use check is called, in logs and in `llora selftest`.
pub const CHECK: &str = "FP8 SwiGLU kernel (ours, NVRTC)";

crate::routes::declare_route! {
    /// The route: the verdict of [`check`] per device, and whether [`forward`] ran our kernel.
    pub static ROUTE: Verdicts<tch::Device> = &crate::routes::RouteSpec {
        name: CHECK,
        fallback: "LibTorch's SwiGLU and quantiser run",
        order: 30,
        part: "gemm",
        self_tests: &[crate::routes::SelfTest {
            name: CHECK,
            check: checked_on,
            passed: "codes and scales equal the LibTorch route's bit for bit, h and gradients within a bf16 ulp",
        }],
        counts_uses: true,
    };
}

/// Whether SwiGLU of `gate` kept as `storage` takes our kernel: FP8 storage, bf16 inputs, a
/// device taking the CUDA routes with `LLORA_CUDA_FUSED_ROUTES` on, the kernel checked there;
/// not under a context-parallel amax group (the kernel's current scales are its gate's and
/// up's own: `crate::fp8::amax_group`).
pub fn takes_kernel(gate: &tch::Tensor, storage: Storage) -> bool {
    let device = gate.device();
    storage == Storage::Fp8
        && !crate::fp8::amax_group::active()
        && gate.kind() == tch::Kind::BFloat16
        && crate::routes::takes_cuda_routes(device)
        && crate::routes::fused_routes()
        && ROUTE.passed(device, || check(device))
}

/// [`check`] on `device` once per process, its result kept (`llora selftest`).
pub fn checked_on(device: tch::Device) -> Result<(), String> {
    ROUTE.check(device, || check(device))
}

/// What the kernel's forward gives: h, and gate and up as E4M3 codes at their own current
/// scales (the kernel writes the codes and `scale_inv`, which the two tensors' scales view).
pub struct Forward {
    /// silu(gate) · up, bf16.
    pub h: tch::Tensor,
    /// gate's E4M3 codes, its inverse scale `scale_inv[0]`.
    pub gate: Fp8Tensor,
    /// up's E4M3 codes, its inverse scale `scale_inv[1]`.
    pub up: Fp8Tensor,
    /// `[2]` f32: gate's and up's inverse scales, as the kernel writes them.
    scale_inv: tch::Tensor,
    /// h's E4M3 codes at down_proj's delayed input scale, when asked for.
    pub h_codes: Option<CodesToWrite>,
}

impl Forward {
    /// Outputs for a problem of `gate`'s shape, to be written; h's codes at `h_scale`.
    fn empty(gate: &tch::Tensor, h_scale: Option<f32>) -> Self {
        let codes = || tch::Tensor::empty(gate.size(), (Fp8Format::E4M3.kind(), gate.device()));
        let scale_inv = tch::Tensor::zeros([2], (tch::Kind::Float, gate.device()));
        let h_codes = h_scale.map(|s| CodesToWrite::empty(&gate.size(), s, Fp8Format::E4M3, gate.device()));
        let (g, u) = (Fp8Tensor::device(codes(), scale_inv.get(0)), Fp8Tensor::device(codes(), scale_inv.get(1)));
        Self { h: gate.empty_like(), gate: g, up: u, scale_inv, h_codes }
    }

    /// The forward's arguments writing into `self`, `amax` a `[2]` f32 scratch.
    fn args<'a>(&'a self, gate: &'a tch::Tensor, up: &'a tch::Tensor, amax: &'a tch::Tensor) -> ForwardArgs<'a> {
        let (out, gate_codes, up_codes, scale_inv) = (&self.h, self.gate.codes(), self.up.codes(), &self.scale_inv);
        ForwardArgs {
            gate,
            up,
            out,
            gate_codes,
            up_codes,
            scale_inv,
            amax,
            h: self.h_codes.as_ref().map(CodesToWrite::args),
        }
    }
}

/// The kernel's forward on bf16 `gate` and `up` (contiguous copies where they are not), also
/// writing h's E4M3 codes at `h_scale` (down_proj's delayed input scale) when given.
///
/// # Shapes
/// - gate, up: `[.., I]` bf16; h and the codes: as gate
pub fn forward(gate: &tch::Tensor, up: &tch::Tensor, h_scale: Option<f32>) -> Result<Forward, String> {
    let (gate, up) = (gate.contiguous(), up.contiguous());
    let (out, amax) = (Forward::empty(&gate, h_scale), tch::Tensor::zeros([2], (tch::Kind::Float, gate.device())));
    let args = out.args(&gate, &up, &amax);
    if !swiglu_fp8::forward(&args).map_err(|e| e.to_string())? {
        stand_ins::swiglu_forward(&args);
    }
    ROUTE.mark_used();
    Ok(out)
}

/// The kernel's backward: (grad of gate, grad of up) from the kept E4M3 gate and up and h's
/// gradient.
///
/// # Shapes
/// - gate, up, grad: `[.., I]`; outputs: as grad, bf16
pub fn backward(gate: &Fp8Tensor, up: &Fp8Tensor, grad: &tch::Tensor) -> Result<(tch::Tensor, tch::Tensor), String> {
    with_backward_args(gate, up, grad, |args| {
        if !swiglu_fp8::backward(args).map_err(|e| e.to_string())? {
            stand_ins::swiglu_backward(args);
        }
        Ok(())
    })
}

/// Runs `run` on the backward's arguments (the one place they are made: the kernel and its
/// reference read the same view) and returns the gradients it wrote.
fn with_backward_args(
    gate: &Fp8Tensor,
    up: &Fp8Tensor,
    grad: &tch::Tensor,
    run: impl FnOnce(&BackwardArgs<'_>) -> Result<(), String>,
) -> Result<(tch::Tensor, tch::Tensor), String> {
    let grad = grad.contiguous();
    let (grad_gate, grad_up) = (grad.empty_like(), grad.empty_like());
    let scale_inv = inverse_scales(gate, up);
    let (gate_codes, up_codes) = (gate.codes(), up.codes());
    run(&BackwardArgs {
        gate_codes,
        up_codes,
        scale_inv: &scale_inv,
        grad: &grad,
        grad_gate: &grad_gate,
        grad_up: &grad_up,
    })?;
    Ok((grad_gate, grad_up))
}

/// gate's and up's inverse scales as the kernels read them: `[2]` f32 on their device.
fn inverse_scales(gate: &Fp8Tensor, up: &Fp8Tensor) -> tch::Tensor {
    let device = gate.codes().device();
    tch::Tensor::stack(&[gate.inv_scale().on_device(device), up.inv_scale().on_device(device)], 0)
}

/// Checks the kernels against the LibTorch route on `device` (bf16 probe values over ±40 with
/// zeros, at a size no multiple of a block): codes and inverse scales bit for bit, h and both
/// gradients within one bf16 ulp. Calls the kernels and their references directly, never the
/// route (no verdict re-entered).
pub fn check(device: tch::Device) -> Result<(), String> {
    let _guard = tch::no_grad_guard();
    let values: Vec<f32> = (0..4103).map(|i| ((i * 7919) % 4001) as f32 / 50.0 - 40.0).collect();
    let gate = tch::Tensor::from_slice(&values).view([11, 373]).to_kind(tch::Kind::BFloat16).to_device(device);
    let up = (gate.flip([1]) * 0.5).contiguous();
    let got = forward(&gate, &up, Some(0.5))?;
    let want = forward_reference(&gate, &up);
    let bits = host_bytes;
    for (name, a, b) in [
        ("gate codes", got.gate.codes(), want.gate.codes()),
        ("up codes", got.up.codes(), want.up.codes()),
        ("inverse scales", &got.scale_inv, &want.scale_inv),
    ] {
        if bits(a) != bits(b) {
            return Err(format!("{name} differ from the LibTorch route"));
        }
    }
    within_ulp("h", &got.h, &want.h)?;
    // h's codes: those of the kernel's own h (h itself may differ by expf's last bit).
    let (h_got, h_want) = (
        got.h_codes.as_ref().ok_or("no h codes")?,
        CodesToWrite::empty(&gate.size(), 0.5, Fp8Format::E4M3, gate.device()),
    );
    stand_ins::write_delayed_codes(&got.h, &h_want.args());
    if bits(&h_got.codes) != bits(&h_want.codes) || bits(&h_got.amax) != bits(&h_want.amax) {
        return Err("h's codes or amax differ from those of its h".into());
    }
    let grad = (gate.flip([0]) * 0.25).contiguous();
    let (gg, gu) = backward(&got.gate, &got.up, &grad)?;
    let (gg_want, gu_want) = backward_reference(&want, &grad)?;
    within_ulp("gate gradient", &gg, &gg_want)?;
    within_ulp("up gradient", &gu, &gu_want)
}

/// `Err` unless every element of bf16 `got` is within one bf16 ulp (2^-7 relative) of `want`.
fn within_ulp(name: &str, got: &tch::Tensor, want: &tch::Tensor) -> Result<(), String> {
    let (g, w) = (got.to_kind(tch::Kind::Float), want.to_kind(tch::Kind::Float));
    let excess = ((&g - &w).abs() - w.abs() * 2f64.powi(-7)).max().double_value(&[]);
    if excess <= 0.0 { Ok(()) } else { Err(format!("{name} differs from the LibTorch route by more than a bf16 ulp")) }
}

/// The LibTorch route's forward (the kernel's CPU stand-in) on fresh outputs.
fn forward_reference(gate: &tch::Tensor, up: &tch::Tensor) -> Forward {
    let (out, amax) = (Forward::empty(gate, None), tch::Tensor::zeros([2], (tch::Kind::Float, gate.device())));
    stand_ins::swiglu_forward(&out.args(gate, up, &amax));
    out
}

/// The LibTorch route's backward on the reference's codes.
fn backward_reference(f: &Forward, grad: &tch::Tensor) -> Result<(tch::Tensor, tch::Tensor), String> {
    let run = |args: &BackwardArgs<'_>| {
        stand_ins::swiglu_backward(args);
        Ok(())
    };
    with_backward_args(&f.gate, &f.up, grad, run)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Kind, Tensor};

    /// bf16 gate and up of `shape` on `dev` (gate ×3: some values past E4M3's finest steps).
    fn inputs(shape: [i64; 2], dev: tch::Device) -> (Tensor, Tensor) {
        let r = |k: f64| (Tensor::randn(shape, (Kind::Float, dev)) * k).to_kind(Kind::BFloat16);
        (r(3.0), r(1.0))
    }

    /// `Ok` when `got` is within one bf16 ulp of `want` everywhere.
    fn ulp(got: &Tensor, want: &Tensor) -> bool {
        within_ulp("", got, want).is_ok()
    }

    /// The route on the CPU standing in for CUDA (its control flow in CI): codes decode to
    /// gate and up within E4M3's half-ulp (2^-4 relative), h is bf16 silu(gate)·up, and the
    /// backward equals torch's autograd of `silu(g) * u` on the decoded inputs (an
    /// independent reference: autograd's own derivative of silu).
    #[test]
    fn the_route_on_the_cpu_runs_as_autograd_does() {
        let _on = crate::routes::on_cpu_for_this_thread(true);
        let (gate, up) = inputs([4, 9], tch::Device::Cpu);
        let f = forward(&gate, &up, Some(0.25)).unwrap();
        let (g, u) = (f.gate.dequantize(), f.up.dequantize());
        let off =
            |x: &Tensor, y: &Tensor| (x.to_kind(Kind::Float) - y.to_kind(Kind::Float)).abs().max().double_value(&[]);
        assert!(off(&g, &gate) <= gate.abs().max().double_value(&[]) * 2f64.powi(-4));
        assert_eq!(off(&(gate.silu() * &up), &f.h), 0.0);
        // h's codes at down_proj's scale 0.25: h · 0.25 within E4M3's half-ulp, amax h's own.
        let hc = f.h_codes.as_ref().unwrap();
        let h_scaled = f.h.to_kind(Kind::Float) * 0.25;
        assert!(
            off(&hc.codes.to_kind(Kind::Float), &h_scaled) <= h_scaled.abs().max().double_value(&[]) * 2f64.powi(-4)
        );
        assert_eq!(hc.amax.double_value(&[0]), f.h.to_kind(Kind::Float).abs().max().double_value(&[]));
        let (g, u) =
            (g.to_kind(Kind::BFloat16).set_requires_grad(true), u.to_kind(Kind::BFloat16).set_requires_grad(true));
        let grad = Tensor::randn([4, 9], (Kind::Float, tch::Device::Cpu)).to_kind(Kind::BFloat16);
        (g.silu() * &u * &grad).sum(Kind::Float).backward();
        let (gg, gu) = backward(&f.gate, &f.up, &grad).unwrap();
        assert!(ulp(&gg, &g.grad()) && ulp(&gu, &u.grad()));
        assert!(check(tch::Device::Cpu).is_ok());
    }

    /// On the CPU standing in for CUDA: SwiGLU's h codes reach down_proj. Once down_proj's
    /// input scale exists, the route writes h's codes at it into the handle down_proj is given
    /// and down_proj quantises nothing, and its output is bit for bit that of down_proj
    /// quantising the same h itself (without the handle).
    #[test]
    fn swiglu_offers_h_codes_to_down_proj() {
        #![allow(deprecated)] // Device::libtorch: burn-tch is deprecated upstream, and it is our backend.
        use burn::tensor::{DType, Device, Distribution, Tensor as BurnTensor};
        let _rng = crate::device::torch_rng_lock();
        let _on = crate::routes::on_cpu_for_this_thread(true);
        let device = Device::libtorch().autodiff();
        device.seed(5);
        let (i, d) = (40, 16);
        let spec = crate::precision::PrecisionSpec {
            compute: crate::precision::Compute::Fp8,
            fp8_weights: true,
            ..Default::default()
        };
        let mut down =
            crate::lora::LoraLinear::new(BurnTensor::random([d, i], Distribution::Normal(0.0, 0.2), &device), false);
        down.set_precision(&spec, &device);
        let input = |k: f64| {
            BurnTensor::<3>::random([2, 3, i], Distribution::Normal(0.0, k), &device).cast(DType::BF16).require_grad()
        };
        let (gate, up) = (input(3.0), input(1.0));
        let codes = crate::fp8::SharedCodes::new();
        let h = || crate::precision::swiglu(gate.clone(), up.clone(), Storage::Fp8, down.codes_to_write(true, &codes));
        let _ = down.forward(h(), true);
        down.quant.as_ref().unwrap().update();
        assert!(down.fp8_input_scale(true).is_some());
        let h_used = h();
        let _ = crate::fp8::take_quantiser_counts();
        let y = down.forward_reading(h_used.clone(), Some(&codes), true);
        let counts = crate::fp8::take_quantiser_counts();
        assert_eq!(counts.kernel + counts.two_pass + counts.via_f32, 0, "{counts:?}: down_proj quantised h");
        let bits = |t: BurnTensor<3>| {
            t.cast(DType::F32).into_data().into_vec::<f32>().unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        };
        assert_eq!(bits(y), bits(down.forward(h_used, true)));
        assert!(crate::fp8::take_quantiser_counts().kernel >= 1, "without the handle down_proj quantises h");
    }

    /// The kernels against the LibTorch route on a GPU: gate/up codes, inverse scales and h's
    /// codes bit for bit, h's amax exact, h and both gradients within one bf16 ulp (expf's last
    /// bit), at odd sizes with zeros, ±1e4 and a denormal-sized value.
    #[test]
    #[ignore = "needs CUDA"]
    fn launches_equal_the_libtorch_route() {
        assert!(tch::Cuda::is_available(), "this test needs a CUDA device");
        let dev = tch::Device::Cuda(0);
        for shape in [[1, 1], [7, 33], [129, 65], [1000, 3]] {
            let (gate, up) = inputs(shape, dev);
            for (i, v) in [0.0, 1e4, -1e4, 1e-30].iter().enumerate().take(gate.numel()) {
                let _ = gate.view([-1]).get(i as i64).fill_(*v);
            }
            let (mine, want) = (Forward::empty(&gate, None), Forward::empty(&gate, None));
            let h = || CodesToWrite::empty(&shape, 0.5, Fp8Format::E4M3, dev);
            let (h_mine, h_want, amax) = (h(), h(), Tensor::zeros([2], (Kind::Float, dev)));
            assert!(
                swiglu_fp8::forward(&ForwardArgs { h: Some(h_mine.args()), ..mine.args(&gate, &up, &amax) }).unwrap()
            );
            stand_ins::swiglu_forward(&ForwardArgs { h: Some(h_want.args()), ..want.args(&gate, &up, &amax) });
            let bits = |t: &Tensor| host_bytes(t).unwrap();
            assert_eq!(bits(mine.gate.codes()), bits(want.gate.codes()), "gate codes, {shape:?}");
            assert_eq!(bits(mine.up.codes()), bits(want.up.codes()), "up codes, {shape:?}");
            assert_eq!(bits(&mine.scale_inv), bits(&want.scale_inv), "inverse scales, {shape:?}");
            assert_eq!(bits(&h_mine.codes), bits(&h_want.codes), "h codes, {shape:?}");
            assert_eq!(bits(&h_mine.amax), bits(&h_want.amax), "h amax, {shape:?}");
            assert!(ulp(&mine.h, &want.h), "h, {shape:?}");
            let grad = Tensor::randn(shape, (Kind::Float, dev)).to_kind(Kind::BFloat16);
            let (gg, gu) = backward(&mine.gate, &mine.up, &grad).unwrap();
            let (gg_want, gu_want) = backward_reference(&want, &grad).unwrap();
            assert!(ulp(&gg, &gg_want) && ulp(&gu, &gu_want), "gradients, {shape:?}");
        }
    }
}
