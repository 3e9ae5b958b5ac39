//! Launching `rope.cu`: RoPE on q or k (or their gradients, rotated back) in one pass
//! ([`launch`]). The argument checks run anywhere; launching needs CUDA tensors, or the
//! emulation in the tests (status on GPUs: docs/gpu.md).

use super::args::Expect;
use super::launch::{THREADS, address, arg, grid_stride, launch as launch_kernel, target};
use super::nvrtc::{KernelError, Source};

/// The kernel's source (after the shared device helpers).
pub const SOURCE: Source = Source {
    name: "rope.cu",
    text: concat!(include_str!("fp8_device.cuh"), include_str!("rope.cu")),
    kernels: &["llora_rope_bf16"],
};

/// Which way the rotation goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// `x·cos + rotate_half(x)·sin`.
    Forward,
    /// The forward's gradient: `g·cos` plus `g·sin`'s halves swapped back, the second negated.
    Backward,
}

/// What one launch reads and writes, all bf16, contiguous, on one device.
///
/// # Shapes
/// - x, y: `[batch, seq, heads, head_dim]` (head_dim even)
/// - cos, sin: `[1 or batch, seq, 1, head_dim]` (one row of positions for all, or one a row)
#[derive(Debug)]
pub struct RopeArgs<'a> {
    /// q or k (or its gradient, backward).
    pub x: &'a tch::Tensor,
    /// cos of each position's angles.
    pub cos: &'a tch::Tensor,
    /// sin of each position's angles.
    pub sin: &'a tch::Tensor,
    /// The output, written (not `x`: the kernel reads both halves of a pair before writing).
    pub y: &'a tch::Tensor,
    /// Which way.
    pub direction: Direction,
}

/// Checks the arguments: dtypes, shapes, contiguity, one device, an even head_dim.
pub fn check(a: &RopeArgs<'_>) -> Result<(), KernelError> {
    let kernel = SOURCE.kernels[0];
    let refuse = |what: String| Err(KernelError::Arguments { kernel, what });
    let [b, s, _, hd] = a.x.size()[..] else {
        return refuse(format!("x is {:?}: want [batch, seq, heads, head_dim]", a.x.size()));
    };
    if hd % 2 != 0 {
        return refuse(format!("head_dim {hd} is odd: rotate_half pairs its halves"));
    }
    let e = Expect { kernel, device: a.x.device(), shape: &a.x.size() };
    let bf16 = tch::Kind::BFloat16;
    e.tensor("x", a.x, bf16, None)?;
    e.tensor("y", a.y, bf16, None)?;
    let tb = a.cos.size().first().copied().unwrap_or(0);
    let table = [if tb == b { b } else { 1 }, s, 1, hd];
    e.tensor("cos", a.cos, bf16, Some(&table))?;
    e.tensor("sin", a.sin, bf16, Some(&table))
}

/// The rotation on x's CUDA device (or emulated, in the tests), without waiting: `Ok(true)`.
/// `Ok(false)` for a CPU tensor: nothing launched, the caller runs the stand-in.
pub fn launch(a: &RopeArgs<'_>) -> Result<bool, KernelError> {
    check(a)?;
    let Some(at) = target(a.x, SOURCE.kernels[0])? else { return Ok(false) };
    let [b, s, h, hd] = a.x.size()[..] else { unreachable!("checked above") };
    let mut pairs = b * s * h * hd / 2;
    if pairs == 0 {
        return Ok(true);
    }
    let (mut x, mut cos, mut sin, mut y) =
        (address(Some(a.x)), address(Some(a.cos)), address(Some(a.sin)), address(Some(a.y)));
    let (mut half, mut heads, mut seq) = (hd / 2, h, s);
    let mut per_row = i32::from(a.cos.size()[0] > 1);
    let mut backward = i32::from(a.direction == Direction::Backward);
    let mut p = [
        arg(&mut x),
        arg(&mut cos),
        arg(&mut sin),
        arg(&mut y),
        arg(&mut pairs),
        arg(&mut half),
        arg(&mut heads),
        arg(&mut seq),
        arg(&mut per_row),
        arg(&mut backward),
    ];
    // SAFETY: the kernel's parameters in order and type, checked above (the tables hold a row
    // for every token the kernel indexes: tb = batch, or one row for all).
    unsafe { launch_kernel(&SOURCE, at, SOURCE.kernels[0], grid_stride(pairs), THREADS, &mut p)? };
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::args::assert_refused;
    use tch::{Kind, Tensor};

    /// Each refusal names the argument: a 3-d x, an odd head_dim, f32, a table of another
    /// length, a non-contiguous output.
    #[test]
    fn arguments_are_checked() {
        let t = |shape: &[i64], kind| Tensor::zeros(shape, (kind, tch::Device::Cpu));
        let (x, y, c) =
            (t(&[2, 3, 4, 8], Kind::BFloat16), t(&[2, 3, 4, 8], Kind::BFloat16), t(&[1, 3, 1, 8], Kind::BFloat16));
        let ok = RopeArgs { x: &x, cos: &c, sin: &c, y: &y, direction: Direction::Forward };
        assert!(check(&ok).is_ok());
        let per_row = t(&[2, 3, 1, 8], Kind::BFloat16);
        assert!(check(&RopeArgs { cos: &per_row, sin: &per_row, ..ok }).is_ok());
        let flat = t(&[2, 3, 32], Kind::BFloat16);
        assert_refused(check(&RopeArgs { x: &flat, ..ok }), "want [batch, seq, heads, head_dim]");
        let odd = t(&[2, 3, 4, 7], Kind::BFloat16);
        assert_refused(check(&RopeArgs { x: &odd, y: &odd, ..ok }), "odd");
        let f32 = t(&[2, 3, 4, 8], Kind::Float);
        assert_refused(check(&RopeArgs { x: &f32, ..ok }), "x is Float");
        let short = t(&[1, 2, 1, 8], Kind::BFloat16);
        assert_refused(check(&RopeArgs { cos: &short, ..ok }), "cos is BFloat16 [1, 2, 1, 8]");
        let strided = t(&[2, 3, 8, 4], Kind::BFloat16).transpose(2, 3);
        assert_refused(check(&RopeArgs { y: &strided, ..ok }), "y is not contiguous");
        assert_eq!(launch(&ok), Ok(false), "a CPU tensor launches nothing");
    }
}
