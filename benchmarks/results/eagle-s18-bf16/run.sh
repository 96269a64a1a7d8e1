#!/bin/bash
# Session 18: batch 1, held-out chat / code / creative prompts, the bundled EAGLE head (now made by the default
# `specd train-draft`, 20 minutes in all; with prompt lookup beside it, and head only) against n-gram and off,
# in the dtype --dtype auto picks: bf16 on this CPU (avx512_bf16 and AMX). Same command as eagle-s17-bf16;
# the head is the change.
#   benchmarks/results/eagle-s18-bf16/run.sh
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=benchmarks/results/eagle-s18-bf16
PYTHONUNBUFFERED=1 .venv/bin/python -m benchmarks.engine_bench --section draft --dtypes auto --max-tokens 128 \
  --json "$OUT/engine_draft.json" | tee "$OUT/engine_draft.md"
