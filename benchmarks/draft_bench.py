"""Learned draft head against n-gram and no speculation, at batch 1, on held-out prompts.

    python -m benchmarks.engine_bench --section draft --dtypes auto
    python -m benchmarks.engine_bench --section draft --draft-head DIR --prompts-per-set 8

Prompts are the first N of `benchmarks/prompt_sets/{chat,code,creative}.jsonl`:
the benchmark's own sets, which `specd train-draft` never trains on. Each
prompt runs alone (batch 1), greedy, `ignore_eos`, so every configuration
emits the same tokens; per set it reports tok/s against speculation off
measured in the same run, the acceptance at each draft position (of the
verifies that drafted a position, the share whose draft was accepted up to
and including it), the mean tokens each verify accepted, and where a step's
time goes: a plain decode step, the drafting of a verify step (host lookup
for n-gram, the head's K forwards for eagle) and the verify forward itself.
`eagle auto` is the default server (prompt lookup beside the head, per row);
`eagle auto, head only` is `--draft-lookup off`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.common import chat_ids, engine_run, load, table
from models.eagle_head import read_head_config
from models.heads import BUNDLED_HEAD_DIR
from scheduler.types import Batch, StepOutput
from speculation.config import ProposerConfig
from worker.builder import build_runner
from worker.runner import ModelRunner, RunnerConfig

PROMPT_SET_DIR = Path(__file__).parent / "prompt_sets"
HELD_OUT_SETS = ("chat", "code", "creative")


@dataclass
class PositionTally:
    """Per draft position j: verifies that drafted it, and those that accepted drafts 0..j."""

    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    verifies: int = 0
    accepted_tokens: int = 0
    # Seconds and steps per runner phase ("draft", "verify", "decode", "prefill"): what a token costs.
    phase_seconds: dict[str, float] = field(default_factory=dict)
    phase_steps: dict[str, int] = field(default_factory=dict)

    def add(self, output: StepOutput) -> None:
        for phase, seconds in output.phase_seconds.items():
            self.phase_seconds[phase] = self.phase_seconds.get(phase, 0.0) + seconds
            self.phase_steps[phase] = self.phase_steps.get(phase, 0) + 1
        for row in output.rows:
            if not row.num_draft_tokens:
                continue
            self.verifies += 1
            self.accepted_tokens += row.num_accepted_tokens
            for j in range(row.num_draft_tokens):
                if j == len(self.drafted):
                    self.drafted.append(0)
                    self.accepted.append(0)
                self.drafted[j] += 1
                self.accepted[j] += j < row.num_accepted_tokens

    def rates(self, k: int) -> list[float | None]:
        return [self.accepted[j] / self.drafted[j] if j < len(self.drafted) and self.drafted[j] else None
                for j in range(k)]  # fmt: skip

    def ms_per_step(self, phase: str) -> float | None:
        steps = self.phase_steps.get(phase)
        return 1000 * self.phase_seconds[phase] / steps if steps else None

    @property
    def mean_accepted(self) -> float | None:
        return self.accepted_tokens / self.verifies if self.verifies else None


class TalliedRunner:
    """A `ModelRunner` whose every step's row outputs feed a `PositionTally`."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.tally = PositionTally()

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def execute(self, batch: Batch) -> StepOutput:
        output = self.runner.execute(batch)
        self.tally.add(output)
        return output


def held_out_prompts(per_set: int) -> dict[str, list[str]]:
    sets = {}
    for name in HELD_OUT_SETS:
        lines = (PROMPT_SET_DIR / f"{name}.jsonl").read_text().splitlines()
        sets[name] = [json.loads(line)["prompt"] for line in lines if line.strip()][:per_set]
    return sets


def draft_section(
    dtype: str, max_tokens: int, model: str | None, device: str, head_dir: Path | None, per_set: int, k: int = 4
) -> tuple[str, list[dict]]:
    target = load(dtype, model, device)
    head_dir = head_dir or BUNDLED_HEAD_DIR
    training = read_head_config(head_dir).training
    configs = [
        ("off", "none", False),
        ("ngram auto", "ngram", "auto"),
        (f"ngram K={k}", "ngram", True),
        ("eagle auto", "eagle", "auto"),  # with prompt lookup beside the head (the default)
        ("eagle auto, head only", "eagle-head", "auto"),
        (f"eagle K={k}", "eagle", True),
    ]
    prompt_sets = held_out_prompts(per_set)
    max_len = max(len(chat_ids(target, p)) for ps in prompt_sets.values() for p in ps) + max_tokens + 8
    runners = {
        key: build_runner(
            target,
            RunnerConfig(max_num_seqs=1, max_model_len=max_len),
            ProposerConfig(method, draft_head=str(head_dir) if method == "eagle" else None, lookup=key == method),
        )
        for key, method in (("none", "none"), ("ngram", "ngram"), ("eagle", "eagle"), ("eagle-head", "eagle"))
    }
    rows, records = [], []
    for set_name, prompts in prompt_sets.items():
        results = {}
        for name, method, speculation in configs:
            runner = TalliedRunner(runners[method])
            seconds, tokens = 0.0, 0
            for prompt in prompts:
                ids = [chat_ids(target, prompt)]
                r = engine_run(target, ids, max_tokens, method, speculation=speculation, k=k, name=name,
                               runner=runner)  # fmt: skip
                seconds += r.seconds
                tokens += r.num_tokens
            results[name] = (tokens / seconds, runner.tally)
        off_tps = results["off"][0]
        for name, (tps, tally) in results.items():
            rates = tally.rates(k)
            ms = [tally.ms_per_step(phase) for phase in ("decode", "draft", "verify")]
            rows.append([set_name, name, tps, tps / off_tps, tally.mean_accepted,
                         *(f"{r:.2f}" if r is not None else "-" for r in rates), *ms])  # fmt: skip
            records.append({"dtype": str(target.dtype).removeprefix("torch."), "set": set_name, "config": name,
                            "tps": tps, "vs_off": tps / off_tps, "mean_accepted_per_verify": tally.mean_accepted,
                            "acceptance_by_position": rates, "verifies": tally.verifies,
                            "ms_decode_step": ms[0], "ms_draft_phase": ms[1], "ms_verify_forward": ms[2]})  # fmt: skip
    headers = ["set", "config", "tok/s", "vs off", "accepted / verify", *(f"pos {j + 1}" for j in range(k)),
               "ms decode step", "ms drafting", "ms verify forward"]  # fmt: skip
    dtype_name = str(target.dtype).removeprefix("torch.")
    text = (
        f"### Draft head vs n-gram at batch 1 ({dtype_name}, {max_tokens} new tokens, "
        f"first {per_set} prompts of each held-out set, {time.strftime('%Y-%m-%d')})\n\n"
        f"Head: `{head_dir}`: {_head_summary(training)}\n\n" + table(headers, rows)
    )
    return text, records


def _head_summary(training: dict) -> str:
    """What the head was trained on and its own held-out numbers, from its training record."""
    data, held = training.get("data", {}), training.get("held_out", {})
    minutes = training.get("phase_minutes", {})
    return (
        f"{data.get('answer_tokens_train', '?')} answer tokens of {data.get('prompts', '?')} prompts, "
        f"{training.get('training', {}).get('steps', '?')} steps, "
        f"{sum(minutes.values()):.1f} min in all; held-out acceptance per position {held.get('per_position')}"
    )
