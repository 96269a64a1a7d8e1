"""Draft proposers: n-gram prompt lookup, Predicted Outputs, and a draft model
(suffix decoding is in `speculation.suffix`).

All speak one small interface: given the rows that speculate this step and
how many tokens each may draft, return a `Draft` per row (possibly shorter,
possibly empty). Model-free proposers have one-hot q (`probs` None).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import torch

from scheduler.types import Request


@dataclass(frozen=True)
class Capabilities:
    """What a proposer can do, as the policy and the runner read it."""

    # Drafts with forwards on the device: each position drafted costs one more forward, a
    # draft for a row that runs plain is not free (it probes instead of shadowing), and
    # prompt lookup may draft beside it.
    on_device: bool = False
    # Its draft for a row is made on the host from the request alone, so before the step the
    # runner can say how long each row's is (`Drafting.available`).
    drafts_ahead: bool = False
    # Its drafts carry each token's probability, which the policy prices them by (`Drafting.preview`).
    priced: bool = False
    # It remembers what finished requests generated (suffix decoding's cache, `specd_suffix_cache_nodes`).
    memory: bool = False

    @property
    def can_shadow(self) -> bool:
        """A draft for a row that runs plain costs nothing, so its next tokens can grade one."""
        return not self.on_device


CAPABILITIES: dict[str, Capabilities] = {
    "ngram": Capabilities(drafts_ahead=True),
    "prediction": Capabilities(drafts_ahead=True),
    "suffix": Capabilities(priced=True, memory=True),
    "draft_model": Capabilities(on_device=True),
    "eagle": Capabilities(on_device=True),
}
LOOKUP_METHOD = "ngram"  # the proposer of prompt-lookup drafts beside a device proposer

# Lengths of the drafts (at most k tokens each) a host proposer would make now for these requests.
DraftLengths = Callable[[list[Request], list[int]], list[int]]
# Per-token probabilities of the drafts a priced proposer would make now (at most k tokens each).
Preview = Callable[[list[Request], list[int]], list[list[float]]]


@dataclass(frozen=True)
class Drafting:
    """A runner's drafting as the scheduler sees it: the proposer, what it measured of itself,
    and the questions the policy may ask it while it plans a step (None: cannot answer)."""

    method: str = "none"  # "ngram", "suffix", "draft_model", "eagle" or "none"
    prior_rates: tuple[float, ...] = ()  # per draft position, its own acceptance record (an EAGLE head's)
    preview: Preview | None = None  # priced proposers: the drafts' token probabilities
    lookup: DraftLengths | None = None  # beside a device proposer: prompt-lookup drafts' lengths
    available: DraftLengths | None = None  # host-drafted rows (n-gram, Predicted Outputs): their drafts' lengths
    head: dict | None = None  # an EAGLE head being served: path, draft vocabulary, training record

    @property
    def capabilities(self) -> Capabilities | None:
        return CAPABILITIES.get(self.method)


@dataclass
class Draft:
    token_ids: list[int]
    method: str
    probs: torch.Tensor | None = None  # [k, vocab] draft distribution q; None = one-hot
    # Model-free proposers that estimate it: each token's probability given the draft before it
    # (for the policy's expected gain; the rejection sampler still sees one-hot q).
    token_probs: list[float] | None = None


@dataclass
class TokensAfter:
    """A request's tokens as they will stand after the step in flight: what the runner drafts
    the next step from before the scheduler has appended them (the fields model-free
    proposers read)."""

    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    prediction_ids: list[int] | None


class Proposer(Protocol):
    method: str
    capabilities: ClassVar[Capabilities]

    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[Draft]: ...

    def free(self, request_id: str) -> None: ...


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


class NgramProposer:
    """Prompt lookup decoding: copy what followed the first occurrence of the longest matching n-gram.

    Each request keeps an `NgramIndex` over its prompt and accepted output,
    extended with the tokens accepted since its last step.
    """

    method = "ngram"
    capabilities: ClassVar[Capabilities] = CAPABILITIES[method]

    def __init__(self, min_n: int = 1, max_n: int = 4):
        self.min_n, self.max_n = min_n, max_n
        self._index: dict[str, NgramIndex] = {}

    def propose(self, requests: Sequence[Request | TokensAfter], num_tokens: list[int]) -> list[Draft]:
        drafts = []
        for request, k in zip(requests, num_tokens):
            index = self._index.get(request.request_id)
            if index is None:
                index = self._index[request.request_id] = NgramIndex(self.min_n, self.max_n)
            seen = len(index.tokens)
            num_prompt = len(request.prompt_ids)
            if seen < num_prompt:
                index.extend(request.prompt_ids[seen:])
                seen = num_prompt
            index.extend(request.output_ids[seen - num_prompt :])
            drafts.append(Draft(index.lookup(k), self.method))
        return drafts

    def free(self, request_id: str) -> None:
        self._index.pop(request_id, None)


class PredictionIndex:
    """Where each bigram of a prediction ends (positions that have a continuation), built once.

    After the output diverges from the prediction, `continuation` re-synchronises on
    the longest tail (2..max_n tokens) of the output that occurs in the prediction,
    latest occurrence first, looking only at the `MAX_CANDIDATES` latest places the
    output's last bigram occurs: O(max_n x candidates) a step whatever the
    prediction's length (a prediction of one repeated token cannot make a step scan
    all of it).
    """

    MAX_CANDIDATES = 64

    def __init__(self, prediction: list[int], max_n: int = 8):
        self.prediction = prediction
        self.max_n = max_n
        self._ends: dict[tuple[int, int], list[int]] = {}
        for end in range(2, len(prediction)):  # end < len: a continuation follows
            self._ends.setdefault((prediction[end - 2], prediction[end - 1]), []).append(end)

    def continuation(self, tokens: list[int], k: int) -> list[int]:
        if k <= 0 or len(tokens) < 2:
            return []
        ends = self._ends.get((tokens[-2], tokens[-1]))
        if not ends:
            return []
        prediction, longest = self.prediction, min(self.max_n, len(tokens))
        best_end, best_n = 0, 0
        for end in reversed(ends[-self.MAX_CANDIDATES :]):  # latest first: ties keep the latest
            n = 2
            while n < longest and end > n and prediction[end - n - 1] == tokens[-n - 1]:
                n += 1
            if n > best_n:
                best_end, best_n = end, n
                if n == longest:
                    break
        return prediction[best_end : best_end + k]


@dataclass
class _PredictionState:
    index: PredictionIndex | None = None  # built at the first divergence
    checked: int = 0  # output tokens compared with the prediction so far
    diverged: bool = False


class PredictionProposer:
    """OpenAI Predicted Outputs: the request's `prediction` is the draft.

    While the output still equals a prefix of the prediction, propose the next
    prediction tokens; after a divergence, re-synchronise on the longest n-gram
    of the output's tail that occurs in the prediction (`PredictionIndex`: edits
    in the middle of a predicted file keep paying after the edit). Each step costs
    O(new tokens + max_n), never a rescan of the prediction.
    """

    method = "prediction"
    capabilities: ClassVar[Capabilities] = CAPABILITIES[method]

    def __init__(self, max_n: int = 8):
        self.max_n = max_n
        self._state: dict[str, _PredictionState] = {}

    def propose(self, requests: Sequence[Request | TokensAfter], num_tokens: list[int]) -> list[Draft]:
        drafts = []
        for request, k in zip(requests, num_tokens):
            prediction = request.prediction_ids or []
            out = request.output_ids
            state = self._state.setdefault(request.request_id, _PredictionState())
            if not state.diverged:
                upto = min(len(out), len(prediction))
                state.diverged = (
                    len(out) > len(prediction) or out[state.checked : upto] != prediction[state.checked : upto]
                )
                state.checked = len(out)
            if not state.diverged:
                ids = prediction[len(out) : len(out) + k]
            else:
                if state.index is None:
                    state.index = PredictionIndex(prediction, self.max_n)
                ids = state.index.continuation(out, k)
            drafts.append(Draft(ids, self.method))
        return drafts

    def free(self, request_id: str) -> None:
        self._state.pop(request_id, None)
