//! Context-parallel attention (`crate::context_parallel`): each rank's queries against the whole
//! sequence's keys and values, gathered from the group.
//!
//! **All-gather of K/V, not a ring.** Every rank gathers the group's keys and values once per
//! layer (forward, and again in backward instead of keeping them: the saved activations stay
//! this rank's share), computes its queries' attention in blocks on the fused kernels, and in
//! backward sums the group's K/V gradients. This is the Llama 3 paper's choice (§3.3.2): with
//! grouped-query attention K/V are a small fraction of Q (8 of 64 heads at 70B), so gathering
//! them costs little next to the attention, the exchange is one collective rather than N−1
//! dependent steps, and packed documents (any block-causal mask) need no schedule of which
//! ring step meets which document. A ring overlaps its transfers with compute, which matters
//! for multi-head K/V or slow links; it is not built.
//!
//! The blocks: for each of this rank's query chunks and each document crossing it (the whole
//! row without packing), the chunk's queries in the document attend to the document's keys
//! before the chunk (no mask) and to their own chunk (causal, square): at most two fused
//! calls per document piece, merged by their log-sum-exp. Backward runs each block's fused
//! backward with the merged output and log-sum-exp (the flash recurrence's `D = rowsum(dO·O)`
//! and probabilities then are the whole row's), so the blocks' gradients add up to the
//! unsplit attention's.

use std::ops::Range;
use std::sync::Arc;

use burn::backend::libtorch::TchTensor;

use super::fused::{self, Kept, Saved};
use crate::context_parallel::{ContextGroup, ContextSplit};
use crate::packing::PackedRows;

/// One batch's context-parallel attention problem: the split, the group, and the documents of
/// packed rows (over the padded global sequence).
#[derive(Debug, Clone)]
pub struct ContextAttention {
    /// How the sequence is split.
    pub split: ContextSplit,
    /// Who holds the other chunks.
    pub group: Arc<dyn ContextGroup>,
    /// The documents of packed rows, laid out over `split.padded` tokens; `None`: one causal
    /// sequence per row.
    pub packed: Option<Arc<PackedRows>>,
}

/// A piece of this rank's queries (one query chunk within one document) and the key blocks it
/// attends to.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Piece {
    /// The row, or `None` for every row (no packing).
    row: Option<i64>,
    /// Local query positions.
    q: Range<i64>,
    /// Global key ranges with their mask: `false` all visible, `true` causal (square, aligned
    /// with the queries).
    blocks: Vec<(Range<i64>, bool)>,
}

impl ContextAttention {
    /// The pieces of this rank's queries, in local order.
    fn pieces(&self) -> Vec<Piece> {
        let mut out = Vec::new();
        // Each row with its document spans (all rows at once, one span, without packing).
        type Row = (Option<i64>, Vec<(usize, usize)>);
        let rows: Vec<Row> = match &self.packed {
            None => vec![(None, vec![(0, self.split.padded)])],
            Some(p) => (0..p.rows()).map(|r| (Some(r as i64), p.spans(r))).collect(),
        };
        for (row, spans) in rows {
            let mut local = 0;
            for chunk in self.split.local_ranges() {
                for &(start, len) in &spans {
                    let (a, e) = (chunk.start.max(start), chunk.end.min(start + len));
                    if a >= e {
                        continue;
                    }
                    let q = (local + a - chunk.start) as i64..(local + e - chunk.start) as i64;
                    let mut blocks = Vec::with_capacity(2);
                    if a > start {
                        blocks.push((start as i64..a as i64, false));
                    }
                    blocks.push((a as i64..e as i64, true));
                    out.push(Piece { row, q, blocks });
                }
                local += chunk.len();
            }
        }
        out
    }

    /// The group's keys or values in global order; zeros once the group has failed (the
    /// failure recorded: `crate::context_parallel::record_failure`).
    ///
    /// # Shapes
    /// - x: `[batch, kv_heads, local, hd]`; output: `[batch, kv_heads, padded, hd]`
    fn gather(&self, x: &tch::Tensor) -> tch::Tensor {
        let whole = || {
            let mut size = x.size();
            size[2] = self.split.padded as i64;
            tch::Tensor::zeros(size, (x.kind(), x.device()))
        };
        if crate::context_parallel::failed() {
            return whole();
        }
        match self.group.all_gather(&x.contiguous()) {
            Ok(all) => self.split.global_of(&all, 2),
            Err(e) => {
                crate::context_parallel::record_failure(format!("{e:#}"));
                whole()
            }
        }
    }

