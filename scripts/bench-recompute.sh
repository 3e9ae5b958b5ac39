#!/usr/bin/env bash
# Block activation recomputation (train.recompute_layers): peak RSS and step time of `llora bench`
# with no block, and every block, recomputed, on the small preset at 4096 and 8192 tokens and one
# Llama 2 70B layer at 8192 tokens (fp32, 2 threads, batch 1), and `llora plan`'s prediction of
# each peak. Prints one table.
#   ./scripts/bench-recompute.sh                          # the three shapes (the 70B layer: ~15 min)
#   SHAPES="small:1024:1:2" ./scripts/bench-recompute.sh  # preset:seq:warmup:steps
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh >&2
cargo build --release --quiet --bin llora
shapes=(${SHAPES:-small:4096:1:2 small:8192:1:2 llama2-70b-1layer:8192:0:1})
out=$(mktemp)
for shape in "${shapes[@]}"; do
  IFS=: read -r preset seq warm steps <<<"$shape"
  for r in 0 1000; do
    echo "# $preset s$seq recompute_layers=$r" >&2
    ./target/release/llora bench --preset "$preset" --seq-len "$seq" --batch 1 --threads 2 --warmup "$warm" \
      --steps "$steps" --recompute-layers "$r" 2>/dev/null | tail -1 >>"$out"
  done
done
python3 - "$out" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip().startswith("{")]
print("| shape | recomputed blocks | step s median | peak RSS MB | planned peak MB | planned / measured | RSS after build MB | step RSS above build MB |")
print("|---|---|---|---|---|---|---|---|")
for r in rows:
    blocks = "none" if r["recompute_layers"] == 0 else "all"
    extra = r["peak_rss_mb"] - r["rss_hwm_after_build_mb"]
    plan = r["planned_peak_mb"]
    print(f'| {r["preset"]} s{r["seq_len"]} | {blocks} | {r["step_s_median"]:.2f} | {r["peak_rss_mb"]:.0f} | {plan:.0f} | {plan / r["peak_rss_mb"]:.3f} | {r["rss_hwm_after_build_mb"]:.0f} | {extra:.0f} |')
PY
rm -f "$out"
