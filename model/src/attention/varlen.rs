//! Packed rows on CUDA: flash attention over variable-length sequences, the way the fast
//! packed trainers run it (flash-attn's `varlen` API, which torch's `_flash_attention_forward`
//! wraps). Every span of every row (its documents, then its padding) becomes one sequence of a
//! single `[tokens, heads, head_dim]` problem described by its cumulative offsets, so a packed
//! batch is one kernel launch per layer, forward and backward, whatever its number of
//! documents, with the documents' own `Σ sᵢ²` work and no mask.
//!
//! The offsets are uploaded once per batch ([`VarlenSpans::new`], with the RoPE positions), not
//! per layer. The kernel is checked against plain LibTorch with a block-diagonal mask on the
//! first problem of each kind ([`usable`]); where it is missing or fails the check, packed rows
//! take one fused kernel per span instead (`attention::packed_causal_attention`). The CPU has
//! no variable-length kernel: there the per-span route is the fast one (torch's CPU flash
//! attention on each document).

use std::sync::Arc;

use burn::backend::libtorch::TchTensor;

use super::choice::Problem;
use super::cuda;
use super::fused::{FusedKernel, Kept, MaybeTensor, OwnBackward, Saved, check_against_reference};
use crate::packing::PackedRows;

/// The sequences of a packed batch laid end to end, as a variable-length kernel takes them.
#[derive(Debug, Clone)]
pub struct VarlenSpans {
    /// int32 `[sequences + 1]` on the compute device: each sequence's first token, then the
    /// batch's token count.
    cu: TchTensor,
    /// Longest sequence.
    max_len: i64,
}

/// The cumulative offsets of every span of every row, rows end to end (a row's padding is one
/// more sequence, attending only within itself as on the per-span route), and the longest span.
pub fn cu_seqlens(packed: &PackedRows) -> (Vec<i32>, i64) {
    let mut cu = vec![0i32];
    let mut longest = 0;
    for r in 0..packed.rows() {
        let base = (r * packed.seq()) as i32;
        for (start, len) in packed.spans(r) {
            cu.push(base + (start + len) as i32);
            longest = longest.max(len);
        }
    }
    (cu, longest as i64)
}

impl VarlenSpans {
    /// The spans of `packed` on `device` (one small upload). Refused past 2³¹ tokens (the
    /// kernel's offsets are int32).
    pub fn new(packed: &PackedRows, device: tch::Device) -> Result<Self, tch::TchError> {
        let tokens = packed.rows() * packed.seq();
        if i32::try_from(tokens).is_err() {
            return Err(tch::TchError::Torch(format!(
                "a packed batch of {tokens} tokens: the kernel's offsets are int32"
            )));
        }
        let (cu, max_len) = cu_seqlens(packed);
        let cu = tch::Tensor::f_from_slice(&cu)?.f_to_device(device)?;
        Ok(Self { cu: TchTensor::new(cu), max_len })
    }
}

/// What the variable-length forward keeps for its backward besides q, k, v, the output and
/// the log-sum-exp.
#[derive(Debug, Clone)]
pub struct VarlenKept {
    spans: Arc<VarlenSpans>,
    seed: MaybeTensor,
    offset: MaybeTensor,
}

/// `[batch, heads, seq, head_dim]` as the kernel's `[batch · seq, heads, head_dim]` (a view
/// when the tensor is laid out `[batch, seq, heads, head_dim]`, as projections leave it).
fn tokens_first(x: &tch::Tensor) -> Result<tch::Tensor, tch::TchError> {
    let [b, h, s, hd] = x.size()[..] else { unreachable!("4-D attention input") };
    x.f_transpose(1, 2)?.f_reshape([b * s, h, hd])
}

/// The inverse of [`tokens_first`] for `batch` rows (a view).
fn heads_first(x: &tch::Tensor, batch: i64) -> Result<tch::Tensor, tch::TchError> {
    let [t, h, hd] = x.size()[..] else { unreachable!("3-D varlen output") };
    x.f_view([batch, t / batch, h, hd])?.f_transpose(1, 2)
}

