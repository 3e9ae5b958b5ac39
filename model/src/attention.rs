//! Scaled-dot-product attention with grouped-query heads, fused where LibTorch has it.
//!
//! Burn 0.22.1's autodiff attention is the naive path: it builds the `S×S` score matrix and
//! keeps it for backward (17 GB in f32 for one Llama 2 70B layer at 8192 tokens). On LibTorch
//! devices llora instead calls LibTorch's fused kernels and their backward through a Burn
//! backend extension with a hand-written autodiff node, so training memory grows with `S`, not
//! `S²`: flash attention on the CPU, memory-efficient attention on CUDA (it takes f32, unlike
//! CUDA flash attention). Other devices take Burn's generic attention (correct, but quadratic).
//!
//! The CUDA path cannot be tested on this project's machines, so the first use on a CUDA
//! device checks it against a plain LibTorch computation (forward and all three gradients,
//! causal and not) and falls back to the generic kernel, with a warning, if they differ.

use std::sync::OnceLock;

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::libtorch::TchTensor;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, Dispatch, DispatchDevice, LibTorch, LibTorchDevice, backend_extension};
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{Device, Tensor};

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

/// Which attention implementation runs on a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionKernel {
    /// LibTorch's fused kernel with its own backward (memory O(S)): flash attention on the
    /// CPU, memory-efficient attention on CUDA.
    TorchFused,
    /// Burn's generic attention (autodiff keeps the `S×S` scores).
    Generic,
}

impl AttentionKernel {
    /// The kernel [`attention`] uses for tensors on `device`.
    pub fn for_device(device: &Device) -> Self {
        match device.clone().inner().as_dispatch() {
            DispatchDevice::LibTorch(LibTorchDevice::Cpu) => Self::TorchFused,
            DispatchDevice::LibTorch(LibTorchDevice::Cuda(n)) if cuda_fused_verified(*n) => Self::TorchFused,
            _ => Self::Generic,
        }
    }
}

/// Whether the fused CUDA kernels agree with plain LibTorch on CUDA device `n` (checked once
/// per process; see the module docs).
fn cuda_fused_verified(n: usize) -> bool {
    static VERIFIED: OnceLock<bool> = OnceLock::new();
    *VERIFIED.get_or_init(|| {
        let ok = verify_fused(tch::Device::Cuda(n));
        match &ok {
            Ok(()) => tracing::info!(
                device = n,
                "fused CUDA attention (memory-efficient kernel) verified against plain LibTorch"
            ),
            Err(e) => {
                tracing::warn!(device = n, "fused CUDA attention disabled, using the generic O(S²) attention: {e}")
            }
        }
        ok.is_ok()
    })
}

/// `softmax(q·kᵀ/√hd [+ causal mask])·v`, query head h attending to KV head h / (H/KV).
///
/// # Shapes
/// - q: `[batch, heads, seq, head_dim]`
/// - k, v: `[batch, kv_heads, seq, head_dim]`
/// - output: `[batch, heads, seq, head_dim]`
pub fn attention(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>, causal: bool) -> Tensor<4> {
    let kernel = AttentionKernel::for_device(&q.device());
    attention_with(kernel, q, k, v, causal)
}

/// Causal [`attention`], as a decoder uses it.
///
/// # Shapes
/// As [`attention`].
pub fn causal_attention(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>) -> Tensor<4> {
    attention(q, k, v, true)
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
}

/// Repeats each KV head `group` times (a copy: the kernels take equal head counts).
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

/// What the fused forward keeps for its backward: O(S) per head, never the probabilities.
#[derive(Debug)]
struct Saved {
    out: tch::Tensor,
    /// Row log-sum-exp of the scores.
    lse: tch::Tensor,
    /// CUDA only: the kernel's dropout RNG state (unused with dropout 0, but required).
    philox: Option<(tch::Tensor, tch::Tensor)>,
}

/// Whether the device's kernel takes K/V with fewer heads than Q itself. torch's CPU flash
/// attention does (forward and backward: dK and dV accumulate over each group in f32 inside the
/// kernel, and no repeated copy of K/V exists); CUDA's memory-efficient kernel does not.
fn native_gqa(device: tch::Device) -> bool {
    !device.is_cuda()
}

