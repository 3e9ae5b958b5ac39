//! Launching `dropout.cu`: inverted dropout in one pass, its mask drawn inside the kernel from
//! Philox (seed and element index: nothing kept, backward runs it again on the gradient)
//! ([`launch`]). The argument checks run anywhere; launching needs CUDA tensors, or the
//! emulation in the tests (status on GPUs: docs/gpu.md).

use super::args::Expect;
use super::launch::{THREADS, address, arg, ceil_div, grid_stride, launch as launch_kernel, target};
use super::nvrtc::{KernelError, Source};

/// The kernel's source (after the shared device helpers).
pub const SOURCE: Source = Source {
    name: "dropout.cu",
    text: concat!(include_str!("fp8_device.cuh"), include_str!("dropout.cu")),
    kernels: &["llora_dropout_bf16"],
};

/// Where a context-parallel rank's tokens sit in the whole sequence, whose mask is drawn:
/// the tensor's second-last dimension is two chunks, local position `l < chunk` being global
/// `starts[0] + l` and the rest `starts[1] + l − chunk`; global positions at or past `seq`
/// (padding) are kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SplitRows {
    /// Tokens per chunk.
    pub chunk: i64,
    /// Each chunk's first global position.
    pub starts: [i64; 2],
    /// Real tokens of the whole sequence.
    pub seq: i64,
}

/// What one launch reads and writes.
///
/// # Shapes
/// - x, y: any (bf16, contiguous); with a split `[.., 2·chunk, width]`
#[derive(Debug)]
pub struct DropoutArgs<'a> {
    /// The input (or, backward, the output's gradient).
    pub x: &'a tch::Tensor,
    /// The output, written: `x · keep / (1 − p)`.
    pub y: &'a tch::Tensor,
    /// The mask's seed (Philox's key).
    pub seed: u64,
    /// The probability of dropping an element, in (0, 1).
    pub p: f64,
    /// This rank's rows of the whole sequence's mask; `None`: the tensor's own mask.
    pub split: Option<SplitRows>,
    /// One f32 (`[1]`) the output's amax is folded into (max with what it holds, ≥ 0): the
    /// amax of current scaling taken in this pass; `None`: none taken.
    pub amax: Option<&'a tch::Tensor>,
}

impl DropoutArgs<'_> {
    /// The keep threshold on a mask word: ⌊(1 − p)·2³²⌋ (word < threshold keeps).
    pub fn threshold(&self) -> u32 {
        ((1.0 - self.p) * 4_294_967_296.0) as u32
    }

    /// The factor kept elements are multiplied by, as LibTorch's f32 arithmetic takes it.
    pub fn scale(&self) -> f32 {
        (1.0 / (1.0 - self.p)) as f32
    }

    /// `[local, width, chunk, g0, g1, seq]` of the kernel: the split's, or (no split) one
    /// row of the tensor's elements, so that element i is word i of the stream.
    fn layout(&self) -> [i64; 6] {
        let n = self.x.numel() as i64;
        match self.split {
            Some(s) => [2 * s.chunk, *self.x.size().last().unwrap_or(&1), s.chunk, s.starts[0], s.starts[1], s.seq],
            None => [1, n.max(1), 1, 0, 0, 1],
        }
    }
}

/// Checks the arguments: bf16, contiguous, one device, the same shape; p in (0, 1); with a
/// split, the second-last dimension two chunks.
pub fn check(a: &DropoutArgs<'_>) -> Result<(), KernelError> {
    let kernel = SOURCE.kernels[0];
    let refuse = |what: String| Err(KernelError::Arguments { kernel, what });
    if !(a.p > 0.0 && a.p < 1.0) {
        return refuse(format!("p = {} is not in (0, 1)", a.p));
    }
    let size = a.x.size();
    if let Some(s) = a.split {
        let d = size.len();
        if d < 2 || size[d - 2] != 2 * s.chunk || s.chunk < 1 || s.seq < 0 {
            return refuse(format!(
                "x is {size:?}: a split of chunks of {} wants [.., {}, width]",
                s.chunk,
                2 * s.chunk
            ));
        }
    }
    let e = Expect { kernel, device: a.x.device(), shape: &size };
    e.tensor("x", a.x, tch::Kind::BFloat16, None)?;
    e.tensor("y", a.y, tch::Kind::BFloat16, None)?;
    match a.amax {
        Some(amax) => e.tensor("amax", amax, tch::Kind::Float, Some(&[1])),
        None => Ok(()),
    }
}

