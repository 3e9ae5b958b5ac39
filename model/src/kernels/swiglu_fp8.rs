//! Launching `swiglu_fp8.cu`: SwiGLU's forward writing bf16 h, down_proj's FP8 input and
//! gate/up kept as E4M3 codes ([`forward`]), and its backward reading those codes
//! ([`backward`]). The argument checks run anywhere; launching needs CUDA tensors (the CUDA
//! test is `precision::swiglu_route`'s `launches_equal_the_libtorch_route`, against the
//! LibTorch route; status on GPUs: docs/gpu.md).

pub use super::args::DelayedCodes;
use super::args::{Expect, codes_params};
use super::launch::{THREADS, address, arg, grid_stride, launch, target};
use super::nvrtc::{KernelError, Source};
use crate::fp8::format::Fp8Format;

/// The kernels' source (after the shared device helpers).
pub const SOURCE: Source = Source {
    name: "swiglu_fp8.cu",
    text: concat!(include_str!("fp8_device.cuh"), include_str!("swiglu_fp8.cu")),
    kernels: &["llora_swiglu_amax_bf16", "llora_swiglu_fp8_forward_bf16", "llora_swiglu_fp8_backward_bf16"],
};

/// What the forward reads and writes: every tensor contiguous, of the gate's shape unless said.
#[derive(Debug)]
pub struct ForwardArgs<'a> {
    /// gate_proj's output, bf16.
    pub gate: &'a tch::Tensor,
    /// up_proj's output, bf16.
    pub up: &'a tch::Tensor,
    /// h = silu(gate) · up, bf16.
    pub out: &'a tch::Tensor,
    /// gate's E4M3 codes at its current scale (kept for backward).
    pub gate_codes: &'a tch::Tensor,
    /// up's E4M3 codes at its current scale.
    pub up_codes: &'a tch::Tensor,
    /// `[2]` f32: gate's and up's inverse scales, written.
    pub scale_inv: &'a tch::Tensor,
    /// `[2]` f32 scratch: gate's and up's amaxes (zeroed and written).
    pub amax: &'a tch::Tensor,
    /// down_proj's FP8 input, when its GEMM runs in FP8.
    pub h: Option<DelayedCodes<'a>>,
}

/// What the backward reads and writes: the forward's codes and inverse scales, and bf16
/// gradients of the gate's shape.
#[derive(Debug)]
pub struct BackwardArgs<'a> {
    /// gate's E4M3 codes, as the forward kept them.
    pub gate_codes: &'a tch::Tensor,
    /// up's E4M3 codes.
    pub up_codes: &'a tch::Tensor,
    /// `[2]` f32 inverse scales, as the forward wrote them.
    pub scale_inv: &'a tch::Tensor,
    /// The gradient of h, bf16.
    pub grad: &'a tch::Tensor,
    /// The gradient of gate, bf16, written.
    pub grad_gate: &'a tch::Tensor,
    /// The gradient of up, bf16, written.
    pub grad_up: &'a tch::Tensor,
}

/// Checks the forward's arguments (dtypes, shapes, contiguity, one device, the h format).
pub fn check_forward(a: &ForwardArgs<'_>) -> Result<(), KernelError> {
    let shape = a.gate.size();
    let e = Expect { kernel: "llora_swiglu_fp8_forward_bf16", device: a.gate.device(), shape: &shape };
    let (bf16, e4m3, f32) = (tch::Kind::BFloat16, Fp8Format::E4M3.kind(), tch::Kind::Float);
    e.tensor("gate", a.gate, bf16, None)?;
    e.tensor("up", a.up, bf16, None)?;
    e.tensor("out", a.out, bf16, None)?;
    e.tensor("gate_codes", a.gate_codes, e4m3, None)?;
    e.tensor("up_codes", a.up_codes, e4m3, None)?;
    e.tensor("scale_inv", a.scale_inv, f32, Some(&[2]))?;
    e.tensor("amax", a.amax, f32, Some(&[2]))?;
    if let Some(h) = &a.h {
        h.check(&e, "h")?;
    }
    Ok(())
}

