"""Speculation policy, deciding K: the learned step cost weighs drafts against a verify
step's price, a plan must beat the plain step by the required edge, and odd fits, prefill
chunks and unmeasured plain steps do not mislead it."""

from __future__ import annotations

import pytest

from speculation.config import SpecConfig
from speculation.cost_model import StepShape
from speculation.policy import SpecPolicy
from speculation.proposer import Drafting
from tests.speculation.policy_support import decide, linear, req, trained


def test_cost_model_weighs_the_steps_real_cost():
    """The same acceptance buys long drafts when verify is cheap and none when it is expensive."""
    cheap = SpecPolicy(SpecConfig(num_speculative_tokens=8), Drafting("ngram"), cost=trained(linear(1.0, 0.01)))
    costly = SpecPolicy(SpecConfig(num_speculative_tokens=8), Drafting("ngram"), cost=trained(linear(0.1, 5.0)))
    batch = [req(f"r{i}") for i in range(4)]
    for policy in (cheap, costly):
        for r in batch:
            policy.observe(r, 4, 2)  # alpha ~ 0.6
    assert sum(decide(cheap, batch)) >= 8
    assert sum(decide(costly, batch)) == 0
    # A draft model's forward serves every row's draft at that position: at half a plain
    # step it pays for the four rows together; at three plain steps it does not.
    for forward, drafts in ((0.5, True), (3.0, False)):
        model = trained(linear(1.0, 0.01, draft=forward), drafts=(0, 1, 2, 4))
        draft_model = SpecPolicy(SpecConfig(num_speculative_tokens=8), Drafting("draft_model"), cost=model)
        for r in batch:
            draft_model.observe(r, 4, 2)
        assert (sum(decide(draft_model, batch)) > 0) == drafts


def test_fixed_spec_cost_keeps_weak_drafts_off():
    """Drafts that pay per token can still lose to the fixed cost of a verify step."""
    batch = [req(f"r{i}") for i in range(8)]
    policies = {
        c: SpecPolicy(
            SpecConfig(num_speculative_tokens=4), Drafting("draft_model"), cost=trained(linear(0.040, 0.001, c))
        )
        for c in (0.0, 0.012)
    }
    for policy in policies.values():
        for r in batch:
            policy.observe(r, 4, 1)
            policy.observe(r, 4, 0)
    assert 0.3 < policies[0.0].acceptance("r0") < 0.5
    assert sum(decide(policies[0.0], batch)) > 0
    assert sum(decide(policies[0.012], batch)) == 0


def test_a_draft_whose_first_token_is_dear_and_the_rest_cheap_is_taken_whole():
    """A step's cost that jumps from one token to two and then stays flat (an
    AVX2 CPU in float32: matrix-vector products at one token, a slower kernel
    from two): no single first token pays at batch 1, a 6-token draft does."""

    def jump(s: StepShape) -> float:
        return 0.1 + (0.08 if s.num_tokens >= 2 else 0.0) + 0.001 * s.num_tokens

    policy = SpecPolicy(
        SpecConfig(num_speculative_tokens=8), Drafting("ngram"), cost=trained(jump, tokens=(1, 2, 3, 4, 6, 8, 9))
    )
    row = req("r0")
    for _ in range(4):
        policy.observe(row, 8, 5)  # ~0.8 per position
    ks, plan = policy.decide([row], [16], 256)
    assert ks[0] >= 6 and plan.edge > 1.2


def test_a_fit_that_prices_the_step_at_zero_does_not_stop_the_engine():
    """Early in a run the fit can predict 0 s for a small step (its level is free to go
    there): the policy still plans, it does not divide by the step's time."""
    cost = trained(linear(0.05, 0.002))
    cost.coef = cost.coef * 0.0  # what such a fit predicts for every shape
    policy = SpecPolicy(SpecConfig(num_speculative_tokens=4), Drafting("ngram"), cost=cost)
    batch = [req(f"r{i}") for i in range(3)]
    ks, plan = policy.decide(batch, [16] * 3, 256)
    assert len(ks) == 3 and plan.expected_tokens >= 3


def test_a_verify_step_must_beat_the_plain_step_by_the_required_edge_however_steps_scatter():
    """Eight rows worth a draft each against a verify step's fixed price: a plan 5.3% ahead of
    the plain step runs, one ~3% ahead runs plain (`margin`), and step times that scatter 40%
    either way (a loaded machine) do not raise the bar."""
    from speculation.policy import REQUIRED_EDGE, StepPlan

    def plan_for(spec_cost: float, scatter: float = 0.0) -> StepPlan:
        fn = linear(0.040, 0.001, spec_cost)
        policy = SpecPolicy(SpecConfig(num_speculative_tokens=4), Drafting("ngram"), cost=trained(fn))
        for i in range(200 if scatter else 0):
            noise = 1.0 + (scatter if i % 2 else -scatter)
            for shape in (StepShape(8), StepShape(16, 0, True)):
                policy.observe_step(shape, fn(shape) * noise, StepPlan(8.0, fn(shape)), 8)
        batch = [req(f"r{i}") for i in range(8)]
        for r in batch:
            for _ in range(5):
                policy.observe(r, 4, 1)
        return policy.decide(batch, [16] * 8, 256)[1]

    assert 1.0 + REQUIRED_EDGE < plan_for(0.035).edge < 1.06
    assert plan_for(0.037).plain_reason == "margin"
    noisy = plan_for(0.035, scatter=0.4)
    assert noisy.plain_reason is None and noisy.edge > 1.0 + REQUIRED_EDGE


