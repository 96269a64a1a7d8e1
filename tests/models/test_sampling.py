"""models.sampling against simple per-row references written here."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from models.sampling import (
    STREAM_ACCEPT,
    STREAM_SAMPLE,
    SamplingTensors,
    compute_logprobs,
    process_logits,
    sample_from_probs,
    uniform_noise,
)
from scheduler.types import SamplingParams
from tests.support.tensors import sampling_tensors, token_counts

V = 50
P_VALUE_FLOOR = 1e-3  # a statistical check fails only below this p-value (fixed seeds: deterministic)


def make_st(params: list[SamplingParams], vocab_size: int = V) -> SamplingTensors:
    return sampling_tensors(params, vocab_size, "cpu")


def random_logits(num_rows: int, n: int = 1, vocab_size: int = V, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, n, vocab_size, generator=g) * 3  # [R, n, V], ties have probability 0


def no_history(num_rows: int, vocab_size: int = V) -> tuple[torch.Tensor, torch.Tensor]:
    counts = torch.zeros(num_rows, vocab_size, dtype=torch.int32)
    return counts, counts > 0


# -- references: one row, one position, float64 numpy ----------------------------------


def ref_penalised(logits: np.ndarray, p: SamplingParams, prompt: list[int], output: list[int]) -> np.ndarray:
    x = logits.astype(np.float64).copy()
    for token_id, bias in p.logit_bias.items():
        if 0 <= token_id < len(x):
            x[token_id] += bias
    seen = set(prompt) | set(output)
    for t in seen:
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):
        x[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return x


def ref_probs(x: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Filters applied one after another on an explicit distribution."""
    if p.is_greedy:
        out = np.zeros_like(x)
        out[int(np.argmax(x))] = 1.0
        return out
    probs = np.exp(x / p.temperature - np.max(x / p.temperature))
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    if 0 < p.top_k < len(x):
        probs[order[p.top_k :]] = 0.0
        probs /= probs.sum()
    if p.top_p < 1.0:
        kept, mass = [], 0.0
        for t in order:
            if mass >= p.top_p:
                break
            kept.append(t)
            mass += probs[t]
        mask = np.zeros(len(x), dtype=bool)
        mask[kept] = True
        probs[~mask] = 0.0
        probs /= probs.sum()
    if p.min_p > 0.0:
        probs[probs < p.min_p * probs.max()] = 0.0
        probs /= probs.sum()
    return probs


# -- SamplingTensors / counts ---------------------------------------------------------


def test_plan_and_resolve_pack_rows_and_flags():
    params = [
        SamplingParams(temperature=0.0, top_k=5, seed=1),
        SamplingParams(temperature=0.8, top_k=-1, top_p=0.9, logit_bias={3: 2.0, 999: 1.0}, seed=2),
        SamplingParams(top_k=V + 10, repetition_penalty=1.2, seed=3),
    ]
    st_ = make_st(params)
    assert st_.top_k.tolist() == [5, 0, 0]  # -1 and >= V mean off
    assert st_.is_greedy.tolist() == [True, False, False]
    assert st_.seeds.tolist() == [1, 2, 3]
    assert not st_.has_top_k  # the only top_k is on a greedy row
    assert st_.has_top_p and not st_.has_min_p and st_.has_penalties
    assert not st_.all_greedy and st_.any_greedy
    # Out-of-vocabulary bias ids are dropped.
    assert st_.logit_bias.shape == (3, V) and st_.logit_bias[1, 3].item() == 2.0
    assert st_.logit_bias.abs().sum().item() == 2.0

    plain = make_st([SamplingParams(seed=0)] * 2)
    assert not (plain.has_top_k or plain.has_top_p or plain.has_min_p or plain.has_penalties or plain.has_logit_bias)


def test_token_counts_count_each_row():
    counts = token_counts([[1, 1, 4], [], [0, 4, 4, 4]], 6, "cpu")
    assert counts.tolist() == [[0, 2, 0, 0, 1, 0], [0] * 6, [1, 0, 0, 0, 3, 0]]
    assert token_counts([[], []], 3, "cpu").tolist() == [[0] * 3] * 2


# -- process_logits --------------------------------------------------------------------


def test_greedy_rows_are_exact_one_hot_argmax():
    params = [SamplingParams(temperature=0.0, seed=0), SamplingParams(temperature=0.9, seed=1)] * 2
    logits = random_logits(4, n=3)
    probs = process_logits(logits, make_st(params), *no_history(4), draft_ids=None)
    for r in (0, 2):
        expected = torch.nn.functional.one_hot(logits[r].argmax(-1), V).float()
        assert torch.equal(probs[r], expected)
    assert not torch.equal(probs[1], torch.nn.functional.one_hot(logits[1].argmax(-1), V).float())

    all_greedy = process_logits(logits, make_st([SamplingParams(temperature=0.0, seed=0)] * 4), *no_history(4))
    assert torch.equal(all_greedy, torch.nn.functional.one_hot(logits.argmax(-1), V).float())