/// Checks the backward's arguments.
pub fn check_backward(a: &BackwardArgs<'_>) -> Result<(), KernelError> {
    let shape = a.grad.size();
    let e = Expect { kernel: "llora_swiglu_fp8_backward_bf16", device: a.grad.device(), shape: &shape };
    let (bf16, e4m3) = (tch::Kind::BFloat16, Fp8Format::E4M3.kind());
    e.tensor("grad", a.grad, bf16, None)?;
    e.tensor("gate_codes", a.gate_codes, e4m3, None)?;
    e.tensor("up_codes", a.up_codes, e4m3, None)?;
    e.tensor("scale_inv", a.scale_inv, tch::Kind::Float, Some(&[2]))?;
    e.tensor("grad_gate", a.grad_gate, bf16, None)?;
    e.tensor("grad_up", a.grad_up, bf16, None)
}

/// The forward on the gate's CUDA device (two launches: the amaxes, then the pass), on the
/// default stream, without waiting: `Ok(true)`. `Ok(false)` where the CPU stands in for CUDA
/// (`LLORA_CUDA_ROUTES_ON_CPU=1`): nothing was written, the caller runs its LibTorch route
/// (`precision/swiglu_route.rs`, which holds the reference).
pub fn forward(a: &ForwardArgs<'_>) -> Result<bool, KernelError> {
    check_forward(a)?;
    let Some(at) = target(a.gate, "llora_swiglu_fp8_forward_bf16")? else { return Ok(false) };
    let mut n = a.gate.numel() as i64;
    if n == 0 {
        return Ok(true);
    }
    let _ = a.amax.shallow_clone().zero_();
    let (mut gate, mut up, mut amax) = (address(Some(a.gate)), address(Some(a.up)), address(Some(a.amax)));
    let mut p = [arg(&mut gate), arg(&mut up), arg(&mut amax), arg(&mut n)];
    // SAFETY: (gate, up, amax bits, n) as the kernel takes them, checked above.
    unsafe { launch(&SOURCE, at, "llora_swiglu_amax_bf16", grid_stride(n), THREADS, &mut p)? };
    let (mut out, mut gq, mut uq) = (address(Some(a.out)), address(Some(a.gate_codes)), address(Some(a.up_codes)));
    let mut scale_inv = address(Some(a.scale_inv));
    let ([mut hq, mut hs, mut ha], mut h_limit, mut h_e5m2) = codes_params(a.h.as_ref());
    let mut e4m3_max = Fp8Format::E4M3.max();
    let mut p = [
        arg(&mut gate),
        arg(&mut up),
        arg(&mut out),
        arg(&mut gq),
        arg(&mut uq),
        arg(&mut amax),
        arg(&mut scale_inv),
        arg(&mut hq),
        arg(&mut hs),
        arg(&mut ha),
        arg(&mut n),
        arg(&mut e4m3_max),
        arg(&mut h_limit),
        arg(&mut h_e5m2),
    ];
    // SAFETY: the forward kernel's parameters in order and type, checked above.
    unsafe { launch(&SOURCE, at, "llora_swiglu_fp8_forward_bf16", grid_stride(n), THREADS, &mut p)? };
    Ok(true)
}

