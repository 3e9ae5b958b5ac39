//! One FLOP model for a training step: what `llora bench` reports as GFLOP/s, what the
//! training loop logs as model TFLOP/s and MFU, and what the PyTorch + PEFT peer reports
//! (`flop_model()` in scripts/peer/recipe.py, the same formulas).
//!
//! Counted: the GEMMs the step's math needs, 2 FLOPs per multiply-add.
//! - Linear layers (every decoder projection and the LM head, N weights): forward 2·N per
//!   token; backward the input gradient, 2·N per token, except block 0's q/k/v (their input
//!   comes from the frozen embedding: nothing needs its gradient). A frozen base has no
//!   weight-gradient GEMM; a trainable one (full fine-tuning) adds 2·N per token.
//! - LoRA adapters (P parameters): forward, input gradient and weight gradient of A and B,
//!   6·P per token, less A's input gradient on block 0's q/k/v.
//! - Attention: QKᵀ and PV, 4·S·hd per query head and token forward, twice that backward,
//!   halved for causal masks (the fused kernels skip the masked blocks): 6·S·H·hd·L per token.
//!
//! Not counted: recomputed blocks' second forward (overhead, not model work, as in Megatron's
//! and MLPerf's "model FLOPs"), norms, softmax, RoPE and other elementwise work.

use llora_model::BlockLinear;
use llora_model::{LlamaConfig, LlamaForCausalLM};
use serde_json::{Value, json};

/// The adapters a step trains, as the FLOP model needs them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Adapters {
    /// LoRA parameters (A and B of every adapter).
    pub params: u64,
    /// Σ rank · input width over block 0's adapters on q, k, v (or the fused qkv): A's input
    /// gradient there is not needed.
    pub first_block_qkv_a: u64,
}

impl Adapters {
    /// The adapters of `model`.
    pub fn of(model: &LlamaForCausalLM) -> Self {
        let mut out = Self { params: 0, first_block_qkv_a: 0 };
        for (name, a) in model.adapters() {
            let ([r, i], [o, _]) = (a.a.shape().dims::<2>(), a.b.shape().dims::<2>());
            out.params += (r * i + o * r) as u64;
            let qkv = BlockLinear::from_name(&name).is_some_and(BlockLinear::is_qkv);
            if qkv && name.contains("model.layers.0.self_attn.") {
                out.first_block_qkv_a += (r * i) as u64;
            }
        }
        out
    }

    /// Rank-`rank` adapters on q, k, v and o of every block (the peer's recipe).
    pub fn qkvo(c: &LlamaConfig, rank: usize) -> Self {
        let (d, q, kv) = (c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim);
        let per_block = rank * ((d + q) + 2 * (d + kv) + (q + d));
        Self { params: (c.num_hidden_layers * per_block) as u64, first_block_qkv_a: (3 * rank * d) as u64 }
    }
}

/// FLOPs of one training sequence, by part.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Flops {
    /// Linear layers' forward.
    pub linear_forward: u64,
    /// Linear layers' backward (input gradients; weight gradients too when trainable).
    pub linear_backward: u64,
    /// LoRA adapters, forward and backward.
    pub lora: u64,
    /// Attention with a causal mask, forward and backward.
    pub attention: u64,
}

impl Flops {
    /// The FLOPs of training one sequence of `len` tokens of `c` with `adapters`; `full`: the
    /// base weights are trained too.
    pub fn sequence(c: &LlamaConfig, adapters: Adapters, len: usize, full: bool) -> Self {
        let t = len as u64;
        let (d, l) = (c.hidden_size as u64, c.num_hidden_layers as u64);
        let (q, kv) = ((c.num_attention_heads * c.head_dim) as u64, (c.num_key_value_heads * c.head_dim) as u64);
        let n = linear_params(c);
        let first_qkv = d * (q + 2 * kv);
        let weight_grads = if full { 2 * t * n } else { 0 };
        Self {
            linear_forward: 2 * t * n,
            linear_backward: 2 * t * n - 2 * t * first_qkv + weight_grads,
            lora: 6 * t * adapters.params - 2 * t * adapters.first_block_qkv_a,
            attention: 6 * t * t * q * l,
        }
    }

    /// All parts together.
    pub fn total(&self) -> u64 {
        self.linear_forward + self.linear_backward + self.lora + self.attention
    }

    /// `k` times these FLOPs (a batch of equal sequences).
    pub fn times(&self, k: u64) -> Self {
        Self {
            linear_forward: k * self.linear_forward,
            linear_backward: k * self.linear_backward,
            lora: k * self.lora,
            attention: k * self.attention,
        }
    }

    /// The benchmark JSON's fields (the peer's names).
    pub fn to_json(&self, c: &LlamaConfig, adapters: Adapters) -> Value {
        json!({
            "flops_per_step": self.total(),
            "flops_lin_fwd": self.linear_forward,
            "flops_lin_bwd": self.linear_backward,
            "flops_lora": self.lora,
            "flops_attn_causal": self.attention,
            "n_lin_params": linear_params(c),
            "n_lora_params": adapters.params,
        })
    }
}

/// Weights of every linear layer: the decoder projections and the LM head (not the embedding,
/// a lookup).
fn linear_params(c: &LlamaConfig) -> u64 {
    let (d, i) = (c.hidden_size as u64, c.intermediate_size as u64);
    let (q, kv) = ((c.num_attention_heads * c.head_dim) as u64, (c.num_key_value_heads * c.head_dim) as u64);
    c.num_hidden_layers as u64 * (2 * d * q + 2 * d * kv + 3 * d * i) + d * c.vocab_size as u64
}

