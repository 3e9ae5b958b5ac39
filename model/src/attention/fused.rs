//! LibTorch's fused attention kernels, forward and backward, on tch tensors: what each keeps for
//! its backward, the K/V head handling each needs, and the check of a kernel against plain
//! LibTorch ops.

use std::collections::BTreeSet;
use std::sync::Mutex;

use burn::backend::libtorch::TchTensor;

use super::cuda;

/// A fused LibTorch attention kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FusedKernel {
    /// torch's CPU flash attention (any float dtype; K/V at their own head count).
    CpuFlash,
    /// CUDA memory-efficient attention (f32 too; K/V repeated to Q's head count).
    CudaEfficient,
    /// CUDA flash attention (bf16/f16; K/V at their own head count).
    CudaFlash,
    /// cuDNN SDPA (bf16/f16; K/V at their own head count).
    CudaCudnn,
}

impl FusedKernel {
    /// The name logs and bench JSON use.
    pub fn name(self) -> &'static str {
        match self {
            Self::CpuFlash => "cpu-flash",
            Self::CudaEfficient => "cuda-memory-efficient",
            Self::CudaFlash => "cuda-flash",
            Self::CudaCudnn => "cuda-cudnn",
        }
    }

    /// Whether the kernel takes K/V with fewer heads than Q itself (forward and backward: dK
    /// and dV come back summed over each group, and no repeated copy of K/V exists).
    fn native_gqa(self) -> bool {
        self != Self::CudaEfficient
    }
}

/// A kernel output that its backward takes back and that the kernel may leave undefined: the
/// cumulative sequence lengths of flash / cuDNN for dense (not variable-length) inputs, the
/// philox seed and offset of every CUDA kernel without dropout. `TchTensor::new` reads a
/// tensor's storage, which an undefined tensor lacks (it panics), so an
/// undefined output is kept as `None` and handed back as an undefined tensor.
#[derive(Debug, Clone)]
pub struct MaybeTensor(Option<TchTensor>);

impl MaybeTensor {
    /// Keeps `t`, defined or not.
    pub fn keep(t: tch::Tensor) -> Self {
        Self(t.defined().then(|| TchTensor::new(t)))
    }

    /// The tensor kept (an undefined tensor where the kernel returned one).
    pub fn get(&self) -> tch::Tensor {
        self.0.as_ref().map_or_else(tch::Tensor::new, |t| t.tensor.shallow_clone())
    }
}

/// What a kernel's backward needs besides q, k, v, the output and the log-sum-exp.
#[derive(Debug, Clone)]
pub enum Kept {
    /// CPU flash attention: nothing more.
    Cpu,
    /// Memory-efficient attention: its dropout RNG state (unused with dropout 0, but required).
    Efficient { seed: MaybeTensor, offset: MaybeTensor },
    /// A kernel that runs its own backward (the variable-length flash attention of packed
    /// rows, `varlen.rs`): this file dispatches to it without depending on it.
    Own(std::sync::Arc<dyn OwnBackward>),
    /// Flash attention or cuDNN SDPA.
    Sdpa {
        /// Which of the two.
        flash: bool,
        cum_seq_q: MaybeTensor,
        cum_seq_k: MaybeTensor,
        max_q: i64,
        max_k: i64,
        seed: MaybeTensor,
        offset: MaybeTensor,
    },
}

impl Kept {
    /// What a flash (`flash`) or cuDNN forward keeps for its backward.
    fn sdpa(flash: bool, f: cuda::SdpaForward) -> (TchTensor, TchTensor, Self) {
        let kept = Self::Sdpa {
            flash,
            cum_seq_q: MaybeTensor::keep(f.cum_seq_q),
            cum_seq_k: MaybeTensor::keep(f.cum_seq_k),
            max_q: f.max_q,
            max_k: f.max_k,
            seed: MaybeTensor::keep(f.philox_seed),
            offset: MaybeTensor::keep(f.philox_offset),
        };
        (TchTensor::new(f.out), TchTensor::new(f.logsumexp), kept)
    }
}

