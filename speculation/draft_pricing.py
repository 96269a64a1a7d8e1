"""What a device proposer's work adds to a step, as the policy prices it: its forwards, their
rows, the catch-up its first forward feeds each row (docs/speculation.md, "The catch-up"), and
how far its drafts run once planned (`DraftReach`).

The cost model's fitted prices are used where recent steps measured them; until then, the prior:
the target's own learned step over as many rows, scaled by the proposer's `forward_cost_ratio`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from scheduler.types import Request
from speculation.cost_model import StepCostModel, StepShape

# Recent steps (a decayed count) that must have measured a device proposer's forwards, or its
# long catch-up feeds, before the fit's price for them replaces the prior: the target's own step
# over as many rows, scaled by the proposer's `forward_cost_ratio`. Fitted from one or two steps,
# where the forwards, their rows and the catch-up all grow together, the split between them
# was arbitrary (on the real pair, 58 ms a forward after two catch-ups, against 14 measured).
MEASURED = 3.0
# Weight of the reach's history per graded draft: about the last twenty drafts count. The
# prior, one planned position drafted, weighs as much as one draft.
REACH_DECAY, REACH_PRIOR_WEIGHT = 0.95, 1.0


@dataclass(frozen=True)
class DraftPrices:
    cost: StepCostModel
    ratio: float | None  # `Proposer.forward_cost_ratio` (None: no prior)

    def forward(self) -> tuple[float, float]:
        """(seconds a forward costs, seconds each row adds to it)."""
        cost, ratio = self.cost, self.ratio
        if ratio is None or cost.draft_support >= MEASURED:
            return cost.draft_forward_cost, cost.draft_row_cost
        one = cost.predict(StepShape(1, num_logits=1))
        return ratio * one, ratio * max(cost.predict(StepShape(2, num_logits=2)) - one, 0.0)

    def catch_up_seconds(self, num_tokens: int) -> float:
        """What `num_tokens` catch-up tokens past their rows' last ones add to a forward: rows of
        it at the fit's prices (each a row, and a catch-up token) where recent steps measured
        long feeds, else the prior's, a target prefill of as many tokens scaled down."""
        cost, ratio = self.cost, self.ratio
        if num_tokens <= 0:
            return 0.0
        if ratio is None or cost.catch_up_support >= MEASURED:
            return (cost.draft_row_cost + cost.catch_up_cost) * num_tokens
        return ratio * cost.added_tokens_cost(1, num_tokens)


def catch_up_charges(
    prices: DraftPrices,
    requests: list[Request],
    positions: Mapping[int, int],
    feeds: Mapping[int, int],
    mean_output_tokens: float | None,
    recurring_feed: int | None = None,
) -> dict[int, tuple[float, float]]:
    """Per row i with a catch-up past its last token (`feeds[i]` tokens fed; `positions[i]` it
    may draft): (seconds charged in full to its first position, seconds charged per token the
    row is expected to make this step).

    Up to a draft's length of the feed recurs every verify (a head re-feeds the tokens it
    drafted and the target accepted), or up to `recurring_feed` tokens (a draft model's KV keeps
    its drafts: only its last one is fed again), and is paid in full. The rest is paid once and serves
    every later verify of the row, so it is spread over the tokens the row has left: its
    `max_tokens` left, or the mean output of recent finished requests where that is less
    (memoryless: a request is expected to make about that many more)."""
    charges = {}
    for i, fed in feeds.items():
        if fed > 1:
            request = requests[i]
            left = float(max(request.params.max_tokens - len(request.output_ids), 1))
            if mean_output_tokens is not None:
                left = min(left, max(mean_output_tokens, 1.0))
            cap = positions[i] if recurring_feed is None else min(positions[i], recurring_feed)
            recurring = prices.catch_up_seconds(min(fed - 1, cap))
            once = max(prices.catch_up_seconds(fed - 1) - recurring, 0.0)
            charges[i] = (recurring, once / left)
    return charges


@dataclass
class DraftReach:
    """How far a device proposer's drafts run: per draft position j, the share of planned drafts
    that drafted it. On a CPU a draft model or head ends a row's draft after a token it doubts
    (`--draft-stop-confidence`), and a position it did not draft is neither a forward nor a row
    of one nor a verify token, so the policy prices each planned position's work at its reach
    (what it gains, its acceptance estimate already says: `AcceptanceEstimates.verified`).
    Learned from every verify of the proposer's drafts, from a prior of 1 (drafts that never end
    early keep it)."""

    planned: list[float] = field(default_factory=list)  # decayed counts per position
    drafted: list[float] = field(default_factory=list)

    def observe(self, num_planned: int, num_drafted: int) -> None:
        """A verify of a draft planned at `num_planned` tokens that drafted `num_drafted`."""
        if num_planned <= 0:
            return
        grow = num_planned - len(self.planned)
        if grow > 0:
            self.planned += [0.0] * grow
            self.drafted += [0.0] * grow
        for j in range(len(self.planned)):
            self.planned[j] *= REACH_DECAY
            self.drafted[j] *= REACH_DECAY
        for j in range(num_planned):
            self.planned[j] += 1.0
            self.drafted[j] += float(j < num_drafted)

    def at(self, position: int) -> float:
        """P(position `position` of a planned draft is drafted)."""
        if position >= len(self.planned):
            return 1.0
        weight = REACH_PRIOR_WEIGHT
        return (self.drafted[position] + weight) / (self.planned[position] + weight)

    def of(self, k: int) -> list[float]:
        """The reach of a draft's first `k` positions."""
        return [self.at(j) for j in range(k)]

    def summary(self) -> list[float]:
        return [round(r, 3) for r in self.of(len(self.planned))]
