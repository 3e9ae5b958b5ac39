#!/usr/bin/env bash
# One Llama 2 70B decoder layer (d 8192, 64 heads, 8 KV heads, I 28672, vocab 32000) with LoRA,
# forward + backward + AdamW at batch 1 on the CPU, at the benchmark's 8192 tokens (and shorter
# ones for the trend): step time and peak RSS per sequence length, beside the bytes that the
# S×S attention-score matrix alone would take in f32 (what Burn's own autodiff attention keeps).
#
#   ./scripts/bench-70b-layer.sh                 # 1024 2048 8192
#   ./scripts/bench-70b-layer.sh 8192            # one length
#   THREADS=2 STEPS=1 ./scripts/bench-70b-layer.sh
# Needs ~16 GB of free memory at 8192 tokens and ~4 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh >&2
cargo build --release --quiet --bin llora
lens=("${@:-1024 2048 8192}")
read -r -a lens <<<"${lens[*]}"
out=$(mktemp)
for s in "${lens[@]}"; do
  echo "# llama2-70b-1layer, $s tokens ..." >&2
  ./target/release/llora bench --preset llama2-70b-1layer --seq-len "$s" --batch 1 \
    --warmup "${WARMUP:-0}" --steps "${STEPS:-1}" --threads "${THREADS:-2}" --tag "70b-layer-s$s" \
    2>/dev/null | tail -1 >>"$out"
done
python3 - "$out" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print(f"{'seq':>6} {'step s':>8} {'fwd s':>7} {'bwd s':>7} {'GFLOP/s':>8} {'peak RSS GB':>12} {'S×S scores GB':>14} {'attention':>14}")
for r in rows:
    s = r["seq_len"]
    scores = 64 * s * s * 4 / 1e9  # one layer's 64 heads, f32
    print(f"{s:>6} {r['step_s_median']:>8.2f} {r['fwd_s_median']:>7.2f} {r['bwd_s_median']:>7.2f} "
          f"{r['gflops_per_s']:>8.1f} {r['peak_rss_mb']/1000:>12.2f} {scores:>14.2f} {r['attn_impl']:>14}")
others = max((r.get("other_procs_cpu_cores") or 0) for r in rows)
print(f"# threads {rows[0]['threads']}; other processes used up to {others:.2f} cores during the timed steps")
PY
rm -f "$out"
