"""Session 24: do `auto`'s plans expect what its verifies accept? One closed-loop `auto` run
(benchmarks.loop_bench internals, n-gram, lengths 64 x [0.5, 1.5], bf16 by --dtype auto) with
SpecPolicy.observe wrapped to log, for every verify the policy planned, the gains it planned
per position (before the row's realised share) and how many drafts were accepted.

    PYTHONPATH=. .venv/bin/python benchmarks/results/auto-s24/plan_calibration.py 8 extraction
    SHARE=off PYTHONPATH=. .venv/bin/python benchmarks/results/auto-s24/plan_calibration.py 8 creative

SHARE=off runs the variant without the realised share (every row's share 1).
"""

import collections
import os
import sys

import scheduler.policy as pol
from benchmarks.loop_bench import LoopConfig, _prompts, _run
from models.builder import ProposerConfig, build_runner
from models.loader import ModelConfig, load_model
from models.runner import RunnerConfig

log: list[tuple[list[float], int, int, float]] = []  # planned gains, drafted, accepted, share
observe = pol.SpecPolicy.observe


def logged_observe(self, request, num_drafted, num_accepted, method=None):
    state = self._state_for(request, method == pol.LOOKUP_METHOD and self.uses_lookup(request))
    if state.plan_gains and request.params.speculation == "auto":
        log.append((list(state.plan_gains), num_drafted, num_accepted, self._realised_share(state)))
    return observe(self, request, num_drafted, num_accepted, method)


pol.SpecPolicy.observe = logged_observe
if os.environ.get("SHARE") == "off":
    pol.SpecPolicy._realised_share = lambda self, state: 1.0

n, sets = int(sys.argv[1]), tuple(sys.argv[2].split(","))
target = load_model(ModelConfig(None, dtype="auto", device="cpu"))
cfg = LoopConfig(sets=sets, batch_sizes=(n,), rounds=1, length_range_ratio=0.5)
runner = build_runner(target, RunnerConfig(max_num_seqs=n, max_model_len=4096), ProposerConfig("ngram"))
result = _run(runner, target, _prompts(target, sets, 2 * n), n, "auto", cfg)
print(f"auto {result['tps']:.1f} tok/s, {result['steps']} steps, {result['drafted']} drafted, "
      f"{result['accepted']} accepted")  # fmt: skip
expected, accepted, count = collections.Counter(), collections.Counter(), collections.Counter()
for gains, drafted, num_accepted, _ in log:
    for j in range(min(drafted, len(gains))):
        expected[j] += gains[j]
        accepted[j] += j < num_accepted
        count[j] += 1
for j in sorted(count):
    print(f"position {j + 1:2d}: drafted {count[j]:4d}, expected {expected[j] / count[j]:.3f} (before the share), "
          f"accepted {accepted[j] / count[j]:.3f}")  # fmt: skip
after_share = sum(sum(gains[:drafted]) * share for gains, drafted, _, share in log)
print(f"{len(log)} planned verifies; mean share {sum(s for *_, s in log) / len(log):.3f}; extra tokens expected "
      f"after the share {after_share:.0f}, accepted {sum(a for _, _, a, _ in log)}")  # fmt: skip
