#!/usr/bin/env python3
"""Each document alone through HF transformers + PEFT: the reference for llora's packed rows.

usage: packed_docs.py BASE ADAPTER DOCS OUT

BASE is an HF checkpoint directory, ADAPTER a PEFT adapter directory (loaded trainable, in
f32, train mode: its dropout must be 0 for a deterministic reference). DOCS (safetensors) holds
the documents back to back: int64 `input_ids` and `labels` `[total]` and `lengths` `[docs]`.
Every document runs on its own, unpadded, at positions 0..len. OUT (safetensors) gets each
document's sum of token losses and its target-token count (HF's shift: the label at t+1 scored
from position t), and the gradient of the token-normalised loss over all documents
(Σ sums / Σ counts) for every trainable parameter, under PEFT's on-disk names
(`...q_proj.lora_A.weight`).
"""
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from peft import PeftModel  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402


def main():
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    base, adapter, docs, out = sys.argv[1:]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = PeftModel.from_pretrained(model, adapter, is_trainable=True)
    model.train()
    d = load_file(docs)
    sums, counts, start = [], [], 0
    for n in d["lengths"].tolist():
        ids, labels = d["input_ids"][start:start + n], d["labels"][start:start + n]
        start += n
        logits = model(input_ids=ids[None], use_cache=False).logits[0].float()
        target = labels[1:]
        keep = target != -100
        logp = F.log_softmax(logits[:-1], dim=-1)
        picked = -logp.gather(-1, target.clamp(min=0)[:, None])[:, 0]
        sums.append((picked * keep).sum())
        counts.append(int(keep.sum()))
    loss = torch.stack(sums).sum() / sum(counts)
    loss.backward()
    result = {
        "loss_sums": torch.stack(sums).detach().float().contiguous(),
        "counts": torch.tensor(counts, dtype=torch.float32),
    }
    for name, p in model.named_parameters():
        if p.requires_grad:
            on_disk = name.replace(".default.", ".")
            result[f"grad.{on_disk}"] = p.grad.detach().float().contiguous()
    save_file(result, out)


if __name__ == "__main__":
    main()
