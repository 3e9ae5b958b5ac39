//! Sliding-window attention on the CPU: torch's CPU flash kernel on blocks of queries, each
//! over only the keys its band reaches, so the work and the memory grow with `seq · (block +
//! window)` rather than `seq²` (the masked path's `seq × seq` f32 scores: 5.4x the time and 5.6x
//! the memory of full attention at 4096 tokens with a window of 8). What CUDA's flash kernel does
//! with its window arguments (`varlen.rs`), by blocks.
//!
//! ```text
//!   queries  [qs, qe)             one block of `block` queries
//!   keys     [qs - (W-1), qe)     all its band can reach; inside, an additive band mask
//! ```
//!
//! Each block's forward keeps its output and log-sum-exp; its backward is the kernel's backward
//! over the same keys, the keys' gradients added into their place (blocks overlap by W - 1 keys).

use std::sync::atomic::{AtomicBool, Ordering};

use burn::backend::libtorch::TchTensor;

use super::fused::{Kept, OwnBackward, Saved, cpu_backward, cpu_forward, cpu_kernel_kind};

/// Queries per block: at least the window (so a block's keys are at most twice its queries) and
/// at least 64 (so a short window does not make many small kernel calls).
fn block_len(window: usize, seq: i64) -> i64 {
    (window.max(64) as i64).min(seq.max(1))
}

/// One block: its queries `[q0, q0 + len)` and the keys its band reaches `[k0, q0 + len)`.
#[derive(Debug, Clone, Copy)]
struct Block {
    q0: i64,
    len: i64,
    k0: i64,
}

impl Block {
    fn keys(self) -> i64 {
        self.q0 + self.len - self.k0
    }
}

fn blocks(seq: i64, window: usize) -> Vec<Block> {
    let b = block_len(window, seq);
    (0..(seq + b - 1) / b)
        .map(|i| {
            let q0 = i * b;
            Block { q0, len: b.min(seq - q0), k0: (q0 - (window as i64 - 1)).max(0) }
        })
        .collect()
}

/// The additive band mask of `block`: 0 where query `t` may see key `u` (`0 <= t - u < W`), -inf
/// elsewhere, in the kernel's compute kind for `q`.
///
/// # Shapes
/// - output: `[block.len, block.keys()]`
fn band(block: Block, window: usize, q: &tch::Tensor) -> Result<tch::Tensor, tch::TchError> {
    let cpu = (tch::Kind::Int64, tch::Device::Cpu);
    let t = tch::Tensor::f_arange_start(block.q0, block.q0 + block.len, cpu)?.f_unsqueeze(1)?;
    let u = tch::Tensor::f_arange_start(block.k0, block.q0 + block.len, cpu)?.f_unsqueeze(0)?;
    let behind = t.f_sub(&u)?;
    let hidden = behind.f_lt(0)?.f_logical_or(&behind.f_ge(window as i64)?)?;
    let kind = cpu_kernel_kind(q);
    tch::Tensor::f_zeros([block.len, block.keys()], (kind, tch::Device::Cpu))?.f_masked_fill(&hidden, f64::NEG_INFINITY)
}

/// Causal attention in a sliding `window` W (each query sees itself and the W - 1 keys before
/// it), block by block on the CPU flash kernel.
///
/// # Shapes
/// - q: `[batch, heads, seq, head_dim]` on the CPU; k, v: `[batch, kv_heads, seq, head_dim]`
/// - output (in [`Saved::out`]): as q; lse `[batch, heads, seq]`
pub fn forward(q: &tch::Tensor, k: &tch::Tensor, v: &tch::Tensor, window: usize) -> Result<Saved, tch::TchError> {
    USED.store(true, Ordering::Relaxed);
    let seq = q.size()[2];
    let (mut outs, mut lses) = (Vec::new(), Vec::new());
    for b in blocks(seq, window) {
        let (qb, kb, vb) =
            (q.f_narrow(2, b.q0, b.len)?, k.f_narrow(2, b.k0, b.keys())?, v.f_narrow(2, b.k0, b.keys())?);
        let saved = cpu_forward([&qb, &kb, &vb], false, Some(&band(b, window, &qb)?))?;
        outs.push(saved.out.tensor);
        lses.push(saved.lse.tensor);
    }
    Ok(Saved {
        out: TchTensor::new(tch::Tensor::f_cat(&outs, 2)?),
        lse: TchTensor::new(tch::Tensor::f_cat(&lses, 2)?),
        kept: Kept::Own(std::sync::Arc::new(Banded { window })),
    })
}

/// Whether [`forward`] ran in this process (bench JSON's `attn_impl` names it `cpu-flash-window`).
static USED: AtomicBool = AtomicBool::new(false);

/// Whether sliding-window attention has run on the banded CPU kernel in this process.
pub fn used() -> bool {
    USED.load(Ordering::Relaxed)
}

/// What [`forward`] keeps besides q, k, v, the output and the log-sum-exp: its window.
#[derive(Debug)]
struct Banded {
    window: usize,
}

impl OwnBackward for Banded {
    /// The backward of [`forward`], block by block: each block's query gradients in place, its
    /// keys' and values' gradients added into theirs.
    fn backward(
        &self,
        grad: &tch::Tensor,
        [q, k, v]: [&tch::Tensor; 3],
        out: &tch::Tensor,
        lse: &tch::Tensor,
        _causal: bool,
    ) -> Result<(tch::Tensor, tch::Tensor, tch::Tensor), tch::TchError> {
        let seq = q.size()[2];
        let (dk, dv) = (k.f_zeros_like()?, v.f_zeros_like()?);
        let mut dqs = Vec::new();
        for b in blocks(seq, self.window) {
            let rows = |x: &tch::Tensor| x.f_narrow(2, b.q0, b.len)?.f_contiguous();
            let (qb, gb, ob, lb) = (rows(q)?, rows(grad)?, rows(out)?, rows(lse)?);
            let (kb, vb) = (k.f_narrow(2, b.k0, b.keys())?, v.f_narrow(2, b.k0, b.keys())?);
            let mask = band(b, self.window, &qb)?;
            let (dq, dkb, dvb) = cpu_backward(&gb, [&qb, &kb, &vb], &ob, &lb, false, Some(&mask))?;
            dqs.push(dq);
            let _ = dk.f_narrow(2, b.k0, b.keys())?.f_add_(&dkb)?;
            let _ = dv.f_narrow(2, b.k0, b.keys())?.f_add_(&dvb)?;
        }
        Ok((tch::Tensor::f_cat(&dqs, 2)?, dk, dv))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The blocks cover every query once, each block's keys start W - 1 before its first query
    /// (or at 0), and a short window still gets 64-query blocks.
    #[test]
    fn blocks_cover_the_queries_and_reach_back_one_window() {
        for (seq, w) in [(1, 1), (63, 8), (200, 8), (200, 100), (130, 129), (4096, 4096)] {
            let bs = blocks(seq, w);
            assert_eq!(bs.iter().map(|b| b.len).sum::<i64>(), seq, "seq {seq} window {w}");
            let mut next = 0;
            for b in &bs {
                assert_eq!((b.q0, b.k0), (next, (b.q0 - w as i64 + 1).max(0)));
                assert!(b.len >= 1 && (b.len == (w.max(64) as i64).min(seq) || b.q0 + b.len == seq));
                next += b.len;
            }
        }
    }
}
