#!/usr/bin/env bash
# Install what llora needs to build and run, idempotently:
#   - a project venv (.venv, git-ignored) with torch from PyPI (2.9.0 unless --torch says
#     otherwise; 2.9 to 2.11 are supported): its bundled libtorch is what tch 0.22 /
#     burn-tch 0.22.1 link against (model/build.rs refuses a libtorch outside that range);
#   - .venv/libtorch, a stable link to that libtorch, which .cargo/config.toml points LIBTORCH
#     at, so plain `cargo build/test/run` work in a new shell with nothing exported;
#   - the headers the c10d shim (trainer/src/dist/) compiles against: Debian's libgloo-dev (the
#     torch wheel lacks gloo's headers; installed with apt-get when missing and we are root) and
#     two header-only CUDA wheels for its NCCL half, matching torch's CUDA (crt and cccl);
#   - the official MLPerf compliance checker (mlperf-logging), which `llora mlperf check` runs;
#   - with --parity: transformers, peft, safetensors, pyarrow, bitsandbytes and trl, for the
#     HF/PEFT parity tests (bitsandbytes: the NF4 reference; trl: real chat templates)
#     and the PyTorch + PEFT peer (scripts/peer/).
# Running it again reuses what is already right and only repairs what is not.
#
# To build against a torch that is already installed (a container's), skip this script and
# point LIBTORCH at that torch directory: LIBTORCH=/usr/lib/python3/site-packages/torch cargo
# build --release (docs/gpu.md).
#
# Usage: scripts/setup.sh [--torch VERSION] [--parity] [--quiet]
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV="$ROOT/.venv"
# The version asked for last (kept in the venv, so that scripts calling setup.sh without
# --torch, like test.sh, keep it), else 2.9.0.
TORCH_CHOICE="$VENV/llora-torch-version"
TORCH_VERSION=$(cat "$TORCH_CHOICE" 2>/dev/null || echo 2.9.0)
# The torch releases llora builds against: tch 0.22's generated wrapper compiles against each
# (checked: 2.9.0 and 2.11.0); 2.15's headers need C++20 and drop six functions tch binds.
SUPPORTED="2.9, 2.10, 2.11"
WANT_PARITY=0
QUIET=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --torch) [[ $# -ge 2 ]] || { echo "setup.sh: --torch needs a version, e.g. --torch 2.11.0" >&2; exit 2; }
      TORCH_VERSION=$2; shift ;;
    --torch=*) TORCH_VERSION=${1#--torch=} ;;
    --parity) WANT_PARITY=1 ;;
    --quiet) QUIET=1 ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "setup.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
[[ $TORCH_VERSION =~ ^([0-9]+)\.([0-9]+)\.[0-9]+$ ]] \
  || { echo "setup.sh: --torch '$TORCH_VERSION' is not a release version like 2.11.0" >&2; exit 2; }
case "${BASH_REMATCH[1]}.${BASH_REMATCH[2]}" in
  2.9|2.10|2.11) ;;
  *) echo "setup.sh: torch $TORCH_VERSION is outside the range llora builds against ($SUPPORTED)" >&2; exit 2 ;;
esac
# Header-only wheels that ProcessGroupNCCL.hpp needs besides torch's own nvidia-* wheels
# (crt/host_config.h, nv/target), at the CUDA version of torch's PyPI wheel.
case "${BASH_REMATCH[2]}" in
  9) NCCL_HEADER_PKGS=(nvidia-cuda-nvcc-cu12==12.8.93 nvidia-cuda-cccl-cu12==12.8.90) ;;  # CUDA 12.8
  10) NCCL_HEADER_PKGS=(nvidia-cuda-nvcc-cu12==12.8.93 nvidia-cuda-cccl-cu12==12.8.90) ;; # CUDA 12.8
  11) NCCL_HEADER_PKGS=(nvidia-cuda-crt==13.0.88 nvidia-cuda-cccl==13.0.85) ;;            # CUDA 13.0 (crt split from nvcc)
esac
# Versions the parity fixtures were made and checked with (scripts/peer/README.md); pyarrow for
# the peer's time-to-train job (scripts/peer/ttt.py); TRL for its models' own chat templates
# (trl/chat_templates: Qwen 2.5, Qwen 3, Llama 3.1, and Qwen 3's with generation markup).
# TensorBoard for its own reader of the event files llora writes (tests/it/train.rs).
PARITY_PKGS=(transformers==5.23.0 peft==0.21.2 safetensors numpy pyarrow bitsandbytes==0.50.2 trl==1.16.0 tensorboard==2.20.0)
# The official MLPerf Training compliance checker behind `llora mlperf check`.
CHECKER_PKG=mlperf-logging==4.1.68

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