    /// The sum of `x` over the group; `x` itself once the group has failed.
    fn sum(&self, x: &tch::Tensor) -> tch::Tensor {
        if crate::context_parallel::failed() {
            return x.shallow_clone();
        }
        self.group.all_reduce_sum(x).unwrap_or_else(|e| {
            crate::context_parallel::record_failure(format!("{e:#}"));
            x.shallow_clone()
        })
    }
}

/// What the forward keeps for backward besides q, k, v: the merged output and log-sum-exp,
/// and each block's kernel state with its log-sum-exp's shape.
#[derive(Debug, Clone)]
pub struct ContextSaved {
    /// `[batch, heads, local, hd]`, q's dtype.
    pub out: TchTensor,
    /// `[batch, heads, local]` f32.
    pub lse: TchTensor,
    /// Per piece, per block: what its kernel keeps and the shape of its log-sum-exp.
    kept: Vec<Vec<(Kept, Vec<i64>)>>,
}

/// `t` restricted to `row` (all rows for `None`), then to `range` along `dim`.
fn take(t: &tch::Tensor, row: Option<i64>, dim: i64, range: &Range<i64>) -> tch::Tensor {
    let t = row.map_or_else(|| t.shallow_clone(), |r| t.narrow(0, r, 1));
    t.narrow(dim, range.start, range.end - range.start)
}

/// The attention of this rank's queries over the group's keys and values.
///
/// # Shapes
/// - q: `[batch, heads, local, hd]`; k, v: `[batch, kv_heads, local, hd]`
/// - output: as q
pub fn forward(
    q: &tch::Tensor,
    k: &tch::Tensor,
    v: &tch::Tensor,
    cp: &ContextAttention,
) -> Result<ContextSaved, tch::TchError> {
    let (kf, vf) = (cp.gather(k), cp.gather(v));
    let out = q.zeros_like();
    let [b, h, s, _] = q.size()[..] else { unreachable!("q is 4-d") };
    let lse = tch::Tensor::zeros([b, h, s], (tch::Kind::Float, q.device()));
    let mut kept = Vec::new();
    for piece in cp.pieces() {
        let qs = take(q, piece.row, 2, &piece.q);
        let mut parts = Vec::with_capacity(piece.blocks.len());
        for (keys, causal) in &piece.blocks {
            let saved =
                super::choice::forward(&qs, &take(&kf, piece.row, 2, keys), &take(&vf, piece.row, 2, keys), *causal)?;
            parts.push(saved);
        }
        let len = piece.q.end - piece.q.start;
        // `[batch, heads, len]` whatever the kernel's layout (padded rows, a trailing 1).
        let rows = qs.size()[0];
        let lses: Vec<tch::Tensor> =
            parts.iter().map(|p| p.lse.tensor.narrow(2, 0, len).reshape([rows, h, len])).collect();
        let merged_lse = tch::Tensor::stack(&lses, 0).logsumexp([0], false);
        let mut merged = tch::Tensor::zeros(qs.size(), (tch::Kind::Float, q.device()));
        for (p, l) in parts.iter().zip(&lses) {
            let w = (l - &merged_lse).exp().unsqueeze(-1);
            merged += p.out.tensor.to_kind(tch::Kind::Float) * w;
        }
        take(&out, piece.row, 2, &piece.q).copy_(&merged);
        take(&lse, piece.row, 2, &piece.q).copy_(&merged_lse);
        kept.push(parts.into_iter().map(|p| (p.kept, p.lse.tensor.size())).collect());
    }
    Ok(ContextSaved { out: TchTensor::new(out), lse: TchTensor::new(lse), kept })
}

