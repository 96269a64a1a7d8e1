"""Per-chunk speculation counts for `stream_options.include_speculation`.

The engine reports cumulative counters per request; a choice's chunks carry
their differences since the previous chunk. The accepted / rejected counts
are differences of the very numbers usage reports (`Choice.usage_details`),
and the token count of the completion tokens usage counts, so a client that
sums a choice's chunks gets its usage back, whatever text was held back
between chunks (stop strings, split characters) or cut by a stop string.
"""

from __future__ import annotations

from scheduler.types import RequestOutput
from server.protocol import ChunkSpeculation


class SpeculationTally:
    """One choice's engine steps since its previous chunk."""

    def __init__(self) -> None:
        self._steps = 0
        self._speculative_steps = 0
        self._drafted = 0  # the request's draft tokens as of the last output seen
        self._sent = (0, 0, 0)  # (tokens, accepted, rejected) as of the previous chunk

    def add(self, out: RequestOutput) -> None:
        """Count one engine output (one step of this choice, unless it only reports an abort)."""
        drafted = out.num_draft_tokens - self._drafted
        self._drafted = out.num_draft_tokens
        if out.new_token_ids or out.stop_token_id is not None or drafted:
            self._steps += 1
        if drafted:
            self._speculative_steps += 1

    def take(self, tokens: int, accepted: int, rejected: int) -> ChunkSpeculation:
        """The chunk's counts, from the choice's running totals; the next chunk starts from here."""
        sent_tokens, sent_accepted, sent_rejected = self._sent
        chunk = ChunkSpeculation(
            tokens=tokens - sent_tokens,
            accepted_tokens=accepted - sent_accepted,
            draft_tokens=accepted - sent_accepted + rejected - sent_rejected,
            rejected_tokens=rejected - sent_rejected,
            steps=self._steps,
            speculative_steps=self._speculative_steps,
        )
        self._sent = (tokens, accepted, rejected)
        self._steps = self._speculative_steps = 0
        return chunk
