#!/usr/bin/env python3
"""Timed LoRA training steps in PyTorch + HF transformers + PEFT: the peer of `llora bench`.

Same recipe and the same JSON fields as `llora bench`, one JSON line per run: a random base of a
llora preset, PEFT LoRA (r 16, alpha 32, dropout 0.1 on q,k,v,o by default), torch AdamW
(lr 4e-4, wd 1e-4), global-norm clip 0.3, random tokens with the first half of each row masked,
loss = mean over the batch's target tokens.

--dtype fp32: everything f32. bf16: base weights and activations bf16, adapters and AdamW f32
(what from_pretrained(dtype=bfloat16) + get_peft_model gives). bf16-autocast: f32 weights, the
forward under torch.autocast (what HF Trainer(bf16=True) does with an f32 model).

--device cuda[:N]: the model is allocated and initialised on the GPU (HF's random init of the
70B layer's 1.6 B values on the host took over a minute on a GPU node; on the device, seconds), so
its random weights differ from a CPU run's (speed does not depend on them); every clock read waits for the GPU; the JSON adds
peak_cuda_allocated_mb / peak_cuda_reserved_mb over the timed steps and what picks the kernels
(GPU, CUDA, cuDNN, TF32, the SDPA switches).
"""
import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from threads import pin_threads  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "bf16-autocast"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--lora-alpha", type=float, default=32.0)
    ap.add_argument("--lora-dropout", type=float, default=0.1)
    ap.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj")
    ap.add_argument("--dora", action="store_true", help="PEFT's use_dora")
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--weight-decay", type=float, default=1e-4)
    ap.add_argument("--max-grad-norm", type=float, default=0.3)
    ap.add_argument("--tag", default=None, help="copied into the JSON")
    ap.add_argument("--out", default=None, help="also append the JSON line to this file")
    a = ap.parse_args(argv)
    for name in ("seq_len", "batch", "accum", "steps", "threads", "lora_r"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if a.device != "cpu" and not (a.device == "cuda" or (a.device.startswith("cuda:") and a.device[5:].isdigit())):
        ap.error(f"--device {a.device!r}: use cpu, cuda or cuda:N")
    return a


def open_device(torch, spec):
    if spec == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        sys.exit(f"step_bench: --device {spec}, but torch {torch.__version__} sees no CUDA GPU "
                 f"(built for CUDA {torch.version.cuda}); use --device cpu or run on a GPU node")
    index = int(spec[5:]) if ":" in spec else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        sys.exit(f"step_bench: --device {spec}, but torch sees {torch.cuda.device_count()} GPU(s)")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def gpu_facts(torch, dev):
    """What picks the kernels: the card, torch's CUDA and cuDNN, TF32, the SDPA switches."""
    b = torch.backends.cuda
    try:
        tf32 = bool(b.matmul.allow_tf32)
    except (RuntimeError, AttributeError):
        tf32 = None
    sdpa = {"flash": b.flash_sdp_enabled(), "mem_efficient": b.mem_efficient_sdp_enabled(), "math": b.math_sdp_enabled()}
    if hasattr(b, "cudnn_sdp_enabled"):
        sdpa["cudnn"] = b.cudnn_sdp_enabled()
    major, minor = torch.cuda.get_device_capability(dev)
    return {"gpu_name": torch.cuda.get_device_name(dev), "gpu_capability": f"{major}.{minor}",
            "torch_cuda_version": torch.version.cuda, "cudnn_version": torch.backends.cudnn.version(),
            "cuda_matmul_allow_tf32": tf32, "sdp_backends_enabled": sdpa}


def main(a):
    pin_threads(a.threads)
    import torch
    import transformers
    import peft
    import recipe

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(a.threads)
    if a.preset not in recipe.PRESETS:
        sys.exit(f"step_bench: unknown --preset {a.preset!r}: expected one of {', '.join(recipe.PRESETS)}")
    dev = open_device(torch, a.device)
    gpu = dev.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(dev)) if gpu else (lambda: None)

    load0 = recipe.loadavg()
    t_build = time.perf_counter()
    cfg = recipe.hf_config(a.preset, a.seq_len)
    print(f"# step_bench: building {a.preset} on {dev}", file=sys.stderr, flush=True)
    base = recipe.random_model(cfg, a.dtype, a.seed, device=dev if gpu else None)
    model = recipe.with_lora(base, a.lora_r, a.lora_alpha, a.lora_dropout, a.targets.split(","), dora=a.dora)
    model.to(dev)
    model.train()
    sync()
    build_s = time.perf_counter() - t_build
    print(f"# step_bench: built in {build_s:.1f} s", file=sys.stderr, flush=True)
    rss_after_build = recipe.peak_rss_mb()
    params = recipe.trainable(model)
    optim = torch.optim.AdamW(params, lr=a.lr, weight_decay=a.weight_decay)
    gen = torch.Generator().manual_seed(a.seed + 1)
    autocast = a.dtype == "bf16-autocast"

    steps, fwd, bwd, opt, util = [], [], [], [], []
    loss_value, window = float("nan"), None
    for step in range(a.warmup + a.steps):
        if gpu and step == a.warmup:
            sync()
            torch.cuda.reset_peak_memory_stats(dev)
        batches = [recipe.random_batch(gen, a.batch, a.seq_len, cfg.vocab_size) for _ in range(a.accum)]
        batches = [(ids.to(dev), labels.to(dev)) for ids, labels in batches]
        targets = sum(int((labels[:, 1:] != -100).sum()) for _, labels in batches)
        sync()
        c0, t0 = recipe.cpu_seconds(), time.perf_counter()
        f_s = b_s = 0.0
        total = 0.0
        for ids, labels in batches:
            tf = time.perf_counter()
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
                logits = model(input_ids=ids, use_cache=False).logits
            # HF's causal-LM loss as a sum, normalised by the whole step's target tokens.
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].float().reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                ignore_index=-100, reduction="sum") / targets
            sync()
            tb = time.perf_counter()
            loss.backward()
            sync()
            f_s, b_s = f_s + (tb - tf), b_s + (time.perf_counter() - tb)
            total += float(loss.detach())
            del logits, loss
        to = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(params, a.max_grad_norm)
        optim.step()
        optim.zero_grad(set_to_none=True)
        sync()
        t1, c1 = time.perf_counter(), recipe.cpu_seconds()
        loss_value = total
        if step + 1 == max(a.warmup, 1):
            window = (recipe.machine_busy(), recipe.cpu_seconds(), time.perf_counter())
        timed = step >= a.warmup
        if timed:
            steps.append(t1 - t0)
            fwd.append(f_s)
            bwd.append(b_s)
            opt.append(t1 - to)
            util.append((c1 - c0) / (t1 - t0))
        print(f"# step {step} {'timed' if timed else 'warm'} {t1 - t0:.3f}s (fwd {f_s:.3f} bwd {b_s:.3f} "
              f"opt {t1 - to:.3f}) loss {loss_value:.4f} cpu_util {(c1 - c0) / (t1 - t0):.2f}",
              file=sys.stderr, flush=True)

    others = None
    if window and window[0]:
        busy0, ours0, wall0 = window
        busy1 = recipe.machine_busy()
        if busy1:
            import os
            cores = os.cpu_count() or 1
            machine = (busy1[0] - busy0[0]) / max(1, busy1[1] - busy0[1]) * cores
            ours = (recipe.cpu_seconds() - ours0) / (time.perf_counter() - wall0)
            others = max(0.0, machine - ours)
    med = statistics.median(steps)
    seqs = a.batch * a.accum
    flops = recipe.flop_model(cfg, seqs, a.seq_len, a.lora_r)
    per_step = flops.pop("flops_per_step")
    r4 = lambda x: round(x, 4)  # noqa: E731
    record = {
        "preset": a.preset, "seq_len": a.seq_len, "batch": a.batch, "dtype": a.dtype, "accum": a.accum, "world": 1,
        "threads": a.threads, "impl": f"pytorch {torch.__version__} + transformers {transformers.__version__} + peft {peft.__version__}",
        "attn_impl": cfg._attn_implementation, "warmup": a.warmup, "steps": a.steps,
        "step_s_median": r4(med), "step_s_min": r4(min(steps)), "step_s_max": r4(max(steps)),
        "step_s_p25": r4(recipe.quantile(steps, 0.25)), "step_s_p75": r4(recipe.quantile(steps, 0.75)),
        "fwd_s_median": r4(statistics.median(fwd)), "bwd_s_median": r4(statistics.median(bwd)),
        "opt_s_median": r4(statistics.median(opt)),
        "tokens_per_s": round(seqs * a.seq_len / med, 2),
        "peak_rss_mb": round(recipe.peak_rss_mb(), 1), "rss_hwm_after_build_mb": round(rss_after_build, 1),
        "trainable_params": sum(p.numel() for p in params), "total_params": sum(p.numel() for p in model.parameters()),
        "final_loss": round(loss_value, 5), "dora": a.dora,
        "flops_per_step": per_step, "gflops_per_s": round(per_step / med / 1e9, 2),
        "model_tflops_per_s": round(per_step / med / 1e12, 4), "flops_breakdown": flops,
        "cpu_util_median": round(statistics.median(util), 2),
        "other_procs_cpu_cores": None if others is None else round(others, 2),
        "loadavg_start": load0, "loadavg_end": recipe.loadavg(), "build_s": round(build_s, 2),
        "step_times": [r4(x) for x in steps], "device": str(dev),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
                     "python": platform.python_version()},
    }
    if gpu:
        record.update(gpu_facts(torch, dev))
        record.update(peak_cuda_allocated_mb=round(torch.cuda.max_memory_allocated(dev) / 2**20, 1),
                      peak_cuda_reserved_mb=round(torch.cuda.max_memory_reserved(dev) / 2**20, 1))
    if a.tag:
        record["tag"] = a.tag
    line = json.dumps(record)
    print(line, flush=True)
    if a.out:
        with open(a.out, "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main(parse_args())
