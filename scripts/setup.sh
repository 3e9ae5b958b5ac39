#!/usr/bin/env bash
# Install what llora needs to build and run, idempotently:
#   - a project venv (.venv, git-ignored) with torch==2.9.0 from PyPI: its bundled libtorch is
#     what tch 0.22 / burn-tch 0.22.1 link against (they require exactly 2.9.0);
#   - .venv/libtorch, a stable link to that libtorch, which .cargo/config.toml points LIBTORCH
#     at, so plain `cargo build/test/run` work in a new shell with nothing exported;
#   - the headers the c10d shim (trainer/src/dist/) compiles against: Debian's libgloo-dev (the
#     torch wheel lacks gloo's headers; installed with apt-get when missing and we are root) and
#     two header-only CUDA wheels for its NCCL half (nvidia-cuda-nvcc-cu12, nvidia-cuda-cccl-cu12);
#   - the official MLPerf compliance checker (mlperf-logging), which `llora mlperf check` runs;
#   - with --parity: transformers, peft, safetensors and pyarrow, for the HF/PEFT parity tests
#     and the PyTorch + PEFT peer (scripts/peer/).
# Running it again reuses what is already right and only repairs what is not.
#
# Usage: scripts/setup.sh [--parity] [--quiet]
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV="$ROOT/.venv"
TORCH_VERSION=2.9.0
# Header-only wheels that ProcessGroupNCCL.hpp needs besides torch's own nvidia-* wheels
# (crt/host_config.h, nv/target); versions of torch 2.9.0's CUDA 12.8.
NCCL_HEADER_PKGS=(nvidia-cuda-nvcc-cu12==12.8.93 nvidia-cuda-cccl-cu12==12.8.90)
# Versions the parity fixtures were made and checked with (scripts/peer/README.md); pyarrow for
# the peer's time-to-train job (scripts/peer/ttt.py).
PARITY_PKGS=(transformers==5.23.0 peft==0.21.2 safetensors numpy pyarrow)
# The official MLPerf Training compliance checker behind `llora mlperf check`.
CHECKER_PKG=mlperf-logging==4.1.68
WANT_PARITY=0
QUIET=0
for arg in "$@"; do
  case "$arg" in
    --parity) WANT_PARITY=1 ;;
    --quiet) QUIET=1 ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "setup.sh: unknown argument '$arg' (see --help)" >&2; exit 2 ;;
  esac
done

say() { [[ $QUIET == 1 ]] || echo "setup: $*" >&2; }
die() { echo "setup.sh: error: $*" >&2; exit 1; }

# --- Rust toolchain -------------------------------------------------------------------------
command -v cargo >/dev/null 2>&1 || die "cargo not found: install a Rust toolchain (>= 1.95) with rustup first"

# --- Python + venv --------------------------------------------------------------------------
PYTHON=${PYTHON:-python3}
command -v "$PYTHON" >/dev/null 2>&1 || die "python3 not found: install Python >= 3.10 with venv and pip (Debian: apt-get install python3 python3-venv python3-pip)"
"$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' \
  || die "$("$PYTHON" --version 2>&1) is too old: torch $TORCH_VERSION needs Python >= 3.10"