def test_a_plain_step_it_has_not_seen_lately_is_measured_once_before_speculating_on():
    """A model that saw only verify steps at this size (and plain steps far
    smaller) extrapolates the plain step; the policy runs one plain step to
    measure it, then goes back to deciding from the model."""
    cost = trained(linear(0.05, 0.002), tokens=(1, 2, 4), spec=(False,))
    for _ in range(60):
        for t in (24, 40, 64):
            shape = StepShape(t, 0, True)
            cost.observe(shape, linear(0.05, 0.002)(shape))
    assert cost.plain_support(16) < 0.5
    policy = SpecPolicy(SpecConfig(num_speculative_tokens=4), Drafting("ngram"), cost=cost)
    batch = [req(f"r{i}") for i in range(16)]
    for r in batch:
        policy.observe(r, 4, 1)  # worth a draft or two, nowhere near twice the plain step
    ks, plan = policy.decide(batch, [16] * 16, 256)
    assert sum(ks) == 0 and plan.edge == 1.0 and plan.plain_reason == "explore"
    cost.observe(StepShape(16), linear(0.05, 0.002)(StepShape(16)))
    ks, plan = policy.decide(batch, [16] * 16, 256)
    assert sum(ks) > 0 and plan.edge > 1.0 and policy.plain_steps["explore"] == 1


def test_a_prefill_chunk_in_the_step_does_not_make_drafts_look_cheap():
    """The prefill is paid with or without drafts: the decode rows draft the
    same with a 512-token chunk beside them as alone."""
    fn = linear(0.05, 0.004, 0.005)
    policy = SpecPolicy(
        SpecConfig(num_speculative_tokens=8),
        Drafting("ngram"),
        cost=trained(fn, tokens=(1, 4, 8, 16, 64, 256, 520, 600)),
    )
    batch = [req(f"r{i}") for i in range(8)]
    for r in batch:
        policy.observe(r, 4, 1)
        policy.observe(r, 4, 0)  # worth a draft or two at most
    alone, _ = policy.decide(batch, [8] * 8, 1024)
    beside, plan = policy.decide(batch, [8] * 8, 1024, prefill=StepShape(512, 512))
    assert alone == beside == [0] * 8  # counting the prefill in, every row would draft 8
    assert plan.predicted_seconds == pytest.approx(fn(StepShape(520, 520)), rel=0.05)  # the whole step


def test_a_draft_model_whose_forward_grows_with_its_rows_pays_at_one_stream_and_not_at_sixteen():
    """Each draft forward costs 0.05 s plus 0.06 s per row it drafts for: four positions for one row
    cost 0.44 s, for sixteen rows 4.04 s. Priced by forwards alone, both looked like 0.2 s, and
    sixteen rows speculated at a loss."""

    def cost(s: StepShape) -> float:
        return 1.0 + 0.01 * s.num_tokens + 0.05 * s.num_draft_forwards + 0.06 * s.num_draft_rows

    model = trained(cost)
    for _ in range(30):
        for rows in (1, 2, 4, 8, 16):
            for forwards in (1, 2, 4):
                shape = StepShape(rows * (1 + forwards), 0, True, forwards, num_draft_rows=rows * forwards)
                model.observe(shape, cost(shape))
    for rows in (1, 16):  # plain steps of both sizes lately: their price is measured, not stale
        model.observe(StepShape(rows), cost(StepShape(rows)))
    assert model.draft_row_cost == pytest.approx(0.06, rel=0.2)
    for streams, drafts in ((1, True), (16, False)):
        policy = SpecPolicy(SpecConfig(num_speculative_tokens=4), Drafting("draft_model"), cost=model)
        batch = [req(f"r{i}") for i in range(streams)]
        for r in batch:
            policy.observe(r, 4, 2)  # alpha ~ 0.6
        assert (sum(decide(policy, batch)) > 0) == drafts


def test_grammar_forced_tokens_are_priced_for_auto_rows_and_drafted_for_true_rows():
    """A grammar's forced tokens are sure drafts: `auto` rows draft them where the step's cost
    says a verify step pays, and not where a verify step's own cost outweighs them or the batch
    is over the operator's cap; a `true` row drafts them whatever they cost."""
    auto, true = [req("a0"), req("a1")], req("t0", speculation=True)
    for fn, drafts in ((linear(1.0, 0.01), [3, 2]), (linear(0.1, 0.01, c=5.0), [0, 0])):
        policy = SpecPolicy(SpecConfig(num_speculative_tokens=4), Drafting("ngram"), cost=trained(fn))
        # Caps as the scheduler passes them: a grammar row drafts nothing else.
        assert policy.decide(auto, [0, 0], 256, grammar=[3, 2])[0] == drafts
        assert policy.decide([true], [0], 256, grammar=[4])[0] == [4]
    capped = SpecPolicy(SpecConfig(num_speculative_tokens=4, spec_disable_batch_size=2), Drafting("ngram"))
    ks, plan = capped.decide([*auto, true], [0, 0, 0], 256, grammar=[3, 2, 4])
    assert ks == [0, 0, 4]
