"""Session 26: `auto` with gains calibrated against what drafts at that gain realised (`autoX`,
as landed) against `auto` with each row's gains scaled by its realised share (as before), with
off and on, in the closed loop (`benchmarks.loop_bench.variant_ab`: modes interleaved and
rotated per round, each run priced by one cost model fitted to all runs' steps).

    PYTHONPATH=. .venv/bin/python benchmarks/results/auto-s26/variant_ab.py extraction 4,8 2
"""

import sys

import benchmarks.loop_bench as lb
import scheduler.policy as pol

sets = tuple(sys.argv[1].split(","))
levels, rounds = [int(x) for x in sys.argv[2].split(",")], int(sys.argv[3])
landed = pol.SpecPolicy._gain_calibration


def set_variant(mode: str) -> None:
    """`auto` without the calibration; every other mode (autoX, off, on) as landed, with it."""
    pol.SpecPolicy._gain_calibration = landed if mode != "auto" else (lambda self, state: None)


lb.variant_ab(sets, levels, rounds, set_variant)
