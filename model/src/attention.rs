//! Causal scaled-dot-product attention with grouped-query heads, fused where LibTorch has it.
//!
//! Burn 0.22.1's autodiff attention is the naive path: it builds the `S×S` score matrix and
//! keeps it for backward (17 GB in f32 for one Llama 2 70B layer at 8192 tokens). On the
//! LibTorch CPU device llora instead calls LibTorch's flash-attention kernel and its backward
//! through a Burn backend extension with a hand-written autodiff node, so training memory grows
//! with `S`, not `S²`. Other devices take Burn's generic attention (correct, but quadratic).

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
    /// LibTorch's CPU flash attention with its own backward (memory O(S)).
    TorchFlashCpu,
    /// Burn's generic attention (autodiff keeps the `S×S` scores).
    Generic,
}

impl AttentionKernel {
    /// The kernel [`causal_attention`] uses for tensors on `device`.
    pub fn for_device(device: &Device) -> Self {
        match device.clone().inner().as_dispatch() {
            DispatchDevice::LibTorch(LibTorchDevice::Cpu) => Self::TorchFlashCpu,
            _ => Self::Generic,
        }
    }
}

/// `softmax(q·kᵀ/√hd + causal mask)·v`, query head h attending to KV head h / (H/KV).
///
/// # Shapes
/// - q: `[batch, heads, seq, head_dim]`
/// - k, v: `[batch, kv_heads, seq, head_dim]`
/// - output: `[batch, heads, seq, head_dim]`
pub fn causal_attention(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>) -> Tensor<4> {
    let kernel = AttentionKernel::for_device(&q.device());
    causal_attention_with(kernel, q, k, v)
}

/// [`causal_attention`] with an explicit kernel (tests compare the two).
///
/// # Shapes
/// As [`causal_attention`].
pub fn causal_attention_with(kernel: AttentionKernel, q: Tensor<4>, k: Tensor<4>, v: Tensor<4>) -> Tensor<4> {
    let group = q.dims()[1] / k.dims()[1];
    let k = repeat_kv(k, group);
    let v = repeat_kv(v, group);
    match kernel {
        AttentionKernel::TorchFlashCpu => Tensor::from_dispatch(<Dispatch as FusedAttentionBackend>::causal_flash_attention(
            q.into_dispatch(),
            k.into_dispatch(),
            v.into_dispatch(),
        )),
        AttentionKernel::Generic => {
            let options = AttentionModuleOptions { scale: None, softcap: None, is_causal: true };
            burn::tensor::module::attention(q, k, v, None, None, options)
        }
    }
}

/// Backend extension: fused causal attention where the backend has a kernel for it.
#[backend_extension(Autodiff, LibTorch)]
pub trait FusedAttentionBackend: Backend {
    /// Causal attention over equal head counts, scale 1/√hd.
    fn causal_flash_attention(q: FloatTensor<Self>, k: FloatTensor<Self>, v: FloatTensor<Self>) -> FloatTensor<Self>;
}

/// LibTorch's CPU flash-attention forward: (output, logsumexp).
fn torch_flash_forward(q: &tch::Tensor, k: &tch::Tensor, v: &tch::Tensor) -> (tch::Tensor, tch::Tensor) {
    tch::Tensor::internal_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, true, None::<tch::Tensor>, None)
}

impl FusedAttentionBackend for LibTorch {
    fn causal_flash_attention(q: TchTensor, k: TchTensor, v: TchTensor) -> TchTensor {
        TchTensor::new(torch_flash_forward(&q.tensor, &k.tensor, &v.tensor).0)
    }
}

/// Autodiff node of the fused attention: keeps q, k, v, the output and the logsumexp
/// (O(S) per head) instead of the probabilities (O(S²)), and calls LibTorch's backward kernel.
#[derive(Debug)]
struct FlashAttentionBackward;

