//! The two FP8 formats (E4M3, E5M2): their ranges, torch dtypes, and a scalar, exact
//! emulation of torch's `float32 → float8` cast that the tests hold LibTorch's casts (and our
//! kernels) to. A leaf: the quantisation routes (`quantize.rs`) and the kernels (`kernels/`)
//! use it.

use serde::{Deserialize, Serialize};

/// An 8-bit floating-point format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Fp8Format {
    /// 4 exponent bits (bias 7), 3 mantissa bits, max 448, no infinity (torch `float8_e4m3fn`).
    E4M3,
    /// 5 exponent bits (bias 15), 2 mantissa bits, max 57344, ±∞ (torch `float8_e5m2`).
    E5M2,
}

impl Fp8Format {
    /// Largest finite magnitude.
    pub fn max(self) -> f32 {
        match self {
            Self::E4M3 => 448.0,
            Self::E5M2 => 57344.0,
        }
    }

    /// Mantissa (fraction) bits.
    fn mantissa_bits(self) -> i32 {
        match self {
            Self::E4M3 => 3,
            Self::E5M2 => 2,
        }
    }

    /// Exponent bias.
    fn bias(self) -> i32 {
        match self {
            Self::E4M3 => 7,
            Self::E5M2 => 15,
        }
    }

    /// The code a value past the range (or an infinity) becomes: NaN for E4M3, which has no
    /// infinity, and infinity for E5M2 (sign bit not included).
    fn overflow_code(self) -> u8 {
        match self {
            Self::E4M3 => 0x7F,
            Self::E5M2 => 0x7C,
        }
    }

    /// The LibTorch dtype of this format.
    pub fn kind(self) -> tch::Kind {
        match self {
            Self::E4M3 => tch::Kind::Float8e4m3fn,
            Self::E5M2 => tch::Kind::Float8e5m2,
        }
    }

    /// `x` rounded to the nearest code, ties to even, without saturation (torch's cast).
    pub fn encode(self, x: f32) -> u8 {
        let sign = ((x.to_bits() >> 24) & 0x80) as u8;
        if x.is_nan() {
            return sign | 0x7F;
        }
        if x.is_infinite() {
            return sign | self.overflow_code();
        }
        // f64 holds every f32 (subnormals included) as a normal number, so its exponent field
        // is floor(log2 |x|) and scaling by powers of two is exact.
        let a = f64::from(x.abs());
        if a == 0.0 {
            return sign;
        }
        let m = self.mantissa_bits();
        let emin = 1 - self.bias();
        let exp = |v: f64| ((v.to_bits() >> 52) & 0x7ff) as i32 - 1023;
        let quantum = 2f64.powi(exp(a).max(emin) - m);
        let r = (a / quantum).round_ties_even() * quantum;
        if r > f64::from(self.max()) {
            return sign | self.overflow_code();
        }
        if r == 0.0 {
            return sign;
        }
        let code = if exp(r) < emin {
            (r / 2f64.powi(emin - m)) as u8
        } else {
            let e = exp(r);
            let mantissa = (r / 2f64.powi(e - m)) as u8 - (1 << m);
            (((e + self.bias()) as u8) << m) | mantissa
        };
        sign | code
    }

    /// The value of a code (NaN codes give NaN).
    pub fn decode(self, code: u8) -> f32 {
        let m = self.mantissa_bits();
        let e = i32::from((code & 0x7F) >> m);
        let mantissa = i32::from(code & ((1 << m) - 1));
        let sign: f32 = if code & 0x80 != 0 { -1.0 } else { 1.0 };
        match self {
            Self::E4M3 if e == 15 && mantissa == 7 => return f32::NAN,
            Self::E5M2 if e == 31 => return if mantissa == 0 { sign * f32::INFINITY } else { f32::NAN },
            _ => {}
        }
        let v = if e == 0 {
            f64::from(mantissa) * 2f64.powi(1 - self.bias() - m)
        } else {
            f64::from((1 << m) + mantissa) * 2f64.powi(e - self.bias() - m)
        };
        sign * v as f32
    }

    /// Saturating per-tensor quantisation of a slice: `encode(clamp(x·scale, ±max))`.
    pub fn quantize_slice(self, xs: &[f32], scale: f32) -> Vec<u8> {
        let max = self.max();
        xs.iter().map(|&x| self.encode((x * scale).clamp(-max, max))).collect()
    }

