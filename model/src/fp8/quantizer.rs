//! How a tensor becomes an [`Fp8Tensor`] (Transformer Engine's quantizers): at a delayed scale
//! known on the host, or at its own amax computed on its device (current scaling). Each routes
//! through `quantize.rs`'s checked routes; the result carries the codes and their inverse scale
//! together, so no caller pairs them by hand.

use super::format::Fp8Format;
use super::quantize::{quantize_and_amax, quantize_current_at_amax, quantize_current_on_device, quantize_tch};
use super::tensor::Fp8Tensor;

/// A way to quantise.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Quantizer {
    /// At `scale` (a delayed scale from earlier steps' amaxes, or a stored weight's own).
    Delayed {
        /// The scale (finite, > 0).
        scale: f32,
        /// E4M3 or E5M2.
        format: Fp8Format,
    },
    /// At `max / amax(x)`, computed on x's device (nothing read back).
    Current(Fp8Format),
}

impl Quantizer {
    /// `x` as FP8 codes with their inverse scale.
    ///
    /// # Shapes
    /// - x: any; the codes: as x
    pub fn quantize(self, x: &tch::Tensor) -> Fp8Tensor {
        match self {
            Self::Delayed { scale, format } => Fp8Tensor::host(quantize_tch(x, scale, format), 1.0 / scale),
            Self::Current(format) => {
                let (codes, scale_inv) = quantize_current_on_device(x, format);
                Fp8Tensor::device(codes, scale_inv)
            }
        }
    }

    /// [`Quantizer::Current`]'s quantisation of `x` at the amax the op that wrote `x` took
    /// (`[1]` f32 on x's device): the same codes, without an amax pass of their own.
    pub fn quantize_current_at_amax(format: Fp8Format, x: &tch::Tensor, amax: &tch::Tensor) -> Fp8Tensor {
        let (codes, scale_inv) = quantize_current_at_amax(x, amax, format);
        Fp8Tensor::device(codes, scale_inv)
    }

    /// [`Self::quantize`] at a delayed scale, with `x`'s amax from the same pass (a 0-dim f32 on
    /// x's device, read by nobody).
    pub fn quantize_with_amax(scale: f32, format: Fp8Format, x: &tch::Tensor) -> (Fp8Tensor, tch::Tensor) {
        let (codes, amax) = quantize_and_amax(x, scale, format);
        (Fp8Tensor::host(codes, 1.0 / scale), amax)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A quantizer's tensor stands for its input as the codes and scale the routes give: a
    /// delayed one at `1 / scale` on the host, a current one at `amax / max` on the device.
    #[test]
    fn a_quantizer_carries_its_codes_and_their_scale() {
        let x = tch::Tensor::from_slice(&[0.5f32, -3.0, 100.0, 1e-3]);
        let delayed = Quantizer::Delayed { scale: 2.0, format: Fp8Format::E4M3 }.quantize(&x);
        assert!(matches!(delayed.inv_scale(), super::super::InvScale::Host(s) if *s == 0.5));
        // 100 · 2 = 200, halfway between E4M3's 192 and 208: to even, 192, so 96; 1e-3 · 2 is
        // the subnormal 2^-9.
        assert_eq!(Vec::<f32>::try_from(delayed.dequantize()).unwrap(), [0.5, -3.0, 96.0, 0.0009765625]);
        let current = Quantizer::Current(Fp8Format::E4M3).quantize(&x);
        let inv = current.inv_scale().on_device(tch::Device::Cpu).double_value(&[]);
        assert_eq!(inv, f64::from(100.0f32 / 448.0));
        let (with_amax, amax) = Quantizer::quantize_with_amax(2.0, Fp8Format::E5M2, &x);
        assert_eq!((with_amax.format(), amax.double_value(&[])), (Fp8Format::E5M2, 100.0));
    }
}