/// The backward of a kernel whose state is its own ([`Kept::Own`]).
pub trait OwnBackward: std::fmt::Debug + Send + Sync {
    /// (dq, dk, dv), dk and dv at K/V's head count.
    ///
    /// # Shapes
    /// - grad, out: as q, `[batch, heads, seq, head_dim]`; k, v: `[batch, kv_heads, seq,
    ///   head_dim]`; lse as the forward returned it
    fn backward(
        &self,
        grad: &tch::Tensor,
        qkv: [&tch::Tensor; 3],
        out: &tch::Tensor,
        lse: &tch::Tensor,
        causal: bool,
    ) -> Result<(tch::Tensor, tch::Tensor, tch::Tensor), tch::TchError>;
}

/// What the fused forward keeps for its backward: O(S) per head, never the probabilities.
#[derive(Debug, Clone)]
pub struct Saved {
    /// The attention output (shared with the autodiff node's output; see `mod.rs`).
    pub out: TchTensor,
    /// Row log-sum-exp of the scores.
    pub lse: TchTensor,
    /// Kernel-specific state.
    pub kept: Kept,
}

/// The kernels forwards ran with in this process (bench JSON names them).
static USED: Mutex<BTreeSet<FusedKernel>> = Mutex::new(BTreeSet::new());

/// The fused kernels of this file that attention has run with so far in this process.
pub fn kernels_used() -> Vec<&'static str> {
    USED.lock().unwrap_or_else(|e| e.into_inner()).iter().map(|k| k.name()).collect()
}

/// Repeats each KV head `group` times (a copy: for kernels that take equal head counts).
///
/// # Shapes
/// - x: `[batch, kv_heads, seq, head_dim]`
/// - output: `[batch, kv_heads · group, seq, head_dim]`
fn repeat_heads(x: &tch::Tensor, group: i64) -> tch::Tensor {
    if group == 1 {
        return x.shallow_clone();
    }
    let [b, kv, s, hd] = x.size()[..] else { unreachable!("4-D attention input") };
    x.unsqueeze(2).expand([b, kv, group, s, hd], false).reshape([b, kv * group, s, hd])
}

/// The gradient of [`repeat_heads`]: each KV head's sum over its group.
///
/// # Shapes
/// - g: `[batch, kv_heads · group, seq, head_dim]`
/// - output: `[batch, kv_heads, seq, head_dim]`
fn sum_heads(g: tch::Tensor, group: i64) -> tch::Tensor {
    if group == 1 {
        return g;
    }
    let [b, h, s, hd] = g.size()[..] else { unreachable!("4-D attention gradient") };
    // Summed in f32 (a bf16 sum over the group would round at every add), returned in g's dtype.
    let kind = g.kind();
    g.reshape([b, h / group, group, s, hd]).sum_dim_intlist([2i64].as_slice(), false, tch::Kind::Float).to_kind(kind)
}

/// The dtype the CPU flash kernel gets `x` in: f32 for bf16 where torch has no fast bf16
/// GEMMs (its blocks are GEMMs: 5x slower than f32 on an AVX2-only CPU, see
/// `precision/bf16.rs`); the tensors kept for backward stay bf16.
pub(super) fn cpu_kernel_kind(x: &tch::Tensor) -> tch::Kind {
    crate::precision::bf16::operand_kind(x.kind(), x.device())
}

