"""Acceptance of the coupled verify (seeded requests) against the rejection sampler, per drafter.

    python -m benchmarks.coupling_bench                     # SmolLM2: its bundled EAGLE head, n-gram
    python -m benchmarks.coupling_bench --model qwen2.5-coder-1.5b-instruct \\
        --draft qwen2.5-coder-0.5b-instruct --drafters draft_model,ngram

A seeded request is verified against the plain path's own draw at each position
(`speculation.rejection.coupled_verify`), and a draft model or head drafts it with
that position's uniform; an unseeded one goes through the rejection sampler, which
accepts the most of a drafter that samples from q. Each drafter runs the first
`--prompts-per-set` prompts of the held-out sets in one batch, `speculation: true`
with K drafts, at each temperature, once per scheme with the same fixed seeds (the
rejection run marks them unseeded, as the server does a request without a seed),
the two schemes interleaved. Per cell: draft tokens accepted of those drafted,
accepted per verify and acceptance by draft position, with the coupled
scheme's acceptance as a ratio of the rejection sampler's. Acceptance, not
speed: it does not depend on the machine or its load. For a model-free
drafter (n-gram) both accept a draft token x with chance p(x): the ratio is 1 up to
noise.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.common import chat_ids, load, table
from benchmarks.draft_bench import PositionTally, TalliedRunner, held_out_prompts
from models.heads import BUNDLED_HEAD_DIR
from models.loader import LoadedModel
from scheduler.offline import run_offline
from scheduler.scheduler import SchedulerConfig
from scheduler.types import Request, SamplingParams
from speculation.config import ProposerConfig, SpecConfig
from worker.builder import build_runner
from worker.runner import RunnerConfig

SCHEMES = ("rejection", "coupled")
HEADERS = ["drafter", "temperature", "scheme", "drafted", "accepted / drafted", "vs rejection", "accepted / verify",
           "by draft position"]  # fmt: skip


@dataclass
class Cell:
    tally: PositionTally
    drafted: int
    accepted: int

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None


def run_scheme(
    target: LoadedModel, runner, prompts: list[list[int]], scheme: str, temperature: float, seed: int, args
) -> Cell:
    """One batch of `prompts` under `scheme`, prompt i seeded `seed + i`."""
    config = SchedulerConfig(
        max_num_seqs=len(prompts),
        max_model_len=max(len(p) for p in prompts) + args.max_tokens + 8,
        max_num_batched_tokens=max(2048, len(prompts) * 32),
        eos_token_ids=target.eos_token_ids,
        spec=SpecConfig(num_speculative_tokens=args.k),
    )
    requests = []
    for i, ids in enumerate(prompts):
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=temperature, seed=seed + i, ignore_eos=True, speculation=True
        )
        params.seeded = scheme == "coupled"  # the same fixed seed either way; unseeded takes the rejection sampler
        requests.append(Request(f"{scheme}-{temperature}-{i}", ids, params))
    tallied = TalliedRunner(runner)
    done = run_offline(tallied, config, requests)
    return Cell(tallied.tally, sum(c.num_draft_tokens for c in done), sum(c.num_accepted_tokens for c in done))


def drafter_config(name: str, args) -> ProposerConfig:
    if name == "eagle":
        return ProposerConfig("eagle", draft_head=str(args.draft_head or BUNDLED_HEAD_DIR), lookup=False)
    if name == "draft_model":
        if not args.draft:
            raise SystemExit("--drafters draft_model needs --draft MODEL")
        return ProposerConfig("draft_model", args.draft, lookup=False)
    return ProposerConfig(name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="target: a catalogue name, directory or .gguf [SmolLM2]")
    parser.add_argument("--draft", default=None, help="the draft model, for --drafters draft_model")
    parser.add_argument("--draft-head", type=Path, default=None, help="the EAGLE head [the bundled one]")
    parser.add_argument("--drafters", default="eagle,ngram", help="comma-separated: eagle, draft_model, ngram, suffix")
    parser.add_argument("--temperatures", default="0.7,1.0")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--prompts-per-set", type=int, default=4, help="held-out prompts per set")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("-k", type=int, default=4, help="draft tokens per verify")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each scheme (different seeds), interleaved")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write the records here")
    args = parser.parse_args()

    target = load(args.dtype, args.model)
    dtype = str(target.dtype).removeprefix("torch.")
    prompts = [chat_ids(target, p) for ps in held_out_prompts(args.prompts_per_set).values() for p in ps]
    print(
        f"# coupled verify vs rejection sampling — {platform.machine()} CPU, {torch.get_num_threads()} threads, "
        f"{dtype}, {len(prompts)} prompts in one batch, {args.max_tokens} tokens, K = {args.k}, "
        f"{args.rounds} rounds, {time.strftime('%Y-%m-%d')}\n",
        flush=True,
    )
    rows, records = [], []
    max_len = max(len(p) for p in prompts) + args.max_tokens + 8
    for drafter in args.drafters.split(","):
        runner = build_runner(
            target, RunnerConfig(max_num_seqs=len(prompts), max_model_len=max_len), drafter_config(drafter, args)
        )
        for temperature in (float(t) for t in args.temperatures.split(",")):
            cells: dict[str, list[Cell]] = {scheme: [] for scheme in SCHEMES}
            for round_ in range(args.rounds):
                base = args.seed + round_ * len(prompts)
                for scheme in SCHEMES if round_ % 2 == 0 else SCHEMES[::-1]:
                    cells[scheme].append(run_scheme(target, runner, prompts, scheme, temperature, base, args))
            summary = {}
            for scheme, runs in cells.items():
                drafted, accepted = sum(c.drafted for c in runs), sum(c.accepted for c in runs)
                verifies = sum(c.tally.verifies for c in runs)
                by_position = [
                    sum(c.tally.accepted[j] for c in runs if j < len(c.tally.accepted))
                    / max(sum(c.tally.drafted[j] for c in runs if j < len(c.tally.drafted)), 1)
                    for j in range(args.k)
                ]
                rate = accepted / drafted if drafted else None
                summary[scheme] = (drafted, rate, accepted / max(verifies, 1), by_position)
            base_rate = summary["rejection"][1]
            for scheme, (drafted, rate, per_verify, by_position) in summary.items():
                ratio = rate / base_rate if rate is not None and base_rate else None
                rows.append([drafter, temperature, scheme, drafted, rate, ratio, per_verify,
                             " / ".join(f"{r:.2f}" for r in by_position)])  # fmt: skip
                records.append({"drafter": drafter, "temperature": temperature, "scheme": scheme, "dtype": dtype,
                                "drafted": drafted, "acceptance": rate, "vs_rejection": ratio,
                                "accepted_per_verify": per_verify, "acceptance_by_position": by_position})  # fmt: skip
            print(table(HEADERS, rows[-len(SCHEMES) :]) + "\n", flush=True)  # a long run shows as it goes
    print(table(HEADERS, rows))
    if args.json:
        args.json.write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