# Free space (GiB) on the filesystem holding PATH's nearest existing folder.
free_gib() { local d=$1; while [[ ! -d $d ]]; do d=$(dirname "$d"); done; df -Pk "$d" | awk 'NR == 2 { print int($4 / 1048576) }'; }
disk_advice() {
  echo "$VENV and pip's temporary folder (${TMPDIR:-/tmp}) have $(free_gib "$VENV") and $(free_gib "${TMPDIR:-/tmp}") GiB free;" \
    "torch's CUDA wheel needs ~$TORCH_GIB GiB installed, the parity packages ~2 more. Free space (old clones' .venv and target folders) or set TMPDIR, then rerun"
}
TORCH_GIB=7
pip_install() {
  # pip's own error names the package; add the cause we can tell (a full disk) or what to
  # check, since the usual other cause here is an unreachable registry. Its output is held in
  # memory: a file could not be written on the disk that filled.
  local out
  if ! out=$("$VPY" -m pip install --disable-pip-version-check --quiet "$@" 2>&1); then
    printf '%s\n' "$out" >&2
    [[ $out != *"No space left on device"* ]] || die "pip ran out of disk space installing $*: $(disk_advice)"
    die "pip could not install: $* (is the PyPI registry reachable from this machine? check proxy/network settings and retry)"
  fi
  [[ -z $out ]] || printf '%s\n' "$out" >&2
}

torch_version() { "$VPY" -c 'from importlib.metadata import version; print(version("torch").split("+")[0])' 2>/dev/null || true; }
have=$(torch_version)
if [[ "$have" != "$TORCH_VERSION" ]]; then
  if [[ -n "$have" ]]; then say "torch $have found, replacing it with $TORCH_VERSION"; fi
  say "installing torch==$TORCH_VERSION into $VENV (the CUDA wheel, ~3.5 GB; it also runs on CPU)"
  # Refuse in a second what pip would fail at after minutes of download, naming the cause.
  (($(free_gib "$VENV") >= TORCH_GIB)) || die "not enough free disk for torch: $(disk_advice)"
  pip_install "torch==$TORCH_VERSION"
  have=$(torch_version)
  [[ "$have" == "$TORCH_VERSION" ]] || die "torch $TORCH_VERSION did not import after install (got '${have:-nothing}')"
else
  say "torch $TORCH_VERSION present in $VENV"
fi
echo "$TORCH_VERSION" >"$TORCH_CHOICE"

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
# CUDA 12 wheels put headers in nvidia/<package>/include, CUDA 13 ones in nvidia/cu13/include.
if ! "$VPY" -c 'import importlib.util as u, os, sys; d = u.find_spec("nvidia").submodule_search_locations[0]; sys.exit(0 if all(any(os.path.exists(os.path.join(d, p, "include", h)) for p in (pkg, "cu13")) for pkg, h in (("cuda_nvcc", "crt/host_config.h"), ("cuda_cccl", "nv/target"))) else 1)' >/dev/null 2>&1; then
  say "installing the CUDA headers the NCCL half of the c10d shim compiles against: ${NCCL_HEADER_PKGS[*]}"
  pip_install --no-deps "${NCCL_HEADER_PKGS[@]}"
fi

if ! "$VPY" -c 'import mlperf_logging.compliance_checker' >/dev/null 2>&1; then
  say "installing the MLPerf compliance checker: $CHECKER_PKG"
  pip_install "$CHECKER_PKG"
fi

if [[ $WANT_PARITY == 1 ]]; then
  if ! "$VPY" -c 'import transformers, peft, safetensors, numpy, pyarrow, bitsandbytes, trl, tensorboard' >/dev/null 2>&1; then
    say "installing parity-test packages: ${PARITY_PKGS[*]}"
    pip_install "${PARITY_PKGS[@]}"
  else
    say "parity-test packages present"
  fi
fi

# What the end-to-end tests' build reads (build/tests.rs): whether the peer packages import,
# so that tests needing them are ignored, with their reason, where they are missing. Written
# only when it changes: a rewrite would rebuild the test binary.
peer=no
"$VPY" -c 'import importlib.util as u, sys; sys.exit(0 if all(u.find_spec(m) for m in ("transformers", "peft", "safetensors", "numpy", "pyarrow", "bitsandbytes", "trl", "tensorboard")) else 1)' >/dev/null 2>&1 && peer=yes
[[ $(cat "$VENV/llora-peer" 2>/dev/null) == "$peer" ]] || echo "$peer" >"$VENV/llora-peer"

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
