#!/bin/bash
# The issue-11 sweep (copy, creative and a 50/50 mix; speculation off / on / auto; concurrency 1-32; streamed
# chat, greedy, ignore_eos) as auto-s6/run.sh runs it, but with lengths that differ: request i asks for
# max_tokens drawn once in 64 x [0.5, 1.5] (--length-range-ratio 0.5), the same in every mode, so the closed
# loop does not move in lock step. Each mode x load its own prefix-cache tenant, modes rotated per repeat.
#   benchmarks/results/auto-s22/run.sh [DTYPE] [REPEATS]
set -euo pipefail
cd "$(dirname "$0")/../../.."
DTYPE=${1:-auto}
OUT=${OUT:-benchmarks/results/auto-s22}
REPEATS=${2:-2}
case "$DTYPE" in
  auto) TAG=$(grep -q avx512_bf16 /proc/cpuinfo && echo bf16 || echo fp32) ;;
  float32) TAG=fp32 ;;
  bfloat16) TAG=bf16 ;;
  *) TAG=$DTYPE ;;
esac
for traffic in ${TRAFFIC:-copy:extraction creative:creative mix:extraction,creative}; do
  name=${traffic%%:*}; sets=${traffic#*:}
  PYTHONUNBUFFERED=1 .venv/bin/python -m benchmarks.serve_bench --prompt-sets "$sets" \
    --concurrency 1,2,4,8,16,32 --max-tokens 64 --length-range-ratio 0.5 --max-model-len 2048 --dtype "$DTYPE" \
    --repeats "$REPEATS" --isolate-runs --out-dir "$OUT/$name-spread-$TAG"
done
