#!/usr/bin/env bash
# One command on a GPU node: is llora correct here, and how fast is it against PyTorch + PEFT
# on the same GPU? Writes one report, REPORT_DIR/report.json and REPORT_DIR/report.md:
#   1. the machine: GPU(s), driver, the torch the peer runs with, the LibTorch llora runs with;
#   2. llora's self-tests on the device (`llora selftest`): bf16 GEMM, `_scaled_mm` (both FP8
#      GEMMs), every fused attention kernel forward + backward against plain LibTorch, dropout
#      mask redraw, an all-reduce on one process group (NCCL on a GPU) and the all-reduce bus
#      bandwidth over all GPUs of the node (torchrun, one rank per GPU);
#   3. parity with HF transformers + PEFT on the device: a fixture made by
#      scripts/peer/fixtures.py, evaluated by `llora eval` in fp32 and bf16, against PEFT's loss;
#   4. llora vs the peer (scripts/peer/step_bench.py) on tiny, small and the Llama 2 70B layer
#      at 8192 tokens, bf16 and FP8: step time, tokens/s, model TFLOP/s (one FLOP model,
#      trainer/src/flops.rs) and its fraction of the GPU's dense bf16 peak, peak memory
#      (nvidia-smi's, sampled), and `llora plan`'s prediction against it; at the shapes of
#      UNFUSED_SHAPES (GPU default: the 70B layer) also with LLORA_CUDA_FUSED_ROUTES=off (rows
#      "bf16-unfused", "fp8-unfused": what the fused norm and the two-pass FP8 quantiser gain);
#   5. on a GPU (or with PACKING=1), sample packing against padding (scripts/bench-packing.sh:
#      llora packed and padded, PEFT padded, target tokens per second; PACKING=0 skips it).
#
# It needs no Rust toolchain: a built `llora` (LLORA=path, default target/release/llora; build it
# elsewhere against the node's torch, docs/gpu.md) and a Python with torch, transformers and
# peft (PYTHON=..., default .venv/bin/python when present, else python3).
#
# Every process it runs must exit 0: a non-zero exit (a panic, an abort at exit) fails the
# report even when the process printed a good result. TRACE=1 adds a Chrome/Perfetto trace of
# one step of each llora bench (REPORT_DIR/trace-PRESET-SEQ-PRECISION.json) and where its
# copies come from (REPORT_DIR/copies-PRESET-SEQ-PRECISION.md, scripts/copies.py).
#
# It survives a hang: every process runs under a time limit (`timeout`, whole process group;
# defaults sized per section, LIMIT_S=N caps each at N seconds); one over its limit is reported
# as **hung** with its last 20 log lines and the check goes on. The self-tests run one part at a
# time. report.json and report.md are rewritten after every section, so a run killed at any
# moment leaves what it measured. Sections in order of value: CUDA tests (a bundle's test
# executables, `--ignored`, one test at a time; TESTS=0 skips), self-test parts, parity
# (PARITY=0 skips), the benches (the 70B layer first, PEFT beside each shape; SHAPES= runs
# none), the tiny job end to end (E2E=1, default on a GPU), two ranks on the one device (data
# parallel, also with gradient buckets started during the backward, and context parallel against
# one process; RANKS_ON_ONE=1, default on a GPU), the whole 70B
# (WHOLE_70B=1, default on a GPU of 140 GB or more), packing.
#
#   scripts/gpu-check.sh                      # on a GPU node, all of the above
#   scripts/gpu-check.sh --cpu                # the same report path on the CPU, small shapes
#   REPORT_DIR=/tmp/r SHAPES="small:2048" TRACE=1 LIMIT_S=120 scripts/gpu-check.sh
#   LIMIT_S=120 scripts/gpu-check.sh --check  # only check the variables (exit 0, or 2 naming one)
set -euo pipefail
MODE=gpu
CHECK_ONLY=0
for arg in "$@"; do
  case "$arg" in
    --cpu) MODE=cpu ;;
    --check) CHECK_ONLY=1 ;;
    -h|--help) sed -n '2,/^[^#]/{/^#/p}' "$0"; exit 0 ;;
    *) echo "gpu-check.sh: unknown argument '$arg' (see --help)" >&2; exit 2 ;;
  esac
done
# Paths the caller gave are the caller's, resolved before this script moves to the repository.
abs() { case $1 in /*) echo "$1" ;; *) echo "$PWD/$1" ;; esac; }
[[ -n ${LLORA:-} ]] && LLORA=$(abs "$LLORA")
[[ ${PYTHON:-} == */* ]] && PYTHON=$(abs "$PYTHON")
[[ -n ${REPORT_DIR:-} ]] && REPORT_DIR=$(abs "$REPORT_DIR")
[[ -n ${MIRROR_DIR:-} ]] && MIRROR_DIR=$(abs "$MIRROR_DIR")
[[ -n ${TEST_BINS:-} ]] && TEST_BINS=$(abs "$TEST_BINS")
# Every variable it honours is checked before anything runs: one line naming it, rather than a
# section skipped without a word, a bash error or a Python traceback later.
refuse() { echo "gpu-check.sh: $*" >&2; exit 2; }
for v in TESTS PARITY PACKING E2E RANKS_ON_ONE WHOLE_70B TRACE; do
  [[ -z ${!v-} || ${!v} == 0 || ${!v} == 1 ]] || refuse "$v=${!v}: say 0 or 1"