/// The dropout on x's CUDA device (or emulated, in the tests), without waiting: `Ok(true)`.
/// `Ok(false)` for a CPU tensor: nothing launched, the caller runs the stand-in.
pub fn launch(a: &DropoutArgs<'_>) -> Result<bool, KernelError> {
    check(a)?;
    let Some(at) = target(a.x, SOURCE.kernels[0])? else { return Ok(false) };
    let mut n = a.x.numel() as i64;
    if n == 0 {
        return Ok(true);
    }
    let [mut local, mut width, mut chunk, mut g0, mut g1, mut seq] = a.layout();
    let (mut x, mut y, mut amax) = (address(Some(a.x)), address(Some(a.y)), address(a.amax));
    let (mut seed, mut threshold, mut scale) = (a.seed, a.threshold(), a.scale());
    let mut p = [
        arg(&mut x),
        arg(&mut y),
        arg(&mut n),
        arg(&mut local),
        arg(&mut width),
        arg(&mut chunk),
        arg(&mut g0),
        arg(&mut g1),
        arg(&mut seq),
        arg(&mut seed),
        arg(&mut threshold),
        arg(&mut scale),
        arg(&mut amax),
    ];
    // SAFETY: the kernel's parameters in order and type, checked above (x and y hold n
    // elements, amax one f32 or is null; the layout only names global positions, it indexes
    // nothing).
    unsafe { launch_kernel(&SOURCE, at, SOURCE.kernels[0], grid_stride(ceil_div(n, 4)), THREADS, &mut p)? };
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::args::assert_refused;
    use tch::{Kind, Tensor};

    /// Each refusal names the argument: p outside (0, 1), f32, another shape, a split whose
    /// chunks are not the tensor's rows, an amax of two values, a non-contiguous output; the threshold and scale are
    /// LibTorch's and the mask's.
    #[test]
    fn arguments_are_checked() {
        let t = |shape: &[i64], kind| Tensor::zeros(shape, (kind, tch::Device::Cpu));
        let (x, y) = (t(&[2, 6, 8], Kind::BFloat16), t(&[2, 6, 8], Kind::BFloat16));
        let split = SplitRows { chunk: 3, starts: [3, 6], seq: 11 };
        let ok = DropoutArgs { x: &x, y: &y, seed: 1, p: 0.25, split: Some(split), amax: None };
        assert!(check(&ok).is_ok());
        assert_eq!((ok.threshold(), ok.scale()), (3 << 30, 1.0 / 0.75));
        assert_refused(check(&DropoutArgs { p: 0.0, ..ok }), "p = 0 is not in (0, 1)");
        assert_refused(check(&DropoutArgs { p: 1.0, ..ok }), "p = 1 is not in (0, 1)");
        let f32 = t(&[2, 6, 8], Kind::Float);
        assert_refused(check(&DropoutArgs { x: &f32, ..ok }), "x is Float");
        let other = t(&[2, 6, 4], Kind::BFloat16);
        assert_refused(check(&DropoutArgs { y: &other, ..ok }), "y is BFloat16 [2, 6, 4]");
        let wrong = SplitRows { chunk: 4, ..split };
        assert_refused(check(&DropoutArgs { split: Some(wrong), ..ok }), "wants [.., 8, width]");
        let two = t(&[2], Kind::Float);
        assert_refused(check(&DropoutArgs { amax: Some(&two), ..ok }), "amax is Float [2]");
        let strided = t(&[2, 8, 6], Kind::BFloat16).transpose(1, 2);
        assert_refused(check(&DropoutArgs { y: &strided, ..ok }), "y is not contiguous");
        assert_eq!(launch(&ok), Ok(false), "a CPU tensor launches nothing");
    }
}
