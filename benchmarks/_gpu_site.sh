# Sourced (never run) by benchmarks/gpu_check.sh and benchmarks/train_gpu.sh, from the repo
# root with REPO set, the script's arguments passed on: "$@" containing --dry-run means the CPU
# dry run. Sets PY (the interpreter: $PYTHON, else .venv/bin/python for a dry run when present,
# else python3) and, for a GPU run, installs the GPU extra from the wheels it is given into
# $GRAPHMP_GPU_SITE (default /tmp/graphmp-gpu-site) PREPENDED to PYTHONPATH (see gpu_check.sh
# step 1), with the CUDA/cuDNN libraries of pip's nvidia-* packages on LD_LIBRARY_PATH; a dry
# run only prepends the repo to PYTHONPATH. Exits 2 when the wheel parts are bad.
DRY=0
for a in "$@"; do
  if [[ $a == --dry-run ]]; then DRY=1; fi
done
PY=${PYTHON:-}
if [[ -z $PY ]]; then
  if [[ $DRY == 1 && -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi

if [[ $DRY == 0 ]]; then
  SITE=${GRAPHMP_GPU_SITE:-/tmp/graphmp-gpu-site}
  WHEELDIR=$(mktemp -d)
  PARTS=${GRAPHMP_ORTGPU_DIR:-$REPO}
  wheels=()
  # N = the number of the folder holding NAME; the lowest one when several do (a stale
  # .ortgpuK/NAME of an earlier split into more parts may be left over).
  nparts=0
  for d in "$PARTS"/.ortgpu*/; do
    k=$(basename "$d")
    k=${k#.ortgpu}
    if [[ $k =~ ^[1-9][0-9]*$ && -f $PARTS/.ortgpu$k/NAME ]] && ((nparts == 0 || k < nparts)); then nparts=$k; fi
  done
  if ((nparts)); then
    name=$(tr -d '[:space:]' < "$PARTS/.ortgpu$nparts/NAME")
    for ((i = 1; i <= nparts; i++)); do
      part=$PARTS/.ortgpu$i/part.$((i - 1))
      if [[ ! -f $part ]]; then
        echo "gpu_check: $part is missing: the onnxruntime-gpu wheel comes in $nparts parts .ortgpu1..$nparts (benchmarks/ortgpu_parts.sh)" >&2
        exit 2
      fi
      cat "$part" >> "$WHEELDIR/$name"
    done
    if ! "$PY" -c 'import sys, zipfile; sys.exit(zipfile.ZipFile(sys.argv[1]).testzip() is not None)' "$WHEELDIR/$name"; then
      echo "gpu_check: the joined parts do not make a valid wheel ($name): send all $nparts again" >&2
      exit 2
    fi
    wheels+=("$WHEELDIR/$name")
  fi
  for w in "${GRAPHMP_WHEELS:-.whl}"/*.whl; do
    if [[ -f $w ]]; then wheels+=("$w"); fi
  done
  if ((${#wheels[@]})); then
    echo "gpu_check: installing ${wheels[*]##*/} into $SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}"
  else
    echo "gpu_check: no wheels given (.ortgpu1..N, ${GRAPHMP_WHEELS:-.whl}/*.whl): using the installed onnxruntime"
  fi
  rm -rf "$WHEELDIR"
  export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}"
  libs=$("$PY" - <<'EOF'
import glob, os, site, sys
roots = [p for p in sys.path if p.endswith("-packages")] + site.getsitepackages()
print(":".join(sorted({d for r in roots for d in glob.glob(os.path.join(r, "nvidia", "*", "lib"))})))
EOF
)
  if [[ -n $libs ]]; then export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; fi
else
  export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
fi

