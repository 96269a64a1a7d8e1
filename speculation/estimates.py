"""What each draft position of a row is expected to yield: one estimator, calibrated per proposer.

Per row and draft position j, decayed counts of drafts that reached j (every earlier
token accepted) and accepted it. Their ratio, shrunk toward the recent rate of rows
with the same proposer (a weight that fades as the row's own record at j grows), is
a_j = P(draft j accepted | drafts before it accepted); the first position is read in
its context, after a draft accepted to its end or after a miss (`AFTER_FULL`). A
position's raw gain is g_k = a_1 ... a_k, or, for a proposer that prices its drafts
(suffix decoding), the product of its tokens' own probabilities. A few decayed
observations make raw gains run to the extremes, so every proposer's are mapped
through what positions priced alike were accepted lately (`GainCalibration`).

Drafts are graded by verifies, by shadows (a model-free draft made for a row that ran
plain, graded by the tokens it then emitted, at no verify cost) and by probes (one
device-drafted token for a row that ran plain).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from scheduler.types import MAX_SPEC_TOKENS

PEER_WEIGHT = 2.0  # a new row's estimate weighs its peers' rates as this many verify steps of its own
MIN_PEER_WEIGHT = 1e-3  # a floor that keeps the weight from underflowing
RECENT_KEEP = 0.98  # weight of history in the peers' rates, per graded draft
# Buckets of the calibration, by raw gain: upper edges. In the closed loop (bf16, n-gram,
# copy and mixed traffic) positions priced under 0.02 were accepted 4-10% of the time,
# those at 0.05-0.2 some 10 points more than priced, those over 0.85 8-25 points less.
GAIN_EDGES = (0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
# The first draft position after a draft accepted to its end (the proposer is on track:
# n-gram on copy traffic accepted it 87% of the time, against 39% after a miss) has its own slot.
AFTER_FULL = MAX_SPEC_TOKENS
NUM_SLOTS = MAX_SPEC_TOKENS + 1


def reached_positions(num_drafted: int, num_accepted: int) -> range:
    """Draft positions a verify reached: the accepted ones and the first rejected one, if any."""
    return range(min(num_drafted, num_accepted + 1))


def slot_of(position: int, after_full: bool) -> int:
    """Where draft `position`'s counts live, given how the row's previous draft ended."""
    return AFTER_FULL if position == 0 and after_full else position


@dataclass
class PositionCounts:
    """Decayed counts per slot (`slot_of`): drafts that reached it and those that accepted it."""

    reached: list[float] = field(default_factory=lambda: [0.0] * NUM_SLOTS)
    accepted: list[float] = field(default_factory=lambda: [0.0] * NUM_SLOTS)

    def decay(self, keep: float) -> None:
        self.reached = [x * keep for x in self.reached]
        self.accepted = [x * keep for x in self.accepted]

    def record(self, slot: int, accepted: float) -> None:
        self.reached[slot] += 1.0
        self.accepted[slot] += accepted

    def first_rate(self) -> float | None:
        """Acceptance of the first draft token, over both contexts (None: never reached)."""
        reached = self.reached[0] + self.reached[AFTER_FULL]
        return (self.accepted[0] + self.accepted[AFTER_FULL]) / reached if reached > 0 else None


@dataclass
class GainCalibration:
    """How often draft positions priced at raw gain g were accepted, per bucket of g.

    Every position of a graded draft counts (those past the first rejection as not
    accepted), and drafts are graded whether the row verified them or ran plain (a
    shadow), so which positions count depends on their price, never on how they
    turned out. `apply` moves a gain by its bucket's mean error, shrunk toward none
    by `prior_weight` positions, keeping a row's gains non-increasing.
    """

    keep: float = 0.998  # per graded draft: about the last 500 count
    prior_weight: float = 8.0
    count: list[float] = field(default_factory=lambda: [0.0] * len(GAIN_EDGES))
    priced: list[float] = field(default_factory=lambda: [0.0] * len(GAIN_EDGES))
    accepted: list[float] = field(default_factory=lambda: [0.0] * len(GAIN_EDGES))

    @staticmethod
    def bucket(g: float) -> int:
        return next((b for b, edge in enumerate(GAIN_EDGES) if g < edge), len(GAIN_EDGES) - 1)

    def add(self, gains: list[float], num_accepted: int) -> None:
        """A graded draft whose positions were priced at `gains`; its first `num_accepted` were accepted."""
        self.count = [x * self.keep for x in self.count]
        self.priced = [x * self.keep for x in self.priced]
        self.accepted = [x * self.keep for x in self.accepted]
        for j, g in enumerate(gains):
            b = self.bucket(g)
            self.count[b] += 1.0
            self.priced[b] += g
            self.accepted[b] += j < num_accepted

    def apply(self, gains: list[float]) -> list[float]:
        out, ceiling = [], 1.0
        for g in gains:
            b = self.bucket(g)
            g += (self.accepted[b] - self.priced[b]) / (self.count[b] + self.prior_weight)
            ceiling = min(max(g, 0.0), ceiling)
            out.append(ceiling)
        return out

    def summary(self) -> dict[str, list[float]]:
        """Per bucket with data, keyed by its upper edge: [mean gain priced, share accepted]."""
        return {
            f"{edge:g}": [round(self.priced[b] / self.count[b], 3), round(self.accepted[b] / self.count[b], 3)]
            for b, edge in enumerate(GAIN_EDGES)
            if self.count[b] >= 1.0
        }


@dataclass
class Shadow:
    """A draft the row did not verify: its next emitted tokens grade it."""

    token_ids: list[int]
    gains: list[float]  # its positions' raw gains, as a plan would have priced them
    after_full: bool
    matched: int = 0


@dataclass
class RowEstimate:
    """One row's record for one source of drafts (its proposer, or prompt lookup beside a device one)."""

    method: str | None
    counts: PositionCounts = field(default_factory=PositionCounts)
    # The peers' weight per slot, in verify steps: it fades as the row reaches that slot.
    peer_weights: list[float] = field(default_factory=lambda: [PEER_WEIGHT] * NUM_SLOTS)
    after_full: bool = False  # the last graded position was accepted
    raw: list[float] = field(default_factory=list)  # the raw gains last priced for this row
    planned: list[float] = field(default_factory=list)  # ... those of the positions this step drafts
    shadow: Shadow | None = None
    plain_steps: int = 0  # plain steps since the row last drafted or probed
    probe_backoff: int = 0


