"""A random Llama checkpoint in bf16 as HF writes one (two safetensors shards + index), for
loading benchmarks: d 2048, I 5632, 16 heads, vocab 32000, LAYERS layers (18: 1.06 B
parameters, 2.0 GB).  Usage: make-bf16-checkpoint.py OUT_DIR LAYERS"""
import json, sys, torch
from safetensors.torch import save_file
out, layers = sys.argv[1], int(sys.argv[2])
d, i, h, kv, v = 2048, 5632, 16, 16, 32000
cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=d, intermediate_size=i,
           num_hidden_layers=layers, num_attention_heads=h, num_key_value_heads=kv, vocab_size=v,
           max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
           torch_dtype="bfloat16", hidden_act="silu")
json.dump(cfg, open(f"{out}/config.json", "w"), indent=1)
g = torch.Generator().manual_seed(0)
def w(*s): return (torch.randn(*s, generator=g) * 0.02).to(torch.bfloat16)
shards, weight_map = [{}, {}], {}
hd = d // h
for l in range(layers):
    p = f"model.layers.{l}"
    t = {f"{p}.self_attn.q_proj.weight": w(h*hd, d), f"{p}.self_attn.k_proj.weight": w(kv*hd, d),
         f"{p}.self_attn.v_proj.weight": w(kv*hd, d), f"{p}.self_attn.o_proj.weight": w(d, h*hd),
         f"{p}.mlp.gate_proj.weight": w(i, d), f"{p}.mlp.up_proj.weight": w(i, d), f"{p}.mlp.down_proj.weight": w(d, i),
         f"{p}.input_layernorm.weight": torch.ones(d, dtype=torch.bfloat16),
         f"{p}.post_attention_layernorm.weight": torch.ones(d, dtype=torch.bfloat16)}
    shards[0 if l < layers // 2 else 1].update(t)
shards[0]["model.embed_tokens.weight"] = w(v, d)
shards[1]["model.norm.weight"] = torch.ones(d, dtype=torch.bfloat16)
shards[1]["lm_head.weight"] = w(v, d)
for k, s in enumerate(shards):
    name = f"model-{k+1:05d}-of-00002.safetensors"
    save_file(s, f"{out}/{name}", metadata={"format": "pt"})
    weight_map.update({n: name for n in s})
json.dump({"metadata": {}, "weight_map": weight_map}, open(f"{out}/model.safetensors.index.json", "w"), indent=1)
