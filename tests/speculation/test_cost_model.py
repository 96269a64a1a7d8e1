"""The step-cost model learns a cost function it is never told, from steps alone."""

from __future__ import annotations

import random

import numpy as np
import pytest

from speculation.cost_model import StepCostModel, StepShape


def truth(s: StepShape) -> float:
    """Concave in tokens (GEMMs get more efficient), linear in keys read and in rows of logits,
    fixed verify and draft costs."""
    return (
        0.040
        + 0.004 * s.num_tokens**0.7
        + 0.002 * s.num_context / 1000
        + 0.003 * s.is_spec
        + 0.006 * s.num_draft_forwards
        + 0.0015 * s.num_draft_rows
        + 0.0008 * s.num_logits
    )


def random_step(rng: random.Random) -> StepShape:
    rows = rng.randint(1, 16)
    spec = rng.random() < 0.5
    drafts = rng.randint(0, 4 * rows) if spec else 0
    prefill = rng.choice([0, 0, 0, 128, 512])
    forwards = rng.choice([0, 0, 2, 4]) if drafts else 0
    return StepShape(
        rows + drafts + prefill,
        rows * rng.randint(100, 1500),
        spec and drafts > 0,
        forwards,
        rows + drafts + (prefill > 0 and rng.random() < 0.5),  # a prefill chunk samples at its end only
        min(drafts, forwards * rows),  # a draft model's forwards compute up to every row
    )


def test_recovers_a_synthetic_cost_function():
    rng = random.Random(0)
    model = StepCostModel()
    for _ in range(800):
        shape = random_step(rng)
        model.observe(shape, truth(shape) * (1 + rng.gauss(0, 0.03)))  # 3% measurement noise
    errors = []
    for _ in range(300):
        shape = random_step(rng)
        errors.append(abs(model.predict(shape) - truth(shape)) / truth(shape))
    assert sum(errors) / len(errors) < 0.05
    # Calibration, measured before each step was learned from: about the noise.
    assert model.calibration.relative_error < 0.06
    assert model.calibration.predicted_seconds / model.calibration.observed_seconds == pytest.approx(1.0, abs=0.03)
    # What one more token adds, as the policy prices drafts: close to the true marginal cost where steps were seen.
    for tokens in (4, 16, 64):
        true_marginal = truth(StepShape(tokens + 1)) - truth(StepShape(tokens))
        assert model.added_tokens_cost(tokens, 1) == pytest.approx(true_marginal, rel=0.6, abs=2e-4)
    assert model.draft_forward_cost == pytest.approx(0.006, rel=0.25)
    assert model.draft_row_cost == pytest.approx(0.0015, rel=0.3)
    assert model.logits_cost == pytest.approx(0.0008, rel=0.3)


