#!/bin/bash
# Session 17: creative traffic at 8, 16 and 32 requests, off and auto only, 3 repeats, bf16 by --dtype auto
# (a CPU with avx512_bf16 and AMX): are the sweep's 0.95 / 0.95 / 0.89 noise or not?
#   benchmarks/results/auto-s17/creative-repeats-bf16/run.sh
set -euo pipefail
cd "$(dirname "$0")/../../../.."
PYTHONUNBUFFERED=1 .venv/bin/python -m benchmarks.serve_bench --prompt-sets creative --concurrency 8,16,32 \
  --modes off,auto --max-tokens 64 --max-model-len 2048 --dtype auto --repeats 3 --isolate-runs --no-plot \
  --out-dir benchmarks/results/auto-s17/creative-repeats-bf16