done
for v in LIMIT_S L_TEST L_SELFTEST L_PARITY L_BENCH L_PEER L_WHOLE L_PACKING L_E2E STEPS WHOLE_STEPS PACKING_STEPS PACKING_DOCS; do
  # At most 9 digits: bash's arithmetic wraps past 2^63 (a huge limit became 0 or negative).
  [[ -z ${!v-} || ${!v} =~ ^0*[1-9][0-9]{0,8}$ ]] \
    || refuse "$v=${!v}: a whole number from 1 to 999999999 (seconds for LIMIT_S and L_*)"
  [[ -z ${!v-} ]] || printf -v "$v" '%d' "$((10#${!v}))" # 08 is eight, not a bad octal number
done
for shape in ${SHAPES-}; do
  [[ $shape =~ ^[A-Za-z0-9_.-]+:[0-9]+$ ]] || refuse "SHAPES: '$shape' is not PRESET:SEQ_LEN (e.g. tiny:128)"
done
for p in ${PRECISIONS-} ${E2E_PRECISIONS-}; do
  [[ $p == fp32 || $p == bf16 || $p == fp8 ]] || refuse "PRECISIONS / E2E_PRECISIONS: '$p' is not fp32, bf16 or fp8"
done
if [[ -n ${REPORT_DIR:-} && -e $REPORT_DIR ]]; then
  [[ -d $REPORT_DIR ]] || refuse "REPORT_DIR=$REPORT_DIR exists and is not a folder"
  for f in report.json report.md rows.jsonl work; do
    [[ ! -e $REPORT_DIR/$f ]] || refuse "REPORT_DIR=$REPORT_DIR holds an earlier report ($f): name a new folder (nothing of an earlier run is reused or written over)"
  done
fi
cd "$(dirname "$0")/.."
if [[ ${TESTS-} == 1 ]] && ! compgen -G "${TEST_BINS:-test-bin}/*" >/dev/null; then
  refuse "TESTS=1 but ${TEST_BINS:-$PWD/test-bin} holds no test executables (a bundle's test-bin/: scripts/gpu-bundle.sh)"
fi
if ((CHECK_ONLY)); then
  echo "gpu-check.sh: the variables are usable (nothing was run)"
  exit 0
fi
if [[ $MODE == gpu ]] && ! command -v nvidia-smi >/dev/null; then
  echo "gpu-check.sh: nvidia-smi not found: not an NVIDIA GPU node (use --cpu)" >&2
  exit 1
