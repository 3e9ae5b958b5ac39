//! The context-parallel group (`train.context_parallel = N`): the N consecutive ranks that
//! share each sequence, as the model's [`ContextGroup`] over a c10d subgroup.
//!
//! Ranks are laid out data-parallel-major: rank `r` is context rank `r % N` of data-parallel
//! group `r / N`, so a group sits on one node whenever N divides the GPUs per node (its
//! K/V exchange then stays on NVLink, as Megatron places its context-parallel groups).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use llora_model::context_parallel::ContextGroup;

use super::collective::Collective;

/// Where rank `rank` of `world` sits with context parallelism `n`: (its data-parallel group,
/// its rank in its context group, the world ranks of that group).
pub fn layout(rank: usize, n: usize) -> (usize, usize, Vec<usize>) {
    let group = rank / n;
    (group, rank % n, (group * n..(group + 1) * n).collect())
}

/// A c10d group as the model's context group. Gathers move bytes and the K/V gradients are
/// summed on the tensors' device, in place (Gloo on the CPU, NCCL on this rank's GPU; status
/// on GPUs: docs/gpu.md). The time spent in its collectives is counted (`llora bench --cp` reports it per
/// layer).
pub struct ContextComm {
    /// The c10d subgroup.
    pub comm: Arc<dyn Collective>,
    /// Nanoseconds spent in this group's collectives so far.
    spent_ns: AtomicU64,
}

impl ContextComm {
    /// The group over `comm`.
    pub fn new(comm: Arc<dyn Collective>) -> Self {
        Self { comm, spent_ns: AtomicU64::new(0) }
    }

    /// Seconds spent in the group's collectives since the last call (the host waits for each:
    /// on a GPU that includes the device work queued before it).
    pub fn take_spent_s(&self) -> f64 {
        self.spent_ns.swap(0, Ordering::Relaxed) as f64 * 1e-9
    }

    /// Runs `f`, counting its time.
    fn timed<T>(&self, f: impl FnOnce() -> T) -> T {
        let t = Instant::now();
        let out = f();
        self.spent_ns.fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        out
    }
}

impl ContextGroup for ContextComm {
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn size(&self) -> usize {
        self.comm.world_size()
    }

    fn all_gather(&self, x: &tch::Tensor) -> anyhow::Result<tch::Tensor> {
        self.timed(|| {
            let bytes = x.contiguous().view_dtype(tch::Kind::Uint8).reshape([-1]);
            let pending = self.comm.start_all_gather_bytes(&bytes)?;
            let all = self.comm.wait_all_gather_bytes(pending)?;
            let mut shape = vec![self.size() as i64];
            shape.extend(x.size());
            Ok(all.view_dtype(x.kind()).reshape(shape))
        })
    }

    fn all_reduce_sum(&self, x: &tch::Tensor) -> anyhow::Result<tch::Tensor> {
        self.timed(|| Ok(self.comm.all_reduce_sum_tensor(x)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Hand-derived: world 8 with N = 2: ranks 4 and 5 share group 2.
    #[test]
    fn context_groups_are_consecutive_ranks() {
        assert_eq!(layout(5, 2), (2, 1, vec![4, 5]));
        assert_eq!(layout(4, 2), (2, 0, vec![4, 5]));
        assert_eq!(layout(3, 4), (0, 3, vec![0, 1, 2, 3]));
    }
}