/// The backward on the gradient's CUDA device, on the default stream, without waiting:
/// `Ok(true)`; `Ok(false)` where the CPU stands in (as [`forward`]).
pub fn backward(a: &BackwardArgs<'_>) -> Result<bool, KernelError> {
    check_backward(a)?;
    let Some(at) = target(a.grad, "llora_swiglu_fp8_backward_bf16")? else { return Ok(false) };
    let mut n = a.grad.numel() as i64;
    if n == 0 {
        return Ok(true);
    }
    let (mut gq, mut uq, mut si) = (address(Some(a.gate_codes)), address(Some(a.up_codes)), address(Some(a.scale_inv)));
    let (mut grad, mut gg, mut gu) = (address(Some(a.grad)), address(Some(a.grad_gate)), address(Some(a.grad_up)));
    let mut p = [arg(&mut gq), arg(&mut uq), arg(&mut si), arg(&mut grad), arg(&mut gg), arg(&mut gu), arg(&mut n)];
    // SAFETY: the backward kernel's parameters in order and type, checked above.
    unsafe { launch(&SOURCE, at, "llora_swiglu_fp8_backward_bf16", grid_stride(n), THREADS, &mut p)? };
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::args::assert_refused;
    use tch::{Kind, Tensor};

    /// Tensors for a `[rows, cols]` problem on `dev`.
    struct Problem {
        gate: Tensor,
        up: Tensor,
        out: Tensor,
        gate_codes: Tensor,
        up_codes: Tensor,
        scale_inv: Tensor,
        amax: Tensor,
    }

    impl Problem {
        fn new(shape: [i64; 2], dev: tch::Device) -> Self {
            let bf16 = (Kind::BFloat16, dev);
            let codes = || Tensor::zeros(shape, (Fp8Format::E4M3.kind(), dev));
            Self {
                gate: Tensor::randn(shape, (Kind::Float, dev)).to_kind(Kind::BFloat16) * 3.0,
                up: Tensor::randn(shape, bf16),
                out: Tensor::zeros(shape, bf16),
                gate_codes: codes(),
                up_codes: codes(),
                scale_inv: Tensor::zeros([2], (Kind::Float, dev)),
                amax: Tensor::zeros([2], (Kind::Float, dev)),
            }
        }

        fn args(&self) -> ForwardArgs<'_> {
            ForwardArgs {
                gate: &self.gate,
                up: &self.up,
                out: &self.out,
                gate_codes: &self.gate_codes,
                up_codes: &self.up_codes,
                scale_inv: &self.scale_inv,
                amax: &self.amax,
                h: None,
            }
        }
    }

    /// Each wrong argument of either launch is refused naming it; valid CPU arguments pass the
    /// checks and are never launched.
    #[test]
    fn the_launch_checks_name_each_wrong_argument() {
        let p = Problem::new([3, 5], tch::Device::Cpu);
        assert!(check_forward(&p.args()).is_ok());
        let f32 = p.gate.to_kind(Kind::Float);
        assert_refused(check_forward(&ForwardArgs { gate: &f32, ..p.args() }), "gate is Float");
        let wide = Tensor::zeros([3, 6], (Kind::BFloat16, tch::Device::Cpu));
        assert_refused(check_forward(&ForwardArgs { up: &wide, ..p.args() }), "up is BFloat16 [3, 6]");
        assert_refused(check_forward(&ForwardArgs { gate_codes: &p.gate, ..p.args() }), "gate_codes");
        let strided = Tensor::zeros([5, 3], (Kind::BFloat16, tch::Device::Cpu)).tr();
        assert_refused(check_forward(&ForwardArgs { out: &strided, ..p.args() }), "out is not contiguous");
        assert_refused(check_forward(&ForwardArgs { scale_inv: &p.amax.get(0), ..p.args() }), "scale_inv");
        let one = Tensor::zeros([1], (Kind::Float, tch::Device::Cpu));
        let h = DelayedCodes { codes: &p.up_codes, scale: &p.scale_inv, amax: &one, format: Fp8Format::E4M3 };
        assert_refused(check_forward(&ForwardArgs { h: Some(h), ..p.args() }), "h scale");
        let grad = Tensor::zeros([3, 5], (Kind::BFloat16, tch::Device::Cpu));
        let back = BackwardArgs {
            gate_codes: &p.gate_codes,
            up_codes: &p.up_codes,
            scale_inv: &p.scale_inv,
            grad: &grad,
            grad_gate: &p.out,
            grad_up: &p.gate,
        };
        assert!(check_backward(&back).is_ok());
        assert_refused(check_backward(&BackwardArgs { grad_up: &f32, ..back }), "grad_up is Float");
        assert_eq!(forward(&p.args()), Ok(false), "a CPU tensor: nothing launched");
        assert_eq!(backward(&back), Ok(false), "a CPU tensor: nothing launched");
    }
}
