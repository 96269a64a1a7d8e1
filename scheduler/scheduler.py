"""Continuous-batching scheduler: pure Python over `Request` dataclasses.

`schedule()` builds one `Batch`: running requests first (decode, with the
policy's draft tokens), then chunked prefill, then FIFO admission of waiting
requests while a slot is free and the step's token budget lasts.
`update()` applies the runner's `StepOutput`: appends tokens, cuts at stop
tokens and `max_tokens`, rolls rejected drafts back by setting
`num_computed_tokens`, and frees finished requests' slots.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from dataclasses import dataclass, field

from scheduler.cost_model import StepShape
from scheduler.policy import Preview, SpecConfig, SpecPolicy, StepPlan
from scheduler.types import (
    Batch,
    FinishReason,
    InvalidRequestError,
    Request,
    RequestOutput,
    RequestStatus,
    ScheduledRow,
    StepOutput,
)


class QueueFullError(RuntimeError):
    """The waiting queue is at `max_queue`; the client should retry later."""


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 16
    max_model_len: int = 2048
    # Tokens one step may feed the target (prefill chunks + decode + drafts).
    max_num_batched_tokens: int = 512
    max_queue: int = 256
    eos_token_ids: list[int] = field(default_factory=list)
    spec: SpecConfig = field(default_factory=SpecConfig)

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs (every running request decodes each step)")
        if self.max_queue < 0:
            raise ValueError("max_queue must be >= 0")


@dataclass
class StepCheck:
    """The policy's plan for the last step against what it did."""

    predicted_seconds: float | None  # None before the cost model has data
    expected_tokens: float  # by the decode rows
    emitted_tokens: int


