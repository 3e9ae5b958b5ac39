//! Sample order: a deterministic shuffle per epoch from the run seed, one global order for
//! every data-parallel rank (each rank takes its micro-batches of every global batch:
//! `batch::train_batches`), with a position that can be saved and restored for exact resume.

use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

/// Where a loader is in its stream: epoch and index within that epoch's permutation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Position {
    /// Epoch number, from 0.
    pub epoch: u64,
    /// Next index within the epoch's permutation.
    pub index: usize,
    /// With packing: rows already taken from the packing window that starts at
    /// (`epoch`, `index`) (see [`crate::packing::PackedOrder`]); 0 between windows and unpacked.
    #[serde(default)]
    pub packed_rows: usize,
}

/// An endless, epoch-by-epoch stream of dataset indices: every epoch is a fresh permutation
/// of `0..len` drawn from `(seed, epoch)`, so each sample is seen exactly once per epoch.
#[derive(Debug, Clone)]
pub struct SampleOrder {
    len: usize,
    seed: u64,
    shuffle: bool,
    position: Position,
    order: Vec<usize>,
}

impl SampleOrder {
    /// A stream over `len` samples, starting at `position`.
    pub fn new(len: usize, seed: u64, shuffle: bool, position: Position) -> anyhow::Result<Self> {
        anyhow::ensure!(len >= 1, "no samples to draw from");
        let mut s = Self { len, seed, shuffle, position, order: Vec::new() };
        s.order = s.epoch_order(position.epoch);
        anyhow::ensure!(
            position.index <= s.order.len(),
            "position index {} is past the epoch's {} samples",
            position.index,
            s.order.len()
        );
        Ok(s)
    }

    /// The indices of `epoch`, in order.
    pub fn epoch_order(&self, epoch: u64) -> Vec<usize> {
        let mut perm: Vec<usize> = (0..self.len).collect();
        if self.shuffle {
            let mut rng = ChaCha8Rng::seed_from_u64(self.seed.wrapping_mul(0x2545_F491_4F6C_DD1D).wrapping_add(epoch));
            perm.shuffle(&mut rng);
        }
        perm
    }

    /// The position of the next index.
    pub fn position(&self) -> Position {
        self.position
    }

    /// The next dataset index, moving to the next epoch when this one is used up.
    pub fn next_index(&mut self) -> usize {
        if self.position.index == self.order.len() {
            self.position = Position { epoch: self.position.epoch + 1, index: 0, packed_rows: 0 };
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
            let mut a = SampleOrder::new(len, seed, true, Position::default()).unwrap();
            let mut b = SampleOrder::new(len, seed, true, Position::default()).unwrap();
            for _ in 0..n { prop_assert_eq!(a.next_index(), b.next_index()); }
        }

        #[test]
        fn every_epoch_is_a_permutation(len in 1usize..300, seed in any::<u64>(), epoch in 0u64..5) {
            let mut order = SampleOrder::new(len, seed, true, Position::default()).unwrap().epoch_order(epoch);
            order.sort_unstable();
            prop_assert_eq!(order, (0..len).collect::<Vec<_>>());
        }

        #[test]
        fn resume_continues_the_exact_sequence(len in 2usize..100, seed in any::<u64>(), before in 0usize..300, after in 1usize..300) {
            let mut full = SampleOrder::new(len, seed, true, Position::default()).unwrap();
            for _ in 0..before { full.next_index(); }
            let saved = full.position();
            let mut resumed = SampleOrder::new(len, seed, true, saved).unwrap();
            for _ in 0..after { prop_assert_eq!(full.next_index(), resumed.next_index()); }
        }
    }

    #[test]
    fn epochs_reshuffle() {
        let o = SampleOrder::new(50, 1, true, Position::default()).unwrap();
        assert_ne!(o.epoch_order(0), o.epoch_order(1));
        let plain = SampleOrder::new(5, 1, false, Position::default()).unwrap();
        assert_eq!(plain.epoch_order(3), vec![0, 1, 2, 3, 4]);
    }
}
