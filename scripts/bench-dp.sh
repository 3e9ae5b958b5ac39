#!/usr/bin/env bash
# Data parallelism on this machine's cores: for the tiny and small presets, the step time of one
# process with 2 threads (2 micro-batches accumulated) against 2 ranks under torchrun with 1
# thread each (1 micro-batch each; c10d Gloo all-reduce of the LoRA gradients): the same global
# batch of 2 sequences either way. Then the all-reduce of one flat f32 bucket the size of Llama 2
# 70B's LoRA gradients (r 16 on q,k,v,o: 44.6 M values) on 2 ranks. The 2-rank step runs twice:
# with the gradients summed in buckets of 1 MiB started during a block-by-block backward
# (dist.bucket_mb 1: tiny's and small's gradients, 1.6 and 13.6 MB, would fit the default 25 MiB
# bucket, which then runs one reduction after the backward) and in one reduction after a plain
# backward (dist.bucket_mb 0): what the streamed backward costs or gains. Prints one table.
#
#   ./scripts/bench-dp.sh                         # tiny s512, small s512, 44.6 M bucket
#   SHAPES="tiny:1024:2:6" ./scripts/bench-dp.sh  # preset:seq:warmup:steps
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh >&2
cargo build --release --quiet --bin llora
shapes=(${SHAPES:-tiny:512:2:8 small:512:1:4})
bucket=${BUCKET:-44600000}
out=$(mktemp)
export OMP_WAIT_POLICY=PASSIVE
torchrun=(.venv/bin/torchrun --standalone --nproc-per-node 2 --no-python ./target/release/llora)
for shape in "${shapes[@]}"; do
  IFS=: read -r preset seq warm steps <<<"$shape"
  common=(--preset "$preset" --seq-len "$seq" --batch 1 --warmup "$warm" --steps "$steps")
  echo "# $preset s$seq: 1 process x 2 threads, accum 2" >&2
  ./target/release/llora bench "${common[@]}" --threads 2 --accum 2 --tag "w1" 2>/dev/null | tail -1 >>"$out"
  echo "# $preset s$seq: 2 ranks x 1 thread, accum 1, 1 MiB buckets during the backward" >&2
  "${torchrun[@]}" bench "${common[@]}" --threads 1 --accum 1 --set dist.bucket_mb=1 --tag "w2" 2>/dev/null \
    | tail -1 >>"$out"
  echo "# $preset s$seq: 2 ranks x 1 thread, accum 1, one reduction after the backward" >&2
  "${torchrun[@]}" bench "${common[@]}" --threads 1 --accum 1 --set dist.bucket_mb=0 --tag "w2-after" 2>/dev/null \
    | tail -1 >>"$out"
done
echo "# all-reduce of $bucket f32 values on 2 ranks" >&2
"${torchrun[@]}" bench --allreduce-values "$bucket" --threads 1 --warmup 2 --steps 10 --tag "allreduce" 2>/dev/null \
  | tail -1 >>"$out"
python3 - "$out" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip().startswith("{")]
print("| shape | layout | global batch | step s median (min-max) | tokens/s (all ranks) | other procs (cores) |")
print("|---|---|---|---|---|---|")
base = {}
for r in rows:
    if r.get("tag") not in ("w1", "w2", "w2-after"):
        continue
    world, seqs = r["world"], r["accum"] * r["batch"] * r["world"]
    tok = r["world_tokens_per_s"]
    key = (r["preset"], r["seq_len"])
    layout = f'{world} x {r["threads"]} thread{"s" if r["threads"] > 1 else ""}, accum {r["accum"]}'
    if world > 1:
        layout += ", 1 MiB buckets during backward" if r["tag"] == "w2" else ", one reduction after"
    ratio = "" if r["tag"] == "w1" else f' ({r["step_s_median"] / base[key]:.2f}x world 1)'
    if r["tag"] == "w1":
        base[key] = r["step_s_median"]
    print(f'| {r["preset"]} s{r["seq_len"]} | {layout} | {seqs} | {r["step_s_median"]:.3f} ({r["step_s_min"]:.3f}-{r["step_s_max"]:.3f}){ratio} | {tok:.0f} | {r.get("other_procs_cpu_cores")} |')
for r in rows:
    if r.get("tag") == "allreduce":
        print()
        print("| all-reduce | world | backend | median s (min-max) | bus bandwidth GB/s |")
        print("|---|---|---|---|---|")
        print(f'| {r["allreduce_values"]/1e6:.1f} M f32 ({r["allreduce_values"]*4/1e6:.0f} MB) | {r["world"]} | {r["backend"]} | {r["allreduce_s_median"]:.3f} ({r["allreduce_s_min"]:.3f}-{r["allreduce_s_max"]:.3f}) | {r["busbw_gb_per_s"]} |')
PY
rm -f "$out"
