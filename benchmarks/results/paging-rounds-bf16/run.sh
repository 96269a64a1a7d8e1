#!/bin/bash
# Three alternating rounds of the paging sweep: "before" is a worktree at cecf7f1
# (the last commit with per-sequence slots), "after" is main (paged KV, prefix
# cache on by default). Then: python -m benchmarks.sweep_rounds OUT --baseline before
set -e
BEFORE=${BEFORE:-../wt-before}   # git worktree add ../wt-before cecf7f1
OUT=${OUT:-benchmarks/results/paging-rounds-bf16}
ARGS="--prompt-sets extraction,creative --concurrency 1,4,16,32 --max-tokens 64 --max-model-len 2048 --no-plot"
for r in 1 2 3; do
  for build in before after; do
    dir=$PWD; [ $build = before ] && dir=$BEFORE
    (cd "$dir" && PYTHONUNBUFFERED=1 python -m benchmarks.serve_bench $ARGS --out-dir "$OLDPWD/$OUT/$build-$r")
  done
done