/// The fused forward with a given kernel (`choice::forward` picks it).
///
/// # Shapes
/// As [`forward`].
pub fn forward_with(
    kernel: FusedKernel,
    q: &tch::Tensor,
    k: &tch::Tensor,
    v: &tch::Tensor,
    causal: bool,
) -> Result<Saved, tch::TchError> {
    USED.lock().unwrap_or_else(|e| e.into_inner()).insert(kernel);
    let group = if kernel.native_gqa() { 1 } else { q.size()[1] / k.size()[1] };
    let (k, v) = (&repeat_heads(k, group), &repeat_heads(v, group));
    let t = TchTensor::new;
    // The CPU standing in for CUDA runs a CUDA kernel's route on its own kernel (K/V as the
    // CUDA kernel gets them); the saved state is the CPU kernel's, so backward runs it too.
    let kernel = if crate::routes::stands_in(q.device()) { FusedKernel::CpuFlash } else { kernel };
    match kernel {
        FusedKernel::CpuFlash => cpu_forward([q, k, v], causal, None),
        FusedKernel::CudaEfficient => {
            let (out, lse, seed, offset) = tch::Tensor::f_internal_scaled_dot_product_efficient_attention(
                q,
                k,
                v,
                None::<tch::Tensor>,
                true,
                0.0,
                causal,
                None,
            )?;
            let kept = Kept::Efficient { seed: MaybeTensor::keep(seed), offset: MaybeTensor::keep(offset) };
            Ok(Saved { out: t(out), lse: t(lse), kept })
        }
        FusedKernel::CudaFlash | FusedKernel::CudaCudnn => {
            let flash = kernel == FusedKernel::CudaFlash;
            let (out, lse, kept) = Kept::sdpa(flash, cuda::sdpa_forward(flash, q, k, v, causal)?);
            Ok(Saved { out, lse, kept })
        }
    }
}

/// The fused backward of the kernel that made `saved`: (dq, dk, dv), dk and dv at K/V's head
/// count (for a kernel without native GQA, K and V repeated again here and their gradients
/// summed over each group).
///
/// # Shapes
/// - grad: as the output, `[batch, heads, seq, head_dim]`; q, k, v as in [`forward`]
pub fn backward(
    grad: &tch::Tensor,
    q: &tch::Tensor,
    k: &tch::Tensor,
    v: &tch::Tensor,
    saved: &Saved,
    causal: bool,
) -> Result<(tch::Tensor, tch::Tensor, tch::Tensor), tch::TchError> {
    let out = &saved.out.tensor;
    let lse = &saved.lse.tensor;
    // The kernels assume a dense gradient laid out like their output; upstream reshapes can
    // hand it a strided view.
    let grad = if grad.stride() == out.stride() {
        grad.shallow_clone()
    } else {
        let mut g = out.empty_like();
        g.copy_(grad);
        g
    };
    match &saved.kept {
        Kept::Cpu => cpu_backward(&grad, [q, k, v], out, lse, causal, None),
        Kept::Own(kept) => kept.backward(&grad, [q, k, v], out, lse, causal),
        Kept::Efficient { seed, offset } => efficient_backward(&grad, [q, k, v], out, lse, causal, [seed, offset]),
        Kept::Sdpa { flash: true, cum_seq_q, cum_seq_k, max_q, max_k, seed, offset } => {
            tch::Tensor::f_internal_scaled_dot_product_flash_attention_backward(
                &grad,
                q,
                k,
                v,
                out,
                lse,
                &cum_seq_q.get(),
                &cum_seq_k.get(),
                *max_q,
                *max_k,
                0.0,
                causal,
                &seed.get(),
                &offset.get(),
                None,
            )
        }
        Kept::Sdpa { flash: false, cum_seq_q, cum_seq_k, max_q, max_k, seed, offset } => {
            tch::Tensor::f_internal_scaled_dot_product_cudnn_attention_backward(
                &grad,
                q,
                k,
                v,
                out,
                lse,
                &seed.get(),
                &offset.get(),
                &tch::Tensor::new(), // no attention bias: an undefined tensor
                &cum_seq_q.get(),
                &cum_seq_k.get(),
                *max_q,
                *max_k,
                0.0,
                causal,
                None,
            )
        }
    }
}

/// The fused backward that ran: (dq, dk, dv).
pub(super) type Grads = Result<(tch::Tensor, tch::Tensor, tch::Tensor), tch::TchError>;