/// LibTorch's fused forward for the tensors' device.
fn torch_forward(q: &tch::Tensor, k: &tch::Tensor, v: &tch::Tensor, causal: bool) -> Result<Saved, tch::TchError> {
    let group = if native_gqa(q.device()) { 1 } else { q.size()[1] / k.size()[1] };
    let (k, v) = (&repeat_heads(k, group), &repeat_heads(v, group));
    if q.device().is_cuda() {
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
        Ok(Saved { out, lse, philox: Some((seed, offset)) })
    } else {
        let f = |x: &tch::Tensor| x.to_kind(cpu_kernel_kind(x));
        let (out, lse) = tch::Tensor::f_internal_scaled_dot_product_flash_attention_for_cpu(
            &f(q),
            &f(k),
            &f(v),
            0.0,
            causal,
            None::<tch::Tensor>,
            None,
        )?;
        Ok(Saved { out: out.to_kind(q.kind()), lse, philox: None })
    }
}

/// The dtype the CPU flash kernel gets `x` in: f32 for bf16 where torch has no fast bf16
/// GEMMs (its blocks are GEMMs: 5x slower than f32 on an AVX2-only CPU, see
/// `precision/bf16.rs`); the tensors kept for backward stay bf16.
fn cpu_kernel_kind(x: &tch::Tensor) -> tch::Kind {
    if x.kind() == tch::Kind::BFloat16 && !crate::precision::bf16::native_on_this_cpu() {
        tch::Kind::Float
    } else {
        x.kind()
    }
}

/// LibTorch's fused backward: (dq, dk, dv) for the upstream gradient `grad`, dk and dv at
/// K/V's head count (K and V repeated again here, their gradients summed over each group).
fn torch_backward(
    grad: &tch::Tensor,
    q: &tch::Tensor,
    k: &tch::Tensor,
    v: &tch::Tensor,
    saved: &Saved,
    causal: bool,
) -> Result<(tch::Tensor, tch::Tensor, tch::Tensor), tch::TchError> {
    let group = if native_gqa(q.device()) { 1 } else { q.size()[1] / k.size()[1] };
    let (k, v) = (repeat_heads(k, group), repeat_heads(v, group));
    let (dq, dk, dv) = equal_heads_backward(grad, q, &k, &v, saved, causal)?;
    Ok((dq, sum_heads(dk, group), sum_heads(dv, group)))
}

/// [`torch_backward`] for the head counts the kernel takes.
fn equal_heads_backward(
    grad: &tch::Tensor,
    q: &tch::Tensor,
    k: &tch::Tensor,
    v: &tch::Tensor,
    saved: &Saved,
    causal: bool,
) -> Result<(tch::Tensor, tch::Tensor, tch::Tensor), tch::TchError> {
    // The kernels assume a dense gradient; upstream reshapes can hand it a strided view.
    let grad = grad.contiguous();
    match &saved.philox {
        Some((seed, offset)) => {
            // What torch's `_scaled_dot_product_efficient_attention_backward_cuda` does: the
            // kernel works in [batch, seq, heads, head_dim]; mask type 1 = causal from top left.
            let t = |x: &tch::Tensor| x.transpose(1, 2);
            let (s_q, s_k) = (q.size()[2], k.size()[2]);
            let (dq, dk, dv, _) = tch::Tensor::f_internal_efficient_attention_backward(
                &t(&grad),
                &t(q),
                &t(k),
                &t(v),
                None::<&tch::Tensor>,
                &t(&saved.out),
                None::<&tch::Tensor>,
                None::<&tch::Tensor>,
                s_q,
                s_k,
                &saved.lse,
                0.0,
                seed,
                offset,
                i64::from(causal),
                false,
                None,
                None,
                None,
                false,
            )?;
            Ok((t(&dq), t(&dk), t(&dv)))
        }
        None => {
            let f = |x: &tch::Tensor| x.to_kind(cpu_kernel_kind(x));
            let (dq, dk, dv) = tch::Tensor::f_internal_scaled_dot_product_flash_attention_for_cpu_backward(
                &f(&grad),
                &f(q),
                &f(k),
                &f(v),
                &f(&saved.out),
                &saved.lse,
                0.0,
                causal,
                None::<tch::Tensor>,
                None,
            )?;
            Ok((dq.to_kind(q.kind()), dk.to_kind(k.kind()), dv.to_kind(v.kind())))
        }
    }
}

