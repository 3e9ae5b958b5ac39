#!/usr/bin/env bash
# FP8 memory and cost, per decoder layer of one shape: the bytes of the activations the
# reduced-precision ops keep for backward (the covered tensors: the inputs LoRA's A and B keep
# for their weight gradients, and SwiGLU's gate and up) and of the frozen base weights, in
# fp32, bf16 and FP8, plus the step time of each (on the CPU FP8 is emulated: quantise-
# dequantise around f32 GEMMs, so it costs time instead of saving it).
# Bytes are read from the tensors the ops actually stored, not computed from shapes.
#   ./scripts/bench-fp8.sh                       # small, 1024 tokens, 3 timed steps
#   ./scripts/bench-fp8.sh llama2-70b-1layer 1024 2
set -euo pipefail
cd "$(dirname "$0")/.."
preset=${1:-small}
seq=${2:-1024}
steps=${3:-3}
./scripts/setup.sh >&2
cargo build --release --quiet --bin llora
out=$(mktemp)
trap 'rm -f "$out"' EXIT
run() { # tag, flags...
  local tag=$1; shift
  ./target/release/llora bench --preset "$preset" --seq-len "$seq" --steps "$steps" --warmup 1 --threads 2 \
    --tag "$tag" "$@" --out "$out" 2>/dev/null >/dev/null
}
run fp32 --precision fp32
run bf16 --precision bf16
run fp8 --precision fp8
run fp8+act --precision fp8 --fp8-activations
run fp8+act+w --precision fp8 --fp8-activations --fp8-weights
python3 - "$out" "$preset" "$seq" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
by = {r["tag"]: r for r in rows}
print(f"# {sys.argv[2]}, seq {sys.argv[3]}, batch 1, 2 threads; per decoder layer")
print(f"{'mode':<12} {'saved act MB':>12} {'bf16/this':>9} {'base W MB':>10} {'bf16/this':>9} {'step s (med)':>12} {'min':>7} {'max':>7} {'x fp32':>7}")
bf, f32 = by["bf16"], by["fp32"]
for r in rows:
    a, w = r["saved_act_bytes_per_layer"], r["base_weight_bytes_per_layer"]
    print(f"{r['tag']:<12} {a/1e6:>12.3f} {bf['saved_act_bytes_per_layer']/a:>9.3f} {w/1e6:>10.3f} "
          f"{bf['base_weight_bytes_per_layer']/w:>9.3f} {r['step_s_median']:>12.3f} {r['step_s_min']:>7.3f} "
          f"{r['step_s_max']:>7.3f} {r['step_s_median']/f32['step_s_median']:>7.2f}")
noise = [r.get("other_procs_cpu_cores") for r in rows]
print(f"# other processes' CPU use during the timed steps (cores): {noise}")
for r in rows:
    print(json.dumps({"mode": r["tag"], "saved_act_bytes_per_layer": r["saved_act_bytes_per_layer"],
                      "base_weight_bytes_per_layer": r["base_weight_bytes_per_layer"], "step_s": r["step_s_median"]}))
PY
