"""Session 24: the realised share on a synthetic row that copies in random stretches. A copy
goes on token by token with probability STAY; after a miss it resumes at once half the time.
Plain steps grade a shadow draft on whether the row is copying. Prints the extra tokens the
verify plans expected over those accepted, with the share as landed and with it off.

    PYTHONPATH=. .venv/bin/python benchmarks/results/auto-s24/share_synthetic.py
"""

import random

import scheduler.policy as pol
from scheduler.policy import SpecConfig, SpecPolicy
from tests.scheduler.test_policy import linear, req, trained

landed = pol.SpecPolicy._realised_share
for variant in ("as landed", "share off"):
    pol.SpecPolicy._realised_share = landed if variant == "as landed" else (lambda self, state: 1.0)
    for stay in (0.7, 0.85, 0.95):
        for seed in range(2):
            rng = random.Random(seed)
            policy = SpecPolicy(SpecConfig(num_speculative_tokens=8), "ngram", cost=trained(linear(0.05, 0.002)))
            row = req("copier")
            expected = accepted = 0.0
            copying = True
            for step in range(600):
                (k,), plan = policy.decide([row], [16], 256)
                if not k:
                    policy.observe_shadow(row, [5] * 8, [5 if copying else 6])
                    copying = rng.random() < (stay if copying else 0.5)
                    continue
                n = 0
                while n < k and copying:
                    n += 1
                    copying = rng.random() < stay
                if n < k:
                    copying = rng.random() < 0.5
                policy.observe(row, k, n)
                if step >= 50:  # past the row's first estimates
                    expected += plan.expected_tokens - 1.0
                    accepted += n
            print(f"{variant}: stay {stay}, seed {seed}: expected / accepted {expected / accepted:.3f}")