/// Flash attention within each span of `spans`.
///
/// # Shapes
/// - q: `[batch, heads, seq, head_dim]`, bf16/f16 on CUDA; k, v: `[batch, kv_heads, seq,
///   head_dim]`; `spans` cover the `batch · seq` tokens
/// - output (in [`Saved::out`]): as q
pub fn forward(
    q: &tch::Tensor,
    k: &tch::Tensor,
    v: &tch::Tensor,
    spans: &Arc<VarlenSpans>,
    causal: bool,
) -> Result<Saved, tch::TchError> {
    let batch = q.size()[0];
    let (tq, tk, tv) = (tokens_first(q)?, tokens_first(k)?, tokens_first(v)?);
    let f = if crate::routes::stands_in(q.device()) {
        stand_in_forward(&tq, &tk, &tv, spans, causal)?
    } else {
        cuda::flash_varlen_forward(&tq, &tk, &tv, &spans.cu.tensor, spans.max_len, causal)?
    };
    ROUTE.mark_used();
    let kept = VarlenKept {
        spans: spans.clone(),
        seed: MaybeTensor::keep(f.philox_seed),
        offset: MaybeTensor::keep(f.philox_offset),
    };
    let out = heads_first(&f.out, batch)?;
    Ok(Saved { out: TchTensor::new(out), lse: TchTensor::new(f.logsumexp), kept: Kept::Own(Arc::new(kept)) })
}

impl OwnBackward for VarlenKept {
    /// The backward of [`forward`]: (dq, dk, dv), dk and dv at K/V's head count.
    ///
    /// # Shapes
    /// - grad, out: as q in [`forward`]; lse as the forward returned it
    fn backward(
        &self,
        grad: &tch::Tensor,
        [q, k, v]: [&tch::Tensor; 3],
        out: &tch::Tensor,
        lse: &tch::Tensor,
        causal: bool,
    ) -> Result<(tch::Tensor, tch::Tensor, tch::Tensor), tch::TchError> {
        let batch = q.size()[0];
        let (cu, max) = (&self.spans.cu.tensor, self.spans.max_len);
        if crate::routes::stands_in(q.device()) {
            let (g, tq, tk, tv, to) =
                (tokens_first(grad)?, tokens_first(q)?, tokens_first(k)?, tokens_first(v)?, tokens_first(out)?);
            let (dq, dk, dv) = stand_in_backward([&g, &tq, &tk, &tv, &to], lse, &self.spans, causal)?;
            return Ok((heads_first(&dq, batch)?, heads_first(&dk, batch)?, heads_first(&dv, batch)?));
        }
        let (dq, dk, dv) = tch::Tensor::f_internal_flash_attention_backward(
            &tokens_first(grad)?.f_contiguous()?,
            &tokens_first(q)?,
            &tokens_first(k)?,
            &tokens_first(v)?,
            &tokens_first(out)?,
            lse,
            cu,
            cu,
            max,
            max,
            0.0,
            causal,
            &self.seed.get(),
            &self.offset.get(),
            None,
            None,
            None,
        )?;
        Ok((heads_first(&dq, batch)?, heads_first(&dk, batch)?, heads_first(&dv, batch)?))
    }
}

/// The sequences `spans` lays end to end, as token ranges `(start, len)` (read from the
/// offsets on the CPU standing in for CUDA).
fn sequences(spans: &VarlenSpans) -> Result<Vec<(i64, i64)>, tch::TchError> {
    let cu = Vec::<i32>::try_from(&spans.cu.tensor)?;
    Ok(cu.windows(2).map(|w| (i64::from(w[0]), i64::from(w[1] - w[0]))).collect())
}

/// One sequence of a tokens-first tensor as the fused kernels take it.
///
/// # Shapes
/// - x: `[tokens, heads, head_dim]`; output: `[1, heads, len, head_dim]`
fn one_sequence(x: &tch::Tensor, (start, len): (i64, i64)) -> Result<tch::Tensor, tch::TchError> {
    x.f_narrow(0, start, len)?.f_transpose(0, 1)?.f_unsqueeze(0)
}

/// The inverse of [`one_sequence`] over all sequences: `[1, heads, len, head_dim]` parts laid
/// end to end as `[tokens, heads, head_dim]`.
fn end_to_end(parts: &[tch::Tensor]) -> Result<tch::Tensor, tch::TchError> {
    tch::Tensor::f_cat(parts, 2)?.f_squeeze_dim(0)?.f_transpose(0, 1)?.f_contiguous()
}

