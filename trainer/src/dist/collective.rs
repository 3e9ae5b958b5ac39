//! What the trainer sees of data parallelism: the [`Collective`] operations, their reductions
//! and errors, the backend that carries them, and a gather in flight. A leaf: `c10d.rs`
//! implements it, `mod.rs` chooses and joins the group.

use std::fmt;

use serde::{Deserialize, Serialize};

use super::world::World;

/// The collective backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Backend {
    /// c10d's Gloo: CPU tensors (what the tests run).
    Gloo,
    /// c10d's NCCL: CUDA tensors.
    Nccl,
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Gloo => "gloo",
            Self::Nccl => "nccl",
        })
    }
}

/// A reduction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    /// Elementwise sum.
    Sum,
    /// Elementwise maximum.
    Max,
}

/// A failed collective or set-up, naming this rank and, when known, the lost ones.
#[derive(Debug, thiserror::Error)]
pub enum DistError {
    /// Joining the group failed.
    #[error("rank {rank} of {world}: {message}")]
    Setup {
        /// This rank.
        rank: usize,
        /// World size.
        world: usize,
        /// What went wrong.
        message: String,
    },
    /// A collective failed (a peer died, hung past `dist.timeout_s`, or the store is gone).
    #[error("{op} failed on rank {rank} of {world}: {}; c10d said: {message}", lost_text(lost))]
    Collective {
        /// The operation.
        op: &'static str,
        /// This rank.
        rank: usize,
        /// World size.
        world: usize,
        /// Ranks whose heartbeat stopped.
        lost: Vec<usize>,
        /// c10d's message.
        message: String,
    },
    /// Ranks were started with different configs.
    #[error("{0}")]
    ConfigMismatch(String),
}

/// c10d's message as a user reads it: without the C++ source locations gloo and NCCL put in
/// (`[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] `) and without LibTorch's stack
/// lines (`Exception raised from ...`, `frame #N: ...`), which say nothing about what failed.
pub fn plain_c10d_message(message: &str) -> String {
    let is_location = |inside: &str| {
        let Some((file, line)) = inside.rsplit_once(':') else { return false };
        !line.is_empty()
            && line.bytes().all(|b| b.is_ascii_digit())
            && [".cc", ".cpp", ".cu", ".h", ".hpp"].iter().any(|ext| file.ends_with(ext))
    };
    let mut lines = Vec::new();
    for line in message.lines() {
        let t = line.trim_start();
        if t.starts_with("Exception raised from") || t.starts_with("frame #") {
            continue;
        }
        let mut out = String::new();
        let mut rest = line;
        while let Some(open) = rest.find('[') {
            let Some(close) = rest[open..].find(']').map(|c| open + c) else { break };
            out.push_str(&rest[..open]);
            if is_location(&rest[open + 1..close]) {
                rest = rest[close + 1..].strip_prefix(' ').unwrap_or(&rest[close + 1..]);
            } else {
                out.push_str(&rest[open..=close]);
                rest = &rest[close + 1..];
            }
        }
        out.push_str(rest);
        // Unbracketed locations too (NCCL's "error in: /path/ProcessGroupNCCL.cpp:3356, ...").
        let words: Vec<&str> = out.split(' ').filter(|w| !is_location(w.trim_end_matches(','))).collect();
        let out = words.join(" ");
        if !out.trim().is_empty() {
            lines.push(out);
        }
    }
    lines.join("\n")
}

fn lost_text(lost: &[usize]) -> String {
    match lost {
        [] => "no rank's heartbeat stopped (a peer hung or the network failed)".into(),
        [r] => format!("lost rank {r} (its heartbeat stopped)"),
        rs => format!("lost ranks {rs:?} (their heartbeats stopped)"),
    }
}

impl DistError {
    pub(super) fn setup(world: &World, message: String) -> Self {
        Self::Setup { rank: world.rank, world: world.size, message: plain_c10d_message(&message) }
    }
}

