"""Session 26: what the drafts `auto` weighed were worth (closed loop, one `auto` run after an
`on` and an `off` run to warm the machine).

At every step with auto rows, each row's n-gram draft (what the index holds now, up to K) and
the gains the policy priced its positions at are recorded, with the step's outcome (verified,
or the plain step's reason). Greedy decoding is lossless, so once the run is over each request's
output says how many of those draft tokens the target would have accepted: the leading tokens
that match what the row emitted from that position. Per outcome and per context of the row's
previous draft (accepted to its end, or not), the table compares the tokens the policy expected
the whole draft to add (the sum of its gains) with the tokens it would have added.

    PYTHONPATH=. .venv/bin/python benchmarks/results/auto-s26/draft_value.py extraction 4

The "before" logs ran at bf6c88d, before the gains were calibrated; with the calibration the
gains recorded (and "expected") are the calibrated ones.
"""

import statistics
import sys
from collections import defaultdict

import benchmarks.loop_bench as lb
import scheduler.policy as pol

sets, n = tuple(sys.argv[1].split(",")), int(sys.argv[2])
records: list[dict] = []
landed_decide = pol.SpecPolicy.decide


def decide(self, requests, caps, budget, num_running=None, prefill=pol.NO_PREFILL):
    rows = [i for i, r in enumerate(requests) if r.params.speculation not in (True, False)]
    drafts = runner.proposer.propose([requests[i] for i in rows], [min(self.k_max(requests[i]), caps[i]) for i in rows])
    priced = {}
    for i, draft in zip(rows, drafts):
        if draft.token_ids:
            state = self._state_for(requests[i])
            rates = self._rates(state, len(draft.token_ids))
            priced[i] = (list(draft.token_ids), self._gains(state, rates), state.after_full)
    ks, plan = landed_decide(self, requests, caps, budget, num_running, prefill)
    outcome = "spec" if any(ks) else plan.plain_reason or "plain"
    for i, (tokens, gains, after_full) in priced.items():
        records.append({"request": requests[i], "at": len(requests[i].output_ids), "tokens": tokens,
                        "gains": gains, "after_full": after_full, "outcome": outcome, "k": ks[i],
                        "rows": len(requests)})  # fmt: skip
    return ks, plan


def instrument(loop_runner) -> None:
    global runner
    runner = loop_runner
    pol.SpecPolicy.decide = decide


runner = None
lb.instrumented_auto_run(sets, n, instrument)


def would_accept(rec: dict) -> int:
    """How many of the recorded draft's tokens the target would have accepted: those that match,
    from the first, what the row went on to emit."""
    out = rec["request"].output_ids[rec["at"] :]
    return next((j for j, (d, o) in enumerate(zip(rec["tokens"], out)) if d != o), min(len(rec["tokens"]), len(out)))


groups: dict[tuple[str, bool], list[tuple[float, int, int, int]]] = defaultdict(list)
for rec in records:
    row = (sum(rec["gains"]), would_accept(rec), len(rec["tokens"]), rec["rows"])
    groups[(rec["outcome"], rec["after_full"])].append(row)
print(f"{'outcome':9s} {'after':6s} {'drafts':>6s} {'rows':>5s} {'length':>6s} {'expected':>8s} {'worth':>6s}"
      f" {'worth/exp':>9s} {'any accepted':>12s}")  # fmt: skip
for (outcome, after_full), xs in sorted(groups.items()):
    expected, worth = sum(x[0] for x in xs), sum(x[1] for x in xs)
    print(f"{outcome:9s} {'full' if after_full else 'miss':6s} {len(xs):6d} {statistics.mean(x[3] for x in xs):5.1f}"
          f" {statistics.mean(x[2] for x in xs):6.1f} {expected / len(xs):8.2f} {worth / len(xs):6.2f}"
          f" {worth / max(expected, 1e-9):9.2f} {sum(x[1] > 0 for x in xs) / len(xs):12.2f}")  # fmt: skip

# Calibration of the gains: a draft position priced at g (the chance it is accepted, every earlier
# one with it) against how often it would have been, over every recorded draft.
edges = (0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.01)
bins: dict[int, list[float]] = defaultdict(lambda: [0, 0.0, 0])  # positions, sum of g, accepted
for rec in records:
    accepted = would_accept(rec)
    for j, g in enumerate(rec["gains"][: len(rec["request"].output_ids) - rec["at"]]):
        b = next(b for b, edge in enumerate(edges) if g < edge)
        bins[b][0] += 1
        bins[b][1] += g
        bins[b][2] += j < accepted
print(f"\n{'g below':>8s} {'positions':>9s} {'mean g':>7s} {'accepted':>8s}")
for b in sorted(bins):
    count, total, accepted = bins[b]
    print(f"{edges[b]:8.2f} {count:9d} {total / count:7.3f} {accepted / count:8.3f}")
