//! Sample order: a deterministic shuffle per epoch from the run seed, sharded across
//! data-parallel ranks, with a position that can be saved and restored for exact resume.

use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

/// Where a loader is in its stream: epoch and index within this rank's shard of that epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Position {
    /// Epoch number, from 0.
    pub epoch: u64,
    /// Next index within this rank's shard of the epoch's permutation.
    pub index: usize,
}

/// An endless, epoch-by-epoch stream of dataset indices for one data-parallel rank.
///
/// Every epoch is a fresh permutation of `0..len` drawn from `(seed, epoch)`; rank r of w takes
/// positions r, r+w, r+2w, ... of it, so across ranks each sample is seen exactly once per
/// epoch (the last `len % w` samples of a permutation are dropped so that ranks stay in step).
#[derive(Debug, Clone)]
pub struct ShardedOrder {
    len: usize,
    seed: u64,
    rank: usize,
    world: usize,
    shuffle: bool,
    position: Position,
    order: Vec<usize>,
}

impl ShardedOrder {
    /// A stream over `len` samples for `rank` of `world`, starting at `position`.
    pub fn new(
        len: usize,
        seed: u64,
        rank: usize,
        world: usize,
        shuffle: bool,
        position: Position,
    ) -> anyhow::Result<Self> {
        anyhow::ensure!(world >= 1 && rank < world, "rank {rank} is not in 0..{world}");
        anyhow::ensure!(len >= world, "{len} samples cannot be sharded over {world} ranks");
        let mut s = Self { len, seed, rank, world, shuffle, position, order: Vec::new() };
        s.order = s.epoch_order(position.epoch);
        anyhow::ensure!(
            position.index <= s.order.len(),
            "position index {} is past the shard's {} samples",
            position.index,
            s.order.len()
        );
        Ok(s)
    }

    /// This rank's indices for `epoch`.
    pub fn epoch_order(&self, epoch: u64) -> Vec<usize> {
        let mut perm: Vec<usize> = (0..self.len).collect();
        if self.shuffle {
            let mut rng = ChaCha8Rng::seed_from_u64(self.seed.wrapping_mul(0x2545_F491_4F6C_DD1D).wrapping_add(epoch));
            perm.shuffle(&mut rng);
        }
        let per_rank = self.len / self.world;
        perm.into_iter().skip(self.rank).step_by(self.world).take(per_rank).collect()
    }

    /// Samples per epoch on this rank.
    pub fn shard_len(&self) -> usize {
        self.len / self.world
    }

    /// The position of the next index.
    pub fn position(&self) -> Position {
        self.position
    }

    /// The next dataset index, moving to the next epoch when this one is used up.
    pub fn next_index(&mut self) -> usize {
        if self.position.index == self.order.len() {
            self.position = Position { epoch: self.position.epoch + 1, index: 0 };
            self.order = self.epoch_order(self.position.epoch);
        }
        let i = self.order[self.position.index];
        self.position.index += 1;
        i
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn same_seed_same_order(len in 1usize..200, seed in any::<u64>(), n in 0usize..500) {
            let mut a = ShardedOrder::new(len, seed, 0, 1, true, Position::default()).unwrap();
            let mut b = ShardedOrder::new(len, seed, 0, 1, true, Position::default()).unwrap();
            for _ in 0..n { prop_assert_eq!(a.next_index(), b.next_index()); }
        }

        #[test]
        fn shards_partition_each_epoch(len in 1usize..300, world in 1usize..9, seed in any::<u64>(), epoch in 0u64..5) {
            prop_assume!(len >= world);
            let mut seen = vec![0u32; len];
            for rank in 0..world {
                let o = ShardedOrder::new(len, seed, rank, world, true, Position::default()).unwrap();
                for i in o.epoch_order(epoch) { seen[i] += 1; }
            }
            // Every sample at most once; exactly len - len % world of them once.
            prop_assert!(seen.iter().all(|&c| c <= 1));
            prop_assert_eq!(seen.iter().sum::<u32>() as usize, len - len % world);
        }

        #[test]
        fn resume_continues_the_exact_sequence(len in 2usize..100, seed in any::<u64>(), before in 0usize..300, after in 1usize..300) {
            let mut full = ShardedOrder::new(len, seed, 0, 2, true, Position::default()).unwrap();
            for _ in 0..before { full.next_index(); }
            let saved = full.position();
            let mut resumed = ShardedOrder::new(len, seed, 0, 2, true, saved).unwrap();
            for _ in 0..after { prop_assert_eq!(full.next_index(), resumed.next_index()); }
        }
    }

    #[test]
    fn epochs_reshuffle() {
        let o = ShardedOrder::new(50, 1, 0, 1, true, Position::default()).unwrap();
        assert_ne!(o.epoch_order(0), o.epoch_order(1));
        let plain = ShardedOrder::new(5, 1, 0, 1, false, Position::default()).unwrap();
        assert_eq!(plain.epoch_order(3), vec![0, 1, 2, 3, 4]);
    }
}
