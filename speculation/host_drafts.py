"""Model-free drafts on the host: Predicted Outputs, prompt lookup, a host proposer's own.

One place decides which host proposer drafts for a row (its prediction, else the proposer
when it drafts ahead, else the prompt lookup beside a device proposer), makes each row's
draft for the next step at the end of the step that produced its tokens (on the step
thread, carried on the request as `Request.draft`), and answers the policy's and the step's
questions from it, so a draft is proposed once per step, never on the event loop in the
common case. It reads proposers only through `Proposer` and their capabilities.
"""

from __future__ import annotations

import logging

from scheduler.types import MAX_SPEC_TOKENS, Draft, Request, RowOutput, ScheduledRow
from speculation.grammar import GrammarProposer, forces
from speculation.prediction import PredictionProposer
from speculation.proposer import Proposer

logger = logging.getLogger("specd.speculation")


class HostDrafts:
    """The host side of a runner's drafting; `proposer` is the runner's (any kind), `lookup`
    prompt lookup beside a device proposer (else None)."""

    def __init__(self, proposer: Proposer | None, lookup: Proposer | None):
        self.proposer = proposer
        self.lookup = lookup
        self.prediction = PredictionProposer()
        self.grammar = GrammarProposer()

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

    def proposer_for(self, request: Request) -> Proposer | None:
        """The proposer that drafts on the host for a row: the tokens its grammar forces, else
        the proposer that drafts ahead for it (`ahead_for`); None: no such draft."""
        if forces(request):
            return self.grammar
        return self.ahead_for(request)

    def ahead_for(self, request: Request) -> Proposer | None:
        """The proposer that drafts ahead for a row: its prediction, else the runner's proposer
        where it drafts ahead, else the lookup beside a device proposer; None: no such draft."""
        if request.prediction_ids:
            return self.prediction
        if self.drafts_ahead:
            return self.proposer
        return self.lookup

    # -- what the policy asks while it plans (event loop) --
    def lengths(self, requests: list[Request], num_tokens: list[int]) -> list[int]:
        """How many tokens (at most `num_tokens`) each row's host draft carries now: Predicted
        Outputs' for a row with a prediction, else the n-gram proposer's. The step that follows
        verifies those very drafts. Rows only a forward or a preview can answer for (a draft
        model, a head, suffix decoding) keep `num_tokens`."""
        drafts = self.drafts(requests, num_tokens)
        return [
            len(d.token_ids) if d is not None and (r.prediction_ids or self.drafts_ahead or forces(r)) else k
            for r, k, d in zip(requests, num_tokens, drafts)
        ]

    def lookup_lengths(self, requests: list[Request], num_tokens: list[int]) -> list[int]:
        return [len(d.token_ids) if d else 0 for d in self.drafts(requests, num_tokens)]

    def drafts(self, requests: list[Request], num_tokens: list[int]) -> list[Draft | None]:
        """Each row's host draft of at most k tokens: the one made at the end of the last
        step (`Request.draft`) where it covers the request's tokens, else made now."""
        drafts: list[Draft | None] = []
        for request, k in zip(requests, num_tokens):
            proposer = self.proposer_for(request)
            if proposer is None:
                drafts.append(None)
                continue
            cached = request.draft
            if cached is not None and cached.fits(proposer.method, request.num_tokens, k):
                drafts.append(Draft(proposer.method, cached.token_ids[:k]))
                continue
            try:
                (draft,) = proposer.propose([request], [k])
            except Exception:  # noqa: BLE001 - a failed draft costs speed, never a request
                logger.exception("%s proposer failed; this row drafts nothing this step", proposer.method)
                draft = Draft(proposer.method, [])
            drafts.append(draft)
        return drafts

    # -- what the step needs (step thread) --
    def for_step(self, rows: list[ScheduledRow], device_drafting: bool) -> tuple[list[Draft | None], list[int], int]:
        """Model-free drafts per row, the rows a device proposer will draft for on the device,
        and the draft tokens the rows' grammars cut.

        A row under a grammar drafts on the host: the tokens its grammar forces, else its
        host proposer's draft (beside a device proposer: prompt lookup), cut at the first
        token the grammar refuses, so the step's masks follow drafts the grammar allows."""
        drafts: list[Draft | None] = [None] * len(rows)
        spec = [i for i, row in enumerate(rows) if row.sample and row.num_spec_tokens > 0]
        if self.on_device:
            host = [
                i
                for i in spec
                if rows[i].request.prediction_ids
                or rows[i].request.constraint is not None
                or (self.lookup is not None and rows[i].use_lookup)
            ]
            on_device = [i for i in spec if i not in host]
        elif self.drafts_ahead:
            host, on_device = spec, []
        else:  # a proposer that drafts for the step in hand (suffix decoding), or none
            host = [i for i in spec if rows[i].request.prediction_ids or forces(rows[i].request)]
            others = [i for i in spec if i not in host]
            if self.proposer is not None:
                _run(self.proposer, rows, others, drafts, [rows[i].num_spec_tokens for i in others])
            on_device = []
        self._fill(drafts, rows, host, [rows[i].num_spec_tokens for i in host])
        return drafts, on_device if device_drafting else [], _cut_to_grammar(drafts, rows)

    def shadows(self, rows: list[ScheduledRow]) -> dict[int, list[int]]:
        """Unverified drafts the policy asked for, to learn rows' acceptance at no verify cost: a
        model-free proposer's (or, beside a device proposer, prompt lookup's)."""
        drafts: list[Draft | None] = [None] * len(rows)
        want = [i for i, row in enumerate(rows) if row.num_shadow_tokens and row.sample]
        host = [i for i in want if self.proposer_for(rows[i].request) is not None]
        self._fill(drafts, rows, host, [rows[i].num_shadow_tokens for i in host])
        if self.proposer is not None and not self.on_device:  # a proposer that drafts for the step in hand
            own = [i for i in want if i not in host]
            _run(self.proposer, rows, own, drafts, [rows[i].num_shadow_tokens for i in own])
        return {i: d.token_ids for i, d in enumerate(drafts) if d is not None}

    def make_next(self, sampled: list[tuple[Request, RowOutput | None]]) -> None:
        """Make each sampled row's draft for the step after this one (into `RowOutput.next_draft`),
        so the policy and the next step only read it."""
        for request, out in sampled:
            proposer = self.ahead_for(request)
            if proposer is None or out is None or not out.token_ids:
                continue
            if len(request.output_ids) + len(out.token_ids) >= request.params.max_tokens:
                continue  # the request ends with this step
            try:
                (draft,) = proposer.propose([request], [MAX_SPEC_TOKENS], pending=[out.token_ids])
            except Exception:  # noqa: BLE001 - a failed draft costs speed, never a request
                logger.exception("%s proposer failed; the next step makes its draft again", proposer.method)
                continue
            draft.num_tokens = request.num_tokens + len(out.token_ids)
            draft.max_tokens = MAX_SPEC_TOKENS
            out.next_draft = draft

    def _fill(self, drafts: list[Draft | None], rows: list[ScheduledRow], index: list[int], k: list[int]) -> None:
        for i, draft in zip(index, self.drafts([rows[i].request for i in index], k)):
            if draft is not None and draft.token_ids:
                drafts[i] = draft


def _cut_to_grammar(drafts: list[Draft | None], rows: list[ScheduledRow]) -> int:
    """Cut each constrained row's draft at the first token its grammar refuses; the tokens cut."""
    cut = 0
    for i, draft in enumerate(drafts):
        constraint = rows[i].request.constraint
        if draft is None or constraint is None:
            continue
        n = constraint.accepts(draft.token_ids)
        if n < len(draft.token_ids):
            cut += len(draft.token_ids) - n
            drafts[i] = Draft(draft.method, draft.token_ids[:n]) if n else None
    return cut


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
