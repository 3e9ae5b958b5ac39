#!/usr/bin/env bash
# FP8 against fp32 on the embedded tiny run: for each seed, samples to the 0.925 target in
# fp32 and with compute = "fp8" + FP8 activations + FP8 base weights (same base, same data),
# then both curves of the first seed on one plot.
#   ./scripts/fp8-convergence.sh            # seeds 1 2 3, plot in runs/fp8-vs-fp32.svg
#   SEEDS="1" OUT=docs/fp8-vs-fp32.svg ./scripts/fp8-convergence.sh
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh >&2
cargo build --release --quiet --bin llora
seeds=(${SEEDS:-1 2 3})
out=${OUT:-runs/fp8-vs-fp32.svg}
fp8=(--set precision.compute=fp8 --set precision.fp8_activations=true --set precision.fp8_weights=true)
printf '%-6s %-5s %8s %10s %8s\n' seed mode samples eval_loss ttt_s
for seed in "${seeds[@]}"; do
  for mode in fp32 fp8; do
    extra=(); [[ $mode == fp8 ]] && extra=("${fp8[@]}")
    line=$(./target/release/llora train --set "run.dir=runs/conv-$mode-$seed" --set "run.seed=$seed" \
      --set logging.progress=never "${extra[@]}" 2>/dev/null | tail -1)
    read -r samples loss ttt < <(sed -E 's/.*samples: ([0-9]+) +eval_loss: ([0-9.na\/]+) +time_to_train: ([0-9.]+).*/\1 \2 \3/' <<<"$line")
    printf '%-6s %-5s %8s %10s %8s\n' "$seed" "$mode" "$samples" "$loss" "$ttt"
  done
done
./target/release/llora plot "fp32=runs/conv-fp32-${seeds[0]}" "fp8=runs/conv-fp8-${seeds[0]}" --out "$out" >/dev/null
echo "plot: $out"
