"""Grammar-forced drafts: where a request's grammar allows exactly one continuation, those
tokens are its draft, made at no cost and verified in the same step (a key, a quote, the
rest of an enum value). Under the grammar's mask such a token is the target's only
choice, so it is accepted unless another tokenization of the same text is also allowed."""

from __future__ import annotations

from collections.abc import Sequence

from scheduler.types import MAX_SPEC_TOKENS, Draft, Request
from speculation.proposer import Proposer


def forces(request: Request) -> bool:
    """The request's grammar forces tokens now and the request may speculate."""
    return (
        request.constraint is not None and request.params.speculation is not False and bool(request.constraint.forced())
    )


def forced_lengths(requests: Sequence[Request], caps: list[int], budget: int) -> list[int]:
    """Per row, how many grammar-forced tokens it may draft this step (free, and certain under the
    mask), within its cap and the step's token budget, in row order."""
    lengths = [0] * len(requests)
    for i, request in enumerate(requests):
        if caps[i] and budget > 0 and forces(request):
            assert request.constraint is not None
            lengths[i] = min(len(request.constraint.forced()), caps[i], MAX_SPEC_TOKENS, budget)
            budget -= lengths[i]
    return lengths


class GrammarProposer(Proposer):
    method = "grammar"

    def propose(
        self, requests: Sequence[Request], num_tokens: list[int], pending: Sequence[list[int]] | None = None
    ) -> list[Draft]:
        # Only for the tokens in hand: the grammar has not seen a step's pending tokens yet.
        return [
            Draft(self.method, [] if pending is not None or r.constraint is None else r.constraint.forced()[:k])
            for r, k in zip(requests, num_tokens)
        ]
