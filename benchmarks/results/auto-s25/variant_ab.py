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

import sys

import benchmarks.loop_bench as lb
import scheduler.policy as pol

variant, sets = sys.argv[1], tuple(sys.argv[2].split(","))
levels, rounds = [int(x) for x in sys.argv[3].split(",")], int(sys.argv[4])
if variant not in ("available", "run-rate"):
    sys.exit(f"unknown variant {variant} (available, run-rate)")
landed_available = pol.SpecPolicy._available
if variant == "run-rate" and not hasattr(pol, "GoingRate"):
    sys.exit("run-rate needs run_rate.patch applied")
landed_rate = pol.GoingRate.rate if variant == "run-rate" else None


def set_variant(mode: str) -> None:
    """`auto` without the variant; every other mode (autoX, off, on) as landed, with it."""
    on = mode != "auto"
    if variant == "available":
        pol.SpecPolicy._available = landed_available if on else (lambda self, k_maxes, *args: k_maxes)
    else:
        pol.GoingRate.rate = landed_rate if on else property(lambda self: None)


lb.variant_ab(sets, levels, rounds, set_variant)
