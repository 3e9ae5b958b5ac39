//! SwiGLU's FP8 route: with `fp8_activations` on a device taking the CUDA routes, our kernel
//! (`kernels/swiglu_fp8.cu`) writes h and keeps gate and up as E4M3 codes in one pass, and its
//! backward reads the codes directly; where the kernel has not passed its first-use check
//! (once per device, against the LibTorch route, logged either way) LibTorch's ops run
//! (`nodes.rs` `Kept`). Untested on a GPU until the bundle ran there (docs/gpu.md).

use crate::fp8_format::Fp8Format;
use crate::kernels::checks::host_bytes;
use crate::kernels::swiglu_fp8::{self, BackwardArgs, ForwardArgs};
use crate::routes::Verdicts;

use super::spec::Storage;

/// What the kernel's first-use check is called, in logs and in `llora selftest`.
pub const CHECK: &str = "FP8 SwiGLU kernel (ours, NVRTC)";

/// The verdict of [`check`] per device.
static VERDICTS: Verdicts<tch::Device> = Verdicts::new(CHECK, "LibTorch's SwiGLU and quantiser run");

/// Whether our kernel's forward has run in this process (bench JSON names SwiGLU's route).
static USED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether [`forward`] has run our kernel in this process.
pub fn used() -> bool {
    USED.load(std::sync::atomic::Ordering::Relaxed)
}

/// Whether SwiGLU of `gate` kept as `storage` takes our kernel: FP8 storage, bf16 inputs, a
/// device taking the CUDA routes with `LLORA_CUDA_FUSED_ROUTES` on, the kernel checked there.
pub fn takes_kernel(gate: &tch::Tensor, storage: Storage) -> bool {
    let device = gate.device();
    storage == Storage::Fp8
        && gate.kind() == tch::Kind::BFloat16
        && crate::routes::takes_cuda_routes(device)
        && crate::routes::fused_routes()
        && VERDICTS.passed(device, || check(device))
}

/// [`check`] on `device` once per process, its result kept (`llora selftest`).
pub fn verdict(device: tch::Device) -> Result<(), String> {
    VERDICTS.check(device, || check(device))
}

/// What the kernel's forward gives: h, and gate's and up's codes with their inverse scales.
pub struct Forward {
    /// silu(gate) · up, bf16.
    pub h: tch::Tensor,
    /// gate's E4M3 codes.
    pub gate_codes: tch::Tensor,
    /// up's E4M3 codes.
    pub up_codes: tch::Tensor,
    /// `[2]` f32: gate's and up's inverse scales.
    pub scale_inv: tch::Tensor,
}

impl Forward {
    /// Outputs for a problem of `gate`'s shape, to be written.
    fn empty(gate: &tch::Tensor) -> Self {
        let codes = || tch::Tensor::empty(gate.size(), (Fp8Format::E4M3.kind(), gate.device()));
        let scale_inv = tch::Tensor::zeros([2], (tch::Kind::Float, gate.device()));
        Self { h: gate.empty_like(), gate_codes: codes(), up_codes: codes(), scale_inv }
    }

    /// The forward's arguments writing into `self`, `amax` a `[2]` f32 scratch.
    fn args<'a>(&'a self, gate: &'a tch::Tensor, up: &'a tch::Tensor, amax: &'a tch::Tensor) -> ForwardArgs<'a> {
        let (out, gate_codes, up_codes, scale_inv) = (&self.h, &self.gate_codes, &self.up_codes, &self.scale_inv);
        ForwardArgs { gate, up, out, gate_codes, up_codes, scale_inv, amax, h: None }
    }
}

