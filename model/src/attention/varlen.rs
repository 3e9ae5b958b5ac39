//! Packed rows and sliding windows on CUDA: flash attention over variable-length sequences,
//! the way the fast packed trainers run it (flash-attn's `varlen` API, which torch's
//! `_flash_attention_forward` wraps). Every span of every row (its documents, then its padding)
//! becomes one sequence of a single `[tokens, heads, head_dim]` problem described by its
//! cumulative offsets, so a packed batch is one kernel launch per layer, forward and backward,
//! whatever its number of documents, with the documents' own `Σ sᵢ²` work and no mask.
//!
//! A sliding window (Mistral, Qwen 2's windowed layers) is the same kernel with its window
//! arguments, on packed documents or on whole rows ([`VarlenSpans::rows`]): the band's own
//! `S·W` work and no `S × S` scores. Its check ([`verify_window`], route [`WINDOW_ROUTE`]) adds
//! the band to the reference mask; where it fails, the masked attention
//! (`attention::masked_window_attention`) runs.
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
use super::fused::{Kept, MaybeTensor, OwnBackward, Saved, check_against_reference};
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
    /// Each of `batch` rows of `seq` tokens as one sequence (offsets made on `device`, no
    /// upload): dense rows for a kernel that only the variable-length entry point offers (the
    /// sliding window).
    pub fn rows(batch: usize, seq: usize, device: tch::Device) -> Result<Self, tch::TchError> {
        let tokens = batch * seq;
        let end = i64::try_from(tokens).ok().filter(|&t| i32::try_from(t).is_ok()).ok_or_else(|| {
            tch::TchError::Torch(format!("a batch of {tokens} tokens: the kernel's offsets are int32"))
        })?;
        let cu = tch::Tensor::f_arange_start_step(0, end + 1, seq as i64, (tch::Kind::Int, device))?;
        Ok(Self { cu: TchTensor::new(cu), max_len: seq as i64 })
    }

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
    /// The sliding window W the forward ran with (a query sees itself and W - 1 keys before).
    window: Option<usize>,
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

/// Flash attention within each span of `spans`; with a sliding `window` W (causal only), each
/// query sees itself and at most the W - 1 keys before it in its span.
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
    window: Option<usize>,
) -> Result<Saved, tch::TchError> {
    let batch = q.size()[0];
    let (tq, tk, tv) = (tokens_first(q)?, tokens_first(k)?, tokens_first(v)?);
    let f = if crate::routes::stands_in(q.device()) {
        stand_in_forward(&tq, &tk, &tv, spans, causal, window)?
    } else {
        let left = keys_behind(window, causal)?;
        cuda::flash_varlen_forward(&tq, &tk, &tv, &spans.cu.tensor, spans.max_len, causal, left)?
    };
    if window.is_some() { &WINDOW_ROUTE } else { &ROUTE }.mark_used();
    let kept = VarlenKept {
        spans: spans.clone(),
        window,
        seed: MaybeTensor::keep(f.philox_seed),
        offset: MaybeTensor::keep(f.philox_offset),
    };
    let out = heads_first(&f.out, batch)?;
    Ok(Saved { out: TchTensor::new(out), lse: TchTensor::new(f.logsumexp), kept: Kept::Own(Arc::new(kept)) })
}

