#!/usr/bin/env bash
# Pack what a lent GPU machine lacks into folders that travel with the working tree, one per device
# call: each call carries at most 64 MiB, the tree included, and the bundled GGUF alone is larger.
#
#   bash benchmarks/gpu_carry.sh          # writes .gpu-carry/0, 1, ... (git-ignored)
#
# Then one device call per folder, in order, each within the machine's warm window of the last:
#   carry [".gpu-carry/0"], command: bash benchmarks/gpu_device_step.sh .gpu-carry/0
#   carry [".gpu-carry/1"], command: bash benchmarks/gpu_device_step.sh .gpu-carry/1
#   ...
# Each call leaves its part (and, in the first, the wheels) in /tmp/specd-gpu on the machine; the
# call that brings the last part joins the GGUF, checks its sha256 and runs benchmarks/gpu_run.sh
# (environment passed through: STAGES, BUDGET_SECONDS, ...), its tables in the reply, everything
# else in $OUT/gpu.tgz.
#
# Environment: PYTHON [.venv/bin/python] (its installed versions are the ones packed),
# PART_MIB [32] (size of a GGUF part; the tree is about 20 MiB), PYTHON_VERSION [3.12] (the GPU
# image's Python).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
PART_MIB=${PART_MIB:-32}
PYTHON_VERSION=${PYTHON_VERSION:-3.12}
OUT=.gpu-carry
# specd's dependencies that the GPU image (its package list, 2026-11-17) does not hold: torch,
# transformers, safetensors, accelerate, httpx, prometheus-client, pyyaml and numpy are there.
MISSING="fastapi starlette uvicorn sse-starlette pydantic pydantic-core pydantic-settings python-dotenv
annotated-types annotated-doc typing-inspection opentelemetry-api gguf"

exclude="$(git rev-parse --git-common-dir)/info/exclude"
mkdir -p "$(dirname "$exclude")"
grep -qx '/.gpu-carry/' "$exclude" 2>/dev/null || echo '/.gpu-carry/' >> "$exclude"
rm -rf "$OUT"
mkdir -p "$OUT/0/whl"
pins=$("$PYTHON" - $MISSING <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version
pins = []
for name in sys.argv[1:]:
    try:
        pins.append(f"{name}=={version(name)}")
    except PackageNotFoundError:
        pass  # not needed by this version of the dependencies
print(" ".join(pins))
EOF
)
echo "wheels: $pins"
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$OUT/0/whl" $pins

gguf=$("$PYTHON" -c "from models.loader import default_gguf_path; print(default_gguf_path())")
split -b "${PART_MIB}M" -d -a 2 "$gguf" "$OUT/part"
parts=("$OUT"/part*)
for i in "${!parts[@]}"; do
    mkdir -p "$OUT/$i"
    mv "${parts[$i]}" "$OUT/$i/model.gguf.part$(printf %02d "$i")"
    {
        echo "parts=${#parts[@]}"
        echo "name=$(basename "$gguf")"
        echo "sha256=$(sha256sum "$gguf" | cut -d' ' -f1)"
    } > "$OUT/$i/manifest"
done
tree_mib=$(( $(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1) / 1048576 ))
for dir in "$OUT"/*/; do
    size=$(( $(du -sb "$dir" | cut -f1) / 1048576 ))
    echo "$dir: ${size} MiB + the tree's ${tree_mib} MiB"
    if [ $(( size + tree_mib )) -ge 63 ]; then
        echo "over the 64 MiB a call carries: lower PART_MIB" >&2
        exit 1
    fi
done
echo "${#parts[@]} device calls, in order: bash benchmarks/gpu_device_step.sh .gpu-carry/N, carrying .gpu-carry/N"
