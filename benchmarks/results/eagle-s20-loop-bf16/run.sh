#!/bin/bash
# Session 20: the bundled EAGLE head made by the default `specd train-draft` with 1187 prompts (20 minutes), with
# prompt lookup beside it (the default) in the closed loop at 1-16 requests, auto vs off, bf16 (what
# --dtype auto picks on this CPU: avx512_bf16 and AMX). Same loop as eagle-s18-loop-bf16; the head is the change.
#   benchmarks/results/eagle-s20-loop-bf16/run.sh
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=benchmarks/results/eagle-s20-loop-bf16
PYTHONUNBUFFERED=1 .venv/bin/python -m benchmarks.engine_bench --section loop --dtypes bfloat16 --max-tokens 64 \
  --loop-sets chat,code,creative --batch-sizes 1,4,8,16 --waves 3 --loop-modes off,auto --rounds 2 \
  --draft-head models/heads/smollm2-135m-instruct --json "$OUT/loop.json" | tee "$OUT/loop.md"
