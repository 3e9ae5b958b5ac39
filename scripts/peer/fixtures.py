#!/usr/bin/env python3
"""Parity fixtures for llora's tests: what HF transformers + PEFT compute for one fixed job.

Writes into --out (CPU, f32 unless --dtype says otherwise):
  config.json, model.safetensors     the random base (HF names and layouts)
  adapter_config.json,
  adapter_model.safetensors          the initial PEFT adapter (on-disk names)
  batch.safetensors                  input_ids, labels int64 [B, S] (first half of each row -100);
                                     every step trains on this batch
  expected.safetensors               step1.hidden.layers.{i}   [B, S, d] decoder layer i's output
                                     step1.hidden.final_norm   [B, S, d] model.norm's output
                                     step1.logsumexp           [B, S] over the f32 logits
                                     step1.target_logit        [B, S] logit of labels[t+1] (0 where
                                                               there is no target)
                                     step{k}.loss              [1]
                                     step{k}.grad.<adapter>    the LoRA gradient before clipping
                                     step{k}.param_after.<adapter>  the weight after AdamW step k
  expected.json                      losses, grad_norm_total_preclip (what clip_grad_norm_
                                     returns), n_target_tokens, the recipe and the versions

With --bf16-twin, the same base (rounded to bf16, as from_pretrained(dtype=bfloat16) loads it)
and the same initial adapter also run step 1 in bf16 the way PEFT does it (adapters kept in
f32): expected.safetensors gains bf16.step1.grad.<adapter>, expected.json bf16_loss. With
--bf16-adapters too, that twin's adapters are bf16 (PEFT with autocast_adapter_dtype=False: the
adapter GEMMs run in bf16 on the bf16 input).

<adapter> is PEFT's on-disk name, e.g. base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight.
The loss is HF's: position t predicts labels[t+1], the mean over the batch's target tokens.
The optimizer is torch.optim.AdamW (lr 4e-4, wd 1e-4) after clip_grad_norm_(0.3).
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from threads import pin_threads  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="fixture directory (created)")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=1, help="optimizer steps recorded")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--lora-alpha", type=float, default=32.0)
    ap.add_argument("--lora-b", default="zeros", choices=["zeros", "normal"],
                    help="zeros: PEFT's init (every A gradient is 0 at step 1); normal: B ~ N(0, 0.02²), "
                         "so that A and B both get gradients")
    ap.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj", help="LoRA target modules")
    ap.add_argument("--rslora", action="store_true", help="PEFT's use_rslora: scale alpha / sqrt(r)")
    ap.add_argument("--dora", action="store_true", help="PEFT's use_dora: a trainable magnitude per output row")
    ap.add_argument("--rank-pattern", default="{}", help="PEFT rank_pattern as JSON, e.g. '{\"q_proj\": 4}'")
    ap.add_argument("--alpha-pattern", default="{}", help="PEFT alpha_pattern as JSON")
    ap.add_argument("--layers", default=None, help="PEFT layers_to_transform, comma-separated layer indexes")
    ap.add_argument("--bf16-twin", action="store_true", help="also record step 1 of the bf16 model (PEFT's bf16)")
    ap.add_argument("--bf16-adapters", action="store_true",
                    help="with --bf16-twin: its adapters in bf16 (PEFT's autocast_adapter_dtype=False)")
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--weight-decay", type=float, default=1e-4)
    ap.add_argument("--max-grad-norm", type=float, default=0.3)
    ap.add_argument("--threads", type=int, default=2)
    return ap.parse_args(argv)


def main(a):
    pin_threads(a.threads)
    import torch
    import transformers
    import peft
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file
    import recipe

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(a.threads)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = recipe.hf_config(a.preset, a.seq_len)
    base = recipe.random_model(cfg, a.dtype, a.seed)
    base_state = {k: v.detach().contiguous().clone() for k, v in base.state_dict().items()}
    # As save_pretrained writes a tied checkpoint: the head is the embedding, stored once.
    on_file = {k: v for k, v in base_state.items() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    save_file(on_file, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg.to_json_file(str(out / "config.json"))

    # Dropout off: the fixtures compare deterministic arithmetic.
    targets = a.targets.split(",")
    patterns = dict(rslora=a.rslora, dora=a.dora, rank_pattern=json.loads(a.rank_pattern), alpha_pattern=json.loads(a.alpha_pattern),
                    layers=[int(x) for x in a.layers.split(",")] if a.layers else None)
    model = recipe.with_lora(base, a.lora_r, a.lora_alpha, 0.0, targets, **patterns)
    model.train()
    def on_disk(n):
        # PEFT drops the adapter name on save, and ".weight" after DoRA's magnitude.
        n = n.replace(".default.", ".")
        return n.removesuffix(".weight") if n.endswith("lora_magnitude_vector.weight") else n
    named = [(on_disk(n), p) for n, p in model.named_parameters() if p.requires_grad]
    if a.lora_b == "normal":
        g = torch.Generator().manual_seed(a.seed + 7)
        with torch.no_grad():
            for n, p in named:
                if ".lora_B." in n:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)
                elif n.endswith("lora_magnitude_vector"):
                    # Away from its initial ‖W‖ too, so each row's rescale is visible.
                    p.mul_(1 + 0.1 * torch.randn(p.shape, generator=g))
    adapter = {k: v.detach().contiguous().clone() for k, v in get_peft_model_state_dict(model).items()}
    assert set(adapter) == {n for n, _ in named}, "PEFT's saved names differ from the parameter names"
    save_file(adapter, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    model.peft_config["default"].save_pretrained(str(out))

    ids, labels = recipe.random_batch(torch.Generator().manual_seed(a.seed + 1), a.batch, a.seq_len, cfg.vocab_size)
    save_file({"input_ids": ids, "labels": labels}, str(out / "batch.safetensors"))
    expected = {}
    bf16_loss = bf16_step1(cfg, base_state, adapter, ids, labels, a, targets, expected) if a.bf16_twin else None

    hf = model.base_model.model
    hidden = {}
    hooks = [layer.register_forward_hook(lambda m, i, o, n=n: hidden.__setitem__(f"layers.{n}", o[0] if isinstance(o, tuple) else o))
             for n, layer in enumerate(hf.model.layers)]
    hooks.append(hf.model.norm.register_forward_hook(lambda m, i, o: hidden.__setitem__("final_norm", o)))

    params = [p for _, p in named]
    optim = torch.optim.AdamW(params, lr=a.lr, weight_decay=a.weight_decay)
    losses, norms = [], []
    for k in range(1, a.steps + 1):
        result = model(input_ids=ids, labels=labels, use_cache=False)
        if k == 1:
            logits = result.logits.detach().float()
            expected["step1.logsumexp"] = torch.logsumexp(logits, -1).contiguous()
            nxt = labels[:, 1:]
            picked = logits[:, :-1].gather(-1, nxt.clamp(min=0)[..., None])[..., 0]
            target = torch.zeros(a.batch, a.seq_len)
            target[:, :-1] = torch.where(nxt != -100, picked, 0.0)
            expected["step1.target_logit"] = target
            for name, t in hidden.items():
                expected[f"step1.hidden.{name}"] = t.detach().float().contiguous().clone()
            for h in hooks:
                h.remove()
        result.loss.backward()
        for n, p in named:
            expected[f"step{k}.grad.{n}"] = p.grad.detach().float().contiguous().clone()
        norm = float(torch.nn.utils.clip_grad_norm_(params, a.max_grad_norm))
        optim.step()
        optim.zero_grad(set_to_none=True)
        for n, p in named:
            expected[f"step{k}.param_after.{n}"] = p.detach().float().contiguous().clone()
        expected[f"step{k}.loss"] = result.loss.detach().float().reshape(1).clone()
        losses.append(float(result.loss))
        norms.append(norm)
        print(f"# step {k}: loss {losses[-1]:.6f} grad norm {norm:.6f}", file=sys.stderr)
    save_file(expected, str(out / "expected.safetensors"), metadata={"format": "pt"})
    summary = {
        "losses": losses, "grad_norm_total_preclip": norms, "n_target_tokens": int((labels[:, 1:] != -100).sum()),
        "bf16_loss": bf16_loss, "preset": a.preset, "seq_len": a.seq_len, "batch": a.batch, "dtype": a.dtype, "seed": a.seed, "steps": a.steps,
        "lora": {"r": a.lora_r, "alpha": a.lora_alpha, "dropout": 0.0, "targets": targets, "b_init": a.lora_b},
        "optim": {"name": "torch.optim.AdamW", "lr": a.lr, "weight_decay": a.weight_decay, "betas": [0.9, 0.999],
                  "eps": 1e-8, "max_grad_norm": a.max_grad_norm},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__},
    }
    (out / "expected.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({"out": str(out), "losses": losses, "grad_norm_total_preclip": norms}))


def bf16_step1(cfg, base_state, adapter, ids, labels, a, targets, expected):
    """Step 1's loss and LoRA gradients of the bf16 model: the f32 base cast to bf16, the same
    initial adapter, which PEFT keeps in f32 (autocast_adapter_dtype). Returns the loss."""
    import torch
    from peft import set_peft_model_state_dict
    import recipe

    model = recipe.causal_lm_class(cfg)(cfg)
    model.load_state_dict(base_state)
    model = recipe.with_lora(model.to(torch.bfloat16), a.lora_r, a.lora_alpha, 0.0, targets, rslora=a.rslora, dora=a.dora)
    set_peft_model_state_dict(model, adapter)
    adapter_dtype = torch.float32
    if a.bf16_adapters:
        # What get_peft_model(..., autocast_adapter_dtype=False) leaves on a bf16 model.
        adapter_dtype = torch.bfloat16
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.to(adapter_dtype)
    model.train()
    result = model(input_ids=ids, labels=labels, use_cache=False)
    result.loss.backward()
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert p.dtype == adapter_dtype, f"the adapters should be {adapter_dtype}, {n} is {p.dtype}"
            expected[f"bf16.step1.grad.{n.replace('.default.', '.')}"] = p.grad.detach().float().contiguous().clone()
    print(f"# bf16 step 1: loss {float(result.loss):.6f}", file=sys.stderr)
    return float(result.loss)


if __name__ == "__main__":
    main(parse_args())
