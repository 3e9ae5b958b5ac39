#!/usr/bin/env python3
"""PyTorch + HF transformers + PEFT on a tokenised MLPerf-schema parquet, padded: the peer of
`scripts/bench-packing.sh`'s padded llora runs.

usage: padded_train.py --preset P --data FILE [--batch 8] [--steps N] [--warmup 1] [--threads 2]
                       [--device cpu|cuda[:N]] [--dtype fp32|bf16]

The file's samples in a seeded shuffle, `--batch` at a time padded to the batch's longest
(right padding, attention mask, label -100), through a random base of a llora preset with PEFT
LoRA (r 16, alpha 32, dropout 0.1 on q,k,v,o; the trainer's recipe: torch AdamW lr 4e-4,
weight decay 1e-4, clip 0.3), the base in `--dtype` (LoRA factors f32, as PEFT keeps them) on
`--device`. Times `--steps` steps after `--warmup` (on CUDA, synchronised) and prints one JSON
line: samples, target tokens and input tokens per second, and the seconds per step.
"""
import argparse
import json
import time

import numpy as np
import pyarrow.parquet as pq


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    return ap.parse_args()


def main(a):
    import torch
    import recipe
    from step_bench import open_device
    torch.set_num_threads(a.threads)
    dev = open_device(torch, a.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    table = pq.read_table(a.data)
    ids = [np.asarray(x, dtype=np.int64) for x in table.column("input_ids").to_pylist()]
    labels = [np.asarray(x, dtype=np.int64) for x in table.column("labels").to_pylist()]
    order = np.random.default_rng(a.seed).permutation(len(ids))
    cfg = recipe.hf_config(a.preset, max(len(x) for x in ids))
    model = recipe.with_lora(recipe.random_model(cfg, a.dtype, a.seed), 16, 32.0, 0.1, recipe.ATTENTION_TARGETS)
    model.to(dev).train()
    params = recipe.trainable(model)
    optim = torch.optim.AdamW(params, lr=4e-4, weight_decay=1e-4)
    times, samples, targets, tokens = [], 0, 0, 0
    for step in range(a.warmup + a.steps):
        take = [order[(step * a.batch + j) % len(ids)] for j in range(a.batch)]
        longest = max(len(ids[i]) for i in take)
        batch_ids = torch.zeros(a.batch, longest, dtype=torch.int64)
        batch_labels = torch.full((a.batch, longest), -100, dtype=torch.int64)
        mask = torch.zeros(a.batch, longest, dtype=torch.int64)
        for r, i in enumerate(take):
            n = len(ids[i])
            batch_ids[r, :n] = torch.from_numpy(ids[i])
            batch_labels[r, :n] = torch.from_numpy(labels[i])
            mask[r, :n] = 1
        sync()
        t = time.perf_counter()
        loss = model(input_ids=batch_ids.to(dev), attention_mask=mask.to(dev), labels=batch_labels.to(dev),
                     use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.3)
        optim.step()
        optim.zero_grad(set_to_none=True)
        sync()
        if step >= a.warmup:
            times.append(time.perf_counter() - t)
            samples += a.batch
            targets += int((batch_labels[:, 1:] != -100).sum())
            tokens += int(mask.sum())
    total = sum(times)
    record = {"impl": "pytorch + transformers + peft, padded", "preset": a.preset, "device": a.device,
              "dtype": a.dtype, "batch": a.batch, "steps": a.steps,
              "step_s_mean": round(total / len(times), 4), "samples_per_s": round(samples / total, 3),
              "target_tokens_per_s": round(targets / total, 2), "tokens_per_s": round(tokens / total, 2)}
    if a.tag:
        record["tag"] = a.tag
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main(parse_args())
