"""Speculation policy: which rows draft this step, and how many tokens.

Rule (documented in docs/speculation.md):

* `speculation: false` rows never draft; `true` rows always draft their K
  (request `num_speculative_tokens` or the engine's), whatever the batch.
  An `auto` row that brings a prediction (Predicted Outputs) drafts from it
  like a `true` row, within the operator's cap: the client asked for it.
* `auto` rows decide per row, every step. Each request keeps decayed counts,
  per draft position j, of verify steps that reached j and that accepted it;
  their ratio a_j = P(draft j accepted | drafts before it accepted) is shrunk
  toward the recent rate of requests with the same proposer (a new request
  starts from what its peers achieved; the peers' weight fades as the row's
  own history grows, and a row whose first draft fares worse than its peers'
  gets their later rates scaled down alike, since those are the copying rows').
  The first position is read in its context: right after a draft accepted to
  its end, or after a miss (`AFTER_FULL`). The k-th draft token of a row yields
  an extra token with probability g_k = a_1 * ... * a_k. A few decayed
  observations make g run to the extremes, so for n-gram, whose drafts are
  graded in every row that has one (verifies, and shadows for plain rows), g
  is mapped through what positions priced alike were accepted lately
  (`GainCalibration`). Other proposers' g is scaled by the share of its
  planned extra tokens the row's verifies realised (at most 1: verify steps
  are chosen where estimates are high, and realise less). How many accepted
  tokens the plans expected against how many they got is tracked and shown
  (`gain_scale`), not applied: one batch-wide factor would lend a copying
  row's luck to a creative row beside it.
* The price of a draft token is what it adds to *this* step's time, from a
  model of the step learned online on the running machine
  (`speculation.cost_model`): what a draft's tokens add to the step's time at
  this step's size, plus a draft model's forward per position drafted.
  Candidate draft positions of all auto rows are ranked by decreasing g;
  each prefix of that ranking is a plan whose rate is its expected tokens
  over its predicted time (the decode rows' time plus what its tokens, the
  fixed verify cost and a draft model's forwards add; a prefill chunk in
  the step is paid either way and is left out), and the best prefix wins:
  the step's cost need not be convex in its tokens, so stopping at the first
  token that does not pay can miss a draft that does. The step speculates
  only if that plan beats the plain step by more than the recent verify
  steps fell short of the edge they were chosen for (`EdgeCheck`; at least
  5%). So a copying row drafts long in a large batch while a creative row
  next to it drafts nothing.
* Only drafts a row has are planned: n-gram and Predicted Outputs drafts are
  made on the host from the request alone, so the runner says before the step
  how long each row's would be (`available`), and a row whose n-gram index
  matches nothing plans none, in `auto` and `on` alike.
* The plain step is only known if the model saw one of about this size
  lately; while it speculates every step it does not, so when none was seen
  and speculation's edge is under 2x, one step runs plain to measure it.
* A proposer that prices its own drafts (suffix decoding: each token's
  frequency among the continuations it has seen) is asked for the row's draft
  while the step is planned (`preview`), and g_k is the product of those
  probabilities, each mapped through an online calibration (acceptance
  observed per probability bucket, decayed), since frequency is not
  acceptance. The per-position estimates above stay for the other proposers.
* A row that does not draft still learns: a model-free proposer (n-gram,
  Predicted Outputs) makes a *shadow* draft for it, which the row's next
  emitted tokens confirm or refute at no verify cost, so acceptance that
  jumps (a request starts quoting) is seen within a step or two. A draft
  model or an EAGLE head cannot shadow for free, as its draft costs a
  forward: its rows *probe*. The proposer drafts one token for a row that
  runs plain, and the token the row emits grades it, as a shadow is graded:
  no verify step, no draft token through the target, only the proposer's
  forward (and its catch-up over the positions since the row last drafted).
  A row probes after `probe_interval` plain steps (doubling to 8x while
  probes fail, halving again as they succeed), or after more where the cost
  model prices a round of probes above `probe_budget` (1%) of the plain
  steps between rounds. A due probe takes along every row past half its
  wait, and a step whose proposer runs anyway (a row drafts from it) takes
  them too, so probes share the proposer's forwards.
* Beside a draft model or an EAGLE head, prompt lookup (n-gram) is a second
  source a row may draft from (`lookup`: the runner's n-gram drafts available
  now). Each such row keeps a second set of estimates for its lookup drafts,
  learned from their verifies and from free shadow drafts graded every step,
  whatever the row verified. Where the row has a lookup draft this step and
  its expected accepted tokens are at least the device draft's, the row drafts
  from the lookup: the tokens are as likely and cost no draft forward. So a
  row that starts quoting its prompt drafts long copies, the head's rows next
  to it draft from the head.
* `spec_disable_batch_size` is the operator's hard cap: with more running
  requests, auto rows run the plain path. None (the default): no cap.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from scheduler.types import MAX_SPEC_TOKENS, Request
from speculation.cost_model import StepCostModel, StepShape

MODEL_FREE_PROPOSERS = ("ngram", "prediction", "suffix")
# Proposers that draft with forwards on the device: each draft position costs one more forward.
DEVICE_PROPOSERS = ("draft_model", "eagle")
PRICED_PROPOSERS = ("suffix",)  # their drafts carry per-token probabilities
# Drafts made on the host from the request alone: the runner can say before the step what
# each row's draft holds (`available`).
HOST_PROPOSERS = ("ngram", "prediction")
PEER_WEIGHT = 2.0  # a new row's estimate weighs its peers' rates as this many verify steps of its own
MIN_PEER_WEIGHT = 1e-3  # a floor that keeps the weight from underflowing
RECENT_KEEP = 0.98  # weight of history in the peers' rates, per verify or shadow draft
# A row's verify steps are chosen where its estimate is high, so they realise less than
# planned (a maximum over noisy estimates is biased up). Each row keeps decayed sums of
# the extra tokens its plans expected and those its verifies accepted; their ratio (at
# most 1, starting from REALISED_PRIOR tokens as planned) scales its gains.
REALISED_KEEP = 0.9
REALISED_PRIOR = 2.0
MAX_PROBE_BACKOFF = 3  # a failing row's probe wait doubles up to probe_interval * 8
# Lengths of the drafts (at most k tokens each) a host proposer would make now for these
# requests: prompt lookup beside a device proposer (`lookup`, the second source), or the
# rows' own model-free proposer, n-gram or Predicted Outputs (`available`).
DraftLengths = Callable[[list[Request], list[int]], list[int]]
LOOKUP_METHOD = "ngram"
# Per-token probabilities of the drafts the proposer would make now for these requests (at most
# k tokens each): the runner's answer to the policy while it plans a step.
Preview = Callable[[list[Request], list[int]], list[list[float]]]
# Probability buckets of the calibration: upper edges.
CALIBRATION_EDGES = (0.2, 0.4, 0.6, 0.8, 0.95, 1.0)
# A row's gains come from a few decayed observations of its own, so they run to the extremes: in
# the closed loop (bf16, n-gram, copy and mixed traffic), draft positions priced under 0.02 were
# accepted 4-10% of the time, those at 0.05-0.2 some 10 points more than priced, those over 0.85
# 8-25 points less. For proposers whose drafts are graded in every row that has one (verified, or
# shadowed for free), gains are mapped through what positions at that gain recently realised.
CALIBRATED_PROPOSERS = ("ngram",)
GAIN_EDGES = (0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
NO_PREFILL = StepShape(0)  # a step of decode rows only
# A verify step is compared with a plain step of the same rows, whose cost the
# model only knows if it saw such steps: while it speculates every step it does
# not. So when plain steps of this size are unseen lately (decayed count below
# EXPLORE_BELOW) and speculation's predicted edge is under EXPLORE_MARGIN, the
# step runs plain once to measure it (about one step in 35 while that lasts).
EXPLORE_BELOW = 0.5
EXPLORE_MARGIN = 2.0
# A verify step must beat the plain step by how far the verify steps auto chose
# fell short of their predicted edge lately (`EdgeCheck`: tokens expected over
# emitted, their time measured over predicted, against plain steps' time bias);
# until it has seen enough of them, by the cost model's recent error. At least
# MIN_EDGE: a call inside that is a coin flip that costs a verify step's fixed
# price when it loses.
MIN_EDGE, MAX_EDGE = 0.05, 0.25  # past 25% the shortfall is noise (a loaded machine), not bias
EDGE_CHECK_KEEP = 0.98  # per step: about the last 50 steps of each kind count
EDGE_CHECK_MIN_STEPS = 5.0  # decayed verify and plain steps each before the shortfall decides
# Why a step with `auto` rows ran plain (`StepPlan.plain_reason`, counted per reason): the
# operator's cap held them back; none had a draft (a host proposer matched nothing); prefill
# chunks left no token budget for drafts; no plan beat the plain step; the best one beat it by
# no more than the required edge; or the step ran plain to measure a plain step of its size.
PLAIN_REASONS = ("cap", "no_draft", "budget", "no_gain", "margin", "explore")


@dataclass
class SpecConfig:
    num_speculative_tokens: int = 10
    # More than this many running requests: `auto` rows stop speculating. None: no cap; 0: never.
    spec_disable_batch_size: int | None = None
    adaptive: bool = True
    prior_acceptance: float = 0.6
    # Per draft position, the conditional acceptance the engine's proposer starts from
    # (an EAGLE head's held-out record); prior_acceptance past its end.
    prior_rates: tuple[float, ...] = ()
    decay: float = 0.8  # weight of history in a request's acceptance estimate, per verify step
    probe_interval: int = 8  # plain steps before a row that cannot shadow probes (at least)
    # Share of step time a round of probes may cost, spread over the steps between rounds:
    # where the proposer's forward is dear (a head catching up 16 rows on a CPU: 19% of a
    # plain step) the wait grows past probe_interval so exploring stays within this share.
    probe_budget: float = 0.01
    # Most tokens a prompt-lookup draft beside a device proposer may carry, unless the
    # request sets num_speculative_tokens (a copy is cheap to draft long, unlike a head's).
    lookup_tokens: int = 10

    def __post_init__(self) -> None:
        if not 0 <= self.num_speculative_tokens <= MAX_SPEC_TOKENS:
            raise ValueError(f"num_speculative_tokens must be in [0, {MAX_SPEC_TOKENS}]")
        if self.spec_disable_batch_size is not None and self.spec_disable_batch_size < 0:
            raise ValueError("spec_disable_batch_size must be >= 0")

    def auto_allowed(self, num_running: int) -> bool:
        cap = self.spec_disable_batch_size
        return cap is None or 0 < cap and num_running <= cap


def reached_positions(num_drafted: int, num_accepted: int) -> range:
    """Draft positions a verify reached (every draft before them accepted): the accepted
    ones and the first rejected one, if any."""
    return range(min(num_drafted, num_accepted + 1))


# The first draft token has two contexts: right after a draft that was accepted to its
# end (the proposer is on track: copying, n-gram on SmolLM2 in bf16, accepted 87% of the
# time at 16 requests of copy traffic) and after one that missed (39%; 15-29% on chat,
# code and creative). Its counts after a full acceptance live in their own slot.
AFTER_FULL = MAX_SPEC_TOKENS
NUM_SLOTS = MAX_SPEC_TOKENS + 1


def slot_of(position: int, after_full: bool) -> int:
    """Where draft `position`'s counts live, given how the row's previous draft ended."""
    return AFTER_FULL if position == 0 and after_full else position


@dataclass
class PositionCounts:
    """Decayed counts per slot (`slot_of`: a draft position j, 0-based, with the first
    position split by context): drafts that reached j (every earlier one accepted) and
    those that accepted j."""

    reached: list[float] = field(default_factory=lambda: [0.0] * NUM_SLOTS)
    accepted: list[float] = field(default_factory=lambda: [0.0] * NUM_SLOTS)

    def decay(self, keep: float) -> None:
        for j in range(NUM_SLOTS):
            self.reached[j] *= keep
            self.accepted[j] *= keep

    def record(self, position: int, accepted: float) -> None:
        self.reached[position] += 1.0
        self.accepted[position] += accepted

    def first_rate(self) -> float | None:
        """Acceptance of the first draft token, over both contexts (None: never reached)."""
        reached = self.reached[0] + self.reached[AFTER_FULL]
        return (self.accepted[0] + self.accepted[AFTER_FULL]) / reached if reached > 0 else None


@dataclass
class ProbabilityCalibration:
    """Acceptance of draft tokens by the probability their proposer gave them.

    Per bucket of the proposer's conditional probability p, decayed counts of
    draft tokens reached (every earlier one accepted) and accepted; the
    calibrated rate is their ratio shrunk toward p itself with a weight of
    `prior_weight` tokens, so it starts as the proposer's own estimate.
    """

    keep: float = 0.995  # per verified draft
    prior_weight: float = 4.0
    reached: list[float] = field(default_factory=lambda: [0.0] * len(CALIBRATION_EDGES))
    accepted: list[float] = field(default_factory=lambda: [0.0] * len(CALIBRATION_EDGES))

    @staticmethod
    def bucket(p: float) -> int:
        return next((b for b, edge in enumerate(CALIBRATION_EDGES) if p <= edge), len(CALIBRATION_EDGES) - 1)

    def add(self, probs: list[float], num_accepted: int) -> None:
        """A verified (or shadow) draft whose tokens had `probs`, of which `num_accepted` were accepted."""
        for b in range(len(CALIBRATION_EDGES)):
            self.reached[b] *= self.keep
            self.accepted[b] *= self.keep
        for j, p in enumerate(probs[: num_accepted + 1]):
            b = self.bucket(p)
            self.reached[b] += 1.0
            self.accepted[b] += j < num_accepted

    def rate(self, p: float) -> float:
        b = self.bucket(p)
        return (self.accepted[b] + self.prior_weight * p) / (self.reached[b] + self.prior_weight)

    def summary(self) -> dict[str, float]:
        """Observed acceptance per probability bucket (those with data), keyed by the bucket's upper edge."""
        return {
            f"{edge:g}": round(self.accepted[b] / self.reached[b], 3)
            for b, edge in enumerate(CALIBRATION_EDGES)
            if self.reached[b] >= 1.0
        }


