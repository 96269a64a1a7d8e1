#!/usr/bin/env bash
# One device call of the sequence benchmarks/gpu_carry.sh prepares: keep this call's part of the
# GGUF (and install the wheels, if this folder has them) in /tmp/specd-gpu; once every part is
# there, join and check them and run benchmarks/gpu_run.sh on the bundled model.
#   bash benchmarks/gpu_device_step.sh .gpu-carry/N
set -uo pipefail
cd "$(dirname "$0")/.."
DIR=${1:?usage: gpu_device_step.sh .gpu-carry/N}
STATE=/tmp/specd-gpu
mkdir -p "$STATE"
# shellcheck disable=SC1091
source "$DIR/manifest"  # parts, name, sha256
cp "$DIR"/model.gguf.part* "$STATE/"
if [ -d "$DIR/whl" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$STATE/site" \
        "$DIR"/whl/*.whl || exit 4
fi
have=$(find "$STATE" -maxdepth 1 -name 'model.gguf.part*' | wc -l)
if [ "$have" -lt "$parts" ]; then
    echo "part $(basename "$DIR") kept: $have of $parts parts in $STATE"
    exit 0
fi
model="$STATE/$name"
cat "$STATE"/model.gguf.part* > "$model"
echo "$sha256  $model" | sha256sum -c || exit 3
[ -d "$STATE/site" ] || { echo "no wheels installed: run the call with .gpu-carry/0 first" >&2; exit 4; }
export PYTHONPATH="$STATE/site"
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm,clocks.max.sm --format=csv
MODEL=$model DRAFT_HEAD=${DRAFT_HEAD:-models/heads/smollm2-135m-instruct} PYTHON=python3 \
    bash benchmarks/gpu_run.sh /tmp/gpu 2>&1 | tee "${OUT:-/tmp}/log.txt"
if [ -n "${OUT:-}" ]; then
    cp /tmp/gpu/summary.md "$OUT/" 2>/dev/null
    tar czf "$OUT/gpu.tgz" -C /tmp --exclude='*.safetensors' gpu
fi
