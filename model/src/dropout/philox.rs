//! Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011), the
//! counter-based generator cuRAND, LibTorch's CUDA generator and Transformer Engine draw
//! dropout from: 128 random bits are a pure function of a 64-bit key and a 128-bit counter, so
//! any element of a mask can be drawn alone, in any order, by any thread, and again in
//! backward. This is the host's copy of `kernels/dropout.cu`'s `philox`, written out because
//! no crate of ours has the 4x32 variant (rand's are stream generators); its known-answer test
//! holds it to the paper's reference vectors.

/// The round multipliers.
const M: [u32; 2] = [0xD251_1F53, 0xCD9E_8D57];
/// The key's per-round increments (the golden ratio's and √3's fractional bits).
const W: [u32; 2] = [0x9E37_79B9, 0xBB67_AE85];

/// Philox4x32 with 10 rounds: the four words of `counter` under `key`.
pub(crate) fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let (mut c, mut k) = (counter, key);
    for round in 0..10 {
        if round > 0 {
            k = [k[0].wrapping_add(W[0]), k[1].wrapping_add(W[1])];
        }
        let p0 = u64::from(M[0]) * u64::from(c[0]);
        let p1 = u64::from(M[1]) * u64::from(c[2]);
        let (hi0, lo0, hi1, lo1) = ((p0 >> 32) as u32, p0 as u32, (p1 >> 32) as u32, p1 as u32);
        c = [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0];
    }
    c
}

/// The 32-bit word of element `index` of the mask stream of `seed`: word `index % 4` of the
/// block at counter `index / 4` (so four consecutive elements share one block): the definition
/// the tests hold the masks to (the mask makers draw a block once for its four elements).
#[cfg(test)]
pub(crate) fn word(seed: u64, index: u64) -> u32 {
    philox4x32_10(block_counter(index), key(seed))[(index & 3) as usize]
}

/// The key of `seed`: its low and high halves.
pub(crate) fn key(seed: u64) -> [u32; 2] {
    [seed as u32, (seed >> 32) as u32]
}

/// The counter of the block holding element `index`.
pub(crate) fn block_counter(index: u64) -> [u32; 4] {
    let block = index >> 2;
    [block as u32, (block >> 32) as u32, 0, 0]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random123's known-answer vectors for philox4x32_10 (its `kat_vectors`): counter and key
    /// all zeros, all ones, and the digits of π.
    #[test]
    fn philox_gives_the_reference_vectors() {
        assert_eq!(philox4x32_10([0; 4], [0; 2]), [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]);
        assert_eq!(philox4x32_10([u32::MAX; 4], [u32::MAX; 2]), [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd]);
        assert_eq!(
            philox4x32_10([0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344], [0xa409_3822, 0x299f_31d0]),
            [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1]
        );
    }

    /// Element k's word is word k % 4 of block k / 4, the 64-bit counter's high half used.
    #[test]
    fn elements_map_to_blocks_of_four() {
        let seed = 0x0123_4567_89ab_cdef;
        let block = philox4x32_10([1, 0, 0, 0], [0x89ab_cdef, 0x0123_4567]);
        assert_eq!((4..8).map(|i| word(seed, i)).collect::<Vec<_>>(), block);
        let far = philox4x32_10([0, 1, 0, 0], key(seed));
        assert_eq!(word(seed, (1 << 34) + 2), far[2]);
    }
}
