#!/usr/bin/env bash
# Runs every GPU check of hypic on the H200 machine (never in CI): GPU-marked tests, then the
# ops, model and engine benchmarks. Needs the fla wheels in .whl/ (../shared/tools/gpu-wheels.sh)
# carried with the call. Details land in $OUT; the tables print last. Sections: SKIP_GPU_TESTS=1,
# GPU_OPS=0, GPU_MODELS=1, GPU_TTFT=1 (see below).
set -eu
OUT=${OUT:-$(mktemp -d)}
site=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
export PYTHONPATH="$site:$PWD" PYTHONUNBUFFERED=1 FLA_DISABLE_BACKEND_DISPATCH=1
if [ "${SKIP_GPU_TESTS:-0}" != 1 ]; then
  python3 -m pytest -q -m gpu tests 2>&1 | tee "$OUT/pytest_gpu.log" | tail -n 15
fi
if [ "${GPU_OPS:-1}" = 1 ]; then
  python3 scripts/gpu_check.py --out "$OUT" "$@"
fi
# Whole models (scripts/gpu_models.py: 9B and 35B-A3B shapes, 32k prefill, decode, vs transformers):
# only with GPU_MODELS=1; GPU_MODELS_ARGS passes it flags, GPU_OPS=0 skips the ops check above.
if [ "${GPU_MODELS:-0}" = 1 ]; then
  python3 scripts/gpu_models.py --out "$OUT" ${GPU_MODELS_ARGS:-}
fi
# TTFT across the ladder on the 9B shape (hypic bench ttft): only with GPU_TTFT=1; GPU_TTFT_ARGS adds flags.
if [ "${GPU_TTFT:-0}" = 1 ]; then
  python3 -m hypic.cli bench ttft --shape qwen3.5-9b --device cuda --out "$OUT/ttft.md" ${GPU_TTFT_ARGS:-}
fi