/// The collective operations the trainer needs, on host buffers.
pub trait Collective: Send + Sync {
    /// This process's rank in `0..world_size()`.
    fn rank(&self) -> usize;
    /// Number of data-parallel ranks.
    fn world_size(&self) -> usize;
    /// What carries the collectives, for logs.
    fn backend(&self) -> &'static str;
    /// Replaces `buf` by its elementwise reduction over all ranks (same length on every rank).
    fn all_reduce_f32(&self, buf: &mut [f32], op: ReduceOp) -> Result<(), DistError>;
    /// The elementwise sum over all ranks of `x` (any float dtype, summed in f32), on `x`'s
    /// device; `x` may be overwritten. Where the group's backend works on `x`'s device (Gloo:
    /// the CPU, NCCL: this rank's GPU) the sum runs there in place, else through a copy moved
    /// there and back.
    fn all_reduce_sum_tensor(&self, x: &tch::Tensor) -> Result<tch::Tensor, DistError>;
    /// As [`Collective::all_reduce_f32`], in f64 (sums of losses and token counts).
    fn all_reduce_f64(&self, buf: &mut [f64], op: ReduceOp) -> Result<(), DistError>;
    /// Replaces `buf` by `root`'s.
    fn broadcast_f32(&self, buf: &mut [f32], root: usize) -> Result<(), DistError>;
    /// Every rank's `x`, concatenated in rank order.
    fn all_gather_f64(&self, x: &[f64]) -> Result<Vec<f64>, DistError>;
    /// As [`Collective::all_gather_f64`], in f32 (gradients summed in a fixed order).
    fn all_gather_f32(&self, x: &[f32]) -> Result<Vec<f32>, DistError>;
    /// Starts gathering every rank's `shard` (1-D `u8`, the same length everywhere),
    /// concatenated in rank order, on the shard's device (in place on the device for Gloo and
    /// NCCL), and returns without waiting: the caller computes meanwhile. Every rank must start
    /// its gathers in the same order.
    fn start_all_gather_bytes(&self, shard: &tch::Tensor) -> Result<PendingBytes, DistError>;
    /// The gathered bytes of a started gather, once it has finished.
    fn wait_all_gather_bytes(&self, pending: PendingBytes) -> Result<tch::Tensor, DistError>;
    /// Starts the elementwise sum over all ranks of `x` (any float dtype, summed in f32) and
    /// returns without waiting where the backend can (c10d's work in flight), else after the
    /// sum ([`Collective::all_reduce_sum_tensor`]). Every rank must start its sums in the same
    /// order.
    fn start_all_reduce_sum(&self, x: &tch::Tensor) -> Result<PendingSum, DistError> {
        Ok(PendingSum { sum: self.all_reduce_sum_tensor(x)?, device: x.device(), work: None })
    }
    /// The sum of a started [`Collective::start_all_reduce_sum`], on `x`'s device, once it has
    /// finished.
    fn wait_all_reduce_sum(&self, pending: PendingSum) -> Result<tch::Tensor, DistError> {
        Ok(pending.sum.to_device(pending.device))
    }
    /// Returns when every rank has called it.
    fn barrier(&self) -> Result<(), DistError>;
    /// Puts `value` under `key` in the job's key-value store.
    fn publish(&self, key: &str, value: &[u8]) -> Result<(), DistError>;
    /// The value under `key`, waiting (up to the timeout) until a rank publishes it.
    fn fetch(&self, key: &str) -> Result<Vec<u8>, DistError>;
    /// Ends the group after successful work (every rank calls it): for NCCL, communicators
    /// finalised while CUDA is still up. A group dropped without it aborts instead.
    fn shutdown(&self) -> Result<(), DistError> {
        Ok(())
    }
    /// The CUDA device the group's collectives are bound to (`None` off CUDA).
    fn bound_device(&self) -> Option<usize> {
        None
    }
}

/// An all-gather in flight: the tensor it writes, and c10d's work (none when nothing is in
/// flight). Dropping it without [`Collective::wait_all_gather_bytes`] still waits for it.
pub struct PendingBytes {
    /// The gathered bytes (written once the work is done).
    pub out: tch::Tensor,
    /// The work in flight; none when nothing is.
    pub work: Option<Box<dyn InFlight>>,
}

/// A sum in flight: the f32 tensor it is written into, the device the caller wants it on, and
/// c10d's work (none when the sum is already done). Dropping it unwaited still waits.
pub struct PendingSum {
    /// The sum (once the work is done), on the group's device.
    pub sum: tch::Tensor,
    /// Where the summed tensor was, and the sum is returned.
    pub device: tch::Device,
    /// The work in flight; none when nothing is.
    pub work: Option<Box<dyn InFlight>>,
}

/// A collective in flight, waited on once (c10d's work, `c10d.rs`); dropped unwaited, it
/// still waits.
pub trait InFlight: Send {
    /// Waits for the collective; its message on failure.
    fn wait(self: Box<Self>) -> Result<(), String>;
}
