#!/usr/bin/env bash
# The benchmarks on one GPU, offline, inside a time budget (BUDGET_SECONDS, 480 by default):
#   1. memory bandwidth (a torch device-to-device copy) and the target's bf16
#      weight bytes: the bandwidth floor of one decode step;
#   then the stages named in STAGES, in that order, each bounded by its own timeout and by
#   what is left of the budget (a stage that would get under 30 s is skipped):
#   step    the engine step (engine_bench --section step: ms per step by batch shape beside
#           transformers' own forward, host transfers and CUDA syncs per step);
#   profile torch.profiler over batch-1 and batch-16 decode steps (engine_bench --section
#           profile): the operators by host and device time, for a step far above its floor;
#   heads   batch 1 on held-out chat, code and creative prompts (engine_bench --section draft):
#           the EAGLE head against n-gram and off, acceptance per position, tokens per verify;
#   eagle   the serving benchmark, speculation off / on / auto, with an EAGLE draft head
#           (DRAFT_HEAD, or the bundled one for the default model);
#   ngram   the same with the n-gram proposer;
#   traffic the per-request `auto` sweep's traffic with the n-gram proposer: copy (extraction
#           prompts), creative and a 50/50 mix, 64 x [0.5, 1.5] tokens per request, each mode x
#           load its own prefix-cache tenant, at TRAFFIC_CONCURRENCY: does the cost model learned
#           on this device keep `auto` with the better fixed mode?
#   batch   the engine batch-size sweep (benchmarks.engine_bench --section batch);
#   draft   the serving benchmark with a draft cut from the target by benchmarks/make_draft.py;
#   train   `specd train-draft` on the GPU for TRAIN_MINUTES (data from the target, training,
#           held-out acceptance), then the serving benchmark with that head;
#   and last a short table.
#
#   bash benchmarks/gpu_run.sh [OUT_DIR]          # default benchmarks/results/gpu-<date>
#
# Environment (all optional):
#   PYTHON        interpreter with torch + specd's dependencies [.venv/bin/python, else python3]
#   MODEL         target: directory, .gguf file or Hub id in the local HF cache [bundled SmolLM2-135M-Instruct]
#   DEVICE        cuda, cuda:N or cpu (cpu only to try this script out) [cuda]
#   STAGES        comma-separated, run in this order [step,profile,traffic,heads,eagle,ngram,batch,draft,train]
#   BUDGET_SECONDS  wall-clock budget of the whole script [480]
#   DRAFT_LAYERS  layers kept in the draft [8]
#   DRAFT_HEAD    EAGLE head directory for the target [models/heads/smollm2-135m-instruct if MODEL is unset
#                 and it exists; else the eagle stage is skipped]
#   TRAIN_MINUTES training budget of the GPU-trained head [2]
#   MAX_TOKENS    tokens per request [128]
#   CONCURRENCY   serving levels of the eagle and n-gram stages [1,2,4,8,16,32]; the draft and
#                 trained-head stages use DRAFT_CONCURRENCY [1,4,16], the traffic stage
#                 TRAFFIC_CONCURRENCY [1,4,16]
#   TRAFFIC       the traffic stage's runs, name:prompt-sets [copy:extraction mix:extraction,creative
#                 creative:creative]
#   WHEELS        folder of wheels to install (no network) into a private folder before starting
# Nothing is downloaded: HF_HUB_OFFLINE=1.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT_DIR=${1:-benchmarks/results/gpu-$(date +%Y%m%d-%H%M%S)}
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
DEVICE=${DEVICE:-cuda}
DRAFT_LAYERS=${DRAFT_LAYERS:-8}
MAX_TOKENS=${MAX_TOKENS:-128}
CONCURRENCY=${CONCURRENCY:-1,2,4,8,16,32}
DRAFT_CONCURRENCY=${DRAFT_CONCURRENCY:-1,4,16}
TRAFFIC_CONCURRENCY=${TRAFFIC_CONCURRENCY:-1,4,16}
TRAFFIC=${TRAFFIC:-copy:extraction mix:extraction,creative creative:creative}
STAGES=${STAGES:-step,profile,traffic,heads,eagle,ngram,batch,draft,train}
BUDGET_SECONDS=${BUDGET_SECONDS:-480}
TRAIN_MINUTES=${TRAIN_MINUTES:-2}
export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT_DIR"
START=$(date +%s)
stamp() { echo "== [$(( $(date +%s) - START ))s] $*" >&2; }
# bounded SECONDS CMD...: run CMD under `timeout`, SECONDS or what is left of the budget if less;
# returns 124 without running it when under 30 s would be left.
bounded() {
    local want=$1 left=$(( BUDGET_SECONDS - ($(date +%s) - START) ))
    shift
    if [ "$left" -lt 30 ]; then
        echo "skipped, ${left}s of the ${BUDGET_SECONDS}s budget left: $*" >&2
        return 124
    fi
    timeout $(( want < left ? want : left )) "$@"
}