/// The variable-length forward as the CPU's fused kernel on each sequence (the CPU standing in
/// for CUDA has no variable-length kernel): what the route's offsets, layout and check do runs,
/// the kernel does not. The log-sum-exp is kept `[1, heads, tokens]`, which only
/// [`stand_in_backward`] reads.
///
/// # Shapes
/// As [`cuda::flash_varlen_forward`].
fn stand_in_forward(
    q: &tch::Tensor,
    k: &tch::Tensor,
    v: &tch::Tensor,
    spans: &VarlenSpans,
    causal: bool,
) -> Result<cuda::VarlenForward, tch::TchError> {
    let (mut outs, mut lses) = (Vec::new(), Vec::new());
    for seq in sequences(spans)? {
        let [q, k, v] = [q, k, v].map(|x| one_sequence(x, seq));
        let saved = super::fused::forward_with(FusedKernel::CpuFlash, &q?, &k?, &v?, causal)?;
        outs.push(saved.out.tensor);
        lses.push(saved.lse.tensor);
    }
    let none = tch::Tensor::new;
    Ok(cuda::VarlenForward {
        out: end_to_end(&outs)?,
        logsumexp: tch::Tensor::f_cat(&lses, 2)?,
        philox_seed: none(),
        philox_offset: none(),
    })
}

/// The backward of [`stand_in_forward`]: the CPU's fused backward on each sequence.
///
/// # Shapes
/// - grad, q, out: `[tokens, heads, head_dim]`; k, v: `[tokens, kv_heads, head_dim]`; lse as
///   [`stand_in_forward`] kept it
fn stand_in_backward(
    [grad, q, k, v, out]: [&tch::Tensor; 5],
    lse: &tch::Tensor,
    spans: &VarlenSpans,
    causal: bool,
) -> Result<(tch::Tensor, tch::Tensor, tch::Tensor), tch::TchError> {
    let mut parts: [Vec<tch::Tensor>; 3] = Default::default();
    for seq @ (start, len) in sequences(spans)? {
        let [g, q, k, v, out] = [grad, q, k, v, out].map(|x| one_sequence(x, seq));
        let saved = Saved {
            out: TchTensor::new(out?),
            lse: TchTensor::new(lse.f_narrow(2, start, len)?.f_contiguous()?),
            kept: Kept::Cpu,
        };
        let (dq, dk, dv) = super::fused::backward(&g?, &q?, &k?, &v?, &saved, causal)?;
        for (part, d) in parts.iter_mut().zip([dq, dk, dv]) {
            part.push(d);
        }
    }
    let [dq, dk, dv] = parts.map(|p| end_to_end(&p));
    Ok((dq?, dk?, dv?))
}

/// The route: the verdict of [`verify`] per kind of problem, and whether [`forward`] ran.
pub static ROUTE: crate::routes::Verdicts<Problem> =
    crate::routes::Verdicts::new("packed attention: cuda-flash-varlen", "one fused kernel per document instead");

/// Whether packed rows of problem `p` take the variable-length kernel: bf16/f16 on a device
/// that takes the CUDA routes, and its check ([`verify`]) passed on the first problem of this
/// kind (logged either way).
pub fn usable(p: Problem) -> bool {
    if !matches!(p.kind, tch::Kind::BFloat16 | tch::Kind::Half) || !crate::routes::fused_routes() {
        return false;
    }
    ROUTE.passed(p, || verify(p.device, p.kind, p.heads, p.kv_heads, p.head_dim))
}

/// Checks the variable-length kernel on `device`, forward and backward, against plain
/// LibTorch with a block-diagonal causal mask ([`check_packed`]).
pub fn verify(device: tch::Device, kind: tch::Kind, heads: i64, kv_heads: i64, head_dim: i64) -> Result<(), String> {
    check_packed(device, kind, [heads, kv_heads, head_dim], |[q, k, v, w], packed| {
        let spans = Arc::new(VarlenSpans::new(packed, device).map_err(|e| format!("offsets: {e}"))?);
        let saved = forward(q, k, v, &spans, true).map_err(|e| format!("forward: {e}"))?;
        let Kept::Own(kept) = &saved.kept else { unreachable!("the varlen forward keeps its own state") };
        let (dq, dk, dv) = kept
            .backward(w, [q, k, v], &saved.out.tensor, &saved.lse.tensor, true)
            .map_err(|e| format!("backward: {e}"))?;
        Ok([saved.out.tensor.shallow_clone(), dq, dk, dv])
    })
}