/// Checks the fused forward and backward on `device` against plain LibTorch ops (matmul,
/// softmax, autograd) on a small random problem, causal and not.
pub fn verify_fused(device: tch::Device) -> Result<(), String> {
    let _guard = tch::no_grad_guard();
    let opts = (tch::Kind::Float, device);
    let (b, h, s, hd) = (2, 3, 37, 16);
    for causal in [true, false] {
        let q = tch::Tensor::f_randn([b, h, s, hd], opts).map_err(|e| e.to_string())?;
        let k = tch::Tensor::randn([b, h, s, hd], opts);
        let v = tch::Tensor::randn([b, h, s, hd], opts);
        let w = tch::Tensor::randn([b, h, s, hd], opts);
        let saved = torch_forward(&q, &k, &v, causal).map_err(|e| format!("forward: {e}"))?;
        let (dq, dk, dv) = torch_backward(&w, &q, &k, &v, &saved, causal).map_err(|e| format!("backward: {e}"))?;
        // The reference, with autograd.
        tch::with_grad(|| {
            let (qr, kr, vr) =
                (q.detach().requires_grad_(true), k.detach().requires_grad_(true), v.detach().requires_grad_(true));
            let mut scores = qr.matmul(&kr.transpose(-2, -1)) / (hd as f64).sqrt();
            if causal {
                let mask = tch::Tensor::ones([s, s], (tch::Kind::Bool, device)).triu(1);
                scores = scores.masked_fill(&mask, f64::NEG_INFINITY);
            }
            let out = scores.softmax(-1, tch::Kind::Float).matmul(&vr);
            (&out * &w).sum(tch::Kind::Float).backward();
            for (name, got, want) in [
                ("output", &saved.out, &out),
                ("dq", &dq, &qr.grad()),
                ("dk", &dk, &kr.grad()),
                ("dv", &dv, &vr.grad()),
            ] {
                let err = (got - want).abs().max().double_value(&[]);
                let scale = want.abs().max().double_value(&[]).max(1e-6);
                let close = err / scale < 1e-3; // false for NaN, which must count as a mismatch
                if !close {
                    return Err(format!(
                        "{name} differs (causal {causal}): max |error| {err:.3e} against max |value| {scale:.3e}"
                    ));
                }
            }
            Ok(())
        })?;
    }
    Ok(())
}

impl FusedAttentionBackend for LibTorch {
    fn fused_attention(q: TchTensor, k: TchTensor, v: TchTensor, causal: bool) -> TchTensor {
        TchTensor::new(torch_forward(&q.tensor, &k.tensor, &v.tensor, causal).expect("fused attention forward").out)
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
    /// Shares its storage with the node's output (see `fused_attention`).
    out: TchTensor,
    lse: TchTensor,
    philox: Option<(TchTensor, TchTensor)>,
    causal: bool,
}

impl Backward<LibTorch, 3> for FusedAttentionBackward {
    type State = FusedState;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [node_q, node_k, node_v] = ops.parents;
        let grad = grads.consume::<LibTorch>(&ops.node);
        let st = ops.state;
        let saved = Saved {
            out: st.out.tensor.shallow_clone(),
            lse: st.lse.tensor.shallow_clone(),
            philox: st.philox.as_ref().map(|(a, b)| (a.tensor.shallow_clone(), b.tensor.shallow_clone())),
        };
        let (dq, dk, dv) = torch_backward(&grad.tensor, &st.q.tensor, &st.k.tensor, &st.v.tensor, &saved, st.causal)
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
        // Node handles first: `into_primitive` consumes the autodiff tensors.
        let nodes = [q.node(), k.node(), v.node()];
        match FusedAttentionBackward.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let (q, k, v) = (q.into_primitive(), k.into_primitive(), v.into_primitive());
                let saved = torch_forward(&q.tensor, &k.tensor, &v.tensor, causal).expect("fused attention forward");
                // One TchTensor shared by the state and the output: burn-tch writes in place
                // into tensors whose storage it believes unique, so two wrappers of the same
                // storage could see each other's in-place updates.
                let out = TchTensor::new(saved.out);
                let philox = saved.philox.map(|(a, b)| (TchTensor::new(a), TchTensor::new(b)));
                let state = FusedState { q, k, v, out: out.clone(), lse: TchTensor::new(saved.lse), philox, causal };
                prep.finish(state, out)
            }
            OpsKind::UnTracked(prep) => {
                let (q, k, v) = (q.into_primitive(), k.into_primitive(), v.into_primitive());
                prep.finish(TchTensor::new(
                    torch_forward(&q.tensor, &k.tensor, &v.tensor, causal).expect("fused attention forward").out,
                ))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Distribution, Tolerance};