/// The kernel's left window for a sliding `window` W: the W - 1 keys before a query (flash
/// attention's `window_size_left`; the right one is 0). A window is causal only.
fn keys_behind(window: Option<usize>, causal: bool) -> Result<Option<i64>, tch::TchError> {
    match window {
        None => Ok(None),
        Some(0) => Err(tch::TchError::Torch("a sliding window of 0 keys".into())),
        Some(_) if !causal => Err(tch::TchError::Torch("a sliding window without the causal mask".into())),
        Some(w) => Ok(Some(w as i64 - 1)),
    }
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
            let (dq, dk, dv) = stand_in_backward([&g, &tq, &tk, &tv, &to], lse, &self.spans, causal, self.window)?;
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
            keys_behind(self.window, causal)?,
            self.window.map(|_| 0),
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
/// for CUDA has no variable-length kernel), a window as a band mask ([`band_mask`]): what the
/// route's offsets, layout and check do runs, the kernel does not. The log-sum-exp is kept
/// `[1, heads, tokens]`, which only [`stand_in_backward`] reads.
///
/// # Shapes
/// As [`cuda::flash_varlen_forward`].
fn stand_in_forward(
    q: &tch::Tensor,
    k: &tch::Tensor,
    v: &tch::Tensor,
    spans: &VarlenSpans,
    causal: bool,
    window: Option<usize>,
) -> Result<cuda::VarlenForward, tch::TchError> {
    let (mut outs, mut lses) = (Vec::new(), Vec::new());
    for seq in sequences(spans)? {
        let [q, k, v] = [q, k, v].map(|x| one_sequence(x, seq));
        let q = q?;
        let mask = window.map(|w| band_mask(seq.1, w, &q)).transpose()?;
        let saved = super::fused::cpu_forward([&q, &k?, &v?], causal && mask.is_none(), mask.as_ref())?;
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
    window: Option<usize>,
) -> Result<(tch::Tensor, tch::Tensor, tch::Tensor), tch::TchError> {
    let mut parts: [Vec<tch::Tensor>; 3] = Default::default();
    for seq @ (start, len) in sequences(spans)? {
        let [g, q, k, v, out] = [grad, q, k, v, out].map(|x| one_sequence(x, seq));
        // The kernel takes the gradient laid out as the output: both made dense.
        let (g, out, q) = (g?.f_contiguous()?, out?.f_contiguous()?, q?);
        let lse = lse.f_narrow(2, start, len)?.f_contiguous()?;
        let mask = window.map(|w| band_mask(len, w, &q)).transpose()?;
        let (dq, dk, dv) =
            super::fused::cpu_backward(&g, [&q, &k?, &v?], &out, &lse, causal && mask.is_none(), mask.as_ref())?;
        for (part, d) in parts.iter_mut().zip([dq, dk, dv]) {
            part.push(d);
        }
    }
    let [dq, dk, dv] = parts.map(|p| end_to_end(&p));
    Ok((dq?, dk?, dv?))
}

/// The additive mask of a causal sliding window W over `len` tokens for the CPU kernel: 0 where
/// a query may see a key (itself and the W - 1 before it), -inf elsewhere, in the dtype the
/// kernel computes `q` in.
///
/// # Shapes
/// - output: `[len, len]`
fn band_mask(len: i64, window: usize, q: &tch::Tensor) -> Result<tch::Tensor, tch::TchError> {
    let pos = tch::Tensor::f_arange(len, (tch::Kind::Int64, tch::Device::Cpu))?;
    let behind = pos.f_unsqueeze(1)?.f_sub(&pos.f_unsqueeze(0)?)?;
    let hidden = behind.f_lt(0)?.f_logical_or(&behind.f_ge(window as i64)?)?;
    let kind = super::fused::cpu_kernel_kind(q);
    tch::Tensor::f_zeros([len, len], (kind, tch::Device::Cpu))?.f_masked_fill(&hidden, f64::NEG_INFINITY)
}

crate::routes::declare_route! {
    /// The route: the verdict of [`verify`] per kind of problem, and whether [`forward`] ran.
    pub static ROUTE: Verdicts<Problem> = &crate::routes::RouteSpec {
        name: "packed attention: cuda-flash-varlen",
        fallback: "one fused kernel per document instead",
        order: 40,
        part: "attention",
        self_tests: &[crate::routes::SelfTest {
            name: "attention cuda-flash-varlen BFloat16 (packed rows)",
            check: |device| verify(device, tch::Kind::BFloat16, 64, 8, 128),
            passed: "packed rows' forward and backward match plain LibTorch",
        }],
        counts_uses: true,
    };
}

crate::routes::declare_route! {
    /// The sliding-window route: the verdict of [`verify_window`] per kind of problem, and
    /// whether [`forward`] ran with a window.
    pub static WINDOW_ROUTE: Verdicts<Problem> = &crate::routes::RouteSpec {
        name: "sliding-window attention: cuda-flash-window",
        fallback: "the masked attention (f32 seq x seq scores) instead",
        order: 50,
        part: "attention",
        self_tests: &[crate::routes::SelfTest {
            name: "attention cuda-flash-window BFloat16 (sliding windows)",
            check: |device| verify_window(device, tch::Kind::BFloat16, 32, 8, 128),
            passed: "banded forward and backward match plain LibTorch",
        }],
        counts_uses: true,
    };
}

/// The window [`verify_window`] checks with: shorter than the check's documents of 37, 60 and
/// 132 tokens, longer than its others.
const CHECK_WINDOW: usize = 16;

/// Whether packed rows of problem `p` take the variable-length kernel: bf16/f16 on a device
/// that takes the CUDA routes, and its check ([`verify`]) passed on the first problem of this
/// kind (logged either way).
pub fn usable(p: Problem) -> bool {
    takes_flash(p) && ROUTE.passed(p, || verify(p.device, p.kind, p.heads, p.kv_heads, p.head_dim))
}

/// Whether a sliding window of problem `p` takes the kernel's window: as [`usable`], with the
/// window's own check ([`verify_window`]).
pub fn usable_with_window(p: Problem) -> bool {
    takes_flash(p) && WINDOW_ROUTE.passed(p, || verify_window(p.device, p.kind, p.heads, p.kv_heads, p.head_dim))
}

/// bf16/f16 with the fused routes on (flash attention has no f32 kernel).
fn takes_flash(p: Problem) -> bool {
    matches!(p.kind, tch::Kind::BFloat16 | tch::Kind::Half) && crate::routes::fused_routes()
}

/// Checks the variable-length kernel on `device`, forward and backward, against plain
/// LibTorch with a block-diagonal causal mask ([`check_packed`]).
pub fn verify(device: tch::Device, kind: tch::Kind, heads: i64, kv_heads: i64, head_dim: i64) -> Result<(), String> {
    verify_with(device, kind, [heads, kv_heads, head_dim], None)
}

/// [`verify`] with a sliding window ([`CHECK_WINDOW`]) in the kernel and in the reference mask.
pub fn verify_window(
    device: tch::Device,
    kind: tch::Kind,
    heads: i64,
    kv_heads: i64,
    head_dim: i64,
) -> Result<(), String> {
    verify_with(device, kind, [heads, kv_heads, head_dim], Some(CHECK_WINDOW))
}

/// [`verify`] or [`verify_window`].
fn verify_with(device: tch::Device, kind: tch::Kind, heads: [i64; 3], window: Option<usize>) -> Result<(), String> {
    check_packed(device, kind, heads, window, |[q, k, v, w], packed| {
        let spans = Arc::new(VarlenSpans::new(packed, device).map_err(|e| format!("offsets: {e}"))?);
        let saved = forward(q, k, v, &spans, true, window).map_err(|e| format!("forward: {e}"))?;
        let Kept::Own(kept) = &saved.kept else { unreachable!("the varlen forward keeps its own state") };
        let (dq, dk, dv) = kept
            .backward(w, [q, k, v], &saved.out.tensor, &saved.lse.tensor, true)
            .map_err(|e| format!("backward: {e}"))?;
        Ok([saved.out.tensor.shallow_clone(), dq, dk, dv])
    })
}

/// Runs `attend` (returning out, dq, dk, dv for inputs q, k, v and upstream gradient w) on a
/// random packed problem with these head counts and compares it with plain LibTorch under a
/// block-diagonal causal mask, banded to `window` if given: two rows of 133 tokens, one holding
/// documents of 37, 5 and 60 tokens then 31 of padding, the other documents of 1 and 132
/// (lengths no tiling divides, a one-token document, a row's end inside no document and at one).
fn check_packed(
    device: tch::Device,
    kind: tch::Kind,
    [heads, kv_heads, head_dim]: [i64; 3],
    window: Option<usize>,
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
    let mask = block_diagonal_mask(&packed, window, device).map_err(|e| format!("mask: {e}"))?;
    check_against_reference([&q, &k, &v, &w], Some(&mask), [&out, &dq, &dk, &dv])
}

/// True where a query may not see a key: another span of its row, a later position, or (with a
/// sliding `window` W) one W or more positions before it.
///
/// # Shapes
/// - output: `[rows, 1, seq, seq]` bool
fn block_diagonal_mask(
    packed: &PackedRows,
    window: Option<usize>,
    device: tch::Device,
) -> Result<tch::Tensor, tch::TchError> {
    let far = |i: usize, j: usize| window.is_some_and(|w| i >= j + w);
    let s = packed.seq();
    let mut hidden = Vec::with_capacity(packed.rows() * s * s);
    for r in 0..packed.rows() {
        let span_of: Vec<usize> =
            packed.spans(r).iter().enumerate().flat_map(|(i, &(_, len))| std::iter::repeat_n(i, len)).collect();
        for i in 0..s {
            hidden.extend((0..s).map(|j| j > i || span_of[j] != span_of[i] || far(i, j)));
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
        let m = block_diagonal_mask(&p, None, tch::Device::Cpu).unwrap();
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

    /// The reference mask with a window of 2, by hand for one row of 5 holding [4] (+1 padding):
    /// a query sees itself and the key before it, within its span.
    #[test]
    fn the_reference_mask_bands_a_window() {
        let p = PackedRows::new(vec![vec![4]], 5).unwrap();
        let m = block_diagonal_mask(&p, Some(2), tch::Device::Cpu).unwrap();
        let got: Vec<bool> = m.flatten(0, -1).try_into().unwrap();
        #[rustfmt::skip]
        let want = [
            false, true,  true,  true,  true,
            false, false, true,  true,  true,
            true,  false, false, true,  true,
            true,  true,  false, false, true,
            true,  true,  true,  true,  false,
        ];
        assert_eq!(got, want);
        // The CPU kernel's additive band over 3 tokens, window 2.
        let q = tch::Tensor::zeros([1], (tch::Kind::Float, tch::Device::Cpu));
        let band: Vec<f32> = band_mask(3, 2, &q).unwrap().flatten(0, -1).try_into().unwrap();
        let inf = f32::NEG_INFINITY;
        assert_eq!(band, [0.0, inf, inf, 0.0, 0.0, inf, inf, 0.0, 0.0]);
    }

    /// The window's check, on the CPU standing in for CUDA: the route with its window passes
    /// it (bf16, grouped K/V); the same route without the window fails it (the check sees the
    /// band), and the verdict is kept per problem.
    #[test]
    fn the_window_route_passes_its_check_and_a_missing_window_fails_it() {
        crate::routes::tests::on_cpu_within(120, "windowed attention's first use", || {
            let cpu = tch::Device::Cpu;
            assert_eq!(verify_window(cpu, tch::Kind::BFloat16, 4, 2, 16), Ok(()));
            let no_window = |[q, k, v, w]: [&tch::Tensor; 4], packed: &PackedRows| {
                let spans = Arc::new(VarlenSpans::new(packed, cpu).map_err(|e| e.to_string())?);
                let saved = forward(q, k, v, &spans, true, None).map_err(|e| e.to_string())?;
                let Kept::Own(kept) = &saved.kept else { unreachable!() };
                let (dq, dk, dv) = kept
                    .backward(w, [q, k, v], &saved.out.tensor, &saved.lse.tensor, true)
                    .map_err(|e| e.to_string())?;
                Ok([saved.out.tensor.shallow_clone(), dq, dk, dv])
            };
            let err = check_packed(cpu, tch::Kind::Float, [4, 2, 16], Some(CHECK_WINDOW), no_window).unwrap_err();
            assert!(err.starts_with("output differs"), "{err}");
            let p = small_problem();
            assert!(usable_with_window(p));
            assert_eq!(WINDOW_ROUTE.verdict(p), Some(true));
            assert!(!usable_with_window(Problem { kind: tch::Kind::Float, ..p }), "flash has no f32 kernel");
        });
    }

    /// The bf16 problem of 4 query heads on 2 K/V heads of 16 on the CPU, as the checks here pose it.
    fn small_problem() -> Problem {
        let (device, kind) = (tch::Device::Cpu, tch::Kind::BFloat16);
        Problem { device, kind, heads: 4, kv_heads: 2, head_dim: 16, single_token: false }
    }

    /// Dense rows as sequences: offsets 0, seq, 2·seq, ... made on the device.
    #[test]
    fn rows_are_one_sequence_each() {
        let r = VarlenSpans::rows(3, 5, tch::Device::Cpu).unwrap();
        assert_eq!(Vec::<i32>::try_from(&r.cu.tensor).unwrap(), vec![0, 5, 10, 15]);
        assert_eq!(r.max_len, 5);
        assert!(VarlenSpans::rows(1 << 16, 1 << 16, tch::Device::Cpu).is_err(), "2^32 tokens overflow int32");
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
            assert_eq!(check_packed(cpu, kind, [4, 2, 16], None, per_span), Ok(()), "{kind:?}");
        }
        let whole_rows = |[q, k, v, w]: [&tch::Tensor; 4], _: &PackedRows| {
            let saved = forward_with(FusedKernel::CpuFlash, q, k, v, true).map_err(|e| e.to_string())?;
            let (dq, dk, dv) = fused_backward(w, q, k, v, &saved, true).map_err(|e| e.to_string())?;
            Ok([saved.out.tensor.shallow_clone(), dq, dk, dv])
        };
        let err = check_packed(cpu, tch::Kind::Float, [4, 2, 16], None, whole_rows).unwrap_err();
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
            let p = small_problem();
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

    /// On a CUDA device: the kernel's window passes its banded check at Mistral 7B's head shape
    /// (32 query heads on 8 K/V heads of 128), Qwen 2.5 7B's (28 on 4) and a small one.
    #[test]
    #[ignore = "needs CUDA"]
    fn cuda_window_matches_the_banded_reference() {
        assert!(tch::Cuda::is_available(), "needs a CUDA device");
        let dev = tch::Device::Cuda(0);
        assert_eq!(verify_window(dev, tch::Kind::BFloat16, 32, 8, 128), Ok(()));
        assert_eq!(verify_window(dev, tch::Kind::BFloat16, 28, 4, 128), Ok(()));
        assert_eq!(verify_window(dev, tch::Kind::BFloat16, 4, 2, 64), Ok(()));
    }
}
