#!/usr/bin/env bash
# The main job on the embedded default config (configs/tiny-cpu.toml: tiny Llama, synthetic
# GovReport-shaped data, CPU), from a fresh clone: installs what is missing, builds, runs.
# Extra arguments go to `llora train`, e.g. `./scripts/demo.sh --set run.threads=2`.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
./scripts/setup.sh
cargo build --release --bin llora
exec cargo run --release --quiet --bin llora -- train "$@"