class Scheduler:
    def __init__(self, config: SchedulerConfig, proposer: str = "ngram", preview: Preview | None = None):
        """`proposer`: the runner's proposer method ("ngram", "suffix", "draft_model" or "none");
        `preview`: the runner's priced drafts, for a proposer that gives them (see SpecPolicy)."""
        self.config = config
        self.proposer = proposer
        self.policy = SpecPolicy(config.spec, proposer, preview=preview)
        self.last_plan: StepPlan | None = None
        self.last_check: StepCheck | None = None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._free_slots = list(range(config.max_num_seqs))
        heapq.heapify(self._free_slots)
        self._aborted: set[str] = set()
        self._finished_ids: list[str] = []
        self._requests: dict[str, Request] = {}

    # -- intake --
    def check(self, request: Request) -> None:
        """Refuse what can never run, before it is queued."""
        limit = self.config.max_model_len
        if not request.prompt_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if request.num_prompt_tokens >= limit:
            raise InvalidRequestError(
                f"this model's maximum context length is {limit} tokens, "
                f"but the prompt has {request.num_prompt_tokens} tokens",
                param="prompt",  # the server names its own field (chat: "messages")
                code="context_length_exceeded",
            )
        if request.num_prompt_tokens + request.params.max_tokens > limit:
            raise InvalidRequestError(
                f"this model's maximum context length is {limit} tokens; the prompt has "
                f"{request.num_prompt_tokens} tokens and max_tokens is {request.params.max_tokens}",
                param="max_tokens",
                code="context_length_exceeded",
            )

    def add(self, request: Request) -> None:
        self.check(request)
        if request.request_id in self._requests:
            raise InvalidRequestError(f"duplicate request id {request.request_id}", param="request_id")
        if len(self.waiting) >= self.config.max_queue:
            raise QueueFullError(f"the queue is full ({self.config.max_queue} waiting requests)")
        self._requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_id: str) -> None:
        if request_id in self._requests:
            self._aborted.add(request_id)

    # -- state --
    @property
    def has_work(self) -> bool:
        # Finished ids count: the runner frees their state (a suffix proposer caches their outputs)
        # on the next step, which must not wait for the next request to arrive.
        return bool(self.waiting or self.running or self._aborted or self._finished_ids)

    @property
    def kv_usage(self) -> float:
        used = sum(r.num_computed_tokens for r in self.running)
        return used / (self.config.max_num_seqs * self.config.max_model_len)

    def get(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def speculation_settings(self) -> dict:
        """The speculation settings in force, as GET /v1/speculation names them."""
        spec = self.config.spec
        return {
            "proposer": self.proposer,
            "num_speculative_tokens": spec.num_speculative_tokens,
            "spec_disable_batch_size": spec.spec_disable_batch_size,
            "adaptive": spec.adaptive,
        }

    def describe_speculation(self) -> str:
        """One line for the startup log."""
        spec = self.config.spec
        cap = spec.spec_disable_batch_size
        if cap == 0:
            auto = "never speculate (cap 0)"
        else:
            limit = f", while at most {cap} requests run" if cap is not None else " (no batch-size cap)"
            auto = "decide per request from acceptance and the step's learned cost" + limit
        return (
            f"proposer={self.proposer} num_speculative_tokens={spec.num_speculative_tokens} "
            f"adaptive={spec.adaptive}; auto rows {auto}"
        )

    def policy_summary(self) -> dict:
        """The policy's own view (cost model, calibration, recent acceptance)."""
        return self.policy.summary()

    # -- schedule --
    def schedule(self) -> tuple[Batch, list[RequestOutput]]:
        """The next batch, plus final outputs for requests aborted since the last step."""
        aborted = self._apply_aborts()
        budget = self.config.max_num_batched_tokens
        decoding = [r for r in self.running if not r.is_prefilling]
        budget -= len(decoding)
        rows: list[ScheduledRow] = []

        # Chunked prefill of running requests, then admission (FIFO, no skipping).
        prefills: list[ScheduledRow] = []
        for request in self.running:
            if request.is_prefilling and budget > 0:
                prefills.append(self._prefill_row(request, budget))
                budget -= len(prefills[-1].token_ids)
        now = time.monotonic()
        while self.waiting and self._free_slots and budget > 0:
            request = self.waiting.popleft()
            request.slot = heapq.heappop(self._free_slots)
            request.status = RequestStatus.RUNNING
            request.first_scheduled_time = now
            self.running.append(request)
            prefills.append(self._prefill_row(request, budget))
            budget -= len(prefills[-1].token_ids)

        caps = [self._draft_cap(r) for r in decoding]
        prefill = StepShape(
            num_tokens=sum(len(p.token_ids) for p in prefills),
            num_context=sum(p.start_pos + len(p.token_ids) for p in prefills),
        )
        ks, self.last_plan = self.policy.decide(decoding, caps, budget, len(self.running), prefill)
        for request, k in zip(decoding, ks):
            rows.append(
                ScheduledRow(
                    request=request,
                    token_ids=[request.output_ids[-1]],
                    start_pos=request.num_computed_tokens,
                    sample=True,
                    num_spec_tokens=k,
                    num_shadow_tokens=min(self.policy.wants_shadow(request, k), self._draft_cap(request) + 1),
                )
            )
        rows += prefills
        finished_ids, self._finished_ids = self._finished_ids, []
        return Batch(rows=rows, finished_ids=finished_ids), aborted

    def _prefill_row(self, request: Request, budget: int) -> ScheduledRow:
        start = request.num_computed_tokens
        end = min(request.num_prompt_tokens, start + budget)
        return ScheduledRow(
            request=request,
            token_ids=request.prompt_ids[start:end],
            start_pos=start,
            sample=end == request.num_prompt_tokens,
        )

    def _draft_cap(self, request: Request) -> int:
        # A step emits up to k + 1 tokens; drafting past max_tokens is waste.
        return max(0, request.params.max_tokens - len(request.output_ids) - 1)

    # -- update --
    def update(self, batch: Batch, output: StepOutput, step_seconds: float | None = None) -> list[RequestOutput]:
        """Apply a step's outputs. With `step_seconds` (a whole step, as scheduled) the
        policy also learns the step's cost and checks its plan."""
        if step_seconds is not None:
            self._observe_step(batch, output, step_seconds)
        results = []
        for row, out in zip(batch.rows, output.rows):
            request = row.request
            if request.is_finished:
                continue
            if out.error is not None:
                request.error = out.error
                self._finish(request, FinishReason.ERROR)
                results.append(self._output(request, [], None, None, finished=True))
                continue
            request.num_computed_tokens = row.start_pos + len(row.token_ids) + out.num_accepted_tokens
            if not row.sample:
                continue
            self._count_speculation(request, out)
            if request.params.speculation == "auto":
                self.policy.observe_shadow(request, out.shadow_ids or [], out.token_ids)
            new_ids, stop_id = self._append(request, out.token_ids)
            n = len(new_ids)
            logprobs = out.logprobs[:n] if out.logprobs is not None else None
            top = out.top_logprobs[:n] if out.top_logprobs is not None else None
            results.append(self._output(request, new_ids, logprobs, top, request.is_finished, stop_id))
        return results

    def _observe_step(self, batch: Batch, output: StepOutput, seconds: float) -> None:
        drafts = [out.num_draft_tokens for out in output.rows]
        draft_model = [out.num_draft_tokens for out in output.rows if out.method == "draft_model"]
        shape = StepShape(
            num_tokens=sum(len(row.token_ids) for row in batch.rows) + sum(drafts),
            num_context=sum(row.start_pos + len(row.token_ids) + k for row, k in zip(batch.rows, drafts)),
            is_spec=any(drafts),
            num_draft_forwards=max(draft_model, default=0),
        )
        emitted = sum(
            len(out.token_ids)
            for row, out in zip(batch.rows, output.rows)
            if row.start_pos >= row.request.num_prompt_tokens  # decode rows: what the plan covered
        )
        plan = self.last_plan
        self.last_check = StepCheck(
            plan.predicted_seconds if plan else None, plan.expected_tokens if plan else 0.0, emitted
        )
        self.policy.observe_step(shape, seconds, plan, emitted)

    def fail(self, request_id: str, message: str) -> RequestOutput | None:
        """End one request with an error (engine fault attributed to it)."""
        request = self._requests.get(request_id)
        if request is None or request.is_finished:
            return None
        request.error = message
        self._finish(request, FinishReason.ERROR)
        return self._output(request, [], None, None, finished=True)

    def _count_speculation(self, request: Request, out) -> None:
        if not out.num_draft_tokens:
            return
        request.num_draft_tokens += out.num_draft_tokens
        request.num_accepted_tokens += out.num_accepted_tokens
        if out.method == "prediction":
            request.num_prediction_accepted += out.num_accepted_tokens
            request.num_prediction_rejected += out.num_draft_tokens - out.num_accepted_tokens
        self.policy.observe(request, out.num_draft_tokens, out.num_accepted_tokens)

    def _append(self, request: Request, token_ids: list[int]) -> tuple[list[int], int | None]:
        """Append tokens up to a stop token or max_tokens; finish the request if one is hit."""
        params = request.params
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops.update(self.config.eos_token_ids)
        new_ids: list[int] = []
        for token_id in token_ids:
            if token_id in stops:
                self._finish(request, FinishReason.STOP)
                return new_ids, token_id
            request.output_ids.append(token_id)
            new_ids.append(token_id)
            if len(request.output_ids) >= params.max_tokens:
                self._finish(request, FinishReason.LENGTH)
                break
        return new_ids, None

    def _apply_aborts(self) -> list[RequestOutput]:
        outputs = []
        for request_id in self._aborted:
            request = self._requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request.status is RequestStatus.WAITING:
                self.waiting.remove(request)
            self._finish(request, FinishReason.ABORT)
            outputs.append(self._output(request, [], None, None, finished=True))
        self._aborted.clear()
        return outputs

    def _finish(self, request: Request, reason: FinishReason) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            assert request.slot is not None
            heapq.heappush(self._free_slots, request.slot)
            self._finished_ids.append(request.request_id)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.policy.free(request.request_id)
        self._requests.pop(request.request_id, None)

    def _output(self, request, new_ids, logprobs, top_logprobs, finished, stop_id=None) -> RequestOutput:
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=new_ids,
            new_logprobs=logprobs,
            new_top_logprobs=top_logprobs,
            finished=finished,
            finish_reason=request.finish_reason if finished else None,
            error=request.error,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=len(request.output_ids),
            num_draft_tokens=request.num_draft_tokens,
            num_accepted_tokens=request.num_accepted_tokens,
            num_prediction_accepted=request.num_prediction_accepted,
            num_prediction_rejected=request.num_prediction_rejected,
            stop_token_id=stop_id,
        )
