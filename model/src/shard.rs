//! Frozen base weights sharded across data-parallel ranks (ZeRO-3 for the frozen base).
//!
//! Each rank keeps 1/world of the bytes of every frozen linear weight in its storage dtype
//! (f32, bf16, or FP8 codes whose scale every rank computed from the whole tensor while
//! loading). A decoder block's weights are all-gathered just before the block runs and freed
//! after; the block-wise step ([`crate::LlamaForCausalLM::recomputed_backward`]) gathers them
//! again for the block's backward. LoRA weights, norms, the embedding and the LM head stay
//! replicated.
//!
//! ```text
//!   bytes of W (row-major) ──▶ | rank 0 | rank 1 | … | rank w−1 (zero-padded) |
//!   all-gather(byte shards) ──▶ the whole W, viewed back as its dtype and shape
//! ```

use std::sync::{Arc, Mutex};

use burn::backend::libtorch::TchTensor;
use tch::Kind;

use crate::precision::StoredWeight;

/// The collective sharded weights are gathered with (the trainer's c10d process group).
pub trait WeightGather: Send + Sync {
    /// This process's rank.
    fn rank(&self) -> usize;
    /// Number of ranks the weights are sharded over.
    fn world(&self) -> usize;
    /// Every rank's `shard` (a 1-D `u8` tensor, the same length on every rank), concatenated
    /// in rank order, on the shard's device.
    fn all_gather_bytes(&self, shard: &tch::Tensor) -> anyhow::Result<tch::Tensor>;
}

/// A gatherer and the model's place in it; cloned into every sharded layer.
#[derive(Clone)]
pub struct Sharding {
    /// The collective.
    pub gather: Arc<dyn WeightGather>,
}

impl std::fmt::Debug for Sharding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Sharding {{ rank: {}, world: {} }}", self.gather.rank(), self.gather.world())
    }
}

/// The dtype a stored weight is kept in, and how it is rebuilt from its bytes.
#[derive(Debug, Clone, Copy, PartialEq)]
enum ShardKind {
    F32,
    Bf16,
    /// E4M3 codes with the inverse of the whole tensor's scale.
    Fp8(f32),
}

impl ShardKind {
    fn tch_kind(self) -> Kind {
        match self {
            Self::F32 => Kind::Float,
            Self::Bf16 => Kind::BFloat16,
            Self::Fp8(_) => crate::fp8::Fp8Format::E4M3.kind(),
        }
    }
}

/// This rank's slice of one frozen weight, and the whole weight while its block is gathered.
#[derive(Debug)]
pub struct WeightShard {
    /// This rank's bytes, `[ceil(bytes / world)]` u8 (the last rank's zero-padded).
    local: TchTensor,
    /// `[out, in]` of the whole weight.
    dims: [usize; 2],
    kind: ShardKind,
    /// Bytes of the whole weight.
    bytes: usize,
    sharding: Sharding,
    /// The whole weight between [`Self::gather`] and [`Self::release`].
    gathered: Mutex<Option<StoredWeight>>,
}

impl WeightShard {
    /// Keeps this rank's slice of `whole` and drops the rest.
    pub fn new(whole: StoredWeight, sharding: &Sharding) -> Self {
        let dims = whole.dims();
        let (tensor, kind) = match &whole {
            StoredWeight::F32(t) => (&t.tensor, ShardKind::F32),
            StoredWeight::Bf16(t) => (&t.tensor, ShardKind::Bf16),
            StoredWeight::Fp8(t, scale_inv) => (&t.tensor, ShardKind::Fp8(*scale_inv)),
        };
        let bytes_of = tensor.contiguous().view([-1]).view_dtype(Kind::Uint8);
        let bytes = bytes_of.size()[0] as usize;
        let (rank, world) = (sharding.gather.rank(), sharding.gather.world());
        let chunk = bytes.div_ceil(world);
        let start = (rank * chunk).min(bytes);
        let len = chunk.min(bytes - start);
        let local = tch::Tensor::zeros([chunk as i64], (Kind::Uint8, tensor.device()));
        if len > 0 {
            local.narrow(0, 0, len as i64).copy_(&bytes_of.narrow(0, start as i64, len as i64));
        }
        Self { local: TchTensor::new(local), dims, kind, bytes, sharding: sharding.clone(), gathered: Mutex::new(None) }
    }

    /// `[out, in]` of the whole weight.
    pub fn dims(&self) -> [usize; 2] {
        self.dims
    }

    /// Whether the weight lives in host memory.
    pub fn on_cpu(&self) -> bool {
        self.local.tensor.device() == tch::Device::Cpu
    }

    /// Bytes this rank holds.
    pub fn local_bytes(&self) -> usize {
        self.local.tensor.numel()
    }

    /// All-gathers the whole weight (a no-op while it is gathered).
    pub fn gather(&self) -> anyhow::Result<()> {
        let mut slot = self.gathered.lock().unwrap();
        if slot.is_some() {
            return Ok(());
        }
        let all = self.sharding.gather.all_gather_bytes(&self.local.tensor)?;
        let [out, inp] = self.dims;
        let whole = all.narrow(0, 0, self.bytes as i64).view_dtype(self.kind.tch_kind()).view([out as i64, inp as i64]);
        *slot = Some(match self.kind {
            ShardKind::F32 => StoredWeight::F32(TchTensor::new(whole)),
            ShardKind::Bf16 => StoredWeight::Bf16(TchTensor::new(whole)),
            ShardKind::Fp8(scale_inv) => StoredWeight::Fp8(TchTensor::new(whole), scale_inv),
        });
        Ok(())
    }

    /// Frees the whole weight (a backward through this layer needs it gathered again).
    pub fn release(&self) {
        *self.gathered.lock().unwrap() = None;
    }

    /// The whole weight; it must be gathered.
    pub fn whole(&self) -> StoredWeight {
        self.gathered.lock().unwrap().clone().unwrap_or_else(|| {
            panic!("a sharded weight {:?} was used outside its block's gather (llora bug)", self.dims)
        })
    }
}
