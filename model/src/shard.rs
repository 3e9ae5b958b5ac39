//! Frozen base weights sharded across data-parallel ranks (ZeRO-3 for the frozen base).
//!
//! Each rank keeps 1/world of the bytes of every frozen linear weight in its storage dtype
//! (f32, bf16, or FP8 codes whose scale every rank computed from the whole tensor while
//! loading). A decoder block's weights are all-gathered just before the block runs and freed
//! after; the block-wise step ([`crate::LlamaForCausalLM::recomputed_backward`]) gathers them
//! again for the block's backward. The next block's gather is started before this one
//! computes (c10d runs it on Gloo's worker threads or NCCL's stream), so at most two blocks
//! are whole at once. LoRA weights, norms, the embedding and the LM head stay
//! replicated.
//!
//! ```text
//!   bytes of W (row-major) ──▶ | rank 0 | rank 1 | … | rank w−1 (zero-padded) |
//!   all-gather(byte shards) ──▶ the whole W, viewed back as its dtype and shape
//! ```

use std::sync::{Arc, Mutex};

use burn::backend::libtorch::TchTensor;
use tch::Kind;

use crate::precision::weights::{Nf4Scales, StoredWeight};

/// The collective sharded weights are gathered with (the trainer's c10d process group).
pub trait WeightGather: Send + Sync {
    /// This process's rank.
    fn rank(&self) -> usize;
    /// Number of ranks the weights are sharded over.
    fn world(&self) -> usize;
    /// Starts gathering every rank's `shard` (a 1-D `u8` tensor, the same length on every
    /// rank), concatenated in rank order, on the shard's device; returns without waiting.
    /// Every rank starts its gathers in the same order.
    fn start_all_gather_bytes(&self, shard: &tch::Tensor) -> anyhow::Result<Box<dyn PendingGather>>;
}

/// A gather in flight.
pub trait PendingGather: Send {
    /// The gathered bytes, once every rank's have arrived.
    fn wait(self: Box<Self>) -> anyhow::Result<tch::Tensor>;
}

/// Where a sharded weight's whole copy is.
enum Slot {
    /// Not gathered.
    Empty,
    /// Being gathered (prefetched while the previous block computes).
    Pending(Box<dyn PendingGather>),
    /// Gathered.
    Ready(StoredWeight),
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
#[derive(Debug, Clone)]
enum ShardKind {
    F32,
    Bf16,
    /// E4M3 codes with the inverse of the whole tensor's scale.
    Fp8(crate::fp8::tensor::InvScale),
    /// NF4 codes (the bytes sharded) with their block scales (kept whole on every rank: a
    /// 64th of the codes' size or less).
    Nf4(Nf4Scales, usize),
}

impl ShardKind {
    fn tch_kind(&self) -> Kind {
        match self {
            Self::F32 => Kind::Float,
            Self::Bf16 => Kind::BFloat16,
            Self::Fp8(_) => crate::fp8::format::Fp8Format::E4M3.kind(),
            Self::Nf4(..) => Kind::Uint8,
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
    /// The whole weight between [`Self::prefetch`] or [`Self::gather`] and [`Self::release`].
    gathered: Mutex<Slot>,
}

impl std::fmt::Debug for Slot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Empty => "Empty",
            Self::Pending(_) => "Pending",
            Self::Ready(_) => "Ready",
        })
    }
}

