"""Model-free proposers: n-gram prompt lookup and Predicted Outputs."""

from __future__ import annotations

from scheduler.types import Request, SamplingParams
from speculation.ngram import NgramIndex, NgramProposer, find_ngram_continuation
from speculation.prediction import PredictionIndex, PredictionProposer


def test_longest_ngram_wins_and_earliest_occurrence_is_copied():
    tokens = [1, 2, 3, 9, 9, 2, 3, 7, 1, 2, 3]
    # The 3-gram [1, 2, 3] occurs at 0 and 8 (the tail itself is excluded): copy what followed 0.
    assert find_ngram_continuation(tokens, tokens, 3, 1, 4, exclude_tail=True) == [9, 9, 2]
    assert find_ngram_continuation(tokens, tokens, 3, 1, 4, exclude_tail=True, earliest=False) == [9, 9, 2]
    tokens = [5, 6, 1, 5, 6, 2, 5, 6]
    assert find_ngram_continuation(tokens, tokens, 2, 1, 4, exclude_tail=True) == [1, 5]
    assert find_ngram_continuation(tokens, tokens, 2, 1, 4, exclude_tail=True, earliest=False) == [2, 5]
    assert find_ngram_continuation([4, 8], [1, 2, 3], 3, 1, 4, exclude_tail=False) == []
    assert find_ngram_continuation([1, 2], [1, 2, 3, 4, 5], 0, 1, 4, exclude_tail=False) == []


def test_ngram_proposer_respects_k_and_min_n():
    request = Request("r", [10, 11, 12, 13, 14, 10, 11], SamplingParams(max_tokens=8))
    (draft,) = NgramProposer(min_n=2, max_n=3).propose([request], [2])
    assert draft.token_ids == [12, 13] and draft.method == "ngram" and draft.token_probs is None
    (none,) = NgramProposer(min_n=3, max_n=3).propose([Request("s", [1, 2, 3, 4], SamplingParams())], [4])
    assert none.token_ids == []


def test_prediction_follows_then_resynchronises():
    request = Request("p", [1], SamplingParams(max_tokens=20))
    request.prediction_ids = [20, 21, 22, 23, 24, 25, 26, 27]
    proposer = PredictionProposer(max_n=4)
    assert proposer.propose([request], [3])[0].token_ids == [20, 21, 22]
    request.output_ids = [20, 21]
    assert proposer.propose([request], [3])[0].token_ids == [22, 23, 24]
    request.output_ids = [20, 21, 99, 23, 24]  # an edit, then back on the prediction
    assert proposer.propose([request], [2])[0].token_ids == [25, 26]


def test_prediction_index_matches_a_full_rescan():
    """Re-synchronising through the bigram index proposes what rescanning the prediction for the
    longest tail (2..max_n), latest occurrence, proposes."""
    import random

    rng = random.Random(1)
    for _trial in range(200):
        prediction = [rng.randrange(5) for _ in range(rng.randrange(3, 40))]  # < MAX_CANDIDATES places
        tokens = [rng.randrange(5) for _ in range(rng.randrange(2, 12))]
        k = rng.randrange(1, 6)
        expected = find_ngram_continuation(tokens, prediction, k, 2, 8, exclude_tail=False, earliest=False)
        assert PredictionIndex(prediction, max_n=8).continuation(tokens, k) == expected


def test_a_hostile_prediction_costs_bounded_work_a_step(monkeypatch):
    """One repeated token, 100k times, never followed: each step compares at most
    MAX_CANDIDATES x max_n tokens, not the prediction's length."""
    compared = 0

    class Counting(list):
        def __getitem__(self, key):
            nonlocal compared
            compared += 1
            return super().__getitem__(key)

    request = Request("h", [1], SamplingParams(max_tokens=50))
    request.prediction_ids = Counting([7] * 100_000)
    proposer = PredictionProposer(max_n=8)
    request.output_ids = [8]
    proposer.propose([request], [4])  # diverged: the index is built once here
    for step in range(20):
        request.output_ids = [8] + [7] * (step + 2)
        compared = 0
        (draft,) = proposer.propose([request], [4])
        assert draft.token_ids == [7]  # the latest place the tail occurs: the end
        assert compared <= PredictionIndex.MAX_CANDIDATES * 8 + 16


def test_ngram_index_matches_a_full_rescan_at_every_step():
    """The incremental index proposes exactly what rescanning the whole history proposes."""
    import random

    rng = random.Random(0)
    for _trial in range(20):
        min_n, max_n = rng.choice([(1, 4), (2, 3), (1, 1)])
        index = NgramIndex(min_n, max_n)
        tokens: list[int] = []
        for _ in range(60):
            new = [rng.randrange(6) for _ in range(rng.randrange(1, 4))]
            tokens += new
            index.extend(new)
            k = rng.randrange(0, 6)
            assert index.lookup(k) == find_ngram_continuation(tokens, tokens, k, min_n, max_n, exclude_tail=True)


def test_ngram_proposer_work_is_linear_in_new_tokens():
    """Per step the proposer touches O(new tokens), not the history (work counted, not timed)."""
    proposer = NgramProposer(min_n=1, max_n=4)
    request = Request("w", list(range(4000)), SamplingParams(max_tokens=200))
    proposer.propose([request], [4])
    index = proposer._index["w"]
    for step in range(50):
        before = index.work
        request.output_ids += [step % 7, (step * 3) % 11]  # two accepted tokens per step
        proposer.propose([request], [4])
        assert index.work - before <= 2 * 4 + 4  # 4 n-gram sizes per new token, <= 4 probes
    proposer.free("w")
    assert "w" not in proposer._index
