"""Speculation policy, prompt lookup beside an EAGLE head: copying rows draft by lookup,
the others from the head; lookup estimates learn from shadows and obey the operator's cap."""

from __future__ import annotations

from speculation.config import SpecConfig
from speculation.policy import SpecPolicy
from speculation.proposer import Drafting
from tests.speculation.policy_support import linear, req, trained


def head_with_lookup(lookup_lengths: dict[str, int], **config) -> SpecPolicy:
    """An EAGLE policy whose rows also have prompt-lookup drafts of the given lengths (0: none now)."""
    config.setdefault("num_speculative_tokens", 5)
    return SpecPolicy(
        SpecConfig(**config),
        Drafting("eagle", lookup=lambda rs, ks: [min(lookup_lengths.get(r.request_id, 0), k) for r, k in zip(rs, ks)]),
        cost=trained(linear(0.05, 0.001, c=0.002, draft=0.002), drafts=(0, 1, 3, 5)),
    )


def test_a_row_that_copies_drafts_by_lookup_and_its_neighbours_from_the_head():
    """Beside a head, a row whose lookup drafts are accepted drafts by lookup, long and with no
    draft forward priced; a row without a lookup draft keeps the head; a row whose lookup
    drafts fail keeps the head even while it has one."""
    policy = head_with_lookup({"copy": 10, "fails": 10}, lookup_tokens=10)
    copier, creative, fails = req("copy"), req("creative"), req("fails")
    for _ in range(6):
        policy.observe(copier, 10, 10, "ngram")
        policy.observe(fails, 10, 0, "ngram")
        for r in (copier, creative, fails):
            policy.observe(r, 5, 4, "eagle")  # the head is good for everyone
    ks, plan = policy.decide([copier, creative, fails], [16] * 3, 256)
    assert plan.lookup_rows == {0}
    assert ks[0] == 10  # the lookup's own K, past the head's 5
    assert 0 < ks[1] <= 5 and 0 < ks[2] <= 5
    # Its verify grades the lookup estimates, not the head's: the head's stay as they were.
    before = policy.estimates.rates(policy.row(copier), 5)
    policy.observe(copier, 10, 0, "ngram")
    assert policy.estimates.rates(policy.row(copier), 5) == before
    assert policy.estimates.rates(policy.row(copier, lookup=True), 1)[0] < 0.9


def test_lookup_drafts_are_learned_from_shadows_whatever_the_row_verifies():
    """A row that verifies the head's drafts still shadows lookup drafts, so when it starts
    quoting the lookup takes over within a few steps, at no verify cost."""
    lengths = {"q": 0}
    policy = head_with_lookup(lengths, lookup_tokens=8)
    r = req("q")
    for _ in range(4):
        policy.observe(r, 5, 1, "eagle")
    policy.decide([r], [16], 256)
    assert policy.wants_shadow(r, 5) == 8  # verifying the head's draft, shadowing the lookup's
    lengths["q"] = 8
    for _ in range(4):  # the lookup's shadows keep failing
        policy.observe_shadow(r, [7] * 8, [1])
    _, plan = policy.decide([r], [16], 256)
    assert not plan.lookup_rows
    steps = 0
    while not plan.lookup_rows:  # it starts quoting: each emitted token matches the shadow
        shadow = [5, 6, 7, 8, 9, 10, 11, 12]
        policy.observe_shadow(r, shadow, shadow[:2])
        _, plan = policy.decide([r], [16], 256)
        steps += 1
        assert steps < 6
    assert policy.wants_shadow(r, 8, lookup=True) == 0  # its verify grades the lookup now


def test_lookup_rows_obey_the_operators_cap():
    policy = head_with_lookup({"a": 10, "b": 10}, spec_disable_batch_size=1)
    rows = [req("a"), req("b")]
    for r in rows:
        for _ in range(4):
            policy.observe(r, 10, 10, "ngram")
    ks, plan = policy.decide(rows, [16] * 2, 256)
    assert ks == [0, 0] and not plan.lookup_rows
    ks, plan = policy.decide(rows[:1], [16], 256)
    assert ks[0] > 0 and plan.lookup_rows == {0}
