//! Frozen base weights held outside Burn's parameters: in bf16, as FP8 codes + scale, or in NF4
//! (`shard.rs` holds a rank's shard of one, and `FrozenWeight`, the whole or the shard).

use burn::backend::libtorch::TchTensor;
use tch::Kind;

use super::nf4;
use super::spec::{Compute, PrecisionSpec};
use crate::fp8::tensor::Fp8Tensor;
use crate::fp8::{Fp8Format, quantize_tch};

/// Elements converted at a time when storing a weight (16 MB of f32).
const CONVERT_CHUNK: usize = 1 << 22;

/// `max |x|` of host values, NaN if any is NaN (as [`amax_tch`]).
fn host_amax(values: &[f32]) -> f32 {
    let mut amax = 0.0f32;
    for &x in values {
        if x.is_nan() {
            return f32::NAN;
        }
        amax = amax.max(x.abs());
    }
    amax
}

/// A frozen weight held outside Burn's parameter: in reduced precision, or (sharded) in f32.
#[derive(Debug, Clone)]
pub enum StoredWeight {
    /// f32 (the whole weight of a sharded f32 layer while gathered).
    F32(TchTensor),
    /// bf16 copy.
    Bf16(TchTensor),
    /// E4M3 codes `[out, in]` row-major, `1 / scale` on the host, and on CUDA (unless one
    /// layout is asked for) their transpose ([`Fp8Tensor::transposed`]).
    Fp8(Fp8Tensor),
    /// NF4 (QLoRA), laid out as [`super::nf4::Nf4`] on the device.
    Nf4 {
        /// Codes, two a byte, the first in the high nibble: `u8 [ceil(out·in / 2)]`.
        codes: TchTensor,
        /// The block scales.
        absmax: Nf4Scales,
        /// Values per block.
        block: usize,
        /// `[out, in]`.
        dims: [usize; 2],
    },
}

/// Values an NF4 weight is decoded at a time (16 MB of f32).
const NF4_CHUNK: usize = 1 << 22;

/// The decoding tables on `device`: each byte's two NF4 values (`[256, 2]`) and the 8-bit
/// dynamic map of double-quantised scales (`[256]`). Made once per device: decoding runs for
/// every GEMM, and an upload there would be a host-to-device copy per GEMM.
fn nf4_tables(device: tch::Device) -> (tch::Tensor, tch::Tensor) {
    static TABLES: std::sync::Mutex<Vec<(tch::Device, tch::Tensor, tch::Tensor)>> = std::sync::Mutex::new(Vec::new());
    let mut tables = TABLES.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, pairs, map)) = tables.iter().find(|(d, ..)| *d == device) {
        return (pairs.shallow_clone(), map.shallow_clone());
    }
    let pairs: Vec<f32> = (0..256usize).flat_map(|b| [super::nf4::NF4[b >> 4], super::nf4::NF4[b & 0xF]]).collect();
    let pairs = tch::Tensor::from_slice(&pairs).reshape([256, 2]).to_device(device);
    let map = tch::Tensor::from_slice(&super::nf4::dynamic_map()).to_device(device);
    tables.push((device, pairs.shallow_clone(), map.shallow_clone()));
    (pairs, map)
}

/// An NF4 weight's absmaxes on the device.
#[derive(Debug, Clone)]
pub enum Nf4Scales {
    /// f32 `[blocks]`.
    Plain(TchTensor),
    /// Double quantisation: `u8 [blocks]` codes into the 8-bit dynamic map, f32 `[ceil(blocks / 256)]`
    /// scales, and the offset.
    Double {
        /// Codes.
        codes: TchTensor,
        /// Scales.
        scales: TchTensor,
        /// The mean absmax.
        offset: f32,
    },
}

impl Nf4Scales {
    /// The absmaxes, f32 `[blocks]`: `map[q] · scale + offset` with double quantisation.
    fn values(&self) -> tch::Tensor {
        match self {
            Self::Plain(a) => a.tensor.shallow_clone(),
            Self::Double { codes, scales, offset } => {
                let device = codes.tensor.device();
                let (_, map) = nf4_tables(device);
                let n = codes.tensor.numel() as i64;
                let per =
                    scales.tensor.repeat_interleave_self_int(super::nf4::DOUBLE_BLOCK as i64, 0, None).narrow(0, 0, n);
                map.index_select(0, &codes.tensor.to_kind(Kind::Int64)) * per + f64::from(*offset)
            }
        }
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        match self {
            Self::Plain(a) => a.tensor.numel() * 4,
            Self::Double { codes, scales, .. } => codes.tensor.numel() + scales.tensor.numel() * 4 + 4,
        }
    }
}

