#!/bin/bash
# Session 17: mixed traffic (extraction + creative, 50/50) at 8 and 16 requests, off and auto only, 3 repeats,
# bf16 by --dtype auto (a CPU with avx512_bf16 and AMX): are the sweep's 0.97 and 0.92 noise or not?
#   benchmarks/results/auto-s17/mix-repeats-bf16/run.sh
set -euo pipefail
cd "$(dirname "$0")/../../../.."
PYTHONUNBUFFERED=1 .venv/bin/python -m benchmarks.serve_bench --prompt-sets extraction,creative --concurrency 8,16 \
  --modes off,auto --max-tokens 64 --max-model-len 2048 --dtype auto --repeats 3 --isolate-runs --no-plot \
  --out-dir benchmarks/results/auto-s17/mix-repeats-bf16