if [ -n "${WHEELS:-}" ]; then
    stamp "installing wheels from $WHEELS"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target /tmp/specd-site "$WHEELS"/*.whl
    export PYTHONPATH="$PYTHONPATH:/tmp/specd-site"
fi

stamp "preflight ($PYTHON, $DEVICE)"
"$PYTHON" - "$DEVICE" <<'EOF'
import importlib.util, sys
import torch
need = ["transformers", "safetensors", "accelerate", "gguf", "fastapi", "uvicorn", "sse_starlette",
        "pydantic", "pydantic_settings", "prometheus_client", "httpx", "yaml", "matplotlib"]
missing = [m for m in need if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"missing Python packages: {' '.join(missing)} (install them, or pass WHEELS=DIR)")
if sys.argv[1].startswith("cuda") and not torch.cuda.is_available():
    sys.exit("torch sees no CUDA device")
name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
print(f"torch {torch.__version__} on {name}")
EOF

stamp "bandwidth floor"
"$PYTHON" - "$DEVICE" "${MODEL:-}" "$OUT_DIR/floor.json" <<'EOF'
import json, sys, time
import torch
from models.loader import ModelConfig, load_model

device, model, out = sys.argv[1], sys.argv[2] or None, sys.argv[3]
loaded = load_model(ModelConfig(model, dtype="bfloat16", device=device))
weight_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())  # tied weights once
numel = (1 << 30) // 4 if device.startswith("cuda") else (1 << 26) // 4  # 1 GiB on a GPU
src = torch.ones(numel, dtype=torch.float32, device=device)
dst = torch.empty_like(src)
sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
for _ in range(3):
    dst.copy_(src)
sync()
iters = 20
start = time.perf_counter()
for _ in range(iters):
    dst.copy_(src)
sync()
seconds = time.perf_counter() - start
bandwidth = 2 * src.numel() * src.element_size() * iters / seconds  # bytes read + written per second
record = {"weight_bytes": weight_bytes, "bandwidth_bytes_per_s": bandwidth, "floor_ms": weight_bytes / bandwidth * 1e3}
json.dump(record, open(out, "w"))
print(f"weights {weight_bytes / 1e6:.0f} MB (bf16), copy bandwidth {bandwidth / 1e9:.0f} GB/s, "
      f"floor {record['floor_ms']:.3f} ms per decode step")
EOF

serve() {  # serve NAME CONCURRENCY [specd flags...]
    local name=$1 levels=$2
    shift 2
    stamp "serving benchmark: $name"
    bounded 240 "$PYTHON" -m benchmarks.serve_bench --device "$DEVICE" --dtype bfloat16 ${MODEL:+--model "$MODEL"} \
        --concurrency "$levels" --max-tokens "$MAX_TOKENS" --max-seconds 30 --out-dir "$OUT_DIR/$name" "$@" \
        > /dev/null || echo "serving benchmark $name failed or ran out of time" >&2
}

DRAFT_HEAD=${DRAFT_HEAD:-}
if [ -z "$DRAFT_HEAD" ] && [ -z "${MODEL:-}" ] && [ -d models/heads/smollm2-135m-instruct ]; then
    DRAFT_HEAD=models/heads/smollm2-135m-instruct
fi

for stage in ${STAGES//,/ }; do
    case $stage in
    heads)
        if [ -n "$DRAFT_HEAD" ]; then
            stamp "batch 1, held-out prompts: EAGLE head, n-gram, off"
            bounded 150 "$PYTHON" -m benchmarks.engine_bench --section draft --dtypes bfloat16 --device "$DEVICE" \
                --draft-head "$DRAFT_HEAD" --max-tokens "$MAX_TOKENS" ${MODEL:+--model "$MODEL"} \
                --json "$OUT_DIR/engine_draft.json" | tee "$OUT_DIR/engine_draft.md" \
                || echo "held-out draft benchmark failed or ran out of time" >&2
        else
            echo "no EAGLE draft head for this target (DRAFT_HEAD): heads stage skipped" >&2
        fi ;;
    eagle)
        if [ -n "$DRAFT_HEAD" ]; then
            serve eagle "$CONCURRENCY" --draft eagle --draft-head "$DRAFT_HEAD"
        else
            echo "no EAGLE draft head for this target (DRAFT_HEAD): eagle stage skipped" >&2
        fi ;;
    ngram)
        serve ngram "$CONCURRENCY" --draft ngram ;;
    traffic)
        for traffic in $TRAFFIC; do
            MAX_TOKENS=64 serve "traffic-${traffic%%:*}" "$TRAFFIC_CONCURRENCY" --draft ngram \
                --prompt-sets "${traffic#*:}" --length-range-ratio 0.5 --isolate-runs --max-model-len 2048
        done ;;
    batch)
        stamp "engine batch-size sweep"
        bounded 150 "$PYTHON" -m benchmarks.engine_bench --section batch --dtypes bfloat16 --device "$DEVICE" \
            --batch-sizes 1,4,8,16,32 --max-tokens "$MAX_TOKENS" ${MODEL:+--model "$MODEL"} \
            --json "$OUT_DIR/engine_batch.json" | tee "$OUT_DIR/engine_batch.md" \
            || echo "engine sweep failed or ran out of time" >&2 ;;
    step)
        stamp "engine step: time, host transfers and device syncs per step"
        bounded 120 "$PYTHON" -m benchmarks.engine_bench --section step --dtypes bfloat16 --device "$DEVICE" \
            ${MODEL:+--model "$MODEL"} --json "$OUT_DIR/engine_step.json" | tee "$OUT_DIR/engine_step.md" \
            || echo "engine step benchmark failed or ran out of time" >&2 ;;
    profile)
        stamp "engine step profile"
        bounded 90 "$PYTHON" -m benchmarks.engine_bench --section profile --dtypes bfloat16 --device "$DEVICE" \
            ${MODEL:+--model "$MODEL"} --json "$OUT_DIR/engine_profile.json" > "$OUT_DIR/engine_profile.md" \
            || echo "engine step profile failed or ran out of time" >&2 ;;
    draft)
        if DRAFT_DIR=$(bounded 120 "$PYTHON" -c "import sys; from benchmarks.make_draft import make_layer_draft; \
print(make_layer_draft(sys.argv[1] or None, int(sys.argv[2])))" "${MODEL:-}" "$DRAFT_LAYERS"); then
            serve "draft${DRAFT_LAYERS}L" "$DRAFT_CONCURRENCY" --draft-model "$DRAFT_DIR"
        else
            echo "no layer draft made: draft stage skipped" >&2
        fi ;;
    train)
        stamp "train-draft on $DEVICE, $TRAIN_MINUTES min"
        if bounded 420 "$PYTHON" -m server.cli train-draft --device "$DEVICE" --dtype bfloat16 \
            ${MODEL:+--model "$MODEL"} --out "$OUT_DIR/head" --minutes "$TRAIN_MINUTES" --total-minutes 6 \
            --max-num-seqs 64 > "$OUT_DIR/train_draft.log" 2>&1; then
            serve eagle-trained-here "$DRAFT_CONCURRENCY" --draft eagle --draft-head "$OUT_DIR/head"
        else
            echo "train-draft failed or ran out of time (see $OUT_DIR/train_draft.log)" >&2
        fi ;;
    *)
        echo "unknown stage $stage (stages: step, profile, heads, eagle, ngram, traffic, batch, draft, train)" >&2
        exit 2 ;;
    esac
done

stamp "summary"
"$PYTHON" - "$OUT_DIR" <<'EOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])


def cell(value, spec):
    return "-" if value is None else format(value, spec)


floor = json.loads((out / "floor.json").read_text())
lines = ["| measure | ms per decode step |", "|---|---|",
         f"| bandwidth floor: {floor['weight_bytes'] / 1e6:.0f} MB / {floor['bandwidth_bytes_per_s'] / 1e9:.0f} GB/s "
         f"| {floor['floor_ms']:.3f} |"]
engine = out / "engine_batch.json"
if engine.exists():
    for rec in json.loads(engine.read_text()):
        if rec["seqs"] == 1:
            lines.append(f"| engine, batch 1, spec off (1 / tok/s) | {1e3 / rec['engine_tps']:.2f} |")
step = out / "engine_step.json"
if step.exists():
    for rec in json.loads(step.read_text()):
        if "case" in rec:
            lines.append(f"| step: {rec['case']} ({rec['device_syncs']} syncs, {rec['host_transfers']:.0f} transfers) "
                         f"| {rec['ms']:.2f} |")
reports = sorted(out.glob("*/serve_bench.json"))
for path in reports:
    for run in json.loads(path.read_text())["runs"]:
        if run["mode"] == "off" and run["load"] == 1 and run["tpot_ms"]:
            lines.append(f"| serving ({path.parent.name}), c=1, spec off: TPOT p50 | {run['tpot_ms']['p50']:.2f} |")