/// The gradients of [`forward`]'s q, k and v: each block's fused backward on the merged output
/// and log-sum-exp, the group's key and value gradients summed.
///
/// # Shapes
/// As [`forward`]; outputs: as q, k, v.
pub fn backward(
    grad: &tch::Tensor,
    q: &tch::Tensor,
    k: &tch::Tensor,
    v: &tch::Tensor,
    saved: &ContextSaved,
    cp: &ContextAttention,
) -> Result<(tch::Tensor, tch::Tensor, tch::Tensor), tch::TchError> {
    let (kf, vf) = (cp.gather(k), cp.gather(v));
    let f32 = (tch::Kind::Float, q.device());
    let dq = tch::Tensor::zeros(q.size(), f32);
    let (dkf, dvf) = (tch::Tensor::zeros(kf.size(), f32), tch::Tensor::zeros(vf.size(), f32));
    let grad = grad.contiguous();
    for (piece, kept) in cp.pieces().iter().zip(&saved.kept) {
        let at = |t: &tch::Tensor| take(t, piece.row, 2, &piece.q);
        let (qs, gs, outs, lses) = (at(q), at(&grad), at(&saved.out.tensor).contiguous(), at(&saved.lse.tensor));
        for ((keys, causal), (kernel, lse_size)) in piece.blocks.iter().zip(kept) {
            // The kernel's own log-sum-exp layout (CUDA's may be padded), the merged values in it.
            let lse = tch::Tensor::zeros(lse_size.as_slice(), f32);
            let rows = lse.narrow(2, 0, piece.q.end - piece.q.start);
            rows.shallow_clone().copy_(&lses.reshape(rows.size()));
            let block =
                Saved { out: TchTensor::new(outs.shallow_clone()), lse: TchTensor::new(lse), kept: kernel.clone() };
            let (kb, vb) = (take(&kf, piece.row, 2, keys), take(&vf, piece.row, 2, keys));
            let (dqb, dkb, dvb) = fused::backward(&gs, &qs, &kb, &vb, &block, *causal)?;
            let _ = at(&dq).f_add_(&dqb)?;
            let _ = take(&dkf, piece.row, 2, keys).f_add_(&dkb)?;
            let _ = take(&dvf, piece.row, 2, keys).f_add_(&dvb)?;
        }
    }
    let (dk, dv) = (cp.split.local_of(&cp.sum(&dkf), 2), cp.split.local_of(&cp.sum(&dvf), 2));
    Ok((dq.to_kind(q.kind()), dk.to_kind(k.kind()), dv.to_kind(v.kind())))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A one-rank "group" for the pieces' layout (no collective runs).
    struct Alone(usize, usize);
    impl ContextGroup for Alone {
        fn rank(&self) -> usize {
            self.0
        }
        fn size(&self) -> usize {
            self.1
        }
        fn all_gather(&self, _: &tch::Tensor) -> anyhow::Result<tch::Tensor> {
            unreachable!()
        }
        fn all_reduce_sum(&self, _: &tch::Tensor) -> anyhow::Result<tch::Tensor> {
            unreachable!()
        }
    }

    /// A group simulated in one process: `all_gather` returns what every rank holds (known in
    /// advance: the test's inputs), `all_reduce_sum` records this rank's part and returns it
    /// (the test sums the ranks' parts itself).
    struct Simulated {
        rank: usize,
        size: usize,
        gathered: std::sync::Mutex<std::collections::VecDeque<tch::Tensor>>,
        reduced: std::sync::Mutex<Vec<tch::Tensor>>,
    }
    impl ContextGroup for Simulated {
        fn rank(&self) -> usize {
            self.rank
        }
        fn size(&self) -> usize {
            self.size
        }
        fn all_gather(&self, _: &tch::Tensor) -> anyhow::Result<tch::Tensor> {
            Ok(self.gathered.lock().unwrap().pop_front().expect("a gather the test prepared"))
        }
        fn all_reduce_sum(&self, x: &tch::Tensor) -> anyhow::Result<tch::Tensor> {
            self.reduced.lock().unwrap().push(x.copy());
            Ok(x.shallow_clone())
        }
    }

    /// Plain attention in f64 with an explicit mask (query i sees key j iff both lie in one
    /// document and j ≤ i), K/V heads repeated, and its gradients by torch's autograd: an
    /// independent reference for the split one.
    fn reference(
        q: &tch::Tensor,
        k: &tch::Tensor,
        v: &tch::Tensor,
        grad: &tch::Tensor,
        docs: &[usize],
    ) -> [tch::Tensor; 4] {
        let leaf = |t: &tch::Tensor| t.to_kind(tch::Kind::Double).set_requires_grad(true);
        let (q, k, v) = (leaf(q), leaf(k), leaf(v));
        let group = q.size()[1] / k.size()[1];
        let (kr, vr) = (k.repeat_interleave_self_int(group, 1, None), v.repeat_interleave_self_int(group, 1, None));
        let s = q.size()[2] as usize;
        let mut doc = vec![usize::MAX; s]; // past the documents: padding, one span of its own
        let mut start = 0;
        for (d, &len) in docs.iter().enumerate() {
            doc[start..start + len].iter_mut().for_each(|x| *x = d);
            start += len;
        }
        let allowed: Vec<f64> = (0..s * s)
            .map(|ij| if ij % s <= ij / s && doc[ij % s] == doc[ij / s] { 0.0 } else { f64::NEG_INFINITY })
            .collect();
        let mask = tch::Tensor::from_slice(&allowed).view([s as i64, s as i64]);
        let scores = q.matmul(&kr.transpose(-2, -1)) / (q.size()[3] as f64).sqrt() + mask;
        let out = scores.softmax(-1, tch::Kind::Double).matmul(&vr);
        (&out * grad.to_kind(tch::Kind::Double)).sum(tch::Kind::Double).backward();
        [out.detach(), q.grad(), k.grad(), v.grad()]
    }

    /// Each of `n` simulated ranks' forward and backward on its share of the padded q, k, v
    /// and output gradient (`[q, k, v, grad]`), reassembled: the output and dq in global
    /// order, and the ranks' dk/dv parts summed (what the group's all-reduce gives), each cut
    /// to the `s` real positions.
    fn split_run(n: usize, s: usize, padded: [&tch::Tensor; 4], packed: Option<Arc<PackedRows>>) -> [tch::Tensor; 4] {
        let [qp, kp, vp, gp] = padded;
        let locals = |t: &tch::Tensor| (0..n).map(|r| ContextSplit::new(s, r, n).local_of(t, 2)).collect::<Vec<_>>();
        let (ks, vs) = (tch::Tensor::stack(&locals(kp), 0), tch::Tensor::stack(&locals(vp), 0));
        let (mut outs, mut dqs, mut dks, mut dvs) = (vec![], vec![], vec![], vec![]);
        for r in 0..n {
            let split = ContextSplit::new(s, r, n);
            let gathered = [&ks, &vs, &ks, &vs].map(|t| t.shallow_clone()).into_iter().collect();
            let reduced = Default::default();
            let group = Arc::new(Simulated { rank: r, size: n, gathered: std::sync::Mutex::new(gathered), reduced });
            let cp = ContextAttention { split, group: group.clone(), packed: packed.clone() };
            let [ql, kl, vl, gl] = [qp, kp, vp, gp].map(|t| split.local_of(t, 2));
            let saved = forward(&ql, &kl, &vl, &cp).unwrap();
            let (dq, _, _) = backward(&gl, &ql, &kl, &vl, &saved, &cp).unwrap();
            outs.push(saved.out.tensor);
            dqs.push(dq);
            let reduced = group.reduced.lock().unwrap();
            dks.push(reduced[0].shallow_clone());
            dvs.push(reduced[1].shallow_clone());
        }
        let split0 = ContextSplit::new(s, 0, n);
        let whole =
            |parts: Vec<tch::Tensor>| split0.global_of(&tch::Tensor::stack(&parts, 0), 2).narrow(2, 0, s as i64);
        let summed = |parts: Vec<tch::Tensor>| {
            tch::Tensor::stack(&parts, 0).sum_dim_intlist(0, false, tch::Kind::Float).narrow(2, 0, s as i64)
        };
        [whole(outs), whole(dqs), summed(dks), summed(dvs)]
    }

    /// Context-parallel attention over 2 and 4 simulated ranks on `device` in `kind` equals
    /// plain attention of the whole sequence in f64 on the same (rounded) inputs, within `tol`
    /// of the largest value (GQA 4:2), unpacked and over packed documents that cross chunk
    /// boundaries, with a length the split must pad: each rank's output and dq, and the
    /// ranks' summed dk/dv in each rank's positions.
    fn split_equals_whole(device: tch::Device, kind: tch::Kind, tol: f64) {
        let _rng = crate::device::torch_rng_lock();
        tch::manual_seed(11);
        let (b, h, kv, s, hd) = (1i64, 4, 2, 21usize, 8);
        let rand = |heads: i64| tch::Tensor::randn([b, heads, s as i64, hd], (kind, device));
        let (q, k, v, grad) = (rand(h), rand(kv), rand(kv), rand(h));
        let cpu = |t: &tch::Tensor| t.to_device(tch::Device::Cpu);
        for docs in [vec![s], vec![5, 9, 4]] {
            let want = reference(&cpu(&q), &cpu(&k), &cpu(&v), &cpu(&grad), &docs);
            for n in [2, 4] {
                let padded = ContextSplit::new(s, 0, n).padded;
                let pad = |t: &tch::Tensor| {
                    let extra = tch::Tensor::zeros([b, t.size()[1], (padded - s) as i64, hd], (kind, device));
                    tch::Tensor::cat(&[t.shallow_clone(), extra], 2)
                };
                let packed = (docs.len() > 1).then(|| Arc::new(PackedRows::new(vec![docs.clone()], padded).unwrap()));
                let got = split_run(n, s, [&pad(&q), &pad(&k), &pad(&v), &pad(&grad)], packed);
                for ((name, g), w) in ["out", "dq", "dk", "dv"].iter().zip(&got).zip(&want) {
                    let err = (cpu(g).to_kind(tch::Kind::Double) - w).abs().max().double_value(&[]);
                    let scale = w.abs().max().double_value(&[]);
                    assert!(err <= tol * scale, "{name}, {n} ranks, documents {docs:?}: error {err:e} of {scale:e}");
                }
            }
        }
    }

    /// On the CPU in f32: within 1e-5.
    #[test]
    fn split_attention_equals_the_whole_sequence() {
        split_equals_whole(tch::Device::Cpu, tch::Kind::Float, 1e-5);
    }

    /// On CUDA in bf16 (cuDNN or flash attention per block, their log-sum-exp layouts) and in
    /// f32 (the memory-efficient kernel, its padded log-sum-exp): within bf16's and f32's
    /// rounding of the blocks' outputs.
    #[test]
    #[ignore = "needs CUDA"]
    fn split_attention_equals_the_whole_sequence_on_cuda() {
        assert!(tch::Cuda::is_available(), "this test needs a CUDA device");
        split_equals_whole(tch::Device::Cuda(0), tch::Kind::BFloat16, 3e-2);
        split_equals_whole(tch::Device::Cuda(0), tch::Kind::Float, 1e-4);
    }

    /// Hand-derived pieces: 8 tokens over 2 ranks (chunks of 2; rank 1 holds 2-3 and 4-5).
    /// Unpacked: chunk 2-3 attends to 0-1 in full and to itself causally. Packed documents
    /// [3, 4] + padding 1: positions 2 (end of document 0: keys 0-1, then itself), 3 (start of
    /// document 1: itself only), 4-5 (keys 3, then themselves).
    #[test]
    fn pieces_cover_each_document_causally() {
        let split = ContextSplit::new(8, 1, 2);
        let cp = |packed| ContextAttention { split, group: Arc::new(Alone(1, 2)), packed };
        let piece = |row, q: Range<i64>, blocks: &[(Range<i64>, bool)]| Piece { row, q, blocks: blocks.to_vec() };
        assert_eq!(
            cp(None).pieces(),
            [piece(None, 0..2, &[(0..2, false), (2..4, true)]), piece(None, 2..4, &[(0..4, false), (4..6, true)]),]
        );
        let packed = Arc::new(PackedRows::new(vec![vec![3, 4]], 8).unwrap());
        assert_eq!(
            cp(Some(packed)).pieces(),
            [
                piece(Some(0), 0..1, &[(0..2, false), (2..3, true)]),
                piece(Some(0), 1..2, &[(3..4, true)]),
                piece(Some(0), 2..4, &[(3..4, false), (4..6, true)]),
            ]
        );
    }
}
