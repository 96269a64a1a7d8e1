#!/bin/bash
# The issue-11 sweep: copy (extraction), creative and a 50/50 mix, speculation off / on / auto,
# concurrency 1-32, streamed chat, 64 tokens, greedy. Each traffic is one serve_bench run
# (ratios inside one run), modes rotated within each of the repeats, each mode x load in its
# own prefix-cache tenant. bf16 only where the CPU has native bf16.
#   benchmarks/results/auto-s6/run.sh [DTYPE] [REPEATS] [SERVE_BENCH FLAGS...]
#   TRAFFIC=mix:extraction,creative benchmarks/results/auto-s6/run.sh float32 2   # the float32 rows
#   OUT=benchmarks/results/auto-s7 benchmarks/results/auto-s6/run.sh                # another results folder
# Flags after REPEATS go to every serve_bench run; SUFFIX (e.g. -spread) goes into each folder's name.
set -euo pipefail
cd "$(dirname "$0")/../../.."
DTYPE=${1:-auto}
OUT=${OUT:-benchmarks/results/auto-s6}
REPEATS=${2:-3}
shift $(( $# < 2 ? $# : 2 ))
case "$DTYPE" in
  auto) TAG=$(grep -q avx512_bf16 /proc/cpuinfo && echo bf16 || echo fp32) ;;
  float32) TAG=fp32 ;;
  bfloat16) TAG=bf16 ;;
  *) TAG=$DTYPE ;;
esac
# TRAFFIC: which of copy, creative, mix to run (all three by default).
for traffic in ${TRAFFIC:-copy:extraction creative:creative mix:extraction,creative}; do
  name=${traffic%%:*}; sets=${traffic#*:}
  PYTHONUNBUFFERED=1 .venv/bin/python -m benchmarks.serve_bench --prompt-sets "$sets" \
    --concurrency 1,2,4,8,16,32 --max-tokens 64 --max-model-len 2048 --dtype "$DTYPE" \
    --repeats "$REPEATS" --isolate-runs --out-dir "$OUT/$name${SUFFIX:-}-$TAG" "$@"
done
