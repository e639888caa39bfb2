#!/usr/bin/env bash
# One resumable training run of the bundled model on the GPU machine (see docs/training.md).
# Carries the previous checkpoint in .ckpt/ (git-ignored; name it in `carry`), trains for
# $MINUTES, and leaves the new checkpoint in $OUT (≤ 8 files, each < 16 MiB) to copy back into .ckpt/.
set -eu
OUT=${OUT:-$(mktemp -d)}
MINUTES=${MINUTES:-8}
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
ck=/tmp/ckpt
mkdir -p "$ck"
if [ -f .ckpt/train_state.json ]; then
  cp .ckpt/* "$ck"/
  cp hypic/assets/tokenizer/tokenizer.json "$ck"/
  python3 -m hypic.train --out "$ck" --resume --minutes "$MINUTES" ${TRAIN_ARGS:-} | tee /tmp/train.log
else
  python3 -m hypic.train --out "$ck" --tokenizer hypic/assets/tokenizer --minutes "$MINUTES" ${TRAIN_ARGS:-} \
    | tee /tmp/train.log
fi
cp "$ck"/model-*.safetensors "$ck"/optim-*.safetensors "$ck"/model.safetensors.index.json "$ck"/config.json \
  "$ck"/train_state.json "$OUT"/
[ "${QUALITY_SECONDS:-60}" = 0 ] || timeout "${QUALITY_SECONDS:-60}" python3 -m hypic.cli eval quality --model "$ck" --device cuda --n 12 --difficulty 0.5 --json \
  --labels full,naive,hypic_w8 2>&1 | tail -1 > "$OUT/quality.json" || true
tail -3 /tmp/train.log; cat "$OUT/quality.json" 2>/dev/null || true
