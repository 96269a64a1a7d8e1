"""Speculation policy, probes: a device-proposer row that stopped drafting probes to bring
K back; probes share forwards, count a sampled row's chance, and keep to their share of
step time."""

from __future__ import annotations

import pytest

from scheduler.types import Request
from speculation.config import SpecConfig
from speculation.cost_model import StepCostModel, StepShape
from speculation.policy import SpecPolicy
from speculation.proposer import Drafting
from tests.speculation.policy_support import linear, req, trained


def run(policy: SpecPolicy, request: Request, steps: int, acceptance: float) -> list[int]:
    """Drive the policy with drafts accepted with probability `acceptance`
    (deterministically: the accepted prefix is the expected one, rounded)."""
    ks = []
    for _ in range(steps):
        ks_, plan = policy.decide([request], [16], 256)
        k = ks_[0]
        ks.append(-1 if plan.probe_rows else k)  # -1: a probe (unverified, the step stays plain)
        if k:
            accepted, p = 0, 1.0
            for _ in range(k):
                p *= acceptance
                if p < 0.5:
                    break
                accepted += 1
            policy.observe(request, k, accepted)
        if plan.probe_rows:  # the probe's token is the emitted one when the row accepts
            policy.observe_probe(request, 1, 1 if acceptance >= 0.5 else 2)
    return ks


def test_a_draft_model_row_drops_to_zero_and_probes_back():
    policy = SpecPolicy(SpecConfig(num_speculative_tokens=8, probe_interval=4), Drafting("draft_model"))
    # Steps measured (a draft model's rows run plain on the unfitted model's guess); its forwards
    # cheap enough that a probe round stays within the budget at `probe_interval`.
    policy.cost = trained(linear(0.05, 0.001, 0.002, draft=0.0001), drafts=(0, 1, 2, 4))
    r = req("a")
    ks = run(policy, r, 40, acceptance=0.0)
    assert ks[0] > 0  # starts optimistic (prior)
    assert ks[-12:].count(0) >= 9  # plain, but for occasional probes
    assert -1 in ks[-12:] and max(ks[-12:]) == 0  # a probe verifies nothing: its step stays plain
    ks = run(policy, r, 60, acceptance=0.95)
    assert ks[-1] >= 6  # the probes saw acceptance again: long drafts are back


def test_probes_of_a_large_batch_share_proposer_forwards():
    """Device-proposer rows that stopped paying probe: the proposer drafts a token for
    them that is not verified. Rows that joined at different steps would each make the
    proposer run in a different plain step; a due probe takes along every row past half
    its wait instead, and no probe turns a plain step into a verify step."""
    policy = SpecPolicy(SpecConfig(num_speculative_tokens=4, probe_interval=8), Drafting("draft_model"))
    policy.cost = trained(linear(0.05, 0.001, 0.002, draft=0.004), drafts=(0, 1, 2, 4))
    rows: list[Request] = []
    probe_steps = verify_steps = 0
    for step in range(400):
        if step < 16:
            rows.append(req(f"r{step}"))  # one joins per step: their waits are staggered
        ks, plan = policy.decide(rows, [16] * len(rows), 256)
        for i, (r, k) in enumerate(zip(rows, ks)):
            policy.observe(r, k, 0)  # nothing is ever accepted
            if i in plan.probe_rows:
                policy.observe_probe(r, 1, 2)
        probe_steps += step >= 200 and bool(plan.probe_rows)
        verify_steps += step >= 200 and any(ks)
    # Probing alone, each of 16 rows every 64 steps would make the proposer run in ~50 of these 200 steps.
    assert 0 < probe_steps <= 16
    assert verify_steps == 0
    assert policy.summary()["probes"]["accepted"] == 0


def test_a_sampled_probe_counts_its_chance_of_acceptance():
    """A probe graded with the rejection sampler's chance of accepting its token counts as
    that fraction: a head that would be accepted 70% of the time reads as 0.7, however the
    row's sampled tokens happened to fall."""
    policy = SpecPolicy(SpecConfig(num_speculative_tokens=4, decay=0.9), Drafting("eagle"))
    row = req("sampled")
    for _ in range(60):
        policy.observe_probe(row, 1, 2, accept=0.7)  # the emitted token differs every time
    assert policy.acceptance(row.request_id) == pytest.approx(0.7, abs=0.02)
    assert policy.summary()["probes"] == {"graded": 60, "accepted": 42.0}


