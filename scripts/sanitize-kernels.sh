#!/usr/bin/env bash
# Our CUDA kernels on the CPU under ThreadSanitizer, then under AddressSanitizer +
# UndefinedBehaviorSanitizer (model/src/kernels/emulation/sanitize.cpp: each kernel launched as
# its Rust launch code launches it, on buffers of exactly its problem's size). The kernel
# sources for the CPU are the ones model/build.rs generates (run a cargo build first; test.sh
# does); each sanitizer build takes a few seconds and is cached by the sources' hash.
#
#   ./scripts/sanitize-kernels.sh        # both; exit 1 on any report
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
EMU=$ROOT/model/src/kernels/emulation
# The newest generated sources of the release build (one registry per build of llora-model).
REGISTRY=$(ls -t "$TARGET"/release/build/llora-model-*/out/emu_registry.cpp 2>/dev/null | head -1 || true)
[[ -n $REGISTRY ]] || { echo "sanitize-kernels: no generated kernel sources under $TARGET/release: run cargo build --release first" >&2; exit 2; }
GEN=$(dirname "$REGISTRY")
SOURCES=("$EMU/emulate.cpp" "$EMU/sanitize.cpp" "$GEN"/emu_*.cpp)
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/llora/sanitize-kernels
mkdir -p "$CACHE"
KEY=$(cat "${SOURCES[@]}" "$EMU"/*.h | sha256sum | cut -c1-16)
status=0
for sanitizer in thread address,undefined; do
  bin="$CACHE/sanitize-${sanitizer%%,*}-$KEY"
  if [[ ! -x $bin ]]; then
    g++ -std=c++20 -O1 -g -pthread -ffp-contract=off -fno-omit-frame-pointer "-fsanitize=$sanitizer" \
      -fno-sanitize-recover=undefined -DLLORA_EMU_CHECKED_SHARED -I "$EMU" -I "$EMU/include" \
      "${SOURCES[@]}" -o "$bin.tmp"
    mv "$bin.tmp" "$bin"
  fi
  echo "sanitize-kernels: $sanitizer"
  # Any report is an error: TSan exits 66, ASan/UBSan abort.
  if ! TSAN_OPTIONS="halt_on_error=1 exitcode=66" ASAN_OPTIONS="detect_leaks=1 halt_on_error=1" \
      "$bin" > "$CACHE/last-${sanitizer%%,*}.log" 2>&1; then
    cat "$CACHE/last-${sanitizer%%,*}.log" >&2
    echo "sanitize-kernels: $sanitizer reported a problem (above)" >&2
    status=1
  else
    echo "sanitize-kernels: $sanitizer clean ($(grep -c '^ran ' "$CACHE/last-${sanitizer%%,*}.log") launches)"
  fi
done
exit $status
