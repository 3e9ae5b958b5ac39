//! Frozen base weights held outside Burn's parameters: in bf16, as FP8 codes + scale, or as
//! this rank's shard of them.

use std::sync::Arc;

use burn::backend::libtorch::TchTensor;
use tch::Kind;

use crate::fp8::dequantize_tch;
use crate::shard::WeightShard;

/// A frozen weight held outside Burn's parameter: in reduced precision, or (sharded) in f32.
#[derive(Debug, Clone)]
pub enum StoredWeight {
    /// f32 (the whole weight of a sharded f32 layer while gathered).
    F32(TchTensor),
    /// bf16 copy.
    Bf16(TchTensor),
    /// E4M3 codes `[out, in]` and the inverse of the scale.
    Fp8 {
        /// The codes, row-major.
        codes: TchTensor,
        /// `1 / scale`.
        scale_inv: f32,
        /// The codes transposed, `[in, out]` row-major, on CUDA: `_scaled_mm` there wants its
        /// second operand column-major, which for the input-gradient GEMM `g · W` is this
        /// tensor's transpose view. Kept rather than made at every backward (a 70B MLP
        /// weight's transpose is 235 MB of copying per layer per step).
        transposed: Option<TchTensor>,
    },
}

impl StoredWeight {
    /// The f32 weight the stored one stands for.
    pub fn dequantize(&self) -> tch::Tensor {
        match self {
            Self::F32(w) => w.tensor.shallow_clone(),
            Self::Bf16(w) => w.tensor.to_kind(Kind::Float),
            Self::Fp8 { codes, scale_inv, .. } => dequantize_tch(&codes.tensor, *scale_inv),
        }
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        match self {
            Self::F32(w) => w.tensor.numel() * 4,
            Self::Bf16(w) => w.tensor.numel() * 2,
            Self::Fp8 { codes, transposed, .. } => codes.tensor.numel() * (1 + usize::from(transposed.is_some())) + 4,
        }
    }

    /// `[out, in]`.
    pub fn dims(&self) -> [usize; 2] {
        let t = match self {
            Self::F32(w) | Self::Bf16(w) | Self::Fp8 { codes: w, .. } => &w.tensor,
        };
        let s = t.size();
        [s[0] as usize, s[1] as usize]
    }
}

/// Where a layer's frozen weight lives when not in its Burn parameter.
#[derive(Debug, Clone)]
pub enum FrozenWeight {
    /// The whole weight on this rank.
    Whole(StoredWeight),
    /// This rank's slice; gathered around the block's forward and backward.
    Sharded(Arc<WeightShard>),
}

impl FrozenWeight {
    /// The whole weight (for a sharded one: while gathered).
    pub fn whole(&self) -> StoredWeight {
        match self {
            Self::Whole(w) => w.clone(),
            Self::Sharded(s) => s.whole(),
        }
    }

    /// `[out, in]`.
    pub fn dims(&self) -> [usize; 2] {
        match self {
            Self::Whole(w) => w.dims(),
            Self::Sharded(s) => s.dims(),
        }
    }

    /// Bytes this rank holds (outside a gather).
    pub fn bytes(&self) -> usize {
        match self {
            Self::Whole(w) => w.bytes(),
            Self::Sharded(s) => s.local_bytes(),
        }
    }
}
