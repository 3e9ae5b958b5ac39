#!/usr/bin/env bash
# Preference tuning (DPO) on the embedded default's tiny model, on the CPU: the demo's base
# (pre-trained first if runs/demo-base is not there yet), LoRA trained on synthetic preference
# pairs (the chosen summary under its report's topic's abstract, the rejected one under another
# topic's), the reference the base with the adapters off. Each evaluation prints the held-out
# pairs' reward accuracy and margin; metrics.jsonl and runs/tiny-cpu-dpo/tensorboard hold
# them per step. Extra arguments go to `llora train` (e.g. --set dpo.loss="ipo").
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
./scripts/setup.sh
cargo build --release --bin llora
exec ./target/release/llora train \
  --set 'train.objective="dpo"' --set mlperf.check=false --set eval.target_loss=0.1 \
  --set schedule.max_steps=64 --set 'run.dir="runs/tiny-cpu-dpo"' "$@"
