#!/bin/bash
# Session 14: the closed loop with a short queue (2 requests per slot: half the run is its tail)
# and a long one (8 per slot: mostly steady state), speculation off / (on) / auto, float32 on a
# CPU without native bf16; each run priced by one step-cost model fitted to all runs' steps.
#   benchmarks/results/loop-s14-fp32/run.sh
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=benchmarks/results/loop-s14-fp32
PYTHONUNBUFFERED=1 .venv/bin/python -m benchmarks.engine_bench --section loop --dtypes float32 --max-tokens 64 \
  --loop-sets creative --batch-sizes 4,16 --waves 2,8 --loop-modes off,auto --rounds 2 \
  --json "$OUT/creative.json" | tee "$OUT/creative.md"
PYTHONUNBUFFERED=1 .venv/bin/python -m benchmarks.engine_bench --section loop --dtypes float32 --max-tokens 64 \
  --loop-sets extraction,creative --batch-sizes 4,16 --waves 2,8 --loop-modes off,on,auto --rounds 2 \
  --json "$OUT/mix.json" | tee "$OUT/mix.md"
