# Sourced by scripts/gpu-check.sh and scripts/bench-packing.sh: a llora built on another machine
# (scripts/gpu-bundle.sh) loads the node's LibTorch, CUDA, cuDNN and NCCL from $PYTHON's torch
# wheel, so this puts torch/lib and every nvidia/*/lib folder of that wheel on LD_LIBRARY_PATH.
torch_libs=$("$PYTHON" - <<'PY'
import glob, os, torch
lib = os.path.join(os.path.dirname(torch.__file__), "lib")
site = os.path.dirname(os.path.dirname(torch.__file__))
nvidia = sorted({os.path.dirname(p) for p in glob.glob(os.path.join(site, "nvidia", "**", "lib*.so*"), recursive=True)})
print(":".join([lib] + nvidia))
PY
)
export LD_LIBRARY_PATH="$torch_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
