#!/usr/bin/env bash
# Fetch the onnxruntime-gpu wheel (CPython 3.12, manylinux_2_28 x86_64) and cut it into N
# parts for a GPU machine that receives the repository in transfers of at most 64 MiB:
#
#   benchmarks/ortgpu_parts.sh [--parts N] [--version V] [--limit-mib M]
#
# The parts go to the ignored folders .ortgpu1/part.0 .. .ortgpuN/part.<N-1> of the repo
# root (or of $GRAPHMP_ORTGPU_DIR); .ortgpuN/NAME holds the wheel's file name. Send one
# folder with each transfer (with the repo), then run benchmarks/gpu_check.sh there: it
# joins the parts, checks the wheel and installs it.
#
#   --parts N      number of parts (default 5)
#   --version V    onnxruntime-gpu version (default $ORT_GPU_VERSION, else 1.31.1)
#   --limit-mib M  one transfer's limit (default 64); each part must fit in it together
#                  with the repository's own files (tracked and untracked, not ignored)
# Exit 0 done, 1 the download failed, 2 bad options or parts too large (the message gives
# the smallest --parts that fits). Earlier .ortgpu* folders are replaced.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

N=5
VERSION=${ORT_GPU_VERSION:-1.31.1}
LIMIT_MIB=64
usage() { sed -n '2,17p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
while (($#)); do
  case $1 in
    --parts|-n) N=${2:?--parts needs a number}; shift 2 ;;
    --parts=*) N=${1#*=}; shift ;;
    --version) VERSION=${2:?--version needs a version}; shift 2 ;;
    --version=*) VERSION=${1#*=}; shift ;;
    --limit-mib) LIMIT_MIB=${2:?--limit-mib needs a number}; shift 2 ;;
    --limit-mib=*) LIMIT_MIB=${1#*=}; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "ortgpu_parts: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
if ! [[ $N =~ ^[1-9][0-9]*$ ]]; then echo "ortgpu_parts: --parts must be a positive integer, not '$N'" >&2; exit 2; fi
if ! [[ $LIMIT_MIB =~ ^[1-9][0-9]*$ ]]; then echo "ortgpu_parts: --limit-mib must be a positive integer" >&2; exit 2; fi
DEST=${GRAPHMP_ORTGPU_DIR:-$REPO}
PY=${PYTHON:-python3}

# What travels with every part: the repository's files that git does not ignore.
repo_bytes=0
if git -C "$REPO" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  repo_bytes=$(cd "$REPO" && git ls-files -z --cached --others --exclude-standard \
    | "$PY" -c 'import os, sys
names = [n for n in sys.stdin.buffer.read().split(b"\0") if n]
print(sum(os.path.getsize(n) for n in names if os.path.isfile(n)))')
fi
budget=$((LIMIT_MIB * 1024 * 1024 - repo_bytes))
if ((budget <= 0)); then
  echo "ortgpu_parts: the repository alone ($((repo_bytes >> 20)) MiB) does not fit in $LIMIT_MIB MiB" >&2
  exit 2
fi

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
echo "ortgpu_parts: downloading onnxruntime-gpu==$VERSION"
if ! "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 -d "$WORK" "onnxruntime-gpu==$VERSION"; then
  echo "ortgpu_parts: pip download of onnxruntime-gpu==$VERSION failed" >&2
  exit 1
fi
wheels=("$WORK"/onnxruntime_gpu-*.whl)
if [[ ! -f ${wheels[0]} ]]; then echo "ortgpu_parts: no onnxruntime_gpu wheel in the download" >&2; exit 1; fi
wheel=${wheels[0]}
name=$(basename "$wheel")
size=$(wc -c < "$wheel")

part=$(((size + N - 1) / N))
if ((part > budget)); then
  need=$(((size + budget - 1) / budget))
  echo "ortgpu_parts: $name is $((size >> 20)) MiB: $N parts of $((part >> 20)) MiB do not fit in" \
       "$LIMIT_MIB MiB with the repository ($((repo_bytes >> 20)) MiB); use --parts $need" >&2
  exit 2
fi

# Replace every earlier set of parts (a stale .ortgpuK/NAME would confuse gpu_check.sh).
for d in "$DEST"/.ortgpu*; do
  if [[ -d $d && $(basename "$d") =~ ^\.ortgpu[0-9]+$ ]]; then rm -rf "$d"; fi
done
split -b "$part" -d -a "${#N}" "$wheel" "$WORK/chunk."
for ((i = 0; i < N; i++)); do
  mkdir -p "$DEST/.ortgpu$((i + 1))"
  chunk=$WORK/chunk.$(printf "%0${#N}d" "$i")
  if [[ -f $chunk ]]; then
    mv "$chunk" "$DEST/.ortgpu$((i + 1))/part.$i"
  else
    : > "$DEST/.ortgpu$((i + 1))/part.$i"  # a tiny wheel: fewer bytes than parts
  fi
done
echo "$name" > "$DEST/.ortgpu$N/NAME"

if [[ $DEST == "$REPO" ]] && ! git -C "$REPO" check-ignore -q .ortgpu1 2>/dev/null; then
  echo "ortgpu_parts: warning: .ortgpu1 is not ignored by git here (.gitignore has /.ortgpu*/ upstream)" >&2
fi
echo "ortgpu_parts: $name ($((size >> 20)) MiB) in $N parts of at most $((part >> 20)) MiB:" \
     ".ortgpu1 .. .ortgpu$N in $DEST (repository $((repo_bytes >> 20)) MiB; limit $LIMIT_MIB MiB per transfer)"