    /// Inverse of [`Self::quantize_slice`]: `decode(q) · scale_inv`.
    pub fn dequantize_slice(self, qs: &[u8], scale_inv: f32) -> Vec<f32> {
        qs.iter().map(|&q| self.decode(q) * scale_inv).collect()
    }
}

/// What the tests of the FP8 code hold codes to: torch's own casts.
#[cfg(test)]
pub(crate) mod checks {
    use super::Fp8Format;
    use tch::{Kind, Tensor};

    pub(crate) fn torch_encode(xs: &[f32], format: Fp8Format) -> Vec<u8> {
        let t = Tensor::from_slice(xs).to_kind(format.kind()).view_dtype(Kind::Uint8);
        Vec::<u8>::try_from(&t).unwrap()
    }

    pub(crate) fn torch_decode(codes: &[u8], format: Fp8Format) -> Vec<f32> {
        let t = Tensor::from_slice(codes).view_dtype(format.kind()).to_kind(Kind::Float);
        Vec::<f32>::try_from(&t).unwrap()
    }

    pub(crate) fn assert_codes_match(xs: &[f32], format: Fp8Format) {
        let want = torch_encode(xs, format);
        for (i, (&x, &w)) in xs.iter().zip(&want).enumerate() {
            let got = format.encode(x);
            assert_eq!(
                got,
                w,
                "{format:?}: encode({x:e}) (bits {:#010x}, element {i}) = {got:#04x}, torch {w:#04x}",
                x.to_bits()
            );
        }
    }

    pub(crate) fn same_value(a: f32, b: f32) -> bool {
        (a.is_nan() && b.is_nan()) || a.to_bits() == b.to_bits()
    }
}

#[cfg(test)]
mod tests {
    use super::checks::*;
    use super::*;

    /// Every one of the 256 codes decodes to torch's value, and every finite value encodes
    /// back to its own code (both signs of zero included).
    #[test]
    fn every_code_matches_torch() {
        for format in [Fp8Format::E4M3, Fp8Format::E5M2] {
            let codes: Vec<u8> = (0..=255).collect();
            let torch = torch_decode(&codes, format);
            let mut finite = Vec::new();
            for (&c, &t) in codes.iter().zip(&torch) {
                let v = format.decode(c);
                assert!(same_value(v, t), "{format:?}: decode({c:#04x}) = {v}, torch {t}");
                if v.is_finite() {
                    assert_eq!(format.encode(v), c, "{format:?}: {v} does not encode to its code {c:#04x}");
                    finite.push(v);
                }
            }
            assert_codes_match(&finite, format);
            let expect_finite = match format {
                Fp8Format::E4M3 => 254, // 2 NaN codes
                Fp8Format::E5M2 => 248, // 2 infinities + 6 NaN codes
            };
            assert_eq!(finite.len(), expect_finite);
            assert_eq!(finite.iter().copied().fold(0.0, f32::max), format.max());
        }
    }

    /// Midpoints between neighbouring values (ties: to even), the f32 neighbours of each
    /// midpoint, and the same past the top of the range and below the smallest subnormal.
    #[test]
    fn ties_and_their_neighbours_match_torch() {
        for format in [Fp8Format::E4M3, Fp8Format::E5M2] {
            let mut values: Vec<f32> = (0..0x7F).map(|c| format.decode(c)).filter(|v| v.is_finite()).collect();
            let step = values[values.len() - 1] - values[values.len() - 2];
            values.push(format.max() + step); // the first value past the range
            let mut xs = Vec::new();
            for w in values.windows(2) {
                let mid = (w[0] + w[1]) / 2.0; // exact: a few significant bits
                for x in [mid, mid.next_down(), mid.next_up(), w[0].next_up(), w[1].next_down()] {
                    xs.extend([x, -x]);
                }
            }
            // Far below the smallest subnormal, f32 subnormals, and f32's extremes.
            xs.extend([1e-30, f32::from_bits(1), f32::MIN_POSITIVE, f32::MAX, 1e10, 0.0, -0.0]);
            assert_codes_match(&xs, format);
        }
    }
}
