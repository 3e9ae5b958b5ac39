//! Scaled-dot-product attention with grouped-query heads, fused where LibTorch has it.
//!
//! Burn 0.22.1's autodiff attention is the naive path: it builds the `S×S` score matrix and
//! keeps it for backward (17 GB in f32 for one Llama 2 70B layer at 8192 tokens). On LibTorch
//! devices llora instead calls LibTorch's fused kernels and their backward through a Burn
//! backend extension with a hand-written autodiff node, so training memory grows with `S`, not
//! `S²`: flash attention on the CPU (any dtype, grouped K/V as they are), and on CUDA cuDNN
//! SDPA or flash attention in bf16/f16 (grouped K/V as they are) and the memory-efficient kernel
//! in f32 (K/V repeated). Other devices take Burn's generic attention (correct, but quadratic).
//!
//! Packed rows (several documents per row) attend within each document: on CUDA in bf16/f16
//! through flash attention's variable-length kernel, one launch for all of a batch's documents;
//! elsewhere one fused kernel per document. A sliding window shorter than the row takes the
//! same kernel's window arguments on CUDA in bf16/f16, and a masked `S × S` path elsewhere.
//!
//! Files (each uses only the ones after it): `varlen.rs` runs packed rows and sliding windows
//! on the variable-length kernel; `choice.rs` chooses the kernel for a problem (the CUDA ones each
//! checked on first use) and dispatches the forward; `fused.rs` runs the kernels (forward,
//! backward, their check against plain LibTorch); `cuda.rs` calls the forwards tch does not
//! bind through `sdpa_shim.cpp` (built by `model/build.rs`).

mod banded;
mod choice;
mod cuda;
mod fused;
pub mod gathered_kv;
mod varlen;

pub use fused::{FusedKernel, verify};
pub use varlen::{ROUTE as VARLEN_ROUTE, VarlenSpans, WINDOW_ROUTE};

use std::cell::Cell;
use std::sync::Arc;

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::libtorch::TchTensor;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, Dispatch, DispatchDevice, LibTorch, LibTorchDevice, backend_extension};
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{Int, Tensor};

use crate::packing::PackedRows;

/// The fused kernels attention has run with so far in this process (bench JSON names them).
pub fn kernels_used() -> Vec<&'static str> {
    let mut used = fused::kernels_used();
    if varlen::ROUTE.used() {
        used.push("cuda-flash-varlen");
    }
    if varlen::WINDOW_ROUTE.used() {
        used.push("cuda-flash-window");
    }
    if banded::used() {
        used.push("cpu-flash-window");
    }
    used
}

/// The attention problem `q` poses with `kv_heads` K/V heads, on a device that takes the CUDA
/// routes (a CUDA one, or the CPU standing in for it; else `None`).
fn problem(q: &Tensor<4>, kv_heads: usize) -> Option<choice::Problem> {
    let device = match q.device().inner().as_dispatch() {
        DispatchDevice::LibTorch(LibTorchDevice::Cuda(n)) => tch::Device::Cuda(*n),
        DispatchDevice::LibTorch(LibTorchDevice::Cpu) => tch::Device::Cpu,
        _ => return None,
    };
    if !crate::routes::takes_cuda_routes(device) {
        return None;
    }
    let [_, heads, seq, head_dim] = q.dims().map(|d| d as i64);
    Some(choice::Problem {
        device,
        kind: tch_kind(q.dtype()),
        heads,
        kv_heads: kv_heads as i64,
        head_dim,
        single_token: seq == 1,
    })
}

/// Repeats each of the KV heads `group` times so query head h reads KV head h / group.
///
/// # Shapes
/// - x: `[batch, kv_heads, seq, head_dim]`
/// - output: `[batch, kv_heads · group, seq, head_dim]`
pub fn repeat_kv(x: Tensor<4>, group: usize) -> Tensor<4> {
    if group == 1 {
        return x;
    }
    let [b, kv, s, hd] = x.dims();
    x.unsqueeze_dim::<5>(2).expand([b, kv, group, s, hd]).reshape([b, kv * group, s, hd])
}

/// Which attention implementation runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionKernel {
    /// LibTorch's fused kernel for the device and dtype, with its own backward (memory O(S)):
    /// see [`FusedKernel`].
    TorchFused,
    /// Burn's generic attention (autodiff keeps the `S×S` scores).
    Generic,
}

