#!/bin/bash
# Session 21: batch 1, held-out chat / code / creative prompts, the bundled EAGLE head (session 20's,
# trained on bf16 features) served on a float32 target: what `--dtype auto` gives on a CPU without
# native bf16 (AVX2 only), the dtype the issue's goals name. Same command as eagle-s20-bf16 but
# --dtypes float32, on the same 2-core avx512_bf16 machine (float32 kernels; an AVX2-only CPU is slower).
#   benchmarks/results/eagle-s21-fp32/run.sh
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=benchmarks/results/eagle-s21-fp32
PYTHONUNBUFFERED=1 .venv/bin/python -m benchmarks.engine_bench --section draft --dtypes float32 --max-tokens 128 \
  --json "$OUT/engine_draft.json" | tee "$OUT/engine_draft.md"