/// Dense peak TFLOP/s of one GPU by its name (NVIDIA's and AMD's data sheets, no sparsity):
/// (bf16, FP8). MFU in llora is against the bf16 peak, as the MLPerf submissions' and
/// Megatron's reports do, also for FP8 runs.
pub fn gpu_peak_tflops(name: &str) -> Option<(f64, f64)> {
    let n = name.to_ascii_uppercase();
    let table: [(&str, f64, f64); 6] = [
        ("H100 PCIE", 756.0, 1513.0),
        ("H100", 989.4, 1978.9),
        ("H200", 989.4, 1978.9),
        ("B200", 2250.0, 4500.0),
        ("MI300X", 1307.4, 2614.9),
        ("MI355X", 2516.6, 5033.2),
    ];
    table.iter().find(|(key, ..)| n.contains(key)).map(|&(_, bf16, fp8)| (bf16, fp8))
}

/// The name of CUDA (or ROCm) device `index`, from the vendor's tool (`nvidia-smi`, else
/// `rocm-smi`); `None` when neither answers.
pub fn gpu_name(index: usize) -> Option<String> {
    let run = |cmd: &str, args: &[&str]| {
        let out = std::process::Command::new(cmd).args(args).output().ok()?;
        out.status.success().then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    };
    let id = index.to_string();
    if let Some(s) = run("nvidia-smi", &["--query-gpu=name", "--format=csv,noheader", "-i", &id]) {
        return s.lines().next().map(|l| l.trim().to_string()).filter(|l| !l.is_empty());
    }
    let s = run("rocm-smi", &["--showproductname", "-d", &id])?;
    s.lines()
        .find_map(|l| l.split("Card Series:").nth(1).or_else(|| l.split("Card series:").nth(1)))
        .map(|v| v.trim().to_string())
}

#[cfg(test)]
mod tests {
    #![allow(deprecated)] // Device::libtorch: burn-tch is deprecated upstream, and it is our backend.
    use super::*;

    /// Against numbers worked out by hand for the `tiny` preset at S 512, r 16 on q,k,v,o
    /// (d 256, L 4, H 8, KV 8, hd 32, I 688, V 32000).
    #[test]
    fn matches_the_hand_count() {
        let c = LlamaConfig::preset("tiny").unwrap();
        let a = Adapters::qkvo(&c, 16);
        // n_lora = 4·16·((256+256) + 2·(256+256) + (256+256)) = 64·2048
        assert_eq!(a, Adapters { params: 131_072, first_block_qkv_a: 3 * 16 * 256 });
        let f = Flops::sequence(&c, a, 512, false);
        // n_lin = 4·(4·256·256 + 3·256·688) + 256·32000 = 4·(262144 + 528384) + 8192000
        let n = 11_354_112u64;
        assert_eq!(linear_params(&c), n);
        // attention: 12·512²·8·32·4 / 2
        assert_eq!(f.attention, 1_610_612_736);
        let total = 2 * 512 * n * 2 - 2 * 512 * 3 * 65536 + 6 * 512 * 131_072 - 2 * 512 * 16 * 256 * 3 + 1_610_612_736;
        assert_eq!(f.total(), total);
        // Full fine-tuning adds the weight gradients, 2·T·N.
        assert_eq!(Flops::sequence(&c, a, 512, true).total(), total + 2 * 512 * n);
    }

    /// Counting a model's adapters gives the formula's count on the layout it describes, and
    /// a fused qkv adapter reads its input once.
    #[test]
    fn counts_a_models_adapters() {
        use burn::tensor::Device;
        // Drawing A uses LibTorch's one generator, which seeded tests rely on.
        let _rng = llora_model::device::torch_rng_lock();
        let c = LlamaConfig::preset("tiny").unwrap();
        let targets = ["q_proj", "k_proj", "v_proj", "o_proj"].map(String::from).to_vec();
        let spec = llora_model::LoraSpec { rank: 16, alpha: 32.0, dropout: 0.0, targets, ..Default::default() };
        let opts = llora_model::BuildOptions { lora: Some(&spec), ..Default::default() };
        let model = LlamaForCausalLM::random(&c, &opts, &Device::libtorch()).unwrap();
        assert_eq!(Adapters::of(&model), Adapters::qkvo(&c, 16));
    }

    #[test]
    fn knows_the_gpus_of_the_submissions() {
        assert_eq!(gpu_peak_tflops("NVIDIA H100 80GB HBM3"), Some((989.4, 1978.9)));
        assert_eq!(gpu_peak_tflops("NVIDIA H100 PCIe"), Some((756.0, 1513.0)));
        assert_eq!(gpu_peak_tflops("NVIDIA H200"), Some((989.4, 1978.9)));
        assert_eq!(gpu_peak_tflops("AMD Instinct MI300X"), Some((1307.4, 2614.9)));
        assert_eq!(gpu_peak_tflops("AMD Instinct MI355X"), Some((2516.6, 5033.2)));
        assert_eq!(gpu_peak_tflops("NVIDIA B200"), Some((2250.0, 4500.0)));
        assert_eq!(gpu_peak_tflops("NVIDIA A10G"), None);
    }
}
