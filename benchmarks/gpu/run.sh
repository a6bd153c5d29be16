#!/usr/bin/env bash
# The GPU kit's one command (README "GPU kit"): measures what only a card can, with zerotune's own commands.
#   bash benchmarks/gpu/run.sh PART [--dry-run]        PART: first | loading | env | reference | grid | paths | flux | all
# `loading` is a lease's first call: the reference rows' loading peak with deepspeed.param_groups=16, then =1, then
# ZeRO-3 with the parameters on the host, as far as its budget goes. `first`: the environment, then the two
# reference rows beside the planner's prediction.
# On the GPU machine it first installs .whl/ (make gpu-kit) offline into /tmp/site; each part writes
# $OUT/<part>.json and $OUT/<part>.md ($OUT defaults to ./gpu-out), prints its plan (each piece's estimated
# seconds on an H100) and fits in 8 minutes from this script's start, the install included
# (ZEROTUNE_GPU_KIT_BUDGET_S=<seconds> changes that). --dry-run runs the same steps on this machine's CPU with tiny
# shapes and the current interpreter (.venv/bin/python when present), no install and no nvidia-smi: every GPU
# figure is written as null ("unmeasured" in the tables).
# Run folders go to $GPU_KIT_WORK (default /tmp/zerotune-gpu-kit), not $OUT: the device tool brings back 8 files.
set -euo pipefail
# the budget counts from here: the install is the call's time too
export GPU_KIT_STARTED=$(date +%s.%N)
cd "$(dirname "$0")/../.."
PART=${1:?usage: bash benchmarks/gpu/run.sh first|loading|env|reference|grid|paths|flux|all [--dry-run]}
DRY=${2:-}
case $PART in first|loading|env|reference|grid|paths|flux|all) ;; *) echo "run.sh: no part '$PART'" >&2; exit 2 ;; esac
case $DRY in ""|--dry-run) ;; *) echo "run.sh: unknown option '$DRY'" >&2; exit 2 ;; esac
OUT=${OUT:-$PWD/gpu-out}
WORK=${GPU_KIT_WORK:-/tmp/zerotune-gpu-kit}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1

if [ -n "$DRY" ]; then
  PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
else
  PY=${PYTHON:-python3}
  ls .whl/*.whl >/dev/null 2>&1 || { echo "run.sh: no .whl/: run 'make gpu-kit' where pip works, and carry .whl" >&2; exit 2; }
  # once per kit on a warm machine: the marker holds the wheels' checksum. A bare machine's install is the whole
  # kit, 19 wheels, 17 MiB (its 14 wheels of before took 1.7 s on an H200: experiments/results/gpu/h200-2026-11-27)
  sum=$(cat .whl/*.whl | md5sum | cut -d' ' -f1)
  if [ "$(cat /tmp/site/.gpu-kit-installed 2>/dev/null)" != "$sum" ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    echo "$sum" > /tmp/site/.gpu-kit-installed
  fi
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  export PATH=/tmp/site/bin:$PATH
  # the CPU-Adam JIT build (the env part, or the first row with offload=cpu) is reused by the later calls while
  # the machine stays warm
  export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/torch_extensions}
fi
mkdir -p "$OUT" "$WORK"
exec "$PY" benchmarks/gpu/kit.py "$PART" $DRY --out "$OUT" --work "$WORK"
