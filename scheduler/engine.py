"""AsyncEngine: the asyncio loop around the scheduler and the model runner.

One loop task runs schedule -> execute -> update. `execute` runs in a single
worker thread so the event loop keeps serving HTTP while the model computes.
Each request gets an async stream of `RequestOutput`s. A step that fails for
one request fails only that request: scheduler state changes only in
`update`, so the other rows simply run again next step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from scheduler.scheduler import QueueFullError, Scheduler, SchedulerConfig
from scheduler.types import (
    Batch,
    FinishedRequestStats,
    FinishReason,
    Request,
    RequestOutput,
    SpecCounts,
    StepOutput,
    StepStats,
)

logger = logging.getLogger("specd.engine")

__all__ = ["AsyncEngine", "Executor", "QueueFullError", "RequestStream"]


class Executor(Protocol):
    """What the engine needs from `models`: run one batch."""

    @property
    def proposer_name(self) -> str: ...

    def execute(self, batch: Batch) -> StepOutput: ...


def new_step_thread() -> ThreadPoolExecutor:
    """The one thread that should load the model and run every step (see AsyncEngine)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="specd-step")


class RequestStream:
    """Async iterator over one request's outputs; closing it early aborts the request."""

    def __init__(self, engine: AsyncEngine, request: Request):
        self.request = request
        self._engine = engine
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.finished = False

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        output = await self._queue.get()
        self.finished = output.finished
        return output

    def abort(self) -> None:
        if not self.finished:
            self._engine.abort(self.request.request_id)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc) -> None:
        self.abort()


@dataclass
class _Timing:
    arrival: float
    first_token: float | None = None
    last_emit: float | None = None


