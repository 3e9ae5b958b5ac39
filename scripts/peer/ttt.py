#!/usr/bin/env python3
"""Time-to-train in PyTorch + HF transformers + PEFT: the peer of `llora train`'s MLPerf loop.

The job: an HF base checkpoint (e.g. runs/demo-base), MLPerf-schema parquet train and eval files
(`input_ids`, `labels`, -100 = no target), PEFT LoRA on --targets, torch AdamW, cosine decay
without warm-up over --max-steps, global-norm clip, a global batch of --gbs one-sequence
micro-batches whose loss is the sum of its target-token losses over its target tokens,
evaluation every --eval-every samples with MLPerf's metric (the mean over eval samples of each
sample's mean token loss), stop at the first evaluation at or below --target.

The clock starts before the data is read, where llora's run_start is. Last line: one JSON
object (status, samples, eval_loss, time_to_train_s, step_s_median).
"""
import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from threads import pin_threads  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF checkpoint directory")
    ap.add_argument("--train", required=True, help="MLPerf-schema parquet")
    ap.add_argument("--eval", required=True, help="MLPerf-schema parquet")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--weight-decay", type=float, default=1e-4)
    ap.add_argument("--clip", type=float, default=0.3)
    ap.add_argument("--gbs", type=int, default=8)
    ap.add_argument("--max-steps", type=int, default=300)
    ap.add_argument("--eval-every", type=int, default=64, help="samples between evaluations")
    ap.add_argument("--target", type=float, default=0.925)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    return ap.parse_args(argv)


def main(a):
    pin_threads(a.threads)
    import torch
    import pyarrow.parquet as pq
    import transformers
    from transformers import LlamaForCausalLM
    import recipe

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    model = recipe.with_lora(LlamaForCausalLM.from_pretrained(a.model, dtype=torch.float32),
                             a.rank, a.alpha, a.dropout, a.targets.split(","))
    params = recipe.trainable(model)
    optim = torch.optim.AdamW(params, lr=a.lr, weight_decay=a.weight_decay)
    cosine = torch.optim.lr_scheduler.LambdaLR(
        optim, lambda s: 0.5 * (1.0 + math.cos(math.pi * min(s, a.max_steps) / a.max_steps)))

    def read(path):
        table = pq.read_table(path, columns=["input_ids", "labels"])
        return [(torch.tensor(r["input_ids"]), torch.tensor(r["labels"])) for r in table.to_pylist()]

    def token_losses(ids, labels):
        logits = model(input_ids=ids[None], use_cache=False).logits[0, :-1].float()
        nxt = labels[1:]
        keep = nxt != -100
        return torch.nn.functional.cross_entropy(logits[keep], nxt[keep], reduction="none")

    start = time.perf_counter()
    train, evals = read(a.train), read(a.eval)
    order_gen = torch.Generator().manual_seed(a.seed)
    order, at = [], 0
    samples, status, eval_loss, step_times = 0, "aborted", None, []
    every = math.ceil(a.eval_every / a.gbs) * a.gbs
    for _ in range(a.max_steps):
        t0 = time.perf_counter()
        model.train()
        batch = []
        while len(batch) < a.gbs:
            if at == len(order):
                order, at = torch.randperm(len(train), generator=order_gen).tolist(), 0
            batch.append(train[order[at]])
            at += 1
        targets = sum(int((labels[1:] != -100).sum()) for _, labels in batch)
        for ids, labels in batch:
            (token_losses(ids, labels).sum() / targets).backward()
        torch.nn.utils.clip_grad_norm_(params, a.clip)
        optim.step()
        cosine.step()
        optim.zero_grad(set_to_none=True)
        samples += a.gbs
        step_times.append(time.perf_counter() - t0)
        if samples % every == 0:
            model.eval()
            with torch.no_grad():
                eval_loss = statistics.fmean(float(token_losses(i, l).mean()) for i, l in evals)
            print(f"samples {samples} eval_loss {eval_loss:.4f}", file=sys.stderr)
            if eval_loss <= a.target:
                status = "success"
                break
    print(json.dumps({"impl": "pytorch+transformers+peft", "status": status, "samples": samples,
                      "eval_loss": eval_loss, "time_to_train_s": round(time.perf_counter() - start, 2),
                      "step_s_median": round(statistics.median(step_times), 4), "torch": torch.__version__,
                      "threads": a.threads, "seed": a.seed}))


if __name__ == "__main__":
    main(parse_args())
