//! `llora plan`: the memory one rank needs for a run, worked out from the config before
//! anything is allocated, and the cheapest recipe that fits a device.
//!
//! Every term is derived from what llora's code allocates (the tensors each op keeps for
//! backward, the temporaries of the largest backward op), not fitted to measurements; `llora
//! bench` prints the plan of each run next to its measured peak (`planned_peak_mb`), and
//! `scripts/bench-memory.sh` tabulates the two (docs/memory.md).
//!
//! One job a file: `budget.rs` the memory terms of a run's [`Shape`]; `recipe.rs` the search
//! for the cheapest recipe that fits a device; `shape.rs` the config turned into a `Shape`;
//! `gate.rs` the check a training run makes before it allocates (with the host's memory);
//! `report.rs` the tables and JSON `llora plan` prints.

use llora_model::LlamaConfig;
pub use llora_model::Saved;
use llora_model::precision::{Compute, PrecisionSpec};
use llora_model::{BlockLinear, LinearInput};
use serde_json::{Value, json};

mod budget;
mod gate;
mod recipe;
mod report;
mod shape;
#[cfg(test)]
mod tests;

use budget::*;
pub use budget::{budget, kept_per_token, minimum_per_token, per_token};
pub use gate::{check_fits, total_memory_bytes};
pub use recipe::cheapest_recipe;
pub use report::to_json;
pub(crate) use report::*;
pub use shape::{checked_product, shape_of};

/// CPU: the process's resident memory before the model exists (LibTorch's libraries, the
/// allocator, the thread pools), measured with `llora bench` (docs/performance.md, M15).
pub(super) const CPU_RUNTIME_BYTES: f64 = 366.0 * MB;
/// CUDA: the context, cuBLAS/cuDNN workspaces and NCCL buffers a rank holds on its device
/// (NVIDIA's usual 1-2 GB; measured against it on GPUs: docs/memory.md).
pub(super) const CUDA_RUNTIME_BYTES: f64 = 2.0 * GB;
/// CUDA: what the caching allocator holds beyond live tensors at the peak (a margin; its
/// measurements: docs/memory.md).
pub(super) const CUDA_FRAGMENTATION: f64 = 0.05;
/// CPU: the packing buffers one thread's f32 GEMMs hold, which MKL's memory manager keeps
/// after the first GEMM: the most measured per thread (docs/performance.md, M15). bf16 GEMMs
/// (oneDNN) keep none.
pub(super) const CPU_F32_GEMM_WORKSPACE: f64 = 36.0 * MB;
/// CPU: the same when only the rank-r adapter GEMMs run in f32 (the `[r, d]` weight gradient
/// at d 8192 is the largest: docs/performance.md, M15).
pub(super) const CPU_ADAPTER_GEMM_WORKSPACE: f64 = 21.0 * MB;
/// Elements of a weight one CPU GEMM converts to f32 at a time: `_scaled_mm` on FP8 codes
/// (`fp8/gemm.rs`) and bf16 GEMMs routed through f32 (`precision/bf16.rs`).
pub(super) const CPU_GEMM_BLOCK_ELEMENTS: f64 = llora_model::precision::blocked::BLOCK_ELEMENTS as f64;
/// Bytes of logits one chunk of the fused LM-head cross-entropy holds (`loss.rs`).
pub(super) const LCE_CHUNK_BYTES: f64 = 32.0 * MB;

pub(crate) const MB: f64 = (1u64 << 20) as f64;
/// Bytes in a GiB (the plan reports binary units).
pub const GB: f64 = (1u64 << 30) as f64;

/// Where the run's tensors live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// Host memory: the plan is the process's peak RSS.
    Cpu,
    /// One GPU per rank: the plan is the device memory at the peak.
    Cuda,
}

/// Everything about a run that decides its memory.
#[derive(Debug, Clone)]
pub struct Shape {
    /// Architecture.
    pub model: LlamaConfig,
    /// The adapters: rank, dropout, targets (`q_proj`, …, `qkv_proj`), per-module ranks and
    /// layer selection.
    pub lora: llora_model::LoraSpec,
    /// Numerics.
    pub precision: PrecisionSpec,
    /// Sequences per micro-batch.
    pub micro_batch: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Fraction of positions that have a target (1 for the MLPerf data's worst case).
    pub target_fraction: f64,
    /// `train.recompute_layers`.
    pub recompute_layers: usize,
    /// `train.shard_frozen_weights`.
    pub shard_frozen_weights: bool,
    /// `model.trainable = "all"`: every weight trains in f32 (gradients, AdamW moments), no
    /// adapters.
    pub full_fine_tuning: bool,
    /// Preference tuning from an existing adapter (`lora.init_from`): its frozen copy is the
    /// reference, one more f32 value per adapter parameter.
    pub frozen_reference: bool,
    /// Ranks in all (data-parallel groups × `context_parallel`).
    pub world: usize,
    /// `train.context_parallel`: ranks sharing each sequence (1: none).
    pub context_parallel: usize,
    /// Host or GPU.
    pub target: Target,
    /// CPU threads of the rank's GEMMs (each holds its own GEMM workspace).
    pub threads: usize,
    /// Whether bf16 GEMMs run natively on the target; where not (an AVX2-only CPU), they run
    /// in f32 on f32 copies of their bf16 operands (`precision/bf16.rs`).
    pub native_bf16_gemm: bool,
}

/// One line of a rank's memory budget.
#[derive(Debug, Clone)]
pub struct Line {
    /// What it is.
    pub name: &'static str,
    /// Bytes.
    pub bytes: f64,
    /// How it was counted.
    pub note: String,
}

/// A rank's memory at the run's peak.
#[derive(Debug, Clone)]
pub struct Budget {
    /// The terms, which add up to `peak`.
    pub lines: Vec<Line>,
    /// Their sum: the predicted peak (CPU: RSS; CUDA: device memory).
    pub peak: f64,
}