/// Runs `attend` (returning out, dq, dk, dv for inputs q, k, v and upstream gradient w) on a
/// random packed problem with these head counts and compares it with plain LibTorch under a
/// block-diagonal causal mask: two rows of 133 tokens, one holding documents of 37, 5 and 60
/// tokens then 31 of padding, the other documents of 1 and 132 (lengths no tiling divides, a
/// one-token document, a row's end inside no document and at one).
fn check_packed(
    device: tch::Device,
    kind: tch::Kind,
    [heads, kv_heads, head_dim]: [i64; 3],
    attend: impl FnOnce([&tch::Tensor; 4], &PackedRows) -> Result<[tch::Tensor; 4], String>,
) -> Result<(), String> {
    let _guard = tch::no_grad_guard();
    let seq = 133;
    let packed = PackedRows::new(vec![vec![37, 5, 60], vec![1, 132]], seq).map_err(|e| e.to_string())?;
    let rows = packed.rows() as i64;
    let rand = |h: i64| {
        tch::Tensor::f_randn([rows, h, seq as i64, head_dim], (tch::Kind::Float, device))
            .and_then(|x| x.f_to_kind(kind))
            .map_err(|e| format!("inputs: {e}"))
    };
    let (q, k, v, w) = (rand(heads)?, rand(kv_heads)?, rand(kv_heads)?, rand(heads)?);
    let [out, dq, dk, dv] = attend([&q, &k, &v, &w], &packed)?;
    let mask = block_diagonal_mask(&packed, device).map_err(|e| format!("mask: {e}"))?;
    check_against_reference([&q, &k, &v, &w], Some(&mask), [&out, &dq, &dk, &dv])
}

/// True where a query may not see a key: another span of its row, or a later position.
///
/// # Shapes
/// - output: `[rows, 1, seq, seq]` bool
fn block_diagonal_mask(packed: &PackedRows, device: tch::Device) -> Result<tch::Tensor, tch::TchError> {
    let s = packed.seq();
    let mut hidden = Vec::with_capacity(packed.rows() * s * s);
    for r in 0..packed.rows() {
        let span_of: Vec<usize> =
            packed.spans(r).iter().enumerate().flat_map(|(i, &(_, len))| std::iter::repeat_n(i, len)).collect();
        for i in 0..s {
            hidden.extend((0..s).map(|j| j > i || span_of[j] != span_of[i]));
        }
    }
    let s = s as i64;
    tch::Tensor::f_from_slice(&hidden)?.f_view([packed.rows() as i64, 1, s, s])?.f_to_device(device)
}

#[cfg(test)]
mod tests {
    use super::super::fused::{FusedKernel, backward as fused_backward, forward_with};
    use super::*;

    /// Hand-derived: rows of 6 holding [2, 3] (+1 padding) and [6]; and one of 8 holding [8].
    #[test]
    fn offsets_cover_every_span_of_every_row() {
        let p = PackedRows::new(vec![vec![2, 3], vec![6]], 6).unwrap();
        assert_eq!(cu_seqlens(&p), (vec![0, 2, 5, 6, 12], 6));
        let p = PackedRows::new(vec![vec![1, 1], vec![3]], 4).unwrap();
        assert_eq!(cu_seqlens(&p), (vec![0, 1, 2, 4, 7, 8], 3));
    }

    /// The mask the check compares with, by hand for one row of 4 holding [1, 2] (+1 padding).
    #[test]
    fn the_reference_mask_is_block_diagonal_and_causal() {
        let p = PackedRows::new(vec![vec![1, 2]], 4).unwrap();
        let m = block_diagonal_mask(&p, tch::Device::Cpu).unwrap();
        let got: Vec<bool> = m.flatten(0, -1).try_into().unwrap();
        #[rustfmt::skip]
        let want = [
            false, true,  true,  true,
            true,  false, true,  true,
            true,  false, false, true,
            true,  true,  true,  false,
        ];
        assert_eq!(got, want);
    }