@dataclass
class GainCalibration:
    """How often draft positions the estimates priced at g were accepted, per bucket of g.

    Per bucket, decayed counts of graded positions, the gains they were priced at, and the
    accepted ones. Every position of a graded draft counts (those past the first rejection as
    not accepted), and a row's draft is graded whether it verified or ran plain (a shadow), so
    which drafts are graded depends on their gains, never on how they turned out: a bucket's
    rate is what a position priced there earns. `apply` moves a gain by its bucket's mean
    error, shrunk toward none by `prior_weight` positions, keeping a row's gains non-increasing.
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
        for b in range(len(GAIN_EDGES)):
            self.count[b] *= self.keep
            self.priced[b] *= self.keep
            self.accepted[b] *= self.keep
        for j, g in enumerate(gains):
            b = self.bucket(g)
            self.count[b] += 1.0
            self.priced[b] += g
            self.accepted[b] += j < num_accepted

    def apply(self, gains: list[float]) -> list[float]:
        out, ceiling = [], 1.0
        for g in gains:
            b = self.bucket(g)
            g = g + (self.accepted[b] - self.priced[b]) / (self.count[b] + self.prior_weight)
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
    probs: list[float] = field(default_factory=list)  # the proposer's, when it gives them
    matched: int = 0
    after_full: bool = False  # the row's previous draft was accepted to its end
    gains: list[float] = field(default_factory=list)  # its positions' gains, uncalibrated, where calibrated


@dataclass
class AcceptanceState:
    method: str | None  # the request's proposer
    counts: PositionCounts = field(default_factory=PositionCounts)
    # Weight of the peers' rate at each draft position in this row's estimate, in verify
    # steps: it fades as the row reaches that position, so where a row has a record of its
    # own that record decides, and a position it rarely reaches keeps its peers' rate.
    peer_weights: list[float] = field(default_factory=lambda: [PEER_WEIGHT] * NUM_SLOTS)
    # The last graded draft position was accepted (a verify accepted to its end, or a
    # shadow's last graded token matched): the next first draft is in the AFTER_FULL context.
    after_full: bool = False
    plain_steps: int = 0
    probe_backoff: int = 0
    planned: float = 0.0  # decayed extra tokens this row's verify plans expected ...
    realised: float = 0.0  # ... and accepted
    plan_gains: list[float] = field(default_factory=list)  # this step's plan: g per drafted position
    raw_gains: list[float] = field(default_factory=list)  # the last gains computed, uncalibrated ...
    plan_raw: list[float] = field(default_factory=list)  # ... and those of this step's drafted positions
    shadow: Shadow | None = None
    draft_probs: list[float] = field(default_factory=list)  # this step's previewed draft, if priced


@dataclass
class StepPlan:
    """What the policy expected of the step it planned (checked against what happened)."""

    expected_tokens: float
    predicted_seconds: float | None
    num_rows: int = 0  # decode rows the expectation covers
    edge: float = 1.0  # predicted tokens per second of the chosen step over the plain step's
    lookup_rows: frozenset[int] = frozenset()  # rows (by index) that draft by prompt lookup
    probe_rows: frozenset[int] = frozenset()  # rows (by index) whose device proposer drafts unverified
    plain_reason: str | None = None  # set where auto rows could have drafted and the step runs plain


@dataclass
class EdgeCheck:
    """How far the verify steps `auto` chose delivered the edge they were chosen for.

    A step speculates when its predicted tokens per second beat the plain
    step's; it delivers (emitted / expected) x (predicted / measured time) of
    that, and the plain step it was compared with runs (predicted / measured)
    of its own prediction. Their ratio, decayed over recent steps, is the
    factor by which chosen plans over-promise: the edge a plan needs. A
    systematic miss (gains overestimated where they were chosen for being
    high, verify steps slower than the fit says) raises it; scatter that
    averages out does not, where the cost model's per-step error would.
    """

    spec_expected: float = 0.0
    spec_emitted: float = 0.0
    spec_predicted: float = 0.0
    spec_observed: float = 0.0
    num_spec: float = 0.0
    plain_predicted: float = 0.0
    plain_observed: float = 0.0
    num_plain: float = 0.0

    def add_spec(self, expected: float, emitted: float, predicted: float, observed: float) -> None:
        keep = EDGE_CHECK_KEEP
        self.spec_expected = keep * self.spec_expected + expected
        self.spec_emitted = keep * self.spec_emitted + emitted
        self.spec_predicted = keep * self.spec_predicted + predicted
        self.spec_observed = keep * self.spec_observed + observed
        self.num_spec = keep * self.num_spec + 1.0

    def add_plain(self, predicted: float, observed: float) -> None:
        keep = EDGE_CHECK_KEEP
        self.plain_predicted = keep * self.plain_predicted + predicted
        self.plain_observed = keep * self.plain_observed + observed
        self.num_plain = keep * self.num_plain + 1.0

    @property
    def shortfall(self) -> float | None:
        """Predicted edge over delivered edge, minus one (None: too few steps of either kind)."""
        if self.num_spec < EDGE_CHECK_MIN_STEPS or self.num_plain < EDGE_CHECK_MIN_STEPS:
            return None
        if min(self.spec_expected, self.spec_emitted, self.spec_predicted, self.spec_observed,
               self.plain_predicted, self.plain_observed) <= 0:  # fmt: skip
            return None
        delivered = (self.spec_emitted / self.spec_expected) * (self.spec_predicted / self.spec_observed)
        plain = self.plain_predicted / self.plain_observed
        return plain / delivered - 1.0


@dataclass
class TokenCalibration:
    """Tokens the policy expected from its decode rows vs what they emitted.

    `scale` is the recent ratio of accepted drafts to expected ones: how
    far the acceptance estimates (shrunk toward peers, lagging a request's
    changes) are from what the plans realised.
    """

    num_steps: int = 0
    expected: float = 0.0
    emitted: float = 0.0
    _expected_extra: float = 0.0  # EMA of expected accepted drafts per speculative step
    _emitted_extra: float = 0.0
    _num_spec_steps: int = 0

    def add(self, expected: float, emitted: float, num_rows: int) -> None:
        self.num_steps += 1
        self.expected += expected
        self.emitted += emitted
        extra = expected - num_rows
        if extra > 0.05:  # a step that speculated
            self._num_spec_steps += 1
            self._expected_extra = 0.95 * self._expected_extra + 0.05 * extra
            self._emitted_extra = 0.95 * self._emitted_extra + 0.05 * max(emitted - num_rows, 0.0)

    @property
    def scale(self) -> float:
        if self._num_spec_steps < 20 or self._expected_extra <= 0:
            return 1.0
        return min(max(self._emitted_extra / self._expected_extra, 0.5), 2.0)


@dataclass
class SpecPolicy:
    config: SpecConfig
    proposer: str  # the engine's proposer method: "ngram", "suffix", "draft_model", "eagle" or "none"
    cost: StepCostModel = field(default_factory=StepCostModel)
    tokens: TokenCalibration = field(default_factory=TokenCalibration)
    preview: Preview | None = None  # set when the proposer prices its drafts
    lookup: DraftLengths | None = None  # set when prompt lookup drafts beside a device proposer
    # Set when the rows' own drafts are known before the step (n-gram, Predicted Outputs): a row
    # plans at most the tokens its proposer has for it now, and none where it has none.
    available: DraftLengths | None = None
    calibration: ProbabilityCalibration = field(default_factory=ProbabilityCalibration)
    gain_calibration: dict[str, GainCalibration] = field(default_factory=dict)  # by proposer method
    # False: n-gram rows keep the realised share instead, as every proposer did before (A/B and tests).
    calibrate_gains: bool = True
    edge_check: EdgeCheck = field(default_factory=EdgeCheck)
    _state: dict[str, AcceptanceState] = field(default_factory=dict)
    _lookup_state: dict[str, AcceptanceState] = field(default_factory=dict)  # rows' lookup drafts
    _recent: dict[str, PositionCounts] = field(default_factory=dict)  # by proposer method
    # Steps with auto rows that ran plain, by reason (PLAIN_REASONS).
    plain_steps: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PLAIN_REASONS, 0))
    num_probes: int = 0  # probes graded, and how many of them were (expected to be) accepted
    num_probes_accepted: float = 0.0

    @property
    def has_proposer(self) -> bool:
        return self.proposer != "none"

    def method_of(self, request: Request) -> str | None:
        if request.prediction_ids is not None:
            return "prediction"
        return self.proposer if self.has_proposer else None

    def can_shadow(self, request: Request) -> bool:
        return self.method_of(request) in MODEL_FREE_PROPOSERS

    def uses_lookup(self, request: Request) -> bool:
        """The row may draft by prompt lookup instead of its device proposer."""
        return self.lookup is not None and self.method_of(request) in DEVICE_PROPOSERS

    def lookup_k_max(self, request: Request) -> int:
        k = request.params.num_speculative_tokens
        return self.config.lookup_tokens if k is None else k

    # -- deciding --
    def decide(
        self,
        requests: list[Request],
        caps: list[int],
        budget: int,
        num_running: int | None = None,
        prefill: StepShape = NO_PREFILL,
    ) -> tuple[list[int], StepPlan]:
        """Draft tokens per decoding request for this step (same order), and what the step should yield.

        `caps[i]` bounds request i's draft by its length limits; all drafts
        together use at most `budget` tokens. `num_running` (default: the
        decoding requests) is what the operator's cap compares. `prefill` is
        the rest of the step (prefill chunks: their tokens and context), for
        the cost model; the decode rows' own shape comes from `requests`.
        """
        ks = [0] * len(requests)
        num_rows = len(requests)
        if not requests:
            return ks, StepPlan(0.0, None)
        auto_allowed = self.config.auto_allowed(num_rows if num_running is None else num_running)
        k_maxes = [min(self.k_max(r), cap) for r, cap in zip(requests, caps)]
        candidates: list[tuple[float, int]] = []  # (gain, row)
        forced, auto_rows = [], []
        capped = False
        for i, request in enumerate(requests):
            mode = request.params.speculation
            if k_maxes[i] == 0 or mode is False or self.method_of(request) is None:
                continue
            if mode is not True and not auto_allowed:
                capped = True  # over the operator's cap: only `speculation: true` rows draft
                continue
            # A prediction is the client's own draft (OpenAI's Predicted Outputs): used whenever
            # the operator's cap allows, as OpenAI always uses it, not second-guessed by the model.
            if mode is True or not self.config.adaptive or self.method_of(request) == "prediction":
                forced.append(i)
            else:
                auto_rows.append(i)
        k_maxes = self._available(k_maxes, requests, forced + auto_rows)
        for i in forced:
            ks[i] = k_maxes[i]
        had_auto_rows = bool(auto_rows)
        auto_rows = [i for i in auto_rows if k_maxes[i]]
        priced = [i for i in auto_rows
                  if self.preview is not None and self.method_of(requests[i]) in PRICED_PROPOSERS]  # fmt: skip
        lookup_gains = self._lookup_gains(requests, [i for i in auto_rows if self.uses_lookup(requests[i])], caps)
        lookup_rows: set[int] = set()
        for i in auto_rows:
            if i in priced:
                continue
            state = self._state_for(requests[i])
            gains = self._gains(state, self._rates(state, k_maxes[i]))
            if i in lookup_gains and sum(lookup_gains[i]) >= sum(gains):
                gains = lookup_gains[i]  # as likely, and no draft forwards to pay
                lookup_rows.add(i)
            candidates += [(gain, i) for gain in gains]
        candidates += self._priced_candidates(requests, priced, k_maxes)
        budget -= sum(ks)  # forced rows spend the budget first
        if budget < 0:
            ks = _shrink(ks, -budget)
            budget = 0
        plan = self._choose(requests, candidates, ks, budget, prefill, frozenset(lookup_rows))
        if not any(ks) and plan.plain_reason is None and (capped or had_auto_rows):
            plan.plain_reason = "cap" if capped else "no_draft"
        if plan.plain_reason is not None:
            self.plain_steps[plan.plain_reason] += 1
        plan.lookup_rows = frozenset(i for i in lookup_rows if ks[i])
        for i in plan.lookup_rows:  # its verify grades the lookup now; a pending shadow would count twice
            self._state_for(requests[i], lookup=True).shadow = None
        probing = [i for i in auto_rows if not ks[i] and not self.can_shadow(requests[i])]
        interval = self._probe_interval(requests, len(probing), prefill)
        waited = {i: self._probe_wait(requests[i], ks[i], interval) for i in auto_rows}
        # A probe makes the proposer run in a step that would not. So once one is due (or a
        # row drafts on the device anyway), every row past half its wait probes with it: a
        # large batch pays one proposer forward per round of probes, each row at its own time.
        on_device = any(ks[i] and self._drafts_on_device(r, i, plan.lookup_rows) for i, r in enumerate(requests))
        if any(w >= 1.0 for w in waited.values()) or on_device:
            plan.probe_rows = frozenset(i for i, w in waited.items() if w >= 0.5)
            for i in plan.probe_rows:
                self._state_for(requests[i]).plain_steps = 0
        return ks, plan

    def _available(self, k_maxes: list[int], requests: list[Request], rows: list[int]) -> list[int]:
        """`k_maxes` cut, for the `rows` that may draft this step, to the drafts their host
        proposer has now. A row's acceptance is learned from the verifies it drafted in, so it
        applies only where a draft exists. Planned blind, a step counted 10 drafts for a row
        whose n-gram index matched nothing: served `on` steps on mixed traffic were priced
        1.11-1.31x their time, 0.99-1.02x with this (bf16, 1-8 requests)."""
        rows = [i for i in rows if self.method_of(requests[i]) in HOST_PROPOSERS]
        if not rows or self.available is None:
            return k_maxes
        lengths = self.available([requests[i] for i in rows], [k_maxes[i] for i in rows])
        k_maxes = list(k_maxes)
        for i, n in zip(rows, lengths):
            k_maxes[i] = min(k_maxes[i], max(n, 0))
        return k_maxes

    def _gains(self, state: AcceptanceState, rates: list[float]) -> list[float]:
        """Expected extra tokens of each of a row's draft positions, given each position's
        conditional acceptance rate: P(draft j accepted) is the product of the rates up to j,
        calibrated where the proposer's drafts are graded in every row (`GainCalibration`),
        else scaled by the row's realised share."""
        raw = [float(g) for g in np.cumprod(rates)]
        calibration = self._gain_calibration(state)
        if calibration is not None:
            state.raw_gains = raw
            return calibration.apply(raw)
        share = self._realised_share(state)
        return [g * share for g in raw]

    def _gain_calibration(self, state: AcceptanceState) -> GainCalibration | None:
        if not self.calibrate_gains or state.method not in CALIBRATED_PROPOSERS:
            return None
        return self.gain_calibration.setdefault(state.method, GainCalibration())

    def _lookup_gains(self, requests: list[Request], rows: list[int], caps: list[int]) -> dict[int, list[float]]:
        """Gains of the prompt-lookup drafts the rows at `rows` have now (rows with none are left out)."""
        if not rows or self.lookup is None:
            return {}
        k_maxes = [min(self.lookup_k_max(requests[i]), caps[i]) for i in rows]
        lengths = self.lookup([requests[i] for i in rows], k_maxes)
        gains = {}
        for i, n in zip(rows, lengths):
            if n > 0:
                state = self._state_for(requests[i], lookup=True)
                gains[i] = self._gains(state, self._rates(state, n))
        return gains

    def _priced_candidates(
        self, requests: list[Request], rows: list[int], k_maxes: list[int]
    ) -> list[tuple[float, int]]:
        """Gains of the previewed drafts' positions: products of the calibrated token probabilities."""
        if not rows or self.preview is None:
            return []
        previews = self.preview([requests[i] for i in rows], [k_maxes[i] for i in rows])
        candidates = []
        for i, probs in zip(rows, previews):
            state = self._state_for(requests[i])
            state.draft_probs = probs
            gains = self._gains(state, [self.calibration.rate(p) for p in probs])
            candidates += [(gain, i) for gain in gains]
        return candidates

    def _choose(
        self, requests, candidates, ks, budget, prefill: StepShape, lookup_rows: frozenset[int] = frozenset()
    ) -> StepPlan:
        """The best prefix of the candidates (by decreasing gain) for the decode rows' tokens per second.

        Every prefix is a plan, priced by the step's predicted time with that
        many more tokens; the best one wins, rather than the first point where
        one more token stops paying: a step's cost need not be convex in its
        tokens (where a second token costs more than the next six, a greedy
        rule never drafts at all). The ratio is taken over the decode rows' own
        time: a prefill chunk in the step is paid with or without drafts, and
        counting it would make drafts look cheap exactly when a long prompt
        arrives; tokens are still priced at the whole step's size. Rows in
        `lookup_rows` draft by prompt lookup: no draft forwards.
        """
        forced = sum(ks)
        expected = float(len(requests))  # forced drafts count as gain-free here
        plain_tokens = len(requests) + prefill.num_tokens  # the step without drafts
        tokens = plain_tokens + forced
        already_spec = forced > 0
        draft_positions = max(
            (k for i, (k, r) in enumerate(zip(ks, requests)) if self._drafts_on_device(r, i, lookup_rows)), default=0
        )
        cost = self.cost
        if cost.is_fitted:
            decode_context = sum(r.num_computed_tokens + 1 for r in requests) + forced
            decode = StepShape(len(requests) + forced, decode_context, already_spec, draft_positions,
                               num_logits=len(requests) + forced)  # fmt: skip
            seconds = max(cost.predict(decode), 1e-9)  # an early fit can price a small step at 0
            whole = replace(decode, num_tokens=tokens, num_context=decode_context + prefill.num_context,
                            num_logits=decode.num_logits + prefill.num_logits)  # fmt: skip
            prefill_seconds = max(cost.predict(whole) - seconds, 0.0)
            spec_cost, draft_cost, logits_cost = cost.spec_cost, cost.draft_forward_cost, cost.logits_cost
        else:  # nothing measured yet: a memory-bound guess (a token costs 2% of a step)
            seconds, prefill_seconds, spec_cost, draft_cost, logits_cost = 1.0, 0.0, 0.0, 0.0, 0.0
        plain_seconds, plain_expected = seconds, expected
        fixed = 0.0 if already_spec else spec_cost  # the first draft makes this a verify step
        order = sorted(candidates, key=lambda c: -c[0])[: max(budget, 0)]
        best, best_expected, best_seconds = 0, expected, seconds
        if order:  # every prefix of the ranking at once (hundreds of candidates at 32 rows)
            expected_at = expected + np.cumsum([gain for gain, _ in order])
            m = np.arange(1, len(order) + 1)
            # Each draft token is one more token through the model and one more row of logits.
            added = cost.added_tokens_costs(tokens, len(order)) + logits_cost * m if cost.is_fitted else 0.02 * m
            # A device proposer runs one more forward for each position past its longest draft so far.
            on_device = [self._drafts_on_device(r, i, lookup_rows) for i, r in enumerate(requests)]
            drafted, positions, longest = [0] * len(requests), draft_positions, []
            for _, i in order:
                if on_device[i]:
                    drafted[i] += 1
                    positions = max(positions, drafted[i])
                longest.append(positions)
            forwards = draft_cost * (np.array(longest, dtype=np.float64) - draft_positions)
            totals = seconds + added + forwards + fixed
            rates = expected_at / totals
            top = int(np.argmax(rates))  # the first of equals: the shortest plan with the best rate
            if rates[top] > expected / seconds:
                best, best_expected, best_seconds = top + 1, float(expected_at[top]), float(totals[top])
        chosen = [0] * len(requests)
        gains: list[list[float]] = [[] for _ in requests]
        for gain, i in order[:best]:
            chosen[i] += 1
            gains[i].append(gain)
        expected, seconds = best_expected, best_seconds
        edge, reason = 1.0, None
        if candidates and not already_spec and not best:
            reason = "no_gain" if order else "budget"
        if best and not already_spec:
            edge = (expected / seconds) / (plain_expected / plain_seconds)
            explore = cost.is_fitted and edge < EXPLORE_MARGIN and cost.plain_support(plain_tokens) < EXPLORE_BELOW
            margin = self.required_edge()
            if edge <= 1.0 + margin or explore:
                reason = "margin" if edge <= 1.0 + margin else "explore"
                chosen, expected, seconds, edge = [0] * len(requests), plain_expected, plain_seconds, 1.0
        for i, k in enumerate(chosen):
            if k:
                ks[i] = k
        for i in {i for _, i in candidates}:  # what each row's verify should add, before its share
            state = self._state_for(requests[i], lookup=i in lookup_rows)
            calibrated = self._gain_calibration(state) is not None
            share = 1.0 if calibrated else self._realised_share(state)
            state.plan_gains = [g / share for g in gains[i]] if chosen[i] else []
            state.plan_raw = state.raw_gains[: chosen[i]] if calibrated and chosen[i] else []
        predicted = seconds + prefill_seconds if cost.is_fitted else None
        return StepPlan(expected, predicted, len(requests), edge, plain_reason=reason)

    def _drafts_on_device(self, request: Request, row: int, lookup_rows: frozenset[int]) -> bool:
        return self.method_of(request) in DEVICE_PROPOSERS and row not in lookup_rows

    def required_edge(self) -> float:
        """By how much a verify step's predicted tokens per second must beat the plain step's."""
        shortfall = self.edge_check.shortfall
        if shortfall is None:  # too little seen: the cost model's recent per-step error
            calibration = self.cost.calibration
            shortfall = calibration.relative_error if calibration.num_steps else 0.0
        return min(max(shortfall, MIN_EDGE), MAX_EDGE)

    def _probe_interval(self, requests: list[Request], num_probes: int, prefill: StepShape) -> float:
        """Plain steps between a row's probes before backoff: `probe_interval`, or more where one
        round of probes (the proposer's forward in a plain step) would cost more than
        `probe_budget` of the plain steps it waits through. Priced by the cost model, so it
        holds on any machine."""
        interval = float(self.config.probe_interval)
        if not num_probes or not self.cost.is_fitted:
            return interval
        context = sum(r.num_computed_tokens + 1 for r in requests) + prefill.num_context
        plain = StepShape(len(requests) + prefill.num_tokens, context, num_logits=len(requests) + prefill.num_logits)
        probe = replace(plain, num_draft_forwards=1)
        seconds = self.cost.predict(plain)
        premium = self.cost.predict(probe) - seconds
        if seconds <= 0.0 or premium <= 0.0:
            return interval
        return max(interval, premium / (self.config.probe_budget * seconds))

    def _probe_wait(self, request: Request, k: int, interval: float) -> float:
        """How far a row that stopped drafting, and cannot shadow, is through its wait for a
        probe (1: due); 0 for rows that draft or shadow."""
        state = self._state_for(request)
        if k:
            state.plain_steps = 0
            state.shadow = None  # its verify steps grade it now; a shadow would count the same tokens twice
            return 0.0
        if self.can_shadow(request):
            return 0.0
        state.plain_steps += 1
        return state.plain_steps / (interval * (1 << state.probe_backoff))

    def wants_shadow(self, request: Request, k: int, lookup: bool = False) -> int:
        """Shadow draft length for a row this step (0: none): a model-free proposer's for a row
        that runs plain; a prompt-lookup one for a row beside a device proposer that does not
        verify a lookup draft (`lookup`), whatever else it verifies."""
        if request.params.speculation is False:
            return 0
        if self.uses_lookup(request):
            if lookup:
                return 0
            state = self._state_for(request, lookup=True)
            return 0 if state.shadow is not None else self.lookup_k_max(request)
        if k or not self.can_shadow(request):
            return 0
        state = self._state_for(request)
        return 0 if state.shadow is not None else self.k_max(request)

    # -- learning --
    def observe(self, request: Request, num_drafted: int, num_accepted: int, method: str | None = None) -> None:
        """Record a verify step of `request`: the drafts it actually carried (by `method`, default
        the row's proposer), and how many were accepted."""
        if num_drafted == 0:
            return
        lookup = method == LOOKUP_METHOD and self.uses_lookup(request)
        state = self._state_for(request, lookup)
        if state.draft_probs:
            self.calibration.add(state.draft_probs[:num_drafted], num_accepted)
        gain_calibration = self._gain_calibration(state)
        if gain_calibration is not None and state.plan_raw:
            gain_calibration.add(state.plan_raw[:num_drafted], num_accepted)
        state.plan_raw = []
        if state.plan_gains:  # the verify the policy planned (not a forced draft)
            keep = REALISED_KEEP
            state.planned = keep * state.planned + sum(state.plan_gains[:num_drafted])
            state.realised = keep * state.realised + num_accepted
            state.plan_gains = []
        self._begin_grading(state)
        after_full = state.after_full
        for j in reached_positions(num_drafted, num_accepted):
            self._grade(state, slot_of(j, after_full), j < num_accepted)
        state.after_full = num_accepted == num_drafted
        state.plain_steps = 0

    def observe_probe(self, request: Request, draft_id: int, emitted: int, accept: float | None = None) -> None:
        """Grade a probe: the device proposer's one-token draft for a row that ran plain,
        against the token the row emitted in that step. `accept`, where the runner gives it,
        is the chance the rejection sampler would have accepted the token, min(1, p/q): for a
        sampled row, emitting the drafted token is rarer (sum of q*p, not of min(p, q)), so
        equality would understate a head whose q is close to p."""
        state = self._state_for(request)
        if accept is None or not math.isfinite(accept):
            accept = float(draft_id == emitted)
        accepted = min(max(accept, 0.0), 1.0)
        self._begin_grading(state)
        self._grade(state, slot_of(0, state.after_full), accepted)
        state.after_full = draft_id == emitted
        self.num_probes += 1
        self.num_probes_accepted += accepted
        # One accepted token is weak evidence for a row that stopped paying: the wait
        # shortens a step at a time, and the acceptance estimate decides the rest.
        step = -1 if accepted >= 0.5 else 1
        state.probe_backoff = min(max(state.probe_backoff + step, 0), MAX_PROBE_BACKOFF)

    def observe_shadow(self, request: Request, draft_ids: list[int], emitted: list[int]) -> None:
        """Grade the row's pending shadow draft (starting `draft_ids` if none) with its emitted
        tokens, a position at a time: each confirmed or refuted position counts at once, so a
        row that starts quoting drafts again a step or two later, not after its whole shadow."""
        state = self._state_for(request, lookup=self.uses_lookup(request))
        if state.shadow is None and draft_ids:
            gains = []
            if self._gain_calibration(state) is not None:  # as the plan would have priced them
                gains = [float(g) for g in np.cumprod(self._rates(state, len(draft_ids)))]
            state.shadow = Shadow(list(draft_ids), state.draft_probs[: len(draft_ids)], after_full=state.after_full,
                                  gains=gains)  # fmt: skip
            self._begin_grading(state)
        shadow = state.shadow
        for token in emitted:
            if shadow is None:
                break
            accepted = token == shadow.token_ids[shadow.matched]
            self._grade(state, slot_of(shadow.matched, shadow.after_full), accepted)
            state.after_full = accepted
            shadow.matched += accepted
            if not accepted or shadow.matched == len(shadow.token_ids):
                if shadow.probs:
                    self.calibration.add(shadow.probs, shadow.matched)
                if shadow.gains and (gain_calibration := self._gain_calibration(state)) is not None:
                    gain_calibration.add(shadow.gains, shadow.matched)
                state.shadow = shadow = None

    def _begin_grading(self, state: AcceptanceState) -> None:
        """A new verify or shadow draft: one more observation, so the history decays once."""
        state.counts.decay(self.config.decay)
        if state.method is not None:
            self._recent.setdefault(state.method, PositionCounts()).decay(RECENT_KEEP)

    def _grade(self, state: AcceptanceState, slot: int, accepted: float) -> None:
        """The draft position of `slot` was reached (every earlier one accepted) and accepted
        or not (or, for a sampled probe, with this chance)."""
        state.counts.record(slot, accepted)
        # The row's own record at this slot grows: its peers' weight there fades.
        state.peer_weights[slot] = max(state.peer_weights[slot] * self.config.decay, MIN_PEER_WEIGHT)
        if state.method is not None:
            self._recent[state.method].record(slot, accepted)

    def observe_step(self, shape: StepShape, seconds: float, plan: StepPlan | None, emitted: int) -> None:
        """A finished step: its measured time teaches the cost model; its tokens check the plan."""
        if plan is not None and plan.expected_tokens:
            self.tokens.add(plan.expected_tokens, emitted, plan.num_rows)
        if self.cost.is_fitted:  # the time predicted for the step as it ran, before learning from it
            predicted = self.cost.predict(shape)
            if not shape.is_spec:
                self.edge_check.add_plain(predicted, seconds)
            elif plan is not None and plan.edge > 1.0 and plan.expected_tokens:  # auto chose to verify
                self.edge_check.add_spec(plan.expected_tokens, emitted, predicted, seconds)
        self.cost.observe(shape, seconds)

    def free(self, request_id: str) -> None:
        self._state.pop(request_id, None)
        self._lookup_state.pop(request_id, None)

    # -- estimates --
    def acceptance(self, request_id: str) -> float | None:
        """Estimated acceptance of the request's first draft token."""
        state = self._state.get(request_id)
        return None if state is None else self._rates(state, 1)[0]

    def _realised_share(self, state: AcceptanceState) -> float:
        """The share of its planned extra tokens this row's verifies have accepted (at most 1)."""
        return min((state.realised + REALISED_PRIOR) / (state.planned + REALISED_PRIOR), 1.0)

    def _conditional_rates(self, request: Request, k: int) -> list[float]:
        return self._rates(self._state_for(request), k)

    def _rates(self, state: AcceptanceState, k: int) -> list[float]:
        """P(draft j accepted | drafts before j accepted), j < k.

        The request's own decayed counts, shrunk toward the recent rate at that
        position of requests with the same proposer (itself shrunk toward the
        configured prior) with a weight of two verify steps that fades, position
        by position, as the row reaches that position itself: a new request
        starts from what its peers recently earned, its own history takes over
        quickly, a row that never accepts goes to zero instead of keeping a
        share of its peers' luck, and a position the row rarely reaches keeps
        the peers' rate rather than one or two observations of its own. For
        prompt lookup the later positions run high (a copy that started tends
        to continue), which a single per-token rate would miss; for the same
        reason the first position is read in its context (`AFTER_FULL`).
        """
        weights, counts = state.peer_weights, state.counts
        recent = self._recent.get(state.method) if state.method else None
        slots = [slot_of(j, state.after_full) for j in range(k)]
        priors = [self._prior(state.method, j) for j in range(k)]
        peers = [
            prior if recent is None else (recent.accepted[i] + PEER_WEIGHT * prior) / (recent.reached[i] + PEER_WEIGHT)
            for i, prior in zip(slots, priors)
        ]
        rates: list[float] = []
        relative = 1.0
        for j, i in enumerate(slots):
            # Peers' later positions are earned by the rows that reach them (the copying ones):
            # a row whose own first draft fares worse than its peers' gets those rates scaled
            # down in proportion, not a copier's long drafts.
            rates.append((counts.accepted[i] + weights[i] * peers[j] * relative) / (counts.reached[i] + weights[i]))
            if j == 0 and peers[0] > 0:
                relative = min(rates[0] / peers[0], 1.0)
        return rates

    def _prior(self, method: str | None, position: int) -> float:
        """What a proposer's draft `position` is assumed to earn before any request has shown it."""
        rates = self.config.prior_rates
        if method == self.proposer and position < len(rates):
            return rates[position]
        return self.config.prior_acceptance

    def _state_for(self, request: Request, lookup: bool = False) -> AcceptanceState:
        """The row's estimates for its proposer's drafts, or (`lookup`) for its prompt-lookup drafts."""
        states, method = (self._lookup_state, LOOKUP_METHOD) if lookup else (self._state, self.method_of(request))
        state = states.get(request.request_id)
        if state is None:
            state = states[request.request_id] = AcceptanceState(method)
        return state

    def k_max(self, request: Request) -> int:
        k = request.params.num_speculative_tokens
        return self.config.num_speculative_tokens if k is None else k

    def summary(self) -> dict:
        """The policy's own view, for /v1/speculation."""
        t = self.tokens
        return {
            "cost_model": self.cost.summary(),
            "expected_tokens_per_step": round(t.expected / t.num_steps, 3) if t.num_steps else None,
            "gain_scale": round(t.scale, 3),
            "required_edge": round(self.required_edge(), 3),
            "plain_steps": dict(self.plain_steps),
            "probes": {"graded": self.num_probes, "accepted": round(self.num_probes_accepted, 1)},
            "emitted_tokens_per_step": round(t.emitted / t.num_steps, 3) if t.num_steps else None,
            "recent_acceptance_by_proposer": {
                method: round(rate, 3)
                for method, counts in self._recent.items()
                if (rate := counts.first_rate()) is not None
            },
            "acceptance_by_draft_probability": self.calibration.summary(),
            "acceptance_by_gain": {method: c.summary() for method, c in self.gain_calibration.items()},
        }


def _shrink(ks: list[int], excess: int) -> list[int]:
    """Take `excess` draft tokens away, longest drafts first."""
    ks = list(ks)
    while excess > 0 and any(ks):
        i = max(range(len(ks)), key=lambda j: ks[j])
        ks[i] -= 1
        excess -= 1
    return ks
