"""Session 24: `auto` as landed against `autoX`, the same policy that also runs a longer draft
than planned once per unseen step-size bucket, with off and on, in the closed loop. Apply the
variant first: `git apply benchmarks/results/auto-s24/longer_drafts.patch`. (benchmarks.loop_bench
internals: modes interleaved and rotated per round, each run priced by one cost model fitted to all runs'
steps, so the "modeled" ratios do not drift with the machine).

    PYTHONPATH=. .venv/bin/python benchmarks/results/auto-s24/longer_drafts_ab.py extraction,creative 4,8 2
"""

import statistics
import sys

import benchmarks.loop_bench as lb
import scheduler.policy as pol
from benchmarks.engine_bench import load
from models.builder import ProposerConfig, build_runner
from models.runner import RunnerConfig

sets, levels, rounds = tuple(sys.argv[1].split(",")), [int(x) for x in sys.argv[2].split(",")], int(sys.argv[3])
modes = ["off", "on", "auto", "autoX"]
lb.MODES["autoX"] = "auto"
target = load("auto", None, "cpu")
cfg = lb.LoopConfig(sets=sets, rounds=rounds, length_range_ratio=0.5)


def rate(run: dict) -> float:
    return run["tokens"] / run["modeled_s"]


for n in levels:
    runner = build_runner(target, RunnerConfig(max_num_seqs=n, max_model_len=2048), ProposerConfig("ngram"))
    prompts = lb._prompts(target, sets, 3 * n)
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(rounds):
        for mode in modes[r % 4 :] + modes[: r % 4]:
            pol.EXPLORE_DRAFT_LOSS = 0.2 if mode == "autoX" else 0.0
            runs[mode].append(lb._run(runner, target, prompts, n, mode, cfg))
    lb._price(runs)
    for m in modes:
        median = {key: statistics.median(x[key] for x in runs[m]) for key in ("tps", "steps", "drafted", "accepted")}
        modeled_tps = statistics.median(map(rate, runs[m]))
        print(sets, n, m, f"tps {median['tps']:.1f}", f"modeled tok/s {modeled_tps:.1f}", "steps", median["steps"],
              "drafted", median["drafted"], "accepted", median["accepted"], flush=True)  # fmt: skip
    for a in ("auto", "autoX"):
        modeled = statistics.median(
            min(rate(runs[a][r]) / rate(runs[m][r]) for m in ("off", "on")) for r in range(rounds)
        )
        measured = statistics.median(
            min(runs[a][r]["tps"] / runs[m][r]["tps"] for m in ("off", "on")) for r in range(rounds)
        )
        print(sets, n, a, f"modeled {a}/better fixed {modeled:.3f} measured {measured:.3f}", flush=True)
