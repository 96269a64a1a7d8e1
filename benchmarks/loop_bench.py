"""Closed-loop engine benchmark: speculation `auto` against off and on, without HTTP.

    python -m benchmarks.engine_bench --section loop --dtypes auto
    python -m benchmarks.engine_bench --section loop --loop-sets extraction,creative --batch-sizes 4,16 --rounds 3

n requests run at once out of 3n queued (a finished request's slot goes to the
next one at the following step), chat prompts from `benchmarks/prompt_sets`
taken in turn from each set, greedy, `ignore_eos`, so every mode emits the
same tokens. Each mode runs on a fresh engine (the policy starts cold, as a
new server would); modes are interleaved within a round, their order rotated
between rounds, and a ratio is the median over rounds of the ratio measured
inside one round, since this machine's speed drifts by 10-30% over minutes.
Per mode: tok/s, engine steps, rows per step (the batch's mean occupancy),
draft tokens and accepted ones.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Literal

from benchmarks.common import chat_ids, table
from benchmarks.serve_bench import load_prompts
from models.builder import ProposerConfig, build_runner
from models.loader import LoadedModel
from models.runner import ModelRunner, RunnerConfig
from scheduler.offline import run_offline
from scheduler.policy import SpecConfig
from scheduler.scheduler import SchedulerConfig
from scheduler.types import Batch, Request, SamplingParams, StepOutput

MODES: dict[str, Literal["auto", True, False]] = {"off": False, "on": True, "auto": "auto"}


@dataclass
class LoopConfig:
    sets: tuple[str, ...] = ("extraction", "creative")
    batch_sizes: tuple[int, ...] = (4, 16)
    rounds: int = 3
    max_tokens: int = 64
    method: str = "ngram"
    draft_head: str | None = None
    num_speculative_tokens: int = 10


class CountingExecutor:
    """The runner, counting steps and the rows they carried."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.steps = 0
        self.rows = 0

    def __getattr__(self, name: str):
        # Everything else the engine asks of its executor (proposer name, draft previews,
        # the proposer's own acceptance record) is the runner's.
        return getattr(self.runner, name)

    def execute(self, batch: Batch) -> StepOutput:
        if batch.rows:
            self.steps += 1
            self.rows += len(batch.rows)
        return self.runner.execute(batch)


def _prompts(target: LoadedModel, sets: tuple[str, ...], total: int) -> list[list[int]]:
    """`total` chat prompts, the sets interleaved as serve_bench sends them, cycled."""
    texts = [p.text for p in load_prompts(list(sets))]
    return [chat_ids(target, texts[i % len(texts)]) for i in range(total)]


def _run(runner: ModelRunner, target: LoadedModel, prompts: list[list[int]], n: int, mode: str, cfg: LoopConfig):
    max_len = max(len(p) for p in prompts) + cfg.max_tokens + cfg.num_speculative_tokens + 8
    config = SchedulerConfig(
        max_num_seqs=n,
        max_model_len=max_len,
        max_num_batched_tokens=2048,
        eos_token_ids=target.eos_token_ids,
        spec=SpecConfig(num_speculative_tokens=cfg.num_speculative_tokens),
    )
    params = SamplingParams(max_tokens=cfg.max_tokens, temperature=0, ignore_eos=True, speculation=MODES[mode])
    requests = [Request(f"{mode}-{i}", p, params) for i, p in enumerate(prompts)]
    executor = CountingExecutor(runner)
    start = time.perf_counter()
    done = run_offline(executor, config, requests)
    seconds = time.perf_counter() - start
    return {
        "tps": sum(len(c.token_ids) for c in done) / seconds,
        "steps": executor.steps,
        "rows_per_step": executor.rows / max(executor.steps, 1),
        "drafted": sum(c.num_draft_tokens for c in done),
        "accepted": sum(c.num_accepted_tokens for c in done),
    }


def loop_section(target: LoadedModel, dtype: str, cfg: LoopConfig) -> tuple[str, list[dict]]:
    modes = list(MODES)
    rows, records = [], []
    for n in cfg.batch_sizes:
        runner = build_runner(
            target,
            RunnerConfig(max_num_seqs=n, max_model_len=2048),
            ProposerConfig(cfg.method, draft_head=cfg.draft_head),
        )
        prompts = _prompts(target, cfg.sets, 3 * n)
        runs: dict[str, list[dict]] = {m: [] for m in modes}
        for r in range(cfg.rounds):
            for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:
                runs[mode].append(_run(runner, target, prompts, n, mode, cfg))
        ratios = {
            "auto/off": statistics.median(a["tps"] / o["tps"] for a, o in zip(runs["auto"], runs["off"])),
            "auto/on": statistics.median(a["tps"] / o["tps"] for a, o in zip(runs["auto"], runs["on"])),
            "auto/best": statistics.median(
                a["tps"] / max(o["tps"], s["tps"]) for a, o, s in zip(runs["auto"], runs["off"], runs["on"])
            ),
        }
        for mode in modes:
            median = {k: statistics.median(run[k] for run in runs[mode]) for k in runs[mode][0]}
            rows.append([n, mode, median["tps"], median["steps"], median["rows_per_step"], median["drafted"],
                         median["accepted"], ratios["auto/best"] if mode == "auto" else None])  # fmt: skip
            records.append({"dtype": dtype, "sets": list(cfg.sets), "requests": n, "mode": mode, **median,
                            **(ratios if mode == "auto" else {})})  # fmt: skip
    headers = ["requests", "mode", "tok/s", "steps", "rows/step", "drafted", "accepted", "auto / better fixed"]
    text = (
        f"### Closed loop ({dtype}, {'+'.join(cfg.sets)}, {cfg.method}, {cfg.max_tokens} tokens, "
        f"3n requests, median of {cfg.rounds} rounds)\n\n" + table(headers, rows)
    )
    return text, records
