#!/bin/bash
# Session 22: the bundled EAGLE head (prompt lookup beside it) in the closed loop, auto vs off, bf16 (what
# --dtype auto picks on this CPU: avx512_bf16 and AMX), with requests that stop at their end of sequence
# (--loop-lengths natural, up to 256 tokens) instead of 64 tokens each: the same tokens in every mode, lengths
# that differ, so the loop does not move in lock step. Then the fixed-length loop at 8 waves for comparison.
#   benchmarks/results/eagle-s22-natural-bf16/run.sh
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=benchmarks/results/eagle-s22-natural-bf16
HEAD=models/heads/smollm2-135m-instruct
PYTHONUNBUFFERED=1 .venv/bin/python -m benchmarks.engine_bench --section loop --dtypes bfloat16 --max-tokens 256 \
  --loop-lengths natural --loop-sets chat,code,creative --batch-sizes 1,4,8,16 --waves 3 --loop-modes off,auto \
  --rounds 2 --draft-head "$HEAD" --json "$OUT/natural.json" | tee "$OUT/natural.md"
PYTHONUNBUFFERED=1 .venv/bin/python -m benchmarks.engine_bench --section loop --dtypes bfloat16 --max-tokens 64 \
  --loop-sets chat,code,creative --batch-sizes 8,16 --waves 8 --loop-modes off,auto \
  --rounds 2 --draft-head "$HEAD" --json "$OUT/fixed-8waves.json" | tee "$OUT/fixed-8waves.md"
# Lengths that differ with the content of the fixed-length loop: each request's max tokens drawn once in
# 64 x [0.5, 1.5] (ignore_eos), the same in every mode.
PYTHONUNBUFFERED=1 .venv/bin/python -m benchmarks.engine_bench --section loop --dtypes bfloat16 --max-tokens 64 \
  --length-range-ratio 0.5 --loop-sets chat,code,creative --batch-sizes 1,4,8,16 --waves 3 --loop-modes off,auto \
  --rounds 2 --draft-head "$HEAD" --json "$OUT/spread.json" | tee "$OUT/spread.md"
