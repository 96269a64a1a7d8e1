"""A device proposer's catch-up (what a row emitted since the proposer last drafted for it, its
whole sequence the first time) is priced into the step that pays it, amortized over the tokens
the row has left; and the plain step's price is never taken from verify steps alone."""

from __future__ import annotations

import pytest

from scheduler.types import Request, SamplingParams
from speculation.config import SpecConfig
from speculation.cost_model import StepShape
from speculation.policy import SpecPolicy
from speculation.proposer import Drafting
from tests.speculation.policy_support import decide, linear, req, trained

RATIO = 0.3  # the draft model's weights against the target's


def row(rid: str, max_tokens: int, emitted: int = 0) -> Request:
    request = Request(rid, [1, 2, 3], SamplingParams(max_tokens=max_tokens))
    request.output_ids = [7] * emitted
    return request


def policy_with(feeds: dict[str, int]) -> SpecPolicy:
    """A draft-model policy on a model that has measured plain and verify steps (0.05 s, 1 ms a
    token; past its knots a token keeps costing 1 ms, as a prefill's does) but no draft forward:
    they are priced as RATIO of the target's."""
    drafting = Drafting("draft_model", catch_up=lambda rows, k: [feeds[r.request_id] for r in rows],
                        forward_cost_ratio=RATIO)  # fmt: skip
    policy = SpecPolicy(SpecConfig(num_speculative_tokens=4), drafting, cost=trained(linear(0.05, 0.001)))
    return policy


def accepted_everything(policy: SpecPolicy, request: Request) -> None:
    for _ in range(10):
        policy.observe(request, 4, 4)


def test_a_long_catch_up_is_paid_only_where_the_row_has_tokens_left_to_repay_it():
    """A 2,000-token catch-up costs RATIO of a 2,000-token target prefill, 0.6 s. A row with 1,000
    tokens to go repays it at 5 tokens a verify; one with 16 to go, three verifies, does not. Each
    row's first verify would otherwise pay: a plain step makes 1 token in 51 ms, a verify of 4
    sure drafts 5 in about 120."""
    feeds = {"caught-up": 1, "long": 2000, "short": 2000, "nearly-done": 2000}
    policy = policy_with(feeds)
    caught_up, long, short = row("caught-up", 1000), row("long", 1000), row("short", 16)
    nearly_done = row("nearly-done", 1000, emitted=984)
    for request in (caught_up, long, short, nearly_done):
        accepted_everything(policy, request)
    assert decide(policy, [caught_up]) == [4]
    assert decide(policy, [long]) == [4]
    assert decide(policy, [short]) == [0]
    assert decide(policy, [nearly_done]) == [0]
    assert policy.plain_steps["no_gain"] == 2


def test_the_part_of_a_feed_that_recurs_every_verify_is_paid_in_full():
    """A head re-feeds the tokens it drafted and the target accepted, every verify: up to a
    draft's length of a feed is paid by the step in full; only the rest is spread over the
    tokens the row has left."""
    policy = policy_with({"head": 5, "prompt": 2001})
    head, prompt = row("head", 1000), row("prompt", 1000)
    candidates = [(0.9, 0)] * 4 + [(0.9, 1)] * 4
    charges = policy._catch_up_charges([head, prompt], candidates, frozenset())
    four = policy.prices.catch_up_seconds(4)
    assert four > 0 and charges[0] == (four, 0.0)
    assert charges[1][0] == four
    assert charges[1][1] * 1000 == pytest.approx(policy.prices.catch_up_seconds(2000) - four)


def test_a_draft_model_pays_once_for_what_it_missed_while_its_row_ran_plain():
    """A draft model's KV keeps the drafts the target accepted (all but its last), so after a
    row ran plain for a while only one token of its catch-up recurs; the rest is paid once,
    spread over the tokens the row has left, and the row's next verify is not charged for it."""
    drafting = Drafting("draft_model", catch_up=lambda rows, k: [9], forward_cost_ratio=RATIO, recurring_feed=1)
    policy = SpecPolicy(SpecConfig(num_speculative_tokens=4), drafting, cost=trained(linear(0.05, 0.001)))
    lagging = row("lagging", 1000)
    charges = policy._catch_up_charges([lagging], [(0.9, 0)] * 4, frozenset())
    one = policy.prices.catch_up_seconds(1)
    assert one > 0 and charges[0][0] == one
    assert charges[0][1] * 1000 == pytest.approx(policy.prices.catch_up_seconds(8) - one)


def test_the_tokens_left_follow_the_mean_output_of_finished_requests():
    """`max_tokens` is a bound, not a length: once requests finish after 16 tokens, a row allowed
    1,000 is expected to make about 16 more, and its 2,000-token catch-up no longer pays."""
    policy = policy_with({"long": 2000})
    long = row("long", 1000)
    accepted_everything(policy, long)
    assert decide(policy, [long]) == [4]
    policy.free("first", 100)
    assert policy.mean_output_tokens == 100
    policy.free("second", 10)
    assert policy.mean_output_tokens == pytest.approx(91.0)  # the newest weighs a tenth
    for i in range(60):
        policy.free(f"done{i}", 16)
    policy.free("aborted", None)  # an abort says nothing about lengths
    assert policy.mean_output_tokens == pytest.approx(16, abs=0.5)
    assert decide(policy, [long]) == [0]


def test_measured_catch_ups_replace_the_prior():
    """Once steps have measured long catch-ups, their fitted price is the one charged: here ten
    times the prior's, so a row with 1,000 tokens to go no longer catches up 2,000."""
    policy = policy_with({"long": 2000})
    long = row("long", 1000)
    accepted_everything(policy, long)
    for _ in range(10):  # 20 ms a catch-up token (the prior: 0.3 ms)
        for fed in (0, 50, 200):
            for forwards in (1, 4):
                shape = StepShape(1 + forwards, 0, True, forwards, 1 + forwards, forwards + fed, fed)
                seconds = 0.05 + 0.001 * shape.num_tokens + 0.015 * forwards + 0.0003 * shape.num_draft_rows
                policy.cost.observe(shape, seconds + 0.02 * fed)
        policy.cost.observe(StepShape(1), 0.051)
    assert policy.cost.catch_up_support >= 3
    assert decide(policy, [long]) == [0]


def test_a_plain_step_of_a_size_unseen_lately_runs_before_any_verify():
    """Priced from verify steps alone, a plain step's cost is a guess: the first step of a size
    not seen plain in ~150 steps runs plain (and is measured), whatever the edge said."""
    policy = SpecPolicy(SpecConfig(num_speculative_tokens=4), Drafting("ngram"),
                        cost=trained(linear(0.05, 0.001), spec=(True,)))  # fmt: skip
    request = req("a")
    accepted_everything(policy, request)
    assert decide(policy, [request]) == [0]
    assert policy.plain_steps["explore"] == 1
    policy.cost.observe(StepShape(1), 0.051)
    assert decide(policy, [request]) == [4]


def test_a_device_proposer_waits_for_a_measured_step():
    """Before any step is measured, a model-free proposer drafts on the memory-bound guess; a
    draft model's rows run plain: its first forward would feed every row's whole prompt."""
    free = SpecPolicy(SpecConfig(num_speculative_tokens=4), Drafting("ngram"))
    assert decide(free, [req("a")]) == [4]
    model = SpecPolicy(SpecConfig(num_speculative_tokens=4), Drafting("draft_model", catch_up=lambda rows, k: [100]))
    assert decide(model, [req("b")]) == [0]
    assert model.plain_steps["explore"] == 1