impl StoredWeight {
    /// Stores a frozen `[out, in]` f32 weight, given as host values, as `spec` asks (bf16 for
    /// bf16 compute, E4M3 with its exact amax for FP8 weights) on `device`; `None` when it
    /// stays in f32. Rows are converted a few MB at a time, so the only full-size buffers are
    /// `values` and the result (what loading a checkpoint can afford at 70B).
    pub fn store(spec: &PrecisionSpec, values: &[f32], dims: [usize; 2], device: tch::Device) -> Option<Self> {
        Self::store_in_chunks(spec, values, dims, device, CONVERT_CHUNK)
    }

    /// [`Self::store`] converting about `chunk` elements (whole rows) at a time.
    pub(super) fn store_in_chunks(
        spec: &PrecisionSpec,
        values: &[f32],
        dims: [usize; 2],
        device: tch::Device,
        chunk: usize,
    ) -> Option<Self> {
        if let Some(nf4) = spec.nf4 {
            let [out, inp] = dims;
            assert_eq!(values.len(), out * inp, "store_weight: {} values for {dims:?}", values.len());
            let q = nf4::Nf4::quantize(values, nf4.block, nf4.double);
            return Some(Self::from_nf4(&q, dims, device));
        }
        let (kind, scale) = match spec.compute {
            Compute::Bf16 => (Kind::BFloat16, 1.0),
            Compute::Fp8 if spec.fp8_weights => {
                let amax = host_amax(values);
                let scale = crate::fp8::scale_for_amax(amax, Fp8Format::E4M3.max(), 0).unwrap_or(1.0);
                (Fp8Format::E4M3.kind(), scale)
            }
            _ => return None,
        };
        let [out, inp] = dims;
        assert_eq!(values.len(), out * inp, "store_weight: {} values for {dims:?}", values.len());
        let stored = tch::Tensor::empty([out as i64, inp as i64], (kind, device));
        let rows = (chunk / inp.max(1)).max(1);
        for r0 in (0..out).step_by(rows) {
            let n = rows.min(out - r0);
            let src = tch::Tensor::from_slice(&values[r0 * inp..(r0 + n) * inp])
                .reshape([n as i64, inp as i64])
                .to_device(device);
            let converted = match kind {
                Kind::BFloat16 => src.to_kind(Kind::BFloat16),
                _ => quantize_tch(&src, scale, Fp8Format::E4M3),
            };
            stored.narrow(0, r0 as i64, n as i64).copy_(&converted);
        }
        Some(Self::converted(spec, stored, scale))
    }

    /// [`Self::store`] of an f32 `[out, in]` weight already on its device (a random one drawn
    /// there): converted there in one piece, nothing read back but the amax; `None` where the
    /// host path must run (f32 storage, NF4's host quantiser). Codes and scale are the host
    /// path's for the same values.
    pub fn store_on_device(spec: &PrecisionSpec, w: &tch::Tensor) -> Option<Self> {
        if spec.nf4.is_some() {
            return None;
        }
        let (stored, scale) = match spec.compute {
            Compute::Bf16 => (w.to_kind(Kind::BFloat16), 1.0),
            Compute::Fp8 if spec.fp8_weights => {
                // max of |w| is NaN where any value is (as host_amax says).
                let amax = w.abs().max().double_value(&[]) as f32;
                let scale = crate::fp8::scale_for_amax(amax, Fp8Format::E4M3.max(), 0).unwrap_or(1.0);
                (quantize_tch(w, scale, Fp8Format::E4M3), scale)
            }
            _ => return None,
        };
        Some(Self::converted(spec, stored, scale))
    }

