"""Model-free drafts on the host: Predicted Outputs, prompt lookup, suffix decoding's own.

One place decides which host proposer drafts for a row (its prediction, else prompt lookup:
the proposer itself or the lookup beside a draft model or head), makes each row's draft for
the next step at the end of the step that produced its tokens (on the step thread, carried
on the request as `HostDraft`), and answers the policy's and the step's questions from it,
so a draft is proposed once per step, never on the event loop in the common case.
"""

from __future__ import annotations

import logging
from typing import cast

from scheduler.types import MAX_SPEC_TOKENS, HostDraft, Request, RowOutput, ScheduledRow
from speculation.device_draft import DeviceProposer
from speculation.proposers import Draft, NgramProposer, PredictionProposer, Proposer, TokensAfter

logger = logging.getLogger("specd.models")


class HostDrafts:
    """The host side of a runner's drafting; `proposer` is the runner's (any kind), `lookup`
    prompt lookup beside a device proposer (else None)."""

    def __init__(self, proposer: Proposer | DeviceProposer | None, lookup: NgramProposer | None):
        self.proposer = proposer
        self.lookup = lookup
        self.prediction = PredictionProposer()

    def free(self, request_id: str) -> None:
        self.prediction.free(request_id)
        if self.proposer:
            self.proposer.free(request_id)
        if self.lookup:
            self.lookup.free(request_id)

    @property
    def drafts_ahead(self) -> bool:
        """The runner's proposer makes its drafts on the host from the request alone (n-gram)."""
        return self.proposer is not None and self.proposer.capabilities.drafts_ahead

    @property
    def on_device(self) -> bool:
        return self.proposer is not None and self.proposer.capabilities.on_device

    def proposer_for(self, request: Request) -> NgramProposer | PredictionProposer | None:
        """The proposer that drafts ahead for a row: its prediction, else prompt lookup (the
        proposer itself, or the lookup beside a device proposer); None: no such draft."""
        if request.prediction_ids:
            return self.prediction
        if self.drafts_ahead:
            return cast(NgramProposer, self.proposer)
        return self.lookup

    # -- what the policy asks while it plans (event loop) --
    def lengths(self, requests: list[Request], num_tokens: list[int]) -> list[int]:
        """How many tokens (at most `num_tokens`) each row's host draft carries now: Predicted
        Outputs' for a row with a prediction, else the n-gram proposer's. The step that follows
        verifies those very drafts. Rows only a forward or a preview can answer for (a draft
        model, a head, suffix decoding) keep `num_tokens`."""
        drafts = self.drafts(requests, num_tokens)
        return [
            len(d.token_ids) if d is not None and (r.prediction_ids or self.drafts_ahead) else k
            for r, k, d in zip(requests, num_tokens, drafts)
        ]

    def lookup_lengths(self, requests: list[Request], num_tokens: list[int]) -> list[int]:
        return [len(d.token_ids) if d else 0 for d in self.drafts(requests, num_tokens)]

    def drafts(self, requests: list[Request], num_tokens: list[int]) -> list[Draft | None]:
        """Each row's host draft of at most k tokens: the one made at the end of the last
        step (`Request.host_draft`) where it covers the request's tokens, else made now."""
        drafts: list[Draft | None] = []
        for request, k in zip(requests, num_tokens):
            proposer = self.proposer_for(request)
            if proposer is None:
                drafts.append(None)
                continue
            cached = request.host_draft
            if cached is not None and cached.fits(proposer.method, request.num_tokens, k):
                drafts.append(Draft(cached.token_ids[:k], proposer.method))
                continue
            try:
                (draft,) = proposer.propose([request], [k])
            except Exception:  # noqa: BLE001 - a failed draft costs speed, never a request
                logger.exception("%s proposer failed; this row drafts nothing this step", proposer.method)
                draft = Draft([], proposer.method)
            drafts.append(draft)
        return drafts

    # -- what the step needs (step thread) --
    def for_step(self, rows: list[ScheduledRow], device_drafting: bool) -> tuple[list[Draft | None], list[int]]:
        """Model-free drafts per row, and the rows a device proposer will draft for on the device."""
        drafts: list[Draft | None] = [None] * len(rows)
        spec = [i for i, row in enumerate(rows) if row.sample and row.num_spec_tokens > 0]
        if self.on_device:
            host = [
                i for i in spec if rows[i].request.prediction_ids or (self.lookup is not None and rows[i].use_lookup)
            ]
            on_device = [i for i in spec if i not in host]
        elif self.drafts_ahead:
            host, on_device = spec, []
        else:  # suffix decoding (its own drafts) or none: host drafts for predictions only
            host = [i for i in spec if rows[i].request.prediction_ids]
            others = [i for i in spec if not rows[i].request.prediction_ids]
            if self.proposer is not None:
                _run(cast(Proposer, self.proposer), rows, others, drafts, [rows[i].num_spec_tokens for i in others])
            on_device = []
        self._fill(drafts, rows, host, [rows[i].num_spec_tokens for i in host])
        return drafts, on_device if device_drafting else []

    def shadows(self, rows: list[ScheduledRow]) -> dict[int, list[int]]:
        """Unverified drafts the policy asked for, to learn rows' acceptance at no verify cost: a
        model-free proposer's (or, beside a device proposer, prompt lookup's)."""
        drafts: list[Draft | None] = [None] * len(rows)
        want = [i for i, row in enumerate(rows) if row.num_shadow_tokens and row.sample]
        host = [i for i in want if self.proposer_for(rows[i].request) is not None]
        self._fill(drafts, rows, host, [rows[i].num_shadow_tokens for i in host])
        if self.proposer is not None and not self.on_device:  # suffix decoding's own
            own = [i for i in want if i not in host]
            _run(cast(Proposer, self.proposer), rows, own, drafts, [rows[i].num_shadow_tokens for i in own])
        return {i: d.token_ids for i, d in enumerate(drafts) if d is not None}

    def make_next(self, sampled: list[tuple[Request, RowOutput | None]]) -> None:
        """Make each sampled row's host draft for the step after this one (into
        `RowOutput.next_host_draft`), so the policy and the next step only read it."""
        for request, out in sampled:
            proposer = self.proposer_for(request)
            if proposer is None or out is None or not out.token_ids:
                continue
            if len(request.output_ids) + len(out.token_ids) >= request.params.max_tokens:
                continue  # the request ends with this step
            after = TokensAfter(request.request_id, request.prompt_ids, request.output_ids + out.token_ids,
                                request.prediction_ids)  # fmt: skip
            try:
                (draft,) = proposer.propose([after], [MAX_SPEC_TOKENS])
            except Exception:  # noqa: BLE001 - a failed draft costs speed, never a request
                logger.exception("%s proposer failed; the next step makes its draft again", proposer.method)
                continue
            num_tokens = len(request.prompt_ids) + len(after.output_ids)
            out.next_host_draft = HostDraft(proposer.method, num_tokens, MAX_SPEC_TOKENS, draft.token_ids)

    def _fill(self, drafts: list[Draft | None], rows: list[ScheduledRow], index: list[int], k: list[int]) -> None:
        for i, draft in zip(index, self.drafts([rows[i].request for i in index], k)):
            if draft is not None and draft.token_ids:
                drafts[i] = draft


def _run(
    proposer: Proposer, rows: list[ScheduledRow], index: list[int], drafts: list[Draft | None], num_tokens: list[int]
) -> None:
    """Fill `drafts[i]` for the rows at `index` from `proposer` (num_tokens each)."""
    if not index:
        return
    try:
        proposed = proposer.propose([rows[i].request for i in index], num_tokens)
    except Exception:  # noqa: BLE001 - a failed draft costs speed, never a request
        logger.exception("%s proposer failed; these rows decode plainly this step", proposer.method)
        return
    for i, draft in zip(index, proposed):
        if draft.token_ids:
            drafts[i] = draft
