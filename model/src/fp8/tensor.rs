//! The one FP8 tensor type: codes and the inverse scale that turns them back into values (a
//! GEMM operand, a saved activation, a stored weight), and the codes a kernel is asked to write
//! beside its output.

use burn::backend::libtorch::TchTensor;

use super::format::Fp8Format;
use super::quantize::{ScaleInv, dequantize};
use crate::kernels::args::DelayedCodes;

/// `1 / scale`, where it lives. Tensors are held as Burn's [`TchTensor`]s (shared between
/// threads as the autodiff graph's saved state is; clones share the storage).
#[derive(Debug, Clone)]
pub enum InvScale {
    /// On the host: delayed scaling (known before the cast) and stored weights.
    Host(f32),
    /// A 0-dim (or one-element) f32 on the codes' device: current scaling, computed there so
    /// the host never waits for it.
    Device(TchTensor),
}

impl ScaleInv for &InvScale {
    fn scale_in_place(&self, x: &mut tch::Tensor) {
        match self {
            InvScale::Host(s) => s.scale_in_place(x),
            InvScale::Device(t) => (&t.tensor).scale_in_place(x),
        }
    }
}

impl InvScale {
    /// As a 0-dim f32 tensor on `device` (a host value is filled there, never copied from
    /// pageable memory: that would make the host wait for the device).
    pub fn on_device(&self, device: tch::Device) -> tch::Tensor {
        match self {
            Self::Host(s) => tch::Tensor::full([] as [i64; 0], f64::from(*s), (tch::Kind::Float, device)),
            Self::Device(t) => t.tensor.reshape([] as [i64; 0]),
        }
    }
}

/// FP8 codes standing for `float(codes) · inv_scale`. Clones share the codes (no copy).
#[derive(Debug, Clone)]
pub struct Fp8Tensor {
    /// The codes (E4M3 or E5M2 dtype).
    codes: TchTensor,
    /// What multiplies the codes back to values.
    inv_scale: InvScale,
    /// For a stored `[out, in]` weight on CUDA: the codes transposed, `[in, out]` row-major.
    /// `_scaled_mm` there wants its second operand column-major, which for the input-gradient
    /// GEMM `g · W` is this tensor's transpose view. Kept rather than made at every backward (a
    /// 70B MLP weight's transpose is 235 MB of copying per layer per step).
    transposed: Option<TchTensor>,
}

impl Fp8Tensor {
    /// Codes and their inverse scale.
    pub fn new(codes: tch::Tensor, inv_scale: InvScale) -> Self {
        Self { codes: TchTensor::new(codes), inv_scale, transposed: None }
    }

    /// Codes with `1 / scale` on the host.
    pub fn host(codes: tch::Tensor, inv_scale: f32) -> Self {
        Self::new(codes, InvScale::Host(inv_scale))
    }

    /// Codes with `1 / scale` a 0-dim f32 on their device (current scaling).
    pub fn device(codes: tch::Tensor, inv_scale: tch::Tensor) -> Self {
        Self::new(codes, InvScale::Device(TchTensor::new(inv_scale)))
    }

    /// These codes with their transpose kept (see the field's doc).
    pub fn with_transposed(self, transposed: Option<tch::Tensor>) -> Self {
        Self { transposed: transposed.map(TchTensor::new), ..self }
    }

    /// The codes.
    pub fn codes(&self) -> &tch::Tensor {
        &self.codes.tensor
    }

    /// What multiplies the codes back to values.
    pub fn inv_scale(&self) -> &InvScale {
        &self.inv_scale
    }

    /// The codes' format (from their dtype).
    pub fn format(&self) -> Fp8Format {
        if self.codes().kind() == Fp8Format::E5M2.kind() { Fp8Format::E5M2 } else { Fp8Format::E4M3 }
    }

    /// The values, f32.
    ///
    /// # Shapes
    /// - output: as the codes
    pub fn dequantize(&self) -> tch::Tensor {
        dequantize(self.codes(), &self.inv_scale)
    }

    /// `codes` (another view or block of these codes, or of their transpose) at this scale, f32.
    pub fn dequantize_part(&self, codes: &tch::Tensor) -> tch::Tensor {
        dequantize(codes, &self.inv_scale)
    }

