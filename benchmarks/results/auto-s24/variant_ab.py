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

import sys

import benchmarks.loop_bench as lb
import scheduler.policy as pol

variant, sets = sys.argv[1], tuple(sys.argv[2].split(","))
levels, rounds = [int(x) for x in sys.argv[3].split(",")], int(sys.argv[4])
if variant not in ("share-off", "longer-drafts"):
    sys.exit(f"unknown variant {variant} (share-off, longer-drafts)")
landed_share = pol.SpecPolicy._realised_share


def set_variant(mode: str) -> None:
    """The variant for autoX's runs, the landed policy for the others."""
    on = mode == "autoX"
    if variant == "share-off":
        pol.SpecPolicy._realised_share = (lambda self, state: 1.0) if on else landed_share
    else:
        pol.EXPLORE_DRAFT_LOSS = 0.2 if on else 0.0  # exists once longer_drafts.patch is applied


lb.variant_ab(sets, levels, rounds, set_variant)
