"""speculation.rejection: greedy tables, then the output distribution tested against the target's.

Statistical checks use scipy's chi-square goodness of fit with fixed seeds, so
they are deterministic; a check fails when its p-value is below
P_VALUE_FLOOR = 1e-3. Each case draws R = 20,000 independent rows in one call.
A deliberately wrong sampler run through the same harness must fail it, which
shows the harness has the power to catch a lossy sampler.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy import stats

from models.sampling import (
    STREAM_ACCEPT,
    STREAM_DRAFT,
    STREAM_SAMPLE,
    process_logits,
    sample_from_probs,
    uniform_noise,
)
from scheduler.types import SamplingParams
from speculation.rejection import rejection_sample
from tests.support.tensors import sampling_tensors

P_VALUE_FLOOR = 1e-3
NUM_SAMPLES = 20_000


def one_hot(ids: list[list[int]], vocab_size: int) -> torch.Tensor:
    return F.one_hot(torch.tensor(ids).clamp(min=0), vocab_size).float()


# -- greedy tables ------------------------------------------------------------------

# (target argmax at positions 0..k, draft ids (-1 = padding), num_draft) -> (num_accepted, output_ids)
GREEDY_TABLE = [
    ([1, 2, 3, 4], [1, 2, 3], 3, 3, [1, 2, 3, 4]),  # all accepted -> bonus
    ([1, 2, 3, 4], [5, 2, 3], 3, 0, [1, -1, -1, -1]),  # first mismatch -> target argmax
    ([1, 2, 3, 4], [1, 5, 3], 3, 1, [1, 2, -1, -1]),
    ([1, 2, 3, 4], [1, 2, 5], 3, 2, [1, 2, 3, -1]),
    ([1, 2, 0, 0], [1, -1, -1], 1, 1, [1, 2, -1, -1]),  # shorter draft, padded
    ([1, 2, 3, 4], [1, 2, 3], 2, 2, [1, 2, 3, -1]),  # padding that matches is still padding
    ([4, 0, 0, 0], [-1, -1, -1], 0, 0, [4, -1, -1, -1]),  # no draft: plain decode
    ([0, 0, 0, 0], [0, 0, 0], 3, 3, [0, 0, 0, 0]),
    ([5, 5, 1, 2], [5, 5, 5], 3, 2, [5, 5, 1, -1]),
]


@pytest.mark.parametrize("model_free", [True, False])
def test_greedy_table(model_free):
    vocab_size = 6
    target_argmax, drafts, num_draft, want_accepted, want_output = (list(col) for col in zip(*GREEDY_TABLE))
    num_rows, k = len(drafts), 3
    draft_ids = torch.tensor(drafts)
    # Uniforms at the extremes, 0 included: greedy must not depend on them.
    u_accept = torch.tensor([0.0, 1 - 2.0**-53, 0.5] * num_rows, dtype=torch.float64).view(num_rows, k)
    u_sample = torch.rand(num_rows, k + 1, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    num_accepted, output_ids = rejection_sample(
        draft_ids,
        torch.tensor(num_draft),
        None if model_free else one_hot(drafts, vocab_size),
        one_hot(target_argmax, vocab_size),
        u_accept,
        u_sample,
    )
    assert num_accepted.dtype == output_ids.dtype == torch.int64
    assert num_accepted.tolist() == want_accepted
    assert output_ids.tolist() == want_output


def test_no_drafts_at_all_is_plain_sampling():
    target_probs = torch.tensor([[[0.0, 1.0, 0.0]], [[0.5, 0.0, 0.5]]])  # [R, 1, V]
    num_accepted, output_ids = rejection_sample(
        torch.zeros(2, 0, dtype=torch.long),
        torch.zeros(2, dtype=torch.long),
        torch.zeros(2, 0, 3),
        target_probs,
        torch.zeros(2, 0, dtype=torch.float64),
        torch.tensor([[0.9], [0.9]], dtype=torch.float64),
    )
    assert num_accepted.tolist() == [0, 0]
    assert output_ids.tolist() == [[1], [2]]


def test_accept_threshold_and_recovered_support():
    """p(x)=0.3 < q(x)=0.6: accept iff u <= 0.5; a recovered token lies where p > q."""
    p = torch.tensor([0.3, 0.4, 0.1, 0.2])
    q = torch.tensor([0.6, 0.1, 0.3, 0.0])
    num_rows = 64
    u_accept = torch.linspace(0.0, 0.999, num_rows, dtype=torch.float64)[:, None]
    num_accepted, output_ids = rejection_sample(
        torch.zeros(num_rows, 1, dtype=torch.long),
        torch.ones(num_rows, dtype=torch.long),
        q.expand(num_rows, 1, 4),
        p.expand(num_rows, 2, 4),
        u_accept,
        torch.linspace(0.0, 0.999, num_rows, dtype=torch.float64)[:, None].expand(-1, 2),
    )
    assert torch.equal(num_accepted, (u_accept[:, 0] <= 0.5).long())
    recovered = output_ids[num_accepted == 0, 0]
    assert set(recovered.tolist()) == {1, 3}  # the residual max(0, p - q) = [0, .3, 0, .2]


# -- the statistical test ------------------------------------------------------------


def chisquare_pvalue(ids: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit of samples `ids` to `probs` [V]. Zero-probability ids must never occur."""
    counts = torch.bincount(ids, minlength=len(probs)).double().numpy()
    expected = probs.double().numpy() / probs.double().sum().item() * len(ids)
    assert counts[expected == 0].sum() == 0, "emitted a token the target gives probability 0"
    small = (expected > 0) & (expected < 5)  # pool sparse cells so the chi-square approximation holds
    big = expected >= 5
    observed = np.append(counts[big], counts[small].sum())
    expected = np.append(expected[big], expected[small].sum())
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
    return float(stats.chisquare(observed, expected).pvalue)


