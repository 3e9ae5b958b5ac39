//! Rotary position embeddings (RoPE): the frequency tables, Llama 3's frequency scaling, and
//! their application to queries and keys, in HF transformers' `rotate_half` layout; on a
//! device taking the CUDA routes, bf16 q and k take our kernel (`fused.rs`).

pub mod fused;

use anyhow::{Context, bail, ensure};
use burn::tensor::{Device, Tensor, TensorData};
use serde::{Deserialize, Serialize};

/// Llama 3.1+'s RoPE scaling (`rope_type = "llama3"`): long wavelengths are stretched by
/// `factor`, short ones kept, the band between interpolated (transformers'
/// `_compute_llama3_parameters`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Llama3Scaling {
    /// How much longer than the pre-training context the long wavelengths become (8 for 3.1, 32 for 3.2).
    pub factor: f64,
    /// Wavelengths above `original_max_position_embeddings / low_freq_factor` are scaled.
    pub low_freq_factor: f64,
    /// Wavelengths below `original_max_position_embeddings / high_freq_factor` are kept.
    pub high_freq_factor: f64,
    /// The context length of pre-training (8192 for Llama 3).
    pub original_max_position_embeddings: usize,
}

impl Llama3Scaling {
    /// Reads the scaling keys of an HF `rope_scaling` / `rope_parameters` object; `max_pos` is
    /// the fallback for `original_max_position_embeddings`, as in transformers.
    pub fn from_hf(v: &serde_json::Value, max_pos: usize) -> anyhow::Result<Self> {
        let num = |key: &str| -> anyhow::Result<f64> {
            let x = v.get(key).with_context(|| format!("{key} is missing"))?;
            let x = x.as_f64().with_context(|| format!("{key} = {x} is not a number"))?;
            ensure!(x.is_finite() && x > 0.0, "{key} = {x} must be a finite number > 0");
            Ok(x)
        };
        let original = match v.get("original_max_position_embeddings") {
            None => max_pos,
            Some(n) => {
                n.as_u64().filter(|&n| n > 0).context("original_max_position_embeddings must be a positive integer")?
                    as usize
            }
        };
        let s = Self {
            factor: num("factor")?,
            low_freq_factor: num("low_freq_factor")?,
            high_freq_factor: num("high_freq_factor")?,
            original_max_position_embeddings: original,
        };
        if s.high_freq_factor <= s.low_freq_factor {
            bail!("high_freq_factor ({}) must exceed low_freq_factor ({})", s.high_freq_factor, s.low_freq_factor);
        }
        Ok(s)
    }

    /// The scaled frequencies, in f32 as transformers computes them.
    fn apply(&self, inv_freq: &mut [f32]) {
        let old = self.original_max_position_embeddings as f32;
        let (factor, low, high) = (self.factor as f32, self.low_freq_factor as f32, self.high_freq_factor as f32);
        let (low_wavelen, high_wavelen) = (old / low, old / high);
        for f in inv_freq {
            let wavelen = 2.0 * std::f32::consts::PI / *f;
            if wavelen > low_wavelen {
                *f /= factor;
            } else if wavelen >= high_wavelen {
                let smooth = (old / wavelen - low) / (high - low);
                *f = (1.0 - smooth) * *f / factor + smooth * *f;
            }
        }
    }
}

/// The inverse frequencies `θ^(-2j/hd)`, j < hd/2, scaled by `scaling` when given.
pub fn inv_freq(head_dim: usize, theta: f64, scaling: Option<&Llama3Scaling>) -> Vec<f32> {
    // Computed in f64 then rounded: HF computes inv_freq in f32; the difference is below f32
    // resolution for the bases Llama uses. The scaling then runs in f32, as HF's does.
    let mut f: Vec<f32> =
        (0..head_dim / 2).map(|j| (1.0 / theta.powf((2 * j) as f64 / head_dim as f64)) as f32).collect();
    if let Some(s) = scaling {
        s.apply(&mut f);
    }
    f
}

/// RoPE angle tables: `cos`/`sin` of `pos·inv_freq`, duplicated to the full head width as
/// `cat(f, f)`, for positions `0..seq`.
///
/// # Shapes
/// - output: (cos, sin), each `[1, 1, seq, head_dim]`, f32
pub fn rope_tables(
    seq: usize,
    head_dim: usize,
    theta: f64,
    scaling: Option<&Llama3Scaling>,
    device: &Device,
) -> (Tensor<4>, Tensor<4>) {
    rope_tables_at(0..seq, head_dim, theta, scaling, device)
}

