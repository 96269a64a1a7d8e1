"""Speculation policy: threshold, per-request modes, adaptive K that recovers."""

from __future__ import annotations

import pytest

from scheduler.policy import SpecConfig, SpecPolicy, StepCostModel
from scheduler.types import Request, SamplingParams


def req(rid: str, **params) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(max_tokens=100, **params))


def run(policy: SpecPolicy, request: Request, steps: int, acceptance: float) -> list[int]:
    """Drive the policy with a proposer whose drafts are accepted with probability `acceptance`
    (deterministically: the accepted prefix is the expected one, rounded)."""
    ks = []
    for _ in range(steps):
        (k,) = policy.decide([request], [16], budget=64)
        ks.append(k)
        if k:
            accepted = 0
            p = 1.0
            for _ in range(k):
                p *= acceptance
                if p < 0.5:
                    break
                accepted += 1
            policy.observe(request, k, accepted)
    return ks


def test_adaptive_k_drops_to_zero_and_recovers():
    policy = SpecPolicy(SpecConfig(num_speculative_tokens=8, probe_interval=4), has_proposer=True)
    r = req("a")
    ks = run(policy, r, 40, acceptance=0.0)
    assert ks[0] > 0  # starts optimistic (prior)
    assert ks[-12:].count(0) >= 9  # mostly plain: only occasional 1-token probes
    assert max(ks[-12:]) <= 1
    ks = run(policy, r, 60, acceptance=0.95)
    assert ks[-1] >= 6  # the probes saw acceptance again: long drafts are back


def test_cost_model_weighs_batch_step_cost():
    """The same acceptance buys long drafts when verify is cheap and none when it is expensive."""
    cheap = SpecPolicy(SpecConfig(num_speculative_tokens=8), has_proposer=True, cost=StepCostModel(a=1.0, b=0.01))
    costly = SpecPolicy(SpecConfig(num_speculative_tokens=8), has_proposer=True, cost=StepCostModel(a=1.0, b=5.0))
    batch = [req(f"r{i}") for i in range(4)]
    for policy in (cheap, costly):
        for r in batch:
            policy.observe(r, 4, 2)  # alpha ~ 0.6
    assert sum(cheap.decide(batch, [16] * 4, budget=64)) >= 8
    assert sum(costly.decide(batch, [16] * 4, budget=64)) == 0
    # A slow draft model makes every draft position cost more than it returns.
    slow_draft = SpecPolicy(SpecConfig(num_speculative_tokens=8), has_proposer=True, cost=StepCostModel(a=1.0, b=0.01))
    for _ in range(200):
        slow_draft.cost.observe_draft(4, 4 * 0.5)
    for r in batch:
        slow_draft.observe(r, 4, 2)
    assert sum(slow_draft.decide(batch, [16] * 4, budget=64)) == 0


def test_cost_model_fits_tokens_and_the_fixed_cost_of_speculating():
    cost = StepCostModel()
    for _ in range(200):
        for tokens, is_spec in ((1, False), (4, True), (8, False), (16, True)):
            cost.observe(tokens, 0.010 + 0.002 * tokens + (0.003 if is_spec else 0.0), is_spec)
    assert cost.a == pytest.approx(0.010, rel=0.02)
    assert cost.b == pytest.approx(0.002, rel=0.02)
    assert cost.c == pytest.approx(0.003, rel=0.05)
    # A batch that never changes size still gives a usable (prior-shaped) model.
    flat = StepCostModel()
    for _ in range(100):
        flat.observe(8, 0.040)
    assert flat.a > 0 and 0 < flat.b < 0.040 / 8 and flat.a + 8 * flat.b == pytest.approx(0.040, rel=0.01)


def test_fixed_spec_cost_keeps_weak_drafts_off():
    """Drafts that pay per token can still lose to the fixed cost of a verify step."""
    batch = [req(f"r{i}") for i in range(8)]
    policy = SpecPolicy(SpecConfig(num_speculative_tokens=4), has_proposer=True,
                        cost=StepCostModel(a=0.040, b=0.001, c=0.0))  # fmt: skip
    for r in batch:
        policy.observe(r, 4, 1)
        for _ in range(3):
            policy.observe(r, 4, 0)
    assert 0.1 < policy.acceptance("r0") < 0.3
    assert sum(policy.decide(batch, [16] * 8, budget=64)) > 0
    policy.cost.c = 0.006
    assert sum(policy.decide(batch, [16] * 8, budget=64)) == 0


def test_modes_threshold_and_no_proposer():
    policy = SpecPolicy(SpecConfig(num_speculative_tokens=4, spec_disable_batch_size=1), has_proposer=True)
    assert policy.decide([req("a")], [16], 64) == [4]
    two = [req("b"), req("c", speculation=True, num_speculative_tokens=2)]
    assert policy.decide(two, [16, 16], 64) == [0, 2]
    assert policy.decide([req("d", speculation=False)], [16], 64) == [0]
    assert policy.decide([req("e")], [1], 64) == [1]  # length cap
    off = SpecPolicy(SpecConfig(spec_disable_batch_size=0), has_proposer=True)
    assert off.decide([req("f")], [16], 64) == [0]
    none = SpecPolicy(SpecConfig(), has_proposer=False)
    assert none.decide([req("g")], [16], 64) == [0]
    with_prediction = req("h")
    with_prediction.prediction_ids = [5, 6, 7]
    assert none.decide([with_prediction], [16], 64)[0] > 0


def test_budget_bounds_drafts():
    policy = SpecPolicy(SpecConfig(num_speculative_tokens=8), has_proposer=True)
    forced = [req(f"r{i}", speculation=True) for i in range(3)]
    assert sum(policy.decide(forced, [16] * 3, budget=10)) == 10


def test_copy_runs_earn_long_drafts():
    """Prompt lookup on a copy task: the first draft is a coin flip, but once a
    copy starts it continues. Per-position rates see that; one per-token rate
    (0.4 ** k) would stop at a few tokens."""
    policy = SpecPolicy(SpecConfig(num_speculative_tokens=10), has_proposer=True, cost=StepCostModel(a=1.0, b=0.01))
    r = req("copy")
    for step in range(40):
        policy.observe(r, 10, 10 if step % 5 < 2 else 0)  # 40%: all ten accepted; 60%: none
    (k,) = policy.decide([r], [16], budget=64)
    assert k == 10
