"""The LoRA recipe llora is measured against, in PyTorch + HF transformers + PEFT.

One module for what the peer's three jobs share (step benchmark, parity fixtures, time-to-train):
llora's model presets as HF `LlamaConfig`s, a randomly initialised base (no download) wrapped by
PEFT LoRA, the random batches, the FLOP model `llora bench` uses, and host measurements.

Import it after the thread variables are set: it imports torch.
"""
import resource

import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)
from peft import LoraConfig, get_peft_model

# llora's presets (model/src/config.rs), as (vocab, d, intermediate, layers, heads, kv heads).
PRESETS = {
    "demo": (512, 128, 344, 4, 4, 2),
    "tiny": (32000, 256, 688, 4, 8, 8),
    "tiny-gqa": (32000, 256, 688, 2, 8, 2),
    "small": (32000, 1024, 2816, 8, 16, 4),
    "llama2-7b-1layer": (32000, 4096, 11008, 1, 32, 32),
    "llama2-70b-1layer": (32000, 8192, 28672, 1, 64, 8),
    "tiny-llama3": (128256, 256, 688, 2, 8, 2),
    "tiny-qwen2": (1000, 128, 344, 2, 4, 2),
    "tiny-qwen3": (1000, 128, 344, 2, 4, 2),
    "tiny-mistral": (1000, 128, 344, 2, 4, 2),
}
# The other families' presets: their config class and what sets them apart from Llama (each
# family's own traits, with windows shorter than the fixtures' rows and head_dim != d / heads).
FAMILIES = {
    "tiny-qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(
        use_sliding_window=True, sliding_window=24, max_window_layers=1, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "tiny-qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(
        head_dim=40, attention_bias=False, use_sliding_window=True, sliding_window=20, max_window_layers=1,
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "tiny-mistral": (MistralConfig, MistralForCausalLM, dict(
        head_dim=24, sliding_window=16, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
}
# What makes a preset Llama-3-style (Llama 3.2 1B's traits, scaled down): llama3 RoPE scaling,
# tied embeddings, a head_dim other than hidden/heads (48, not 32), end-of-turn ids as a list.
LLAMA3_TRAITS = {
    "tiny-llama3": dict(
        head_dim=48, tie_word_embeddings=True, bos_token_id=128000, eos_token_id=[128001, 128008, 128009],
        max_position_embeddings=131072,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
}
# The benchmark's adapters: attention projections only.
ATTENTION_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
# torch dtypes of the base weights per --dtype (adapters stay f32: PEFT's autocast_adapter_dtype).
BASE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "bf16-autocast": torch.float32}


def hf_config(preset, seq_len):
    """An HF LlamaConfig with the preset's shapes and Llama 2's constants (no tying, no biases),
    or Llama 3's traits for the presets of LLAMA3_TRAITS."""
    vocab, d, inter, layers, heads, kv = PRESETS[preset]
    if preset in FAMILIES:
        config_class, _, traits = FAMILIES[preset]
        cfg = config_class(
            vocab_size=vocab, hidden_size=d, intermediate_size=inter, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=kv, rms_norm_eps=1e-6, hidden_act="silu",
            attention_dropout=0.0, initializer_range=0.02, use_cache=False,
            max_position_embeddings=max(4096, seq_len), **traits)
        cfg._attn_implementation = "sdpa"
        return cfg
    traits = dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False)
    traits.update(LLAMA3_TRAITS.get(preset, {}))
    traits.setdefault("max_position_embeddings", max(4096, seq_len))
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=d, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, rms_norm_eps=1e-5, hidden_act="silu",
        attention_bias=False, mlp_bias=False, attention_dropout=0.0, initializer_range=0.02,
        use_cache=False, **traits)
    cfg._attn_implementation = "sdpa"
    return cfg


def causal_lm_class(cfg):
    """The transformers model class of a config of ours (a family's, or Llama's)."""
    return next((m for c, m, _ in FAMILIES.values() if isinstance(cfg, c)), LlamaForCausalLM)


