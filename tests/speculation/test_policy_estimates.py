"""Speculation policy, learning acceptance: per-position and in-context rates, peers'
and recorded priors, shadow drafts, and the gain calibration every graded draft feeds."""

from __future__ import annotations

import pytest

from speculation.config import SpecConfig
from speculation.estimates import GainCalibration
from speculation.policy import SpecPolicy
from speculation.proposer import Drafting
from tests.speculation.policy_support import decide, linear, req, trained


def test_an_ngram_row_learns_from_shadows_without_probing():
    """A row that stopped drafting is graded by its shadow drafts: no probe costs
    a verify, and when the row starts copying its drafts come back within steps."""
    policy = SpecPolicy(SpecConfig(num_speculative_tokens=8), Drafting("ngram"), cost=trained(linear(0.05, 0.002)))
    r = req("s")
    for _ in range(10):
        policy.observe(r, 8, 0)  # drafts never accepted
    ks = [decide(policy, [r])[0] for _ in range(20)]
    assert ks == [0] * 20  # no probes: shadows will tell
    assert policy.wants_shadow(r, 0) == 8
    # It starts quoting: each step's emitted token matches its shadow draft. Each match counts
    # at once, so the drafts come back within two steps, not after the 8-token shadow is done.
    steps = 0
    while decide(policy, [r])[0] == 0:
        policy.observe_shadow(r, [7] * 8, [7])
        steps += 1
        assert steps < 20
    assert steps <= 2


def test_copy_runs_earn_long_drafts():
    """Prompt lookup on a copy task: the first draft is a coin flip, but once a
    copy starts it continues. Per-position rates see that; one per-token rate
    (0.4 ** k) would stop at a few tokens."""
    policy = SpecPolicy(SpecConfig(num_speculative_tokens=10), Drafting("ngram"), cost=trained(linear(1.0, 0.01)))
    r = req("copy")
    for step in range(40):
        policy.observe(r, 10, 10 if step % 5 < 2 else 0)  # 40%: all ten accepted; 60%: none
    assert decide(policy, [r]) == [10]


def test_a_new_request_starts_from_its_peers_acceptance():
    policy = SpecPolicy(SpecConfig(num_speculative_tokens=8), Drafting("ngram"), cost=trained(linear(0.05, 0.005)))
    for i in range(30):
        policy.observe(req(f"old{i}"), 8, 0)  # every ngram request so far: nothing accepted
    assert decide(policy, [req("new")]) == [0]
    predicted = req("pred")
    predicted.prediction_ids = [1, 2, 3]  # another proposer: its own (untouched) peers
    assert decide(policy, [predicted])[0] > 0


def test_the_first_draft_is_judged_by_how_the_previous_one_ended():
    """A row that copies in stretches: a draft right after one accepted to its end is
    accepted (the copy goes on), one after a miss mostly is not (the copy has not
    resumed). Where a first draft token costs 40% of a step, a blended 50% rate would
    draft in both; read in context, the row drafts after a full acceptance only."""
    policy = SpecPolicy(SpecConfig(num_speculative_tokens=8), Drafting("ngram"), cost=trained(linear(0.05, 0.02)))
    r = req("stretches")
    for _ in range(8):  # five verifies copying, then five that miss
        for step in range(10):
            policy.observe(r, 8, 8 if step < 5 else 0)
    assert policy.acceptance("stretches") < 0.2  # it just missed: the copy has stopped
    assert decide(policy, [r]) == [0]
    policy.observe_shadow(r, [5] * 8, [5])  # its shadow's first token matches: copying again
    assert policy.acceptance("stretches") > 0.7
    assert decide(policy, [r]) == [8]


def test_a_row_that_never_accepts_goes_to_zero_beside_copying_peers():
    """Peers' rates start a row off; they do not keep a floor under a row whose own
    record is nothing, nor lend it the copying rows' later positions."""
    policy = SpecPolicy(SpecConfig(num_speculative_tokens=8), Drafting("ngram"), cost=trained(linear(0.05, 0.001)))
    copier, creative = req("copy"), req("creative")
    for _ in range(30):
        policy.observe(copier, 8, 8)
        policy.observe(creative, 8, 0)
    assert policy.acceptance("copy") > 0.9
    assert policy.acceptance("creative") < 0.01
    rates = policy.estimates.rates(policy.row(req("new")), 8)
    # A new request starts from its peers, in its context: its first draft follows none that
    # was accepted to its end, where only the creative row drafted; past it, the copier's rates.
    assert rates[0] < 0.1 and rates[1] > 0.9
    unlucky = req("unlucky")
    for _ in range(3):
        policy.observe(unlucky, 8, 0)
    later = policy.estimates.rates(policy.row(unlucky), 8)
    rates = policy.estimates.rates(policy.row(req("new2")), 8)  # the peers' profile now
    scale = later[0] / rates[0]
    assert scale < 0.5  # its first draft fares worse than its peers' ...
    assert all(mine <= peer * scale + 1e-9 for mine, peer in zip(later[1:], rates[1:]))  # ... so do the later ones
    assert decide(policy, [copier, creative]) == [8, 0]


