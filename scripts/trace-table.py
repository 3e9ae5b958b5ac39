#!/usr/bin/env python3
"""Where one traced step's GPU time goes, from a Kineto/Chrome trace (`llora bench --trace`,
torch.profiler's export_chrome_trace): the kernels with the most device time (name, calls, ms,
share of the device's busy time) and the step's phases.

Phases come from the bench's own device synchronisations: with `sync_phases` (on CUDA) a bench
step waits for the device after the forward, after the backward and after the optimizer
(`cudaDeviceSynchronize`), so the device work finished by the end of the first wait is the
forward, by the second the backward, by the third the optimizer. For each phase: the device's
busy time (the union of its kernels, copies and sets) and its idle time between the phase's
start and its last activity, the time the device waited for the host to queue work ("host
gap"). A trace without device activity (the CPU) ranks the top-level CPU ops instead, and has
no phases.

Usage: trace-table.py TRACE.json [--top 15] [--json]   (--json: one JSON object; else markdown)
"""
import argparse
import json
import sys

DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
SYNC_NAMES = {"cudaDeviceSynchronize", "hipDeviceSynchronize"}
PHASE_NAMES = ["forward", "backward", "optimizer"]


def load(path):
    with open(path) as f:
        d = json.load(f)
    return d["traceEvents"] if isinstance(d, dict) else d


def union_us(spans):
    """Total length of the union of (start, end) spans, in the spans' unit."""
    total, end = 0.0, None
    for s, e in sorted(spans):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def top_level_cpu_ops(events):
    """CPU ops not nested in another op of the same thread (what the step dispatched itself)."""
    ops = sorted((e for e in events if e.get("cat") == "cpu_op" and e.get("ph") == "X"),
                 key=lambda e: (e.get("tid"), e["ts"], -e.get("dur", 0)))
    out, open_end = [], {}
    for e in ops:
        tid, end = e.get("tid"), e["ts"] + e.get("dur", 0)
        if e["ts"] >= open_end.get(tid, float("-inf")):
            out.append(e)
            open_end[tid] = end
    return out


def phases(device, events):
    """Each phase's device work and span, split at the ends of the device synchronisations."""
    syncs = sorted(e["ts"] + e.get("dur", 0) for e in events
                   if e.get("cat") == "cuda_runtime" and e.get("name") in SYNC_NAMES)
    if not syncs or not device:
        return []
    bounds = syncs + [float("inf")]
    out, start = [], min(e["ts"] for e in device)
    for i, b in enumerate(bounds):
        work = [e for e in device if start <= e["ts"] < b]
        if i == len(syncs) and not work:
            break
        name = PHASE_NAMES[i] if len(syncs) == len(PHASE_NAMES) and i < len(PHASE_NAMES) else (
            "after the last wait" if i == len(syncs) else f"phase {i + 1}")
        spans = [(e["ts"], e["ts"] + e.get("dur", 0)) for e in work]
        busy = union_us(spans)
        last = max((s[1] for s in spans), default=start)
        out.append({"phase": name, "kernels": len(work), "busy_ms": busy / 1e3,
                    "span_ms": (last - start) / 1e3, "host_gap_ms": max(0.0, last - start - busy) / 1e3})
        start = b
    return out


def table(path, top):
    events = [e for e in load(path) if isinstance(e, dict) and e.get("ph") == "X" and "ts" in e]
    device = [e for e in events if e.get("cat") in DEVICE_CATS]
    ranked = device if device else top_level_cpu_ops(events)
    by = {}
    for e in ranked:
        name = e.get("name", "?")
        if e.get("cat") == "gpu_memcpy" or e.get("cat") == "gpu_memset":
            name = f"[{e['cat']}] {name}"
        c, t = by.get(name, (0, 0.0))
        by[name] = (c + 1, t + e.get("dur", 0))
    spans = [(e["ts"], e["ts"] + e.get("dur", 0)) for e in ranked]
    busy = union_us(spans)
    total = sum(t for _, t in by.values())
    rows = sorted(by.items(), key=lambda kv: -kv[1][1])
    out = {
        "trace": path,
        "timeline": "device" if device else "cpu (top-level ops)",
        "events": len(ranked),
        "distinct": len(by),
        "busy_ms": busy / 1e3,
        "wall_ms": ((max(s[1] for s in spans) - min(s[0] for s in spans)) / 1e3) if spans else 0.0,
        "sum_ms": total / 1e3,
        "top": [{"name": n, "calls": c, "ms": t / 1e3, "share": t / total if total else 0.0} for n, (c, t) in rows[:top]],
        "phases": phases(device, events),
    }
    return out


def markdown(t):
    short = lambda s: s if len(s) <= 110 else s[:107] + "..."
    md = [f"`{t['trace']}` ({t['timeline']}): {t['events']} events of {t['distinct']} kinds, busy {t['busy_ms']:.2f} ms "
          f"of {t['wall_ms']:.2f} ms from first to last (sum {t['sum_ms']:.2f} ms)", "",
          "| # | kernel | calls | ms | share |", "|---|---|---|---|---|"]
    for i, r in enumerate(t["top"], 1):
        md.append(f"| {i} | `{short(r['name'])}` | {r['calls']} | {r['ms']:.3f} | {100 * r['share']:.1f}% |")
    if t["phases"]:
        md += ["", "| phase | device activities | busy ms | span ms | host gap ms |", "|---|---|---|---|---|"]
        for p in t["phases"]:
            md.append(f"| {p['phase']} | {p['kernels']} | {p['busy_ms']:.2f} | {p['span_ms']:.2f} | {p['host_gap_ms']:.2f} |")
    return "\n".join(md)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    try:
        t = table(a.trace, a.top)
    except (OSError, ValueError, KeyError) as e:
        print(f"trace-table.py: cannot read {a.trace}: {e}", file=sys.stderr)
        sys.exit(1)
    print(json.dumps(t) if a.json else markdown(t))


if __name__ == "__main__":
    main()
