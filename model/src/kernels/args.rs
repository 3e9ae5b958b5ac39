//! What every kernel's launch code shares about its arguments: the checks of a tensor's dtype,
//! shape, contiguity and device (each refusal naming the kernel and the argument; they run on
//! any device, the CPU tests check them), and the one argument type several kernels take
//! (`DelayedCodes`: FP8 codes written at a delayed scale, with their amax).

use super::launch::address;
use super::nvrtc::KernelError;
use crate::fp8::format::Fp8Format;

/// What a kernel needs of one tensor argument.
pub struct Expect<'a> {
    /// The kernel, for the error.
    pub kernel: &'static str,
    /// Where every tensor must be (the first input's device).
    pub device: tch::Device,
    /// The shape the problem gives.
    pub shape: &'a [i64],
}

impl Expect<'_> {
    /// Refuses `t` (named `name`) unless it is `kind`, contiguous, on the device, and of
    /// `shape` (`None`: the problem's shape).
    pub fn tensor(
        &self,
        name: &str,
        t: &tch::Tensor,
        kind: tch::Kind,
        shape: Option<&[i64]>,
    ) -> Result<(), KernelError> {
        let shape = shape.unwrap_or(self.shape);
        let what = if t.kind() != kind || t.size() != shape {
            format!("{name} is {:?} {:?}: want {kind:?} {shape:?}", t.kind(), t.size())
        } else if !t.is_contiguous() {
            format!("{name} is not contiguous (strides {:?})", t.stride())
        } else if t.device() != self.device {
            format!("{name} is on {:?}, the input on {:?}", t.device(), self.device)
        } else {
            return Ok(());
        };
        Err(KernelError::Arguments { kernel: self.kernel, what })
    }
}

/// An output's FP8 codes at a delayed scale read from the device, and its amax: what a kernel
/// writes beside its output for the next GEMM (SwiGLU's h for down_proj, a norm's output for
/// q/k/v or gate/up).
#[derive(Debug)]
pub struct DelayedCodes<'a> {
    /// The codes (`format`'s dtype, the output's shape).
    pub codes: &'a tch::Tensor,
    /// The delayed scale, one f32 on the device (read by the kernel, never by the host).
    pub scale: &'a tch::Tensor,
    /// One f32 the output's amax is folded into (max with what it holds, ≥ 0).
    pub amax: &'a tch::Tensor,
    /// E4M3 (forward GEMM inputs) or E5M2.
    pub format: Fp8Format,
}

impl DelayedCodes<'_> {
    /// Refuses codes, scale or amax (named `name codes`, ...) unlike what `e` expects.
    pub fn check(&self, e: &Expect<'_>, name: &str) -> Result<(), KernelError> {
        e.tensor(&format!("{name} codes"), self.codes, self.format.kind(), None)?;
        e.tensor(&format!("{name} scale"), self.scale, tch::Kind::Float, Some(&[1]))?;
        e.tensor(&format!("{name} amax"), self.amax, tch::Kind::Float, Some(&[1]))
    }
}

/// The kernel parameters of optional codes: the three addresses (0 for none), the format's
/// largest value (1 for none) and whether it is E5M2.
pub fn codes_params(c: Option<&DelayedCodes<'_>>) -> ([u64; 3], f32, i32) {
    let addresses = [address(c.map(|c| c.codes)), address(c.map(|c| c.scale)), address(c.map(|c| c.amax))];
    (addresses, c.map_or(1.0, |c| c.format.max()), i32::from(c.is_some_and(|c| c.format == Fp8Format::E5M2)))
}

/// The bytes of a tensor on the host (FP8 codes, f32 scales), for bit-for-bit comparisons of
/// a kernel with its reference; `None` where LibTorch cannot give them.
pub fn host_bytes(t: &tch::Tensor) -> Option<Vec<u8>> {
    Vec::<u8>::try_from(&t.reshape([-1]).view_dtype(tch::Kind::Uint8).to_device(tch::Device::Cpu)).ok()
}

/// Fails unless `got` is a refusal of the kernel's arguments whose message contains `word`.
#[cfg(test)]
pub fn assert_refused(got: Result<(), KernelError>, word: &str) {
    match got {
        Err(KernelError::Arguments { what, .. }) => assert!(what.contains(word), "{what}"),
        other => panic!("expected a refusal naming {word}, got {other:?}"),
    }
}
