#!/usr/bin/env bash
# One resumable training run of the bundled model on the GPU machine (see docs/training.md).
# Carries the previous checkpoint in .ckpt/ (git-ignored; name it in `carry`), trains for
# $MINUTES, and leaves the new checkpoint in $OUT (≤ 8 files, each < 16 MiB, 64 MiB in all) to copy back into .ckpt/.
set -eu
OUT=${OUT:-$(mktemp -d)}
MINUTES=${MINUTES:-8}
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
ck=/tmp/ckpt
mkdir -p "$ck"
# BATCH_SWEEP="65536,131072": time standalone steps (the most memory-hungry kind) at each batch size
# on a random model first (at hypic's seam SWEEP_SEAM, default 0: use the run's --standalone-seam) and
# train with the fastest one whose peak stays under MAX_GB (a training
# step is host-bound, so tokens/s grows with the batch until the device is busy or memory runs out).
if [ -n "${BATCH_SWEEP:-}" ]; then
  python3 scripts/gpu_train_profile.py --out /tmp --batch-tokens "$BATCH_SWEEP" --standalone --standalone-seam "${SWEEP_SEAM:-0}" --difficulty-step 5000 \
    2>&1 | grep -E "^(batch|data)" | tee /tmp/sweep.log
  best=$(python3 scripts/pick_batch.py /tmp/sweep.log "${MAX_GB:-110}")
  echo "batch sweep: training with --batch-tokens $best"
  TRAIN_ARGS="${TRAIN_ARGS:-} --batch-tokens $best"
fi
if [ -f .ckpt/train_state.json ]; then
  cp .ckpt/* "$ck"/
  cp hypic/assets/tokenizer/tokenizer.json "$ck"/
  python3 -m hypic.train --out "$ck" --resume --minutes "$MINUTES" ${TRAIN_ARGS:-} | tee /tmp/train.log
else
  python3 -m hypic.train --out "$ck" --tokenizer hypic/assets/tokenizer --minutes "$MINUTES" ${TRAIN_ARGS:-} \
    | tee /tmp/train.log
fi
if [ -n "${THEN_QUALITY_SECONDS:-}" ]; then
  # The last run of a schedule: export the model and measure the full quality table in the same call
  # (no second machine start). $OUT returns ≤ 8 files and 64 MiB: the weights' shards, their index,
  # train_state, the table's three files packed as quality.tar (scripts/ckpt_in.sh unpacks it), and
  # the Adam moments where they fit (the 8-layer model's 2 shards; a 12-layer one's 3 + 3 do not),
  # so that the next run resumes from this step's moments rather than an earlier call's. Needs .whl.
  cp "$ck"/model-*.safetensors "$ck"/model.safetensors.index.json "$ck"/train_state.json "$OUT"/
  moments=$(ls "$ck"/optim-*.safetensors 2>/dev/null | wc -l)
  [ "$moments" -ge 1 ] && [ "$moments" -le 2 ] && cp "$ck"/optim-*.safetensors "$OUT"/
  python3 -m hypic.train.export --from "$ck"
  q=/tmp/quality && mkdir -p "$q"
  OUT="$q" GPU_OPS=0 SKIP_GPU_TESTS=1 GPU_QUALITY=1 GPU_QUALITY_SECONDS="$THEN_QUALITY_SECONDS" \
    GPU_QUALITY_ARGS="${THEN_QUALITY_ARGS:---n 200 --batch 400}" bash scripts/gpu_check.sh | grep -E '^(\||\[)' || true
  grep -E 'Error' "$q/quality.log" | tail -n 3
  (cd "$q" && ls quality.md quality.png quality.json 2>/dev/null | xargs -r tar -cf "$OUT/quality.tar")
  tail -2 /tmp/train.log
  exit 0
fi
# weights + moments + index + state: 2+2+2 files for the 8-layer model, 3+3+2 for a 12-layer one
# (hypic.train.grow); the config only on a first run (resuming never changes it).
cp "$ck"/model-*.safetensors "$ck"/optim-*.safetensors "$ck"/model.safetensors.index.json "$ck"/train_state.json "$OUT"/
[ -f .ckpt/train_state.json ] || cp "$ck"/config.json "$OUT"/
# QUALITY_LABELS / QUALITY_N / QUALITY_DIFFICULTY: the check's modes, examples per family, difficulty
[ "${QUALITY_SECONDS:-60}" = 0 ] || timeout "${QUALITY_SECONDS:-60}" python3 -m hypic.cli eval quality --model "$ck" --device cuda \
  --n "${QUALITY_N:-12}" --difficulty "${QUALITY_DIFFICULTY:-0.5}" --json \
  --labels "${QUALITY_LABELS:-full,naive,hypic_w8}" 2>&1 | tail -1 || true
tail -3 /tmp/train.log
[ "$(ls "$OUT" | wc -l)" -le 8 ] || echo "warning: $(ls "$OUT" | wc -l) files in \$OUT; a call returns at most 8"
