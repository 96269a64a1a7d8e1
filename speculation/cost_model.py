"""An online model of one engine step's time, learned on the running machine.

    t = f(T) + c_ctx * C + c_spec * [the step verifies drafts] + c_draft * D + c_row * R + c_feed * F + c_logits * L

T is the tokens the target computes (prefill chunks, decode tokens, drafts),
C the keys its rows attend over (sum of context lengths), D the draft model's
forwards (0 for model-free proposers), R the token rows those forwards compute, a
row's catch-up feed (what it emitted since its last draft) counting each token (a
draft model's forward over 16 rows costs more than over one: on the real
pair, Qwen2.5-Coder-0.5B drafting for 1.5B, pricing forwards alone learned the
cost at one stream and lost 22% to plain decoding at 8), F the catch-up tokens past each row's
last one (a row that has not drafted for a while feeds its gap, the whole sequence the first
time: the draft model's prefill, compute-bound where its other rows are not; on that pair a
292-token catch-up made a 4-stream step of 53-70 ms take 600-650, where R's price, learned from the
usual one-to-five-token feeds, was 0.35 ms a row), L the positions the output projection
computes logits for (every sampling row's last token and drafts; a prefill
chunk's other tokens get none). L is what separates a verify step from a
prefill chunk of as many tokens: on SmolLM2 in float32 on 2 cores the output
projection takes 35 ms for 16 rows and 56 ms for 50, against 14 ms for the
one row a prefill chunk samples, so a step priced by T alone (learned from
prefills) came out 26-30% under a 13-50-token verify step's time. f is piecewise linear in T over
knots at every count up to 16, then log-spaced: a step's cost is not linear
in its tokens (on a 2-core CPU in float32 a step of 11 tokens cost 2.2x a step
of 1 and 16 rows of 1k context cost 164 ms while adding 4 drafts to each cost only 2.7 ms per token more;
on a GPU f stays flat until the step turns compute-bound). Nothing is tuned
in advance: the fit is exponentially weighted least squares over recent steps,
with a ridge that keeps f straight where the data says nothing (so knots never
visited extrapolate from the ones that were).

The model is validated as it runs: every step's prediction is compared with
the step's measured time before the step is learned from (`calibration`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np

from scheduler.types import Batch, StepOutput
from speculation import registry

# A knot at every token count up to 16: BLAS kernels switch at odd sizes (on an AVX2 CPU in
# float32, with the tuned layouts, 9 tokens cost ~1.1x one token and 10 cost ~1.9x), and decode
# and verify steps of a small batch live there. Then powers of two (24 between 16 and 32).
KNOTS = np.array(
    [*range(1, 17), 24, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384],
    dtype=np.float64,
)
# Sizes of plain steps are counted in coarser buckets (`plain_support`): one plain step of
# 5 tokens also measures one of 6.
_SUPPORT_KNOTS = [float(1 << i) for i in range(15)]  # 1, 2, 4, ..., 16384
# Parameters: f's level at T = 1, f's slope on each segment between knots (the
# last one extrapolates), then the per-thousand-keys, verify, draft-forward, logits-row,
# draft-row and catch-up-token costs.
_NUM_SLOPES = len(KNOTS) - 1
_LEVEL = 0
_SLOPES = slice(1, 1 + _NUM_SLOPES)
_CTX, _SPEC, _DRAFT, _LOGITS, _DRAFT_ROWS, _CATCH_UP = (n + _NUM_SLOPES for n in range(1, 7))
_NUM_FEATURES = 7 + _NUM_SLOPES
_TARGET_FEATURES = np.array([_LEVEL, *range(_SLOPES.start, _SLOPES.stop), _CTX, _SPEC, _LOGITS])
_CTX_SCALE = 1e-3  # C is fitted per thousand keys, so all features have similar sizes
_WIDTHS = np.diff(KNOTS)
_KNOT_LIST = [float(k) for k in KNOTS]
_SKIPPED_STEPS = 1  # the first step after start-up pays one-off kernel set-up: never learned from
_WARMUP_STEPS = 5  # steps learned from before predictions are scored and outliers clipped
_OUTLIER_FACTOR = 3.0
# A catch-up this long is compute-bound, as a prefill chunk is: steps with one measure its price.
CATCH_UP_SEEN = 16


@dataclass(frozen=True)
class StepShape:
    num_tokens: int  # T
    num_context: int = 0  # C
    is_spec: bool = False
    num_draft_forwards: int = 0  # D
    num_logits: int = 0  # L
    num_draft_rows: int = 0  # R: rows summed over the draft forwards
    num_catch_up: int = 0  # F: of those, the catch-up feeds' tokens past each row's last one


@dataclass
class Calibration:
    """How well the model predicted the steps it then learned from."""

    num_steps: int = 0
    predicted_seconds: float = 0.0
    observed_seconds: float = 0.0
    relative_error: float = 0.0  # EMA of |predicted - observed| / observed

    def add(self, predicted: float, observed: float) -> None:
        self.num_steps += 1
        self.predicted_seconds += predicted
        self.observed_seconds += observed
        error = abs(predicted - observed) / max(observed, 1e-9)
        self.relative_error = error if self.num_steps == 1 else 0.95 * self.relative_error + 0.05 * error


def _bucket(num_tokens: int, knots: list[float] = _KNOT_LIST) -> int:
    return max(bisect.bisect_right(knots, num_tokens + 0.5) - 1, 0)


def _features(shape: StepShape) -> np.ndarray:
    x = np.zeros(_NUM_FEATURES)
    t = float(max(shape.num_tokens, 1))
    x[_LEVEL] = 1.0
    # Tokens past each knot, up to the segment's width (unbounded on the last segment).
    past = np.clip(t - KNOTS[:-1], 0.0, None)
    past[:-1] = np.minimum(past[:-1], _WIDTHS[:-1])
    x[_SLOPES] = past
    x[_CTX] = shape.num_context * _CTX_SCALE
    x[_SPEC] = 1.0 if shape.is_spec else 0.0
    x[_DRAFT] = float(shape.num_draft_forwards)
    x[_LOGITS] = float(shape.num_logits)
    x[_DRAFT_ROWS] = float(shape.num_draft_rows)
    x[_CATCH_UP] = float(shape.num_catch_up)
    return x


def _slope_change_penalty() -> np.ndarray:
    """D such that |D w|^2 sums the squared changes of f's slope between neighbouring segments."""
    rows = []
    for k in range(_NUM_SLOPES - 1):
        row = np.zeros(_NUM_FEATURES)
        row[1 + k], row[2 + k] = -1.0, 1.0
        rows.append(row * KNOTS[k + 1])  # in seconds across the knot's own scale: every knot weighs alike
    return np.array(rows)