fi
LLORA=${LLORA:-$PWD/target/release/llora}
[[ -x $LLORA ]] || { echo "gpu-check.sh: no llora binary at $LLORA (build it, or set LLORA=path)" >&2; exit 1; }
if [[ -z ${PYTHON:-} ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=$PWD/.venv/bin/python; else PYTHON=python3; fi
fi
command -v "$PYTHON" >/dev/null || { echo "gpu-check.sh: no Python at $PYTHON (set PYTHON=path)" >&2; exit 1; }
"$PYTHON" -c 'import torch, transformers, peft, safetensors' 2>/dev/null \
  || { echo "gpu-check.sh: $PYTHON lacks torch, transformers, peft or safetensors" >&2; exit 1; }
TORCHRUN=("$PYTHON" -m torch.distributed.run)
# The node's torch libraries, for a llora built elsewhere (scripts/gpu-bundle.sh).
source scripts/node-libs.sh
"$LLORA" --version >/dev/null 2>&1 || { echo "gpu-check.sh: $LLORA does not start here: $("$LLORA" --version 2>&1 | head -3)" >&2; exit 1; }
REPORT_DIR=${REPORT_DIR:-gpu-check-$(hostname)-$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$REPORT_DIR" 2>/dev/null && [[ -w $REPORT_DIR ]] || refuse "REPORT_DIR=$REPORT_DIR cannot be created or written"
if [[ -n ${MIRROR_DIR:-} ]]; then
  mkdir -p "$MIRROR_DIR" 2>/dev/null && [[ -w $MIRROR_DIR ]] || refuse "MIRROR_DIR=$MIRROR_DIR cannot be created or written"
fi
# Sections the caller switched off are named in the report, not counted as missing.
skipped=()
[[ ${PARITY:-1} == 0 ]] && skipped+=("parity:PARITY=0")
[[ -z ${SHAPES-x} ]] && skipped+=("bench:SHAPES=")
export GPU_CHECK_SKIPPED="${skipped[*]}"
work="$REPORT_DIR/work"
mkdir -p "$work"
rows="$REPORT_DIR/rows.jsonl"
: >"$rows"
export OMP_WAIT_POLICY=PASSIVE
if [[ $MODE == gpu ]]; then
  DEVICE=cuda:0
  NGPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
  SHAPES=${SHAPES-llama2-70b-1layer:8192 small:2048 tiny:512}
  PRECISIONS=${PRECISIONS:-bf16 fp8}
  UNFUSED_SHAPES=${UNFUSED_SHAPES-llama2-70b-1layer:8192}
  STEPS=${STEPS:-10}
  THREADS=8
else
  DEVICE=cpu
  NGPU=2 # two Gloo ranks stand in for the GPUs of a node
  SHAPES=${SHAPES-tiny:128}
  PRECISIONS=${PRECISIONS:-bf16 fp8}
  UNFUSED_SHAPES=${UNFUSED_SHAPES-}
  STEPS=${STEPS:-2}
  THREADS=1
fi
# Time limits (seconds) of each kind of process; LIMIT_S=N caps every one at N.
# L_TEST=N (and the others below) sets one kind's own limit, for a lease that must share its
# minutes out.
if [[ $MODE == gpu ]]; then
  d=(300 180 300 300 300 480 600 300)
else
  d=(300 600 900 900 900 900 1800 900)
fi
L_TEST=${L_TEST:-${d[0]}} L_SELFTEST=${L_SELFTEST:-${d[1]}} L_PARITY=${L_PARITY:-${d[2]}} L_BENCH=${L_BENCH:-${d[3]}}
L_PEER=${L_PEER:-${d[4]}} L_WHOLE=${L_WHOLE:-${d[5]}} L_PACKING=${L_PACKING:-${d[6]}} L_E2E=${L_E2E:-${d[7]}}
limit() { local s=$1; if [[ -n ${LIMIT_S:-} ]] && ((LIMIT_S < s)); then s=$LIMIT_S; fi; echo "$s"; }
row() { echo "$1" >>"$rows"; }
say() { echo "# gpu-check: $*" >&2; }
# limited WHAT SECONDS LOG CMD...: CMD under a time limit (its whole process group killed past
# it; stdout as the caller redirects it, stderr appended to LOG, no stdin); records its exit
# row: status ok, failed or hung, with LOG's last 20 lines unless ok. Leaves the exit code in rc.
limited() {
  local what=$1 secs log=$3 status=ok
  secs=$(limit "$2")
  shift 3
  rc=0
  timeout --kill-after=10 "$secs" "$@" 2>>"$log" </dev/null || rc=$?
  if ((rc == 124 || rc == 137)); then
    status=hung
    say "HUNG: $what (no exit within its ${secs} s limit); the check goes on"
  elif ((rc != 0)); then
    status=failed
  fi
  "$PYTHON" - "$what" "$rc" "$status" "$secs" "$log" >>"$rows" <<'PY'
import json, sys
what, rc, status, secs, log = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
row = {"section": "exit", "what": what, "rc": rc, "status": status, "limit_s": secs}
if status != "ok":
    try:
        row["tail"] = open(log, errors="replace").read().splitlines()[-20:]
    except OSError:
        row["tail"] = []
print(json.dumps(row))
PY
}
# report [final]: report.json and report.md from the rows so far (rewritten after every section).
report() {
  local rc=0
  "$PYTHON" "$work/report.py" "$rows" "$REPORT_DIR" "${1:-partial}" || rc=$?
  # MIRROR_DIR: a folder that must hold the latest report at every moment (a lease's $OUT).
  if [[ -n ${MIRROR_DIR:-} ]]; then cp "$REPORT_DIR/report.md" "$REPORT_DIR/report.json" "$MIRROR_DIR/" 2>/dev/null || true; fi
  return "$rc"
}
cat >"$work/report.py" <<'PY'
import json, sys
rows = []
for l in open(sys.argv[1]):
    try:
        rows.append(json.loads(l))
    except ValueError:
        pass  # a process killed mid-line
out, final = sys.argv[2], sys.argv[3] == "final"
by = lambda s: [r for r in rows if r.get("section") == s]
m = by("machine")[0]
import os
md = [f"# llora gpu-check ({m['mode']} mode{'' if final else ', in progress'})", "", f"- llora: {m['llora']}",
      f"- peer: {json.dumps(m['peer'])}", f"- GPUs: {json.dumps(m['gpus'])}"]
if os.environ.get("GPU_CHECK_SKIPPED"):
    md.append("- sections skipped by the caller: " + ", ".join(f"{s} ({why})" for s, why in (x.split(":", 1) for x in os.environ["GPU_CHECK_SKIPPED"].split())))
md.append("")
if by("cuda_test"):
    md += ["## CUDA tests (the bundle's test executables, `--ignored`, one test at a time)", "",
           "| binary | test | result |", "|---|---|---|"]
    for r in by("cuda_test"):
        md.append(f"| {r['binary']} | {r['test']} | {r['status'] if r['status'] == 'passed' else '**' + r['status'] + '**'} |")
    md.append("")
md += ["## Self-tests", "", "| check | ok | detail |", "|---|---|---|"]
for s in by("selftest") + by("allreduce"):
    for c in s.get("checks", []):
        ok = "yes" if c["ok"] else ("**no**" if c["required"] else "no (optional)")
        md.append(f"| {c['name']} | {ok} | {c.get('detail', '')} |")
    for c in s.get("skipped", []):
        md.append(f"| {c['name']} | skipped | {c['why']} |")
md += ["", "## Parity with HF transformers + PEFT (eval loss; bf16: within twice PEFT's bf16 distance from fp32)", "",
       "| precision | llora | PEFT | relative difference | ok |", "|---|---|---|---|---|"]
for r in by("parity"):
    if "skipped" in r:
        md.append(f"| skipped: {r['skipped']} | | | | |")
    elif "error" in r:
        md.append(f"| {r['precision']} | **{r['error']}** | | | **no** |")
    else:
        md.append(f"| {r['precision']} | {r['llora_loss']:.6f} | {r['peft_loss']:.6f} | {r['rel_diff']:.2e} | {'yes' if r['ok'] else '**no**'} |")
md += ["", "## Exit statuses (every process must exit 0 within its limit)", "", "| process | exit | status | limit s |", "|---|---|---|---|"]
for r in by("exit"):
    st = r.get("status", "ok")
    md.append(f"| {r['what']} | {r['rc'] if r['rc'] == 0 else '**' + str(r['rc']) + '**'} | {st if st == 'ok' else '**' + st + '**'} | {r.get('limit_s', '')} |")
for r in by("exit"):
    if r.get("tail"):
        md += ["", f"<details><summary>{r.get('status')}: {r['what']} (last lines of its log)</summary>", "", "```"] + r["tail"] + ["```", "</details>"]
md += ["", "## llora against PyTorch + PEFT (bf16)", "",
       "| shape | llora precision | llora step s | PEFT bf16 step s | ratio | llora TFLOP/s | PEFT TFLOP/s | of bf16 peak | llora peak MB | PEFT peak MB | planned MB | measured/planned | attention |",
       "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
f = lambda x, p=3: "" if x is None else (f"{x:.{p}f}" if isinstance(x, float) else str(x))
for r in by("bench"):
    md.append(f"| {r['preset']} s{r['seq_len']} | {r['precision']} | {f(r['llora_step_s'],4)} | {f(r['peer_bf16_step_s'],4)} | {f(r['ratio'])} | "
              f"{f(r['llora_tflops'],4)} | {f(r['peer_tflops'],4)} | {f(r['llora_mfu_bf16_peak'])} | {f(r['llora_peak_mb'],0)} | {f(r['peer_peak_mb'],0)} | "
              f"{f(r['planned_peak_mb'],0)} | {f(r.get('measured_over_planned'))} | {','.join(r.get('attn_impl') or [])} |")
md += ["", "## Where the step goes (llora's phases synchronised with the device; allocator peaks)", "",
       "| shape | llora precision | llora fwd / bwd / opt s | PEFT fwd / bwd / opt s | ops per step | host syncs per step | device peak allocated / reserved MB |",
       "|---|---|---|---|---|---|---|"]
for r in by("bench"):
    md.append(f"| {r['preset']} s{r['seq_len']} | {r['precision']} | {f(r.get('llora_fwd_s'),4)} / {f(r.get('llora_bwd_s'),4)} / {f(r.get('llora_opt_s'),4)} | "
              f"{f(r.get('peer_fwd_s'),4)} / {f(r.get('peer_bwd_s'),4)} / {f(r.get('peer_opt_s'),4)} | {f(r.get('ops_per_step'))} | {f(r.get('host_syncs_per_step'))} | "
              f"{f(r.get('llora_device_peak_allocated_mb'),0)} / {f(r.get('llora_device_peak_reserved_mb'),0)} |")
if by("trace"):
    import importlib.util
    spec = importlib.util.spec_from_file_location("trace_table", "scripts/trace-table.py")
    tt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tt)
    md += ["", "## Where one traced step's device time goes (scripts/trace-table.py; phases end at the bench's device waits)"]
    for r in by("trace"):
        md += ["", f"### {r['preset']} s{r['seq_len']} {r['precision']}", "", tt.markdown(r)]
if by("packing"):
    md += ["", "## Packing against padding (target tokens per second; llora packed rows of 4096, padded batches of 8)", "",
           "| run | steps | target tok/s | samples/s | vs llora padded | attention | ran |", "|---|---|---|---|---|---|---|"]
    base = {r["preset"]: r.get("target_tokens_per_s") for r in by("packing") if r.get("run", "").endswith("-padded")}
    for r in by("packing"):
        name, tps = r.get("run") or r.get("tag"), r.get("target_tokens_per_s")
        vs = f(tps / base[r["preset"]], 2) if tps and base.get(r["preset"]) else ""
        md.append(f"| {name} | {f(r.get('steps'))} | {f(tps, 1)} | {f(r.get('samples_per_s'), 2)} | {vs} | {r.get('attention', '')} | {'yes' if r.get('ok', True) else '**no**'} |")
if by("whole"):
    md += ["", "## The whole model on one device (FP8 weights + activations, `llora plan`'s recipe)", "",
           "| shape | flags | step s | tokens/s | device peak MB | planned MB | measured/planned | error |", "|---|---|---|---|---|---|---|---|"]
    for r in by("whole"):
        ratio = r["device_peak_mb"] / r["planned_peak_mb"] if r.get("device_peak_mb") and r.get("planned_peak_mb") else None
        md.append(f"| {r.get('preset')} s{r.get('seq_len')} | {r.get('flags', '')} | {f(r.get('step_s_median'),4)} | {f(r.get('tokens_per_s'),1)} | "
                  f"{f(r.get('device_peak_mb'),0)} | {f(r.get('planned_peak_mb'),0)} | {f(ratio)} | {r.get('error') or ''} |")
if by("e2e"):
    md += ["", "## The tiny job end to end (to the benchmark's target)", "", "| precision | ok | time to train s | final eval |", "|---|---|---|---|"]
    for r in by("e2e"):
        md.append(f"| {r['precision']} | {'yes' if r['ok'] else '**no**'} | {f(r.get('time_to_train_s'),1)} | {f(r.get('final_eval'),4)} |")
if by("ranks_on_one_device"):
    md += ["", "## Two ranks on one device against one process (3 steps' losses, gradient norms, eval loss)", "",
           "| layout | ok | bitwise | max relative difference | error |", "|---|---|---|---|---|"]
    for r in by("ranks_on_one_device"):
        md.append(f"| {r['layout']} | {'yes' if r['ok'] else '**no**'} | {r.get('bitwise', '')} | {f(r.get('max_rel_diff'), 9)} | {r.get('error', '')} |")
open(f"{out}/report.md", "w").write("\n".join(md) + "\n")
json.dump({"rows": rows, "final": final}, open(f"{out}/report.json", "w"), indent=1)
if not final:
    sys.exit(0)
failed = [c["name"] for s in by("selftest") + by("allreduce") for c in s.get("checks", []) if c["required"] and not c["ok"]]
failed += [f"parity {r['precision']}" for r in by("parity") if "skipped" not in r and not r["ok"]]
failed += [f"{r.get('status', 'exit')} (exit {r['rc']}): {r['what']}" for r in by("exit") if r["rc"] != 0]
failed += [f"CUDA test {r['test']}: {r['status']}" for r in by("cuda_test") if r["status"] != "passed"]
failed += [f"end to end {r['precision']}" for r in by("e2e") if not r["ok"]]
failed += [f"two ranks on one device, {r['layout']}" for r in by("ranks_on_one_device") if not r["ok"]]
failed += [f"whole model: {r['error']}" for r in by("whole") if r.get("error")]
failed += [f"packing run {r['run']}" for r in by("packing") if not r.get("ok", True)]
import os
skipped = dict(x.split(":", 1) for x in os.environ.get("GPU_CHECK_SKIPPED", "").split())
missing = [s for s in ("selftest", "allreduce", "parity", "bench") if not by(s) and s not in skipped]
print("\n".join(md))
if failed or missing:
    print(f"gpu-check: failed checks {failed}, missing sections {missing}", file=sys.stderr)
    sys.exit(1)
PY

# 1. The machine.
say "machine"
gpus=null
if [[ $MODE == gpu ]]; then
  gpus=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader \
    | "$PYTHON" -c 'import json,sys; print(json.dumps([dict(zip(["name","driver","memory"], [x.strip() for x in l.split(",")])) for l in sys.stdin if l.strip()]))')
fi
peer_torch=$("$PYTHON" -c 'import json, torch, transformers, peft; print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__, "peft": peft.__version__}))')
row "{\"section\": \"machine\", \"mode\": \"$MODE\", \"gpus\": $gpus, \"peer\": $peer_torch, \"llora\": $("$PYTHON" -c 'import json,sys; print(json.dumps(sys.argv[1]))' "$("$LLORA" --version)")}"

report

# 1. The CUDA tests a bundle carries (scripts/gpu-bundle.sh: test-bin/), each test alone.
if [[ ${TESTS:-$([[ $MODE == gpu ]] && echo 1 || echo 0)} == 1 && -d ${TEST_BINS:-test-bin} ]]; then
  for bin in "${TEST_BINS:-test-bin}"/*; do
    [[ -f $bin && -x $bin ]] || continue
    name=$(basename "$bin")
    say "CUDA tests of $name"
    "$bin" --ignored --list 2>/dev/null </dev/null | sed -n 's/: test$//p' >"$work/tests-$name.list" || true
    hung=0
    while read -r t; do
      # Two hangs say a shared cause (a route's lock, a driver): the rest would each wait out
      # their limit, so they are listed as not run and the lease goes to the sections after.
      if ((hung >= 2)); then
        row "{\"section\": \"cuda_test\", \"binary\": \"$name\", \"test\": \"$t\", \"status\": \"not run (2 hung before it)\"}"
        continue
      fi
      # stdout too: the test harness prints a failed test's output there.
      limited "test $name $t" "$L_TEST" "$work/tests.log" "$bin" --ignored --exact "$t" --test-threads=1 >>"$work/tests.log"
      status=passed
      ((rc == 124 || rc == 137)) && status=hung && hung=$((hung + 1))
      ((rc != 0 && rc != 124 && rc != 137)) && status=failed
      row "{\"section\": \"cuda_test\", \"binary\": \"$name\", \"test\": \"$t\", \"status\": \"$status\"}"
    done <"$work/tests-$name.list"
    report
  done
fi

# 2. Self-tests, one part at a time (a hang hides nothing else): this process alone (NCCL on
# one GPU), then one rank per GPU for the all-reduce's bus bandwidth.
for part in gemm attention norm rope optimizer dropout all-reduce; do
  say "self-test $part on $DEVICE"
  limited "llora selftest --only $part --device $DEVICE" "$L_SELFTEST" "$work/selftest.log" \
    "$LLORA" selftest --device "$DEVICE" --threads "$THREADS" --only "$part" >"$work/selftest-$part.out"
  tail -1 "$work/selftest-$part.out" | sed "s/^{/{\"section\": \"selftest\", \"part\": \"$part\", /" >>"$rows" || true
  report
done
say "all-reduce over $NGPU ranks"
limited "torchrun x$NGPU llora selftest --only all-reduce" "$L_SELFTEST" "$work/allreduce.log" \
  "${TORCHRUN[@]}" --standalone --nproc-per-node "$NGPU" --no-python "$LLORA" selftest --device "${DEVICE%%:*}" \
  --threads "$THREADS" --only all-reduce >"$work/allreduce.out"
tail -1 "$work/allreduce.out" | sed 's/^{/{"section": "allreduce", /' >>"$rows" || true
report

# 3. Parity with HF + PEFT: a fixture (base, adapter, batch and PEFT's losses in fp32 and bf16,
# computed by scripts/peer/fixtures.py on the CPU) evaluated by llora on the device.
if [[ ${PARITY:-1} == 1 ]]; then
say "parity with HF transformers + PEFT"
fx="$work/parity"
limited "peer fixtures.py (parity fixture)" "$L_PARITY" "$work/fixtures.log" "$PYTHON" scripts/peer/fixtures.py --out "$fx" \
  --preset tiny-gqa --seq-len 96 --batch 2 --lora-b normal \
  --targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj --bf16-twin --threads 2 >>"$work/fixtures.log"
if [[ -f $fx/batch.safetensors ]] && "$PYTHON" -c 'import pyarrow' 2>/dev/null; then
  "$PYTHON" - "$fx" <<'PY'
import sys, pyarrow as pa, pyarrow.parquet as pq
from safetensors.numpy import load_file
b = load_file(sys.argv[1] + "/batch.safetensors")
pq.write_table(pa.table({"input_ids": [list(map(int, r)) for r in b["input_ids"]], "labels": [list(map(int, r)) for r in b["labels"]]}),
               sys.argv[1] + "/batch.parquet")
PY
  for precision in fp32 bf16; do
    limited "llora eval --precision $precision" "$L_PARITY" "$work/eval.log" "$LLORA" eval --model "$fx" --adapter "$fx" \
      --data "$fx/batch.parquet" --batch-size 2 --precision "$precision" --device "$DEVICE" --threads "$THREADS" \
      >"$work/eval-$precision.out"
    tail -1 "$work/eval-$precision.out" \
      | "$PYTHON" -c 'import json,sys; d=json.load(sys.stdin); e=json.load(open(sys.argv[2]+"/expected.json")); fp32=e["losses"][0]; want=e["bf16_loss"] if sys.argv[1]=="bf16" else fp32; got=d["loss_per_token"]; print(json.dumps({"section": "parity", "precision": sys.argv[1], "llora_loss": got, "peft_loss": want, "peft_fp32_loss": fp32, "rel_diff": abs(got-want)/abs(want), "ok": abs(got-fp32) <= 2*abs(want-fp32) + 1e-4*abs(fp32) if sys.argv[1]=="bf16" else abs(got-want) <= 1e-5*abs(want)}))' "$precision" "$fx" >>"$rows" 2>>"$work/eval.log" \
      || row "{\"section\": \"parity\", \"precision\": \"$precision\", \"ok\": false, \"error\": \"no loss printed (see the exit rows)\"}"
  done
elif [[ -f $fx/batch.safetensors ]]; then
  row '{"section": "parity", "skipped": "pyarrow is not installed in this Python: llora eval reads parquet"}'
fi

report
fi

# 4. llora vs the peer, with the device's memory peak sampled by nvidia-smi on a GPU.
peak_sampler() { # writes the largest memory.used (MiB) of GPU 0 while its parent runs
  local max=0 now
  while :; do
    now=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0 2>/dev/null | head -1)
    [[ $now =~ ^[0-9]+$ ]] && ((now > max)) && max=$now && echo "$max" >"$1"
    sleep 0.2
  done
}
run_sampled() { # run_sampled OUTFILE SECONDS CMD...: the command's last stdout line, plus device_peak_mb
  local out=$1 secs=$2; shift 2
  local peak="$work/peak.$$" pid=
  echo 0 >"$peak"
  if [[ $MODE == gpu ]]; then peak_sampler "$peak" & pid=$!; fi
  limited "$(basename "$1") ${*:2:12}" "$secs" "$work/bench.log" "$@" >"$out.all"
  tail -1 "$out.all" >"$out.line" || true
  [[ -n $pid ]] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null || true
  "$PYTHON" -c 'import json,sys; l=open(sys.argv[1]).read().strip(); d=json.loads(l) if l.startswith("{") else {"error": "no output (see the exit rows)"}; d["device_peak_mb"]=float(open(sys.argv[2]).read() or 0) or None; print(json.dumps(d))' \
    "$out.line" "$peak" >"$out"
}
for shape in $SHAPES; do
  IFS=: read -r preset seq <<<"$shape"
  precisions=$PRECISIONS
  # The same step with the newer fused CUDA routes off (LLORA_CUDA_FUSED_ROUTES=off): what they gain.
  [[ " $UNFUSED_SHAPES " == *" $shape "* ]] && precisions="$precisions $(printf '%s-unfused ' $PRECISIONS)"
  for precision in $precisions; do
    common=(--preset "$preset" --seq-len "$seq" --batch 1 --warmup 2 --steps "$STEPS" --threads "$THREADS")
    base=${precision%-unfused}
    routes=(env LLORA_CUDA_FUSED_ROUTES=on)
    [[ $precision == *-unfused ]] && routes=(env LLORA_CUDA_FUSED_ROUTES=off)
    extra=(--precision "$base")
    [[ $base == fp8 ]] && extra=(--precision fp8 --fp8-weights --fp8-activations)
    if [[ ${TRACE:-0} == 1 ]]; then
      trace="$REPORT_DIR/trace-$preset-$seq-$precision.json"
      rm -f "$trace"
      extra+=(--trace "$trace")
    fi
    say "bench $preset s$seq $precision: llora"
    run_sampled "$work/l.json" "$L_BENCH" "${routes[@]}" "$LLORA" bench "${common[@]}" "${extra[@]}" --device "$DEVICE" --tag llora
    # Where the traced step's device time went: its top kernels and phases (scripts/trace-table.py).
    if [[ ${TRACE:-0} == 1 && -s ${trace:-} ]]; then
      "$PYTHON" scripts/trace-table.py --json --top 15 "$trace" 2>>"$work/bench.log" \
        | sed "s/^{/{\"section\": \"trace\", \"preset\": \"$preset\", \"seq_len\": $seq, \"precision\": \"$precision\", /" >>"$rows" || true
      # Where its copies come from (scripts/copies.py): each aten::copy_ by the op that asked.
      "$PYTHON" scripts/copies.py --top 40 "$trace" >"$REPORT_DIR/copies-$preset-$seq-$precision.md" 2>>"$work/bench.log" || true
    fi
    say "bench $preset s$seq bf16: peer"
    [[ -f "$work/p-$preset-$seq.json" ]] \
      || run_sampled "$work/p-$preset-$seq.json" "$L_PEER" "$PYTHON" scripts/peer/step_bench.py "${common[@]}" --dtype bf16 --device "${DEVICE%%:*}" --tag peer
    "$PYTHON" - "$work/l.json" "$work/p-$preset-$seq.json" "$precision" "$MODE" "$preset" "$seq" >>"$rows" <<'PY'
import json, sys
l, p = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
precision, mode = sys.argv[3], sys.argv[4]
peaks = {"H100": 989.4, "H200": 989.4, "B200": 2250.0, "MI300X": 1307.4, "MI355X": 2516.6}
gpu = p.get("gpu_name") or ""
peak = next((v for k, v in peaks.items() if k in gpu.upper()), None)
def tflops(d):
    return d["flops_per_step"] / d["step_s_median"] / 1e12 if d.get("step_s_median") else None
mem = "device_peak_mb" if mode == "gpu" else "peak_rss_mb"
row = {"section": "bench", "preset": l.get("preset") or sys.argv[5], "seq_len": l.get("seq_len") or int(sys.argv[6]), "precision": precision,
       "llora_step_s": l.get("step_s_median"), "peer_bf16_step_s": p.get("step_s_median"),
       "ratio": (l["step_s_median"] / p["step_s_median"]) if l.get("step_s_median") and p.get("step_s_median") else None,
       "llora_tokens_per_s": l.get("tokens_per_s"), "peer_tokens_per_s": p.get("tokens_per_s"),
       "llora_tflops": tflops(l), "peer_tflops": tflops(p),
       "llora_mfu_bf16_peak": (tflops(l) / peak) if peak and tflops(l) else None,
       "llora_peak_mb": l.get(mem), "peer_peak_mb": p.get(mem),
       "peer_peak_cuda_allocated_mb": p.get("peak_cuda_allocated_mb"), "gpu": gpu or None,
       "planned_peak_mb": l.get("planned_peak_mb"), "attn_impl": l.get("attn_impl"), "rms_norm": l.get("rms_norm"), "optimizer": l.get("optimizer"),
       "llora_fwd_s": l.get("fwd_s_median"), "llora_bwd_s": l.get("bwd_s_median"), "llora_opt_s": l.get("opt_s_median"),
       "peer_fwd_s": p.get("fwd_s_median"), "peer_bwd_s": p.get("bwd_s_median"), "peer_opt_s": p.get("opt_s_median"),
       "llora_device_peak_allocated_mb": l.get("device_peak_allocated_mb"),
       "llora_device_peak_reserved_mb": l.get("device_peak_reserved_mb"),
       "ops_per_step": l.get("ops_per_step"), "host_syncs_per_step": l.get("host_syncs_per_step"),
       "fp8_gemms_fallback": l.get("fp8_gemms_fallback"), "error": l.get("error") or p.get("error")}
if row["llora_peak_mb"] and row["planned_peak_mb"]:
    row["measured_over_planned"] = row["llora_peak_mb"] / row["planned_peak_mb"]
print(json.dumps(row))
PY
    report
  done
done


# 5. The tiny job end to end on the device in fp32, bf16 and FP8 (weights + activations; E2E=1,
# default on a GPU; E2E_PRECISIONS chooses): the demo's MLPerf-style run to its target, with
# time-to-train. Before the whole 70B, the longest section.
if [[ ${E2E:-$([[ $MODE == gpu ]] && echo 1 || echo 0)} == 1 ]]; then
  for precision in ${E2E_PRECISIONS:-fp32 bf16 fp8}; do
    say "tiny job end to end, $precision"
    fp8=()
    [[ $precision == fp8 ]] && fp8=(--set precision.fp8_weights=true --set precision.fp8_activations=true)
    limited "llora train tiny $precision" "$L_E2E" "$work/e2e.log" "$LLORA" train configs/tiny-cpu.toml \
      --set "run.device=\"$DEVICE\"" --set "precision.compute=\"$precision\"" --set "run.dir=\"$work/e2e-$precision\"" \
      --set "run.threads=$THREADS" "${fp8[@]}" >"$work/e2e-$precision.out"
    "$PYTHON" - "$work/e2e-$precision" "$precision" "$rc" >>"$rows" <<'PY'
import json, pathlib, sys
d, precision, rc = pathlib.Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
log = d / "result_0.txt"
events = [json.loads(l.split(":::MLLOG", 1)[1]) for l in log.read_text().splitlines() if ":::MLLOG" in l] if log.exists() else []
stop = next((e for e in events if e.get("key") == "run_stop"), None)
start = next((e for e in events if e.get("key") == "run_start"), None)
evals = [e["value"] for e in events if e.get("key") == "eval_accuracy"]
print(json.dumps({"section": "e2e", "precision": precision, "ok": rc == 0 and bool(stop) and stop.get("metadata", {}).get("status") == "success",
                  "time_to_train_s": (stop["time_ms"] - start["time_ms"]) / 1e3 if stop and start else None,
                  "final_eval": evals[-1] if evals else None}))
PY
    report
  done
fi


# 5b. Two ranks on the one device (RANKS_ON_ONE=1, default on a GPU): the tiny job for 3 steps in
# fp32 (dropout 0, AdamW eps 1e-3 as tests/it/dist.rs has it: at 1e-8 the first updates are
# ~lr·sign(g), which rounding flips) on one process, then under torchrun x2 with
# dist.share_device (both ranks on cuda:0, Gloo through the host), data- and context-parallel:
# every step's loss and gradient norm and the eval loss against the one process's (within 1e-6
# relative; bitwise on the CPU for data parallelism, where tests/it/dist.rs holds both).
# dp2-buckets: data parallel with 4 KiB gradient buckets, so that they start during a
# block-by-block backward on the device's tensors (tiny's gradients fit the default 25 MiB
# bucket, which reduces after the backward).
if [[ ${RANKS_ON_ONE:-$([[ $MODE == gpu ]] && echo 1 || echo 0)} == 1 ]]; then
  short=(--set "run.device=\"$DEVICE\"" --set "run.threads=$THREADS" --set schedule.max_steps=3
    --set eval.every_samples=24 --set eval.target_loss=100 --set data.synthetic.train_samples=64
    --set data.synthetic.eval_samples=9 --set lora.dropout=0.0 --set optim.eps=1e-3 --set dist.share_device=true
    --set 'logging.progress="never"')
  for layout in one dp2 dp2-buckets cp2; do
    say "two ranks on one device: $layout"
    cmd=("$LLORA")
    [[ $layout != one ]] && cmd=("${TORCHRUN[@]}" --standalone --nproc-per-node 2 --no-python "$LLORA")
    extra=()
    [[ $layout == cp2 ]] && extra=(--set train.context_parallel=2)
    [[ $layout == dp2-buckets ]] && extra=(--set dist.bucket_mb=0.004)
    limited "llora train tiny x $layout on one device" "$L_E2E" "$work/ranks.log" "${cmd[@]}" train configs/tiny-cpu.toml \
      "${short[@]}" "${extra[@]}" --set "run.dir=\"$work/ranks-$layout\"" >"$work/ranks-$layout.out"
  done
  "$PYTHON" - "$work" >>"$rows" <<'PY'
import json, pathlib, sys
work = pathlib.Path(sys.argv[1])
def numbers(layout):
    f = work / f"ranks-{layout}" / "metrics.jsonl"
    if not f.exists():
        return None
    rows = [json.loads(l) for l in f.read_text().splitlines() if l.strip()]
    steps = [(r["loss"], r["grad_norm"]) for r in rows if isinstance(r.get("step"), int) and "loss" in r]
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    return [x for pair in steps for x in pair] + evals
one = numbers("one")
for layout in ("dp2", "dp2-buckets", "cp2"):
    other = numbers(layout)
    row = {"section": "ranks_on_one_device", "layout": layout}
    if not one or other is None or len(other) != len(one):
        row.update(ok=False, error="no metrics, or not the one process's steps (see the exit rows)")
    else:
        rel = max(abs(a - b) / max(abs(a), 1e-30) for a, b in zip(one, other))
        row.update(max_rel_diff=rel, bitwise=one == other, ok=rel <= 1e-6)
    print(json.dumps(row))
PY
  report
fi

# 6. The whole Llama 2 70B on one GPU (WHOLE_70B=1; default on a GPU of 140 GB or more): FP8
# weights in one layout and the recomputed blocks `llora plan` chooses for this memory, one
# step of 8192 tokens, its device peak against the plan.
whole_default=0
if [[ $MODE == gpu ]]; then
  mem_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 | head -1)
  [[ $mem_mib =~ ^[0-9]+$ ]] && ((mem_mib >= 140000)) && whole_default=1
fi
if [[ ${WHOLE_70B:-$whole_default} == 1 ]]; then
  # The card's memory less 2 GiB of headroom for the caching allocator's fragmentation (the
  # plan counts the CUDA runtime itself, 2 GiB, but not blocks cached and split).
  wpreset=llama2-70b wseq=8192 wmem=${WHOLE_MEMORY:-$([[ $MODE == gpu ]] && echo "$((mem_mib - 2048))MiB" || echo 8GiB)}
  say "the whole $wpreset at $wseq tokens on one device ($wmem)"
  # Exit 3 only says the config's own recipe does not fit this memory; its "cheapest" is the answer.
  timeout 60 "$LLORA" plan configs/llama2-70b-mlperf.toml --world 1 --device-memory "$wmem" --json \
    >"$work/whole-plan.json" 2>>"$work/whole.log" </dev/null || true
  wflags=$("$PYTHON" -c 'import json,sys; c=json.load(open(sys.argv[1]))["cheapest"]; print(("--fp8-weights-one-layout " if c.get("fp8_weights_one_layout") else "") + "--recompute-layers " + str(c.get("recompute_layers", 0)))' \
    "$work/whole-plan.json" 2>/dev/null || echo "")
  if [[ -n $wflags ]]; then
    # shellcheck disable=SC2086 # two flags, split on purpose
    run_sampled "$work/whole.json" "$L_WHOLE" "$LLORA" bench --preset "$wpreset" --seq-len "$wseq" --batch 1 --warmup 1 \
      --steps "${WHOLE_STEPS:-3}" --threads "$THREADS" --device "$DEVICE" --precision fp8 --fp8-weights --fp8-activations $wflags --tag llora
    # A bench that printed nothing still names its shape (the row says what was tried).
    "$PYTHON" -c 'import json,sys; d=json.load(open(sys.argv[1])); r={k: d.get(k) for k in ("preset","seq_len","step_s_median","tokens_per_s","device_peak_mb","device_peak_allocated_mb","planned_peak_mb","peak_rss_mb","fp8_quantiser_routes","error")}; r["preset"]=r["preset"] or sys.argv[3]; r["seq_len"]=r["seq_len"] or int(sys.argv[4]); print(json.dumps({"section": "whole", "flags": sys.argv[2], **r}))' \
      "$work/whole.json" "$wflags" "$wpreset" "$wseq" >>"$rows" || true
  else
    row "{\"section\": \"whole\", \"error\": \"llora plan found no recipe that fits $wmem (work/whole-plan.json)\"}"
  fi
  report
fi

# 7. Packing against padding on the device (scripts/bench-packing.sh; GPU mode, or PACKING=1):
# target tokens/s of llora packed (variable-length flash attention on CUDA) and padded, and of
# PEFT padded, on a long-tailed synthetic corpus.
if [[ ${PACKING:-$([[ $MODE == gpu ]] && echo 1 || echo 0)} == 1 ]]; then
  say "packing against padding"
  limited "bench-packing.sh on $DEVICE" "$L_PACKING" "$work/packing.log" env LLORA="$LLORA" PYTHON="$PYTHON" DEVICE="$DEVICE" \
    THREADS="$THREADS" OUT="$work/packing" DOCS="${PACKING_DOCS:-256}" STEPS_SMALL="${PACKING_STEPS:-20}" \
    PRESETS="${PACKING_PRESETS:-tiny small}" scripts/bench-packing.sh >"$work/packing.out"
  tail -1 "$work/packing.out" \
    | "$PYTHON" -c 'import json,sys; [print(json.dumps(dict(section="packing", **r))) for r in json.load(sys.stdin)]' >>"$rows" || true
fi

report

report final
say "report: $REPORT_DIR/report.md and $REPORT_DIR/report.json"