FILTER_CASES = [
    dict(temperature=0.7),
    dict(temperature=1.0),
    dict(temperature=1.5),
    dict(temperature=1.0, top_k=1),
    dict(temperature=0.8, top_k=7),
    dict(temperature=1.2, top_p=0.5),
    dict(temperature=1.0, top_p=0.95),
    dict(temperature=1.0, min_p=0.1),
    dict(temperature=0.9, top_k=20, top_p=0.8, min_p=0.05),
    dict(temperature=0.0, top_k=3),
]


def test_filters_match_reference_in_one_mixed_batch():
    params = [SamplingParams(seed=i, **kw) for i, kw in enumerate(FILTER_CASES)]
    logits = random_logits(len(params), n=2, seed=1)
    probs = process_logits(logits, make_st(params), *no_history(len(params)))
    assert probs.dtype == torch.float32
    for r, p in enumerate(params):
        for j in range(2):
            expected = ref_probs(logits[r, j].numpy(), p)
            np.testing.assert_allclose(probs[r, j].numpy(), expected, atol=1e-6, err_msg=str(FILTER_CASES[r]))


def test_top_p_keeps_smallest_set_reaching_mass():
    logits = torch.log(torch.tensor([[[0.5, 0.3, 0.15, 0.05]]]))
    for top_p, support in [(0.5, 1), (0.50001, 2), (0.8, 2), (0.81, 3), (1e-6, 1), (1.0, 4)]:
        probs = process_logits(logits, make_st([SamplingParams(top_p=top_p, seed=0)], 4), *no_history(1, 4))
        assert int((probs > 0).sum()) == support, top_p


def test_penalties_with_drafts_match_sequential_decoding():
    """Position j of a verify row is penalised as if drafts[:j] had been emitted one by one."""
    params = [
        SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4, seed=0),
        SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=-0.7, seed=1),
        SamplingParams(presence_penalty=-1.5, logit_bias={7: 3.0, 8: -100.0}, seed=2),
        SamplingParams(seed=3),  # no penalty on this row, others in the batch have some
    ]
    prompts = [[1, 2, 3, 3], [5], [], [9, 9]]
    outputs = [[3, 4, 4], [], [7, 7, 7, 2], [1]]
    drafts = [[4, 6, 4], [5, 5, -1], [2, -1, -1], [9, 9, 9]]  # -1 pads rows with fewer drafts
    num_rows, n = len(params), 4
    logits = random_logits(num_rows, n=n, seed=2)
    st_ = make_st(params)
    probs = process_logits(
        logits,
        st_,
        token_counts(outputs, V, "cpu"),
        token_counts(prompts, V, "cpu") > 0,
        draft_ids=torch.tensor(drafts),
    )
    for r, p in enumerate(params):
        for j in range(n):
            history = outputs[r] + [t for t in drafts[r][:j] if t >= 0]
            expected = ref_probs(ref_penalised(logits[r, j].numpy(), p, prompts[r], history), p)
            np.testing.assert_allclose(probs[r, j].numpy(), expected, atol=1e-6, err_msg=f"row {r} pos {j}")


def test_logit_bias_moves_mass_and_greedy_choice():
    logits = torch.zeros(2, 1, V)
    params = [
        SamplingParams(logit_bias={11: 100.0}, seed=0),
        SamplingParams(temperature=0.0, logit_bias={42: 1.0}, seed=1),
    ]
    probs = process_logits(logits, make_st(params), None, None)
    assert probs[0, 0, 11] > 0.999
    assert probs[1, 0].argmax() == 42 and probs[1, 0, 42] == 1.0
    expected = ref_probs(ref_penalised(logits[0, 0].numpy(), params[0], [], []), params[0])
    np.testing.assert_allclose(probs[0, 0].numpy(), expected, atol=1e-6)


def test_inf_and_ties_never_give_nan():
    logits = torch.full((4, 2, V), float("-inf"))
    logits[0, :, :3] = 1.0  # ties
    logits[1, :, 5] = 2.0  # a single finite logit
    logits[2] = 0.0  # all tied
    # row 3: all -inf (a padding row)
    for kw in [dict(), dict(top_p=0.5), dict(top_k=2), dict(min_p=0.5), dict(temperature=0.0), dict(temperature=1e-4)]:
        params = [SamplingParams(seed=r, **kw) for r in range(4)]
        probs = process_logits(logits, make_st(params), *no_history(4))
        assert not probs.isnan().any(), kw
        torch.testing.assert_close(probs.sum(-1), torch.ones(4, 2))
        assert probs[1, :, 5].eq(1.0).all(), kw
        assert probs[0, :, 3:].eq(0.0).all(), kw
    greedy = process_logits(logits, make_st([SamplingParams(temperature=0.0, seed=0)] * 4), *no_history(4))
    assert greedy[0, :, 0].eq(1.0).all() and greedy[2, :, 0].eq(1.0).all()  # ties: lowest id