    /// The check itself, on the CPU: the per-span route (the CPU flash kernel on each span)
    /// passes it in f32 and bf16 with grouped K/V, and causal attention over whole rows (which
    /// crosses documents) fails it.
    #[test]
    fn the_check_passes_per_span_attention_and_refuses_whole_rows() {
        let cpu = tch::Device::Cpu;
        let per_span = |[q, k, v, w]: [&tch::Tensor; 4], packed: &PackedRows| {
            let mut parts: [Vec<tch::Tensor>; 4] = Default::default();
            for r in 0..packed.rows() as i64 {
                for (start, len) in packed.spans(r as usize) {
                    let cut = |x: &tch::Tensor| x.narrow(0, r, 1).narrow(2, start as i64, len as i64);
                    let (q, k, v, w) = (cut(q), cut(k), cut(v), cut(w));
                    let saved = forward_with(FusedKernel::CpuFlash, &q, &k, &v, true).map_err(|e| e.to_string())?;
                    let (dq, dk, dv) = fused_backward(&w, &q, &k, &v, &saved, true).map_err(|e| e.to_string())?;
                    for (part, t) in parts.iter_mut().zip([saved.out.tensor.shallow_clone(), dq, dk, dv]) {
                        part.push(t);
                    }
                }
            }
            // Spans back into rows (dim 2), rows into the batch (dim 0).
            let spans_per_row: Vec<usize> = (0..packed.rows()).map(|r| packed.spans(r).len()).collect();
            Ok(parts.map(|p| {
                let mut it = p.into_iter();
                let rows: Vec<tch::Tensor> = spans_per_row
                    .iter()
                    .map(|&n| tch::Tensor::cat(&it.by_ref().take(n).collect::<Vec<_>>(), 2))
                    .collect();
                tch::Tensor::cat(&rows, 0)
            }))
        };
        for kind in [tch::Kind::Float, tch::Kind::BFloat16] {
            assert_eq!(check_packed(cpu, kind, [4, 2, 16], per_span), Ok(()), "{kind:?}");
        }
        let whole_rows = |[q, k, v, w]: [&tch::Tensor; 4], _: &PackedRows| {
            let saved = forward_with(FusedKernel::CpuFlash, q, k, v, true).map_err(|e| e.to_string())?;
            let (dq, dk, dv) = fused_backward(w, q, k, v, &saved, true).map_err(|e| e.to_string())?;
            Ok([saved.out.tensor.shallow_clone(), dq, dk, dv])
        };
        let err = check_packed(cpu, tch::Kind::Float, [4, 2, 16], whole_rows).unwrap_err();
        assert!(err.starts_with("output differs"), "{err}");
    }

    /// There is no variable-length kernel on the CPU: the check reports the kernel's error
    /// (through the C++ shim), never a panic, an abort or a pass.
    #[test]
    fn the_check_reports_a_missing_kernel() {
        let _off = crate::routes::on_cpu_for_this_thread(false);
        let err = verify(tch::Device::Cpu, tch::Kind::BFloat16, 4, 2, 16).unwrap_err();
        eprintln!("varlen flash on the CPU: {}", err.lines().next().unwrap_or(""));
        assert!(err.starts_with("forward: "), "{err}");
    }

    /// The route on the CPU standing in for CUDA: offsets uploaded, tokens-first layout, the
    /// per-sequence stand-in kernel and its backward pass the block-diagonal check, and the
    /// verdict is kept per problem (bf16 takes it; f32 never asks).
    #[test]
    fn the_varlen_route_passes_its_check_on_the_cpu_standing_in() {
        crate::routes::tests::on_cpu_within(120, "varlen attention's first use", || {
            let cpu = tch::Device::Cpu;
            assert_eq!(verify(cpu, tch::Kind::BFloat16, 4, 2, 16), Ok(()));
            let p = Problem {
                device: cpu,
                kind: tch::Kind::BFloat16,
                heads: 4,
                kv_heads: 2,
                head_dim: 16,
                single_token: false,
            };
            assert!(usable(p));
            assert_eq!(ROUTE.verdict(p), Some(true));
            assert!(!usable(Problem { kind: tch::Kind::Float, ..p }), "f32 takes one kernel per document");
        });
    }

    /// On a CUDA device: the kernel passes its check at the Llama 2 70B head shape (64 query
    /// heads on 8 K/V heads of 128) and at a small one.
    #[test]
    #[ignore = "needs CUDA"]
    fn cuda_varlen_matches_the_block_diagonal_reference() {
        assert!(tch::Cuda::is_available(), "needs a CUDA device");
        let dev = tch::Device::Cuda(0);
        assert_eq!(verify(dev, tch::Kind::BFloat16, 64, 8, 128), Ok(()));
        assert_eq!(verify(dev, tch::Kind::BFloat16, 4, 2, 64), Ok(()));
    }
}
