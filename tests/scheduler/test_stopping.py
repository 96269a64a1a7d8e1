"""Where a request's output ends: stop token, max_tokens, the end of its grammar."""

from __future__ import annotations

from scheduler.stopping import append_tokens
from scheduler.types import FinishReason, Request, SamplingParams


class Grammar:
    """Allows tokens under `limit`; done once `length` tokens are in."""

    def __init__(self, length: int, limit: int = 100):
        self.length, self.limit, self.seen = length, limit, 0
        self.error: str | None = None

    @property
    def is_done(self) -> bool:
        return self.seen >= self.length

    def advance(self, token_ids: list[int]) -> bool:
        if any(t >= self.limit for t in token_ids):
            self.error = f"token {token_ids[0]} is not allowed here"
            return False
        self.seen += len(token_ids)
        return True

    def forced(self) -> list[int]:
        return []

    def accepts(self, token_ids: list[int]) -> int:
        return len(token_ids)


def request(max_tokens: int = 10, stops: frozenset[int] = frozenset(), grammar: Grammar | None = None) -> Request:
    r = Request("r", [1, 2], SamplingParams(max_tokens=max_tokens))
    r.stop_ids, r.constraint = stops, grammar
    return r


def test_a_stop_token_ends_the_output_and_is_not_appended():
    r = request(stops=frozenset({7}))
    out = append_tokens(r, [3, 4, 7, 5])
    assert out.new_ids == [3, 4] == r.output_ids and out.stop_id == 7 and out.finish is FinishReason.STOP


def test_max_tokens_cuts_a_step_that_emitted_more():
    r = request(max_tokens=3)
    out = append_tokens(r, [3, 4])
    assert out.finish is None and out.new_ids == [3, 4]
    out = append_tokens(r, [5, 6, 7])  # a verify step's accepted drafts past the limit are dropped
    assert out.new_ids == [5] and r.output_ids == [3, 4, 5] and out.finish is FinishReason.LENGTH


def test_a_complete_grammar_ends_the_output_and_a_refused_token_ends_it_with_the_reason():
    r = request(grammar=Grammar(length=2))
    out = append_tokens(r, [3, 4, 5])
    assert out.new_ids == [3, 4] and out.finish is FinishReason.STOP and out.error is None
    r = request(grammar=Grammar(length=5, limit=50))
    out = append_tokens(r, [3, 60, 4])
    assert out.new_ids == [3, 60] and out.finish is FinishReason.ERROR
    assert out.error == "the grammar could not go on: token 60 is not allowed here"