def processed(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[n, V] logits -> [n, V] probs through the engine's own processing."""
    st = sampling_tensors([params], logits.shape[-1], "cpu")
    return process_logits(logits[None], st, None, None)[0]


def draw(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """probs [R, n, V] -> ids [R, n] with the engine's counter-based noise."""
    return sample_from_probs(probs, uniform_noise(seeds, positions, stream))


def speculate(sampler, p: torch.Tensor, q: torch.Tensor | None, proposal: torch.Tensor, num_draft, seed: int):
    """One verify step on NUM_SAMPLES independent rows with context-free p [k+1, V] and proposal [k, V].

    Drafts are drawn from `proposal`; `q` is what the sampler is told about it
    (None: model-free). Returns (num_accepted, output_ids).
    """
    k = proposal.shape[0]
    seeds = torch.arange(NUM_SAMPLES) + seed * NUM_SAMPLES
    positions = torch.arange(k + 1).expand(NUM_SAMPLES, -1)  # [R, k + 1]
    draft_ids = draw(proposal.expand(NUM_SAMPLES, -1, -1), seeds, positions[:, :k], STREAM_DRAFT)
    return sampler(
        draft_ids,
        num_draft,
        None if q is None else q.expand(NUM_SAMPLES, -1, -1),
        p.expand(NUM_SAMPLES, -1, -1),
        uniform_noise(seeds, positions[:, :k], STREAM_ACCEPT),
        uniform_noise(seeds, positions, STREAM_SAMPLE),
    )


def make_case(name: str, vocab_size: int = 24, k: int = 3):
    """(p [k+1, V], q [k, V] or None, proposal [k, V], num_draft [R]) for a named case."""
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    target_logits = torch.randn(k + 1, vocab_size, generator=g) * 2
    near_logits = target_logits[:k] + torch.randn(k, vocab_size, generator=g)  # a decent draft model
    num_draft = torch.full((NUM_SAMPLES,), k)
    params = {
        "temp0.7": SamplingParams(temperature=0.7, seed=0),
        "temp1.0": SamplingParams(temperature=1.0, seed=0),
        "temp1.5": SamplingParams(temperature=1.5, seed=0),
        "top_p": SamplingParams(temperature=1.0, top_p=0.8, seed=0),
        "top_k": SamplingParams(temperature=1.2, top_k=5, seed=0),
        "min_p": SamplingParams(temperature=1.0, min_p=0.05, seed=0),
    }.get(name, SamplingParams(seed=0))
    p = processed(target_logits, params)
    q = processed(near_logits, params)
    if name == "q_far":  # the draft favours what the target dislikes
        q = processed(-target_logits[:k], params)
    if name == "ragged":  # each row its own k, 0..k
        num_draft = torch.randint(0, k + 1, (NUM_SAMPLES,), generator=g)
    if name == "model_free":  # n-gram style: q one-hot on whatever was proposed
        return p, None, q, num_draft
    return p, q, q, num_draft


STAT_CASES = ["temp0.7", "temp1.0", "temp1.5", "top_p", "top_k", "min_p", "q_far", "ragged", "model_free"]


@pytest.mark.parametrize("name", STAT_CASES)
def test_output_distribution_is_the_target(name):
    p, q, proposal, num_draft = make_case(name)
    num_accepted, output_ids = speculate(rejection_sample, p, q, proposal, num_draft, seed=1)

    # First emitted token ~ p_0, whether accepted, recovered or bonus.
    assert chisquare_pvalue(output_ids[:, 0], p[0]) > P_VALUE_FLOOR
    # Context-free p and independent drafts: given position 0 accepted, the
    # second emitted token (accepted, recovered or bonus) ~ p_1.
    second = output_ids[num_accepted >= 1, 1]
    assert len(second) > 1000
    assert chisquare_pvalue(second, p[1]) > P_VALUE_FLOOR
    assert (output_ids[:, 1:] == -1).sum() == (3 - num_accepted).sum()

    # Acceptance rate at position 0 is the overlap sum_x min(p, q) (a draft model)
    # or sum_x proposal(x) p(x) (q one-hot), within 5 standard errors.
    has_draft = num_draft > 0
    expected = (proposal[0] * p[0]).sum() if q is None else torch.minimum(p[0], q[0]).sum()
    rate = (num_accepted[has_draft] >= 1).double().mean()
    stderr = (expected * (1 - expected) / has_draft.sum()).sqrt()
    assert abs(rate - expected) < 5 * stderr + 1e-9


def test_multi_step_generation_matches_a_bigram_target():
    """Run real steps (k = 2) with a context-dependent target and draft until every row has two
    tokens; the joint law of (token 1, token 2) must be p(a | s) p(b | a)."""
    vocab_size, k, start = 8, 2, 0
    g = torch.Generator().manual_seed(7)
    target_logits = torch.randn(vocab_size, 1, vocab_size, generator=g) * 1.5  # [context, 1, V]
    draft_logits = target_logits + torch.randn(vocab_size, 1, vocab_size, generator=g) * 1.5
    st = sampling_tensors([SamplingParams(temperature=0.9, seed=0)] * vocab_size, vocab_size, "cpu")
    p_table = process_logits(target_logits, st, None, None)[:, 0]  # [context, V]
    q_table = process_logits(draft_logits, st, None, None)[:, 0]

    seeds = torch.arange(NUM_SAMPLES) + 99
    emitted = torch.full((NUM_SAMPLES, 2 + k + 1), -1)
    num_emitted = torch.zeros(NUM_SAMPLES, dtype=torch.long)
    context = torch.full((NUM_SAMPLES,), start)
    rows = torch.arange(NUM_SAMPLES)
    while (num_emitted < 2).any():
        positions = num_emitted[:, None] + torch.arange(k + 1)  # [R, k + 1] output index of each slot
        draft_ids = torch.empty(NUM_SAMPLES, k, dtype=torch.long)
        last = context
        for i in range(k):  # the draft model proposes autoregressively
            u = uniform_noise(seeds, positions[:, i : i + 1], STREAM_DRAFT)[:, 0]
            draft_ids[:, i] = last = sample_from_probs(q_table[last], u)
        contexts = torch.cat([context[:, None], draft_ids], dim=1)  # [R, k + 1]
        num_accepted, output_ids = rejection_sample(
            draft_ids,
            torch.full((NUM_SAMPLES,), k),
            q_table[contexts[:, :k]],
            p_table[contexts],
            uniform_noise(seeds, positions[:, :k], STREAM_ACCEPT),
            uniform_noise(seeds, positions, STREAM_SAMPLE),
        )
        active = num_emitted < 2
        for j in range(k + 1):
            write = active & (j <= num_accepted)
            emitted[rows[write], num_emitted[write] + j] = output_ids[write, j]
        num_emitted = torch.where(active, num_emitted + num_accepted + 1, num_emitted)
        context = torch.where(active, output_ids[rows, num_accepted], context)

    joint = emitted[:, 0] * vocab_size + emitted[:, 1]
    expected = (p_table[start][:, None] * p_table).flatten()  # [V * V]
    assert chisquare_pvalue(joint, expected) > P_VALUE_FLOOR


# -- the harness can fail -----------------------------------------------------------


def recovered_from_target_sampler(draft_ids, num_draft, draft_probs, target_probs, u_accept, u_sample):
    """WRONG on purpose: the accept test is right, but a rejected position draws
    from p instead of norm(max(0, p - q)), which double-counts accepted mass."""
    num_rows, k = draft_ids.shape
    rows = torch.arange(num_rows)
    p_draft = target_probs[:, :k].gather(-1, draft_ids[..., None]).squeeze(-1)
    q_draft = draft_probs.gather(-1, draft_ids[..., None]).squeeze(-1)
    is_accepted = (u_accept * q_draft <= p_draft) & (torch.arange(k) < num_draft[:, None])
    num_accepted = is_accepted.long().cumprod(dim=1).sum(dim=1)
    output_ids = torch.full((num_rows, k + 1), -1)
    output_ids[:, :k] = torch.where(torch.arange(k) < num_accepted[:, None], draft_ids, -1)
    output_ids[rows, num_accepted] = sample_from_probs(target_probs[rows, num_accepted], u_sample[rows, num_accepted])
    return num_accepted, output_ids


def test_harness_rejects_a_sampler_that_recovers_from_p():
    p, q, proposal, num_draft = make_case("q_far")
    _, output_ids = speculate(recovered_from_target_sampler, p, q, proposal, num_draft, seed=1)
    assert chisquare_pvalue(output_ids[:, 0], p[0]) < P_VALUE_FLOOR
    _, output_ids = speculate(rejection_sample, p, q, proposal, num_draft, seed=1)  # same inputs, right sampler
    assert chisquare_pvalue(output_ids[:, 0], p[0]) > P_VALUE_FLOOR


def test_harness_rejects_q_processed_differently_from_the_draw():
    """Drafts drawn at temperature 1.5 but verified against q at 0.7: not lossless."""
    p, _, _, num_draft = make_case("temp1.0")
    g = torch.Generator().manual_seed(3)
    draft_logits = torch.randn(3, 24, generator=g) * 2
    drawn_from = processed(draft_logits, SamplingParams(temperature=1.5, seed=0))
    claimed = processed(draft_logits, SamplingParams(temperature=0.7, seed=0))
    _, output_ids = speculate(rejection_sample, p, claimed, drawn_from, num_draft, seed=2)
    assert chisquare_pvalue(output_ids[:, 0], p[0]) < P_VALUE_FLOOR
    _, output_ids = speculate(rejection_sample, p, drawn_from, drawn_from, num_draft, seed=2)
    assert chisquare_pvalue(output_ids[:, 0], p[0]) > P_VALUE_FLOOR


def test_coupled_verify_equals_rejection_sample_on_one_hot_rows():
    from speculation.rejection import coupled_verify

    g = torch.Generator().manual_seed(3)
    rows, k, vocab = 64, 4, 6  # a small vocabulary: drafts often match
    target_ids = torch.randint(0, vocab, (rows, k + 1), generator=g)
    draft_ids = torch.where(
        torch.rand(rows, k, generator=g) < 0.7, target_ids[:, :k], torch.randint(0, vocab, (rows, k), generator=g)
    )
    num_draft = torch.randint(0, k + 1, (rows,), generator=g)
    p = torch.nn.functional.one_hot(target_ids, vocab).float()
    q = torch.nn.functional.one_hot(draft_ids, vocab).float()
    u_accept = torch.rand(rows, k, generator=g, dtype=torch.float64)
    u_sample = torch.rand(rows, k + 1, generator=g, dtype=torch.float64)
    expected = rejection_sample(draft_ids, num_draft, q, p, u_accept, u_sample)
    actual = coupled_verify(draft_ids, num_draft, target_ids)
    assert torch.equal(actual[0], expected[0]) and torch.equal(actual[1], expected[1])
    assert 0 < expected[0].float().mean() < k
