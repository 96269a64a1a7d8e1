#!/bin/bash
# Session 20: batch 1, held-out chat / code / creative prompts, the bundled EAGLE head made by the default
# `specd train-draft` with 1187 shipped prompts and 2048-token minibatches (20.3 minutes in all), with prompt
# lookup beside it and head only, against n-gram and off, in the dtype --dtype auto picks: bf16 on this CPU
# (avx512_bf16 and AMX). Same command as eagle-s18-bf16; the head is the change.
#   benchmarks/results/eagle-s20-bf16/run.sh
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=benchmarks/results/eagle-s20-bf16
PYTHONUNBUFFERED=1 .venv/bin/python -m benchmarks.engine_bench --section draft --dtypes auto --max-tokens 128 \
  --json "$OUT/engine_draft.json" | tee "$OUT/engine_draft.md"
