"""Where a request's output ends: a stop token, `max_tokens`, or the end of its grammar."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.types import FinishReason, Request


@dataclass
class Appended:
    """What `append_tokens` kept of a step's tokens, and whether (and why) the request ends."""

    new_ids: list[int] = field(default_factory=list)
    stop_id: int | None = None  # the stop token that ended it (never appended)
    finish: FinishReason | None = None
    error: str | None = None  # why the grammar ended it, where it refused a token


def append_tokens(request: Request, token_ids: list[int]) -> Appended:
    """Append `token_ids` to the request's output up to a stop token, `max_tokens` or the end of
    its grammar, advancing the grammar by each (it sees emitted tokens only). A complete grammar
    ends the request (end of sequence is all it could add); a token it refuses (its limits, or
    a masking fault) ends it with the grammar's reason."""
    params, stops, constraint = request.params, request.stop_ids, request.constraint
    out = Appended()
    for token_id in token_ids:
        if token_id in stops:
            out.stop_id, out.finish = token_id, FinishReason.STOP
            return out
        request.output_ids.append(token_id)
        out.new_ids.append(token_id)
        if constraint is not None:
            if not constraint.advance([token_id]):
                out.finish = FinishReason.ERROR
                out.error = f"the grammar could not go on: {constraint.error or 'it refused a token'}"
                return out
            if constraint.is_done:
                out.finish = FinishReason.STOP
                return out
        if len(request.output_ids) >= params.max_tokens:
            out.finish = FinishReason.LENGTH
            return out
    return out
