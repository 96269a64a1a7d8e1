"""Helpers shared by the SpecPolicy tests (tests/speculation/test_policy_*.py):
requests, a cost model trained on a known step cost, and a one-call `decide`."""

from __future__ import annotations

from scheduler.types import Request, SamplingParams
from speculation.cost_model import StepCostModel, StepShape
from speculation.policy import SpecPolicy


def req(rid: str, **params) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(max_tokens=100, **params))


def trained(cost_fn, tokens=(1, 2, 4, 8, 16, 24, 32, 48, 64, 96), spec=(False, True), drafts=(0,)) -> StepCostModel:
    """A cost model that has watched steps of every shape cost exactly `cost_fn(shape)`."""
    model = StepCostModel()
    for _ in range(30):
        for t in tokens:
            for s in spec:
                for d in drafts:
                    shape = StepShape(t, 0, s, d)
                    model.observe(shape, cost_fn(shape))
    return model


def linear(a: float, b: float, c: float = 0.0, draft: float = 0.0):
    return lambda s: a + b * s.num_tokens + (c if s.is_spec else 0.0) + draft * s.num_draft_forwards


def decide(policy: SpecPolicy, requests: list[Request], cap: int = 16, budget: int = 256, running=None) -> list[int]:
    ks, _ = policy.decide(requests, [cap] * len(requests), budget, running)
    return ks
