//! NF4, QLoRA's storage of a frozen weight (Dettmers et al. 2023): 4-bit NormalFloat codes,
//! one absmax scale per block of 64 values, and optionally those scales quantised again
//! ("double quantisation": 8-bit codes of `absmax − mean` per block of 256, with an f32 scale
//! per such block). Laid out as bitsandbytes' `quantize_4bit` lays it out (codes two to a byte,
//! the first in the high nibble; blocks over the flattened row-major tensor, the last one
//! shorter), so a weight quantised here dequantises to what PEFT + bitsandbytes compute with.
//!
//! Why by hand: this is a format (sixteen code values, a rounding rule, a byte layout), not an
//! engine; bitsandbytes is Python/CUDA, and its CPU path is itself a few lines of torch. The
//! rule, as its kernel applies it: each value is scaled by its block's `1/absmax` (divided
//! by the absmax in a last partial block), clamped to [−1, 1], and takes the code whose
//! interval between midpoints holds it (a value on a midpoint takes the lower code).
//!
//! Memory (70B, `[8192, 28672]` MLP weight): 0.5 byte a value + 4 bytes per 64 values = 0.5625
//! bytes a value, 0.516 with double quantisation; bf16 is 2.

/// The NF4 code values (bitsandbytes' `get_4bit_type("nf4")`): quantiles of a normal
/// distribution, normalised to [−1, 1], with an exact 0.
// Written as bitsandbytes prints its f32 table (each literal is exactly that f32).
#[allow(clippy::excessive_precision)]
pub const NF4: [f32; 16] = [
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
];

/// The values per absmax of QLoRA and bitsandbytes (`model.quant_block_size`).
pub const BLOCK: usize = 64;

/// Absmaxes per second-level scale in double quantisation (bitsandbytes' 256).
pub const DOUBLE_BLOCK: usize = 256;

/// A tensor in NF4.
#[derive(Debug, Clone, PartialEq)]
pub struct Nf4 {
    /// Codes, two a byte, the first in the high nibble; `len.div_ceil(2)` bytes.
    pub codes: Vec<u8>,
    /// The block scales.
    pub absmax: Absmax,
    /// Values per block.
    pub block: usize,
    /// Values.
    pub len: usize,
}

/// The absmax of every block, as stored.
#[derive(Debug, Clone, PartialEq)]
pub enum Absmax {
    /// f32, one a block.
    Plain(Vec<f32>),
    /// Double quantisation: `absmax = code8[q] · scale[block / 256] + offset`.
    Double {
        /// 8-bit codes into [`dynamic_map`], one a block.
        codes: Vec<u8>,
        /// One f32 per [`DOUBLE_BLOCK`] codes.
        scales: Vec<f32>,
        /// The mean absmax, subtracted before quantising.
        offset: f32,
    },
}

/// Codes of `values` scaled into [−1, 1] by blocks of `block`, into `code` (sorted): for each
/// block its absmax and the index of every value's code. Multiplies by `1/absmax` in full
/// blocks and divides in a last partial one, as bitsandbytes' kernel does (the two differ in
/// the last bit).
fn blockwise(values: &[f32], block: usize, code: &[f32]) -> (Vec<u8>, Vec<f32>) {
    let bounds: Vec<f32> = code.windows(2).map(|w| (w[0] + w[1]) / 2.0).collect();
    // The code of a scaled value: how many midpoints lie strictly below it.
    let index = |x: f32| bounds.partition_point(|&b| b < x) as u8;
    let (mut out, mut absmax) = (Vec::with_capacity(values.len()), Vec::with_capacity(values.len().div_ceil(block)));
    for chunk in values.chunks(block) {
        let am = chunk.iter().fold(0f32, |m, x| m.max(x.abs()));
        let am_safe = am.max(1e-38);
        if chunk.len() == block {
            let inv = 1.0 / am_safe;
            out.extend(chunk.iter().map(|&x| index((x * inv).clamp(-1.0, 1.0))));
        } else {
            out.extend(chunk.iter().map(|&x| index((x / am_safe).clamp(-1.0, 1.0))));
        }
        absmax.push(am);
    }
    (out, absmax)
}

/// bitsandbytes' signed 8-bit dynamic code (`create_dynamic_map()`): for exponents 10⁻⁶..10⁰,
/// 2ᵏ evenly spaced mantissas (the midpoints of `linspace(0.1, 1, 2ᵏ + 1)`) of either sign,
/// then 0 and 1; 256 values, sorted.
pub fn dynamic_map() -> Vec<f32> {
    let mut data: Vec<f32> = Vec::with_capacity(256);
    for i in 0..7i32 {
        let n = (1usize << i) + 1;
        let bounds = linspace_f32(0.1, 1.0, n);
        let scale = 10f64.powi(i - 6) as f32;
        for w in bounds.windows(2) {
            let mean = (w[0] + w[1]) / 2.0;
            data.push(scale * mean);
            data.push(-(scale * mean));
        }
    }
    data.extend([0.0, 1.0]);
    data.sort_by(f32::total_cmp);
    data
}