def random_model(cfg, dtype, seed, device=None):
    """HF's own random initialisation from `seed`, allocated directly in the base dtype; on `device`
    (allocated and initialised there, from that device's generator) when one is given."""
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(BASE_DTYPES[dtype])
    model_class = causal_lm_class(cfg)
    try:
        if device is None:
            model = model_class(cfg)
        else:
            with torch.device(device):
                model = model_class(cfg)
    finally:
        torch.set_default_dtype(previous)
    model.config.use_cache = False
    if model_class is not LlamaForCausalLM:
        # HF starts biases at 0 and norm gains at 1: moved away, so that each is seen.
        g = torch.Generator().manual_seed(seed + 11)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.copy_(torch.randn(p.shape, generator=g) * 0.2)
                elif name.endswith(("q_norm.weight", "k_norm.weight")):
                    p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
    return model


def with_lora(model, rank, alpha, dropout, targets=ATTENTION_TARGETS, rslora=False, rank_pattern=None,
              alpha_pattern=None, layers=None, dora=False):
    """PEFT LoRA with its defaults (A Kaiming-uniform, B zero, f32 adapters); the base frozen.
    rslora: PEFT's use_rslora (the update scaled by alpha / sqrt(r)); rank_pattern, alpha_pattern,
    layers (layers_to_transform): PEFT's per-module ranks and alphas and layer selection; dora: PEFT's
    use_dora (a magnitude per output row)."""
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(targets),
                        bias="none", task_type="CAUSAL_LM", use_rslora=rslora, rank_pattern=rank_pattern or {},
                        alpha_pattern=alpha_pattern or {}, layers_to_transform=layers,
                        use_dora=dora)
    return get_peft_model(model, config)


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def random_batch(generator, batch, seq_len, vocab):
    """Token ids uniform in [0, vocab); the first half of each row is prompt (label -100)."""
    ids = torch.randint(0, vocab, (batch, seq_len), generator=generator, dtype=torch.int64)
    labels = ids.clone()
    labels[:, : seq_len // 2] = -100
    return ids, labels


def flop_model(cfg, batch, seq_len, rank):
    """Matmul FLOPs of one LoRA step, the model `llora bench` reports (trainer/src/flops.rs).

    Frozen weights: forward 2·T·N, backward 2·T·N for the input gradient only (no weight
    gradient), less layer 0's q/k/v input gradient (the embedding needs none). Adapters: 6·T
    per parameter, less layer 0's A input gradient. Causal attention: half of 12·B·S²·H·hd·L.
    """
    d, layers, heads, kv = cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads
    hd = d // heads
    tokens = batch * seq_len
    q, k, v, o = d * heads * hd, d * kv * hd, d * kv * hd, heads * hd * d
    frozen = layers * (q + k + v + o + 3 * d * cfg.intermediate_size) + d * cfg.vocab_size
    adapters = layers * rank * ((d + heads * hd) + 2 * (d + kv * hd) + (heads * hd + d))
    fwd = 2 * tokens * frozen
    bwd = 2 * tokens * frozen - 2 * tokens * (q + k + v)
    lora = 6 * tokens * adapters - 2 * tokens * rank * d * 3
    attn_full = 12 * batch * seq_len * seq_len * heads * hd * layers
    attn = attn_full // 2
    return {"flops_per_step": fwd + bwd + lora + attn, "flops_lin_fwd": fwd, "flops_lin_bwd": bwd,
            "flops_lora": lora, "flops_attn_causal": attn, "flops_per_step_attn_full": fwd + bwd + lora + attn_full,
            "flops_full_ft_equiv": 6 * tokens * frozen + attn, "n_lin_params": frozen, "n_lora_params": adapters}


def peak_rss_mb():
    """This process's peak resident set, MB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def machine_busy():
    """(busy, total) jiffies over all CPUs, for the other processes' share of a timed window."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields) - idle, sum(fields)


def loadavg():
    try:
        with open("/proc/loadavg") as f:
            return [float(x) for x in f.read().split()[:3]]
    except OSError:
        return None


def quantile(xs, p):
    """Linear-interpolated quantile, as llora bench computes it."""
    xs = sorted(xs)
    pos = p * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
