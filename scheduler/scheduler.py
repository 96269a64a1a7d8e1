"""Continuous-batching scheduler: pure Python over `Request` dataclasses.

`schedule()` builds one `Batch`: running requests first (decode, with the
policy's draft tokens), then chunked prefill, then FIFO admission of waiting
requests while fewer than `max_num_seqs` run, the step's token budget lasts
and the KV pool has the blocks for the request's prompt.
`update()` applies the runner's `StepOutput`: appends tokens, cuts at stop
tokens, `max_tokens` and the end of a grammar (`scheduler.stopping`), rolls rejected drafts back by setting
`num_computed_tokens`, offers newly full blocks to the prefix cache, and
releases finished requests' blocks.

KV memory is paged (`scheduler.kv_blocks`): a request holds blocks for the
positions it has computed or is about to. When a decoding request needs a
block and none is free, the newest running request is preempted: its blocks
are released (its full ones stay cached) and it waits at the head of the
queue to be recomputed from its tokens; its client only sees a pause.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from scheduler.kv_blocks import BlockPool, block_key, blocks_for
from scheduler.stopping import append_tokens
from scheduler.types import (
    Batch,
    FinishReason,
    InvalidRequestError,
    QueueState,
    Request,
    RequestOutput,
    RequestStatus,
    ScheduledRow,
    StepOutput,
    StepPlan,
)
from speculation import registry
from speculation.config import SpecConfig
from speculation.cost_model import StepShape, step_shape
from speculation.grammar import forced_lengths
from speculation.policy import SpecPolicy
from speculation.proposer import Drafting

logger = logging.getLogger(__name__)


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
    # KV pool: blocks of `block_size` positions. None: what `max_num_seqs`
    # sequences of `max_model_len` need, the memory a per-sequence reservation took.
    num_kv_blocks: int | None = None
    block_size: int = 16
    prefix_caching: bool = True
    # Roots the prefix cache's keys: the served model (and its dtype).
    cache_identity: str = ""

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.block_size < 1 or (self.num_kv_blocks is not None and self.num_kv_blocks < 1):
            raise ValueError("the KV pool needs at least one block of at least one token")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs (every running request decodes each step)")
        if self.max_queue < 0:
            raise ValueError("max_queue must be >= 0")

    @property
    def resolved_num_kv_blocks(self) -> int:
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        return blocks_for(self.max_num_seqs * self.max_model_len, self.block_size)


class Scheduler:
    def __init__(self, config: SchedulerConfig, drafting: Drafting | None = None):
        """`drafting`: the runner's proposer and what the policy may ask it (default: n-gram, no questions)."""
        self.config = config
        self.drafting = drafting or Drafting(registry.NGRAM.name)
        self.policy = SpecPolicy(config.spec, self.drafting)
        # The plan of the step scheduled last; `update` fills in what it emitted and the probes it graded.
        self.last_plan: StepPlan | None = None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.blocks = BlockPool(
            config.resolved_num_kv_blocks, config.block_size, config.prefix_caching, config.cache_identity
        )
        # Admission keeps this many blocks free, so the next decode steps rarely preempt (vLLM's watermark).
        self._watermark = self.blocks.num_blocks // 100
        self.num_preemptions = 0
        self._aborted: set[str] = set()
        self._finished_ids: list[str] = []
        self._requests: dict[str, Request] = {}

    # -- intake --
    @property
    def max_sequence_tokens(self) -> int:
        """The longest prompt + completion that can run: max_model_len, or the KV pool if smaller."""
        return min(self.config.max_model_len, self.blocks.num_blocks * self.blocks.block_size)

    def check(self, request: Request) -> None:
        """Refuse what can never run, before it is queued."""
        pool, limit = self.blocks, self.max_sequence_tokens
        if limit < self.config.max_model_len:  # the pool, not the model, sets the limit
            what = f"the KV cache ({pool.num_blocks} blocks of {pool.block_size}) holds"
        else:
            what = "this model's maximum context length is"
        if not request.prompt_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if request.num_prompt_tokens >= limit:
            raise InvalidRequestError(
                f"{what} {limit} tokens, but the prompt has {request.num_prompt_tokens} tokens",
                param="prompt",  # the server names its own field (chat: "messages")
                code="context_length_exceeded",
            )
        if request.num_prompt_tokens + request.params.max_tokens > limit:
            raise InvalidRequestError(
                f"{what} {limit} tokens; the prompt has {request.num_prompt_tokens} tokens "
                f"and max_tokens is {request.params.max_tokens}",
                param="max_tokens",
                code="context_length_exceeded",
            )

    def add(self, request: Request) -> None:
        self.check(request)
        if request.request_id in self._requests:
            raise InvalidRequestError(f"duplicate request id {request.request_id}", param="request_id")
        if len(self.waiting) >= self.config.max_queue:
            raise QueueFullError(f"the queue is full ({self.config.max_queue} waiting requests)")
        params = request.params
        request.stop_ids = frozenset(params.stop_token_ids).union(
            () if params.ignore_eos else self.config.eos_token_ids
        )
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
        """Blocks held by requests / all blocks (cached free blocks count as free)."""
        return self.blocks.num_used / self.blocks.num_blocks

    def queue_state(self) -> QueueState:
        return QueueState(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_preempted=sum(1 for r in self.waiting if r.num_preemptions),
            kv_blocks_used=self.blocks.num_used,
            kv_blocks_total=self.blocks.num_blocks,
        )

    def get(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def speculation_settings(self) -> dict:
        """The speculation settings in force, as GET /v1/speculation names them."""
        spec = self.config.spec
        return {
            "proposer": self.drafting.method,
            "num_speculative_tokens": spec.num_speculative_tokens,
            "spec_disable_batch_size": spec.spec_disable_batch_size,
            "adaptive": spec.adaptive,
        }

    def describe_speculation(self) -> str:
        """One line for the startup log."""
        return self.config.spec.describe(self.drafting)

    def policy_summary(self) -> dict:
        """The policy's own view (cost model, calibration, recent acceptance)."""
        return self.policy.summary()

    # -- schedule --
    def schedule(self) -> tuple[Batch, list[RequestOutput]]:
        """The next batch, plus final outputs for requests aborted since the last step."""
        aborted = self._apply_aborts()
        budget = self.config.max_num_batched_tokens
        preempted = self._reserve_decode_blocks()
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
        # No admission in a step that had to preempt: the blocks just freed are spoken for.
        while self.waiting and not preempted and len(self.running) < self.config.max_num_seqs and budget > 0:
            request = self.waiting[0]
            if not self._admit(request):
                break  # its blocks do not fit yet: it keeps its place
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            self.running.append(request)
            if request.is_prefilling:  # a preempted request may find all of its KV cached
                prefills.append(self._prefill_row(request, budget))
                budget -= len(prefills[-1].token_ids)

        caps = [self._draft_cap(r) for r in decoding]
        # Rows whose grammar forces their next tokens draft only those; the policy says whether
        # an `auto` row's pay this step, and plans the other rows with the budget they leave.
        forced = forced_lengths(decoding, caps, budget)
        caps = [0 if f else cap for f, cap in zip(forced, caps)]
        prefill = StepShape(
            num_tokens=sum(len(p.token_ids) for p in prefills),
            num_context=sum(p.start_pos + len(p.token_ids) for p in prefills),
            num_logits=sum(p.sample for p in prefills),
        )
        try:
            ks, self.last_plan = self.policy.decide(decoding, caps, budget, len(self.running), prefill, forced)
        except Exception:  # noqa: BLE001 - speculation only speeds a step up: a policy fault must not stop it
            logger.exception("speculation policy failed; this step runs plain")
            ks, self.last_plan = [0] * len(decoding), None
        plan = self.last_plan
        lookup_rows = plan.lookup_rows if plan else frozenset()
        probe_rows = plan.probe_rows if plan else frozenset()
        for i, (request, k) in enumerate(zip(decoding, ks)):
            lookup = i in lookup_rows
            if k and not self._grow(request, request.num_computed_tokens + 1 + k):
                # No blocks for every draft: draft what the request's blocks hold (never preempt for drafts).
                k = len(request.block_ids) * self.blocks.block_size - request.num_computed_tokens - 1
            rows.append(
                ScheduledRow(
                    request=request,
                    token_ids=[request.output_ids[-1]],
                    start_pos=request.num_computed_tokens,
                    sample=True,
                    num_spec_tokens=k,
                    num_shadow_tokens=min(self.policy.wants_shadow(request, k, lookup), self._draft_cap(request) + 1),
                    use_lookup=lookup,
                    probe=i in probe_rows,
                )
            )
        rows += prefills
        finished_ids, self._finished_ids = self._finished_ids, []
        return Batch(rows=rows, finished_ids=finished_ids), aborted

    def _prefill_row(self, request: Request, budget: int) -> ScheduledRow:
        start = request.num_computed_tokens
        end = min(request.num_prefill_tokens, start + budget)
        return ScheduledRow(
            request=request,
            token_ids=request.token_slice(start, end),
            start_pos=start,
            sample=end == request.num_prompt_tokens and not request.output_ids,
        )

    # -- KV blocks --
    def _admit(self, request: Request) -> bool:
        """Give `request` the longest cached prefix of its tokens and fresh blocks for the
        rest of its prefill; False (nothing taken) when they do not fit."""
        pool, size = self.blocks, self.blocks.block_size
        # The last token is always computed (its logits give the next one), so a hit
        # stops at a whole block short of it and never shares a block it writes.
        max_hit_blocks = (request.num_tokens - 1) // size
        self._extend_keys(request, max_hit_blocks)
        hits = pool.lookup(request.block_keys[:max_hit_blocks])
        num_new = max(0, blocks_for(request.num_prefill_tokens, size) - len(hits))
        reserve = self._watermark if self.running else 0
        if pool.num_needed(hits, num_new) + reserve > pool.num_free:
            return False
        pool.take(hits)
        request.block_ids = hits + pool.allocate(num_new)
        request.num_computed_tokens = len(hits) * size
        pool.count_lookup(request.num_prefill_tokens, request.num_computed_tokens)
        if not request.num_preemptions:
            request.num_cached_tokens = request.num_computed_tokens
        return True

    def _grow(self, request: Request, num_positions: int) -> bool:
        """Blocks for positions < num_positions; False (nothing taken) when the pool lacks them."""
        missing = blocks_for(num_positions, self.blocks.block_size) - len(request.block_ids)
        if missing <= 0:
            return True
        if missing > self.blocks.num_free:
            return False
        request.block_ids += self.blocks.allocate(missing)
        return True

    def _reserve_decode_blocks(self) -> bool:
        """A block for every decoding request's next token, oldest first; when the pool
        is out, the newest running request is preempted (possibly the one asking).
        True if any was."""
        before = self.num_preemptions
        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING or request.is_prefilling:
                continue  # preempted just now, or holding its prompt's blocks since admission
            while not self._grow(request, request.num_computed_tokens + 1):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is request:
                    break
        return self.num_preemptions > before

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        self._finished_ids.append(request.request_id)  # the runner drops its per-request state

    def _release(self, request: Request) -> None:
        self._cache_blocks(request, 0)
        self.blocks.release(request.block_ids)
        request.block_ids = []

    def _cache_blocks(self, request: Request, from_position: int) -> None:
        """Offer the blocks that filled with computed tokens since `from_position` to the prefix cache."""
        if not self.blocks.enable_caching:
            return
        size = self.blocks.block_size
        # Positions past num_tokens may hold accepted drafts cut by a stop token: not the sequence's.
        num_full = min(request.num_computed_tokens, request.num_tokens) // size
        self._extend_keys(request, num_full)
        listening = self.blocks.events is not None  # KV events say what each block holds
        for i in range(from_position // size, num_full):
            parent = request.block_keys[i - 1] if i else None
            tokens = request.token_slice(i * size, (i + 1) * size) if listening else None
            self.blocks.cache(request.block_ids[i], request.block_keys[i], parent, tokens)

    def _extend_keys(self, request: Request, num_blocks: int) -> None:
        """Prefix-cache keys of the request's first `num_blocks` full blocks (computed once each)."""
        if not self.blocks.enable_caching:
            return
        keys, size = request.block_keys, self.blocks.block_size
        for i in range(len(keys), num_blocks):
            parent = keys[-1] if keys else self.blocks.root(request.cache_scope)
            keys.append(block_key(parent, request.token_slice(i * size, (i + 1) * size)))

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
                self._cache_blocks(request, row.start_pos)
                continue
            self._count_speculation(row, out)
            if request.params.speculation == "auto":
                self.policy.observe_shadow(request, out.shadow_ids or [], out.token_ids)
                if out.probe_id is not None and out.token_ids:
                    accepted = self.policy.observe_probe(request, out.probe_id, out.token_ids[0], out.probe_accept)
                    if self.last_plan is not None:
                        self.last_plan.probes_graded += 1
                        self.last_plan.probes_accepted += accepted
            appended = append_tokens(request, out.token_ids)
            if appended.finish is not None:
                request.error = appended.error or request.error
                self._finish(request, appended.finish)
            new_ids, stop_id = appended.new_ids, appended.stop_id
            request.draft = out.next_draft
            if not request.is_finished:  # a finished request's blocks were offered on release
                self._cache_blocks(request, row.start_pos)
            n = len(new_ids)
            logprobs = out.logprobs[:n] if out.logprobs is not None else None
            top = out.top_logprobs[:n] if out.top_logprobs is not None else None
            results.append(self._output(request, new_ids, logprobs, top, request.is_finished, stop_id))
        return results

    def _observe_step(self, batch: Batch, output: StepOutput, seconds: float) -> None:
        shape = step_shape(batch, output)
        emitted = sum(
            len(out.token_ids)
            for row, out in zip(batch.rows, output.rows)
            if row.start_pos >= row.request.num_prompt_tokens  # decode rows: what the plan covered
        )
        plan = self.last_plan
        if plan is not None:
            plan.emitted_tokens = emitted
        self.policy.observe_step(shape, seconds, plan, emitted)

    def fail(self, request_id: str, message: str) -> RequestOutput | None:
        """End one request with an error (engine fault attributed to it)."""
        request = self._requests.get(request_id)
        if request is None or request.is_finished:
            return None
        request.error = message
        self._finish(request, FinishReason.ERROR)
        return self._output(request, [], None, None, finished=True)

    def _count_speculation(self, row: ScheduledRow, out) -> None:
        request = row.request
        if not out.num_draft_tokens:
            return
        request.num_draft_tokens += out.num_draft_tokens
        request.num_accepted_tokens += out.num_accepted_tokens
        if out.method == registry.GRAMMAR.name:  # forced by the grammar: nothing for the policy to learn
            return
        if request.prediction_ids is not None:  # Predicted Outputs drafted the row (usage reports them)
            request.num_prediction_accepted += out.num_accepted_tokens
            request.num_prediction_rejected += out.num_draft_tokens - out.num_accepted_tokens
        self.policy.observe(request, out.num_draft_tokens, out.num_accepted_tokens, out.method, row.num_spec_tokens)

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
            self._release(request)
            self._finished_ids.append(request.request_id)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        ended = reason in (FinishReason.STOP, FinishReason.LENGTH)
        self.policy.free(request.request_id, len(request.output_ids) if ended else None)
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
            num_cached_tokens=request.num_cached_tokens,
            num_output_tokens=len(request.output_ids),
            num_draft_tokens=request.num_draft_tokens,
            num_accepted_tokens=request.num_accepted_tokens,
            num_prediction_accepted=request.num_prediction_accepted,
            num_prediction_rejected=request.num_prediction_rejected,
            stop_token_id=stop_id,
        )
