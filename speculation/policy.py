"""Speculation policy: which rows draft this step, and how many tokens.

`speculation: false` rows never draft; `true` rows, and rows that bring a prediction,
draft their K within the operator's caps. `auto` rows decide every step by one rule:
each candidate draft position carries its calibrated expected extra tokens
(`speculation.estimates`), the positions of all auto rows are ranked by that gain, and
the prefix of the ranking with the most expected tokens per second of the step, priced
by the step's cost model learned on the running machine (`speculation.cost_model`),
wins, if it beats the plain step by 5%.
Exploration is part of the rule: a plain step runs when one of this size is unseen
lately, rows that run plain are graded by free shadow drafts, and rows whose proposer
drafts on the device probe one token now and then. docs/speculation.md tells the whole
story; the operator's `spec_disable_batch_size` caps auto rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from scheduler.types import PLAIN_REASONS, Request, StepPlan
from speculation import registry
from speculation.config import SpecConfig
from speculation.cost_model import StepCostModel, StepShape
from speculation.draft_pricing import DraftPrices, DraftReach, catch_up_charges
from speculation.estimates import AcceptanceEstimates, RowEstimate
from speculation.proposer import Drafting
from speculation.registry import Capabilities

MAX_PROBE_BACKOFF = 3  # a failing row's probe wait doubles up to probe_interval * 8
NO_PREFILL = StepShape(0)  # a step of decode rows only
# While plain steps of this size are unseen lately (decayed count under EXPLORE_BELOW) and
# speculation's edge is under EXPLORE_MARGIN, the step runs plain once to price it. Where they
# are unseen at all (under EXPLORE_UNSEEN: none in the last ~150 steps, or none since start-up
# once any step was measured), it runs plain whatever the edge: the edge is a ratio to the plain step's price, and that
# price was then learned from verify steps alone. On the real pair a server's first decode
# steps verified drafts whose catch-up (its prompt, into the draft model) took 650 ms, and
# the fit that followed priced a 70 ms plain step at 650, then 150-250: every later step
# verified, at 0.85-0.9x the tokens per second of plain decoding. Before any step is measured
# (the memory-bound guess), rows of a device proposer run plain too: that first verify's
# catch-up (every row's prompt) is the dearest step a server runs.
EXPLORE_BELOW, EXPLORE_MARGIN, EXPLORE_UNSEEN = 0.5, 2.0, 0.05
# The edge a verify step's predicted tokens per second must show over the plain step's: inside
# it the call is a coin flip that costs a verify step's fixed price when it loses. Constant: the
# gains are calibrated and the cost model is fitted to the recent steps, so what is left is
# scatter, and a margin that followed the model's per-step error made a shared, noisy machine
# stop speculating where it paid (served mix traffic at 4 requests: 24 steps of 158 ran
# plain for want of it in one run, 4-7 in the others).
REQUIRED_EDGE = 0.05
# Weight of the newest finished request in the mean output length (about the last ten count).
OUTPUT_LENGTH_WEIGHT = 0.1


@dataclass
class SpecPolicy:
    config: SpecConfig
    drafting: Drafting = field(default_factory=Drafting)
    cost: StepCostModel = field(default_factory=StepCostModel)
    estimates: AcceptanceEstimates = field(init=False)
    reach: DraftReach = field(default_factory=DraftReach)  # how far the device proposer's drafts run
    plain_steps: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PLAIN_REASONS, 0))
    num_probes: int = 0  # probes graded, and how many of them were (expected to be) accepted
    num_probes_accepted: float = 0.0
    num_steps: int = 0  # planned steps, their expected and emitted tokens
    expected_tokens: float = 0.0
    emitted_tokens: float = 0.0
    mean_output_tokens: float | None = None  # of recent finished requests (None: none yet)

    def __post_init__(self) -> None:
        c = self.config
        self.estimates = AcceptanceEstimates(c.decay, c.prior_acceptance, c.prior_rates, self.drafting.method)

    def method_of(self, request: Request) -> str | None:
        """The proposer that drafts for the row: its prediction's, else the engine's (None: none)."""
        if request.prediction_ids is not None:
            return registry.PREDICTION.name
        return self.drafting.method if self.drafting.method in registry.REGISTRY else None

    def capabilities(self, request: Request) -> Capabilities:
        return registry.capabilities(self.method_of(request))

    def uses_lookup(self, request: Request) -> bool:
        """The row may draft by prompt lookup instead of its device proposer."""
        return self.drafting.lookup is not None and self.capabilities(request).on_device

    def k_max(self, request: Request) -> int:
        k = request.params.num_speculative_tokens
        return self.config.num_speculative_tokens if k is None else k

    def lookup_k_max(self, request: Request) -> int:
        k = request.params.num_speculative_tokens
        return self.config.lookup_tokens if k is None else k

    def row(self, request: Request, lookup: bool = False) -> RowEstimate:
        method = registry.LOOKUP.name if lookup else self.method_of(request)
        return self.estimates.row(request.request_id, method, lookup)

    # -- deciding --
    def decide(
        self,
        requests: list[Request],
        caps: list[int],
        budget: int,
        num_running: int | None = None,
        prefill: StepShape = NO_PREFILL,
        grammar: list[int] | None = None,
    ) -> tuple[list[int], StepPlan]:
        """Draft tokens per decoding request (same order; `caps[i]` bounds row i's, `budget` all
        of them), and what the step should yield. `num_running` (default: the decoding requests)
        is what the operator's cap compares; `prefill` is the rest of the step, for the cost model.

        `grammar[i]` > 0: row i's grammar forces that many next tokens (`speculation.grammar`;
        its cap is 0, and they fit `budget`). A `true` row drafts them all; an `auto` row's
        are priced like any draft, each as sure to be accepted: where a bigger step costs more
        than the tokens it saves (many rows on a CPU), they are left for later steps to decode."""
        ks = [0] * len(requests)
        if not requests:
            return ks, StepPlan(0.0, None)
        grammar = grammar or [0] * len(requests)
        auto_allowed = self.config.auto_allowed(len(requests) if num_running is None else num_running)
        k_maxes = [min(self.k_max(r), cap) for r, cap in zip(requests, caps)]
        forced, auto_rows, capped = [], [], False
        grammar_candidates: list[tuple[float, int]] = []
        for i, request in enumerate(requests):
            mode = request.params.speculation
            if grammar[i]:
                if mode is True or not self.config.adaptive:
                    ks[i] = grammar[i]
                elif auto_allowed:
                    grammar_candidates += [(1.0, i)] * grammar[i]
                else:
                    capped = True
                continue
            if k_maxes[i] == 0 or mode is False or self.method_of(request) is None:
                continue
            if mode is not True and not auto_allowed:
                capped = True  # over the operator's cap: only `speculation: true` rows draft
                continue
            # A prediction is the client's own draft (OpenAI's Predicted Outputs): used whenever
            # the operator's cap allows, as OpenAI always uses it, not second-guessed.
            if mode is True or not self.config.adaptive or request.prediction_ids is not None:
                forced.append(i)
            else:
                auto_rows.append(i)
        k_maxes = self._available(k_maxes, requests, forced + auto_rows)
        for i in forced:
            ks[i] = k_maxes[i]
        had_auto_rows = bool(auto_rows or grammar_candidates)
        auto_rows = [i for i in auto_rows if k_maxes[i]]
        candidates, lookup_rows = self._candidates(requests, auto_rows, k_maxes, caps)
        catch_ups = self._catch_up_charges(requests, candidates, lookup_rows)
        budget -= sum(ks)  # forced rows spend the budget first
        if budget < 0:
            ks = _shrink(ks, -budget)
            budget = 0
        grammar_rows = frozenset(i for _, i in grammar_candidates)
        plan = self._choose(
            requests, candidates + grammar_candidates, ks, budget, prefill, lookup_rows, grammar_rows, catch_ups
        )
        if not any(ks) and plan.plain_reason is None and (capped or had_auto_rows):
            plan.plain_reason = "cap" if capped else "no_draft"
        if plan.plain_reason is not None:
            self.plain_steps[plan.plain_reason] += 1
        plan.lookup_rows = frozenset(i for i in lookup_rows if ks[i])
        for i in plan.lookup_rows:  # its verify grades the lookup now; a pending shadow would count twice
            self.row(requests[i], lookup=True).shadow = None
        plan.probe_rows = self._probes(requests, auto_rows, ks, plan, prefill)
        return ks, plan

    def _available(self, k_maxes: list[int], requests: list[Request], rows: list[int]) -> list[int]:
        """`k_maxes` cut to the drafts made ahead on the host that rows have now."""
        rows = [i for i in rows if self.capabilities(requests[i]).drafts_ahead]
        if not rows or self.drafting.available is None:
            return k_maxes
        lengths = self.drafting.available([requests[i] for i in rows], [k_maxes[i] for i in rows])
        k_maxes = list(k_maxes)
        for i, n in zip(rows, lengths):
            k_maxes[i] = min(k_maxes[i], max(n, 0))
        return k_maxes

    def _candidates(
        self, requests: list[Request], rows: list[int], k_maxes: list[int], caps: list[int]
    ) -> tuple[list[tuple[float, int]], frozenset[int]]:
        """(gain, row) for every draft position the auto `rows` may plan, and the rows whose
        prompt-lookup draft (as likely, and no draft forwards to pay) beats their proposer's."""
        priced = [i for i in rows if self.capabilities(requests[i]).priced]
        probs: dict[int, list[float]] = {}
        if priced and self.drafting.preview is not None:
            previews = self.drafting.preview([requests[i] for i in priced], [k_maxes[i] for i in priced])
            probs = {i: p for i, p in zip(priced, previews)}
        lookups = [i for i in rows if self.uses_lookup(requests[i])]
        lookup_lengths = {}
        if lookups and self.drafting.lookup is not None:
            k = [min(self.lookup_k_max(requests[i]), caps[i]) for i in lookups]
            lookup_lengths = dict(zip(lookups, self.drafting.lookup([requests[i] for i in lookups], k)))
        candidates, lookup_rows = [], set()
        for i in rows:
            if i in priced:
                gains = self.estimates.gains(self.row(requests[i]), 0, probs.get(i, []))
            else:
                gains = self.estimates.gains(self.row(requests[i]), k_maxes[i])
            if lookup_lengths.get(i, 0) > 0:
                lookup_gains = self.estimates.gains(self.row(requests[i], lookup=True), lookup_lengths[i])
                if sum(lookup_gains) >= sum(gains):
                    gains = lookup_gains
                    lookup_rows.add(i)
            candidates += [(gain, i) for gain in gains]
        return candidates, frozenset(lookup_rows)

    def _on_device(self, request: Request, row: int, host_rows: frozenset[int]) -> bool:
        return self.capabilities(request).on_device and row not in host_rows

    def _catch_up_charges(
        self, requests: list[Request], candidates: list[tuple[float, int]], lookup_rows: frozenset[int]
    ) -> dict[int, tuple[float, float]]:
        """`draft_pricing.catch_up_charges` for the device rows among the candidates."""
        if self.drafting.catch_up is None:
            return {}
        positions: dict[int, int] = {}
        for _, i in candidates:
            if self._on_device(requests[i], i, lookup_rows):
                positions[i] = positions.get(i, 0) + 1
        if not positions:
            return {}
        rows = list(positions)
        feeds = dict(zip(rows, self.drafting.catch_up([requests[i] for i in rows], [1] * len(rows))))
        return catch_up_charges(
            self.prices, requests, positions, feeds, self.mean_output_tokens, self.drafting.recurring_feed
        )

    @property
    def prices(self) -> DraftPrices:
        return DraftPrices(self.cost, self.drafting.forward_cost_ratio)

    def _choose(
        self,
        requests,
        candidates,
        ks,
        budget,
        prefill: StepShape,
        lookup_rows: frozenset[int],
        grammar_rows: frozenset[int] = frozenset(),
        catch_ups: dict[int, tuple[float, float]] | None = None,
    ) -> StepPlan:
        """The best prefix of the candidates (by decreasing gain) for the decode rows' tokens per second.

        Every prefix is a plan priced by the step's predicted time with that many more tokens;
        the best wins rather than the first token that stops paying, since a step's cost need
        not be convex in its tokens. The rate is over the decode rows' own time: a prefill
        chunk is paid either way (tokens are still priced at the whole step's size). A device
        row's positions also pay their share of its catch-up (`_catch_up_charges`): the first
        its recurring part, each its expected tokens' share of the rest.
        """
        catch_ups = catch_ups or {}
        forced = sum(ks)
        expected = float(len(requests))  # forced drafts count as gain-free here
        plain_tokens = len(requests) + prefill.num_tokens
        tokens = plain_tokens + forced
        already_spec = forced > 0
        host_rows = lookup_rows | grammar_rows
        on_device = [self._on_device(r, i, host_rows) for i, r in enumerate(requests)]
        draft_positions = max((k for k, dev in zip(ks, on_device) if dev), default=0)
        draft_rows = sum(k for k, dev in zip(ks, on_device) if dev)
        cost = self.cost
        if cost.is_fitted:
            context = sum(r.num_computed_tokens + 1 for r in requests) + forced
            decode = StepShape(len(requests) + forced, context, already_spec, draft_positions,
                               num_logits=len(requests) + forced, num_draft_rows=draft_rows)  # fmt: skip
            seconds = max(cost.predict(decode), 1e-9)  # an early fit can price a small step at 0
            whole = replace(decode, num_tokens=tokens, num_context=context + prefill.num_context,
                            num_logits=decode.num_logits + prefill.num_logits)  # fmt: skip
            prefill_seconds = max(cost.predict(whole) - seconds, 0.0)
            spec_cost, logits_cost = cost.spec_cost, cost.logits_cost
            draft_cost, row_cost = self.prices.forward()
        else:  # nothing measured yet: a memory-bound guess (a token costs 2% of a step)
            seconds, prefill_seconds, spec_cost, draft_cost, logits_cost, row_cost = 1.0, 0.0, 0.0, 0.0, 0.0, 0.0
        plain_seconds, plain_expected = seconds, expected
        order = sorted(candidates, key=lambda c: -c[0])[: max(budget, 0)]
        best = 0
        if order:  # every prefix of the ranking at once
            expected_at = expected + np.cumsum([gain for gain, _ in order])
            # A device proposer runs one more forward for each position past the forced drafts'
            # that some row still drafts, and each of its draft tokens is one more row of a forward
            # and of the verify; a position is drafted as often as the proposer's drafts reach it.
            drafted = [0] * len(requests)
            missed: dict[int, float] = {}  # position -> P(no row drafts it)
            forward_sum, rows, extra, caught_up = 0.0, 0.0, 0.0, 0.0
            forwards_at, rows_at, extra_at, catch_up_at = [], [], [], []
            for gain, i in order:
                if on_device[i]:
                    j = drafted[i]
                    drafted[i] += 1
                    reach = self.reach.at(j)
                    if j >= draft_positions:
                        miss = missed.get(j, 1.0)
                        missed[j] = miss * (1.0 - reach)
                        forward_sum += miss - missed[j]
                    rows += reach
                    extra += reach
                    recurring, per_token = catch_ups.get(i, (0.0, 0.0))
                    caught_up += recurring + per_token if j == 0 else 0.0
                    caught_up += per_token * gain
                else:
                    extra += 1.0
                forwards_at.append(forward_sum)
                rows_at.append(rows)
                extra_at.append(extra)
                catch_up_at.append(caught_up)
            m = np.array(extra_at)
            added = cost.added_tokens_costs(tokens, m) + logits_cost * m if cost.is_fitted else 0.02 * m
            forwards = draft_cost * np.array(forwards_at) + row_cost * np.array(rows_at) + np.array(catch_up_at)
            totals = seconds + added + forwards + (0.0 if already_spec else spec_cost)
            rates = expected_at / totals
            top = int(np.argmax(rates))  # the first of equals: the shortest plan with the best rate
            if rates[top] > expected / seconds:
                best, expected, seconds = top + 1, float(expected_at[top]), float(totals[top])
        chosen = [0] * len(requests)
        for _, i in order[:best]:
            chosen[i] += 1
        edge, reason = 1.0, None
        if candidates and not already_spec and not best:
            reason = "no_gain" if order else "budget"
        if best and not already_spec:
            edge = (expected / seconds) / (plain_expected / plain_seconds)
            support = cost.plain_support(plain_tokens)
            if cost.is_fitted:
                explore = support < EXPLORE_UNSEEN or (edge < EXPLORE_MARGIN and support < EXPLORE_BELOW)
            else:  # a device proposer's first forward feeds each row's whole sequence: not on a guess
                explore = any(on_device[i] for _, i in order[:best])
            if edge <= 1.0 + REQUIRED_EDGE or explore:
                reason = "explore" if edge > 1.0 + REQUIRED_EDGE else "margin"
                chosen, expected, seconds, edge = [0] * len(requests), plain_expected, plain_seconds, 1.0
        for i in grammar_rows:  # drafted by the grammar: no proposer's estimate to grade
            ks[i] = chosen[i]
        for i in {i for _, i in candidates} - grammar_rows:  # the raw gains each verify is graded against
            ks[i] = chosen[i] or ks[i]
            state = self.row(requests[i], lookup=i in lookup_rows)
            state.planned = state.raw[: chosen[i]]
        predicted = seconds + prefill_seconds if cost.is_fitted else None
        return StepPlan(expected, predicted, len(requests), edge, plain_reason=reason)

    # -- probes: a device proposer's one-token drafts for rows that run plain --
    def _probes(
        self, requests: list[Request], auto_rows: list[int], ks: list[int], plan: StepPlan, prefill: StepShape
    ) -> frozenset[int]:
        """Rows that probe this step. A row waits `_probe_interval` plain steps, doubled per
        failed probe (up to 8x); once one is due, or the proposer runs anyway, every row past
        half its wait probes too, so a large batch pays one proposer forward per round."""
        waited = {}
        for i in auto_rows:
            state = self.row(requests[i])
            if ks[i]:
                state.plain_steps = 0
                state.shadow = None  # its verify grades it now; a shadow would count the same tokens twice
            elif not self.capabilities(requests[i]).can_shadow:
                waited[i] = state
        if not waited:
            return frozenset()
        fed = len(waited)
        if self.drafting.catch_up is not None:
            behind = [requests[i] for i in waited]
            fed = sum(self.drafting.catch_up(behind, [1] * len(behind)))
        interval = self._probe_interval(requests, len(waited), fed, prefill)
        due = {}
        for i, state in waited.items():
            state.plain_steps += 1
            due[i] = state.plain_steps / (interval * (1 << state.probe_backoff))
        on_device = any(ks[i] and self._on_device(r, i, plan.lookup_rows) for i, r in enumerate(requests))
        if not on_device and max(due.values()) < 1.0:
            return frozenset()
        rows = frozenset(i for i, w in due.items() if w >= 0.5)
        for i in rows:
            waited[i].plain_steps = 0
        return rows

    def _probe_interval(self, requests: list[Request], num_rows: int, num_fed: int, prefill: StepShape) -> float:
        """`probe_interval`, or more where a round of probes (the proposer's forward in a plain
        step, over `num_fed` tokens of `num_rows` rows: each row's catch-up on what it emitted
        since its last draft) would cost more than `probe_budget` of the plain steps it waits
        through. The catch-up
        grows with the wait, so where feeding a row's tokens to the proposer alone costs more
        than the budget (a draft model on a CPU: each token a row of its forward), the wait
        outgrows every row and probes stop; rows then draft again only where their estimates
        say a verify pays."""
        interval = float(self.config.probe_interval)
        if not num_fed or not self.cost.is_fitted:
            return interval
        context = sum(r.num_computed_tokens + 1 for r in requests) + prefill.num_context
        plain = StepShape(len(requests) + prefill.num_tokens, context, num_logits=len(requests) + prefill.num_logits)
        seconds = self.cost.predict(plain)
        prices = self.prices
        forward, row = prices.forward()
        premium = forward + row * num_rows + prices.catch_up_seconds(num_fed - num_rows)
        if seconds <= 0.0 or premium <= 0.0:
            return interval
        return max(interval, premium / (self.config.probe_budget * seconds))

    def wants_shadow(self, request: Request, k: int, lookup: bool = False) -> int:
        """Shadow draft length for a row this step (0: none): a model-free proposer's for a row
        that runs plain; beside a device proposer, prompt lookup's for a row that does not
        verify a lookup draft (`lookup`), whatever else it verifies."""
        if request.params.speculation is False:
            return 0
        if self.uses_lookup(request):
            return 0 if lookup or self.row(request, lookup=True).shadow is not None else self.lookup_k_max(request)
        if k or not self.capabilities(request).can_shadow:
            return 0
        return 0 if self.row(request).shadow is not None else self.k_max(request)

    # -- learning --
    def observe(
        self, request: Request, num_drafted: int, num_accepted: int, method: str | None = None, num_asked: int = 0
    ) -> None:
        """A verify step of `request`: the drafts it carried (by `method`, default the row's
        proposer), and how many were accepted; `num_asked`, the draft length the step asked of
        it (a device proposer's draft may end before that: `DraftReach`)."""
        if num_drafted:
            lookup = method == registry.LOOKUP.name and self.uses_lookup(request)
            state = self.row(request, lookup=lookup)
            asked = num_asked if not lookup and self.capabilities(request).on_device else 0
            self.estimates.verified(state, num_drafted, num_accepted, asked)
            state.plain_steps = 0
            if asked:
                self.reach.observe(asked, num_drafted)

    def observe_probe(self, request: Request, draft_id: int, emitted: int, accept: float | None = None) -> float:
        """Grade a probe against the token the row emitted, and return how accepted it was.
        `accept`, where the runner gives it, is the chance the rejection sampler would have
        accepted the token, min(1, p/q): for a sampled row, emitting the drafted token is rarer
        than accepting it."""
        state = self.row(request)
        if accept is None or not math.isfinite(accept):
            accept = float(draft_id == emitted)
        accepted = min(max(accept, 0.0), 1.0)
        self.estimates.probed(state, accepted, draft_id == emitted)
        self.num_probes += 1
        self.num_probes_accepted += accepted
        # One accepted token is weak evidence for a row that stopped paying: the wait
        # shortens a step at a time, and the acceptance estimate decides the rest.
        state.probe_backoff = min(max(state.probe_backoff + (-1 if accepted >= 0.5 else 1), 0), MAX_PROBE_BACKOFF)
        return accepted

    def observe_shadow(self, request: Request, draft_ids: list[int], emitted: list[int]) -> None:
        """Grade the row's pending shadow draft (starting `draft_ids` if none) with its emitted tokens."""
        state = self.row(request, lookup=self.uses_lookup(request))
        priced = registry.capabilities(state.method).priced
        self.estimates.shadowed(state, draft_ids, emitted, priced)

    def observe_step(self, shape: StepShape, seconds: float, plan: StepPlan | None, emitted: int) -> None:
        """A finished step: its measured time teaches the cost model; its tokens are counted."""
        if plan is not None and plan.expected_tokens:
            self.num_steps += 1
            self.expected_tokens += plan.expected_tokens
            self.emitted_tokens += emitted
        self.cost.observe(shape, seconds)

    def free(self, request_id: str, num_output_tokens: int | None = None) -> None:
        """The request ended; `num_output_tokens`: what it made, where it ended on its own (a
        stop or its length), for the mean output the catch-up charges amortize over."""
        self.estimates.free(request_id)
        if num_output_tokens:
            mean = self.mean_output_tokens
            w = OUTPUT_LENGTH_WEIGHT
            self.mean_output_tokens = num_output_tokens if mean is None else (1 - w) * mean + w * num_output_tokens

    def acceptance(self, request_id: str) -> float | None:
        """Estimated acceptance of the request's first draft token (None: no record)."""
        state = self.estimates.rows.get((request_id, False))
        return None if state is None else self.estimates.rates(state, 1)[0]

    def summary(self) -> dict:
        """The policy's own view, for /v1/speculation."""
        n = self.num_steps
        return {
            "cost_model": self.cost.summary(),
            "expected_tokens_per_step": round(self.expected_tokens / n, 3) if n else None,
            "emitted_tokens_per_step": round(self.emitted_tokens / n, 3) if n else None,
            "required_edge": REQUIRED_EDGE,
            "plain_steps": dict(self.plain_steps),
            "probes": {"graded": self.num_probes, "accepted": round(self.num_probes_accepted, 1)},
            "draft_reach": self.reach.summary(),
            **self.estimates.summary(),
        }


def _shrink(ks: list[int], excess: int) -> list[int]:
    """Take `excess` draft tokens away, longest drafts first."""
    ks = list(ks)
    while excess > 0 and any(ks):
        i = max(range(len(ks)), key=lambda j: ks[j])
        ks[i] -= 1
        excess -= 1
    return ks