impl Backward<LibTorch, 3> for FlashAttentionBackward {
    type State = (TchTensor, TchTensor, TchTensor, TchTensor, TchTensor);

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [node_q, node_k, node_v] = ops.parents;
        let grad = grads.consume::<LibTorch>(&ops.node);
        let (q, k, v, out, lse) = ops.state;
        // The kernel assumes a dense gradient; upstream reshapes can hand it a strided view.
        let grad = grad.tensor.contiguous();
        let (dq, dk, dv) = tch::Tensor::internal_scaled_dot_product_flash_attention_for_cpu_backward(
            &grad,
            &q.tensor,
            &k.tensor,
            &v.tensor,
            &out.tensor,
            &lse.tensor,
            0.0,
            true,
            None::<tch::Tensor>,
            None,
        );
        for (node, g) in [(node_q, dq), (node_k, dk), (node_v, dv)] {
            if let Some(node) = node {
                grads.register::<LibTorch>(node.id, TchTensor::new(g));
            }
        }
    }
}

impl<C: CheckpointStrategy> FusedAttentionBackend for Autodiff<LibTorch, C> {
    fn causal_flash_attention(q: FloatTensor<Self>, k: FloatTensor<Self>, v: FloatTensor<Self>) -> FloatTensor<Self> {
        // Node handles first: `into_primitive` consumes the autodiff tensors.
        let nodes = [q.node(), k.node(), v.node()];
        match FlashAttentionBackward.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let (q, k, v) = (q.into_primitive(), k.into_primitive(), v.into_primitive());
                let (out, lse) = torch_flash_forward(&q.tensor, &k.tensor, &v.tensor);
                // One TchTensor shared by the state and the output: burn-tch writes in place
                // into tensors whose storage it believes unique, so two wrappers of the same
                // storage could see each other's in-place updates.
                let out = TchTensor::new(out);
                prep.finish((q, k, v, out.clone(), TchTensor::new(lse)), out)
            }
            OpsKind::UnTracked(prep) => {
                let (q, k, v) = (q.into_primitive(), k.into_primitive(), v.into_primitive());
                prep.finish(TchTensor::new(torch_flash_forward(&q.tensor, &k.tensor, &v.tensor).0))
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

    /// Fused and generic attention agree in value and in all three input gradients, with GQA.
    #[test]
    fn fused_matches_generic_forward_and_backward() {
        let device = Device::libtorch().autodiff();
        device.seed(7);
        let (b, h, kv, s, hd) = (2, 4, 2, 33, 16);
        let q0 = rand([b, h, s, hd], &device);
        let k0 = rand([b, kv, s, hd], &device);
        let v0 = rand([b, kv, s, hd], &device);
        let w = rand([b, h, s, hd], &device); // a random upstream gradient via Σ(out·w)
        let run = |kernel| {
            let (q, k, v) = (q0.clone().require_grad(), k0.clone().require_grad(), v0.clone().require_grad());
            let out = causal_attention_with(kernel, q.clone(), k.clone(), v.clone());
            let grads = (out.clone() * w.clone()).sum().backward();
            (out, q.grad(&grads).unwrap(), k.grad(&grads).unwrap(), v.grad(&grads).unwrap())
        };
        let fused = run(AttentionKernel::TorchFlashCpu);
        let generic = run(AttentionKernel::Generic);
        let tol = Tolerance::<f32>::relative(1e-4).set_absolute(1e-5);
        fused.0.into_data().assert_approx_eq::<f32>(&generic.0.into_data(), tol);
        fused.1.into_data().assert_approx_eq::<f32>(&generic.1.into_data(), tol);
        fused.2.into_data().assert_approx_eq::<f32>(&generic.2.into_data(), tol);
        fused.3.into_data().assert_approx_eq::<f32>(&generic.3.into_data(), tol);
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
        out.narrow(2, 0, 1).into_data().assert_approx_eq::<f32>(&v.narrow(2, 0, 1).into_data(), Tolerance::absolute(1e-6));
    }
}