/// The kernel's forward on bf16 `gate` and `up` (contiguous copies where they are not).
///
/// # Shapes
/// - gate, up: `[.., I]` bf16; h and the codes: as gate
pub fn forward(gate: &tch::Tensor, up: &tch::Tensor) -> Result<Forward, String> {
    let (gate, up) = (gate.contiguous(), up.contiguous());
    let (out, amax) = (Forward::empty(&gate), tch::Tensor::zeros([2], (tch::Kind::Float, gate.device())));
    let args = out.args(&gate, &up, &amax);
    if !swiglu_fp8::forward(&args).map_err(|e| e.to_string())? {
        reference_forward(&args);
    }
    USED.store(true, std::sync::atomic::Ordering::Relaxed);
    Ok(out)
}

/// The kernel's backward: (grad of gate, grad of up) from the kept codes and h's gradient.
///
/// # Shapes
/// - codes, grad: `[.., I]`; scale_inv `[2]` f32; outputs: as grad, bf16
pub fn backward(
    gate_codes: &tch::Tensor,
    up_codes: &tch::Tensor,
    scale_inv: &tch::Tensor,
    grad: &tch::Tensor,
) -> Result<(tch::Tensor, tch::Tensor), String> {
    let grad = grad.contiguous();
    let (grad_gate, grad_up) = (grad.empty_like(), grad.empty_like());
    let args = BackwardArgs { gate_codes, up_codes, scale_inv, grad: &grad, grad_gate: &grad_gate, grad_up: &grad_up };
    if !swiglu_fp8::backward(&args).map_err(|e| e.to_string())? {
        reference_backward(&args);
    }
    Ok((grad_gate, grad_up))
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
    let got = forward(&gate, &up)?;
    let want = forward_reference(&gate, &up);
    let bits = host_bytes;
    for (name, a, b) in [
        ("gate codes", &got.gate_codes, &want.gate_codes),
        ("up codes", &got.up_codes, &want.up_codes),
        ("inverse scales", &got.scale_inv, &want.scale_inv),
    ] {
        if bits(a) != bits(b) {
            return Err(format!("{name} differ from the LibTorch route"));
        }
    }
    within_ulp("h", &got.h, &want.h)?;
    let grad = (gate.flip([0]) * 0.25).contiguous();
    let (gg, gu) = backward(&got.gate_codes, &got.up_codes, &got.scale_inv, &grad)?;
    let (gg_want, gu_want) = backward_reference(&want, &grad);
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
    let (out, amax) = (Forward::empty(gate), tch::Tensor::zeros([2], (tch::Kind::Float, gate.device())));
    reference_forward(&out.args(gate, up, &amax));
    out
}

/// The LibTorch route's backward on the reference's codes.
fn backward_reference(f: &Forward, grad: &tch::Tensor) -> (tch::Tensor, tch::Tensor) {
    let (grad_gate, grad_up) = (grad.empty_like(), grad.empty_like());
    let (gate_codes, up_codes, scale_inv) = (&f.gate_codes, &f.up_codes, &f.scale_inv);
    reference_backward(&BackwardArgs {
        gate_codes,
        up_codes,
        scale_inv,
        grad,
        grad_gate: &grad_gate,
        grad_up: &grad_up,
    });
    (grad_gate, grad_up)
}

/// The LibTorch route's forward (nodes.rs: `silu(gate) * up`, `Kept::keep` in FP8, and h's
/// codes as `quantize_via_f32` makes them): the reference the first-use check and the CUDA
/// test hold the kernel to, and what runs where the CPU stands in for CUDA.
pub fn reference_forward(a: &ForwardArgs<'_>) {
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
        let scale = hc.scale.to_kind(tch::Kind::Float);
        let limit = f64::from(hc.format.max());
        let codes = (h.to_kind(tch::Kind::Float) * scale).clamp(-limit, limit).to_kind(hc.format.kind());
        hc.codes.shallow_clone().copy_(&codes);
        let folded = hc.amax.maximum(&crate::fp8::amax_on_device(&h).reshape([1]));
        hc.amax.shallow_clone().copy_(&folded);
    }
}

