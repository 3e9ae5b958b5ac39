//! Argument checks every kernel's launch code shares: a tensor's dtype, shape, contiguity and
//! device, each refusal naming the kernel and the argument. They run on any device (the CPU
//! tests check them).

use super::nvrtc::KernelError;

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
