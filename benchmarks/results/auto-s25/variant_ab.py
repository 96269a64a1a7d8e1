"""Session 25: `auto` with one of this session's changes (`autoX`) against `auto` without it,
with off and on, in the closed loop (benchmarks.loop_bench internals: modes interleaved and
rotated per round, each run priced by one cost model fitted to all runs' steps, so the
"modeled" ratios do not drift with the machine). Variants:

    available  rows plan only the drafts their n-gram index has now (`auto`: up to K for every
               row, blind, as before this session)
    run-rate   a verify plan runs on while its drafts beat the engine's going rate (`auto`:
               the step's best rate decides the plan's length, as landed); not kept, so apply
               the patch first: `git apply benchmarks/results/auto-s25/run_rate.patch`

    PYTHONPATH=. .venv/bin/python benchmarks/results/auto-s25/variant_ab.py available extraction,creative 4,8 2
    PYTHONPATH=. .venv/bin/python benchmarks/results/auto-s25/variant_ab.py run-rate extraction 4,8 2
"""

import statistics
import sys

import benchmarks.loop_bench as lb
import scheduler.policy as pol
from benchmarks.engine_bench import load
from models.builder import ProposerConfig, build_runner
from models.runner import RunnerConfig

variant, sets = sys.argv[1], tuple(sys.argv[2].split(","))
levels, rounds = [int(x) for x in sys.argv[3].split(",")], int(sys.argv[4])
if variant not in ("available", "run-rate"):
    sys.exit(f"unknown variant {variant} (available, run-rate)")
modes = ["off", "on", "auto", "autoX"]
lb.MODES["autoX"] = "auto"
landed_available = pol.SpecPolicy._available
if variant == "run-rate" and not hasattr(pol, "GoingRate"):
    sys.exit("run-rate needs run_rate.patch applied")
landed_rate = pol.GoingRate.rate if variant == "run-rate" else None


def set_variant(on: bool) -> None:
    """`auto` without the variant (on=False) or with it."""
    if variant == "available":
        pol.SpecPolicy._available = landed_available if on else (lambda self, k_maxes, requests: k_maxes)
    else:
        pol.GoingRate.rate = landed_rate if on else property(lambda self: None)


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
            set_variant(mode != "auto")  # off and on as landed
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
        per_round = [min(rate(runs[a][r]) / rate(runs[m][r]) for m in ("off", "on")) for r in range(rounds)]
        print(sets, n, a, f"modeled {a}/better fixed {modeled:.3f} measured {measured:.3f}",
              "per round", " ".join(f"{x:.3f}" for x in per_round), flush=True)  # fmt: skip