_SMOOTH = _slope_change_penalty()
# Costs cannot be negative: f never falls with more tokens, and context, verify
# and draft forwards never make a step cheaper. Only the level is free.
_NONNEGATIVE = np.arange(1, _NUM_FEATURES)


@dataclass
class StepCostModel:
    # Weight of the newest step: about the last 1 / weight steps count.
    weight: float = 0.02
    # Ridge strengths, relative to the data's own scale.
    smoothness: float = 1e-5
    shrink: float = 1e-6
    coef: np.ndarray = field(default_factory=lambda: np.zeros(_NUM_FEATURES))
    calibration: Calibration = field(default_factory=Calibration)
    _xx: np.ndarray = field(default_factory=lambda: np.zeros((_NUM_FEATURES, _NUM_FEATURES)))
    _xy: np.ndarray = field(default_factory=lambda: np.zeros(_NUM_FEATURES))
    _mean: float = 0.0
    _slopes: list[float] = field(default_factory=lambda: [0.0] * _NUM_SLOPES)
    _knot_rises: np.ndarray = field(default_factory=lambda: np.zeros(len(KNOTS)))  # f(knot k) - f(1)
    _rises: list[float] = field(default_factory=lambda: [0.0] * _NUM_SLOPES)  # the same, as a list, per segment
    # Decayed count of recent plain (non-verify) steps per token bucket [knot, next knot).
    _plain_support: list[float] = field(default_factory=lambda: [0.0] * len(_SUPPORT_KNOTS))
    # Decayed counts of recent steps that ran draft forwards, and catch-up feeds of CATCH_UP_SEEN tokens or more.
    draft_support: float = 0.0
    catch_up_support: float = 0.0
    num_seen: int = 0
    num_observed: int = 0

    @property
    def is_fitted(self) -> bool:
        return self.num_observed > 0

    def predict(self, shape: StepShape) -> float:
        return max(float(_features(shape) @ self.coef), 0.0)

    def added_tokens_cost(self, num_tokens: int, extra: int) -> float:
        """Seconds `extra` more tokens add to a step of `num_tokens`: f's rise between them.
        Not one slope times `extra`: f need not be convex (on an AVX2 CPU in float32 a
        second token cost ~80 ms over a 1-token step's ~115, the next six almost nothing),
        so a first draft token can be dear where a whole draft is cheap. The policy prices
        every prefix of a draft at once with `added_tokens_costs`."""
        return self._rise(num_tokens + extra) - self._rise(num_tokens)

    def _rise(self, num_tokens: int) -> float:
        b = min(_bucket(num_tokens), _NUM_SLOPES - 1)
        return self._rises[b] + self._slopes[b] * max(num_tokens - _KNOT_LIST[b], 0.0)

    def added_tokens_costs(self, num_tokens: int, extras: np.ndarray) -> np.ndarray:
        """`added_tokens_cost(num_tokens, m)` for every m in `extras`, in one call: the policy
        prices every prefix of its ranked draft tokens, hundreds a step at 32 rows. An extra
        count may be fractional (tokens expected, where drafts can end early): f is piecewise
        linear, so it is read between whole counts."""
        totals = num_tokens + np.asarray(extras, dtype=np.float64)
        rises = np.interp(totals, KNOTS, self._knot_rises)
        # Past the last knot f keeps its last slope, as `_rise` does.
        rises += self._slopes[-1] * np.clip(totals - KNOTS[-1], 0.0, None)
        return rises - self._rise(num_tokens)

    def plain_support(self, num_tokens: int) -> float:
        """How many plain steps of about this size (same power-of-two bucket) the model
        saw recently, decayed at the fit's own rate: below 1, a plain step of
        this size is extrapolated rather than measured."""
        return self._plain_support[_bucket(num_tokens, _SUPPORT_KNOTS)]

    def tokens_cost(self, num_tokens: int) -> float:
        return self.predict(StepShape(num_tokens))

    @property
    def spec_cost(self) -> float:
        return max(float(self.coef[_SPEC]), 0.0)

    @property
    def draft_forward_cost(self) -> float:
        return max(float(self.coef[_DRAFT]), 0.0)

    @property
    def draft_row_cost(self) -> float:
        """Seconds one more row adds to a draft forward."""
        return max(float(self.coef[_DRAFT_ROWS]), 0.0)

    @property
    def catch_up_cost(self) -> float:
        """Seconds one more catch-up token adds to a draft forward, on top of its row's price."""
        return max(float(self.coef[_CATCH_UP]), 0.0)

    @property
    def logits_cost(self) -> float:
        """Seconds one more position's logits add (each draft token adds one)."""
        return max(float(self.coef[_LOGITS]), 0.0)

    def observe(self, shape: StepShape, seconds: float) -> None:
        self.num_seen += 1
        if seconds <= 0 or self.num_seen <= _SKIPPED_STEPS:
            return
        if self.num_observed >= _WARMUP_STEPS:
            predicted = self.predict(shape)
            self.calibration.add(predicted, seconds)
            # A step stalled by something else (another process, a GC pause) must not
            # move the fit far: learn from at most 3x (and at least 1/3) the prediction.
            if predicted > 0:
                seconds = min(max(seconds, predicted / _OUTLIER_FACTOR), predicted * _OUTLIER_FACTOR)
        x = _features(shape)
        keep = 1.0 - self.weight
        self._plain_support = [keep * w for w in self._plain_support]
        if not shape.is_spec:
            self._plain_support[_bucket(shape.num_tokens, _SUPPORT_KNOTS)] += 1.0
        self.draft_support = keep * self.draft_support + (shape.num_draft_forwards > 0)
        self.catch_up_support = keep * self.catch_up_support + (shape.num_catch_up >= CATCH_UP_SEEN)
        self._xx = keep * self._xx + self.weight * np.outer(x, x)
        self._xy = keep * self._xy + self.weight * x * seconds
        self._mean = seconds if not self.num_observed else keep * self._mean + self.weight * seconds
        self.num_observed += 1
        self._solve()

    def _solve(self) -> None:
        # The ridges' scale is the target step's own features': a draft model's catch-up feeds
        # hundreds of rows in one step, and squared in the trace they would set every ridge by
        # that one feature's size rather than the step's. (Not the cause of the mispriced plain
        # steps on the real pair: that was the fresh server's first verify, `policy.EXPLORE_UNSEEN`.)
        target = self._xx[_TARGET_FEATURES, _TARGET_FEATURES]
        scale = max(float(target.sum()) / len(target), 1e-12)
        matrix = self._xx + self.smoothness * scale * (_SMOOTH.T @ _SMOOTH)
        # A weak pull toward "every step costs the mean, one token 1% more per token":
        # only where the data is silent (segments never visited, a fixed cost never seen).
        prior = np.zeros(_NUM_FEATURES)
        prior[_LEVEL] = self._mean
        prior[_SLOPES] = 0.01 * self._mean
        matrix = matrix + self.shrink * scale * np.eye(_NUM_FEATURES)
        rhs = self._xy + self.shrink * scale * prior
        # Non-negative least squares by an active set: pin the most negative
        # cost at zero and solve again, until every cost is >= 0.
        free = np.ones(_NUM_FEATURES, dtype=bool)
        coef = np.zeros(_NUM_FEATURES)
        for _ in range(_NUM_FEATURES):
            try:
                solution = np.linalg.solve(matrix[np.ix_(free, free)], rhs[free])
            except np.linalg.LinAlgError:
                return
            coef[:] = 0.0
            coef[free] = solution
            negative = [i for i in _NONNEGATIVE if free[i] and coef[i] < 0]
            if not negative:
                break
            free[min(negative, key=lambda i: coef[i])] = False
        coef[_NONNEGATIVE] = np.maximum(coef[_NONNEGATIVE], 0.0)
        self.coef = coef
        self._slopes = [float(s) for s in coef[_SLOPES]]
        self._knot_rises = np.concatenate(([0.0], np.cumsum(coef[_SLOPES] * _WIDTHS)))
        self._rises = self._knot_rises[:-1].tolist()  # `_rise` runs in plain Python, per query

    def summary(self) -> dict:
        c = self.calibration
        return {
            "steps_observed": self.num_observed,
            "relative_error": round(c.relative_error, 4) if c.num_steps else None,
            "predicted_over_observed": round(c.predicted_seconds / c.observed_seconds, 4)
            if c.observed_seconds
            else None,
            "ms_per_step_at_tokens": {int(t): round(self.tokens_cost(int(t)) * 1e3, 3) for t in (1, 4, 16, 64, 256)},
            "ms_per_1k_context": round(float(self.coef[_CTX]) * 1e3, 4),
            "ms_spec_step": round(self.spec_cost * 1e3, 3),
            "ms_per_draft_forward": round(self.draft_forward_cost * 1e3, 3),
            "ms_per_draft_row": round(self.draft_row_cost * 1e3, 3),
            "ms_per_catch_up_token": round(self.catch_up_cost * 1e3, 3),
            "ms_per_logits_row": round(self.logits_cost * 1e3, 3),
        }


def step_shape(batch: Batch, output: StepOutput) -> StepShape:
    """What the step cost model prices of a step as it ran: the tokens the target computed
    (drafts included), the keys they attended over, whether it verified, draft forwards
    (one for probes alone) and the token rows they computed (a row's catch-up feed counts each
    of its tokens; those past its last one count again, as catch-up), and the positions it
    computed logits for (a sampling row's last token and drafts)."""
    drafts = [out.num_draft_tokens for out in output.rows]
    device_drafts = [out.num_draft_tokens for out in output.rows if registry.capabilities(out.method).on_device]
    probed = any(out.probe_id is not None for out in output.rows)
    return StepShape(
        num_tokens=sum(len(row.token_ids) for row in batch.rows) + sum(drafts),
        num_context=sum(row.start_pos + len(row.token_ids) + k for row, k in zip(batch.rows, drafts)),
        is_spec=any(drafts),
        num_draft_forwards=max(*device_drafts, int(probed), 0),
        num_logits=sum(1 + k for row, k in zip(batch.rows, drafts) if row.sample),
        num_draft_rows=output.num_draft_rows,
        num_catch_up=output.num_draft_catch_up,
    )
