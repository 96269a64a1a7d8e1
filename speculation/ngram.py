"""Prompt lookup decoding (n-gram): drafts copied from what followed the longest n-gram of the
request's tail found earlier in its prompt or output."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from scheduler.types import Draft, Request
from speculation.proposer import BuildContext, Proposer


def find_ngram_continuation(
    tokens: list[int],
    source: list[int],
    k: int,
    min_n: int,
    max_n: int,
    exclude_tail: bool,
    earliest: bool = True,
) -> list[int]:
    """Longest n-gram (max_n down to min_n) ending `tokens` that also occurs in
    `source`; return up to k tokens that followed its earliest (or latest)
    occurrence.

    Earliest suits prompt lookup: the first occurrence is usually the passage
    being copied (measured on SmolLM2 extraction prompts: 2.72 tokens per step
    against 2.51 with the latest). With exclude_tail the match may not be the
    suffix of `source` itself (source is tokens: the suffix matches itself).
    """
    if k <= 0:
        return []
    limit = len(source) - 1 if exclude_tail else len(source)
    for n in range(min(max_n, len(tokens)), min_n - 1, -1):
        pattern = tokens[-n:]
        first = pattern[0]
        last_start = limit - n
        starts = range(0, last_start + 1) if earliest else range(last_start, -1, -1)
        for start in starts:
            if source[start] == first and source[start : start + n] == pattern:
                follow = source[start + n : start + n + k]
                if follow:
                    return follow
    return []


@dataclass
class NgramIndex:
    """Earliest end position of every n-gram (min_n..max_n) of one token stream.

    Tokens only ever append (the index covers accepted tokens, never drafts),
    so each new token adds max_n - min_n + 1 entries: O(new tokens) per step.
    `lookup` gives what `find_ngram_continuation(tokens, tokens, k, ...,
    exclude_tail=True)` gives, without rescanning the history.
    """

    min_n: int
    max_n: int
    tokens: list[int] = field(default_factory=list)
    _first_end: dict[tuple[int, ...], int] = field(default_factory=dict)
    work: int = 0  # entries inserted or probed: what a test can count

    def extend(self, new_tokens: list[int]) -> None:
        tokens = self.tokens
        for token in new_tokens:
            tokens.append(token)
            end = len(tokens)
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._first_end.setdefault(tuple(tokens[end - n : end]), end)
                self.work += 1

    def lookup(self, k: int) -> list[int]:
        """Up to k tokens that followed the earliest earlier occurrence of the longest n-gram ending the stream."""
        tokens = self.tokens
        length = len(tokens)
        if k <= 0:
            return []
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            self.work += 1
            end = self._first_end.get(tuple(tokens[length - n :]))
            if end is not None and end < length:  # an occurrence other than the tail itself
                return tokens[end : end + k]
        return []


class NgramProposer(Proposer):
    """Prompt lookup decoding: copy what followed the first occurrence of the longest matching n-gram.

    Each request keeps an `NgramIndex` over its prompt and accepted output,
    extended with the tokens accepted since its last step.
    """

    method = "ngram"

    def __init__(self, min_n: int = 1, max_n: int = 4):
        self.min_n, self.max_n = min_n, max_n
        self._index: dict[str, NgramIndex] = {}

    @classmethod
    def build(cls, context: BuildContext) -> NgramProposer:
        return cls(context.config.ngram_min, context.config.ngram_max)

    def propose(
        self, requests: Sequence[Request], num_tokens: list[int], pending: Sequence[list[int]] | None = None
    ) -> list[Draft]:
        drafts = []
        for r, (request, k) in enumerate(zip(requests, num_tokens)):
            index = self._index.get(request.request_id)
            if index is None:
                index = self._index[request.request_id] = NgramIndex(self.min_n, self.max_n)
            seen = len(index.tokens)
            num_prompt = len(request.prompt_ids)
            if seen < num_prompt:
                index.extend(request.prompt_ids[seen:])
                seen = num_prompt
            index.extend(request.output_ids[seen - num_prompt :])
            if pending is not None:
                index.extend(pending[r])
            drafts.append(Draft(self.method, index.lookup(k)))
        return drafts

    def free(self, request_id: str) -> None:
        self._index.pop(request_id, None)
