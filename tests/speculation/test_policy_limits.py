"""Speculation policy, what bounds a plan: request modes, the operator's cap, the token
budget, client predictions, the drafts the proposer has now, and the reason a plain step
gives for its auto rows."""

from __future__ import annotations

import pytest

from scheduler.types import Request
from speculation.config import SpecConfig
from speculation.cost_model import StepShape
from speculation.policy import SpecPolicy
from speculation.proposer import Drafting
from tests.speculation.policy_support import decide, linear, req, trained


def test_modes_cap_and_no_proposer():
    policy = SpecPolicy(SpecConfig(num_speculative_tokens=4, spec_disable_batch_size=1), Drafting("ngram"))
    assert decide(policy, [req("a")]) == [4]
    two = [req("b"), req("c", speculation=True, num_speculative_tokens=2)]
    assert decide(policy, two) == [0, 2]  # 2 running > cap 1: auto runs plain, forced still drafts
    assert decide(policy, [req("a2")], running=2) == [0]  # the cap counts running requests, not rows
    assert decide(policy, [req("d", speculation=False)]) == [0]
    assert decide(policy, [req("e")], cap=1) == [1]  # length cap
    off = SpecPolicy(SpecConfig(spec_disable_batch_size=0), Drafting("ngram"))
    assert decide(off, [req("f")]) == [0]
    none = SpecPolicy(SpecConfig(), Drafting("none"))
    assert decide(none, [req("g")]) == [0]
    with_prediction = req("h")
    with_prediction.prediction_ids = [5, 6, 7]
    assert decide(none, [with_prediction])[0] > 0


def test_budget_bounds_drafts():
    policy = SpecPolicy(SpecConfig(num_speculative_tokens=8), Drafting("ngram"))
    forced = [req(f"r{i}", speculation=True) for i in range(3)]
    assert sum(decide(policy, forced, budget=10)) == 10


def test_a_prediction_is_used_whenever_the_operator_allows():
    """Predicted Outputs are the client's own draft: used even where the cost
    model would not draft, but not past the operator's cap or `speculation: false`."""
    costly = trained(linear(0.1, 5.0))
    policy = SpecPolicy(SpecConfig(num_speculative_tokens=6, spec_disable_batch_size=2), Drafting("ngram"), cost=costly)
    predicted, plain = req("p"), req("q")
    predicted.prediction_ids = [1, 2, 3]
    refused = req("r", speculation=False)
    refused.prediction_ids = [1, 2, 3]
    assert decide(policy, [plain]) == [0]  # drafting does not pay here
    assert decide(policy, [predicted, refused]) == [6, 0]
    assert decide(policy, [predicted, refused], running=3) == [0, 0]  # over the cap


def test_rows_plan_only_the_drafts_their_host_proposer_has_now():
    """With n-gram lookup, what a row can draft is known before the step: a row whose index
    matches nothing plans no draft (in `auto` and `on` alike), and one with a short match plans
    no more than it; the plan's predicted time is the step's with those drafts alone."""
    lengths = {"copy": 10, "short": 3, "none": 0}
    asked: list[str] = []

    def available(requests: list[Request], ks: list[int]) -> list[int]:
        asked.extend(r.request_id for r in requests)
        return [min(lengths.get(r.request_id, 10), k) for r, k in zip(requests, ks)]

    cost = trained(linear(0.05, 0.0005))
    policy = SpecPolicy(SpecConfig(num_speculative_tokens=10), Drafting("ngram", available=available), cost=cost)
    rows = [req(rid) for rid in lengths]
    for _ in range(20):
        for r in rows:
            policy.observe(r, 10, 10)  # every row copies whenever it has a draft
    ks, plan = policy.decide(rows, [16] * 3, 256)
    assert ks == [10, 3, 0]
    assert plan.predicted_seconds == pytest.approx(cost.predict(StepShape(3 + 13, is_spec=True)), rel=0.05)
    forced = [req(rid, speculation=True) for rid in lengths]
    assert decide(policy, forced) == [10, 3, 0]
    blind = SpecPolicy(SpecConfig(num_speculative_tokens=10), Drafting("ngram"), cost=cost)
    assert decide(blind, forced) == [10, 10, 10]  # a runner that cannot tell: as asked
    # Over the operator's cap auto rows run plain: their drafts are not looked up at all.
    drafting = Drafting("ngram", available=available)
    capped = SpecPolicy(SpecConfig(num_speculative_tokens=10, spec_disable_batch_size=1), drafting, cost=cost)
    asked.clear()
    assert decide(capped, rows + [req("forced", speculation=True)]) == [0, 0, 0, 10]
    assert asked == ["forced"]


def test_a_plain_step_says_why_its_auto_rows_did_not_draft():
    """Each plain step with auto rows is counted under one reason, for /metrics and
    /v1/speculation; a step that verifies (a forced row drafts) has none."""
    cost = trained(linear(0.040, 0.001, 0.03))  # a verify step's fixed price: weak drafts lose
    lengths = {"copy": 4}

    def available(requests: list[Request], ks: list[int]) -> list[int]:
        return [min(lengths.get(r.request_id, 0), k) for r, k in zip(requests, ks)]

    def reason(policy: SpecPolicy, rows: list[Request], budget: int = 256, running=None) -> str | None:
        ks, plan = policy.decide(rows, [16] * len(rows), budget, running)
        assert (plan.plain_reason is None) == any(ks)
        return plan.plain_reason

    drafting = Drafting("ngram", available=available)
    policy = SpecPolicy(SpecConfig(num_speculative_tokens=4, spec_disable_batch_size=8), drafting, cost=cost)
    batch = [req(f"r{i}") for i in range(7)] + [req("copy")]
    for r in batch:
        for _ in range(5):
            policy.observe(r, 4, 1)
    idle = batch[:-1]
    assert reason(policy, idle) == "no_draft"  # their n-gram index matches nothing
    assert reason(policy, batch, running=9) == "cap"
    assert reason(policy, batch, budget=0) == "budget"
    assert reason(policy, batch) == "no_gain"  # one row's draft does not pay the verify step's price
    lengths.update({r.request_id: 4 for r in idle})
    assert reason(policy, batch) is None  # eight rows' drafts do (edge 1.11)
    policy.cost = trained(linear(0.040, 0.001, 0.037))  # a dearer verify: eight rows' drafts gain < 5%
    assert reason(policy, batch) == "margin"
    policy.cost = cost
    lengths["forced"] = 4
    assert reason(policy, idle + [req("forced", speculation=True)]) is None
    assert policy.plain_steps == {"cap": 1, "no_draft": 1, "budget": 1, "no_gain": 1, "margin": 1, "explore": 0}
    assert policy.summary()["plain_steps"] == policy.plain_steps
