"""Drafting time per verify step: the EAGLE head on the target's GEMM table vs the standard layout.

.venv/bin/python benchmarks/results/eagle-s14-head-kernels/head_ab.py  # from the repository root
"""

from __future__ import annotations

import statistics
import sys

sys.path.insert(0, ".")

from benchmarks.common import load  # noqa: E402
from benchmarks.loop_bench import _prompts  # noqa: E402
from models.builder import ProposerConfig, build_runner  # noqa: E402
from models.linear_kernels import STANDARD  # noqa: E402
from models.runner import RunnerConfig  # noqa: E402
from scheduler.offline import run_offline  # noqa: E402
from scheduler.policy import SpecConfig  # noqa: E402
from scheduler.scheduler import SchedulerConfig  # noqa: E402
from scheduler.types import Request, SamplingParams  # noqa: E402

HEAD = "models/heads/smollm2-135m-instruct"


class DraftTimer:
    """The runner, keeping each verify step's drafting seconds."""

    def __init__(self, runner):
        self.runner, self.draft = runner, []

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def execute(self, batch):
        out = self.runner.execute(batch)
        if out.phase_seconds.get("draft"):
            self.draft.append(out.phase_seconds["draft"])
        return out


def main() -> None:
    target = load("float32")
    print("target table:", target.kernel_table.describe())
    results: dict[tuple[int, str], list[float]] = {}
    for n in (1, 4, 16):
        runner = build_runner(
            target, RunnerConfig(max_num_seqs=n, max_model_len=2048), ProposerConfig("eagle", draft_head=HEAD)
        )
        head = runner.proposer.head
        prompts = _prompts(target, ("chat", "code"), n)
        for _ in range(3):
            for name, table in (("tuned", target.kernel_table), ("standard", STANDARD)):
                head.use_kernels(table)
                config = SchedulerConfig(
                    max_num_seqs=n,
                    max_model_len=2048,
                    max_num_batched_tokens=2048,
                    eos_token_ids=target.eos_token_ids,
                    spec=SpecConfig(num_speculative_tokens=4),
                )
                params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, speculation=True)
                timer = DraftTimer(runner)
                run_offline(timer, config, [Request(f"{name}-{i}", p, params) for i, p in enumerate(prompts)])
                results.setdefault((n, name), []).append(statistics.median(timer.draft) * 1e3)
    for n in (1, 4, 16):
        tuned, standard = (statistics.median(results[(n, k)]) for k in ("tuned", "standard"))
        print(f"batch {n:2}: drafting ms per verify step (K=4): target's table {tuned:6.1f}, "
              f"standard {standard:6.1f}, ratio {tuned / standard:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