/// The LibTorch route's backward (nodes.rs `SwigluBackward` on the dequantised inputs).
pub fn reference_backward(a: &BackwardArgs<'_>) {
    let _no_grad = tch::no_grad_guard();
    let kind = a.grad.kind();
    let gate = crate::fp8::dequantize_with(a.gate_codes, &a.scale_inv.get(0)).to_kind(kind);
    let up = crate::fp8::dequantize_with(a.up_codes, &a.scale_inv.get(1)).to_kind(kind);
    a.grad_up.shallow_clone().copy_(&(a.grad * gate.silu()));
    a.grad_gate.shallow_clone().copy_(&gate.silu_backward(&(a.grad * up)));
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
        let f = forward(&gate, &up).unwrap();
        let decode = |codes: &Tensor, i: i64| crate::fp8::dequantize_with(codes, &f.scale_inv.get(i));
        let (g, u) = (decode(&f.gate_codes, 0), decode(&f.up_codes, 1));
        let off =
            |x: &Tensor, y: &Tensor| (x.to_kind(Kind::Float) - y.to_kind(Kind::Float)).abs().max().double_value(&[]);
        assert!(off(&g, &gate) <= gate.abs().max().double_value(&[]) * 2f64.powi(-4));
        assert_eq!(off(&(gate.silu() * &up), &f.h), 0.0);
        let (g, u) =
            (g.to_kind(Kind::BFloat16).set_requires_grad(true), u.to_kind(Kind::BFloat16).set_requires_grad(true));
        let grad = Tensor::randn([4, 9], (Kind::Float, tch::Device::Cpu)).to_kind(Kind::BFloat16);
        (g.silu() * &u * &grad).sum(Kind::Float).backward();
        let (gg, gu) = backward(&f.gate_codes, &f.up_codes, &f.scale_inv, &grad).unwrap();
        assert!(ulp(&gg, &g.grad()) && ulp(&gu, &u.grad()));
        assert!(check(tch::Device::Cpu).is_ok());
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
            let (mine, want) = (Forward::empty(&gate), Forward::empty(&gate));
            let scale = Tensor::from_slice(&[0.5f32]).to_device(dev);
            let codes = || Tensor::zeros(shape, (Kind::Float, dev)).to_kind(Fp8Format::E4M3.kind());
            let one = || Tensor::zeros([1], (Kind::Float, dev));
            let (hq, hq_want, ha, ha_want, amax) =
                (codes(), codes(), one(), one(), Tensor::zeros([2], (Kind::Float, dev)));
            let h =
                |codes, amax| Some(swiglu_fp8::DelayedCodes { codes, scale: &scale, amax, format: Fp8Format::E4M3 });
            assert!(swiglu_fp8::forward(&ForwardArgs { h: h(&hq, &ha), ..mine.args(&gate, &up, &amax) }).unwrap());
            reference_forward(&ForwardArgs { h: h(&hq_want, &ha_want), ..want.args(&gate, &up, &amax) });
            let bits = |t: &Tensor| host_bytes(t).unwrap();
            assert_eq!(bits(&mine.gate_codes), bits(&want.gate_codes), "gate codes, {shape:?}");
            assert_eq!(bits(&mine.up_codes), bits(&want.up_codes), "up codes, {shape:?}");
            assert_eq!(bits(&mine.scale_inv), bits(&want.scale_inv), "inverse scales, {shape:?}");
            assert_eq!(bits(&hq), bits(&hq_want), "h codes, {shape:?}");
            assert_eq!(bits(&ha), bits(&ha_want), "h amax, {shape:?}");
            assert!(ulp(&mine.h, &want.h), "h, {shape:?}");
            let grad = Tensor::randn(shape, (Kind::Float, dev)).to_kind(Kind::BFloat16);
            let (gg, gu) = backward(&mine.gate_codes, &mine.up_codes, &mine.scale_inv, &grad).unwrap();
            let (gg_want, gu_want) = backward_reference(&want, &grad);
            assert!(ulp(&gg, &gg_want) && ulp(&gu, &gu_want), "gradients, {shape:?}");
        }
    }
}
