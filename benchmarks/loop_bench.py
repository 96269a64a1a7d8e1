"""Closed-loop engine benchmark: speculation `auto` against off and on, without HTTP.

    python -m benchmarks.engine_bench --section loop --dtypes auto
    python -m benchmarks.engine_bench --section loop --loop-sets extraction,creative --batch-sizes 4,16 --rounds 3
    python -m benchmarks.engine_bench --section loop --loop-sets creative --waves 2,8 --loop-modes off,auto

n requests run at once out of `waves` x n queued (a finished request's slot goes
to the next one at the following step), chat prompts from `benchmarks/prompt_sets`
taken in turn from each set, greedy, `ignore_eos`, so every mode emits the
same tokens. With equal lengths `off` keeps every slot in lock step to the
end, and a mode that finishes some requests early ends its run on a tail of
emptier steps; two ways to lengths that differ, as real requests' do:
`length_range_ratio` r draws each request's max_tokens once, uniformly in
max_tokens x [1 - r, 1 + r] (vLLM's benchmark does the same), and
`lengths="natural"` stops each request at its end of sequence (max_tokens
still caps it; greedy decoding is lossless, so every mode emits the same
tokens, but a small model's long answers repeat themselves, which drafts
well: a different workload, not only a different length). Each mode runs on
a fresh engine (the policy starts cold, as a new server would); modes are
interleaved within a round, their order rotated between rounds, and a ratio
is the median over rounds of the ratio measured inside one round, since this
machine's speed drifts by 10-30% over minutes.
Per mode: tok/s, engine steps, rows per step (the batch's mean occupancy),
draft tokens and accepted ones.

Drift that large hides a 5% difference, so every step's shape (tokens, keys,
verify or not, draft forwards) and time are also recorded, one step-cost model
(`speculation.cost_model`, the one the policy learns) is fitted to the steps of
all modes and rounds of a batch size together, and each run is priced by it:
"modeled" seconds are what the run's steps cost on one machine at one speed.
Its ratios do not drift; they are as good as that model's fit, which the table
shows per mode (modeled over measured seconds).
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass
from typing import Literal

from benchmarks.common import chat_ids, table
from benchmarks.lengths import max_tokens_per_request
from benchmarks.serve_client import load_prompts
from models.loader import LoadedModel
from scheduler.offline import run_offline
from scheduler.scheduler import SchedulerConfig
from scheduler.types import Batch, Request, SamplingParams, StepOutput
from speculation.config import ProposerConfig, SpecConfig
from speculation.cost_model import StepCostModel, StepShape, step_shape
from worker.builder import build_runner
from worker.runner import ModelRunner, RunnerConfig

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
    waves: tuple[int, ...] = (3,)  # requests queued per slot: few make the run mostly its tail
    modes: tuple[str, ...] = tuple(MODES)
    lengths: Literal["fixed", "natural"] = "fixed"  # natural: stop at end of sequence
    # Each request's max_tokens drawn once, uniformly in max_tokens x [1 - r, 1 + r] (as vLLM's
    # benchmark's --random-range-ratio): the same in every mode, so the loop does not move in lock step.
    length_range_ratio: float = 0.0


class CountingExecutor:
    """The runner, counting steps and the rows they carried, and recording each step's shape and time."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.steps = 0
        self.rows = 0
        self.timed: list[tuple[StepShape, float]] = []

    def __getattr__(self, name: str):
        # Everything else the engine asks of its executor (proposer name, draft previews,
        # the proposer's own acceptance record) is the runner's.
        return getattr(self.runner, name)

    def execute(self, batch: Batch) -> StepOutput:
        start = time.perf_counter()
        output = self.runner.execute(batch)
        if batch.rows:
            self.steps += 1
            self.rows += len(batch.rows)
            self.timed.append((step_shape(batch, output), time.perf_counter() - start))
        return output


def shared_cost_model(timed: list[tuple[StepShape, float]], seed: int = 0) -> StepCostModel:
    """One step-cost model fitted to all these steps alike: shuffled, so no run's steps
    count for more by coming last, and weighted 1/n, so the oldest keep ~1/e of the weight."""
    steps = list(timed)
    random.Random(seed).shuffle(steps)
    model = StepCostModel(weight=1.0 / max(len(steps), 1))
    for shape, seconds in steps:
        model.observe(shape, seconds)
    return model


def _prompts(target: LoadedModel, sets: tuple[str, ...], total: int) -> list[list[int]]:
    """`total` chat prompts, the sets interleaved as serve_bench sends them, cycled."""
    texts = [p.text for p in load_prompts(list(sets))]
    return [chat_ids(target, texts[i % len(texts)]) for i in range(total)]


