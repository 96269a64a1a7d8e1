"""StepRecorder: request timing and per-step statistics, for the metrics observer.

The engine tells the recorder when a request arrives (`arrived`), what it
sends down the streams (`published`) and when a step ran (`step`) or the loop
only retired requests (`idle`). The recorder keeps each request's timestamps,
turns them into one `StepStats` per call and hands it to the observer
(`scheduler.metrics.MetricsObserver.observe` in the server). It also keeps
the speculation totals since start, for /v1/speculation.

A request's first token is timed once, when it is published: the same
timestamp feeds the time-to-first-token histogram and the finished request's
`ttft_seconds` (and so TPOT).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from scheduler.types import (
    Batch,
    FinishedRequestStats,
    FinishReason,
    RequestOutput,
    SpecCounts,
    StepOutput,
    StepPlan,
    StepStats,
)

if TYPE_CHECKING:
    from scheduler.scheduler import Scheduler

logger = logging.getLogger("specd.engine")

__all__ = ["StepRecorder"]


@dataclass
class _Timing:
    arrival: float
    structured: bool = False  # under a grammar (structured outputs, tool calls)
    first_token: float | None = None
    last_emit: float | None = None


class StepRecorder:
    def __init__(self, scheduler: Scheduler, observer: Callable[[StepStats], None] | None = None):
        self.scheduler = scheduler  # read for the queue gauges and the prefix cache's counters
        self.observer = observer
        self.totals = SpecCounts()  # speculation since start, all methods
        self.last_step_speculated = False
        self._timing: dict[str, _Timing] = {}
        # The scheduler's cumulative counters when last reported: (cache queries, cache hits, preemptions).
        self._reported = (0, 0, 0)
        # Samples from published outputs, waiting for the next `step` or `idle`.
        self._pending = StepStats(0.0, 0, "plain")

    @property
    def num_tracked(self) -> int:
        """Requests whose timing is still held (arrived, not yet finished)."""
        return len(self._timing)

    def arrived(self, request_id: str, structured: bool = False) -> None:
        self._timing[request_id] = _Timing(arrival=time.monotonic(), structured=structured)

    def published(self, outputs: list[RequestOutput]) -> None:
        """Outputs just sent down their streams: time first tokens, gaps and finishes."""
        now = time.monotonic()
        pending = self._pending
        for out in outputs:
            timing = self._timing.get(out.request_id)
            if timing is None:
                continue
            if out.new_token_ids:
                if timing.first_token is None:
                    timing.first_token = now
                    pending.first_token_latencies.append(now - timing.arrival)
                else:
                    assert timing.last_emit is not None
                    pending.token_gaps.append((len(out.new_token_ids), now - timing.last_emit))
                timing.last_emit = now
            if out.finished:
                del self._timing[out.request_id]
                pending.finished.append(
                    FinishedRequestStats(
                        finish_reason=out.finish_reason or FinishReason.ERROR,  # a finished output always has one
                        e2e_seconds=now - timing.arrival,
                        ttft_seconds=None if timing.first_token is None else timing.first_token - timing.arrival,
                        num_prompt_tokens=out.num_prompt_tokens,
                        num_output_tokens=out.num_output_tokens,
                        structured=timing.structured,
                    )
                )

    def step(
        self,
        batch: Batch,
        output: StepOutput,
        outputs: list[RequestOutput],
        step_seconds: float,
        plan: StepPlan | None = None,
    ) -> None:
        """A step ran `batch` in `step_seconds` and emitted `outputs` (after `Scheduler.update`);
        `plan` is the policy's plan for it, with what it emitted (None: no decode rows planned)."""
        spec: dict[str, SpecCounts] = {}
        for row_out in output.rows:
            if row_out.method:
                counts = spec.setdefault(row_out.method, SpecCounts())
                counts.num_drafts += 1
                counts.num_draft_tokens += row_out.num_draft_tokens
                counts.num_accepted_tokens += row_out.num_accepted_tokens
                self.totals.num_drafts += 1
                self.totals.num_draft_tokens += row_out.num_draft_tokens
                self.totals.num_accepted_tokens += row_out.num_accepted_tokens
        self.last_step_speculated = bool(spec)

        stats = self._take()
        stats.step_seconds = step_seconds
        stats.batch_size = len(batch.rows)
        stats.mode = "spec" if spec else "plain"
        stats.num_prompt_tokens = sum(len(r.token_ids) for r in batch.rows if r.start_pos < r.request.num_prompt_tokens)
        stats.num_generation_tokens = sum(len(o.new_token_ids) for o in outputs)
        stats.spec = spec
        stats.accepted_per_position = output.accepted_per_position
        stats.phase_seconds = output.phase_seconds
        stats.proposer_cache_nodes = output.proposer_cache_nodes
        stats.grammar_mask_seconds = output.grammar_mask_seconds
        stats.grammar_cut_tokens = output.grammar_cut_tokens
        stats.plan = plan
        if plan is not None and plan.probes_graded:
            stats.probes = {self.scheduler.drafting.method: (plan.probes_graded, plan.probes_accepted)}
        for row in batch.rows:
            request = row.request
            # A request's first chunk starts after its cached prefix; a preempted one was counted before.
            first_chunk = row.start_pos == request.num_cached_tokens and not request.num_preemptions
            if first_chunk and request.first_scheduled_time is not None:
                stats.queue_seconds.append(request.first_scheduled_time - request.arrival_time)
        self._notify(stats)

    def acceptance(self) -> dict:
        """Speculation since start: counts, acceptance rate and mean acceptance length."""
        t = self.totals
        return {
            "acceptance_rate": t.num_accepted_tokens / t.num_draft_tokens if t.num_draft_tokens else None,
            "mean_acceptance_length": 1 + t.num_accepted_tokens / t.num_drafts if t.num_drafts else None,
            "num_drafts": t.num_drafts,
            "num_draft_tokens": t.num_draft_tokens,
            "num_accepted_tokens": t.num_accepted_tokens,
        }

    def idle(self) -> None:
        """No step ran, but requests may have finished (aborts, failures)."""
        self._notify(self._take())

    def _take(self) -> StepStats:
        """The samples gathered since the last call, with the scheduler's state now."""
        stats, self._pending = self._pending, StepStats(0.0, 0, "plain")
        scheduler = self.scheduler
        stats.queue = scheduler.queue_state()
        now = (scheduler.blocks.stats.queries, scheduler.blocks.stats.hits, scheduler.num_preemptions)
        before, self._reported = self._reported, now
        stats.prefix_cache_queries, stats.prefix_cache_hits, stats.num_preemptions = (
            a - b for a, b in zip(now, before)
        )
        return stats

    def _notify(self, stats: StepStats) -> None:
        """Hand a step to the observer; a metrics fault must never stop the engine loop."""
        if self.observer is None:
            return
        try:
            self.observer(stats)
        except Exception:  # noqa: BLE001
            logger.exception("the step observer failed; the step itself completed")
