"""Session 24: `auto` as landed against `autoX`, the same policy with one variant, with off and
on, in the closed loop (benchmarks.loop_bench internals: modes interleaved and rotated per
round, each run priced by one cost model fitted to all runs' steps, so the "modeled" ratios do
not drift with the machine). Variants:

    share-off      no realised share: every row's share is 1
    longer-drafts  a longer draft than planned, once per unseen step-size bucket; apply the patch
                   first: `git apply benchmarks/results/auto-s24/longer_drafts.patch`

    PYTHONPATH=. .venv/bin/python benchmarks/results/auto-s24/variant_ab.py share-off extraction 4,8 2
    PYTHONPATH=. .venv/bin/python benchmarks/results/auto-s24/variant_ab.py longer-drafts extraction,creative 4,8 2
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
if variant not in ("share-off", "longer-drafts"):
    sys.exit(f"unknown variant {variant} (share-off, longer-drafts)")
modes = ["off", "on", "auto", "autoX"]
lb.MODES["autoX"] = "auto"
landed_share = pol.SpecPolicy._realised_share


def set_variant(on: bool) -> None:
    """Switch the policy to the variant (on) or back to the landed policy."""
    if variant == "share-off":
        pol.SpecPolicy._realised_share = (lambda self, state: 1.0) if on else landed_share
    else:
        pol.EXPLORE_DRAFT_LOSS = 0.2 if on else 0.0  # exists once longer_drafts.patch is applied


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
            set_variant(mode == "autoX")
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
