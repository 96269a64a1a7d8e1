"""Speculation policy: which rows draft this step, and how many tokens.

Rule (documented in README, "Speculation policy"):

* `speculation: false` rows never draft; `true` rows always draft their K
  (request `num_speculative_tokens` or the engine's), whatever the batch size.
* `auto` rows draft only while the step has at most `spec_disable_batch_size`
  rows; above it the step is the plain decode path (no proposer call).
* Adaptive K for `auto` rows. Each request keeps decayed counts, per draft
  position j, of verify steps that reached j and that accepted it; their ratio
  a_j = P(draft j accepted | drafts before it accepted) is shrunk toward the
  engine-wide rate at j (a fresh server: 0.6). The k-th draft token of a row
  yields an extra token with probability g_k = a_1 * ... * a_k. A step's time is modelled as a + b * tokens + c * [speculates]
  (fitted online by the engine from its own steps; c is the fixed extra work
  of a verify step). Adding a draft token with expected gain g raises the
  step's throughput E/S (tokens per second) iff g * S > b_eff * E, with
  b_eff = b + the proposer's measured seconds per draft position (a draft
  model's forward; near zero for n-gram). Candidate draft positions of all
  auto rows are taken greedily by decreasing g_k while that holds; the
  step then speculates only if its expected tokens per second, c included,
  beat the plain step's. So the same acceptance buys long drafts at batch 1
  (cheap verify) and none in a large, compute-bound batch.
* A request whose drafts stopped paying (k = 0) probes with one draft token
  after `probe_interval` plain steps (doubling up to 64 while probes fail), so
  K comes back when acceptance comes back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.types import MAX_SPEC_TOKENS, Request


@dataclass
class SpecConfig:
    num_speculative_tokens: int = 10
    # More than this many running requests: `auto` rows stop speculating. 0: never.
    spec_disable_batch_size: int = 8
    adaptive: bool = True
    prior_acceptance: float = 0.6
    decay: float = 0.8  # weight of history in the acceptance estimate, per verify step
    probe_interval: int = 8

    def __post_init__(self) -> None:
        if not 0 <= self.num_speculative_tokens <= MAX_SPEC_TOKENS:
            raise ValueError(f"num_speculative_tokens must be in [0, {MAX_SPEC_TOKENS}]")
        if self.spec_disable_batch_size < 0:
            raise ValueError("spec_disable_batch_size must be >= 0")


@dataclass
class PositionCounts:
    """Decayed counts per draft position j (0-based): verify steps that reached j
    (every earlier draft accepted) and those that accepted j."""

    reached: list[float] = field(default_factory=lambda: [0.0] * MAX_SPEC_TOKENS)
    accepted: list[float] = field(default_factory=lambda: [0.0] * MAX_SPEC_TOKENS)

    def add(self, num_drafted: int, num_accepted: int, keep: float) -> None:
        for j in range(MAX_SPEC_TOKENS):
            self.reached[j] *= keep
            self.accepted[j] *= keep
        for j in range(min(num_drafted, num_accepted + 1)):
            self.reached[j] += 1.0
            if j < num_accepted:
                self.accepted[j] += 1.0


@dataclass
class AcceptanceState:
    counts: PositionCounts = field(default_factory=PositionCounts)
    plain_steps: int = 0
    probe_backoff: int = 0


@dataclass
class StepCostModel:
    """Step time = a + b * tokens + c * [step speculates], fitted online.

    c is what a speculative step costs beyond its tokens (padded verify
    attention, the sampling grid, the rejection sampler). Exponentially
    weighted least squares over recent steps, with a light ridge that keeps b
    near 2% of a step and c near 0 until the data says otherwise (a batch that
    never changes size cannot separate a from b on its own).
    """

    a: float = 1.0
    b: float = 0.02  # prior: one more token costs 2% of a small step (memory-bound)
    c: float = 0.0
    # Seconds the proposer spends per draft position (EMA of the draft phase / k).
    draft: float = 0.0
    weight: float = 0.05
    ridge: float = 1e-3
    _xx: list[list[float]] = field(default_factory=lambda: [[0.0] * 3 for _ in range(3)])
    _xy: list[float] = field(default_factory=lambda: [0.0] * 3)
    _mean: float = 0.0

    def observe_draft(self, num_positions: int, seconds: float) -> None:
        if num_positions > 0:
            self.draft += self.weight * (seconds / num_positions - self.draft)

    def observe(self, num_tokens: int, seconds: float, is_spec: bool = False) -> None:
        w, keep = self.weight, 1.0 - self.weight
        x = (1.0, float(num_tokens), 1.0 if is_spec else 0.0)
        for i in range(3):
            self._xy[i] = keep * self._xy[i] + w * x[i] * seconds
            for j in range(3):
                self._xx[i][j] = keep * self._xx[i][j] + w * x[i] * x[j]
        self._mean = seconds if self._mean == 0.0 else keep * self._mean + w * seconds
        # Ridge toward (free a, b = 2% of a step, c = 0), scaled to the data.
        prior = (0.0, 0.02 * self._mean, 0.0)
        strength = (0.0, self.ridge * max(self._xx[1][1], 1.0), self.ridge)
        matrix = [[self._xx[i][j] + (strength[i] if i == j else 0.0) for j in range(3)] for i in range(3)]
        rhs = [self._xy[i] + strength[i] * prior[i] for i in range(3)]
        solution = _solve3(matrix, rhs)
        if solution is not None and solution[0] > 0 and solution[1] > 0:
            self.a, self.b, self.c = solution[0], solution[1], max(solution[2], 0.0)


def _solve3(m: list[list[float]], v: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting for a 3x3 system."""
    a = [row[:] + [v[i]] for i, row in enumerate(m)]
    for col in range(3):
        pivot = max(range(col, 3), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-18:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(col + 1, 3):
            f = a[r][col] / a[col][col]
            for cc in range(col, 4):
                a[r][cc] -= f * a[col][cc]
    x = [0.0] * 3
    for r in (2, 1, 0):
        x[r] = (a[r][3] - sum(a[r][cc] * x[cc] for cc in range(r + 1, 3))) / a[r][r]
    return x


@dataclass
class SpecPolicy:
    config: SpecConfig
    has_proposer: bool
    cost: StepCostModel = field(default_factory=StepCostModel)
    _state: dict[str, AcceptanceState] = field(default_factory=dict)
    _recent: PositionCounts = field(default_factory=PositionCounts)  # engine-wide

    def decide(self, requests: list[Request], caps: list[int], budget: int, num_running: int | None = None) -> list[int]:
        """Draft tokens per decoding request for this step (same order).

        `caps[i]` bounds request i's draft by its length limits; all drafts
        together use at most `budget` tokens. `num_running` (default: the
        decoding requests) is what the threshold compares: every running
        request, prefilling ones included.
        """
        ks = [0] * len(requests)
        k_maxes = [min(self._k_max(r), cap) for r, cap in zip(requests, caps)]
        if not requests:
            return ks
        batch_size = len(requests) if num_running is None else num_running
        auto_allowed = self.config.spec_disable_batch_size > 0 and batch_size <= self.config.spec_disable_batch_size
        candidates: list[tuple[float, int]] = []  # (gain, row)
        for i, request in enumerate(requests):
            mode = request.params.speculation
            k_max = k_maxes[i]
            if k_max == 0 or mode is False or (request.prediction_ids is None and not self.has_proposer):
                continue
            if mode is True or not self.config.adaptive:
                if mode is True or auto_allowed:
                    ks[i] = k_max
                continue
            if not auto_allowed:
                continue
            gain = 1.0
            for j, rate in enumerate(self._conditional_rates(self._state_for(request), k_max)):
                gain *= rate  # P(draft j+1 accepted) = product of the conditional rates up to it
                candidates.append((gain, i))
        # Forced rows spend the budget first.
        budget -= sum(ks)
        if budget < 0:
            ks = _shrink(ks, -budget)
            budget = 0
        if candidates:
            self._choose_adaptive(requests, k_maxes, candidates, ks, budget)
        return ks

    def _choose_adaptive(self, requests, k_maxes, candidates, ks, budget) -> None:
        cost = self.cost
        b_eff = cost.b + cost.draft
        expected = float(len(requests)) + sum(ks)  # forced drafts count as gain-free here
        plain_seconds = seconds = cost.a + cost.b * (len(requests) + sum(ks))
        already_spec = any(ks)
        if not already_spec:
            seconds += cost.c  # the first draft makes this a speculative step
        candidates.sort(key=lambda c: -c[0])
        chosen = [0] * len(requests)
        for gain, i in candidates:
            if budget <= 0 or gain * seconds <= b_eff * expected:
                break
            chosen[i] += 1
            expected += gain
            seconds += b_eff
            budget -= 1
        # All-or-nothing check for the fixed cost: speculate only if the whole
        # step's throughput beats the plain step's.
        if not already_spec and any(chosen):
            plain_expected = float(len(requests))
            if expected / seconds <= plain_expected / plain_seconds:
                chosen = [0] * len(requests)
        for i, request in enumerate(requests):
            if request.params.speculation != "auto" or k_maxes[i] == 0:
                continue
            if request.prediction_ids is None and not self.has_proposer:
                continue
            state = self._state_for(request)
            if chosen[i] == 0:
                state.plain_steps += 1
                if budget > 0 and state.plain_steps >= self.config.probe_interval << state.probe_backoff:
                    chosen[i] = 1  # probe: does drafting pay again?
                    budget -= 1
            ks[i] = chosen[i]

    def observe(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        """Record a verify step of `request` (drafts it actually carried)."""
        if num_drafted == 0:
            return
        state = self._state_for(request)
        state.counts.add(num_drafted, num_accepted, self.config.decay)
        self._recent.add(num_drafted, num_accepted, keep=0.98)  # the last ~50 verify steps
        if state.plain_steps:  # this was a probe
            state.probe_backoff = 0 if num_accepted else min(state.probe_backoff + 1, 3)
        state.plain_steps = 0

    def free(self, request_id: str) -> None:
        self._state.pop(request_id, None)

    def acceptance(self, request_id: str) -> float | None:
        """Estimated acceptance of the request's first draft token."""
        state = self._state.get(request_id)
        return self._conditional_rates(state, 1)[0] if state else None

    def _conditional_rates(self, state: AcceptanceState, k: int) -> list[float]:
        """P(draft j accepted | drafts before j accepted), j < k.

        The request's own decayed counts, shrunk toward the engine-wide rate
        at that position (itself shrunk toward the configured prior) with a
        weight of two verify steps: a new request starts from what drafting
        has recently earned, and its own history takes over quickly. For
        prompt lookup the later positions run high (a copy that started tends
        to continue), which a single per-token rate would miss.
        """
        prior, weight = self.config.prior_acceptance, 2.0
        rates = []
        for j in range(k):
            fleet = (self._recent.accepted[j] + weight * prior) / (self._recent.reached[j] + weight)
            own = (state.counts.accepted[j] + weight * fleet) / (state.counts.reached[j] + weight)
            rates.append(own)
        return rates

    def _state_for(self, request: Request) -> AcceptanceState:
        state = self._state.get(request.request_id)
        if state is None:
            state = self._state[request.request_id] = AcceptanceState()
        return state

    def _k_max(self, request: Request) -> int:
        k = request.params.num_speculative_tokens
        return self.config.num_speculative_tokens if k is None else k


def _shrink(ks: list[int], excess: int) -> list[int]:
    """Take `excess` draft tokens away, longest drafts first."""
    ks = list(ks)
    while excess > 0 and any(ks):
        i = max(range(len(ks)), key=lambda j: ks[j])
        ks[i] -= 1
        excess -= 1
    return ks
