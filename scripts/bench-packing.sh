#!/usr/bin/env bash
# Sample packing against padding, on a synthetic chat-like corpus, in one run: llora
# padded (micro-batches of 8 samples padded to their longest, as TRL/axolotl pad by default),
# llora packed (rows of 4096 tokens, every sample attending only to itself) and PyTorch + HF
# transformers + PEFT padded (scripts/peer/padded_train.py, the same batches of 8), on the
# `tiny` and `small` presets (random bases, LoRA r 16 on q/k/v/o, 2 threads).
#
# The corpus: DOCS samples (default 256) with lengths log-normal around a median of 250 tokens
# (sigma 1.09, so that 5% are over 1500), clipped to [16, 4096]; 40% of each is prompt (label
# -100). Printed first, with what `llora data inspect` says of packing it.
#
# Reported per preset and run: target tokens per second (tokens that take a loss) and the time
# to one epoch of the corpus, from the samples per second of the timed steps. `tiny` trains a
# whole epoch each way; `small` (~200 tokens/s on 2 cores) trains STEPS_SMALL steps (default 3).
#
# On a GPU node (no Rust there: scripts/gpu-check.sh runs it from the bundle), give the binary
# and the device: LLORA=path skips the set-up and the build (and loads the node's torch
# libraries, scripts/node-libs.sh), PYTHON is the peer's Python (with
# torch, transformers, peft, numpy, pyarrow), DEVICE=cuda:0 runs both sides there in
# PRECISION (default bf16 on CUDA, fp32 on the CPU; the peer in the same dtype). PRESETS picks
# the presets (default "tiny small"). The last line printed is every result as JSON.
#   ./scripts/bench-packing.sh              # ~15 minutes on 2 cores
#   DOCS=128 STEPS_SMALL=2 ./scripts/bench-packing.sh
#   LLORA=./llora PYTHON=python3 DEVICE=cuda:0 STEPS_SMALL=20 scripts/bench-packing.sh
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z ${LLORA:-} ]]; then
  ./scripts/setup.sh --parity >&2
  cargo build --release --quiet --bin llora