/// torch's CPU flash attention, forward (in its compute kind; output in q's kind), with an
/// additive `mask` (0 or -inf, in the compute kind: [`cpu_kernel_kind`]) if given.
///
/// # Shapes
/// - q: `[batch, heads, seq, head_dim]`; k, v: `[batch, kv_heads, seq, head_dim]`
/// - mask: broadcast to `[batch, heads, seq, seq]`
pub(super) fn cpu_forward(
    [q, k, v]: [&tch::Tensor; 3],
    causal: bool,
    mask: Option<&tch::Tensor>,
) -> Result<Saved, tch::TchError> {
    let f = |x: &tch::Tensor| x.to_kind(cpu_kernel_kind(x));
    let (out, lse) = tch::Tensor::f_internal_scaled_dot_product_flash_attention_for_cpu(
        &f(q),
        &f(k),
        &f(v),
        0.0,
        causal,
        mask,
        None,
    )?;
    Ok(Saved { out: TchTensor::new(out.to_kind(q.kind())), lse: TchTensor::new(lse), kept: Kept::Cpu })
}

/// [`backward`] of the CPU flash kernel (in its compute kind; gradients in the inputs' kinds),
/// under the `mask` its forward had ([`cpu_forward`]).
pub(super) fn cpu_backward(
    grad: &tch::Tensor,
    [q, k, v]: [&tch::Tensor; 3],
    out: &tch::Tensor,
    lse: &tch::Tensor,
    causal: bool,
    mask: Option<&tch::Tensor>,
) -> Grads {
    let f = |x: &tch::Tensor| x.to_kind(cpu_kernel_kind(x));
    let (dq, dk, dv) = tch::Tensor::f_internal_scaled_dot_product_flash_attention_for_cpu_backward(
        &f(grad),
        &f(q),
        &f(k),
        &f(v),
        &f(out),
        lse,
        0.0,
        causal,
        mask,
        None,
    )?;
    Ok((dq.to_kind(q.kind()), dk.to_kind(k.kind()), dv.to_kind(v.kind())))
}

/// [`backward`] of CUDA's memory-efficient kernel, which has no native GQA: K and V repeated
/// to the query heads again and their gradients summed over each group.
fn efficient_backward(
    grad: &tch::Tensor,
    [q, k, v]: [&tch::Tensor; 3],
    out: &tch::Tensor,
    lse: &tch::Tensor,
    causal: bool,
    [seed, offset]: [&MaybeTensor; 2],
) -> Grads {
    let group = q.size()[1] / k.size()[1];
    let (k, v) = (&repeat_heads(k, group), &repeat_heads(v, group));
    // What torch's `_scaled_dot_product_efficient_attention_backward_cuda` does: the
    // kernel works in [batch, seq, heads, head_dim]; mask type 1 = causal from top left.
    let t = |x: &tch::Tensor| x.transpose(1, 2);
    let (s_q, s_k) = (q.size()[2], k.size()[2]);
    let (dq, dk, dv, _) = tch::Tensor::f_internal_efficient_attention_backward(
        &t(grad),
        &t(q),
        &t(k),
        &t(v),
        None::<&tch::Tensor>,
        &t(out),
        None::<&tch::Tensor>,
        None::<&tch::Tensor>,
        s_q,
        s_k,
        lse,
        0.0,
        &seed.get(),
        &offset.get(),
        i64::from(causal),
        false,
        None,
        None,
        None,
        false,
    )?;
    Ok((t(&dq), sum_heads(t(&dk), group), sum_heads(t(&dv), group)))
}

/// Checks `kernel`'s forward and backward on `device` against plain LibTorch ops (f32 matmul,
/// softmax, autograd on the same rounded inputs) for a random problem with these head counts,
/// causal and not: in f32 an error under 1e-3 of the largest value; in bf16/f16 a norm-wise
/// relative error ‖got − want‖/‖want‖ under 1e-2 (bf16 outputs round every value, and the
/// largest single error of a gradient summed over 133 positions reached 2.0e-2 of its largest
/// value on random inputs now and then: a flaky check).
pub fn verify(
    kernel: FusedKernel,
    device: tch::Device,
    kind: tch::Kind,
    heads: i64,
    kv_heads: i64,
    head_dim: i64,
) -> Result<(), String> {
    // More than one 128-row block, and a length no kernel's tiling divides.
    verify_at(kernel, device, kind, [heads, kv_heads, head_dim], 133)
}