def probe_steps(policy: SpecPolicy, steps: int) -> list[int]:
    """Steps on which one never-accepting draft-model row probes, after it stopped drafting."""
    row = req("p")
    for _ in range(10):
        policy.observe(row, 4, 0)
    probes = []
    for step in range(steps):
        ks, plan = policy.decide([row], [16], 256)
        assert ks == [0]
        if plan.probe_rows:
            probes.append(step)
            policy.observe_probe(row, 1, 2)
    return probes


def test_probes_stay_within_their_share_of_step_time():
    """A probe costs the proposer's forward in a plain step. Where that is cheap a row
    probes after `probe_interval` plain steps; where it costs 40% of a step (a large draft
    model, or a head's long catch-up), probing that often would spend 5% of the time on
    probes, so the wait grows to keep a round's premium within `probe_budget` (1%) of the
    steps it waits through. What a verify step costs does not matter: a probe verifies nothing."""

    def policy(spec: float, draft: float) -> SpecPolicy:
        p = SpecPolicy(SpecConfig(num_speculative_tokens=4, probe_interval=8), Drafting("draft_model"))
        p.cost = trained(linear(0.05, 0.0001, spec, draft=draft), drafts=(0, 1, 2, 4))
        return p

    cheap, costly, dear_verify = policy(0.0, 0.0005), policy(0.0, 0.02), policy(0.02, 0.0005)
    cheap_probes, costly_probes = probe_steps(cheap, 300), probe_steps(costly, 300)
    assert cheap_probes[0] == 7  # the 8th plain step probes
    assert probe_steps(dear_verify, 300) == cheap_probes
    # A probe's premium, ~0.02 s over a 0.0501 s step, is 1% of ~40 steps.
    assert costly.config.probe_budget == 0.01
    assert 39 <= costly_probes[0] <= 40
    # Failing probes back off alike (doubling the wait) in both.
    assert len(costly_probes) < len(cheap_probes)
    assert len(costly_probes) * 0.02 / (300 * 0.0501) <= 0.01


def test_a_probe_pays_for_the_rows_catch_up():
    """A probe's forward feeds the proposer every token the row emitted since it last drafted.
    That catch-up grows with the wait, so a proposer whose cost per fed token is over
    `probe_budget` of a plain step (a draft model on a CPU) never probes a plain row: however
    long the wait, a round costs more than 1% of the steps it waited through. Where a token
    costs little (a head), probes come after `probe_interval` plain steps as before."""

    def probes(per_token: float) -> list[int]:
        behind = {"a": 0}

        def catch_up(rows: list[Request], num_tokens: list[int]) -> list[int]:
            return [behind[r.request_id] + 1 for r in rows]

        policy = SpecPolicy(SpecConfig(num_speculative_tokens=4, probe_interval=8), Drafting("draft_model",
                            catch_up=catch_up))  # fmt: skip
        model = StepCostModel()
        for _ in range(30):
            for t in (1, 2, 4, 8, 16):
                for d, rows in ((0, 0), (1, 1), (1, 4), (1, 16), (4, 4), (4, 32)):
                    shape = StepShape(t, 0, d > 1, d, num_draft_rows=rows)
                    model.observe(shape, 0.05 + 0.0001 * t + 0.0002 * d + per_token * rows)
        policy.cost = model
        row, steps = req("a"), []
        for _ in range(60):
            policy.observe(row, 4, 0)  # the draft model is never accepted: the row runs plain
        for step in range(300):
            ks, plan = policy.decide([row], [16], 256)
            assert ks == [0]
            behind["a"] += 1
            if plan.probe_rows:
                steps.append(step)
                behind["a"] = 0
                policy.observe_probe(row, 1, 2)
        return steps

    assert probes(0.00005)[0] == 7  # 0.1% of a step per token: the 8th plain step probes
    assert probes(0.002) == []  # 4% of a step per token: the catch-up alone is over budget