@dataclass
class AcceptanceEstimates:
    """Every row's record, the peers' recent rates and one `GainCalibration` per proposer."""

    decay: float = 0.8  # weight of a row's history, per graded draft
    prior_acceptance: float = 0.6
    prior_rates: tuple[float, ...] = ()  # the engine proposer's own record, per position
    proposer: str | None = None
    rows: dict[tuple[str, bool], RowEstimate] = field(default_factory=dict)  # (request id, lookup)
    recent: dict[str, PositionCounts] = field(default_factory=dict)  # by proposer
    calibration: dict[str, GainCalibration] = field(default_factory=dict)  # by proposer

    def row(self, request_id: str, method: str | None, lookup: bool = False) -> RowEstimate:
        state = self.rows.get((request_id, lookup))
        if state is None:
            state = self.rows[(request_id, lookup)] = RowEstimate(method)
        return state

    def free(self, request_id: str) -> None:
        self.rows.pop((request_id, False), None)
        self.rows.pop((request_id, True), None)

    # -- estimates --
    def rates(self, state: RowEstimate, k: int) -> list[float]:
        """P(draft j accepted | drafts before j accepted), j < k: the row's own counts shrunk
        toward its peers' recent rate at that slot (itself shrunk toward the prior). A row
        whose first position fares worse than its peers' gets their later rates scaled down
        alike: those are earned by the rows that reach them (the copying ones)."""
        recent = self.recent.get(state.method) if state.method else None
        rates: list[float] = []
        relative = 1.0
        for j in range(k):
            slot, prior = slot_of(j, state.after_full), self._prior(state.method, j)
            peer = prior
            if recent is not None:
                peer = (recent.accepted[slot] + PEER_WEIGHT * prior) / (recent.reached[slot] + PEER_WEIGHT)
            weight, counts = state.peer_weights[slot], state.counts
            rates.append((counts.accepted[slot] + weight * peer * relative) / (counts.reached[slot] + weight))
            if j == 0 and peer > 0:
                relative = min(rates[0] / peer, 1.0)
        return rates

    def raw_gains(self, state: RowEstimate, k: int, probs: list[float] | None = None) -> list[float]:
        """P(draft position j accepted), j < k: the product of the rates up to j or, for a
        priced draft, of its tokens' probabilities."""
        return [float(g) for g in np.cumprod(probs if probs is not None else self.rates(state, k))]

    def gains(self, state: RowEstimate, k: int, probs: list[float] | None = None) -> list[float]:
        """Calibrated expected extra tokens of each of the row's first k draft positions; the
        raw gains are kept on the row for grading."""
        state.raw = self.raw_gains(state, k, probs)
        return self._calibration(state).apply(state.raw)

    def _prior(self, method: str | None, position: int) -> float:
        if method == self.proposer and position < len(self.prior_rates):
            return self.prior_rates[position]
        return self.prior_acceptance

    def _calibration(self, state: RowEstimate) -> GainCalibration:
        return self.calibration.setdefault(state.method or "", GainCalibration())

    # -- learning --
    def verified(self, state: RowEstimate, num_drafted: int, num_accepted: int, num_asked: int = 0) -> None:
        """A verify of `num_drafted` draft tokens accepted `num_accepted`, of a draft asked for
        `num_asked` (more where it ended early: the position after its last, reached when all
        were accepted, gained nothing, so a rate is the chance a position is drafted and accepted)."""
        if state.planned:  # a verify the policy planned (not a forced draft)
            # Every planned position is graded: one a draft that ended early never drafted
            # gained nothing (its rate below counts it so too).
            self._calibration(state).add(state.planned, num_accepted)
            state.planned = []
        self._begin(state)
        after_full = state.after_full
        for j in reached_positions(max(num_drafted, num_asked), num_accepted):
            self._grade(state, slot_of(j, after_full), float(j < num_accepted))
        state.after_full = num_accepted == num_drafted

    def probed(self, state: RowEstimate, accepted: float, hit: bool) -> None:
        """A one-token probe accepted with this chance (`hit`: the row emitted its token)."""
        self._begin(state)
        self._grade(state, slot_of(0, state.after_full), accepted)
        state.after_full = hit

    def shadowed(self, state: RowEstimate, draft_ids: list[int], emitted: list[int], priced: bool) -> None:
        """Grade the row's pending shadow (starting one from `draft_ids` if none) with its
        emitted tokens, a position at a time, so a row that starts quoting drafts again a
        step or two later rather than after its whole shadow. A shadow is priced as a plan
        would have priced it: by its rates, or (`priced`) by the last previewed draft's."""
        if state.shadow is None and draft_ids:
            n = len(draft_ids)
            if priced:
                gains = state.raw[:n] if len(state.raw) >= n else []
            else:
                gains = self.raw_gains(state, n)
            state.shadow = Shadow(list(draft_ids), gains, state.after_full)
            self._begin(state)
        shadow = state.shadow
        for token in emitted:
            if shadow is None:
                break
            accepted = token == shadow.token_ids[shadow.matched]
            self._grade(state, slot_of(shadow.matched, shadow.after_full), float(accepted))
            state.after_full = accepted
            shadow.matched += accepted
            if not accepted or shadow.matched == len(shadow.token_ids):
                if shadow.gains:
                    self._calibration(state).add(shadow.gains, shadow.matched)
                state.shadow = shadow = None

    def _begin(self, state: RowEstimate) -> None:
        """A new graded draft: the row's history (and its peers') decays once."""
        state.counts.decay(self.decay)
        if state.method is not None:
            self.recent.setdefault(state.method, PositionCounts()).decay(RECENT_KEEP)

    def _grade(self, state: RowEstimate, slot: int, accepted: float) -> None:
        state.counts.record(slot, accepted)
        state.peer_weights[slot] = max(state.peer_weights[slot] * self.decay, MIN_PEER_WEIGHT)
        if state.method is not None:
            self.recent[state.method].record(slot, accepted)

    def summary(self) -> dict:
        first = {method: counts.first_rate() for method, counts in self.recent.items()}
        return {
            "recent_acceptance_by_proposer": {method: round(r, 3) for method, r in first.items() if r is not None},
            "acceptance_by_gain": {method: c.summary() for method, c in self.calibration.items()},
        }
