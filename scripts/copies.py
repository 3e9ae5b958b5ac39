#!/usr/bin/env python3
"""Where a step's copies come from: every `aten::copy_` of a Kineto trace (`llora bench --trace`)
accounted by the op that asked for it, with the bytes it wrote.

    python3 scripts/copies.py TRACE.json [--top N]

Each copy is classed by its chain of enclosing ops (same thread, by time): a cast
(`aten::to`/`_to_copy` to another dtype), a move (another device), a layout fix (`contiguous`, or
`reshape` of a strided view, cloning), a clone, or a copy llora's code asked for itself (no
aten op around it: `Tensor::copy_`, the stand-ins' writes into their outputs). On a GPU trace
each is one `direct_copy_kernel` launch (a no-op copy launches nothing and is not in the trace).
Prints one table row per (class, outermost op, shapes), most bytes first, and the totals.
Standard library only.
"""

import argparse
import collections
import json
import math
import sys

SIZES = {"float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2, "bool": 1, "unsigned char": 1,
         "signed char": 1, "long int": 8, "int": 4, "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1}


def contiguous(dims, strides):
    expect = 1
    for d, s in zip(reversed(dims), reversed(strides)):
        if d != 1 and s != expect:
            return False
        expect *= d
    return True


def classify(copy, chain):
    """The copy's class and the op that asked for it (the outermost aten op around it)."""
    names = [e["name"] for e in chain]
    args = copy.get("args", {})
    types, dims, strides = args.get("Input type", []), args.get("Input Dims", []), args.get("Input Strides", [])
    outer = names[0] if names else "(llora's own copy_)"
    if len(types) >= 2 and types[0] != types[1]:
        return "cast", outer
    if "aten::_to_copy" in names:
        return "move", outer
    src_contig = len(dims) >= 2 and len(strides) >= 2 and contiguous(dims[1], strides[1])
    if "aten::contiguous" in names or "aten::reshape" in names:
        return ("layout" if not src_contig else "clone"), outer
    if "aten::clone" in names:
        return "clone", outer
    if not names:
        return ("own copy (strided source)" if not src_contig else "own copy"), outer
    return "inside " + names[-1], outer


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    events = [e for e in json.load(open(a.trace))["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    by_thread = collections.defaultdict(list)
    for e in events:
        by_thread[e["tid"]].append(e)
    rows = collections.defaultdict(lambda: [0, 0])
    totals = collections.defaultdict(lambda: [0, 0])
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []
        for e in evs:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] < e["ts"] + e["dur"] - 1e-3:
                stack.pop()
            if e["name"] == "aten::copy_":
                chain = [s for s in stack if s["name"].startswith("aten::")]
                kind, outer = classify(e, chain)
                args = e.get("args", {})
                dims = args.get("Input Dims", [[]])[0]
                size = SIZES.get((args.get("Input type") or ["float"])[0], 4)
                nbytes = math.prod(dims) * size if dims else size
                key = (kind, outer, str(dims))
                rows[key][0] += 1
                rows[key][1] += nbytes
                totals[kind][0] += 1
                totals[kind][1] += nbytes
            stack.append(e)
    print("| class | asked for by | destination shape | copies | bytes |")
    print("|---|---|---|---|---|")
    for (kind, outer, dims), (n, b) in sorted(rows.items(), key=lambda kv: -kv[1][1])[: a.top]:
        print(f"| {kind} | `{outer}` | {dims} | {n} | {b} |")
    print()
    print("| class | copies | bytes |")
    print("|---|---|---|")
    for kind, (n, b) in sorted(totals.items(), key=lambda kv: -kv[1][1]):
        print(f"| {kind} | {n} | {b} |")
    n, b = sum(v[0] for v in totals.values()), sum(v[1] for v in totals.values())
    print(f"| **all** | **{n}** | **{b}** |")


if __name__ == "__main__":
    sys.exit(main())
