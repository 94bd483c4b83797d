#!/usr/bin/env bash
# The training-step measurement for a GPU machine, one command (the GPU half of the
# training-speed issue; the CPU half is benchmarks/train_cpu.py):
#
#   benchmarks/train_gpu.sh [--out DIR] [--steps 20] [--warmup 5]
#   benchmarks/train_gpu.sh --dry-run [--out DIR]   # the same code on the CPU at toy size (< 60 s)
#   benchmarks/train_gpu.sh --build-only [--out DIR]  then  --reuse [--out DIR]   # build, then time
#
# 1. Installs the GPU extra from the wheels it is given (onnxruntime-gpu in parts, other
#    wheels), exactly as benchmarks/gpu_check.sh does (the shared benchmarks/_gpu_site.sh).
# 2. benchmarks/train.py --device cuda --models resnet50,bert-base: ResNet-50 (batch 32 of
#    3x224x224) and BERT-base (12 layers d 768, batch 32 x 128 tokens) training steps on ORT
#    CUDA (graphmp's step, FP32 and mixed, state bound on the GPU) and torch CUDA (FP32 and
#    AMP FP16 + GradScaler), AdamW lr 1e-4, each engine in its own process (median of --steps
#    after --warmup). Targets (the `targets` section of the JSON): ORT mixed >= 1.5x its FP32
#    step, and within 1.2x torch AMP. -> DIR/train_gpu.json
# 3. benchmarks/train_session.py on the mixed ResNet-50 b32 step of 2.: the step session's
#    settings side by side, each variant in its own process, one after the other: ORT's default
#    CUDA options, graphmp's (prefer_nhwc=1 for FP16 convs, cuDNN EXHAUSTIVE + max workspace),
#    and graphmp's with --cuda-graph (or the one line that refuses it). -> DIR/train_session.json;
#    the same for the mixed BERT-base step -> DIR/train_session_bert.json
# 4. benchmarks/train_profile_gpu.py on the four step graphs: GPU time by phase, op type and
#    node (launches blocking, ORT's profiler), and the nodes placed on the CPU. -> DIR/profile.json
# 5. benchmarks/step_audit.py on the four step graphs at batch 32: nodes by phase, MB moved by
#    the non-GEMM nodes. -> DIR/audit.json ({run folder name: audit})
# 6. benchmarks/train_grads.py --device cuda --only dx,dw,fwd --net resnet50-224: the conv gradient
#    and forward forms one by one on the CUDA provider (their shape rules were derived on the
#    CPU). -> DIR/grads_cuda.json (skipped with --dry-run)
# --build-only: only the exports and step graphs of 2. (into DIR/runs; the installed onnxruntime,
# no GPU needed), so that a later --reuse run times them without building again.
# --dry-run: train.py --device cpu --tiny (the same models at toy size, batch 4, ORT CPU and
# torch CPU), 2 timed steps, the session variants on the CPU provider (--cuda-graph refused:
# no CUDA), the audit at batch 4: it checks that the script runs; its numbers say nothing about
# a GPU.
# Exit 0 done, 1 a row failed, 2 cannot run (no CUDA provider, bad wheel parts).
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"

OUT=benchmarks/results/train_gpu
STEPS=20
WARMUP=5
DRY=0
BUILD_ONLY=0
REUSE=()
while (($#)); do
  case $1 in
    --out) OUT=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --warmup) WARMUP=$2; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    --build-only) BUILD_ONLY=1; shift ;;
    --reuse) REUSE=(--reuse); shift ;;
    *) echo "train_gpu: unknown argument $1 (--out DIR, --steps N, --warmup N, --dry-run, --build-only, --reuse)" >&2
       exit 2 ;;
  esac
done
mkdir -p "$OUT"

if ((BUILD_ONLY)); then
  # Step 2's exports and step graphs only, with the installed onnxruntime (no wheels needed): a
  # GPU session can build them while the onnxruntime-gpu parts still travel; --reuse then
  # times them.
  PY=${PYTHON:-python3}
  if [[ -z ${PYTHON:-} ]] && ((DRY)) && [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; fi
  export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
  tiny=()
  if ((DRY)); then tiny=(--tiny); fi
  exec "$PY" benchmarks/train.py --device cuda "${tiny[@]}" --models resnet50,bert-base --build-only \
    --work "$OUT/runs"
fi
if ((DRY)); then
  # shellcheck source=benchmarks/_gpu_site.sh
  source "$REPO/benchmarks/_gpu_site.sh" --dry-run
  export OMP_NUM_THREADS=1  # toy sizes: more threads only fight over a shared CPU
  device=(--device cpu --tiny)
  session_device=(--device cpu --tiny)
  profile_device=(--device cpu --tiny --steps 2)
  STEPS=2
  WARMUP=1
  BATCH=4
else
  # shellcheck source=benchmarks/_gpu_site.sh
  source "$REPO/benchmarks/_gpu_site.sh"
  device=(--device cuda)
  session_device=(--device cuda)
  profile_device=(--device cuda)
  BATCH=32
fi

rc=0
"$PY" benchmarks/train.py "${device[@]}" --models resnet50,bert-base --steps "$STEPS" --warmup "$WARMUP" \
  --no-curves --json "$OUT/train_gpu.json" --work "$OUT/runs" "${REUSE[@]}" || rc=$?
if ((rc == 2)); then exit 2; fi
for m in resnet50 bert-base; do
  json=$OUT/train_session.json
  if [[ $m == bert-base ]]; then json=$OUT/train_session_bert.json; fi
  if [[ -f $OUT/runs/$m-mixed/train.json ]]; then
    "$PY" benchmarks/train_session.py "$OUT/runs/$m-mixed" "${session_device[@]}" --steps "$STEPS" \
      --warmup "$WARMUP" --json "$json" || rc=1
  else
    echo "train_gpu: no $OUT/runs/$m-mixed run folder: its session variants are not measured" >&2
    rc=1
  fi
done
runs=()
for m in resnet50 bert-base; do
  for p in fp32 mixed; do
    if [[ -f $OUT/runs/$m-$p/train.json ]]; then runs+=("$OUT/runs/$m-$p"); fi
  done
done
if ((${#runs[@]})); then
  "$PY" benchmarks/train_profile_gpu.py "${runs[@]}" "${profile_device[@]}" --json "$OUT/profile.json" || rc=1
  "$PY" benchmarks/step_audit.py "${runs[@]}" --batch "$BATCH" --json "$OUT/audit.json" || rc=1
fi
if ((!DRY)); then
  "$PY" benchmarks/train_grads.py --device cuda --only dx,dw,fwd --net resnet50-224 --rounds 11 \
    --json "$OUT/grads_cuda.json" || rc=1
fi
echo "train_gpu: wrote $OUT/train_gpu.json, $OUT/train_session.json, $OUT/train_session_bert.json," \
  "$OUT/profile.json, $OUT/audit.json and (on a GPU) $OUT/grads_cuda.json"
exit $rc
