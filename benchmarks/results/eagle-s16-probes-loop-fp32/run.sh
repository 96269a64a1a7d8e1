#!/bin/bash
# Session 16: the bundled EAGLE head with prompt lookup beside it (the default) in the closed loop at 1-16
# requests, auto vs off, float32 on a CPU without native bf16, after probes stopped verifying (the head
# drafts one token for a plain row; the emitted token grades it) and their budget went from 2% to 1%.
# Same loop as eagle-s15-lookup-loop-fp32.
#   benchmarks/results/eagle-s16-probes-loop-fp32/run.sh
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=benchmarks/results/eagle-s16-probes-loop-fp32
PYTHONUNBUFFERED=1 .venv/bin/python -m benchmarks.engine_bench --section loop --dtypes float32 --max-tokens 64 \
  --loop-sets chat,code,creative --batch-sizes 1,4,8,16 --waves 3 --loop-modes off,auto --rounds 2 \
  --draft-head models/heads/smollm2-135m-instruct --json "$OUT/loop.json" | tee "$OUT/loop.md"
