#!/bin/bash
# The issue-11 sweep (copy, creative and a 50/50 mix; speculation off / on / auto; concurrency 1-32; streamed
# chat, greedy, ignore_eos) as auto-s6/run.sh runs it, but with lengths that differ: request i asks for
# max_tokens drawn once in 64 x [0.5, 1.5] (--length-range-ratio 0.5), the same in every mode, so the closed
# loop does not move in lock step. Each mode x load its own prefix-cache tenant, modes rotated per repeat.
#   benchmarks/results/auto-s22/run.sh [DTYPE] [REPEATS]
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-benchmarks/results/auto-s22} SUFFIX=-spread \
  exec benchmarks/results/auto-s6/run.sh "${1:-auto}" "${2:-2}" --length-range-ratio 0.5
