//! The context-parallel group (`train.context_parallel = N`): the N consecutive ranks that
//! share each sequence, as the model's [`ContextGroup`] over a c10d subgroup.
//!
//! Ranks are laid out data-parallel-major: rank `r` is context rank `r % N` of data-parallel
//! group `r / N`, so a group sits on one node whenever N divides the GPUs per node (its
//! K/V exchange then stays on NVLink, as Megatron places its context-parallel groups).

use std::sync::Arc;

use llora_model::context::ContextGroup;

use super::collective::{Collective, ReduceOp};

/// Where rank `rank` of `world` sits with context parallelism `n`: (its data-parallel group,
/// its rank in its context group, the world ranks of that group).
pub fn layout(rank: usize, n: usize) -> (usize, usize, Vec<usize>) {
    let group = rank / n;
    (group, rank % n, (group * n..(group + 1) * n).collect())
}

/// A c10d group as the model's context group. Gathers move bytes on the tensors' device (in
/// place for Gloo and NCCL); the gradient sum crosses the host (one f32 copy each way; on a
/// GPU that is a device round trip: untested on a GPU).
pub struct ContextComm(pub Arc<dyn Collective>);

impl ContextGroup for ContextComm {
    fn rank(&self) -> usize {
        self.0.rank()
    }

    fn size(&self) -> usize {
        self.0.world_size()
    }

    fn all_gather(&self, x: &tch::Tensor) -> anyhow::Result<tch::Tensor> {
        let bytes = x.contiguous().view_dtype(tch::Kind::Uint8).reshape([-1]);
        let pending = self.0.start_all_gather_bytes(&bytes)?;
        let all = self.0.wait_all_gather_bytes(pending)?;
        let mut shape = vec![self.size() as i64];
        shape.extend(x.size());
        Ok(all.view_dtype(x.kind()).reshape(shape))
    }

    fn all_reduce_sum(&self, x: &tch::Tensor) -> anyhow::Result<tch::Tensor> {
        let flat = x.to_kind(tch::Kind::Float).to_device(tch::Device::Cpu).reshape([-1]);
        let mut host = Vec::<f32>::try_from(&flat)?;
        self.0.all_reduce_f32(&mut host, ReduceOp::Sum)?;
        Ok(tch::Tensor::from_slice(&host).reshape(x.size()).to_device(x.device()))
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