def test_a_verify_step_is_priced_above_a_prefill_chunk_of_as_many_tokens():
    """Large steps are seen as prefill chunks (one row of logits), verify steps only small: a
    verify of 50 tokens computes 50 rows of logits, and is priced so (by T alone it was not)."""
    rng = random.Random(3)
    model = StepCostModel()
    for _ in range(600):
        rows = rng.randint(1, 16)
        if rng.random() < 0.3:  # decode rows plus a prefill chunk
            chunk = rng.choice([32, 64, 128, 256])
            shape = StepShape(rows + chunk, rows * 300 + chunk**2 // 2, num_logits=rows + rng.randint(0, 1))
        else:  # decode, or verify with a few drafts
            drafts = rng.randint(0, 3) * rows if rng.random() < 0.5 else 0
            shape = StepShape(rows + drafts, rows * 300 + drafts, drafts > 0, 0, rows + drafts)
        model.observe(shape, truth(shape) * (1 + rng.gauss(0, 0.02)))
    verify = StepShape(50, 16 * 300 + 34, True, 0, 50)
    assert model.predict(verify) == pytest.approx(truth(verify), rel=0.08)
    prefill = StepShape(50, 16 * 300 + 34, False, 0, 16)
    assert model.predict(verify) - model.predict(prefill) == pytest.approx(truth(verify) - truth(prefill), rel=0.3)


def test_follows_a_machine_that_changes_speed():
    """Another process takes half the CPU: predictions catch up within a few dozen steps."""
    rng = random.Random(1)
    model = StepCostModel()
    for _ in range(300):
        shape = random_step(rng)
        model.observe(shape, truth(shape))
    for _ in range(150):
        shape = random_step(rng)
        model.observe(shape, 2 * truth(shape))
    shape = StepShape(16, 8000)
    assert model.predict(shape) == pytest.approx(2 * truth(shape), rel=0.1)


def test_a_batch_that_never_changes_size_still_gives_a_sane_model():
    model = StepCostModel()
    for _ in range(100):
        model.observe(StepShape(8, 2000), 0.040)
    assert model.predict(StepShape(8, 2000)) == pytest.approx(0.040, rel=0.02)
    assert 0 <= model.added_tokens_cost(8, 1) < 0.040 / 8
    assert model.predict(StepShape(64, 2000)) > model.predict(StepShape(8, 2000)) * 0.9


def test_what_a_draft_adds_follows_a_curve_that_is_not_convex():
    """A step that jumps from one token to two and then barely rises (an AVX2 CPU in
    float32): the rise over a whole draft is what the steps showed, not the first
    token's slope times the draft's length."""

    def jump(s: StepShape) -> float:
        return 0.1 + (0.08 if s.num_tokens >= 2 else 0.0) + 0.001 * s.num_tokens

    model = StepCostModel()
    for _ in range(40):
        for t in (1, 2, 3, 4, 6, 8, 12, 16):
            model.observe(StepShape(t), jump(StepShape(t)))
    for start, extra in ((1, 1), (1, 7), (2, 6), (4, 8)):
        rise = jump(StepShape(start + extra)) - jump(StepShape(start))
        assert model.added_tokens_cost(start, extra) == pytest.approx(rise, rel=0.25, abs=3e-3)
    assert model.added_tokens_cost(1, 7) < 7 * model.added_tokens_cost(1, 1) / 3


def test_a_kernel_switch_between_two_token_counts_is_priced_where_it_is():
    """Flat from 1 to 9 tokens, ~1.9x from 10 (a BLAS switch seen with the tuned GEMM layouts on
    an AVX2 CPU in float32): a draft that takes a step from 5 to 9 tokens is cheap, to 10 is not."""

    def kernel(s: StepShape) -> float:
        return (0.055 if s.num_tokens <= 9 else 0.105) + 0.0008 * s.num_tokens

    rng = random.Random(2)
    model = StepCostModel()
    for _ in range(600):
        shape = StepShape(rng.randint(1, 16))
        model.observe(shape, kernel(shape) * (1 + rng.gauss(0, 0.03)))
    for tokens in (1, 4, 9, 10, 12, 16):
        assert model.predict(StepShape(tokens)) == pytest.approx(kernel(StepShape(tokens)), rel=0.08)
    assert model.added_tokens_cost(5, 4) < 0.01
    assert model.added_tokens_cost(5, 5) > 0.04


def test_every_prefix_of_a_draft_is_priced_in_one_call_as_one_at_a_time():
    """The policy prices each prefix of its ranked draft tokens with one vectorized call: the same
    rises as asking token count by token count, across knots and past the last one."""
    rng = random.Random(3)
    model = StepCostModel()
    for _ in range(300):
        t = rng.choice([1, 3, 9, 17, 40, 200, 3000, 20000])
        model.observe(StepShape(t, 50 * t), 0.02 + 1e-4 * t + 2e-6 * t * t**0.5 + rng.uniform(0, 1e-3))
    for start, extra in ((1, 40), (15, 20), (250, 300), (16000, 900), (30000, 5)):
        batch = model.added_tokens_costs(start, np.arange(1, extra + 1))
        one_by_one = [model.added_tokens_cost(start, m) for m in range(1, extra + 1)]
        assert batch.tolist() == pytest.approx(one_by_one, rel=1e-9, abs=1e-12)
    assert len(StepCostModel().added_tokens_costs(4, np.arange(1, 4))) == 3  # an unfitted model prices drafts at 0
    # Expected counts between whole ones (drafts that may end early) read f between them.
    halfway = model.added_tokens_costs(15, np.array([2.5]))[0]
    assert halfway == pytest.approx((model.added_tokens_cost(15, 2) + model.added_tokens_cost(15, 3)) / 2)


def test_a_catch_up_is_priced_apart_from_the_rows_of_a_draft_forward():
    """A draft model's catch-up feed is a prefill in it: per token dearer than a row of its usual
    one-to-five-row forwards. Priced as rows alone, one long feed came out at a fifth of its time."""

    def cost(s: StepShape) -> float:
        return (
            0.05
            + 0.001 * s.num_tokens
            + 0.01 * s.num_draft_forwards
            + 0.0005 * s.num_draft_rows
            + 0.002 * s.num_catch_up
        )

    rng = random.Random(1)
    model = StepCostModel()
    for _ in range(600):
        rows, forwards = rng.randint(1, 8), rng.choice([0, 1, 2, 4])
        fed = rng.choice([0, 0, 0, 0, 3, 50, 200]) if forwards else 0
        shape = StepShape(rows * (1 + forwards), 0, forwards > 0, forwards, rows * (1 + forwards),
                          rows * forwards + fed, fed)  # fmt: skip
        model.observe(shape, cost(shape) * (1 + rng.gauss(0, 0.02)))
    assert model.catch_up_cost == pytest.approx(0.002, rel=0.15)
    long = StepShape(8, 0, True, 4, 8, 4 + 300, 300)  # a catch-up longer than any seen
    assert model.predict(long) == pytest.approx(cost(long), rel=0.1)
    assert model.catch_up_support >= 3 and model.draft_support >= 3
    assert model.summary()["ms_per_catch_up_token"] == pytest.approx(2.0, rel=0.15)