/// [`verify`] on sequences of `s` tokens (one: the problem of a single query and key).
pub(super) fn verify_at(
    kernel: FusedKernel,
    device: tch::Device,
    kind: tch::Kind,
    [heads, kv_heads, head_dim]: [i64; 3],
    s: i64,
) -> Result<(), String> {
    let _guard = tch::no_grad_guard();
    let b = 2;
    let rand = |h: i64| {
        tch::Tensor::f_randn([b, h, s, head_dim], (tch::Kind::Float, device))
            .and_then(|x| x.f_to_kind(kind))
            .map_err(|e| format!("inputs: {e}"))
    };
    for causal in [true, false] {
        let (q, k, v, w) = (rand(heads)?, rand(kv_heads)?, rand(kv_heads)?, rand(heads)?);
        let saved = forward_with(kernel, &q, &k, &v, causal).map_err(|e| format!("forward: {e}"))?;
        let (dq, dk, dv) = backward(&w, &q, &k, &v, &saved, causal).map_err(|e| format!("backward: {e}"))?;
        let mask = causal.then(|| tch::Tensor::ones([s, s], (tch::Kind::Bool, device)).triu(1));
        check_against_reference([&q, &k, &v, &w], mask.as_ref(), [&saved.out.tensor, &dq, &dk, &dv])
            .map_err(|e| format!("{e} (causal {causal})"))?;
    }
    Ok(())
}

