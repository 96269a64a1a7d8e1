"""Speculation policy: per-request `auto` from acceptance and a learned step cost;
modes, the operator's cap, shadows and probes that bring K back."""

from __future__ import annotations

import pytest

from scheduler.scheduler import Scheduler, SchedulerConfig
from scheduler.types import Batch, Request, RowOutput, SamplingParams, StepOutput
from speculation.config import SpecConfig
from speculation.cost_model import StepCostModel, StepShape
from speculation.estimates import GainCalibration
from speculation.policy import SpecPolicy
from speculation.proposers import Drafting


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
    r = req("a")
    ks = run(policy, r, 40, acceptance=0.0)
    assert ks[0] > 0  # starts optimistic (prior)
    assert ks[-12:].count(0) >= 9  # plain, but for occasional probes
    assert -1 in ks[-12:] and max(ks[-12:]) == 0  # a probe verifies nothing: its step stays plain
    ks = run(policy, r, 60, acceptance=0.95)
    assert ks[-1] >= 6  # the probes saw acceptance again: long drafts are back


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


# -- through the scheduler, with a fake runner -------------------------------------

COPY, CREATIVE = 7, 8


def fake_step(batch: Batch) -> StepOutput:
    """ "copy" rows accept every draft and emit what their shadows predicted;
    "creative" rows accept nothing and never match a shadow."""
    rows = []
    for row in batch.rows:
        copy = row.request_id.startswith("copy")
        if not row.sample:
            rows.append(RowOutput(row.request_id))
            continue
        k = row.num_spec_tokens if copy else 0
        shadow = ([COPY] if copy else [CREATIVE + 1]) * row.num_shadow_tokens or None
        token = COPY if copy else CREATIVE
        method = "ngram" if row.num_spec_tokens else None
        out = RowOutput(row.request_id, [token] * (k + 1), num_draft_tokens=row.num_spec_tokens, num_accepted_tokens=k)
        out.method, out.shadow_ids = method, shadow
        rows.append(out)
    return StepOutput(rows=rows)


def step_seconds(batch: Batch, output: StepOutput) -> float:
    """A memory-bound step: 50 ms plus 1 ms per token fed."""
    tokens = sum(len(r.token_ids) for r in batch.rows) + sum(o.num_draft_tokens for o in output.rows)
    return 0.050 + 0.001 * tokens


def test_accepting_rows_draft_and_the_others_do_not_at_every_batch_size():
    for size in (2, 4, 8, 16):
        config = SchedulerConfig(max_num_seqs=size, max_model_len=4096, max_num_batched_tokens=1024,
                                 spec=SpecConfig(num_speculative_tokens=8))  # fmt: skip
        s = Scheduler(config, Drafting("ngram"))
        for i in range(size):
            kind = "copy" if i % 2 == 0 else "creative"
            s.add(Request(f"{kind}{i}", [1, 2, 3], SamplingParams(max_tokens=3000, temperature=0, ignore_eos=True)))
        for _ in range(60):
            batch, _ = s.schedule()
            output = fake_step(batch)
            s.update(batch, output, step_seconds(batch, output))
        ks = {row.request_id: row.num_spec_tokens for row in s.schedule()[0].rows}
        assert all(k >= 4 for rid, k in ks.items() if rid.startswith("copy")), (size, ks)  # long drafts
        assert all(k == 0 for rid, k in ks.items() if rid.startswith("creative")), (size, ks)
        check = s.last_check
        assert check is not None and check.predicted_seconds is not None


def test_the_operators_cap_is_obeyed_exactly():
    config = SchedulerConfig(max_num_seqs=8, max_model_len=4096, max_num_batched_tokens=1024,
                             spec=SpecConfig(num_speculative_tokens=4, spec_disable_batch_size=3))  # fmt: skip
    s = Scheduler(config, Drafting("ngram"))
    for i in range(5):
        s.add(Request(f"copy{i}", [1, 2, 3], SamplingParams(max_tokens=3000, temperature=0, ignore_eos=True)))
    s.add(Request("forced", [1, 2, 3], SamplingParams(max_tokens=3000, ignore_eos=True, speculation=True)))
    for _ in range(10):  # 6 running > 3: auto rows never draft, the forced row always does
        batch, _ = s.schedule()
        ks = {r.request_id: r.num_spec_tokens for r in batch.rows}
        if all(r.request.output_ids for r in batch.rows):
            assert ks.pop("forced") == 4 and set(ks.values()) == {0}
        output = fake_step(batch)
        s.update(batch, output, step_seconds(batch, output))
    for rid in ("copy3", "copy4", "forced"):
        s.abort(rid)
    for _ in range(10):  # 3 running: at the cap, the copy rows draft
        batch, _ = s.schedule()
        output = fake_step(batch)
        s.update(batch, output, step_seconds(batch, output))
    assert len(batch.rows) == 3 and all(r.num_spec_tokens == 4 for r in batch.rows)


def test_a_policy_fault_runs_the_step_plain_instead_of_stopping_the_engine():
    config = SchedulerConfig(max_num_seqs=4, max_model_len=4096, max_num_batched_tokens=1024,
                             spec=SpecConfig(num_speculative_tokens=4))  # fmt: skip
    s = Scheduler(config, Drafting("ngram"))
    requests = [Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=20, temperature=0, speculation=True))
                for i in range(2)]  # fmt: skip
    for r in requests:
        s.add(r)

    def broken(*args, **kwargs):
        raise ZeroDivisionError("float division by zero")

    s.policy.decide = broken
    for _ in range(3):
        batch, _ = s.schedule()
        assert len(batch.rows) == 2 and all(r.num_spec_tokens == 0 for r in batch.rows)
        output = fake_step(batch)
        s.update(batch, output, step_seconds(batch, output))
    assert all(len(r.output_ids) == 3 for r in requests)  # a prefill, then two plain decode steps


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