/// [`rope_tables`] for the positions `positions` only (a decoding step needs one).
///
/// # Shapes
/// - output: (cos, sin), each `[1, 1, positions.len(), head_dim]`, f32
pub fn rope_tables_at(
    positions: std::ops::Range<usize>,
    head_dim: usize,
    theta: f64,
    scaling: Option<&Llama3Scaling>,
    device: &Device,
) -> (Tensor<4>, Tensor<4>) {
    let inv_freq = inv_freq(head_dim, theta, scaling);
    let seq = positions.len();
    let mut cos = Vec::with_capacity(seq * head_dim);
    let mut sin = Vec::with_capacity(seq * head_dim);
    for pos in positions {
        for _ in 0..2 {
            for f in &inv_freq {
                let angle = pos as f32 * f;
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
    }
    let shape = [1, 1, seq, head_dim];
    (Tensor::from_data(TensorData::new(cos, shape), device), Tensor::from_data(TensorData::new(sin, shape), device))
}

/// The RoPE tables of the longest sequence seen so far, on one device in one dtype, shared by
/// a model and its clones.
///
/// Why: the tables are computed on the host (2·seq·head_dim sines and cosines) and uploaded,
/// with the device idle meanwhile (docs/performance.md, M9), and the upload from pageable
/// memory is a host-device synchronisation. Each position's row depends
/// on that position alone, so a shorter sequence reads the first rows of the longer tables.
#[derive(Debug, Clone, Default)]
pub struct RopeCache(std::sync::Arc<std::sync::Mutex<Option<RopeTables>>>);

/// One pair of cached tables and what they were made for.
#[derive(Debug)]
pub struct RopeTables {
    device: Device,
    dtype: burn::tensor::DType,
    cos: Tensor<4>,
    sin: Tensor<4>,
}

impl RopeCache {
    /// The tables of positions `0..seq` on `device` in `dtype`; `make(n)` computes those of
    /// `0..n` when the cache has none long enough (then they replace it).
    ///
    /// # Shapes
    /// - output: (cos, sin), each `[1, 1, seq, head_dim]`
    pub fn get(
        &self,
        seq: usize,
        device: &Device,
        dtype: burn::tensor::DType,
        make: impl FnOnce(usize) -> (Tensor<4>, Tensor<4>),
    ) -> (Tensor<4>, Tensor<4>) {
        let mut cached = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let fits = cached.as_ref().is_some_and(|c| c.device == *device && c.dtype == dtype && c.cos.dims()[2] >= seq);
        if !fits {
            let (cos, sin) = make(seq);
            *cached = Some(RopeTables { device: device.clone(), dtype, cos, sin });
        }
        let c = cached.as_ref().expect("filled above");
        if c.cos.dims()[2] == seq {
            return (c.cos.clone(), c.sin.clone());
        }
        (c.cos.clone().narrow(2, 0, seq), c.sin.clone().narrow(2, 0, seq))
    }
}

/// `x·cos + rotate_half(x)·sin`, with `rotate_half(x) = cat(-x[hd/2:], x[:hd/2])`.
///
/// # Shapes
/// - x: `[batch, heads, seq, head_dim]`
/// - cos, sin: `[1, 1, seq, head_dim]`
/// - output: `[batch, heads, seq, head_dim]`
pub fn apply_rope(x: Tensor<4>, cos: Tensor<4>, sin: Tensor<4>) -> Tensor<4> {
    if fused::takes_kernel(&x) {
        return fused::rope(x, cos, sin);
    }
    let hd = x.dims()[3];
    let first = x.clone().narrow(3, 0, hd / 2);
    let second = x.clone().narrow(3, hd / 2, hd / 2);
    let rotated = Tensor::cat(vec![second.neg(), first], 3);
    x * cos + rotated * sin
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The cache computes the tables once for the longest sequence, and a shorter one reads
    /// exactly what computing it directly gives; another dtype or a longer sequence recomputes.
    #[test]
    fn rope_cache_serves_shorter_sequences_from_the_longest() {
        let device = Device::libtorch();
        let cache = RopeCache::default();
        let made = std::cell::Cell::new(0);
        let make = |n: usize| {
            made.set(made.get() + 1);
            rope_tables_at(0..n, 16, 10000.0, None, &device)
        };
        let f32 = burn::tensor::DType::F32;
        let _ = cache.get(9, &device, f32, make);
        let (cos, sin) = cache.get(5, &device, f32, make);
        assert_eq!(made.get(), 1);
        let (want_cos, want_sin) = rope_tables_at(0..5, 16, 10000.0, None, &device);
        assert_eq!(cos.dims(), [1, 1, 5, 16]);
        assert_eq!(cos.into_data(), want_cos.into_data());
        assert_eq!(sin.into_data(), want_sin.into_data());
        let _ = cache.get(12, &device, f32, make);
        let _ = cache.get(12, &device, burn::tensor::DType::BF16, |n| {
            let (c, s) = make(n);
            (c.cast(burn::tensor::DType::BF16), s.cast(burn::tensor::DType::BF16))
        });
        assert_eq!(made.get(), 3);
    }

    /// Llama 3.1 8B's frequencies (θ 500000, hd 128, factor 8, 1, 4, 8192) by hand at the three
    /// bands: the highest frequency kept, the lowest divided by 8, one in between interpolated.
    #[test]
    fn llama3_scaling_by_band() {
        let s = Llama3Scaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        };
        let plain = inv_freq(128, 500000.0, None);
        let scaled = inv_freq(128, 500000.0, Some(&s));
        assert_eq!(scaled[0], plain[0], "wavelength 2π < 2048: kept");
        assert_eq!(scaled[63], plain[63] / 8.0, "wavelength > 8192: divided by the factor");
        // j = 30: wavelength 2π/f between 2048 and 8192.
        let (f, w) = (plain[30], 2.0 * std::f32::consts::PI / plain[30]);
        assert!((2048.0..=8192.0).contains(&w), "{w}");
        let smooth = (8192.0 / w - 1.0) / 3.0;
        assert_eq!(scaled[30], (1.0 - smooth) * f / 8.0 + smooth * f);
    }

    #[test]
    fn scaling_keys_are_checked() {
        let ok =
            serde_json::json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0});
        assert_eq!(Llama3Scaling::from_hf(&ok, 4096).unwrap().original_max_position_embeddings, 4096);
        let missing = serde_json::json!({"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0});
        assert!(Llama3Scaling::from_hf(&missing, 4096).unwrap_err().to_string().contains("low_freq_factor"));
        let swapped = serde_json::json!({"factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0});
        assert!(Llama3Scaling::from_hf(&swapped, 4096).unwrap_err().to_string().contains("must exceed"));
    }
}