class AsyncEngine:
    def __init__(
        self,
        executor: Executor,
        config: SchedulerConfig,
        observer: Callable[[StepStats], None] | None = None,
        step_thread: ThreadPoolExecutor | None = None,
        inline: bool = False,
    ):
        """`step_thread` runs every model step; pass the thread that built the
        model. On CPU, PyTorch's bf16 kernels run far slower once a second
        thread has issued parallel work (measured: 38 instead of 23 ms a
        SmolLM2 step), so one thread should own all torch work. `inline` runs
        steps on the event-loop thread instead, for offline use where that
        thread built the model and no HTTP needs serving meanwhile."""
        self.executor = executor
        self.config = config
        self.scheduler = Scheduler(config, proposer=executor.proposer_name)
        self.observer = observer
        self._streams: dict[str, RequestStream] = {}
        self._timing: dict[str, _Timing] = {}
        self._wakeup = asyncio.Event()
        self._inline = inline
        self._owns_thread = step_thread is None and not inline
        self._thread = step_thread or (None if inline else new_step_thread())
        self._task: asyncio.Task | None = None
        self._accepting = True
        self.last_step_speculated = False
        self.num_steps = 0
        self.totals = SpecCounts()

    # -- lifecycle --
    async def start(self) -> None:
        spec = self.config.spec
        cap = spec.spec_disable_batch_size
        logger.info(
            "speculation: proposer=%s num_speculative_tokens=%d adaptive=%s; auto rows %s",
            self.executor.proposer_name,
            spec.num_speculative_tokens,
            spec.adaptive,
            "never speculate (cap 0)"
            if cap == 0
            else "decide per request from acceptance and the step's learned cost"
            + (f", while at most {cap} requests run" if cap is not None else " (no batch-size cap)"),
        )
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="specd-engine")

    async def stop(self, timeout: float = 30.0) -> None:
        """Stop admitting, let running requests finish for `timeout` s, abort the rest."""
        self._accepting = False
        deadline = time.monotonic() + timeout
        while self.scheduler.has_work and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for request_id in list(self._streams):
            self.abort(request_id)
        while self.scheduler.has_work and self._task and not self._task.done():
            await asyncio.sleep(0.01)
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        if self._owns_thread and self._thread is not None:
            self._thread.shutdown(wait=True)

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    # -- requests --
    def submit(self, request: Request) -> RequestStream:
        """Queue a request; raises InvalidRequestError or QueueFullError at once."""
        if not self._accepting:
            raise QueueFullError("the server is shutting down")
        self.scheduler.add(request)
        stream = RequestStream(self, request)
        self._streams[request.request_id] = stream
        self._timing[request.request_id] = _Timing(arrival=time.monotonic())
        self._wakeup.set()
        return stream

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)
        self._wakeup.set()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def kv_usage(self) -> float:
        return self.scheduler.kv_usage

    @property
    def spec_config(self):
        return self.scheduler.policy.config

    def policy_summary(self) -> dict:
        return self.scheduler.policy.summary()

    # -- the loop --
    async def _run(self) -> None:
        while True:
            if not self.scheduler.has_work:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            batch, aborted = self.scheduler.schedule()
            self._publish(aborted)
            if not batch.rows:
                if batch.finished_ids:
                    # Nothing to run, but the runner still drops the finished requests' state.
                    await self._execute(batch)
                if aborted or batch.finished_ids:
                    self._observe_idle(aborted)
                continue
            start = time.perf_counter()
            try:
                output = await self._execute(batch)
            except Exception as exc:  # noqa: BLE001 - isolate the faulty request, keep serving
                await self._isolate_fault(batch, exc, aborted)
                continue
            step_seconds = time.perf_counter() - start
            outputs = self.scheduler.update(batch, output, step_seconds)
            self._publish(outputs)
            self._record(batch, output, outputs + aborted, step_seconds)
            # Let the event loop run (HTTP, new submissions) between steps.
            await asyncio.sleep(0)

    async def _execute(self, batch: Batch) -> StepOutput:
        if self._inline:
            return self.executor.execute(batch)
        return await asyncio.get_running_loop().run_in_executor(self._thread, self.executor.execute, batch)

    async def _isolate_fault(self, batch: Batch, exc: Exception, aborted: list[RequestOutput]) -> None:
        """Find the request(s) a failed step belongs to and fail only those.

        `aborted` (this step's aborts) and requests that finish in a one-row
        re-run are recorded as finished here, since the step itself records nothing.
        """
        finished = list(aborted)
        request_id = getattr(exc, "request_id", None)
        if request_id is not None:
            culprits = [request_id]
        elif len(batch.rows) == 1:
            culprits = [batch.rows[0].request_id]
        else:
            # Unattributed: re-run rows one at a time; the rows that still fail are the culprits.
            culprits = []
            for row in batch.rows:
                single = Batch(rows=[row], finished_ids=batch.finished_ids)
                try:
                    output = await self._execute(single)
                except Exception:  # noqa: BLE001
                    culprits.append(row.request_id)
                    continue
                rerun = self.scheduler.update(single, output)
                self._publish(rerun)
                finished += [o for o in rerun if o.finished]
        logger.error("engine step failed for %s: %r", culprits, exc)
        outputs = [o for rid in culprits if (o := self.scheduler.fail(rid, f"engine error: {exc}"))]
        self._publish(outputs)
        self._observe_idle(finished + outputs)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            timing = self._timing.get(output.request_id)
            if timing and output.new_token_ids:
                if timing.first_token is None:
                    timing.first_token = now
            stream._queue.put_nowait(output)
            if output.finished:
                self._streams.pop(output.request_id, None)

    # -- stats --
    def _record(self, batch: Batch, output: StepOutput, outputs: list[RequestOutput], step_seconds: float) -> None:
        now = time.monotonic()
        self.num_steps += 1
        spec: dict[str, SpecCounts] = {}
        for row_out in output.rows:
            if row_out.method:
                counts = spec.setdefault(row_out.method, SpecCounts())
                counts.num_drafts += 1
                counts.num_draft_tokens += row_out.num_draft_tokens
                counts.num_accepted_tokens += row_out.num_accepted_tokens
        for counts in spec.values():
            self.totals.num_drafts += counts.num_drafts
            self.totals.num_draft_tokens += counts.num_draft_tokens
            self.totals.num_accepted_tokens += counts.num_accepted_tokens
        self.last_step_speculated = bool(spec)

        stats = StepStats(
            step_seconds=step_seconds,
            batch_size=len(batch.rows),
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            kv_usage=self.kv_usage,
            mode="spec" if spec else "plain",
            num_prompt_tokens=sum(len(r.token_ids) for r in batch.rows if r.start_pos < r.request.num_prompt_tokens),
            num_generation_tokens=sum(len(o.new_token_ids) for o in outputs),
            spec=spec,
            accepted_per_position=output.accepted_per_position,
            phase_seconds=output.phase_seconds,
        )
        check = self.scheduler.last_check
        if check is not None:
            stats.predicted_seconds = check.predicted_seconds
            stats.expected_tokens = check.expected_tokens
            stats.emitted_tokens = check.emitted_tokens
        for row in batch.rows:
            if row.start_pos == 0 and row.request.first_scheduled_time is not None:
                stats.queue_seconds.append(row.request.first_scheduled_time - row.request.arrival_time)
        for out in outputs:
            timing = self._timing.get(out.request_id)
            if timing is None:
                continue
            if out.new_token_ids:
                if timing.last_emit is None:
                    stats.first_token_latencies.append(now - timing.arrival)
                else:
                    stats.token_gaps.append((len(out.new_token_ids), now - timing.last_emit))
                timing.last_emit = now
            if out.finished:
                self._finish_stats(stats, out, timing, now)
        self._notify(stats)

    def _observe_idle(self, aborted: list[RequestOutput]) -> None:
        now = time.monotonic()
        stats = StepStats(0.0, 0, self.num_running, self.num_waiting, self.kv_usage, "plain")
        for out in aborted:
            timing = self._timing.get(out.request_id)
            if timing:
                self._finish_stats(stats, out, timing, now)
        self._notify(stats)

    def _notify(self, stats: StepStats) -> None:
        """Hand a step to the observer; a metrics fault must never stop the engine loop."""
        if self.observer is None:
            return
        try:
            self.observer(stats)
        except Exception:  # noqa: BLE001
            logger.exception("the step observer failed; the step itself completed")

    def _finish_stats(self, stats: StepStats, out: RequestOutput, timing: _Timing, now: float) -> None:
        self._timing.pop(out.request_id, None)
        stats.finished.append(
            FinishedRequestStats(
                finish_reason=out.finish_reason or FinishReason.ERROR,  # a finished output always has one
                e2e_seconds=now - timing.arrival,
                ttft_seconds=None if timing.first_token is None else timing.first_token - timing.arrival,
                num_prompt_tokens=out.num_prompt_tokens,
                num_output_tokens=out.num_output_tokens,
            )
        )
