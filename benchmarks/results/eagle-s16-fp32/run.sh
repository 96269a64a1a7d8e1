#!/bin/bash
# Session 16: batch 1, held-out chat / code / creative prompts, eagle (with prompt lookup beside it, and
# head only) against n-gram and off, float32 by --dtype auto on a CPU without native bf16. Measured at
# commit 4625d8f (unverified probes, and the cost model pricing the proposer's tokens apart from its
# forwards), which lost on code and was reverted: docs/benchmarks.md, session 16.
#   benchmarks/results/eagle-s16-fp32/run.sh
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=benchmarks/results/eagle-s16-fp32
PYTHONUNBUFFERED=1 .venv/bin/python -m benchmarks.engine_bench --section draft --dtypes auto --max-tokens 128 \
  --json "$OUT/engine_draft.json" | tee "$OUT/engine_draft.md"
