#!/usr/bin/env bash
# Decode speed of `llora generate` against HF transformers' greedy `generate` (PyTorch + PEFT)
# on this machine, in one run: random HF checkpoints of the tiny and small presets with a PEFT
# adapter (scripts/peer/fixtures.py), a prompt through the Llama 2 tokenizer
# (scripts/llama2-tokenizer.sh; needs node and npm), N new tokens greedy, f32, THREADS threads
# for both. Prints one table: prefill seconds and decode tokens/s (the tokens after the first
# over the time after it), and whether the two continuations are the same ids.
#   ./scripts/bench-generate.sh               # 128 new tokens, all cores
#   NEW=64 THREADS=1 ./scripts/bench-generate.sh
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh --parity >&2
cargo build --release --quiet --bin llora
NEW=${NEW:-128}
THREADS=${THREADS:-$(nproc)}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
./scripts/llama2-tokenizer.sh "$dir/tok" >&2
PROMPT="The Government Accountability Office reviewed federal agencies' plans and found that"
echo "| preset | new tokens | threads | llora prefill s | HF prefill s | llora decode tok/s | HF decode tok/s | llora / HF | same ids |"
echo "|---|---|---|---|---|---|---|---|---|"
for preset in tiny small; do
  .venv/bin/python scripts/peer/fixtures.py --out "$dir/$preset" --preset "$preset" --seq-len 16 --batch 1 \
    --lora-b normal --threads "$THREADS" >/dev/null 2>&1
  mkdir -p "$dir/$preset-base"
  cp "$dir/$preset/config.json" "$dir/$preset/model.safetensors" "$dir/$preset-base/"
  ours=$(./target/release/llora generate --model "$dir/$preset-base" --adapter "$dir/$preset" --tokenizer "$dir/tok" \
    --prompt "$PROMPT" --max-new-tokens "$NEW" --threads "$THREADS" --json 2>/dev/null | tail -n 1)
  req=$(python3 -c 'import json,sys; o=json.loads(sys.argv[1]); print(json.dumps({"prompt_ids": o["prompt_ids"], "max_new_tokens": int(sys.argv[2])}))' "$ours" "$NEW")
  peer=$(echo "$req" | .venv/bin/python scripts/peer/generate.py "$dir/$preset-base" "$dir/$preset" "$THREADS")
  python3 - "$preset" "$NEW" "$THREADS" "$ours" "$peer" <<'PY'
import json, sys
preset, new, threads, ours, peer = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), json.loads(sys.argv[5])
a, b = ours["decode_tokens_per_s"], peer["decode_tokens_per_s"]
print(f"| {preset} | {new} | {threads} | {ours['prefill_s']:.3f} | {peer['prefill_s']:.3f} | {a:.1f} | {b:.1f} | {a / b:.2f} | {ours['ids'] == peer['ids']} |")
PY
done