impl WeightShard {
    /// Keeps this rank's slice of `whole` and drops the rest.
    pub fn new(whole: StoredWeight, sharding: &Sharding) -> Self {
        let dims = whole.dims();
        let (tensor, kind) = match &whole {
            StoredWeight::F32(t) => (&t.tensor, ShardKind::F32),
            StoredWeight::Bf16(t) => (&t.tensor, ShardKind::Bf16),
            StoredWeight::Fp8(q) => (q.codes(), ShardKind::Fp8(q.inv_scale().clone())),
            StoredWeight::Nf4 { codes, absmax, block, .. } => (&codes.tensor, ShardKind::Nf4(absmax.clone(), *block)),
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
        Self {
            local: TchTensor::new(local),
            dims,
            kind,
            bytes,
            sharding: sharding.clone(),
            gathered: Mutex::new(Slot::Empty),
        }
    }

    /// `[out, in]` of the whole weight.
    pub fn dims(&self) -> [usize; 2] {
        self.dims
    }

    /// Bytes this rank holds.
    pub fn local_bytes(&self) -> usize {
        let scales = match &self.kind {
            ShardKind::Nf4(scales, _) => scales.bytes(),
            _ => 0,
        };
        self.local.tensor.numel() + scales
    }

    /// Starts gathering the whole weight without waiting (a no-op when it is gathered or
    /// being gathered): the next block's gather runs while this one computes.
    pub fn prefetch(&self) -> anyhow::Result<()> {
        let mut slot = self.gathered.lock().unwrap();
        if matches!(*slot, Slot::Empty) {
            *slot = Slot::Pending(self.sharding.gather.start_all_gather_bytes(&self.local.tensor)?);
        }
        Ok(())
    }

    /// Makes the whole weight available: waits for a prefetched gather, or gathers now.
    pub fn gather(&self) -> anyhow::Result<()> {
        let mut slot = self.gathered.lock().unwrap();
        let pending = match std::mem::replace(&mut *slot, Slot::Empty) {
            Slot::Ready(w) => {
                *slot = Slot::Ready(w);
                return Ok(());
            }
            Slot::Pending(p) => p,
            Slot::Empty => self.sharding.gather.start_all_gather_bytes(&self.local.tensor)?,
        };
        let all = pending.wait()?;
        let [out, inp] = self.dims;
        let bytes = all.narrow(0, 0, self.bytes as i64);
        let whole = || bytes.view_dtype(self.kind.tch_kind()).view([out as i64, inp as i64]);
        *slot = Slot::Ready(match &self.kind {
            ShardKind::F32 => StoredWeight::F32(TchTensor::new(whole())),
            ShardKind::Bf16 => StoredWeight::Bf16(TchTensor::new(whole())),
            // The transpose the CUDA input-gradient GEMM needs is made as it runs.
            ShardKind::Fp8(inv_scale) => StoredWeight::Fp8(crate::fp8::Fp8Tensor::new(whole(), inv_scale.clone())),
            // NF4 codes stay a byte vector (two values a byte).
            ShardKind::Nf4(absmax, block) => StoredWeight::Nf4 {
                codes: TchTensor::new(bytes.shallow_clone()),
                absmax: absmax.clone(),
                block: *block,
                dims: self.dims,
            },
        });
        Ok(())
    }

    /// Frees the whole weight (a backward through this layer needs it gathered again); a
    /// gather still in flight is waited for first (its buffer is in use until it ends).
    pub fn release(&self) {
        let old = std::mem::replace(&mut *self.gathered.lock().unwrap(), Slot::Empty);
        if let Slot::Pending(p) = old {
            // Reached only when a step ends before using a prefetched block (an error, which is
            // the one to report).
            let _ = p.wait();
        }
    }

    /// The whole weight; it must be gathered.
    pub fn whole(&self) -> StoredWeight {
        match &*self.gathered.lock().unwrap() {
            Slot::Ready(w) => w.clone(),
            slot => {
                panic!("a sharded weight {:?} was used outside its block's gather ({slot:?}; llora bug)", self.dims)
            }
        }
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

    /// The NF4 block size, when the weight is NF4 (QLoRA).
    pub fn nf4_block(&self) -> Option<usize> {
        match self {
            Self::Whole(StoredWeight::Nf4 { block, .. }) => Some(*block),
            Self::Sharded(s) => match s.kind {
                ShardKind::Nf4(_, block) => Some(block),
                _ => None,
            },
            Self::Whole(_) => None,
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
