#!/usr/bin/env bash
# Memory of loading and of sharded frozen weights; prints two tables.
# 1. Loading: a random 2.0 GB bf16 checkpoint (scripts/make-bf16-checkpoint.py, kept in
#    ~/.cache/llora/bf16-2g) loaded into FP8 and into bf16 storage by `llora bench --load`:
#    peak RSS against the bound (runtime RSS before loading + weights as stored + the largest
#    tensor in f32).
# 2. Sharding: `llora bench` on 2 ranks (torchrun, Gloo) with frozen weights replicated and
#    sharded: base weight bytes per layer on each rank, peak RSS of rank 0, final loss (equal).
# 4. NF4 (QLoRA): `llora bench` with the frozen weights in bf16 and in NF4 (with and without
#    double quantisation), bf16 compute, on NF4_SHAPES (default one Llama 2 70B layer at 256
#    tokens): frozen weight bytes per layer and their ratio to bf16's, step time, peak RSS.
# 3. The planner: `llora plan`'s prediction (`planned_peak_mb`) against the measured peak RSS
#    (and the allocator's peaks of live bytes and of resident pages) on the PLAN_SHAPES; a
#    shape ending in ":purge" runs with jemalloc purging freed pages (MALLOC_CONF
#    dirty_decay_ms:1000) instead of keeping them, llora's default.
#   ./scripts/bench-memory.sh
#   SHARD_SHAPES="small:512:fp32" ./scripts/bench-memory.sh   # preset:seq:precision
#   PLAN_SHAPES="tiny:1024:fp32:0:1" ./scripts/bench-memory.sh  # preset:seq:precision:recompute:ranks[s][:purge]
#   SECTIONS=plan ./scripts/bench-memory.sh                  # any of load,shard,plan,nf4
#   NF4_SHAPES="small:512" SECTIONS=nf4 ./scripts/bench-memory.sh
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh >&2
cargo build --release --quiet --bin llora
export OMP_WAIT_POLICY=PASSIVE
ckpt=${LLORA_BENCH_CHECKPOINT:-$HOME/.cache/llora/bf16-2g}
if [ ! -f "$ckpt/model.safetensors.index.json" ]; then
  echo "# writing a 2.0 GB bf16 checkpoint to $ckpt" >&2
  mkdir -p "$ckpt"
  .venv/bin/python scripts/make-bf16-checkpoint.py "$ckpt" 18
fi
out=$(mktemp)
sections=${SECTIONS:-load,shard,plan,nf4}
precision_args() {
  case $1 in
    fp8) echo --precision fp8 --fp8-weights --fp8-activations ;;
    bf16) echo --precision bf16 ;;
    *) echo --precision fp32 ;;
  esac
}
[[ $sections == *load* ]] && for p in "--precision fp8 --fp8-weights" "--precision bf16" "--precision fp32"; do
  echo "# load $p" >&2
  # shellcheck disable=SC2086
  ./target/release/llora bench --load "$ckpt" $p --threads 2 2>/dev/null | tail -1 >>"$out"
done
shapes=(${SHARD_SHAPES:-small:512:fp32 llama2-70b-1layer:512:fp8})
[[ $sections == *shard* ]] && for shape in "${shapes[@]}"; do
  IFS=: read -r preset seq precision <<<"$shape"
  extra=()
  [ "$precision" = fp8 ] && extra=(--precision fp8 --fp8-weights --fp8-activations)
  for shard in "" --shard-frozen-weights; do
    echo "# $preset s$seq $precision ${shard:-replicated} on 2 ranks" >&2
    .venv/bin/torchrun --standalone --nproc-per-node 2 --no-python ./target/release/llora bench --preset "$preset" \
      --seq-len "$seq" --threads 1 --warmup 1 --steps 2 "${extra[@]}" $shard 2>/dev/null | tail -1 \
      | python3 -c "import json,sys; d=json.load(sys.stdin); d['sharded']=bool('$shard'); print(json.dumps(d))" >>"$out"
  done
done
plan_shapes=(${PLAN_SHAPES:-tiny:1024:fp32:0:1 tiny:1024:bf16:0:1 tiny:4096:bf16:0:1 tiny:4096:fp8:0:1 small:1024:bf16:0:1 small:2048:fp32:0:1 small:2048:bf16:0:1 \
  small:4096:fp32:8:1 small:4096:bf16:8:1 small:4096:fp8:4:1 small:1024:fp32:0:2s llama2-70b-1layer:2048:fp32:0:1 \
  llama2-70b-1layer:2048:bf16:0:1 llama2-70b-1layer:1024:fp8:0:1 llama2-70b-1layer:1024:fp8:0:1:purge})