def test_does_not_modify_caller_logits():
    logits = random_logits(2, n=2)
    before = logits.clone()
    params = [SamplingParams(repetition_penalty=1.5, logit_bias={0: 5.0}, top_k=3, seed=r) for r in range(2)]
    process_logits(logits, make_st(params), *no_history(2))
    assert torch.equal(logits, before)


@settings(max_examples=40, deadline=None)
@given(
    temperature=st.sampled_from([0.0, 0.3, 1.0, 2.0]),
    top_k=st.integers(-1, 12),
    top_p=st.floats(0.05, 1.0),
    min_p=st.floats(0.0, 0.9),
    repetition_penalty=st.floats(0.5, 2.0),
    seed=st.integers(0, 2**16),
)
def test_probs_are_distributions_whatever_the_params(temperature, top_k, top_p, min_p, repetition_penalty, seed):
    p = SamplingParams(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty, seed=0
    )
    logits = random_logits(1, n=2, vocab_size=12, seed=seed)
    counts = token_counts([[1, 2, 2]], 12, "cpu")
    probs = process_logits(logits, make_st([p], 12), counts, counts > 0, torch.tensor([[3]]))
    assert not probs.isnan().any()
    torch.testing.assert_close(probs.sum(-1), torch.ones(1, 2))
    assert (probs >= 0).all()
    if 0 < top_k:
        assert int((probs[0, 0] > 0).sum()) <= top_k


# -- uniform_noise ---------------------------------------------------------------------


