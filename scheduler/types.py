"""Wire types between server, scheduler and models.

Plain dataclasses of Python lists: no tensors cross this boundary, so the
scheduler is testable with a fake runner and the server never sees torch.
"""

from __future__ import annotations

import enum
import secrets
import time
from dataclasses import dataclass, field
from typing import Literal, Protocol

SpeculationMode = Literal["auto", True, False]

MAX_SPEC_TOKENS = 16  # per-request `num_speculative_tokens` upper bound
MAX_LOGIT_BIAS = 1024  # entries in one request's `logit_bias`
MAX_STOP_TOKEN_IDS = 64  # entries in one request's `stop_token_ids`
MAX_TOP_LOGPROBS = 20  # as OpenAI
MAX_TEMPERATURE = 2.0  # as OpenAI
# Temperatures below this decode greedily (as vLLM): dividing float32 logits by
# a smaller one overflows to inf, and the softmax of inf is NaN.
GREEDY_TEMPERATURE = 1e-5


class InvalidRequestError(ValueError):
    """A request the engine refuses before queueing; `param` names the field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class TokenConstraint(Protocol):
    """What the engine asks of a request's grammar (`models.grammar.GrammarState`): the scheduler
    advances it by emitted tokens only; speculation reads it without committing anything."""

    @property
    def is_done(self) -> bool:
        """Nothing but end-of-sequence can follow."""

    @property
    def error(self) -> str | None:
        """Why the grammar can go no further (its limits, a refused token); None while it can."""

    def advance(self, token_ids: list[int]) -> bool:
        """Commit emitted tokens; False if the grammar refuses one."""

    def forced(self) -> list[int]:
        """The tokens the grammar allows as the only continuation from here."""

    def accepts(self, token_ids: list[int]) -> int:
        """How many of `token_ids`, in order, the grammar allows from here."""


@dataclass
class SamplingParams:
    """Per-request decoding parameters, validated on construction.

    temperature 0 (or below GREEDY_TEMPERATURE) means greedy. `top_k` <= 0 and `top_p` == 1 disable those
    filters. `logprobs` None: no logprobs; 0: the chosen token's; n: plus the
    top n. `seed` None draws a random seed: every request samples from its own
    counter-based stream, so its tokens never depend on its batch neighbours.
    `seeded` says the caller chose the seed: such a request verifies drafts by the
    coupled scheme (models.sampling), so its text is the plain path's whatever speculated.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    speculation: SpeculationMode = "auto"
    num_speculative_tokens: int | None = None
    # Test-only fault injection (honoured only when the engine enables it).
    fault: str | None = None
    seeded: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self.seeded = self.seed is not None
        if self.seed is None:
            self.seed = secrets.randbits(63)
        self.validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def validate(self) -> None:
        def bad(param: str, why: str) -> InvalidRequestError:
            return InvalidRequestError(f"'{param}' {why}", param=param)

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise bad("temperature", f"must be in [0, {MAX_TEMPERATURE:g}] (as OpenAI), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise bad("top_k", f"must be -1, 0 (disabled) or a positive integer, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise bad(name, f"must be in [-2, 2], got {value}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise bad("repetition_penalty", f"must be in (0, 10], got {self.repetition_penalty}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise bad("stop_token_ids", f"may hold at most {MAX_STOP_TOKEN_IDS} ids")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise bad("logit_bias", f"may hold at most {MAX_LOGIT_BIAS} entries")
        for token_id, bias in self.logit_bias.items():
            if not -100.0 <= bias <= 100.0:
                raise bad("logit_bias", f"values must be in [-100, 100], got {bias} for token {token_id}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise bad("logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")
        if self.speculation not in ("auto", True, False):
            raise bad("speculation", f'must be "auto", true or false, got {self.speculation!r}')
        k = self.num_speculative_tokens
        if k is not None and (isinstance(k, bool) or not 0 <= k <= MAX_SPEC_TOKENS):
            raise bad("num_speculative_tokens", f"must be an integer in [0, {MAX_SPEC_TOKENS}], got {k!r}")
        if self.seed is None or not 0 <= self.seed < 2**63:
            raise bad("seed", "must be in [0, 2**63)")


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass
class Draft:
    """One row's draft: tokens a proposer offers to follow a request's tokens.

    Model-free drafts are one-hot (q is 1 on each token); a proposer that estimates it gives
    each token's probability given the draft before it (`token_probs`, what the policy prices
    a draft by; the rejection sampler still sees one-hot q). A draft made ahead, at the end of
    the step that produced the request's tokens (`Request.draft`), says which tokens it follows
    (`num_tokens`) and how many were asked for (`max_tokens`), so the policy and the next step
    read it instead of proposing again. A draft model's or head's drafts stay on the device as
    tensors and are never a `Draft`."""

    method: str  # the proposer that made it
    token_ids: list[int]
    token_probs: list[float] | None = None
    num_tokens: int = -1  # prompt + output tokens it follows (-1: made for the step in hand)
    max_tokens: int = 0  # tokens asked for (it holds fewer where the continuation ends)

    def fits(self, method: str, num_tokens: int, k: int) -> bool:
        return self.method == method and self.num_tokens == num_tokens and k <= self.max_tokens


@dataclass
class Request:
    """One sequence. The scheduler owns the mutable state below the line."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    # Predicted Outputs: the client's expected completion, used as the draft.
    prediction_ids: list[int] | None = None
    # Isolation: requests share cached prefixes and cross-request drafts only within one
    # `cache_scope`: their tenant (named by the credential, `server.auth`), narrowed by a
    # `cache_salt` when the request gives one.
    tenant: str = ""
    cache_salt: str | None = None
    # Structured outputs: every token the request emits obeys this grammar (None: free text).
    constraint: TokenConstraint | None = None
    arrival_time: float = field(default_factory=time.monotonic)

    # -- scheduler state --
    status: RequestStatus = RequestStatus.WAITING
    # The draft made ahead for the tokens so far (`Draft.num_tokens`), None until a step makes one.
    draft: Draft | None = None
    # Token ids that end the request: its stop_token_ids and (unless ignore_eos) the model's
    # end-of-sequence ids, as one set built when it is queued, not per step.
    stop_ids: frozenset[int] = frozenset()
    output_ids: list[int] = field(default_factory=list)
    # Tokens whose KV is in the cache. Rejected drafts are rolled back by
    # moving this back; the runner writes each step from here.
    num_computed_tokens: int = 0
    # KV blocks holding positions 0, block_size, 2 * block_size, ... (`scheduler.kv_blocks`).
    block_ids: list[int] = field(default_factory=list)
    # Prefix-cache keys of the sequence's full blocks, computed as they fill.
    block_keys: list[bytes] = field(default_factory=list)
    # Prompt tokens found in the prefix cache when first admitted (usage.prompt_tokens_details).
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    error: str | None = None
    first_scheduled_time: float | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_prediction_accepted: int = 0
    num_prediction_rejected: int = 0

    @property
    def cache_scope(self) -> str:
        """What the request's shared caches are keyed by: its tenant, or (tenant, salt)."""
        return self.tenant if self.cache_salt is None else f"{self.tenant}\x00{self.cache_salt}"

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building the whole list."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.prompt_ids[start:] + self.output_ids[: end - n]

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens to compute before the request decodes: its prompt, or, after a
        preemption freed its KV, everything but the last token (which decodes)."""
        return self.num_tokens - 1 if self.output_ids else len(self.prompt_ids)

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_prefill_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass
class ScheduledRow:
    """One request's share of a step.

    `token_ids` are written to the KV at positions `start_pos ..`; for a
    prefill chunk they are prompt tokens, for decode the last sampled token.
    `num_spec_tokens` > 0 asks the runner to propose that many draft tokens
    and verify them in the same forward. `sample` is False for a prefill chunk
    that does not reach the end of the prompt.
    """

    request: Request
    token_ids: list[int]
    start_pos: int
    sample: bool
    num_spec_tokens: int = 0
    # > 0: a row that runs plain asks a model-free proposer for this many tokens
    # anyway, returned unverified (`RowOutput.shadow_ids`) so the policy can
    # learn the row's acceptance at no verify cost.
    num_shadow_tokens: int = 0
    # The row drafts by prompt lookup (n-gram) instead of the engine's draft model or head.
    use_lookup: bool = False
    # A row that runs plain asks the device proposer (draft model, head) for one draft token
    # anyway, returned unverified (`RowOutput.probe_id`): the token the row emits grades it.
    probe: bool = False

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def block_ids(self) -> list[int]:
        return self.request.block_ids


@dataclass
class Batch:
    rows: list[ScheduledRow]
    # Requests that finished or were preempted since the last step: the runner
    # drops their state (a preempted one starts afresh when readmitted).
    finished_ids: list[str] = field(default_factory=list)


@dataclass
class RowOutput:
    """What the runner produced for one row: 0 tokens mid-prefill, else 1..K+1."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    # Log-probability of each token above, and the top-n alternatives.
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Proposer that drafted for this row this step: "ngram", "suffix", "draft_model",
    # "eagle", "prediction", "grammar" (tokens its grammar forces) ("ngram" beside a device
    # proposer: a lookup row); None when the row did not speculate.
    method: str | None = None
    error: str | None = None
    # The shadow draft asked for by `ScheduledRow.num_shadow_tokens` (not verified).
    shadow_ids: list[int] | None = None
    # The probe's draft token asked for by `ScheduledRow.probe` (not verified), and, where
    # the step sampled, the chance the rejection sampler would have accepted it.
    probe_id: int | None = None
    probe_accept: float | None = None
    # The draft made ahead for the request's tokens after this step's (`Request.draft`).
    next_draft: Draft | None = None


@dataclass
class StepOutput:
    rows: list[RowOutput]
    # Token rows the device proposer's forwards computed (catch-up feeds and drafts fed back).
    num_draft_rows: int = 0
    # Of those, the catch-up feeds' tokens past each row's last one (`DraftPlan.num_catch_up`).
    num_draft_catch_up: int = 0
    # Seconds by phase: "prefill", "draft", "verify", "decode".
    phase_seconds: dict[str, float] = field(default_factory=dict)
    # accepted_per_position[i]: rows whose draft token i+1 was accepted.
    accepted_per_position: list[int] = field(default_factory=list)
    # Entries the proposer keeps across requests (`Proposer.cache_nodes`; None: it keeps none).
    proposer_cache_nodes: int | None = None
    # Structured outputs: seconds the step's grammar masks took (None: no row had a grammar),
    # and draft tokens cut because a row's grammar refused them.
    grammar_mask_seconds: float | None = None
    grammar_cut_tokens: int = 0


@dataclass
class RequestOutput:
    """One step's news for one request, sent down its stream."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float] | None = None
    new_top_logprobs: list[list[tuple[int, float]]] | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_output_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_prediction_accepted: int = 0
    num_prediction_rejected: int = 0
    # The stop token that ended the request (not in new_token_ids), if any.
    stop_token_id: int | None = None


@dataclass
class SpecCounts:
    """Speculation counters for one proposer method within a step."""

    num_drafts: int = 0  # rows that carried a draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass
class FinishedRequestStats:
    finish_reason: FinishReason
    e2e_seconds: float
    ttft_seconds: float | None
    num_prompt_tokens: int
    num_output_tokens: int
    structured: bool = False  # it ran under a grammar


@dataclass
class QueueState:
    """The scheduler's queues and KV pool at one moment: what the gauges show."""

    num_running: int = 0
    num_waiting: int = 0
    num_preempted: int = 0  # of the waiting: requests that ran and were preempted
    kv_blocks_used: int = 0  # held by requests (free cached blocks count as free)
    kv_blocks_total: int = 0

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


# Why a step with `auto` rows ran plain (`StepPlan.plain_reason`, counted per reason).
PLAIN_REASONS = ("cap", "no_draft", "budget", "no_gain", "margin", "explore")


@dataclass
class StepPlan:
    """One step's plan, from the policy that made it to the metrics that report it: what the
    policy expected of the step, and (once it ran) what its decode rows emitted."""

    expected_tokens: float  # by the decode rows
    predicted_seconds: float | None  # None before the cost model has data
    num_rows: int = 0  # decode rows the expectation covers
    edge: float = 1.0  # predicted tokens per second of the chosen step over the plain step's
    lookup_rows: frozenset[int] = frozenset()  # rows (by index) that draft by prompt lookup
    probe_rows: frozenset[int] = frozenset()  # rows (by index) whose device proposer drafts unverified
    plain_reason: str | None = None  # set where auto rows could have drafted and the step runs plain (PLAIN_REASONS)
    # Filled in when the step's output is applied: what the decode rows emitted, and the probes
    # graded (a sampled row's probe counts its chance of acceptance, so `accepted` need not be whole).
    emitted_tokens: int = 0
    probes_graded: int = 0
    probes_accepted: float = 0.0


@dataclass
class StepStats:
    """Everything one engine step did, for the metrics observer.

    Filled by the engine loop; `scheduler.metrics` is the one place that turns
    it into Prometheus samples.
    """

    step_seconds: float
    batch_size: int  # running requests in the step
    mode: Literal["spec", "plain"]
    queue: QueueState = field(default_factory=lambda: QueueState())  # after the step
    # Since the last stats: prefix-cache lookups and hits (tokens), and preemptions.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_prompt_tokens: int = 0  # prompt tokens prefilled this step
    num_generation_tokens: int = 0  # tokens emitted this step
    spec: dict[str, SpecCounts] = field(default_factory=dict)  # by method
    # accepted_per_position[i]: rows whose draft token i+1 was accepted.
    accepted_per_position: list[int] = field(default_factory=list)
    phase_seconds: dict[str, float] = field(default_factory=dict)
    proposer_cache_nodes: int | None = None  # see StepOutput
    grammar_mask_seconds: float | None = None  # see StepOutput
    grammar_cut_tokens: int = 0
    plan: StepPlan | None = None  # the policy's plan for the step, with what it emitted
    # Probes graded this step (a draft model's or head's one unverified token for a row that
    # ran plain), by proposer method: (graded, accepted). A sampled row's probe counts its
    # chance of acceptance, so `accepted` need not be whole.
    probes: dict[str, tuple[int, float]] = field(default_factory=dict)
    # For each row that emitted n > 0 tokens after a gap of g seconds since its
    # previous emission: (n, g). Per-token ITL records n samples of g / n.
    token_gaps: list[tuple[int, float]] = field(default_factory=list)
    first_token_latencies: list[float] = field(default_factory=list)
    queue_seconds: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)
