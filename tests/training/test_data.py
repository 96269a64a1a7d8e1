"""The data pipeline: the target's answers, its features along them, the draft vocabulary."""

from __future__ import annotations

import time

import torch

from models.eagle_head import fused_feature_layers
from training.data import (
    TOP_K,
    DataConfig,
    Sequence,
    build_draft_vocab,
    build_sequences,
    coverage,
    length_groups,
    record_features,
    split_held_out,
    top_k_next,
)
from training.prompts import TrainingPrompt


def fake_sequence(ids: list[int], targets: list[int]) -> Sequence:
    return Sequence(torch.tensor(ids), 1, torch.zeros(len(ids), 4), torch.tensor(targets))


def test_answers_are_the_targets_greedy_tokens_and_features_are_its_last_hidden_state(tiny_loaded, tiny_sequences):
    assert len(tiny_sequences) >= 45
    assert all(0 < s.num_answer_tokens <= 24 for s in tiny_sequences)
    model = tiny_loaded.model
    for s in tiny_sequences[:3] + tiny_sequences[-3:]:  # short and long ones: padding changes nothing
        with torch.inference_mode():
            hidden = model.get_decoder()(input_ids=s.token_ids[None]).last_hidden_state[0]
            argmax = model.get_output_embeddings()(hidden).argmax(-1)
            probs = model.get_output_embeddings()(hidden).softmax(-1)
        torch.testing.assert_close(s.features, hidden, rtol=1e-4, atol=1e-4)
        assert torch.equal(s.target_next, argmax)
        # The soft targets: the target's TOP_K likeliest tokens at every position, with their probabilities.
        assert s.target_top_ids.shape == s.target_top_probs.shape == (len(s.token_ids), TOP_K)
        assert torch.equal(s.target_top_ids[:, 0], argmax)
        torch.testing.assert_close(s.target_top_probs.float(), probs.gather(-1, s.target_top_ids), rtol=1e-3, atol=1e-3)
        assert torch.equal(s.target_top_probs.float(), s.target_top_probs.float().sort(-1, descending=True).values)
        # Greedy answers: each answer token is the target's argmax at the position before it.
        answer = slice(s.prompt_len - 1, len(s.token_ids) - 1)
        assert torch.equal(s.token_ids[s.prompt_len :], s.target_next[answer])


def test_answering_past_its_deadline_leaves_out_the_prompts_it_never_reached(tiny_loaded):
    prompts = [TrainingPrompt(text=f"Say {w}.") for w in "abc"]
    assert build_sequences(tiny_loaded, prompts, DataConfig(max_tokens=4), deadline=time.monotonic()) == []


def test_top_k_next_is_the_softmax_top_k_whatever_the_chunk(tiny_loaded):
    lm_head = tiny_loaded.model.get_output_embeddings()
    torch.manual_seed(0)
    hidden = torch.randn(10, tiny_loaded.model.config.hidden_size)
    with torch.inference_mode():
        ids, probs = top_k_next(lm_head, hidden, rows=3)
        full = lm_head(hidden).softmax(-1)
        reference_probs, reference_ids = full.topk(TOP_K, dim=-1)
        whole_ids = top_k_next(lm_head, hidden)[0]
    torch.testing.assert_close(probs, reference_probs)
    # The same tokens, up to the order of near-ties: a GEMM of 3 rows sums in another order than
    # one of 10, so two tokens a last bit apart can swap places.
    torch.testing.assert_close(full.gather(-1, ids), reference_probs)
    torch.testing.assert_close(full.gather(-1, whole_ids), reference_probs)
    assert (ids == reference_ids).float().mean() > 0.9


def test_record_features_batches_unequal_lengths_like_one_at_a_time(tiny_loaded):
    prompts, answers = [[5, 6, 7], [8] * 20, [9, 10]], [[11], [], [12, 13, 14]]
    together = record_features(tiny_loaded, prompts, answers, batch_tokens=64)
    alone = [record_features(tiny_loaded, [p], [a])[0] for p, a in zip(prompts, answers)]
    for a, b in zip(together, alone):
        assert torch.equal(a.token_ids, b.token_ids) and a.prompt_len == b.prompt_len
        torch.testing.assert_close(a.features, b.features, rtol=1e-4, atol=1e-4)


def test_fused_features_are_the_layers_states_side_by_side_and_the_targets_its_own(tiny_loaded):
    layers = fused_feature_layers(tiny_loaded.model.config.num_hidden_layers)
    prompts, answers = [[5, 6, 7], [8] * 20], [[11], [12, 13]]
    last = record_features(tiny_loaded, prompts, answers, batch_tokens=64)
    fused = record_features(tiny_loaded, prompts, answers, batch_tokens=64, layers=layers)
    for a, b in zip(last, fused):
        with torch.inference_mode():
            out = tiny_loaded.model.get_decoder()(input_ids=b.token_ids[None], output_hidden_states=True)
        expected = torch.cat([out.hidden_states[i][0] for i in layers], -1)
        assert b.features.shape == (len(b.token_ids), len(layers) * tiny_loaded.model.config.hidden_size)
        torch.testing.assert_close(b.features, expected, rtol=1e-4, atol=1e-4)
        assert torch.equal(a.target_next, b.target_next)  # labels stay the target's argmax


def test_draft_vocab_holds_the_most_frequent_tokens_and_coverage_counts_targets():
    sequences = [fake_sequence([1, 2, 2, 3, 3, 3], [2, 2, 3, 3, 3, 9]), fake_sequence([3, 4], [4, 7])]
    vocab = build_draft_vocab(sequences, 2, vocab_size=10)
    assert vocab.tolist() == [3, 2]  # 3: 7 times, 2: 4 times
    # Targets the head learns (positions 1..): [2, 3, 3, 3, 9] and [7]: 4 of 6 inside {2, 3}.
    assert coverage(sequences, vocab, 10) == 4 / 6
    filled = build_draft_vocab(sequences, 8, vocab_size=10)
    assert filled[:6].tolist() == [3, 2, 4, 1, 7, 9] and sorted(filled.tolist()) == sorted(set(filled.tolist()))
    assert len(filled) == 8


def test_length_groups_respect_the_token_budget():
    lengths = [5, 50, 7, 30, 6, 200]
    groups = length_groups(lengths, 64)
    assert sorted(i for g in groups for i in g) == list(range(6))
    for group in groups:
        assert len(group) == 1 or max(lengths[i] for i in group) * len(group) <= 64
    assert groups[-1] == [5]  # longer than the budget: alone


def test_held_out_split_is_seeded_and_disjoint():
    sequences = [fake_sequence([i, i], [i, i]) for i in range(20)]
    train, held = split_held_out(sequences, 0.1, seed=3)
    assert len(held) == 2 and len(train) == 18 and not {id(s) for s in held} & {id(s) for s in train}
    again, _ = split_held_out(sequences, 0.1, seed=3)
    assert [id(s) for s in again] == [id(s) for s in train]