    /// The stored weight of converted values (bf16, or E4M3 codes at `scale`), with the
    /// transposed copy FP8 keeps where the CUDA routes run unless one layout is asked for.
    fn converted(spec: &PrecisionSpec, stored: tch::Tensor, scale: f32) -> Self {
        match stored.kind() {
            Kind::BFloat16 => Self::Bf16(TchTensor::new(stored)),
            _ => {
                // The CPU standing in for CUDA keeps it too: the same GEMM layouts, the same copies.
                let keep = crate::routes::takes_cuda_routes(stored.device()) && !spec.fp8_weights_one_layout;
                let transposed = keep.then(|| stored.tr().contiguous());
                Self::Fp8(Fp8Tensor::host(stored, 1.0 / scale).with_transposed(transposed))
            }
        }
    }

    /// `nf4` on `device`.
    pub fn from_nf4(nf4: &super::nf4::Nf4, dims: [usize; 2], device: tch::Device) -> Self {
        let up = |t: tch::Tensor| TchTensor::new(t.to_device(device));
        let absmax = match &nf4.absmax {
            super::nf4::Absmax::Plain(a) => Nf4Scales::Plain(up(tch::Tensor::from_slice(a))),
            super::nf4::Absmax::Double { codes, scales, offset } => Nf4Scales::Double {
                codes: up(tch::Tensor::from_slice(codes)),
                scales: up(tch::Tensor::from_slice(scales)),
                offset: *offset,
            },
        };
        Self::Nf4 { codes: up(tch::Tensor::from_slice(&nf4.codes)), absmax, block: nf4.block, dims }
    }

    /// The f32 weight the stored one stands for (NF4: each code's value times its block's
    /// absmax, in f32, as bitsandbytes dequantises).
    pub fn dequantize(&self) -> tch::Tensor {
        match self {
            Self::F32(w) => w.tensor.shallow_clone(),
            Self::Bf16(w) => w.tensor.to_kind(Kind::Float),
            Self::Fp8(q) => q.dequantize(),
            Self::Nf4 { .. } => self.dequantize_to(Kind::Float),
        }
    }

    /// [`Self::dequantize`] in `kind` (the GEMM's operand dtype). An NF4 weight is decoded a
    /// few million values at a time straight into the result: a byte's two codes looked up in
    /// a 256-entry table of value pairs, times their block's absmax; no index or f32 copy of the
    /// whole weight exists beside the result.
    pub fn dequantize_to(&self, kind: Kind) -> tch::Tensor {
        let Self::Nf4 { codes, absmax, block, dims: [out, inp] } = self else {
            return self.dequantize().to_kind(kind);
        };
        let (n, block) = (out * inp, *block);
        let device = codes.tensor.device();
        let (pairs, _) = nf4_tables(device);
        let absmax = absmax.values();
        let result = tch::Tensor::empty([n as i64], (kind, device));
        // Whole blocks per chunk (block is even: a block's codes are whole bytes).
        let chunk = (NF4_CHUNK / block).max(1) * block;
        for start in (0..n).step_by(chunk) {
            let len = chunk.min(n - start);
            let bytes = codes.tensor.narrow(0, (start / 2) as i64, len.div_ceil(2) as i64).to_kind(Kind::Int64);
            let values = pairs.index_select(0, &bytes).reshape([-1]).narrow(0, 0, len as i64);
            let blocks = len.div_ceil(block);
            let scale = absmax.narrow(0, (start / block) as i64, blocks as i64);
            let scaled = if len % block == 0 {
                (values.reshape([blocks as i64, block as i64]) * scale.unsqueeze(1)).reshape([-1])
            } else {
                values * scale.repeat_interleave_self_int(block as i64, 0, None).narrow(0, 0, len as i64)
            };
            result.narrow(0, start as i64, len as i64).copy_(&scaled.to_kind(kind));
        }
        result.reshape([*out as i64, *inp as i64])
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        match self {
            Self::F32(w) => w.tensor.numel() * 4,
            Self::Bf16(w) => w.tensor.numel() * 2,
            Self::Fp8(q) => q.bytes(),
            Self::Nf4 { codes, absmax, .. } => codes.tensor.numel() + absmax.bytes(),
        }
    }

    /// `[out, in]`.
    pub fn dims(&self) -> [usize; 2] {
        let t = match self {
            Self::F32(w) | Self::Bf16(w) => &w.tensor,
            Self::Fp8(q) => q.codes(),
            Self::Nf4 { dims, .. } => return *dims,
        };
        let s = t.size();
        [s[0] as usize, s[1] as usize]
    }
}
