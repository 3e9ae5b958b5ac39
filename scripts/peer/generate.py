#!/usr/bin/env python3
"""HF transformers' greedy generate on a base model + PEFT adapter, the peer of `llora generate`:
reads {"prompt_ids": [...], "max_new_tokens": N[, "dtype": "bf16"]} on stdin (dtype: the base
model's, fp32 by default; PEFT keeps its adapters in f32 either way), prints {"ids": [...new tokens...],
"decode_tokens_per_s": ..., "prefill_s": ..., "versions": {...}}. Stops at the model's
eos_token_id list, as `llora generate` does. Nothing is downloaded.

usage: generate.py BASE ADAPTER [THREADS]      (ADAPTER "-": the base model alone)
"""
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main():
    if len(sys.argv) not in (3, 4):
        sys.exit(__doc__)
    base, adapter = sys.argv[1:3]
    import torch
    import transformers
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    if len(sys.argv) == 4:
        torch.set_num_threads(int(sys.argv[3]))
    req = json.load(sys.stdin)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[req.get("dtype", "fp32")]
    model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
    if adapter != "-":
        model = PeftModel.from_pretrained(model, adapter, is_trainable=False)
    model.eval()
    ids = torch.tensor([req["prompt_ids"]], dtype=torch.int64)
    eos = model.config.eos_token_id
    # The fixtures save use_cache=False (training); generation uses its KV cache, as llora does.
    kw = dict(do_sample=False, use_cache=True, eos_token_id=eos, pad_token_id=(eos[0] if isinstance(eos, list) else eos),
              attention_mask=torch.ones_like(ids))
    with torch.no_grad():
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, **kw)
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=req["max_new_tokens"], **kw)
        total = time.perf_counter() - t0
    new = out[0, ids.shape[1]:].tolist()
    decode = max(total - prefill, 1e-9)
    print(json.dumps({"ids": new, "prefill_s": prefill, "decode_tokens_per_s": (len(new) - 1) / decode,
                      "versions": {"torch": torch.__version__, "transformers": transformers.__version__}}))


if __name__ == "__main__":
    main()