    /// The same codes in `shape` (a view where the codes allow), at this scale.
    pub fn reshape(&self, shape: &[i64]) -> Self {
        Self::new(self.codes().reshape(shape), self.inv_scale.clone())
    }

    /// The same codes viewed `[in, out]` (a transpose view: no copy).
    pub fn t(&self) -> Self {
        Self::new(self.codes().tr(), self.inv_scale.clone())
    }

    /// The same matrix laid out column-major, as `_scaled_mm` on CUDA wants its second operand:
    /// a view of the kept transposed codes when there are some, else a column-major copy.
    pub fn col_major(&self) -> Self {
        let codes = match &self.transposed {
            Some(t) => t.tensor.tr(),
            None => self.codes().tr().contiguous().tr(),
        };
        Self::new(codes, self.inv_scale.clone())
    }

    /// Bytes held: one a code, and the scale (a kept transpose counted too).
    pub fn bytes(&self) -> usize {
        let t = self.transposed.as_ref().map_or(0, |t| t.tensor.numel());
        self.codes().numel() + t + 4
    }
}

/// Codes a kernel writes beside its output at a delayed scale read on the device, and the
/// output's amax: what the next GEMM reads (SwiGLU's h for down_proj, a norm's output for q/k/v
/// or gate/up).
#[derive(Debug)]
pub struct CodesToWrite {
    /// The codes, `format`'s dtype, the output's shape.
    pub codes: tch::Tensor,
    /// The delayed scale, `[1]` f32 on the device.
    pub scale: tch::Tensor,
    /// The output's amax, `[1]` f32 (zero until written).
    pub amax: tch::Tensor,
    /// E4M3 (forward GEMM inputs) or E5M2.
    pub format: Fp8Format,
    /// The delayed scale on the host (what `scale` holds on the device).
    host_scale: f32,
}

impl CodesToWrite {
    /// Codes of `shape` to be written at `scale` on `device`.
    pub fn empty(shape: &[i64], scale: f32, format: Fp8Format, device: tch::Device) -> Self {
        Self {
            codes: tch::Tensor::empty(shape, (format.kind(), device)),
            scale: tch::Tensor::from_slice(&[scale]).to_device(device),
            amax: tch::Tensor::zeros([1], (tch::Kind::Float, device)),
            format,
            host_scale: scale,
        }
    }

    /// Once the kernel wrote them: the codes as an [`Fp8Tensor`] at `1 / scale`, and the
    /// output's amax (0-dim f32).
    pub fn written(self) -> (Fp8Tensor, tch::Tensor) {
        (Fp8Tensor::host(self.codes, 1.0 / self.host_scale), self.amax.reshape([] as [i64; 0]))
    }

    /// The kernel's view of them.
    pub fn args(&self) -> DelayedCodes<'_> {
        DelayedCodes { codes: &self.codes, scale: &self.scale, amax: &self.amax, format: self.format }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both homes of the inverse scale give the same values, and the transposed views read the
    /// same codes as the codes themselves.
    #[test]
    fn host_and_device_scales_and_the_views_agree() {
        let x = tch::Tensor::from_slice(&[1.0f32, -2.0, 3.5, 0.25, 6.0, -0.5]).view([2, 3]);
        let q = crate::fp8::quantize_tch(&x, 16.0, Fp8Format::E4M3);
        let host = Fp8Tensor::host(q.shallow_clone(), 1.0 / 16.0);
        let device = Fp8Tensor::device(q.shallow_clone(), tch::Tensor::from(1.0f32 / 16.0));
        assert!(host.dequantize().equal(&device.dequantize()));
        assert!(host.dequantize().allclose(&x, 0.0, 1e-6, false), "these values are exact in E4M3");
        assert!(host.t().dequantize().equal(&x.tr()));
        let kept = host.clone().with_transposed(Some(q.tr().contiguous()));
        assert!(kept.col_major().dequantize().equal(&x) && host.col_major().dequantize().equal(&x));
        assert_eq!(kept.col_major().codes().stride(), vec![1, 2], "column-major");
        assert_eq!(host.col_major().codes().stride(), vec![1, 2], "column-major");
        assert_eq!((host.bytes(), kept.bytes()), (10, 16));
        assert_eq!(host.format(), Fp8Format::E4M3);
    }
}
