#!/usr/bin/env bash
# Bring what a gpu_train.sh call returned (the run tool's files_at folder) into .ckpt/, and a
# THEN_QUALITY call's table (quality.tar): its plot and JSON into docs/, its quality.md into
# .ckpt/quality/ and onto the screen (docs/quality.md is curated: merge the table by hand).
# Run it right after the call: the device machine goes back after 30 s idle, and the next call
# should find it warm.
#   bash scripts/ckpt_in.sh /work/.device/N
set -eu
src=${1:?usage: scripts/ckpt_in.sh FILES_AT}
mkdir -p .ckpt
chmod u+w .ckpt/* 2>/dev/null || true
cp "$src"/*.safetensors "$src"/model.safetensors.index.json "$src"/train_state.json .ckpt/
[ -f "$src/config.json" ] && cp "$src/config.json" .ckpt/
if [ -f "$src/quality.tar" ]; then
  mkdir -p .ckpt/quality && tar -xf "$src/quality.tar" -C .ckpt/quality
  cp .ckpt/quality/quality.png .ckpt/quality/quality.json docs/
  grep -E '^\|' .ckpt/quality/quality.md
fi
python3 -c "import json; print('.ckpt/ at step', json.load(open('.ckpt/train_state.json'))['step'])"