/// torch's `linspace(start, end, n)` in f32 on the CPU: an f32 step, the first half counted up
/// from `start` and the rest down from `end`, each value `start + step·i` (or `end − step·j`)
/// formed in wider precision and rounded once (checked against torch by `tests/it/parity/llama.rs`).
fn linspace_f32(start: f32, end: f32, n: usize) -> Vec<f32> {
    let (start, end) = (start as f64, end as f64);
    let step = ((end - start) / (n - 1) as f64) as f32 as f64;
    let half = n / 2;
    (0..n).map(|i| if i < half { start + step * i as f64 } else { end - step * (n - 1 - i) as f64 } as f32).collect()
}

impl Nf4 {
    /// `values` (a flattened row-major tensor) in NF4 with blocks of `block`, the absmaxes
    /// double-quantised when `double`.
    pub fn quantize(values: &[f32], block: usize, double: bool) -> Self {
        assert!(block >= 1, "NF4 block size must be at least 1");
        let (q, absmax) = blockwise(values, block, &NF4);
        let codes = q.chunks(2).map(|p| (p[0] << 4) | p.get(1).copied().unwrap_or(7)).collect();
        let absmax = if double {
            // The mean in f64, rounded once (bitsandbytes takes torch's f32 mean).
            let offset = (absmax.iter().map(|&a| a as f64).sum::<f64>() / absmax.len().max(1) as f64) as f32;
            let centred: Vec<f32> = absmax.iter().map(|a| a - offset).collect();
            let (codes, scales) = blockwise(&centred, DOUBLE_BLOCK, &dynamic_map());
            Absmax::Double { codes, scales, offset }
        } else {
            Absmax::Plain(absmax)
        };
        Self { codes, absmax, block, len: values.len() }
    }

    /// The block scales as they dequantise.
    pub fn absmax(&self) -> Vec<f32> {
        match &self.absmax {
            Absmax::Plain(a) => a.clone(),
            Absmax::Double { codes, scales, offset } => {
                let map = dynamic_map();
                codes.iter().enumerate().map(|(i, &q)| map[q as usize] * scales[i / DOUBLE_BLOCK] + offset).collect()
            }
        }
    }

    /// The values: each code's NF4 value times its block's absmax.
    pub fn dequantize(&self) -> Vec<f32> {
        let absmax = self.absmax();
        (0..self.len)
            .map(|i| {
                let byte = self.codes[i / 2];
                let q = if i % 2 == 0 { byte >> 4 } else { byte & 0xF };
                NF4[q as usize] * absmax[i / self.block]
            })
            .collect()
    }

    /// Bytes stored: codes and scales.
    pub fn bytes(&self) -> usize {
        self.codes.len()
            + match &self.absmax {
                Absmax::Plain(a) => 4 * a.len(),
                Absmax::Double { codes, scales, .. } => codes.len() + 4 * scales.len() + 4,
            }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Worked by hand: a block of 4 with absmax 2: 2 → 1.0 (code 15), −1 → −0.5 (between
    /// −0.5251 and −0.3949, nearer the first: code 2), 0.1 → 0.05 (code 8: above the
    /// midpoint 0.0398), 0 → code 7; packed 0xF2, 0x87. Dequantised: 2, −1.0501, 0.1592, 0.
    #[test]
    fn a_block_by_hand() {
        let q = Nf4::quantize(&[2.0, -1.0, 0.1, 0.0], 4, false);
        assert_eq!(q.codes, vec![0xF2, 0x87]);
        assert_eq!(q.absmax, Absmax::Plain(vec![2.0]));
        assert_eq!(q.dequantize(), vec![2.0, NF4[2] * 2.0, NF4[8] * 2.0, 0.0]);
        assert_eq!(q.bytes(), 2 + 4);
    }

    /// The dynamic map has bitsandbytes' shape: 256 sorted values in [−1, 1] with 0 and 1,
    /// its largest below 1 being 0.99296875 (the midpoint of 0.9859375 and 1 at 10⁰).
    #[test]
    fn dynamic_map_shape() {
        let m = dynamic_map();
        assert_eq!(m.len(), 256);
        assert!(m.windows(2).all(|w| w[0] <= w[1]));
        assert_eq!((m[0], m[254], m[255]), (-0.99296874, 0.99296874, 1.0));
        assert!(m.contains(&0.0));
    }

    /// Double quantisation keeps every absmax within 1% of its f32 value, in fewer bytes.
    #[test]
    fn double_quantised_scales_stay_close() {
        let values: Vec<f32> = (0..64 * 600).map(|i| ((i * 7919 % 1000) as f32 - 500.0) * 1e-3).collect();
        let plain = Nf4::quantize(&values, 64, false).absmax();
        let double = Nf4::quantize(&values, 64, true);
        assert!(double.bytes() < Nf4::quantize(&values, 64, false).bytes());
        for (a, b) in plain.iter().zip(double.absmax()) {
            assert!((a - b).abs() <= 0.01 * a.abs().max(1e-3), "{a} vs {b}");
        }
    }
}
