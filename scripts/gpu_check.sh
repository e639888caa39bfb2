#!/usr/bin/env bash
# Runs every GPU check of hypic on the H200 machine (never in CI): GPU-marked tests, then the
# ops, model and engine benchmarks. Needs the fla wheels in .whl/ (../shared/tools/gpu-wheels.sh)
# carried with the call. Details land in $OUT; the tables print last.
set -eu
OUT=${OUT:-$(mktemp -d)}
site=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
export PYTHONPATH="$site:$PWD" PYTHONUNBUFFERED=1 FLA_DISABLE_BACKEND_DISPATCH=1
if [ "${SKIP_GPU_TESTS:-0}" != 1 ]; then
  python3 -m pytest -q -m gpu tests 2>&1 | tee "$OUT/pytest_gpu.log" | tail -n 15
fi
python3 scripts/gpu_check.py --out "$OUT" "$@"
