#!/usr/bin/env python3
"""bitsandbytes' NF4 of a tensor: the reference for llora's `precision::nf4`.

usage: nf4_reference.py IN OUT

IN (safetensors) holds f32 `values` [n]. OUT gets, from `bitsandbytes.functional.quantize_4bit`
on the CPU (blocksize 64, quant_type "nf4"): without double quantisation `codes` (uint8,
packed as bitsandbytes packs them), `absmax` (f32) and `dequantized` (f32); with it
(compress_statistics=True) `double.codes`, `double.absmax` (the scales as they dequantise, f32)
and `double.dequantized`; and `dynamic_map`, bitsandbytes' 8-bit code for the scales.
Exits 3 when bitsandbytes is not installed (the caller reports the check as skipped).
"""
import sys

try:
    import bitsandbytes.functional as F
except ImportError:
    sys.exit(3)
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    x = load_file(sys.argv[1])["values"].float()
    out = {"dynamic_map": F.create_dynamic_map().float()}
    for prefix, double in (("", False), ("double.", True)):
        q, state = F.quantize_4bit(x, blocksize=64, quant_type="nf4", compress_statistics=double)
        absmax = F.dequantize_blockwise(state.absmax, state.state2) + state.offset if double else state.absmax
        out[prefix + "codes"] = q.reshape(-1).contiguous()
        out[prefix + "absmax"] = absmax.float().contiguous()
        # A 1-D tensor of odd length: bitsandbytes' CPU kernel falls back to its reference path.
        out[prefix + "dequantized"] = F.dequantize_4bit(q, state).float().reshape(-1).contiguous()
    save_file(out, sys.argv[2])


if __name__ == "__main__":
    main()
