#!/usr/bin/env bash
# The whole test suite, from a fresh clone: installs what is missing (scripts/setup.sh), checks
# formatting and clippy, then builds and runs every test of the workspace. Extra arguments go
# to `cargo test`.
#
#   ./scripts/test.sh            # everything (what CI runs)
#   ./scripts/test.sh --quick    # the unit tier: each crate's own tests, model/tests and the
#                                #   house rules (tests/house.rs), no end-to-end runs (the
#                                #   README's test map has every file, its needs and its time)
#
# Tests run in the release profile: the tiny-model training tests are ~10x slower unoptimised,
# and the demo uses the same profile, so one build of the dependencies serves both.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

# CI starts from a fresh clone each time: keep compiled dependencies in a cache outside it.
if [[ "${CI:-}" == "true" && -z "${CARGO_TARGET_DIR:-}" ]]; then
  export CARGO_TARGET_DIR="$HOME/.cache/llora/target"
fi

QUICK=0
if [[ ${1:-} == --quick ]]; then
  QUICK=1
  shift
fi
./scripts/setup.sh --parity
# The habits every Rust project has: formatted (rustfmt.toml) and clippy-clean, or the suite fails.
cargo fmt --all --check || { echo "test.sh: run 'cargo fmt --all' (the tree is not formatted)" >&2; exit 1; }
cargo clippy --release --workspace --all-targets --quiet -- -D warnings
if ((QUICK)); then
  cargo test --release --workspace --lib --test house --test checkpoint_errors "$@"
else
  cargo test --release --workspace "$@"
  # Our CUDA kernels on the CPU under ThreadSanitizer and AddressSanitizer + UBSan (the sources
  # the release build above generated; ~20 s the first time, cached after).
  ./scripts/sanitize-kernels.sh
fi
