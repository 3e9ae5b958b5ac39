#!/usr/bin/env python3
"""An HF checkpoint with its decoder's linear weights replaced by their NF4 round trip through
bitsandbytes: the base PEFT computes on in QLoRA, in f32, for llora's `model.quantize = "nf4"`.

usage: nf4_base.py BASE OUT [--single]

Every `model.layers.*.{self_attn,mlp}.*_proj.weight` of BASE goes through
`bitsandbytes.functional.quantize_4bit` (blocksize 64, NF4, double quantisation unless
`--single`) and back to f32 through bitsandbytes' reference dequantisation (its default
backend, which its CUDA kernel agrees with: the CPU kernel of bitsandbytes 0.50.2 puts the
block boundaries at each row's start when a row's width is not a multiple of the block, e.g.
688-wide down_proj rows, and is 5x further from the weights there); the rest is copied. Writes
OUT/model.safetensors and OUT/config.json. Exits 3 when bitsandbytes is not installed.
"""
import re
import shutil
import sys
from pathlib import Path

try:
    import bitsandbytes.functional as F
except ImportError:
    sys.exit(3)
import torch  # noqa: E402
from bitsandbytes.backends.default.ops import _dequantize_4bit_compute  # noqa: E402
from bitsandbytes.backends.utils import _get_4bit_code  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402


def nf4_round_trip(w, double):
    """`w` through bitsandbytes' NF4 (blocks of 64, its double quantisation when `double`) and
    back to f32 by its reference dequantisation (flat blocks over the row-major tensor)."""
    q, state = F.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=double)
    absmax = F.dequantize_blockwise(state.absmax, state.state2) + state.offset if double else state.absmax
    code = _get_4bit_code("nf4", q.device)
    return _dequantize_4bit_compute(q.reshape(-1), absmax.float(), code, 64, list(w.shape), torch.float32)


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if len(args) != 2:
        sys.exit(__doc__)
    base, out = Path(args[0]), Path(args[1])
    double = "--single" not in sys.argv
    out.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(base / "model.safetensors"))
    for name, w in tensors.items():
        if re.fullmatch(r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight", name):
            tensors[name] = nf4_round_trip(w.float(), double).reshape(w.shape).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(base / "config.json", out / "config.json")


if __name__ == "__main__":
    main()
