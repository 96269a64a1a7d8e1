"""Engine benchmark: throughput vs batch size and speculation vs prompt kind.

    python -m benchmarks.engine_bench                      # both sections, fp32 and bf16
    python -m benchmarks.engine_bench --section batch --dtypes bfloat16
    python -m benchmarks.engine_bench --section spec --max-tokens 128
    python -m benchmarks.engine_bench --section step --dtypes float32,bfloat16
    python -m benchmarks.engine_bench --section kernels --dtypes auto   # tuned GEMM layouts vs x @ W^T
    python -m benchmarks.engine_bench --section draft --dtypes auto   # draft head vs n-gram (benchmarks.draft_bench)
    python -m benchmarks.engine_bench --section loop --dtypes auto --max-tokens 64   # auto vs off, on (loop_bench)

Greedy, ignore_eos, so every configuration generates the same number of tokens.
Every ratio is against a baseline measured in the same run on the same machine.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import platform
import time
from pathlib import Path

import torch

from benchmarks.common import chat_ids, engine_run, hf_run, load, table
from benchmarks.draft_bench import draft_section
from benchmarks.loop_bench import LoopConfig, loop_section
from benchmarks.make_draft import make_layer_draft
from benchmarks.prompts import KINDS
from benchmarks.step_bench import kernel_section, profile_section, step_section


def batch_section(
    dtype: str, sizes: list[int], max_tokens: int, model: str | None, device: str
) -> tuple[str, list[dict]]:
    target = load(dtype, model, device)
    reference = load(dtype, model, device)
    prompts = [chat_ids(target, p) for kind in KINDS.values() for p in kind]
    engine_run(target, prompts[:2], 8)  # warm-up
    hf_run(reference, prompts[:1], 8, "warm")
    hf1 = hf_run(reference, prompts[:1], max_tokens, "HF generate, batch 1")
    rows, records = [], []
    base = None
    for n in sizes:
        batch = [prompts[i % len(prompts)] for i in range(n)]
        result = engine_run(target, batch, max_tokens, speculation=False, name=f"engine, {n} seqs")
        base = base or result.tokens_per_second
        hf = hf_run(reference, batch, max_tokens, f"HF generate, batch {n}") if n in (1, 8) else None
        rows.append(
            [
                n,
                result.tokens_per_second,
                result.tokens_per_second / base,
                result.tokens_per_second / hf1.tokens_per_second,
                hf.tokens_per_second if hf else None,
                hf.tokens_per_second / hf1.tokens_per_second if hf else None,
            ]
        )
        records.append(
            {
                "dtype": dtype,
                "seqs": n,
                "engine_tps": result.tokens_per_second,
                "hf_tps": hf.tokens_per_second if hf else None,
            }
        )
    headers = ["seqs", "engine tok/s", "vs engine@1", "vs HF@1", "HF generate tok/s", "HF vs HF@1"]
    text = f"### Throughput vs concurrency ({dtype}, {max_tokens} new tokens, spec off)\n\n" + table(headers, rows)
    text += f"\n\nHF generate batch 1: {hf1.tokens_per_second:.2f} tok/s"
    return text, records


def spec_section(
    dtype: str, max_tokens: int, model: str | None, draft_layers: int, device: str, draft_head: Path | None = None
) -> tuple[str, list[dict]]:
    target = load(dtype, model, device)
    reference = load(dtype, model, device)
    draft_dir = make_layer_draft(model, draft_layers)
    rows, records = [], []
    for kind, prompts in KINDS.items():
        for i, prompt in enumerate(prompts):
            ids = [chat_ids(target, prompt)]
            tag = f"{kind}#{i}"
            run = functools.partial(engine_run, target, ids, max_tokens)
            draft = functools.partial(run, "draft_model", str(draft_dir))
            off = run(speculation=False, name="off")
            results = [
                off,
                run("ngram", speculation="auto", name="ngram auto K<=4"),
                run("ngram", speculation="auto", k=10, name="ngram auto K<=10"),
                run("ngram", speculation=True, k=4, name="ngram K=4"),
                run("ngram", speculation=True, k=10, name="ngram K=10"),
                draft(speculation=True, k=4, name=f"draft {draft_layers}L K=4"),
                draft(speculation="auto", name=f"draft {draft_layers}L auto"),
            ]
            if draft_head:
                eagle = functools.partial(run, "eagle", draft_head=str(draft_head))
                results += [
                    eagle(speculation=True, k=5, name="eagle K=5"),
                    eagle(speculation="auto", name="eagle auto"),
                ]
            hf_plain = hf_run(reference, ids, max_tokens, "HF generate")
            for n in (3, 5, 10):
                r = hf_run(reference, ids, max_tokens, f"HF prompt lookup {n}", prompt_lookup_num_tokens=n)
                results.append(r)
            for r in results:
                mean_len = r.num_tokens / r.num_steps if r.num_steps else None
                rows.append(
                    [
                        tag,
                        r.name,
                        r.tokens_per_second,
                        r.tokens_per_second / off.tokens_per_second,
                        r.tokens_per_second / hf_plain.tokens_per_second,
                        r.acceptance,
                        mean_len,
                    ]
                )
                records.append(
                    {
                        "dtype": dtype,
                        "prompt": tag,
                        "config": r.name,
                        "tps": r.tokens_per_second,
                        "vs_off": r.tokens_per_second / off.tokens_per_second,
                        "acceptance": r.acceptance,
                        "tokens_per_step": mean_len,
                    }
                )
            gc.collect()
    headers = ["prompt", "config", "tok/s", "vs spec off", "vs HF generate", "acceptance", "tokens/step"]
    text = f"### Speculation at batch 1 ({dtype}, {max_tokens} new tokens)\n\n" + table(headers, rows)
    return text, records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--section",
        choices=["batch", "spec", "step", "kernels", "profile", "draft", "loop", "all"],
        default="all",
        help="[all: all but kernels, draft and loop]",
    )
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated dtypes to run")
    parser.add_argument("--batch-sizes", default="1,4,8,16")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--model", default=None, help="target model (default: bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--draft-layers", type=int, default=8, help="layers kept in the truncated draft")
    parser.add_argument(
        "--draft-head", type=Path, default=None, help="spec: also run eagle with this head; draft: the head [bundled]"
    )
    parser.add_argument("--prompts-per-set", type=int, default=6, help="draft section: held-out prompts per set")
    parser.add_argument("--loop-sets", default="extraction,creative", help="loop section: prompt sets, in turn")
    parser.add_argument("--rounds", type=int, default=3, help="loop section: rounds of every mode")
    parser.add_argument(
        "--waves", default="3", help="loop section: requests queued per slot, comma-separated (2: the run is half tail)"
    )
    parser.add_argument("--loop-modes", default="off,on,auto", help="loop section: speculation modes [off,on,auto]")
    parser.add_argument(
        "--loop-lengths",
        choices=["fixed", "natural"],
        default="fixed",
        help="loop section: fixed: every request generates --max-tokens (ignore_eos); natural: each stops at "
        "its end of sequence, up to --max-tokens (greedy: the same tokens in every mode, lengths that differ)",
    )
    parser.add_argument(
        "--length-range-ratio",
        type=float,
        default=0.0,
        help="loop section: each request's max tokens drawn uniformly in --max-tokens x [1 - R, 1 + R], the "
        "same in every mode (vLLM's --random-range-ratio): lengths that differ, the same tokens [0: all equal]",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the records here")
    args = parser.parse_args()

    where = (
        torch.cuda.get_device_name()
        if args.device == "cuda"
        else f"{platform.machine()} CPU, {torch.get_num_threads()} threads"
    )
    print(f"# specd engine benchmark — {where}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}\n")
    records = []
    for dtype in args.dtypes.split(","):
        if args.section in ("batch", "all"):
            text, rec = batch_section(
                dtype, [int(x) for x in args.batch_sizes.split(",")], args.max_tokens, args.model, args.device
            )
            print(text + "\n", flush=True)
            records += rec
        if args.section in ("step", "all"):
            text, rec = step_section(load(dtype, args.model, args.device), dtype)
            print(text + "\n", flush=True)
            records += rec
        if args.section in ("spec", "all"):
            text, rec = spec_section(
                dtype, args.max_tokens, args.model, args.draft_layers, args.device, args.draft_head
            )
            print(text + "\n", flush=True)
            records += rec
        if args.section == "profile":
            text, rec = profile_section(load(dtype, args.model, args.device), dtype)
            print(text + "\n", flush=True)
            records += rec
        if args.section == "kernels":
            text, rec = kernel_section(load(dtype, args.model, args.device), dtype)
            print(text + "\n", flush=True)
            records += rec
        if args.section == "draft":
            text, rec = draft_section(
                dtype, args.max_tokens, args.model, args.device, args.draft_head, args.prompts_per_set
            )
            print(text + "\n", flush=True)
            records += rec
        if args.section == "loop":
            loop = LoopConfig(
                sets=tuple(args.loop_sets.split(",")),
                batch_sizes=tuple(int(x) for x in args.batch_sizes.split(",")),
                rounds=args.rounds,
                max_tokens=args.max_tokens,
                method="eagle" if args.draft_head else "ngram",
                draft_head=str(args.draft_head) if args.draft_head else None,
                num_speculative_tokens=5 if args.draft_head else 10,
                waves=tuple(int(x) for x in args.waves.split(",")),
                modes=tuple(args.loop_modes.split(",")),
                lengths=args.loop_lengths,
                length_range_ratio=args.length_range_ratio,
            )
            text, rec = loop_section(load(dtype, args.model, args.device), dtype, loop)
            print(text + "\n", flush=True)
            records += rec
    if args.json:
        args.json.write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
