#!/usr/bin/env bash
# Create a separate venv with NVIDIA ModelOpt AutoCast for benchmarks/convert.py.
#
# nvidia-modelopt pins onnx~=1.21 / onnxruntime-gpu~=1.24 / torch, which conflict
# with graphmp's own venv, so it lives in its own venv (default /work/venv-modelopt)
# and benchmarks/convert.py runs it as a subprocess via benchmarks/_autocast_runner.py.
#
# CPU-only route: the package's "[onnx]" extra would pull onnxruntime-gpu and
# cupy-cuda12x on Linux x86_64. Neither is needed for AutoCast on CPU: its
# reference run defaults to providers=["cpu"]. So we install nvidia-modelopt
# (which still hard-requires torch; torch imports fine without a GPU) plus the
# [onnx] extra's list by hand with the plain CPU `onnxruntime` instead.
#
# Usage: bash benchmarks/setup_autocast.sh [VENV_DIR]    (or AUTOCAST_VENV=...)
# Disk: ~6 GB (torch + its CUDA wheels come from PyPI), or ~1.4 GB with a CPU torch:
# TORCH_SPEC is installed first when set, and nvidia-modelopt then keeps that torch, e.g.
#   TORCH_SPEC=torch==2.13.0 bash benchmarks/setup_autocast.sh   (a CPU wheel on a find-links path)
#   TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cpu" bash benchmarks/setup_autocast.sh
set -euo pipefail

VENV="${1:-${AUTOCAST_VENV:-/work/venv-modelopt}}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
MODELOPT_VERSION="${MODELOPT_VERSION:-0.47.0}"

if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
if [ -n "${TORCH_SPEC:-}" ]; then
    # shellcheck disable=SC2086  # TORCH_SPEC may carry pip options
    "$VENV/bin/python" -m pip install -q $TORCH_SPEC
fi
"$VENV/bin/python" -m pip install -q "nvidia-modelopt==${MODELOPT_VERSION}"
# The [onnx] extra, minus onnxruntime-gpu/cupy, with CPU onnxruntime:
"$VENV/bin/python" -m pip install -q \
    "onnx~=1.21.0" \
    "onnxruntime~=1.24.2" \
    "onnx-graphsurgeon>=0.6.1" \
    "onnxconverter-common~=1.16.0" \
    onnxscript \
    "onnxslim>=0.1.76" \
    "polygraphy>=0.53.4" \
    ml_dtypes cppimport lief psutil

"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
import onnxruntime as ort
from modelopt.onnx.autocast import convert_to_mixed_precision  # noqa: F401
print("AutoCast OK: nvidia-modelopt", md.version("nvidia-modelopt"),
      "onnx", md.version("onnx"), "onnxruntime", ort.__version__,
      "providers", ort.get_available_providers())
EOF
echo "AutoCast venv ready: $VENV (pass --autocast-python $VENV/bin/python if not the default)"
