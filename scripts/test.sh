#!/usr/bin/env bash
# The test suite, from a fresh clone: installs what is missing (scripts/setup.sh), then runs it
# in the release profile (the tiny-model training tests are ~10x slower unoptimised, and the
# demo uses the same profile, so one build of the dependencies serves both). Extra arguments
# go to `cargo test`.
#
#   ./scripts/test.sh            # everything, what CI runs: the peer venv (setup.sh --parity),
#                                #   formatting, clippy, every test, the kernel sanitizers
#   ./scripts/test.sh --quick    # the unit tier: torch only (setup.sh), each crate's own tests
#                                #   and the house rules; builds nothing else (docs/testing.md)
#
# A test that needs the peer venv or node is ignored, with its reason, where they are missing
# (build/tests.rs); the full run installs the venv and refuses to run without it.
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
if ((QUICK)); then
  ./scripts/setup.sh
  cargo fmt --all --check || { echo "test.sh: run 'cargo fmt --all' (the tree is not formatted)" >&2; exit 1; }
  cargo test --release --workspace --lib "$@"
  cargo test --release --test it "$@" -- house:: checkpoint::
  exit 0
fi
./scripts/setup.sh --parity
# The peer venv is what the parity tests compare with: the full run never skips them.
[[ $(cat .venv/llora-peer 2>/dev/null) == yes ]] || { echo "test.sh: the peer venv is incomplete after setup.sh --parity (.venv/llora-peer)" >&2; exit 1; }
# The habits every Rust project has: formatted (rustfmt.toml) and clippy-clean, or the suite fails.
cargo fmt --all --check || { echo "test.sh: run 'cargo fmt --all' (the tree is not formatted)" >&2; exit 1; }
cargo clippy --release --workspace --all-targets --quiet -- -D warnings
cargo test --release --workspace "$@"
# Our CUDA kernels on the CPU under ThreadSanitizer and AddressSanitizer + UBSan (the sources
# the release build above generated; ~20 s the first time, cached after).
./scripts/sanitize-kernels.sh
