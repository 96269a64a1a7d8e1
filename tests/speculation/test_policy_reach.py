"""How far a device proposer's drafts run (`draft_pricing.DraftReach`): a draft model that ends a
row's draft after a token it doubts skips the forwards, rows and verify tokens of the positions it
did not draft, and gains nothing there; the policy prices a planned position at its reach."""

from __future__ import annotations

import pytest

from speculation.config import SpecConfig
from speculation.cost_model import StepShape
from speculation.draft_pricing import DraftReach
from speculation.policy import SpecPolicy
from speculation.proposer import Drafting
from tests.speculation.policy_support import req, trained

PLAIN, TOKEN, FORWARD = 0.05, 0.001, 0.01  # seconds: a plain step, a verify token, a draft forward


def test_drafts_that_run_their_length_keep_a_reach_of_one():
    reach = DraftReach()
    assert reach.of(4) == [1.0] * 4  # the prior: a planned position is drafted
    for _ in range(50):
        reach.observe(4, 4)
    assert reach.of(4) == [1.0] * 4


def test_drafts_that_end_early_lower_the_reach_of_the_positions_they_skip():
    reach = DraftReach()
    for _ in range(60):
        reach.observe(4, 2)
    first, second, third, fourth = reach.of(4)
    assert first == second == 1.0
    assert third == fourth < 0.1
    for _ in range(60):  # half of them now run their length
        reach.observe(4, 2)
        reach.observe(4, 4)
    assert reach.at(2) == pytest.approx(0.5, abs=0.05)
    assert reach.at(9) == 1.0  # never planned: the prior


def policy() -> SpecPolicy:
    """A draft-model policy on a machine that measured plain and verify steps and the draft's
    forwards: PLAIN a step, TOKEN a verify token, FORWARD a forward."""
    cost = trained(lambda s: PLAIN + TOKEN * (s.num_tokens - 1) + FORWARD * s.num_draft_forwards, drafts=(0, 1, 2, 4))
    return SpecPolicy(SpecConfig(num_speculative_tokens=4), Drafting("draft_model"), cost=cost)


def plan_of(p: SpecPolicy, request) -> tuple[list[int], float, float]:
    ks, plan = p.decide([request], [4], 64)
    return ks, plan.expected_tokens, plan.predicted_seconds


def test_a_plan_is_priced_and_credited_at_the_positions_its_drafts_reach():
    """Two rows whose drafted tokens are all accepted; one's drafts run their length, the
    other's end after their first token. The second's plan of four positions is priced at about
    one forward and one verify token, and credited with about one token more: not four forwards
    for tokens the draft would never make."""
    full, ended = policy(), policy()
    full_row, ended_row = req("a"), req("b")
    for p, r, longest in ((full, full_row, 4), (ended, ended_row, 1)):
        for _ in range(60):
            ks, _, _ = plan_of(p, r)
            drafted = min(ks[0], longest)
            if drafted:
                p.observe(r, drafted, drafted, num_asked=ks[0])
    ks, full_expected, full_seconds = plan_of(full, full_row)
    assert ks == [4]
    assert full_expected > 4.5
    assert full_seconds == pytest.approx(full.cost.predict(StepShape(5, 5, True, 4, num_logits=5)), rel=0.05)
    ks, expected, seconds = plan_of(ended, ended_row)
    assert ks[0] >= 1  # the runner drafts until the draft doubts a token, up to ks
    assert expected == pytest.approx(2.0, abs=0.15)
    assert seconds == pytest.approx(ended.cost.predict(StepShape(2, 2, True, 1, num_logits=2)), rel=0.05)


def test_a_plan_graded_after_its_draft_ended_early_counts_the_skipped_positions_as_not_gained():
    """A position the draft never made gained nothing: the row's rate there (the chance it is
    drafted and accepted) and the gain calibration, which grades every planned position, count
    it as a miss; the positions the draft made count as they went."""
    p = policy()
    r = req("c")
    plan_of(p, r)
    planned = len(p.row(r).planned)
    assert planned >= 2
    p.observe(r, 1, 1, num_asked=planned)
    counts = p.row(r).counts
    assert (counts.reached[0], counts.accepted[0]) == (1.0, 1.0)
    assert (counts.reached[1], counts.accepted[1]) == (1.0, 0.0)  # reached (all before accepted), not made
    calibration = p.estimates.calibration["draft_model"]
    assert sum(calibration.count) == pytest.approx(planned)
    assert sum(calibration.accepted) == pytest.approx(1.0)
    # One draft that made one token of those planned, beside the prior's one that made them all.
    assert p.reach.of(planned) == [1.0] + [pytest.approx(0.5)] * (planned - 1)
