"""Speculation policy, priced drafts: a proposer that prices each draft position (suffix
decoding) drafts long where confident, and its prices are calibrated against what the
target accepts."""

from __future__ import annotations

from scheduler.types import Request
from speculation.config import SpecConfig
from speculation.policy import SpecPolicy
from speculation.proposer import Drafting
from tests.speculation.policy_support import decide, linear, req, trained


def priced_policy(previews: dict[str, list[float]], **spec) -> SpecPolicy:
    """A suffix-decoding policy whose proposer prices each row's draft as `previews[request_id]`."""

    def preview(requests: list[Request], ks: list[int]) -> list[list[float]]:
        return [previews[r.request_id][:k] for r, k in zip(requests, ks)]

    policy = SpecPolicy(SpecConfig(num_speculative_tokens=10, **spec), Drafting("suffix", preview=preview))
    policy.cost = trained(linear(0.02, 0.0004, 0.002))
    return policy


def test_priced_drafts_go_long_where_confident_and_nowhere_else_in_one_batch():
    previews = {"copy": [1.0] * 10, "guess": [0.15, 0.2, 0.3], "none": []}
    policy = priced_policy(previews)
    rows = [req(rid) for rid in ("copy", "guess", "none")]
    assert decide(policy, rows) == [10, 0, 0]
    # The budget goes to the most probable positions: a second confident row shares it.
    previews["copy2"] = [1.0, 0.9, 0.9, 0.5, 0.5, 0.3]
    assert decide(policy, rows + [req("copy2")], budget=12) == [10, 0, 0, 2]


def test_priced_gains_are_calibrated_against_observed_acceptance():
    """Frequency 1.0 that the target never confirms stops earning drafts; the calibration
    learns it from verify steps and shadows alike."""
    previews = {"a": [1.0] * 10, "b": [1.0] * 10}
    policy = priced_policy(previews)
    a, b = req("a"), req("b")
    assert decide(policy, [a]) == [10]
    for _ in range(30):
        (k,) = decide(policy, [a])
        policy.observe(a, k, 0) if k else policy.observe_shadow(a, [5] * 10, [6])
    assert policy.estimates.calibration["suffix"].apply([1.0])[0] < 0.2
    assert decide(policy, [b]) == [0]
    assert policy.summary()["acceptance_by_gain"]["suffix"]["1"][1] < 0.2
    # Other proposers keep their per-position estimates: an ngram policy is not affected.
    ngram = SpecPolicy(SpecConfig(num_speculative_tokens=10), Drafting("ngram"))
    ngram.cost = policy.cost
    assert decide(ngram, [req("c")])[0] > 0
