"""Model-free proposers: n-gram prompt lookup and Predicted Outputs."""

from __future__ import annotations

from models.proposers import NgramProposer, PredictionProposer, find_ngram_continuation
from scheduler.types import Request, SamplingParams


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
    assert draft.token_ids == [12, 13] and draft.method == "ngram" and draft.probs is None
    (none,) = NgramProposer(min_n=3, max_n=3).propose([Request("s", [1, 2, 3, 4], SamplingParams())], [4])
    assert none.token_ids == []


def test_prediction_follows_then_resynchronises():
    request = Request("p", [1], SamplingParams(max_tokens=20))
    request.prediction_ids = [20, 21, 22, 23, 24, 25, 26, 27]
    proposer = PredictionProposer(min_n=2, max_n=4)
    assert proposer.propose([request], [3])[0].token_ids == [20, 21, 22]
    request.output_ids = [20, 21]
    assert proposer.propose([request], [3])[0].token_ids == [22, 23, 24]
    request.output_ids = [20, 21, 99, 23, 24]  # an edit, then back on the prediction
    assert proposer.propose([request], [2])[0].token_ids == [25, 26]