    fn rand(shape: [usize; 4], device: &Device) -> Tensor<4> {
        Tensor::random(shape, Distribution::Normal(0.0, 1.0), device)
    }

    /// Fused and generic attention agree in value and in all three input gradients, with GQA,
    /// causal and not.
    #[test]
    fn fused_matches_generic_forward_and_backward() {
        let device = Device::libtorch().autodiff();
        device.seed(7);
        let (b, h, kv, s, hd) = (2, 4, 2, 33, 16);
        let q0 = rand([b, h, s, hd], &device);
        let k0 = rand([b, kv, s, hd], &device);
        let v0 = rand([b, kv, s, hd], &device);
        let w = rand([b, h, s, hd], &device); // a random upstream gradient via Σ(out·w)
        for causal in [true, false] {
            let run = |kernel| {
                let (q, k, v) = (q0.clone().require_grad(), k0.clone().require_grad(), v0.clone().require_grad());
                let out = attention_with(kernel, q.clone(), k.clone(), v.clone(), causal);
                let grads = (out.clone() * w.clone()).sum().backward();
                (out, q.grad(&grads).unwrap(), k.grad(&grads).unwrap(), v.grad(&grads).unwrap())
            };
            let fused = run(AttentionKernel::TorchFused);
            let generic = run(AttentionKernel::Generic);
            let tol = Tolerance::<f32>::relative(1e-4).set_absolute(1e-5);
            fused.0.into_data().assert_approx_eq::<f32>(&generic.0.into_data(), tol);
            fused.1.into_data().assert_approx_eq::<f32>(&generic.1.into_data(), tol);
            fused.2.into_data().assert_approx_eq::<f32>(&generic.2.into_data(), tol);
            fused.3.into_data().assert_approx_eq::<f32>(&generic.3.into_data(), tol);
        }
        // Non-causal attention really differs from causal (the flag reaches the kernel).
        let c = attention_with(AttentionKernel::TorchFused, q0.clone(), k0.clone(), v0.clone(), true);
        let n = attention_with(AttentionKernel::TorchFused, q0, k0, v0, false);
        assert!((c - n).abs().max().into_scalar::<f32>() > 1e-2);
    }

    /// The start-up self-check passes on the CPU kernels and refuses kernels that fail: the
    /// CUDA memory-efficient kernel has no CPU implementation, so forcing its path on CPU
    /// tensors must give an error, not a panic or a pass.
    #[test]
    fn self_check_accepts_cpu_and_reports_failures() {
        assert_eq!(verify_fused(tch::Device::Cpu), Ok(()));
        let q = tch::Tensor::randn([1, 1, 4, 8], (tch::Kind::Float, tch::Device::Cpu));
        let r = tch::Tensor::f_internal_scaled_dot_product_efficient_attention(
            &q,
            &q,
            &q,
            None::<tch::Tensor>,
            true,
            0.0,
            true,
            None,
        );
        assert!(r.is_err(), "the CUDA kernel unexpectedly ran on the CPU");
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