/// Compares a kernel's output and input gradients (`got`: out, dq, dk, dv) with plain LibTorch
/// on the same (rounded) inputs: f32 autograd of `softmax(q·kᵀ/√hd, masked)·v` under the
/// upstream gradient `w` (the gradient of Σ out·w). In f32 the largest error must stay under
/// 1e-3 of the largest value, in bf16/f16 the norm-wise relative error under 1e-2; a tensor
/// whose values are near zero is measured against a thousandth of the output's scale instead
/// (with one key, dq and dk are zero in exact arithmetic: a kernel's rounding noise is no
/// relative error of 100%).
///
/// # Shapes
/// - inputs: q, k, v, w; q and w `[batch, heads, seq, head_dim]`, k and v `[batch, kv_heads,
///   seq, head_dim]`
/// - mask: broadcast to `[batch, heads, seq, seq]`, true where a query may not see a key
/// - got: shaped as q, q, k, v
pub(super) fn check_against_reference(
    [q, k, v, w]: [&tch::Tensor; 4],
    mask: Option<&tch::Tensor>,
    got: [&tch::Tensor; 4],
) -> Result<(), String> {
    let kind = q.kind();
    let tol = if kind == tch::Kind::Float { 1e-3 } else { 1e-2 };
    let (heads, kv_heads, head_dim) = (q.size()[1], k.size()[1], q.size()[3]);
    tch::with_grad(|| {
        let leaf = |x: &tch::Tensor| x.to_kind(tch::Kind::Float).requires_grad_(true);
        let (qr, kr, vr) = (leaf(q), leaf(k), leaf(v));
        let group = heads / kv_heads;
        let (ke, ve) = (repeat_heads(&kr, group), repeat_heads(&vr, group));
        let mut scores = qr.matmul(&ke.transpose(-2, -1)) / (head_dim as f64).sqrt();
        if let Some(mask) = mask {
            scores = scores.masked_fill(mask, f64::NEG_INFINITY);
        }
        let out = scores.softmax(-1, tch::Kind::Float).matmul(&ve);
        (&out * w.to_kind(tch::Kind::Float)).sum(tch::Kind::Float).backward();
        let want = [out, qr.grad(), kr.grad(), vr.grad()];
        // max in f32, norm in bf16/f16
        let size = |x: &tch::Tensor| {
            if kind == tch::Kind::Float { x.abs().max().double_value(&[]) } else { x.norm().double_value(&[]) }
        };
        let floor = (1e-3 * size(&want[0])).max(1e-6);
        for ((name, got), want) in ["output", "dq", "dk", "dv"].into_iter().zip(got).zip(&want) {
            if got.size() != want.size() {
                return Err(format!("{name} has shape {:?}, expected {:?}", got.size(), want.size()));
            }
            let (err, scale) = (size(&(got.to_kind(tch::Kind::Float) - want)), size(want).max(floor));
            let close = err / scale < tol; // false for NaN, which must count as a mismatch
            if !close {
                return Err(format!("{name} differs: error {err:.3e} against {scale:.3e} (max in f32, norm in bf16)"));
            }
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A problem of one query and one key: dq and dk are zero in exact arithmetic, so a
    /// kernel's rounding noise (1e-7) passes the check, which the memory-efficient kernel's
    /// did not on an H200 (measured against zero: no kernel was left for a context-parallel
    /// piece of one token); a wrong gradient still fails it.
    #[test]
    fn one_token_rounding_noise_passes_and_a_wrong_gradient_fails() {
        let _lock = crate::device::torch_rng_lock();
        tch::manual_seed(3);
        let randn = |h: i64| tch::Tensor::randn([2, h, 1, 8], (tch::Kind::Float, tch::Device::Cpu));
        let (q, k, v, w) = (randn(4), randn(2), randn(2), randn(4));
        let saved = forward_with(FusedKernel::CpuFlash, &q, &k, &v, true).unwrap();
        let (dq, dk, dv) = backward(&w, &q, &k, &v, &saved, true).unwrap();
        let mask = tch::Tensor::ones([1, 1], (tch::Kind::Bool, tch::Device::Cpu)).triu(1);
        let noisy = |x: &tch::Tensor, a: f64| x + x.randn_like() * a;
        let check = |dq: &tch::Tensor, dk: &tch::Tensor| {
            check_against_reference([&q, &k, &v, &w], Some(&mask), [&saved.out.tensor, dq, dk, &dv])
        };
        assert_eq!(check(&noisy(&dq, 1e-7), &noisy(&dk, 1e-7)), Ok(()));
        let wrong = check(&noisy(&dq, 1e-1), &dk).unwrap_err();
        assert!(wrong.starts_with("dq differs"), "{wrong}");
    }

    /// What cuDNN and flash attention return for dense inputs without dropout: no cumulative
    /// lengths and no philox state (undefined tensors). The saved state keeps them as undefined
    /// (cloned as the autodiff node clones it), hands them back undefined, and the backward is
    /// reached: on the CPU, where the CUDA kernels do not exist, it fails with an error rather
    /// than a panic in `TchTensor::new`.
    #[test]
    fn undefined_kernel_outputs_stay_undefined_through_the_saved_state() {
        let (b, h, s, hd) = (1, 2, 8, 16);
        let opts = (tch::Kind::Float, tch::Device::Cpu);
        let q = tch::Tensor::randn([b, h, s, hd], opts);
        for flash in [true, false] {
            let f = cuda::SdpaForward {
                out: q.copy(),
                logsumexp: tch::Tensor::zeros([b, h, s], opts),
                cum_seq_q: tch::Tensor::new(),
                cum_seq_k: tch::Tensor::new(),
                max_q: s,
                max_k: s,
                philox_seed: tch::Tensor::new(),
                philox_offset: tch::Tensor::new(),
            };
            let (out, lse, kept) = Kept::sdpa(flash, f);
            let saved = Saved { out, lse, kept }.clone();
            let Kept::Sdpa { cum_seq_q, cum_seq_k, seed, offset, max_q, .. } = &saved.kept else {
                panic!("an SDPA state")
            };
            for t in [cum_seq_q, cum_seq_k, seed, offset] {
                assert!(t.0.is_none() && !t.get().defined());
            }
            assert_eq!(*max_q, s);
            let err = backward(&q, &q, &q, &q, &saved, true).unwrap_err();
            eprintln!("flash {flash} backward on the CPU: {}", err.to_string().lines().next().unwrap_or(""));
        }
        // A defined output comes back as the same tensor.
        let t = tch::Tensor::from_slice(&[3i64, 5]);
        let kept = MaybeTensor::keep(t.shallow_clone());
        assert!(kept.0.is_some());
        assert_eq!(Vec::<i64>::try_from(&kept.get()).unwrap(), vec![3, 5]);
    }
}
