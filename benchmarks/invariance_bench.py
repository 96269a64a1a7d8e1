"""What `--batch-invariant` costs: decode tok/s against the default, at 1 and 16 streams, plain and
speculating, measured in one run with the two modes interleaved.

    python -m benchmarks.invariance_bench
    python -m benchmarks.invariance_bench --model qwen2.5-coder-1.5b-instruct --streams 1,4 --max-tokens 32

The target is loaded twice, tuned (the default) and invariant (fixed 16-row GEMM calls, paged
attention for every row). Both read the same weights; the process's paged-attention switch is
set for each run's mode. Greedy, `ignore_eos`: every configuration emits the same number of
tokens (and, in the invariant mode, the same tokens whatever the batch).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from benchmarks.common import chat_ids, engine_run, table
from benchmarks.draft_bench import held_out_prompts
from models import paged_attention
from models.loader import LoadedModel, ModelConfig, load_model
from speculation.config import ProposerConfig
from worker.builder import build_runner
from worker.runner import RunnerConfig

MODES = ("default", "invariant")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="target: a catalogue name, directory or .gguf [SmolLM2]")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--streams", default="1,16", help="comma-separated concurrent requests")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--draft", default="ngram", help="the proposer of the speculating runs")
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    streams = [int(s) for s in args.streams.split(",")]
    targets: dict[str, LoadedModel] = {
        mode: load_model(ModelConfig(args.model, dtype=args.dtype, batch_invariant=mode == "invariant"))
        for mode in MODES
    }
    prompts = [chat_ids(targets["default"], p) for ps in held_out_prompts(6).values() for p in ps]
    batch = max(streams)
    max_len = max(len(p) for p in prompts) + args.max_tokens + 8
    runners = {
        mode: build_runner(target, RunnerConfig(max_num_seqs=batch, max_model_len=max_len), ProposerConfig(args.draft))
        for mode, target in targets.items()
    }
    print(
        f"# --batch-invariant vs default — {platform.machine()} CPU, {torch.get_num_threads()} threads, {args.dtype}, "
        f"{args.max_tokens} tokens, {args.draft} K = {args.k}, {args.rounds} rounds, {time.strftime('%Y-%m-%d')}\n",
        flush=True,
    )
    seconds: dict[tuple, float] = {}
    tokens: dict[tuple, int] = {}
    for round_ in range(args.rounds):
        for n in streams:
            for speculation in (False, True):
                for mode in MODES if round_ % 2 == 0 else MODES[::-1]:
                    target = targets[mode]  # the paged-attention switch as its own load set it
                    paged_attention.use(True, everywhere=target.batch_invariant or target.step_invariant)
                    r = engine_run(target, prompts[:n], args.max_tokens, args.draft, speculation=speculation,
                                   k=args.k, runner=runners[mode])  # fmt: skip
                    key = (n, speculation, mode)
                    seconds[key] = seconds.get(key, 0.0) + r.seconds
                    tokens[key] = tokens.get(key, 0) + r.num_tokens
    rows, records = [], []
    for n in streams:
        tps = {(s, m): tokens[(n, s, m)] / seconds[(n, s, m)] for s in (False, True) for m in MODES}
        for mode in MODES:
            off, on = tps[(False, mode)], tps[(True, mode)]
            base = tps[(False, "default")]
            rows.append([n, mode, off, base / off, on, on / off])
            records.append({"streams": n, "mode": mode, "off_tps": off, "time_per_token_vs_default": base / off,
                            "on_tps": on, "speculation_speedup": on / off})  # fmt: skip
    headers = ["streams", "mode", "off tok/s", "off time per token vs default", f"{args.draft} tok/s", "on / off"]
    print(table(headers, rows))
    if args.json:
        args.json.write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