fi
llora=${LLORA:-./target/release/llora}
py=${PYTHON:-.venv/bin/python}
[[ $py == */* ]] && py="$(cd "$(dirname "$py")" && pwd)/$(basename "$py")" # the peer runs from scripts/peer
# A given binary may be a bundle's, built elsewhere: it loads the node's torch libraries.
[[ -n ${LLORA:-} ]] && PYTHON=$py source scripts/node-libs.sh
device=${DEVICE:-cpu}
if [[ $device == cuda* ]]; then precision=${PRECISION:-bf16}; else precision=${PRECISION:-fp32}; fi
presets=${PRESETS:-tiny small}
threads=${THREADS:-2}
out=${OUT:-$(mktemp -d)}
docs=${DOCS:-256}
steps_small=${STEPS_SMALL:-3}
mkdir -p "$out"
echo "llora on $device in $precision; the peer in the same dtype" >&2

# 1. The corpus.
"$py" - "$out" "$docs" <<'PY'
import sys
import numpy as np, pyarrow as pa, pyarrow.parquet as pq
out, n = sys.argv[1], int(sys.argv[2])
rng = np.random.default_rng(0)
def write(path, count):
    lengths = np.clip(np.round(rng.lognormal(np.log(250), 1.09, count)), 16, 4096).astype(np.int64)
    ids, labels = [], []
    for length in lengths:
        x = rng.integers(3, 32000, length)
        x[0] = 1
        y = x.copy()
        y[: int(length * 0.4)] = -100
        ids.append(x.tolist()); labels.append(y.tolist())
    pq.write_table(pa.table({"input_ids": ids, "labels": labels}), path)
    return lengths
lengths = write(f"{out}/train.parquet", n)
write(f"{out}/eval.parquet", 4)
print(f"corpus: {n} samples, median {np.median(lengths):.0f} tokens, mean {lengths.mean():.0f}, "
      f"p95 {np.percentile(lengths, 95):.0f}, {100 * (lengths > 1500).mean():.1f}% over 1500, max {lengths.max()}")
PY
inspect=$("$llora" data inspect "$out/train.parquet" --vocab 32000 --max-seq-len 4096 | tail -1)
packed_rows=$("$py" -c 'import json,sys; print(json.loads(sys.argv[1])["packed_rows"])' "$inspect")
"$py" - "$inspect" <<'PY'
import json, sys
r = json.loads(sys.argv[1])
print("rows of 4096: padded {} ({:.1f}% tokens), packed {} ({:.1f}% tokens)".format(
    r["padded_rows"], 100 * r["padded_efficiency"], r["packed_rows"], 100 * r["packing_efficiency"]))
PY

# 2. The runs. A config per run; eval only at the end (every_samples past the run).
run() { # name preset packing global steps
  local name=$1 preset=$2 packing=$3 global=$4 steps=$5
  cat >"$out/$name.toml" <<EOF
[model]
preset = "$preset"
[lora]
targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
[data]
train = "$out/train.parquet"
eval = "$out/eval.parquet"
max_seq_len = 4096
packing = $packing
[train]
global_batch_size = $global
micro_batch_size = $global
[schedule]
max_steps = $steps
[optim]
lr = 4e-4
[eval]
every_samples = 1000000
target_loss = 1e-9
batch_size = 1
[precision]
compute = "$precision"
[run]
device = "$device"
threads = $threads
dir = "$out/$name"
[logging]
progress = "never"
EOF
  rm -rf "${out:?}/$name"
  echo "# $name" >&2
  local rc=0
  OMP_WAIT_POLICY=PASSIVE "$llora" train "$out/$name.toml" >/dev/null 2>"$out/$name.log" || rc=$?
  # The packed attention route the run took (logged once per kind of problem on CUDA).
  local route=per-document
  grep -q "cuda-flash-varlen (verified" "$out/$name.log" && route=cuda-flash-varlen
  # Its unreachable target ends every run "aborted" (exit 1, saying so): anything else failed.
  local ok=true
  [[ $rc == 0 ]] || { [[ $rc == 1 ]] && grep -q "did not reach eval.target_loss" "$out/$name.log"; } || ok=false
  "$py" - "$out/$name/metrics.jsonl" "$name" "$preset" "$global" "$ok" "$route" "$packing" <<'PY' >>"$out/results.jsonl"
import json, sys
path, name, preset, glob, ok, route, packing = sys.argv[1:]
try:
    rows = [json.loads(l) for l in open(path) if '"loss"' in l]
except FileNotFoundError:
    rows = []
rows = rows[1:] if len(rows) > 2 else rows  # the first step warms the allocator up
record = {"run": name, "preset": preset, "steps": len(rows), "ok": ok == "true" and bool(rows)}
if packing == "true":
    record["attention"] = route
if rows:
    t = sum(r["step_s"] for r in rows)
    docs = sum(r.get("documents", int(glob)) for r in rows)
    record.update({"seconds": t, "samples_per_s": docs / t,
                   "target_tokens_per_s": sum(r["target_tokens"] for r in rows) / t})
print(json.dumps(record))
PY
}
rm -f "$out/results.jsonl"
for preset in $presets; do
  if [[ $preset == tiny ]]; then
    run tiny-padded tiny false 8 "$((docs / 8))"
    run tiny-packed tiny true 1 "$packed_rows"
  else
    run "$preset-padded" "$preset" false 8 "$steps_small"
    run "$preset-packed" "$preset" true 1 "$steps_small"
  fi
done
for preset in $presets; do
  steps=$([[ $preset == tiny ]] && echo "$((docs / 8))" || echo "$steps_small")
  echo "# $preset-peft-padded" >&2
  peer_dtype=$([[ $precision == fp32 ]] && echo fp32 || echo bf16)
  (cd scripts/peer && OMP_WAIT_POLICY=PASSIVE "$py" padded_train.py --preset "$preset" --data "$out/train.parquet" \
     --batch 8 --steps "$steps" --warmup 1 --threads "$threads" --device "${device%%:*}" --dtype "$peer_dtype" \
     --tag "$preset-peft-padded") 2>"$out/$preset-peft-padded.log" | tail -1 >>"$out/results.jsonl"
done

# 3. The table.
"$py" - "$out/results.jsonl" "$docs" "$presets" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
docs = int(sys.argv[2])
by = {r.get("run") or r["tag"]: r for r in rows}
print(f"\n{'run':<20} {'steps':>6} {'target tok/s':>13} {'samples/s':>10} {'epoch s':>9}  vs padded")
for preset in sys.argv[3].split():
    if "target_tokens_per_s" not in by.get(f"{preset}-padded", {}):
        print(f"{preset}: the padded run failed (see its log)")
        continue
    base = by[f"{preset}-padded"]["target_tokens_per_s"]
    for kind in ["padded", "packed", "peft-padded"]:
        r = by.get(f"{preset}-{kind}")
        if r is None or "target_tokens_per_s" not in r:
            print(f"{preset + '-' + kind:<20} failed" if r else f"{preset + '-' + kind:<20} missing")
            continue
        epoch = docs / r["samples_per_s"]
        print(f"{preset + '-' + kind:<20} {r['steps']:>6} {r['target_tokens_per_s']:>13.1f} {r['samples_per_s']:>10.2f} "
              f"{epoch:>9.0f}  {r['target_tokens_per_s'] / base:.2f}x")
print("epoch s: the corpus's samples / the samples per second measured over the timed steps "
      "(llora's first step and the peer's warm-up step not timed)")
print(json.dumps(rows))
PY
