#!/usr/bin/env python3
"""Full fine-tuning gradients as transformers computes them, for llora's parity tests.

Loads the HF checkpoint MODEL (config.json + model.safetensors, f32) with transformers, runs
its loss on BATCH (batch.safetensors of a fixture: input_ids, labels; the mean over target
tokens), backpropagates, and writes the gradients of the named parameters to OUT
(safetensors). A tied checkpoint has one nn.Parameter for the embedding and the head: its
gradient is the sum of both uses, under the embedding's name. Prints one JSON line: the loss,
and whether the head is the embedding's tensor.
  full_grads.py MODEL BATCH OUT NAME[,NAME...] [THREADS]
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from threads import pin_threads  # noqa: E402


def main(model_dir, batch_path, out, names, threads=2):
    pin_threads(threads)
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    batch = load_file(batch_path)
    loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
    loss.backward()
    params = dict(model.named_parameters())
    missing = [n for n in names if n not in params]
    if missing:
        sys.exit(f"{model_dir}: no parameter {missing} (named_parameters lists a tied head once, as the embedding)")
    save_file({n: params[n].grad.detach().contiguous() for n in names}, out)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    print(json.dumps({"loss": loss.item(), "head_is_embedding": tied}))


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], a[1], a[2], a[3].split(","), int(a[4]) if len(a) > 4 else 2)
