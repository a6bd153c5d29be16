#!/usr/bin/env bash
# Builds the GPU kit: zerotune's wheel and every wheel in benchmarks/gpu/requirements.txt, for CPython 3.12 on
# manylinux x86-64 (the GPU machine's /opt/torch/.venv), into DEST (default .whl/), and fails over 64 MiB.
#   bash benchmarks/gpu/build_kit.sh [DEST] [PYTHON_VERSION]      (make gpu-kit)
# PYTHON_VERSION (default 3.12) picks the binary wheels' CPython: the slow install test builds a 3.11 twin of the
# kit, with the same pins, for this machine's Python (tests/test_gpu_kit_install.py).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
DEST=${1:-$ROOT/.whl}
PYV=${2:-3.12}
PY=${PY:-$ROOT/.venv/bin/python}
LIMIT_MIB=64
REQS=$ROOT/benchmarks/gpu/requirements.txt
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

rm -rf "$DEST" && mkdir -p "$DEST"
DEST=$(cd "$DEST" && pwd)
TMP=$(mktemp -d) && trap 'rm -rf "$TMP"' EXIT

# zerotune from the tracked files only (no build/ or egg-info leftovers of the working tree)
(cd "$ROOT" && git ls-files -z | tar --null -T - -cf - | tar -xf - -C "$TMP" --one-top-level=src_copy)
"$PY" -m pip wheel -q --no-deps --no-build-isolation "$TMP/src_copy" -w "$DEST"

grep -vE '^\s*(#|$)' "$REQS" | while read -r how pin _; do
  case $how in
    binary) "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
              "${PLATFORMS[@]}" -d "$DEST" "$pin" ;;
    pure)   "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" -d "$DEST" "$pin" ;;
    # DS_BUILD_OPS=0: no op compiled here (this machine has no CUDA); DeepSpeed JIT-builds them where they run.
    build)  DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$DEST" "$pin" ;;
    *) echo "build_kit: unknown kind '$how' in $REQS" >&2; exit 2 ;;
  esac
done

ls -l "$DEST"
total=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
count=$(ls "$DEST"/*.whl | wc -l)
echo "gpu kit: $count wheels, $((total / 1024)) KiB in $DEST (limit ${LIMIT_MIB} MiB)"
if [ "$total" -ge $((LIMIT_MIB * 1024 * 1024)) ]; then
  echo "gpu kit: over ${LIMIT_MIB} MiB: the device tool carries at most that much" >&2
  exit 1
fi