def test_a_proposer_with_a_recorded_acceptance_starts_from_it():
    """An EAGLE head records its held-out acceptance per position: before any request
    has shown how the head fares here, its rows start from that record (a head that
    is right one time in four does not draft on a step where a token costs 40% of it),
    other proposers from the configured prior."""
    cost = trained(linear(0.05, 0.02), drafts=(0, 1, 2, 4))
    recorded = SpecPolicy(
        SpecConfig(num_speculative_tokens=4, prior_rates=(0.27, 0.24, 0.11)), Drafting("eagle"), cost=cost
    )
    unknown = SpecPolicy(SpecConfig(num_speculative_tokens=4), Drafting("eagle"), cost=cost)
    assert recorded.estimates.rates(recorded.row(req("a")), 4) == pytest.approx([0.27, 0.24, 0.11, 0.6])
    assert decide(recorded, [req("b")]) == [0]
    assert decide(unknown, [req("c")])[0] > 0  # the 0.6 prior drafts
    predicted = req("pred")
    predicted.prediction_ids = [1, 2, 3]  # another proposer: the configured prior
    assert recorded.estimates.rates(recorded.row(predicted), 1) == [0.6]


def test_gains_are_mapped_through_what_positions_priced_alike_realised():
    """GainCalibration: positions priced at 0.01 that were accepted one time in ten come to be
    priced near 0.1, those priced at 0.95 and accepted half the time near 0.5; a row's gains
    never rise along its draft; with nothing graded they stay as priced."""
    calibration = GainCalibration()
    assert calibration.apply([0.95, 0.5, 0.01]) == [0.95, 0.5, 0.01]
    for i in range(400):
        calibration.add([0.01], int(i % 10 == 0))
        calibration.add([0.95], int(i % 2 == 0))
    low, high = calibration.apply([0.01])[0], calibration.apply([0.95])[0]
    assert low == pytest.approx(0.1, abs=0.01) and high == pytest.approx(0.5, abs=0.02)
    assert calibration.apply([0.96, 0.5, 0.012]) == [pytest.approx(0.51, abs=0.02), 0.5, pytest.approx(0.1, abs=0.01)]
    assert calibration.summary()["0.02"] == [0.01, pytest.approx(0.1, abs=0.01)]


def test_every_graded_ngram_draft_teaches_the_gain_calibration_and_the_plan_uses_it():
    """A verify grades the positions it drafted, a shadow every position of its draft; a row
    priced below paying drafts once positions priced like it are seen to pay, and not
    without the calibration."""
    cost = trained(linear(0.05, 0.004, 0.01))
    policy = SpecPolicy(SpecConfig(num_speculative_tokens=4), Drafting("ngram"), cost=cost)
    plain = SpecPolicy(SpecConfig(num_speculative_tokens=4), Drafting("ngram"), cost=cost)  # a calibration never fed
    quiet, copier = req("quiet"), req("copier")
    for p in (policy, plain):
        for _ in range(6):
            p.observe(quiet, 4, 0)  # a row that missed lately: priced near zero
            p.observe(copier, 4, 4)
    assert decide(policy, [quiet]) == decide(plain, [quiet]) == [0]
    calibration = policy.estimates.calibration["ngram"]
    policy.observe_shadow(quiet, [7, 7, 7, 7], [7, 8])  # matched one of four, then missed: graded whole
    assert sum(calibration.count) == pytest.approx(4.0)
    (k,) = decide(policy, [copier])
    policy.observe(copier, k, k)
    assert k and sum(calibration.count) == pytest.approx(4.0 * 0.998 + k)
    assert decide(policy, [quiet]) == [0]  # its shadow's one match is not enough
    priced = policy.row(quiet).raw
    assert len(priced) == 4 and priced[0] < 0.3
    for _ in range(300):  # positions priced as the quiet row's are were accepted half the time
        calibration.add(priced, 2)
    assert decide(policy, [quiet])[0] > 0
    assert decide(plain, [quiet]) == [0]


def test_a_device_row_whose_verifies_fall_short_of_its_plans_drafts_less():
    """Every proposer's gains go through its calibration. A draft-model row whose probes are
    accepted half the time (its estimate stays near 0.5) while every verify it runs accepts
    nothing: positions priced like its plans are seen not to pay, and it stops verifying;
    a row whose verifies accept what was planned keeps drafting."""

    def verify_steps(policy: SpecPolicy) -> int:
        r = req("short")
        count = 0
        for step in range(200):
            ks, plan = policy.decide([r], [16], 256)
            if ks[0]:
                policy.observe(r, ks[0], 0)
                count += step >= 100
            if plan.probe_rows:
                policy.observe_probe(r, 5, 5 if step % 2 else 6)
        return count

    cost = trained(linear(0.05, 0.01, draft=0.001), drafts=(0, 1, 4, 8))
    policy = SpecPolicy(SpecConfig(num_speculative_tokens=8, probe_interval=2), Drafting("draft_model"), cost=cost)
    assert verify_steps(policy) <= 8
    summary = policy.summary()["acceptance_by_gain"]["draft_model"]
    assert all(accepted == 0.0 for _, accepted in summary.values())
    policy = SpecPolicy(SpecConfig(num_speculative_tokens=8), Drafting("draft_model"), cost=cost)
    copier = req("copier")
    for _ in range(20):
        (k,) = decide(policy, [copier])
        policy.observe(copier, k, k)
    assert decide(policy, [copier])[0] >= 6
