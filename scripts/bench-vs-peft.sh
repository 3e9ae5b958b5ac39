#!/usr/bin/env bash
# llora against the peer (PyTorch + HF transformers + PEFT, scripts/peer/step_bench.py)
# on identical LoRA training shapes: fp32 (or DTYPE=bf16: llora --precision bf16 against the peer
# with its base in bf16 and PEFT's f32 adapters), 2 threads, batch 1, runs alternating A B A B so that
# machine noise hits both. Prints one table (step time median/min/max over all timed steps of
# all rounds, tokens/s, GFLOP/s by the peer's FLOP model, peak RSS, llora/peer ratios), then one
# JSON line per shape.
#
#   ./scripts/bench-vs-peft.sh                       # all four shapes, 2 rounds
#   ROUNDS=3 SHAPES="tiny:512" ./scripts/bench-vs-peft.sh
#   DTYPE=bf16 ./scripts/bench-vs-peft.sh           # both in bf16
# Takes ~15 minutes for the default set on 2 cores (the 70B layer dominates).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh --parity >&2
cargo build --release --quiet --bin llora
peer=scripts/peer/step_bench.py
shapes=(${SHAPES:-tiny:512:3:10 tiny:2048:2:5 small:1024:2:5 llama2-70b-1layer:1024:1:3})
rounds=${ROUNDS:-2}
dtype=${DTYPE:-fp32}
out=$(mktemp)
for shape in "${shapes[@]}"; do
  IFS=: read -r preset seq warm steps <<<"$shape"
  warm=${warm:-2}; steps=${steps:-5}
  for r in $(seq "$rounds"); do
    common=(--preset "$preset" --seq-len "$seq" --batch 1 --threads 2 --warmup "$warm" --steps "$steps")
    echo "# $preset s$seq $dtype round $r: llora" >&2
    ./target/release/llora bench "${common[@]}" --precision "$dtype" --tag "llora" 2>/dev/null | tail -1 >>"$out"
    echo "# $preset s$seq round $r: peer" >&2
    .venv/bin/python "$peer" "${common[@]}" --dtype "$dtype" --tag "peer" 2>/dev/null | tail -1 >>"$out"
  done
done
python3 - "$out" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
shapes = []
for r in rows:
    k = (r["preset"], r["seq_len"])
    if k not in shapes:
        shapes.append(k)
def agg(impl, k):
    rs = [r for r in rows if r.get("tag") == impl and (r["preset"], r["seq_len"]) == k]
    steps = [t for r in rs for t in r["step_times"]]
    med = statistics.median(steps)
    return dict(med=med, lo=min(steps), hi=max(steps), tok=k[1] / med, gf=rs[0]["flops_per_step"] / med / 1e9,
                rss=max(r["peak_rss_mb"] for r in rs), noise=max((r.get("other_procs_cpu_cores") or 0) for r in rs))
print(f"{'shape':<24} {'impl':<6} {'median s':>9} {'min s':>8} {'max s':>8} {'tok/s':>8} {'GFLOP/s':>8} {'peak RSS MB':>12} {'ratio':>6} {'rss ratio':>9}")
lines = []
for k in shapes:
    a, b = agg("llora", k), agg("peer", k)
    name = f"{k[0]} s{k[1]}"
    for impl, x in (("llora", a), ("peer", b)):
        ratio = f"{a['med']/b['med']:.2f}" if impl == "llora" else ""
        rr = f"{a['rss']/b['rss']:.2f}" if impl == "llora" else ""
        print(f"{name:<24} {impl:<6} {x['med']:>9.3f} {x['lo']:>8.3f} {x['hi']:>8.3f} {x['tok']:>8.0f} {x['gf']:>8.1f} {x['rss']:>12.0f} {ratio:>6} {rr:>9}")
    lines.append(json.dumps({"shape": name, "ratio": round(a["med"] / b["med"], 3), "rss_ratio": round(a["rss"] / b["rss"], 3),
                             "llora_step_s": round(a["med"], 4), "peer_step_s": round(b["med"], 4),
                             "other_procs_cpu_cores_max": round(max(a["noise"], b["noise"]), 2)}))
print("\n".join(lines))
PY
rm -f "$out"