[[ $sections == *plan* ]] && for shape in "${plan_shapes[@]}"; do
  IFS=: read -r preset seq precision recompute ranks purge <<<"$shape"
  malloc_conf=${MALLOC_CONF:-}; [ "$purge" = purge ] && malloc_conf=dirty_decay_ms:1000
  # shellcheck disable=SC2207
  extra=($(precision_args "$precision") --recompute-layers "$recompute")
  echo "# plan vs measured: $shape" >&2
  if [ "${ranks%s}" = 1 ]; then
    MALLOC_CONF=$malloc_conf ./target/release/llora bench --preset "$preset" --seq-len "$seq" --threads 2 --warmup 1 \
      --steps 1 "${extra[@]}" 2>/dev/null | tail -1
  else
    shard=(); [ "${ranks: -1}" = s ] && shard=(--shard-frozen-weights)
    MALLOC_CONF=$malloc_conf .venv/bin/torchrun --standalone --nproc-per-node "${ranks%s}" --no-python \
      ./target/release/llora bench --preset "$preset" --seq-len "$seq" --threads 1 --warmup 1 --steps 1 "${extra[@]}" \
      "${shard[@]}" 2>/dev/null | tail -1
  fi | python3 -c "import json,sys; d=json.load(sys.stdin); d['plan_row']=True; d['sharded']='$ranks'.endswith('s'); d['purge']='$purge'=='purge'; print(json.dumps(d))" >>"$out"
done
nf4_shapes=(${NF4_SHAPES:-llama2-70b-1layer:256})
[[ $sections == *nf4* ]] && for shape in "${nf4_shapes[@]}"; do
  IFS=: read -r preset seq <<<"$shape"
  for q in "none" "nf4 --double-quant true" "nf4 --double-quant false"; do
    echo "# nf4: $preset s$seq --quantize $q" >&2
    # shellcheck disable=SC2086
    ./target/release/llora bench --preset "$preset" --seq-len "$seq" --precision bf16 --quantize $q --threads 2 \
      --warmup 1 --steps 2 2>/dev/null | tail -1 \
      | python3 -c "import json,sys; d=json.load(sys.stdin); d['nf4_row']=True; print(json.dumps(d))" >>"$out"
  done
done
python3 - "$out" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip().startswith("{")]
print("| load into | checkpoint MB | baseline RSS MB | stored weights MB | largest tensor f32 MB | bound MB | peak RSS MB | peak / bound | load s |")
print("|---|---|---|---|---|---|---|---|---|")
for r in (r for r in rows if "load" in r):
    kind = r["dtype"] + (" + FP8 weights" if r["fp8_weights"] else "")
    print(f'| {kind} | {r["checkpoint_mb"]:.0f} | {r["baseline_rss_mb"]:.0f} | {r["stored_weights_mb"]:.0f} | {r["largest_tensor_f32_mb"]:.0f} | {r["bound_mb"]:.0f} | {r["peak_rss_mb"]:.0f} | {r["peak_over_bound"]:.3f} | {r["load_s"]:.1f} |')
print()
print("| shape (2 ranks) | frozen weights | base weight MB per layer per rank | peak RSS MB rank 0 | step s median | final loss |")
print("|---|---|---|---|---|---|")
for r in (r for r in rows if "load" not in r and "plan_row" not in r and "nf4_row" not in r):
    kind = "sharded" if r["sharded"] else "replicated"
    dtype = r["dtype"] + (" + FP8 weights" if r["fp8_weights"] else "")
    print(f'| {r["preset"]} s{r["seq_len"]} {dtype} | {kind} | {r["base_weight_bytes_per_layer"] / 2**20:.1f} | {r["peak_rss_mb"]:.0f} | {r["step_s_median"]:.2f} | {r["final_loss"]} |')
print()
print("| shape | ranks | recomputed blocks | planned peak MB | measured peak RSS MB | measured / planned (<= 1.05) | planned / measured (<= 1.15) | live-bytes peak MB | allocator-resident peak MB | step s |")
print("|---|---|---|---|---|---|---|---|---|---|")
for r in (r for r in rows if "plan_row" in r):
    dtype = r["dtype"] + (" + FP8 weights and activations" if r["fp8_weights"] else "")
    dtype += " (allocator purging)" if r["purge"] else ""
    ranks = f'{r["world"]}' + (" sharded" if r["sharded"] else "")
    print(f'| {r["preset"]} s{r["seq_len"]} {dtype} | {ranks} | {r["recompute_layers"]} | {r["planned_peak_mb"]:.0f} | {r["peak_rss_mb"]:.0f} | {r["peak_rss_mb"] / r["planned_peak_mb"]:.3f} | {r["planned_peak_mb"] / r["peak_rss_mb"]:.3f} | {r["peak_heap_in_use_mb"]:.0f} | {r["peak_heap_resident_mb"]:.0f} | {r["step_s_median"]:.2f} |')
print()
print("| shape (bf16 compute) | frozen weights | MB per layer | vs bf16 | step s median | peak RSS MB | final loss |")
print("|---|---|---|---|---|---|---|")
nf4_rows = [r for r in rows if "nf4_row" in r]
for r in nf4_rows:
    base = next(x for x in nf4_rows if x["preset"] == r["preset"] and x["seq_len"] == r["seq_len"] and not x["nf4"])
    kind = "bf16" if not r["nf4"] else "NF4" + (" + double quantisation" if r["nf4"]["double"] else "")
    ratio = r["base_weight_bytes_per_layer"] / base["base_weight_bytes_per_layer"]
    print(f'| {r["preset"]} s{r["seq_len"]} | {kind} | {r["base_weight_bytes_per_layer"] / 2**20:.1f} | {ratio:.3f} | {r["step_s_median"]:.2f} | {r["peak_rss_mb"]:.0f} | {r["final_loss"]} |')
PY
rm -f "$out"
