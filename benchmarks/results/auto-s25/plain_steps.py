"""Session 25: why `auto` runs plain in steps where rows have drafts (closed loop, one `auto`
run after an `on` and an `off` run to warm the machine). For every step whose rows have
candidate drafts, the best plan's edge over the plain step is computed once more with the
margin and exploration off, and the step is classed by what the policy then did:

    spec      it verified
    no-edge   no plan beat the plain step (edge <= 1)
    margin    a plan beat it, but by no more than the required edge
    explore   a plan beat it by the margin, but the step ran plain to measure a plain step

It also prints how far the cost model priced the plain steps of a size it had not seen lately
(explored or not) from their measured time.

    PYTHONPATH=. .venv/bin/python benchmarks/results/auto-s25/plain_steps.py extraction 8
"""

import statistics
import sys
from collections import Counter

import benchmarks.loop_bench as lb
import scheduler.policy as pol

sets, n = tuple(sys.argv[1].split(",")), int(sys.argv[2])
landed_choose = pol.SpecPolicy._choose
log: list[dict] = []


def choose(self, requests, candidates, ks, budget, prefill, lookup_rows=frozenset()):
    if not candidates:
        return landed_choose(self, requests, candidates, ks, budget, prefill, lookup_rows)
    margin = self.required_edge()
    explore_margin, required = pol.EXPLORE_MARGIN, pol.SpecPolicy.required_edge
    pol.EXPLORE_MARGIN, pol.SpecPolicy.required_edge = 0.0, lambda policy: -1.0
    try:  # the unconstrained best plan (its per-row gains are overwritten by the real call)
        free = landed_choose(self, requests, candidates, list(ks), budget, prefill, lookup_rows)
    finally:
        pol.EXPLORE_MARGIN, pol.SpecPolicy.required_edge = explore_margin, required
    explored = self.num_explored
    plan = landed_choose(self, requests, candidates, ks, budget, prefill, lookup_rows)
    if any(ks):
        kind = "spec"
    elif free.edge <= 1.0:
        kind = "no-edge"
    elif self.num_explored > explored or free.edge > 1.0 + margin:
        kind = "explore"
    else:
        kind = "margin"
    rows_with = len({i for _, i in candidates})
    log.append({"kind": kind, "rows": len(requests), "rows_with": rows_with, "edge": free.edge, "margin": margin})
    return plan


# Plain steps of a size the model had not seen lately: how far it priced them from their time.
unseen: list[tuple[float, float]] = []  # (predicted, measured)
landed_observe = pol.SpecPolicy.observe_step


def observe_step(self, shape, seconds, plan, emitted):
    if not shape.is_spec and self.cost.is_fitted and self.cost.plain_support(shape.num_tokens) < pol.EXPLORE_BELOW:
        unseen.append((self.cost.predict(shape), seconds))
    landed_observe(self, shape, seconds, plan, emitted)


def instrument(runner) -> None:
    pol.SpecPolicy._choose = choose
    pol.SpecPolicy.observe_step = observe_step


lb.instrumented_auto_run(sets, n, instrument)
kinds = Counter(x["kind"] for x in log)
print("steps with candidate drafts", len(log), dict(kinds))
for kind in ("spec", "no-edge", "margin", "explore"):
    xs = [x for x in log if x["kind"] == kind]
    if xs:
        print(f"{kind:8s} steps {len(xs):4d}  rows {statistics.mean(x['rows'] for x in xs):.1f}"
              f"  rows with drafts {statistics.mean(x['rows_with'] for x in xs):.1f}"
              f"  best edge median {statistics.median(x['edge'] for x in xs):.3f}"
              f"  required margin median {statistics.median(x['margin'] for x in xs):.3f}")  # fmt: skip
ratios = sorted(p / m for p, m in unseen)
if ratios:
    print(f"unseen plain steps {len(ratios)}: predicted / measured median {statistics.median(ratios):.3f}"
          f" min {ratios[0]:.3f} max {ratios[-1]:.3f}")  # fmt: skip
