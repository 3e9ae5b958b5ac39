#!/usr/bin/env python3
"""Forward pass of an HF base model + a PEFT LoRA adapter, for llora's round-trip tests.

Loads BASE (an HF checkpoint directory) with transformers, applies the adapter in ADAPTER with
peft.PeftModel.from_pretrained (so PEFT's own key matching and shape checks run), evaluates
the int64 `input_ids`/`labels` in BATCH (safetensors) and writes logits [B, S, V] and the
HF causal-LM loss to OUT (safetensors). Nothing is downloaded.

usage: peft_forward.py BASE ADAPTER BATCH OUT      (ADAPTER "-": the base model alone)
"""
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch  # noqa: E402
from peft import PeftModel  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402


def main():
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    base, adapter, batch, out = sys.argv[1:]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter != "-":
        model = PeftModel.from_pretrained(model, adapter, is_trainable=False)
    model.eval()
    b = load_file(batch)
    with torch.no_grad():
        res = model(input_ids=b["input_ids"], labels=b["labels"])
    save_file({"logits": res.logits.float().contiguous(), "loss": res.loss.float().reshape(1)}, out)


if __name__ == "__main__":
    main()