def _run(runner: ModelRunner, target: LoadedModel, prompts: list[list[int]], n: int, mode: str, cfg: LoopConfig):
    max_len = max(len(p) for p in prompts) + 2 * cfg.max_tokens + cfg.num_speculative_tokens + 8
    config = SchedulerConfig(
        max_num_seqs=n,
        max_model_len=max_len,
        max_num_batched_tokens=2048,
        eos_token_ids=target.eos_token_ids,
        spec=SpecConfig(num_speculative_tokens=cfg.num_speculative_tokens),
    )
    caps = max_tokens_per_request(len(prompts), cfg.max_tokens, cfg.length_range_ratio)
    requests = [
        Request(f"{mode}-{i}", p, SamplingParams(max_tokens=cap, temperature=0, ignore_eos=cfg.lengths == "fixed",
                                                 speculation=MODES[mode]))
        for i, (p, cap) in enumerate(zip(prompts, caps))
    ]  # fmt: skip
    cap_of = {r.request_id: cap for r, cap in zip(requests, caps)}
    executor = CountingExecutor(runner)
    start = time.perf_counter()
    done = run_offline(executor, config, requests)
    seconds = time.perf_counter() - start
    return {
        "tps": sum(len(c.token_ids) for c in done) / seconds,
        "tokens": sum(len(c.token_ids) for c in done),
        "steps": executor.steps,
        "rows_per_step": executor.rows / max(executor.steps, 1),
        "drafted": sum(c.num_draft_tokens for c in done),
        "accepted": sum(c.num_accepted_tokens for c in done),
        "at_max_tokens": sum(len(c.token_ids) == cap_of[c.request_id] for c in done),  # natural: ran to the cap
        "timed": executor.timed,
    }


def _price(runs: dict[str, list[dict]]) -> None:
    """Add each run's modeled seconds (its steps priced by one model fitted to every run's
    steps) and the model's fit to that run (modeled over measured step seconds)."""
    model = shared_cost_model([step for rs in runs.values() for run in rs for step in run["timed"]])
    for rs in runs.values():
        for run in rs:
            timed = run.pop("timed")
            run["modeled_s"] = sum(model.predict(shape) for shape, _ in timed)
            run["model_fit"] = run["modeled_s"] / max(sum(seconds for _, seconds in timed), 1e-9)


def _ratios(runs: dict[str, list[dict]], faster) -> dict[str, float]:
    """auto over off, on and the better of the two (faster(a, b): how much faster run a was than
    run b), the median over rounds of the ratio inside a round."""
    fixed = [m for m in ("off", "on") if m in runs]
    if "auto" not in runs or not fixed:
        return {}
    rounds = range(len(runs["auto"]))
    out = {f"auto/{m}": statistics.median(faster(runs["auto"][r], runs[m][r]) for r in rounds) for m in fixed}
    out["auto/best"] = statistics.median(min(faster(runs["auto"][r], runs[m][r]) for m in fixed) for r in rounds)
    return out


def rotated_runs(
    runner: ModelRunner,
    target: LoadedModel,
    prompts: list[list[int]],
    n: int,
    modes: list[str],
    cfg: LoopConfig,
) -> dict[str, list[dict]]:
    """Each mode's runs over `cfg.rounds` rounds, the order rotated every round so no mode always
    follows the same one, then priced by one cost model (`_price`)."""
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(cfg.rounds):
        for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:
            runs[mode].append(_run(runner, target, prompts, n, mode, cfg))
    _price(runs)
    return runs


def loop_section(target: LoadedModel, dtype: str, cfg: LoopConfig) -> tuple[str, list[dict]]:
    modes = list(cfg.modes)
    rows, records = [], []
    for n in cfg.batch_sizes:
        runner = build_runner(
            target,
            RunnerConfig(max_num_seqs=n, max_model_len=2048),
            ProposerConfig(cfg.method, draft_head=cfg.draft_head),
        )
        for waves in cfg.waves:
            runs = rotated_runs(runner, target, _prompts(target, cfg.sets, waves * n), n, modes, cfg)
            measured = _ratios(runs, lambda a, b: a["tps"] / b["tps"])
            # Tokens per modeled second: with natural lengths, bf16's batch-dependent rounding can
            # end a request a few tokens apart between modes.
            modeled = _ratios(runs, lambda a, b: (a["tokens"] / a["modeled_s"]) / (b["tokens"] / b["modeled_s"]))
            for mode in modes:
                median = {k: statistics.median(run[k] for run in runs[mode]) for k in runs[mode][0]}
                is_auto = mode == "auto"
                rows.append([n, waves, mode, median["tps"], median["tokens"], median["at_max_tokens"],
                             median["modeled_s"], median["steps"], median["rows_per_step"], median["drafted"],
                             median["accepted"], median["model_fit"],
                             measured.get("auto/best") if is_auto else None,
                             modeled.get("auto/best") if is_auto else None])  # fmt: skip
                records.append({"dtype": dtype, "sets": list(cfg.sets), "lengths": cfg.lengths, "requests": n,
                                "waves": waves, "mode": mode, **median, **(measured if is_auto else {}),
                                **({f"{k} modeled": v for k, v in modeled.items()} if is_auto else {})})  # fmt: skip
    headers = ["requests", "waves", "mode", "tok/s", "tokens", "at max tokens", "modeled s", "steps", "rows/step",
               "drafted", "accepted", "model fit", "auto / better fixed", "modeled: auto / better fixed"]  # fmt: skip
    text = (
        f"### Closed loop ({dtype}, {'+'.join(cfg.sets)}, {cfg.method}, "
        f"{'up to ' if cfg.lengths == 'natural' else ''}{cfg.max_tokens} tokens"
        f"{f' x [{1 - cfg.length_range_ratio:g}, {1 + cfg.length_range_ratio:g}]' if cfg.length_range_ratio else ''}, "
        f"waves x n requests, median of {cfg.rounds} rounds)\n\n" + table(headers, rows)
    )
    return text, records
