#!/usr/bin/env bash
# The GPU check, one command on a GPU machine (docs/gpu.md):
#
#   benchmarks/gpu_check.sh [--out DIR] [--models resnet50,bert-base,detector,gpt2] [...]
#   benchmarks/gpu_check.sh --dry-run          # the same steps on the CPU, tiny models (CI)
#
# 1. Installs the GPU extra from the wheels it is given, into $GRAPHMP_GPU_SITE
#    (default /tmp/graphmp-gpu-site), PREPENDED to PYTHONPATH (nothing in site-packages changes):
#    - onnxruntime-gpu in N parts .ortgpu1/part.0 .. .ortgpuN/part.<N-1> in the repo root (or
#      in $GRAPHMP_ORTGPU_DIR; made by benchmarks/ortgpu_parts.sh, N = 5 by default;
#      .ortgpuN/NAME is the wheel's file name and says N): joined, checked as a zip, installed;
#    - every wheel in $GRAPHMP_WHEELS (default .whl/), e.g. tensorrt's, installed alike.
#    The CUDA/cuDNN libraries of pip's nvidia-* packages (torch's) go on LD_LIBRARY_PATH for
#    onnxruntime-gpu's CUDA provider.
# 2. Runs benchmarks/gpu_check.py with the arguments given: models, convert, FP16 numerics on
#    ORT CUDA, graphmp bench (ORT CUDA, TensorRT when it imports) at batch 1 and 32,
#    benchmarks/train.py on CUDA, pytest -m gpu. Writes DIR/gpu_check.json + .png, prints a table.
# Exit 0 all passed, 1 a check failed, 2 cannot run (no CUDA provider, bad wheel parts).
# PYTHON picks the interpreter (default python3; with --dry-run, .venv/bin/python when present).
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"

# shellcheck source=benchmarks/_gpu_site.sh
source "$REPO/benchmarks/_gpu_site.sh" "$@"

exec "$PY" benchmarks/gpu_check.py "$@"
