"""Where eagle auto's time goes at n requests: its steps by class (plain, verify with head drafts,
verify with lookup drafts only, probe only), each priced, and priced again without its drafts and
probe, by one step-cost model fitted to the steps of all four runs (off, auto, off, auto).

    PYTHONPATH=. .venv/bin/python benchmarks/results/eagle-s22-natural-bf16/step_classes.py 16 8 [bfloat16]
"""

from __future__ import annotations

import collections
import sys
import time

import benchmarks.loop_bench as lb
from benchmarks.common import load
from models.builder import ProposerConfig, build_runner
from models.runner import RunnerConfig
from scheduler.cost_model import StepShape
from scheduler.scheduler import step_shape

HEAD = "models/heads/smollm2-135m-instruct"
steps: list[dict] = []
current_mode = ["off"]


class ClassifyingExecutor(lb.CountingExecutor):
    def execute(self, batch):
        start = time.perf_counter()
        out = self.runner.execute(batch)
        seconds = time.perf_counter() - start
        if batch.rows:
            self.steps += 1
            self.rows += len(batch.rows)
            shape = step_shape(batch, out)
            self.timed.append((shape, seconds))
            steps.append({
                "mode": current_mode[0],
                "rows": len(batch.rows),
                "decode": sum(1 for r in batch.rows if r.sample),
                "drafts": sum(o.num_draft_tokens for o in out.rows),
                "lookup": sum(o.num_draft_tokens for o in out.rows if o.method == "ngram"),
                "emitted": sum(len(o.token_ids) for o in out.rows),
                "probe": any(o.probe_id is not None for o in out.rows),
                "shape": shape,
                "seconds": seconds,
            })  # fmt: skip
        return out


def as_plain(shape: StepShape, decode_rows: int) -> StepShape:
    """The same step with no drafts and no probe (context kept: a slight overprice)."""
    drafts = shape.num_logits - decode_rows
    return StepShape(num_tokens=shape.num_tokens - drafts, num_context=shape.num_context, num_logits=decode_rows)


def main() -> None:
    n, waves = int(sys.argv[1]), int(sys.argv[2])
    dtype = sys.argv[3] if len(sys.argv) > 3 else "bfloat16"
    lb.CountingExecutor = ClassifyingExecutor
    target = load(dtype)
    cfg = lb.LoopConfig(sets=("chat", "code", "creative"), max_tokens=64, method="eagle", draft_head=HEAD,
                        num_speculative_tokens=5)  # fmt: skip
    runner = build_runner(
        target, RunnerConfig(max_num_seqs=n, max_model_len=2048), ProposerConfig("eagle", draft_head=HEAD)
    )
    prompts = lb._prompts(target, cfg.sets, waves * n)
    runs: dict[str, list[dict]] = {}
    for mode in ("off", "auto", "off", "auto"):
        current_mode[0] = mode
        runs.setdefault(mode, []).append(lb._run(runner, target, prompts, n, mode, cfg))
    model = lb.shared_cost_model([step for rs in runs.values() for run in rs for step in run["timed"]])
    for mode in ("off", "auto"):
        mine = [s for s in steps if s["mode"] == mode]
        classes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        for s in mine:
            shape = s["shape"]
            name = "verify, head drafts" if shape.is_spec else ("probe only" if s["probe"] else "plain")
            if shape.is_spec and s["lookup"] == s["drafts"]:
                name = "verify, lookup drafts only"
            c = classes[name]
            c["steps"] += 1
            c["rows"] += s["rows"]
            c["drafts"] += s["drafts"]
            c["extra"] += s["emitted"] - s["rows"]
            c["measured"] += s["seconds"]
            c["modeled"] += model.predict(shape)
            c["as_plain"] += model.predict(as_plain(shape, s["decode"]))
        print(f"## {mode}: {len(mine)} steps over 2 rounds, {sum(s['seconds'] for s in mine):.2f} s measured")
        print("| steps | count | rows/step | drafts | extra tokens | measured s | modeled s | as plain s | premium | "
              "extra tokens / rows |\n|---|---|---|---|---|---|---|---|---|---|")  # fmt: skip
        for name, c in classes.items():
            print(f"| {name} | {c['steps']} | {c['rows'] / c['steps']:.2f} | {c['drafts']} | {c['extra']} | "
                  f"{c['measured']:.2f} | {c['modeled']:.2f} | {c['as_plain']:.2f} | "
                  f"{(c['modeled'] / c['as_plain'] - 1) * 100:+.1f}% | "
                  f"{c['extra'] / c['rows'] * 100:+.1f}% |")  # fmt: skip
    for mode, rs in runs.items():
        print(mode, "tok/s", [round(r["tps"], 1) for r in rs], "steps", [r["steps"] for r in rs])


if __name__ == "__main__":
    main()