profile = out / "engine_profile.json"
if profile.exists():
    lines += ["", "| profiled case | operator | calls / step | host ms / step | device ms / step |",
              "|---|---|---|---|---|"]
    for rec in json.loads(profile.read_text()):
        case = f"{rec['case']} ({rec['ms_per_step']:.2f} ms/step, operators {rec['host_op_ms_per_step']:.2f})"
        for op in rec["ops"][:6]:
            lines.append(f"| {case} | {op['name']} | {op['calls_per_step']:.0f} | "
                         f"{op['self_cpu_ms_per_step']:.2f} | {op['self_device_ms_per_step']:.2f} |")
heads = out / "engine_draft.json"
if heads.exists():
    lines += ["", "| held-out set | config | tok/s | vs off | accepted / verify |", "|---|---|---|---|---|"]
    for rec in json.loads(heads.read_text()):
        lines.append(f"| {rec['set']} | {rec['config']} | {rec['tps']:.0f} | {rec['vs_off']:.2f} | "
                     f"{cell(rec['mean_accepted_per_verify'], '.2f')} |")
lines += ["", "| run | load | off tok/s | on tok/s | auto tok/s | on / off | auto / best | accept (on) "
          "| auto's steps that verify | auto's calibration | engine ms / step, off / on / auto |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]

for path in reports:
    report = json.loads(path.read_text())
    by_mode = {(r["mode"], r["load"]): r for r in report["runs"] if r["load_kind"] == "concurrency"}
    for row in report["tradeoff"]["rows"]:
        tps = row["output_throughput"]
        cells = [f"{tps[m]:.0f}" if m in tps else "-" for m in ("off", "on", "auto")]
        ratios = [cell(v, ".2f") for v in (row["on_vs_off"], row["auto_vs_best"])]
        on, auto = by_mode.get(("on", row["load"]), {}), by_mode.get(("auto", row["load"]), {})
        lines.append(f"| {path.parent.name} | {row['load']} | {' | '.join(cells)} | {' | '.join(ratios)} | "
                     f"{cell(on.get('acceptance_rate'), '.0%')} | {cell(auto.get('spec_step_share'), '.0%')} | "
                     f"{cell(auto.get('step_time_predicted_over_measured'), '.2f')} | "
                     f"{' / '.join(cell(by_mode.get((m, row['load']), {}).get('step_ms'), '.1f') for m in ('off', 'on', 'auto'))} |")
text = "\n".join(lines)
(out / "summary.md").write_text(text + "\n")
print(text)
EOF
stamp "done: $OUT_DIR"