venv_ok() { [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" -c 'import sys' >/dev/null 2>&1; }
if ! venv_ok; then
  say "creating venv $VENV"
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV" 2>/dev/null \
    || die "'$PYTHON -m venv' failed: install the venv module (Debian: apt-get install python3-venv)"
fi
VPY="$VENV/bin/python"
"$VPY" -m pip --version >/dev/null 2>&1 \
  || "$VPY" -m ensurepip --upgrade >/dev/null 2>&1 \
  || die "pip is missing in $VENV and ensurepip failed (Debian: apt-get install python3-pip)"

pip_install() {
  # pip's own error already names the package; add what to check, since the usual cause here
  # is an unreachable registry.
  if ! "$VPY" -m pip install --disable-pip-version-check --quiet "$@"; then
    die "pip could not install: $* (is the PyPI registry reachable from this machine? check proxy/network settings and retry)"
  fi
}

torch_version() { "$VPY" -c 'from importlib.metadata import version; print(version("torch").split("+")[0])' 2>/dev/null || true; }
have=$(torch_version)
if [[ "$have" != "$TORCH_VERSION" ]]; then
  if [[ -n "$have" ]]; then say "torch $have found, replacing it with $TORCH_VERSION"; fi
  say "installing torch==$TORCH_VERSION into $VENV (the CUDA wheel, ~3.5 GB; it also runs on CPU)"
  pip_install "torch==$TORCH_VERSION"
  have=$(torch_version)
  [[ "$have" == "$TORCH_VERSION" ]] || die "torch $TORCH_VERSION did not import after install (got '${have:-nothing}')"
else
  say "torch $TORCH_VERSION present in $VENV"
fi

# --- Headers of the c10d shim ---------------------------------------------------------------
if [[ ! -f /usr/include/gloo/config.h ]]; then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null 2>&1; then
    say "installing libgloo-dev (gloo's headers, for the c10d shim) with apt-get"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libgloo-dev; } >/dev/null 2>&1 \
      || die "apt-get could not install libgloo-dev (is Debian's package registry reachable?)"
  else
    die "gloo's headers (/usr/include/gloo) are missing: the c10d shim needs them. Install Debian's libgloo-dev (sudo apt-get install libgloo-dev) and rerun"
  fi
fi
if ! "$VPY" -c 'import importlib.util as u, os, sys; d = os.path.dirname(u.find_spec("nvidia").submodule_search_locations[0]); sys.exit(0 if all(os.path.exists(os.path.join(d, "nvidia", p)) for p in ("cuda_nvcc/include/crt/host_config.h", "cuda_cccl/include/nv/target")) else 1)' >/dev/null 2>&1; then
  say "installing the CUDA headers the NCCL half of the c10d shim compiles against: ${NCCL_HEADER_PKGS[*]}"
  pip_install --no-deps "${NCCL_HEADER_PKGS[@]}"
fi

if ! "$VPY" -c 'import mlperf_logging.compliance_checker' >/dev/null 2>&1; then
  say "installing the MLPerf compliance checker: $CHECKER_PKG"
  pip_install "$CHECKER_PKG"
fi

if [[ $WANT_PARITY == 1 ]]; then
  if ! "$VPY" -c 'import transformers, peft, safetensors, numpy, pyarrow' >/dev/null 2>&1; then
    say "installing parity-test packages: ${PARITY_PKGS[*]}"
    pip_install "${PARITY_PKGS[@]}"
  else
    say "parity-test packages present"
  fi
fi

# --- The libtorch link that .cargo/config.toml names ----------------------------------------
# find_spec locates torch without importing it (importing is slow and warns without numpy).
TORCH_DIR=$("$VPY" -c 'import os, importlib.util as u; print(os.path.dirname(u.find_spec("torch").origin))')
[[ -f "$TORCH_DIR/lib/libtorch_cpu.so" ]] || die "no libtorch_cpu.so under $TORCH_DIR/lib: the torch install looks broken; delete $VENV and rerun"
ln -sfn "$TORCH_DIR" "$VENV/libtorch"

# --- Repair torch-sys build dirs a failed or foreign build left behind ----------------------
# torch-sys caches its build script's result. A build attempted before the venv existed may
# have started a libtorch download (an `out/libtorch` dir that later builds trust even when
# half-empty), or recorded a libtorch directory that is gone. Either way, clean it so the next
# build links against .venv/libtorch.
for target in "$ROOT/target" ${CARGO_TARGET_DIR:+"$CARGO_TARGET_DIR"}; do
  [[ -d "$target" ]] || continue
  for build in "$target"/*/build/torch-sys-*; do
    [[ -d "$build" ]] || continue
    stale=0
    [[ -e "$build/out/libtorch" ]] && stale=1
    if [[ -f "$build/output" ]]; then
      lib=$(sed -n 's/^cargo:libtorch_lib=//p' "$build/output")
      [[ -n "$lib" && ! -f "$lib/libtorch_cpu.so" ]] && stale=1
    fi
    if [[ $stale == 1 ]]; then
      say "removing stale torch-sys build state $build"
      rm -rf "$build"
      # The build-script run's fingerprint shares the build dir's name; dropping it makes
      # cargo rerun exactly this build script, and nothing else.
      profile_dir=$(dirname "$(dirname "$build")")
      rm -rf "${profile_dir:?}/.fingerprint/$(basename "$build")"
    fi
  done
done

say "ready: cargo build / test / run work in any shell from $ROOT"