thread_local! {
    /// Whether this thread's attention runs Burn's generic path (see [`with_generic_attention`]).
    static GENERIC: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` with every attention this thread computes in it on Burn's generic path instead of
/// a fused kernel, as HF's `attn_implementation="eager"` does: a numerics check measures with
/// it what two correct implementations of the same attention differ by in fp32. The previous
/// setting is restored after `f`, also when it unwinds; other threads are not affected.
/// Context-parallel attention is not switched (it has no generic path).
pub fn with_generic_attention<T>(f: impl FnOnce() -> T) -> T {
    crate::scoped::with(&GENERIC, true, f)
}

impl AttentionKernel {
    /// The kernel [`attention`] uses for `q` (`[batch, heads, seq, head_dim]`) with
    /// `kv_heads` K/V heads: on CUDA, whether a fused kernel passed its check for this dtype
    /// and these head counts (checked on first use, see `choice.rs`); the generic one inside
    /// [`with_generic_attention`].
    pub fn for_query(q: &Tensor<4>, kv_heads: usize) -> Self {
        if GENERIC.with(Cell::get) {
            return Self::Generic;
        }
        match (q.device().inner().as_dispatch(), problem(q, kv_heads)) {
            (DispatchDevice::LibTorch(_), None) => Self::TorchFused, // the CPU's own kernel
            (_, Some(p)) => choice::choose(p).map_or(Self::Generic, |_| Self::TorchFused),
            _ => Self::Generic,
        }
    }
}

/// The tch element type of a Burn float dtype.
fn tch_kind(dtype: burn::tensor::DType) -> tch::Kind {
    match dtype {
        burn::tensor::DType::BF16 => tch::Kind::BFloat16,
        burn::tensor::DType::F16 => tch::Kind::Half,
        burn::tensor::DType::F64 => tch::Kind::Double,
        _ => tch::Kind::Float,
    }
}

/// `softmax(q·kᵀ/√hd [+ causal mask])·v`, query head h attending to KV head h / (H/KV).
///
/// # Shapes
/// - q: `[batch, heads, seq, head_dim]`
/// - k, v: `[batch, kv_heads, seq, head_dim]`
/// - output: `[batch, heads, seq, head_dim]`
pub fn attention(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>, causal: bool) -> Tensor<4> {
    let kernel = AttentionKernel::for_query(&q, k.dims()[1]);
    attention_with(kernel, q, k, v, causal)
}

/// Causal [`attention`], as a decoder uses it.
///
/// # Shapes
/// As [`attention`].
pub fn causal_attention(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>) -> Tensor<4> {
    attention(q, k, v, true)
}

/// Causal attention where each query sees at most the `window` keys ending at its own position
/// (itself and the `window - 1` before it: transformers' sliding window); without a window, or
/// a window as long as the sequence, [`causal_attention`] itself.
///
/// Under a shorter window, on CUDA in bf16/f16, flash attention with its window arguments
/// (each row one sequence of the variable-length kernel, checked on first use: `varlen.rs`);
/// on the CPU, its flash kernel in f32 on blocks of queries over the keys their band reaches
/// (`banded.rs`); elsewhere [`masked_window_attention`].
///
/// # Shapes
/// As [`attention`].
pub fn windowed_causal_attention(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>, window: Option<usize>) -> Tensor<4> {
    let [b, _, s, _] = q.dims();
    let Some(w) = window.filter(|&w| w < s) else { return causal_attention(q, k, v) };
    if let Some(p) = problem(&q, k.dims()[1])
        && varlen::usable_with_window(p)
    {
        match VarlenSpans::rows(b, s, p.device) {
            Ok(rows) => return fused_varlen(q, k, v, Arc::new(rows), Some(w)),
            Err(e) => tracing::warn!("sliding-window attention: {e}; using the masked path"),
        }
    }
    let on_cpu = matches!(q.device().inner().as_dispatch(), DispatchDevice::LibTorch(LibTorchDevice::Cpu));
    if on_cpu && BANDED_ON_CPU.with(Cell::get) {
        // In f32, as the masked path computes (and HF's eager attention its softmax): the CPU
        // kernel's bf16 moved bf16 LoRA gradients past PEFT's bf16 twin.
        let (dtype, f32) = (q.dtype(), |t: Tensor<4>| t.cast(burn::tensor::DType::F32));
        let out: Tensor<4> = Tensor::from_dispatch(<Dispatch as FusedAttentionBackend>::banded_attention(
            f32(q).into_dispatch(),
            f32(k).into_dispatch(),
            f32(v).into_dispatch(),
            w,
        ));
        return out.cast(dtype);
    }
    masked_window_attention(q, k, v, w)
}

thread_local! {
    /// Whether windows on the CPU take the banded kernel (tests turn it off to run the masked
    /// path, the reference it is checked against).
    static BANDED_ON_CPU: Cell<bool> = const { Cell::new(true) };
}

/// Runs `f` with sliding windows on the CPU on [`masked_window_attention`] (on this thread).
pub fn with_masked_windows<T>(f: impl FnOnce() -> T) -> T {
    crate::scoped::with(&BANDED_ON_CPU, false, f)
}

/// Causal attention in a sliding `window` by Burn's ops: the scores masked to the band and
/// softmaxed in f32 (a `seq × seq` score matrix, kept for backward). Not Burn's `attention`
/// with a mask: burn-tch hands the mask to torch's SDPA, where `true` means the opposite of
/// Burn's documented "masked" (its autodiff fallback follows the documentation).
///
/// # Shapes
/// As [`attention`].
pub fn masked_window_attention(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>, w: usize) -> Tensor<4> {
    let [b, h, s, hd] = q.dims();
    let (device, dtype) = (q.device(), q.dtype());
    let pos = Tensor::<1, Int>::arange(0..s as i64, &device);
    // How far each key lies behind each query: masked when ahead (< 0) or W or more behind.
    let behind = pos.clone().reshape([s, 1]) - pos.reshape([1, s]);
    let masked = behind.clone().lower_elem(0).bool_or(behind.greater_equal_elem(w as i64));
    let group = h / k.dims()[1];
    let f32 = |t: Tensor<4>| t.cast(burn::tensor::DType::F32);
    let (q, k, v) = (f32(q), f32(repeat_kv(k, group)), f32(repeat_kv(v, group)));
    let scores = q.matmul(k.swap_dims(2, 3)).mul_scalar((hd as f64).sqrt().recip());
    let scores = scores.mask_fill(masked.reshape([1, 1, s, s]).expand([b, h, s, s]), f32::NEG_INFINITY);
    softmax_as_autodiff_computes_it(scores).matmul(v).cast(dtype)
}

/// Softmax over the last dimension in the ops Burn's autodiff decomposes it into (a detached
/// max, exp, sum, divide), tracked or not. burn-tch computes an untracked softmax with torch's
/// own kernel, which rounds differently: a recomputed block, whose first forward runs
/// untracked, would then see other values than the tracked forward of the same block.
///
/// # Shapes
/// - scores: `[batch, heads, seq, seq]`; output: as scores
fn softmax_as_autodiff_computes_it(scores: Tensor<4>) -> Tensor<4> {
    let max = scores.clone().detach().max_dim(3);
    let exp = (scores - max).exp();
    let sum = exp.clone().sum_dim(3);
    exp / sum
}

/// Causal attention within each document of packed rows (block-diagonal): the work is the
/// documents' `Σ sᵢ²` rather than `seq²`, and no `seq × seq` mask exists. With `varlen` (the
/// batch's spans on a CUDA device) and a bf16/f16 problem the variable-length flash kernel
/// passes its check on, all spans are one launch; otherwise every span of
/// [`PackedRows::spans`] is its own causal problem on the kernel [`attention`] picks. With a
/// sliding `window`, each document has its own: in the same launch where the kernel's window
/// passed its check, else [`windowed_causal_attention`] per span.
///
/// # Shapes
/// As [`attention`], with `q.dims()[0] == packed.rows()` and `q.dims()[2] == packed.seq()`.
pub fn packed_causal_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    packed: &PackedRows,
    varlen: Option<&Arc<VarlenSpans>>,
    window: Option<usize>,
) -> Tensor<4> {
    let window = window.filter(|&w| w < packed.seq());
    if let Some(spans) = varlen
        && let Some(p) = problem(&q, k.dims()[1])
        && (if window.is_some() { varlen::usable_with_window(p) } else { varlen::usable(p) })
    {
        return fused_varlen(q, k, v, spans.clone(), window);
    }
    let rows: Vec<Tensor<4>> = (0..packed.rows())
        .map(|r| {
            let row = |t: &Tensor<4>| t.clone().narrow(0, r, 1);
            let (q, k, v) = (row(&q), row(&k), row(&v));
            let spans = packed.spans(r);
            if spans.len() == 1 {
                return windowed_causal_attention(q, k, v, window);
            }
            let parts = spans
                .into_iter()
                .map(|(start, len)| {
                    let span = |t: &Tensor<4>| t.clone().narrow(2, start, len);
                    windowed_causal_attention(span(&q), span(&k), span(&v), window)
                })
                .collect();
            Tensor::cat(parts, 2)
        })
        .collect();
    Tensor::cat(rows, 0)
}

/// Causal attention within each of `spans` on the variable-length kernel, in a sliding
/// `window` if given (the caller checked the route).
///
/// # Shapes
/// As [`attention`].
fn fused_varlen(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>, spans: Arc<VarlenSpans>, window: Option<usize>) -> Tensor<4> {
    Tensor::from_dispatch(<Dispatch as FusedAttentionBackend>::fused_varlen_attention(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        spans,
        window,
    ))
}

/// Causal attention of this rank's share of a context-parallel sequence (`cp`) over the whole
/// sequence, keys and values gathered from the group ([`gathered_kv`]).
///
/// # Shapes
/// - q: `[batch, heads, local, head_dim]`; k, v: `[batch, kv_heads, local, head_dim]`
/// - output: as q
pub fn context_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    cp: Arc<gathered_kv::ContextAttention>,
) -> Tensor<4> {
    Tensor::from_dispatch(<Dispatch as FusedAttentionBackend>::context_attention(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        cp,
    ))
}

/// [`attention`] with an explicit kernel (tests compare the two).
///
/// # Shapes
/// As [`attention`].
pub fn attention_with(kernel: AttentionKernel, q: Tensor<4>, k: Tensor<4>, v: Tensor<4>, causal: bool) -> Tensor<4> {
    let group = q.dims()[1] / k.dims()[1];
    match kernel {
        // The fused op repeats K/V itself, so that backward keeps them at KV heads.
        AttentionKernel::TorchFused => Tensor::from_dispatch(<Dispatch as FusedAttentionBackend>::fused_attention(
            q.into_dispatch(),
            k.into_dispatch(),
            v.into_dispatch(),
            causal,
        )),
        AttentionKernel::Generic => {
            let (k, v) = (repeat_kv(k, group), repeat_kv(v, group));
            let options = AttentionModuleOptions { scale: None, softcap: None, is_causal: causal };
            burn::tensor::module::attention(q, k, v, None, None, options)
        }
    }
}

/// Backend extension: fused attention where the backend has a kernel for it.
#[backend_extension(Autodiff, LibTorch)]
pub trait FusedAttentionBackend: Backend {
    /// Attention with scale 1/√hd, causal or not; K/V may have fewer heads than Q (grouped).
    fn fused_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        causal: bool,
    ) -> FloatTensor<Self>;

    /// Causal attention within each span of `spans` (packed rows, or whole rows) on the
    /// variable-length kernel, in a sliding `window` if given.
    fn fused_varlen_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        spans: Arc<VarlenSpans>,
        window: Option<usize>,
    ) -> FloatTensor<Self>;

    /// Causal attention in a sliding `window` on the CPU, block by block ([`banded`]).
    fn banded_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        window: usize,
    ) -> FloatTensor<Self>;

    /// Causal attention of this rank's share of a context-parallel sequence over the whole of
    /// it ([`gathered_kv`]).
    fn context_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        cp: Arc<gathered_kv::ContextAttention>,
    ) -> FloatTensor<Self>;
}

impl FusedAttentionBackend for LibTorch {
    fn fused_attention(q: TchTensor, k: TchTensor, v: TchTensor, causal: bool) -> TchTensor {
        choice::forward(&q.tensor, &k.tensor, &v.tensor, causal).expect("fused attention forward").out
    }

    fn fused_varlen_attention(
        q: TchTensor,
        k: TchTensor,
        v: TchTensor,
        spans: Arc<VarlenSpans>,
        window: Option<usize>,
    ) -> TchTensor {
        varlen::forward(&q.tensor, &k.tensor, &v.tensor, &spans, true, window).expect("packed attention forward").out
    }

    fn banded_attention(q: TchTensor, k: TchTensor, v: TchTensor, window: usize) -> TchTensor {
        banded::forward(&q.tensor, &k.tensor, &v.tensor, window).expect("sliding-window attention forward").out
    }

    fn context_attention(
        q: TchTensor,
        k: TchTensor,
        v: TchTensor,
        cp: Arc<gathered_kv::ContextAttention>,
    ) -> TchTensor {
        gathered_kv::forward(&q.tensor, &k.tensor, &v.tensor, &cp).expect("context-parallel attention forward").out
    }
}

/// Autodiff node of context-parallel attention: keeps this rank's q, k, v, the merged output
/// and log-sum-exp; its backward gathers K/V again and sums the group's K/V gradients.
#[derive(Debug)]
struct ContextAttentionBackward;

/// The node's state.
#[derive(Debug, Clone)]
struct ContextState {
    q: TchTensor,
    k: TchTensor,
    v: TchTensor,
    saved: gathered_kv::ContextSaved,
    cp: Arc<gathered_kv::ContextAttention>,
}

impl Backward<LibTorch, 3> for ContextAttentionBackward {
    type State = ContextState;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [node_q, node_k, node_v] = ops.parents;
        let grad = grads.consume::<LibTorch>(&ops.node);
        let st = ops.state;
        let (dq, dk, dv) =
            gathered_kv::backward(&grad.tensor, &st.q.tensor, &st.k.tensor, &st.v.tensor, &st.saved, &st.cp)
                .expect("context-parallel attention backward");
        for (node, g) in [(node_q, dq), (node_k, dk), (node_v, dv)] {
            if let Some(node) = node {
                grads.register::<LibTorch>(node.id, TchTensor::new(g));
            }
        }
    }
}

/// Autodiff node of the fused attention: keeps q, k, v, the output and the log-sum-exp
/// (O(S) per head) instead of the probabilities (O(S²)), and calls LibTorch's backward kernel.
#[derive(Debug)]
struct FusedAttentionBackward;

/// The node's state: inputs, what the forward kept, and the mask kind.
#[derive(Debug, Clone)]
struct FusedState {
    q: TchTensor,
    k: TchTensor,
    v: TchTensor,
    /// Its output shares one `TchTensor` with the node's output (see `fused_attention`).
    saved: fused::Saved,
    causal: bool,
}

impl Backward<LibTorch, 3> for FusedAttentionBackward {
    type State = FusedState;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [node_q, node_k, node_v] = ops.parents;
        let grad = grads.consume::<LibTorch>(&ops.node);
        let st = ops.state;
        let (dq, dk, dv) =
            fused::backward(&grad.tensor, &st.q.tensor, &st.k.tensor, &st.v.tensor, &st.saved, st.causal)
                .expect("fused attention backward");
        for (node, g) in [(node_q, dq), (node_k, dk), (node_v, dv)] {
            if let Some(node) = node {
                grads.register::<LibTorch>(node.id, TchTensor::new(g));
            }
        }
    }
}

impl<C: CheckpointStrategy> FusedAttentionBackend for Autodiff<LibTorch, C> {
    fn fused_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        causal: bool,
    ) -> FloatTensor<Self> {
        tracked::<C>([q, k, v], causal, |q, k, v| choice::forward(q, k, v, causal).expect("fused attention forward"))
    }

    fn fused_varlen_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        spans: Arc<VarlenSpans>,
        window: Option<usize>,
    ) -> FloatTensor<Self> {
        tracked::<C>([q, k, v], true, |q, k, v| {
            varlen::forward(q, k, v, &spans, true, window).expect("packed attention forward")
        })
    }

    fn banded_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        window: usize,
    ) -> FloatTensor<Self> {
        tracked::<C>([q, k, v], true, |q, k, v| {
            banded::forward(q, k, v, window).expect("sliding-window attention forward")
        })
    }

    fn context_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        cp: Arc<gathered_kv::ContextAttention>,
    ) -> FloatTensor<Self> {
        let nodes = [q.node(), k.node(), v.node()];
        let (q, k, v) = (q.into_primitive(), k.into_primitive(), v.into_primitive());
        let saved =
            gathered_kv::forward(&q.tensor, &k.tensor, &v.tensor, &cp).expect("context-parallel attention forward");
        match ContextAttentionBackward.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                // One TchTensor shared by the state and the output (see `tracked`).
                let out = saved.out.clone();
                prep.finish(ContextState { q, k, v, saved, cp }, out)
            }
            OpsKind::UnTracked(prep) => prep.finish(saved.out),
        }
    }
}

/// Runs a fused forward on the inner tensors of `q, k, v` and records its backward node.
fn tracked<C: CheckpointStrategy>(
    [q, k, v]: [FloatTensor<Autodiff<LibTorch, C>>; 3],
    causal: bool,
    forward: impl FnOnce(&tch::Tensor, &tch::Tensor, &tch::Tensor) -> fused::Saved,
) -> FloatTensor<Autodiff<LibTorch, C>> {
    // Node handles first: `into_primitive` consumes the autodiff tensors.
    let nodes = [q.node(), k.node(), v.node()];
    let (q, k, v) = (q.into_primitive(), k.into_primitive(), v.into_primitive());
    let saved = forward(&q.tensor, &k.tensor, &v.tensor);
    match FusedAttentionBackward.prepare::<C>(nodes).compute_bound().stateful() {
        OpsKind::Tracked(prep) => {
            // One TchTensor shared by the state and the output: burn-tch writes in place
            // into tensors whose storage it believes unique, so two wrappers of the same
            // storage could see each other's in-place updates.
            let out = saved.out.clone();
            prep.finish(FusedState { q, k, v, saved, causal }, out)
        }
        OpsKind::UnTracked(prep) => prep.finish(saved.out),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Device, Distribution, Tolerance};

    fn rand(shape: [usize; 4], device: &Device) -> Tensor<4> {
        Tensor::random(shape, Distribution::Normal(0.0, 1.0), device)
    }

    /// `with_generic_attention` switches this thread only, and only while it runs: nested, on
    /// another thread, after a panic inside it.
    #[test]
    fn generic_attention_is_scoped_to_its_thread_and_call() {
        let device = Device::libtorch();
        let q: Tensor<4> = Tensor::zeros([1, 4, 3, 8], &device);
        let kernel = || AttentionKernel::for_query(&q, 2);
        assert_eq!(kernel(), AttentionKernel::TorchFused, "the CPU's own kernel by default");
        with_generic_attention(|| {
            assert_eq!(kernel(), AttentionKernel::Generic);
            with_generic_attention(|| assert_eq!(kernel(), AttentionKernel::Generic));
            assert_eq!(kernel(), AttentionKernel::Generic, "a nested call restores, not clears");
            let other = std::thread::scope(|s| s.spawn(kernel).join().unwrap());
            assert_eq!(other, AttentionKernel::TorchFused, "another thread is not switched");
        });
        assert_eq!(kernel(), AttentionKernel::TorchFused);
        let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| with_generic_attention(|| panic!("x"))));
        assert!(unwound.is_err());
        assert_eq!(kernel(), AttentionKernel::TorchFused, "restored on unwind");
    }

    /// Fused and generic attention agree in value and in all three input gradients, with GQA,
    /// causal and not, in `dtype` on `device` (the generic one in f32 on the same rounded
    /// inputs), within `tol` of the largest value.
    fn fused_matches_generic(device: &Device, dtype: burn::tensor::DType, tol: f32) {
        let _rng = crate::device::torch_rng_lock();
        device.seed(7);
        let (b, h, kv, s, hd) = (2, 4, 2, 33, 16);
        let q0 = rand([b, h, s, hd], device).cast(dtype);
        let k0 = rand([b, kv, s, hd], device).cast(dtype);
        let v0 = rand([b, kv, s, hd], device).cast(dtype);
        let w = rand([b, h, s, hd], device); // a random upstream gradient via Σ(out·w)
        for causal in [true, false] {
            let run = |kernel, dtype| {
                let leaf = |x: &Tensor<4>| x.clone().cast(dtype).require_grad();
                let (q, k, v) = (leaf(&q0), leaf(&k0), leaf(&v0));
                let out = attention_with(kernel, q.clone(), k.clone(), v.clone(), causal);
                let grads = (out.clone().cast(burn::tensor::DType::F32) * w.clone()).sum().backward();
                [out, q.grad(&grads).unwrap(), k.grad(&grads).unwrap(), v.grad(&grads).unwrap()]
                    .map(|t| t.cast(burn::tensor::DType::F32))
            };
            let fused = run(AttentionKernel::TorchFused, dtype);
            let generic = run(AttentionKernel::Generic, burn::tensor::DType::F32);
            for (name, got, want) in [("out", 0, 0), ("dq", 1, 1), ("dk", 2, 2), ("dv", 3, 3)]
                .map(|(n, i, j)| (n, fused[i].clone(), generic[j].clone()))
            {
                assert_eq!(got.dims(), want.dims(), "{name}");
                let err = (got - want.clone()).abs().max().into_scalar::<f32>();
                let scale = want.abs().max().into_scalar::<f32>();
                assert!(err <= tol * scale, "{name} ({dtype:?}, causal {causal}): error {err:e} of {scale:e}");
            }
        }
        // Non-causal attention really differs from causal (the flag reaches the kernel).
        let c = attention_with(AttentionKernel::TorchFused, q0.clone(), k0.clone(), v0.clone(), true);
        let n = attention_with(AttentionKernel::TorchFused, q0, k0, v0, false);
        assert!((c - n).cast(burn::tensor::DType::F32).abs().max().into_scalar::<f32>() > 1e-2);
    }

    /// The CPU flash kernel matches the generic attention in f32 and in bf16.
    #[test]
    fn fused_matches_generic_forward_and_backward() {
        let device = Device::libtorch().autodiff();
        fused_matches_generic(&device, burn::tensor::DType::F32, 1e-5);
        fused_matches_generic(&device, burn::tensor::DType::BF16, 2e-2);
    }

    /// The CUDA route choice on the CPU standing in for CUDA: f32 takes the memory-efficient
    /// kernel's route and bf16 cuDNN's (each checked on first use, the CPU kernel standing in),
    /// and both still match the generic attention through Burn's autodiff.
    #[test]
    fn cuda_route_choice_runs_on_the_cpu_standing_in() {
        crate::routes::tests::on_cpu_within(120, "attention's CUDA route choice", || {
            let device = Device::libtorch().autodiff();
            fused_matches_generic(&device, burn::tensor::DType::F32, 1e-5);
            fused_matches_generic(&device, burn::tensor::DType::BF16, 2e-2);
            let used = kernels_used();
            assert!(used.contains(&"cuda-memory-efficient") && used.contains(&"cuda-cudnn"), "{used:?}");
        });
    }

    /// cuDNN SDPA builds a graph per sequence length: a problem that has seen more than
    /// [`choice::CUDNN_MAX_LENGTHS`] lengths moves to flash attention, and stays there; one
    /// length repeated never moves (the choice's logic, on the CPU standing in for CUDA).
    #[test]
    fn many_sequence_lengths_move_a_problem_off_cudnn() {
        crate::routes::tests::on_cpu_within(120, "cuDNN/flash selection", || {
            let p = choice::Problem {
                device: tch::Device::Cpu,
                kind: tch::Kind::BFloat16,
                heads: 6,
                kv_heads: 3,
                head_dim: 24,
                single_token: false,
            };
            for _ in 0..10 {
                assert_eq!(choice::choose_for(p, Some(64)), Some(FusedKernel::CudaCudnn));
            }
            let mut chosen = Vec::new();
            for seq in [65, 66, 67, 68, 64, 69] {
                chosen.push(choice::choose_for(p, Some(seq)).unwrap());
            }
            use FusedKernel::{CudaCudnn as C, CudaFlash as F};
            // Lengths 64..=67 are four; 68 is the fifth (moves); 64 again stays on flash.
            assert_eq!(chosen, [C, C, C, F, F, F]);
            let f32_problem = choice::Problem { kind: tch::Kind::Float, ..p };
            assert_eq!(choice::choose(f32_problem), Some(FusedKernel::CudaEfficient));
        });
    }

    /// A problem of one query and one key (a one-token document, a context-parallel piece of
    /// one token) is never given cuDNN SDPA, whose backward refuses it ("s_q = s_kv = 1 is not
    /// supported": two CUDA tests panicked so on an H200): it is its own problem, flash
    /// attention first, checked at one token; a longer problem of the same heads keeps cuDNN
    /// (the choice's logic, on the CPU standing in for CUDA).
    #[test]
    fn one_token_problems_never_take_cudnn() {
        crate::routes::tests::on_cpu_within(120, "one-token attention problems", || {
            let rand = |h: i64, s: i64| {
                tch::Tensor::randn([1, h, s, 8], (tch::Kind::Float, tch::Device::Cpu)).to_kind(tch::Kind::BFloat16)
            };
            let (q, k, v) = (rand(2, 1), rand(1, 1), rand(1, 1));
            let saved = choice::forward(&q, &k, &v, true).unwrap();
            // One key: the output is that key's value row, for each query head of its group.
            let want = v.expand([1, 2, 1, 8], false).to_kind(tch::Kind::Float);
            let diff = (saved.out.tensor.to_kind(tch::Kind::Float) - &want).abs().max().double_value(&[]);
            assert!(diff < 1e-2, "one-token attention off by {diff}");
            let p = choice::Problem::of(&q, &k).unwrap();
            assert!(p.single_token, "{p:?}");
            assert_eq!(choice::choose_for(p, Some(1)), Some(FusedKernel::CudaFlash));
            let longer = choice::Problem::of(&rand(2, 3), &rand(1, 3)).unwrap();
            assert!(!longer.single_token);
            assert_eq!(choice::choose_for(longer, Some(3)), Some(FusedKernel::CudaCudnn));
        });
    }

    /// On a CUDA device: the kernels chosen for f32 and bf16 (cuDNN or flash with grouped K/V
    /// in bf16) match the generic attention through Burn's autodiff.
    #[test]
    #[ignore = "needs CUDA"]
    fn cuda_fused_matches_generic_forward_and_backward() {
        assert!(tch::Cuda::is_available(), "needs a CUDA device");
        let device = Device::libtorch_cuda(0).autodiff();
        fused_matches_generic(&device, burn::tensor::DType::F32, 1e-3);
        fused_matches_generic(&device, burn::tensor::DType::BF16, 2e-2);
        let used = kernels_used();
        assert!(used.contains(&"cuda-memory-efficient"), "f32 ran on {used:?}");
        assert!(used.contains(&"cuda-cudnn") || used.contains(&"cuda-flash"), "bf16 ran on {used:?}");
    }

    /// On a CUDA device, at a Llama 70B head shape (64 query heads on 8 K/V heads of 128): each
    /// bf16 kernel's verdict is printed, and at least one of cuDNN SDPA and flash attention
    /// passes with grouped K/V as they are.
    #[test]
    #[ignore = "needs CUDA"]
    fn cuda_bf16_kernels_take_grouped_heads() {
        assert!(tch::Cuda::is_available(), "needs a CUDA device");
        let dev = tch::Device::Cuda(0);
        let mut passed = Vec::new();
        for kernel in [FusedKernel::CudaCudnn, FusedKernel::CudaFlash, FusedKernel::CudaEfficient] {
            let verdict = verify(kernel, dev, tch::Kind::BFloat16, 64, 8, 128);
            eprintln!("{}: {verdict:?}", kernel.name());
            if verdict.is_ok() {
                passed.push(kernel);
            }
        }
        assert!(passed.iter().any(|k| matches!(k, FusedKernel::CudaCudnn | FusedKernel::CudaFlash)));
    }

    /// The check passes on the CPU kernel, in f32 and bf16 with grouped K/V, and refuses kernels
    /// that fail: the CUDA kernels have no CPU implementation, so forcing them on CPU tensors
    /// (the flash and cuDNN forwards through the C++ shim) must give an error, not a panic, an
    /// abort or a pass.
    #[test]
    fn self_check_accepts_cpu_and_reports_failures() {
        let _off = crate::routes::on_cpu_for_this_thread(false);
        let cpu = tch::Device::Cpu;
        assert_eq!(verify(FusedKernel::CpuFlash, cpu, tch::Kind::Float, 4, 2, 16), Ok(()));
        assert_eq!(verify(FusedKernel::CpuFlash, cpu, tch::Kind::BFloat16, 4, 2, 16), Ok(()));
        for kernel in [FusedKernel::CudaEfficient, FusedKernel::CudaFlash, FusedKernel::CudaCudnn] {
            let err = verify(kernel, cpu, tch::Kind::BFloat16, 4, 2, 16).unwrap_err();
            eprintln!("{} on the CPU: {}", kernel.name(), err.lines().next().unwrap_or(""));
            assert!(err.starts_with("forward: "), "{}: {err}", kernel.name());
        }
    }

    /// On a CUDA device: packed rows in bf16 through the variable-length kernel (one launch)
    /// equal the per-document route (one fused kernel per span) in value and in all three
    /// input gradients through Burn's autodiff (norm-wise 1e-2: both round to bf16), and the
    /// varlen kernel is the one that ran.
    #[test]
    #[ignore = "needs CUDA"]
    fn cuda_packed_rows_take_the_varlen_kernel() {
        assert!(tch::Cuda::is_available(), "needs a CUDA device");
        packed_rows_take_the_varlen_route(Device::libtorch_cuda(0).autodiff(), tch::Device::Cuda(0));
    }

    /// The same route on the CPU standing in for CUDA: the batch's offsets, the one-launch
    /// autodiff node, its backward, and the per-document route agree.
    #[test]
    fn packed_rows_take_the_varlen_route_on_the_cpu_standing_in() {
        crate::routes::tests::on_cpu_within(120, "packed rows' varlen route", || {
            packed_rows_take_the_varlen_route(Device::libtorch().autodiff(), tch::Device::Cpu);
        });
    }

    fn packed_rows_take_the_varlen_route(device: Device, dev: tch::Device) {
        let _rng = crate::device::torch_rng_lock();
        device.seed(3);
        let packed = PackedRows::new(vec![vec![100, 3, 1, 150], vec![300], vec![7, 200]], 300).unwrap();
        let dtype = burn::tensor::DType::BF16;
        let (b, h, kv, s, hd) = (3, 8, 2, 300, 64);
        let q0 = rand([b, h, s, hd], &device).cast(dtype);
        let k0 = rand([b, kv, s, hd], &device).cast(dtype);
        let v0 = rand([b, kv, s, hd], &device).cast(dtype);
        let w = rand([b, h, s, hd], &device);
        let spans = Arc::new(VarlenSpans::new(&packed, dev).unwrap());
        let run = |varlen: Option<&Arc<VarlenSpans>>| {
            let leaf = |x: &Tensor<4>| x.clone().require_grad();
            let (q, k, v) = (leaf(&q0), leaf(&k0), leaf(&v0));
            let out = packed_causal_attention(q.clone(), k.clone(), v.clone(), &packed, varlen, None);
            let grads = (out.clone().cast(burn::tensor::DType::F32) * w.clone()).sum().backward();
            [out, q.grad(&grads).unwrap(), k.grad(&grads).unwrap(), v.grad(&grads).unwrap()]
                .map(|t| t.cast(burn::tensor::DType::F32))
        };
        let (one_launch, per_span) = (run(Some(&spans)), run(None));
        assert!(kernels_used().contains(&"cuda-flash-varlen"), "{:?}", kernels_used());
        for (name, got, want) in
            ["out", "dq", "dk", "dv"].into_iter().zip(one_launch).zip(per_span).map(|((n, g), w)| (n, g, w))
        {
            let err = (got - want.clone()).powi_scalar(2).sum().sqrt().into_scalar::<f32>();
            let scale = want.powi_scalar(2).sum().sqrt().into_scalar::<f32>();
            assert!(err <= 1e-2 * scale, "{name}: error {err:e} of {scale:e}");
        }
    }

    /// A sliding window on the CPU standing in for CUDA: whole rows and packed documents take
    /// the kernel's window (one launch each) and agree, forward and backward, with the masked
    /// path of Burn's ops (the CUDA routes off), which is independent of the kernel.
    #[test]
    fn sliding_windows_take_the_flash_window_route_on_the_cpu_standing_in() {
        crate::routes::tests::on_cpu_within(120, "the window route", || {
            sliding_windows_take_the_flash_window_route(Device::libtorch().autodiff(), tch::Device::Cpu);
        });
    }

    /// On a CUDA device: as the test above.
    #[test]
    #[ignore = "needs CUDA"]
    fn cuda_sliding_windows_take_the_flash_window_route() {
        assert!(tch::Cuda::is_available(), "needs a CUDA device");
        sliding_windows_take_the_flash_window_route(Device::libtorch_cuda(0).autodiff(), tch::Device::Cuda(0));
    }

    fn sliding_windows_take_the_flash_window_route(device: Device, dev: tch::Device) {
        let _rng = crate::device::torch_rng_lock();
        device.seed(5);
        let packed = PackedRows::new(vec![vec![100, 3, 1, 150], vec![300], vec![7, 200]], 300).unwrap();
        let dtype = burn::tensor::DType::BF16;
        let (b, h, kv, s, hd, window) = (3, 8, 2, 300, 64, 48);
        let q0 = rand([b, h, s, hd], &device).cast(dtype);
        let k0 = rand([b, kv, s, hd], &device).cast(dtype);
        let v0 = rand([b, kv, s, hd], &device).cast(dtype);
        let w = rand([b, h, s, hd], &device);
        let spans = Arc::new(VarlenSpans::new(&packed, dev).unwrap());
        let run = |attend: &dyn Fn(Tensor<4>, Tensor<4>, Tensor<4>) -> Tensor<4>| {
            let leaf = |x: &Tensor<4>| x.clone().require_grad();
            let (q, k, v) = (leaf(&q0), leaf(&k0), leaf(&v0));
            let out = attend(q.clone(), k.clone(), v.clone());
            let grads = (out.clone().cast(burn::tensor::DType::F32) * w.clone()).sum().backward();
            [out, q.grad(&grads).unwrap(), k.grad(&grads).unwrap(), v.grad(&grads).unwrap()]
                .map(|t| t.cast(burn::tensor::DType::F32))
        };
        // The reference for packed rows: every span on the masked path.
        let per_span = |q: Tensor<4>, k: Tensor<4>, v: Tensor<4>| {
            let rows = (0..packed.rows()).map(|r| {
                let spans = packed.spans(r).into_iter().map(|(start, len)| {
                    let cut = |t: &Tensor<4>| t.clone().narrow(0, r, 1).narrow(2, start, len);
                    masked_window_attention(cut(&q), cut(&k), cut(&v), window)
                });
                Tensor::cat(spans.collect(), 2)
            });
            Tensor::cat(rows.collect(), 0)
        };
        let rows = run(&|q, k, v| windowed_causal_attention(q, k, v, Some(window)));
        let rows_want = run(&|q, k, v| masked_window_attention(q, k, v, window));
        let docs = run(&|q, k, v| packed_causal_attention(q, k, v, &packed, Some(&spans), Some(window)));
        let docs_want = run(&per_span);
        assert!(kernels_used().contains(&"cuda-flash-window"), "{:?}", kernels_used());
        let p = problem(&q0, kv).expect("a problem of the CUDA routes");
        assert_eq!(WINDOW_ROUTE.verdict(p), Some(true), "the window route passed its check for {p:?}");
        for (what, got, want) in [("rows", rows, rows_want), ("packed", docs, docs_want)] {
            for (name, got, want) in
                ["out", "dq", "dk", "dv"].into_iter().zip(got).zip(want).map(|((n, g), w)| (n, g, w))
            {
                let err = (got - want.clone()).powi_scalar(2).sum().sqrt().into_scalar::<f32>();
                let scale = want.powi_scalar(2).sum().sqrt().into_scalar::<f32>();
                assert!(err <= 1e-2 * scale, "{what} {name}: error {err:e} of {scale:e}");
            }
        }
    }

    /// On the CPU a window shorter than the row runs on the CPU flash kernel by blocks
    /// (`banded.rs`): its output and every gradient equal the masked path's (Burn's ops on the
    /// whole `seq x seq` scores) within f32 rounding, over grouped K/V heads, windows of 1, 8,
    /// 63 and 129 (one block, a block edge, several blocks, a window past one block), a sequence
    /// that is no multiple of the block, and in bf16 within its rounding.
    #[test]
    fn cpu_windows_on_the_banded_kernel_equal_the_masked_path() {
        let _rng = crate::device::torch_rng_lock();
        let device = Device::libtorch().autodiff();
        device.seed(9);
        let (b, h, kv, s, hd) = (2, 6, 2, 201, 16);
        for (dtype, bound) in [(burn::tensor::DType::F32, 2e-6), (burn::tensor::DType::BF16, 2e-2)] {
            let q0 = rand([b, h, s, hd], &device).cast(dtype);
            let k0 = rand([b, kv, s, hd], &device).cast(dtype);
            let v0 = rand([b, kv, s, hd], &device).cast(dtype);
            let w = rand([b, h, s, hd], &device);
            for window in [1, 8, 63, 129] {
                let run = |masked: bool| {
                    let leaf = |x: &Tensor<4>| x.clone().require_grad();
                    let (q, k, v) = (leaf(&q0), leaf(&k0), leaf(&v0));
                    let attend = || windowed_causal_attention(q.clone(), k.clone(), v.clone(), Some(window));
                    let out = if masked { with_masked_windows(attend) } else { attend() };
                    let grads = (out.clone().cast(burn::tensor::DType::F32) * w.clone()).sum().backward();
                    [out, q.grad(&grads).unwrap(), k.grad(&grads).unwrap(), v.grad(&grads).unwrap()]
                        .map(|t| t.cast(burn::tensor::DType::F32))
                };
                let (got, want) = (run(false), run(true));
                for (name, got, want) in
                    ["out", "dq", "dk", "dv"].into_iter().zip(got).zip(want).map(|((n, g), w)| (n, g, w))
                {
                    let err = (got - want.clone()).powi_scalar(2).sum().sqrt().into_scalar::<f32>();
                    let scale = want.powi_scalar(2).sum().sqrt().into_scalar::<f32>();
                    // A window of 1 makes dq and dk exactly 0 (one key: a constant softmax); the flash
                    // kernel's is the rounding of a difference of equal terms.
                    let zero = window == 1 && (name == "dq" || name == "dk");
                    let ok = if zero { err <= 1e-4 } else { scale > 0.0 && err <= bound * scale };
                    assert!(ok, "{dtype:?} window {window} {name}: {err:e} of {scale:e}");
                }
            }
        }
    }

    /// Hand-checkable case: with one key per query position visible (position 0), the output at
    /// position 0 is v[0] exactly, whatever q and k are.
    #[test]
    fn first_position_sees_only_itself() {
        let device = Device::libtorch();
        let q = rand([1, 2, 5, 8], &device);
        let k = rand([1, 2, 5, 8], &device);
        let v = rand([1, 2, 5, 8], &device);
        let out = causal_attention(q, k, v.clone());
        out.narrow(2, 0, 1)
            .into_data()
            .assert_approx_eq::<f32>(&v.narrow(2, 0, 1).into_data(), Tolerance::absolute(1e-6));
    }
}