def splitmix_reference(seed: int, position: int, stream: int) -> float:
    mask = (1 << 64) - 1

    def mix(x: int) -> int:
        z = (x + 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    h = mix(mix(mix(seed) ^ position) ^ stream)
    return (h >> 11) * 2.0**-53


def test_uniform_noise_matches_unsigned_reference():
    seeds = [0, 1, 12345, 2**62 + 7, 2**63 - 1]
    positions = [0, 1, 17, 2**40]
    u = uniform_noise(torch.tensor(seeds), torch.tensor([positions] * len(seeds)), stream=3)
    assert u.dtype == torch.float64
    for i, s in enumerate(seeds):
        for j, pos in enumerate(positions):
            assert u[i, j].item() == splitmix_reference(s, pos, 3)


def test_uniform_noise_is_independent_of_batch_composition():
    seeds = torch.tensor([5, 9, 5, 123456789])
    positions = torch.tensor([[0, 1, 2], [7, 8, 9], [3, 4, 5], [0, 1, 2]])
    u = uniform_noise(seeds, positions, STREAM_SAMPLE)
    again = uniform_noise(seeds[[3, 0]], positions[[3, 0]], STREAM_SAMPLE)
    assert torch.equal(again, u[[3, 0]])
    single = uniform_noise(seeds[2:3], positions[2:3, 1:2], STREAM_SAMPLE)
    assert single.item() == u[2, 1].item()
    assert not torch.equal(uniform_noise(seeds, positions, STREAM_ACCEPT), u)


def test_uniform_noise_is_uniform_and_decorrelated():
    num_seeds, num_positions = 2000, 25
    seeds = torch.arange(num_seeds) + 1000  # consecutive seeds: the hard case for a weak hash
    positions = torch.arange(num_positions).expand(num_seeds, -1)
    u0 = uniform_noise(seeds, positions, 0)
    u1 = uniform_noise(seeds, positions, 1)
    assert ((u0 >= 0) & (u0 < 1)).all()
    assert stats.kstest(u0.flatten().numpy(), "uniform").pvalue > P_VALUE_FLOOR
    assert stats.kstest(u1.flatten().numpy(), "uniform").pvalue > P_VALUE_FLOOR

    def pearson_pvalue(a: torch.Tensor, b: torch.Tensor) -> float:
        return stats.pearsonr(a.flatten().numpy(), b.flatten().numpy()).pvalue

    assert pearson_pvalue(u0, u1) > P_VALUE_FLOOR  # streams
    assert pearson_pvalue(u0[:, :-1], u0[:, 1:]) > P_VALUE_FLOOR  # adjacent positions
    assert pearson_pvalue(u0[:-1], u0[1:]) > P_VALUE_FLOOR  # adjacent seeds
    # Joint uniformity of (stream 0, stream 1) pairs on a 10 x 10 grid.
    cells = (u0 * 10).long() * 10 + (u1 * 10).long()
    counts = torch.bincount(cells.flatten(), minlength=100).numpy()
    assert stats.chisquare(counts).pvalue > P_VALUE_FLOOR


# -- sample_from_probs -----------------------------------------------------------------


def test_sample_from_probs_matches_frequencies():
    probs = torch.tensor([0.0, 0.05, 0.3, 0.0, 0.15, 0.4, 0.1, 0.0])
    num_samples = 20000
    u = uniform_noise(torch.arange(num_samples), torch.zeros(num_samples, 1, dtype=torch.long), STREAM_SAMPLE)
    ids = sample_from_probs(probs.expand(num_samples, 1, -1), u)  # [R, 1]
    assert ids.shape == (num_samples, 1) and ids.dtype == torch.int64
    counts = torch.bincount(ids.flatten(), minlength=len(probs)).numpy()
    assert counts[probs.numpy() == 0].sum() == 0
    support = probs.numpy() > 0
    assert stats.chisquare(counts[support], probs.numpy()[support] * num_samples).pvalue > P_VALUE_FLOOR


def test_sample_from_probs_edges():
    probs = torch.tensor([[0.0, 0.5, 0.5, 0.0, 0.0], [0.2, 0.0, 0.0, 0.0, 0.8]])
    u_max = torch.tensor([1.0 - 2.0**-53] * 2, dtype=torch.float64)
    assert sample_from_probs(probs, u_max).tolist() == [2, 4]  # trailing zero-mass ids never picked
    assert sample_from_probs(probs, torch.zeros(2, dtype=torch.float64)).tolist() == [1, 0]
    unnormalised = torch.tensor([[0.0, 3.0, 1.0]])
    assert sample_from_probs(unnormalised, torch.tensor([0.74], dtype=torch.float64)).tolist() == [1]
    assert sample_from_probs(unnormalised, torch.tensor([0.76], dtype=torch.float64)).tolist() == [2]
    assert sample_from_probs(torch.zeros(1, 4), torch.tensor([0.5], dtype=torch.float64)).tolist() == [0]


# -- compute_logprobs ------------------------------------------------------------------


@pytest.mark.parametrize("top_n", [0, 1, 5])
def test_compute_logprobs_matches_log_softmax(top_n):
    logits = random_logits(6).squeeze(1)  # [N, V]
    token_ids = torch.tensor([0, 3, 49, 7, 7, 20])
    chosen, top_ids, top_logprobs = compute_logprobs(logits, token_ids, top_n)
    reference = torch.log_softmax(logits.double(), dim=-1)
    torch.testing.assert_close(chosen.double(), reference[torch.arange(6), token_ids], atol=1e-5, rtol=0)
    assert top_ids.shape == top_logprobs.shape == (6, top_n)
    assert torch.equal(top_ids, reference.topk(top_n, dim=-1).indices)
    torch.testing.assert_close(top_logprobs.double(), reference.topk(top_n, dim=-1).values, atol=1e-5, rtol=0)


@pytest.mark.parametrize("shape", [(3, 49152), (2, 4, 4096), (5, 100), (1, 1 << 17)])
def test_blocked_argmax_is_torch_argmax_ties_included(shape):
    from models.sampling import argmax

    g = torch.Generator().manual_seed(0)
    x = torch.randint(-3, 4, shape, generator=g).float()  # many ties: the first maximum must win
    assert torch.equal(argmax(x), x.argmax(dim=-1))
    x = torch.randn(shape, generator=g)
    assert torch.equal(argmax(x), x.argmax(dim=-1))


@pytest.mark.parametrize("vocab", [7, 320, 49152, 151936])
def test_the_two_level_draw_is_the_inverse_cdf_and_a_rows_own(vocab):
    """Block sums then one block's running sum pick the id a running sum over the whole
    vocabulary picks, and each row's id alone is its id in a batch (so the plain path, a
    verify and a coupled draft draw a position alike)."""
    g = torch.Generator().manual_seed(vocab)
    probs = torch.rand(8, 3, vocab, generator=g).pow(8).softmax(-1)
    probs[0, 0, : vocab // 2] = 0.0  # zero mass is never picked
    u = torch.rand(8, 3, generator=g, dtype=torch.float64)
    cdf = probs.double().cumsum(-1)
    expected = torch.searchsorted(cdf, (u[..., None] * cdf[..., -1:]).contiguous(), right=True).squeeze(-1)
    drawn = sample_from_probs(probs, u)
    assert torch.equal(drawn, expected.clamp(max=vocab - 1))
    alone = torch.stack([sample_from_probs(probs[r, j], u[r, j]) for r in range(8) for j in range(3)])
    assert torch.equal(alone.view(8, 3), drawn)
