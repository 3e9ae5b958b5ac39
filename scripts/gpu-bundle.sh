#!/usr/bin/env bash
# Builds llora against a given torch and writes one small folder that runs on a GPU node with
# only Python + that torch (no Rust toolchain, no network): the stripped, xz-compressed binary,
# scripts/gpu-check.sh and scripts/bench-packing.sh with the PyTorch + PEFT peer (scripts/peer/),
# the configs, the demo base when this checkout has one (runs/demo-base), and the test
# executable that holds the CUDA tests (the model crate's unit tests, `#[ignore = "needs CUDA"]`;
# stripped and compressed like the binary, test-bin/), which gpu-check.sh runs first with
# `--ignored`, one test at a time. On the node:
#
#   OUT/gpu-check.sh [--cpu]      # unpacks the binaries once, then runs scripts/gpu-check.sh
#   OUT/llora ARGS...             # the binary itself, after the first gpu-check.sh (or unxz)
#
# gpu-check.sh finds the node's LibTorch, CUDA and NCCL libraries through its Python's torch
# (torch/lib and every nvidia/*/lib folder), so a binary built here runs against the node's
# own torch wheel, which must be the version built against (llora --version names it).
#
# Usage: scripts/gpu-bundle.sh [--torch VERSION] [--max-mb N] OUT   (VERSION defaults to 2.11.0)
#   --max-mb N   fail when the bundle is over N MB (for a transfer that caps what it carries,
#                e.g. 60 for a 64 MiB call); no limit by default
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TORCH=2.11.0
OUT=
MAX_MB=
while [[ $# -gt 0 ]]; do
  case "$1" in
    --torch) [[ $# -ge 2 ]] || { echo "gpu-bundle.sh: --torch needs a version, e.g. --torch 2.11.0" >&2; exit 2; }
      TORCH=$2; shift ;;
    --torch=*) TORCH=${1#--torch=} ;;
    --max-mb) [[ $# -ge 2 && $2 =~ ^[0-9]+$ ]] || { echo "gpu-bundle.sh: --max-mb needs a whole number of MB, e.g. --max-mb 60" >&2; exit 2; }
      MAX_MB=$2; shift ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    -*) echo "gpu-bundle.sh: unknown flag '$1' (see --help)" >&2; exit 2 ;;
    *) [[ -z $OUT ]] || { echo "gpu-bundle.sh: one OUT folder, not '$OUT' and '$1'" >&2; exit 2; }
      OUT=$1 ;;
  esac
  shift
done
[[ -n $OUT ]] || { echo "gpu-bundle.sh: name the OUT folder (see --help)" >&2; exit 2; }
# OUT as the caller named it, resolved once before anything changes folder: the check below and
# every write are then about the same folder.
case $OUT in
  /*) ;;
  *) OUT="$PWD/$OUT" ;;
esac
if [[ -e $OUT && ! -d $OUT ]]; then
  echo "gpu-bundle.sh: $OUT exists and is not a folder: name a new one" >&2
  exit 1
fi
if [[ -e $OUT && -n $(ls -A "$OUT" 2>/dev/null) ]]; then
  echo "gpu-bundle.sh: $OUT exists and is not empty: llora never writes over a folder; name a new one" >&2
  exit 1
fi
command -v xz >/dev/null || { echo "gpu-bundle.sh: xz not found (Debian: apt-get install xz-utils)" >&2; exit 1; }
cd "$ROOT"
./scripts/setup.sh --torch "$TORCH" --parity --quiet
PYTHON_BIN=$ROOT/.venv/bin/python
cargo build --release --quiet -p llora-trainer --bin llora
built=$(./target/release/llora --version)
[[ $built == *"LibTorch $TORCH"* ]] || { echo "gpu-bundle.sh: built '$built', not against torch $TORCH" >&2; exit 1; }
# The test executable of the CUDA tests (unit tests of the model crate), as cargo names it.
tests=$(cargo test --release --quiet -p llora-model --lib --no-run --message-format=json \
  | "$PYTHON_BIN" -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l) if l.startswith("{") else {}
    if m.get("reason") == "compiler-artifact" and m.get("profile", {}).get("test") and m.get("executable"):
        print(m["executable"])')
[[ -n $tests ]] || { echo "gpu-bundle.sh: cargo built no test executable for llora-model" >&2; exit 1; }
mkdir -p "$OUT/scripts" "$OUT/configs" "$OUT/test-bin"
tmp=$(mktemp)
strip -o "$tmp" target/release/llora
xz -T0 -6 -c "$tmp" >"$OUT/llora.xz"
for t in $tests; do
  strip -o "$tmp" "$t"
  xz -T0 -6 -c "$tmp" >"$OUT/test-bin/$(basename "$t" | sed 's/-[0-9a-f]*$//').xz"
done
rm -f "$tmp"
cp scripts/gpu-check.sh scripts/trace-table.py scripts/copies.py scripts/bench-packing.sh scripts/node-libs.sh "$OUT/scripts/"
cp -r scripts/peer "$OUT/scripts/"
rm -rf "$OUT/scripts/peer/__pycache__"
cp configs/*.toml "$OUT/configs/"
if [[ -f runs/demo-base/config.json ]]; then
  mkdir -p "$OUT/runs"
  cp -r runs/demo-base "$OUT/runs/"
fi
cat >"$OUT/gpu-check.sh" <<'SH'
#!/usr/bin/env bash
# Unpacks llora (once) and runs its gpu-check here; see scripts/gpu-check.sh --help.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
unpack() { [[ -x $1 ]] || { xz -dc "$1.xz" >"$1.tmp" && chmod +x "$1.tmp" && mv "$1.tmp" "$1"; }; }
unpack "$here/llora"
for t in "$here"/test-bin/*.xz; do
  [[ -e $t ]] && unpack "${t%.xz}"
done
LLORA=${LLORA:-$here/llora} exec "$here/scripts/gpu-check.sh" "$@"
SH
chmod +x "$OUT/gpu-check.sh"
echo "$built" >"$OUT/VERSION"
du -sh "$OUT"
size_mb=$(du -sm "$OUT" | cut -f1)
[[ -z $MAX_MB ]] || ((size_mb <= MAX_MB)) ||
  { echo "gpu-bundle.sh: $OUT is $size_mb MB, over the --max-mb $MAX_MB asked for" >&2; exit 1; }
echo "gpu-bundle.sh: $OUT holds llora $built; on the node: $OUT/gpu-check.sh" >&2
