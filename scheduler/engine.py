"""AsyncEngine: the asyncio loop around the scheduler and the model runner.

One loop task runs schedule -> execute -> update. `execute` runs in a single
worker thread so the event loop keeps serving HTTP while the model computes.
Each request gets an async stream of `RequestOutput`s. A step that fails for
one request fails only that request: scheduler state changes only in
`update`, so the other rows simply run again next step. A fault in the loop's
own bookkeeping (schedule, update) leaves state nothing can trust: the engine
is then dead, every request in flight ends with an error at once rather than
hang, new ones are refused, and `/health` says so, so a supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Protocol

from scheduler.kv_blocks import BlockEvent
from scheduler.recorder import StepRecorder
from scheduler.scheduler import QueueFullError, Scheduler, SchedulerConfig
from scheduler.stream import RequestStream
from scheduler.types import Batch, FinishReason, Request, RequestOutput, StepOutput, StepStats
from speculation.proposer import Drafting

logger = logging.getLogger("specd.engine")

__all__ = ["AsyncEngine", "EngineDeadError", "Executor", "QueueFullError", "RequestStream"]


class EngineDeadError(RuntimeError):
    """The engine loop stopped on a fault of its own; the process must be restarted."""


class Executor(Protocol):
    """What the engine needs from `models`: its drafting (what the policy may ask while it
    plans) and a step."""

    @property
    def drafting(self) -> Drafting: ...

    def execute(self, batch: Batch) -> StepOutput: ...


def new_step_thread() -> ThreadPoolExecutor:
    """The one thread that should load the model and run every step (see AsyncEngine)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="specd-step")


class AsyncEngine:
    def __init__(
        self,
        executor: Executor,
        config: SchedulerConfig,
        observer: Callable[[StepStats], None] | None = None,
        step_thread: ThreadPoolExecutor | None = None,
        inline: bool = False,
        on_dead: Callable[[str], None] | None = None,
        kv_events: Callable[[list[BlockEvent]], None] | None = None,
    ):
        """`step_thread` runs every model step; pass the thread that built the
        model. On CPU, PyTorch's bf16 kernels run far slower once a second
        thread has issued parallel work (measured: 38 instead of 23 ms a
        SmolLM2 step), so one thread should own all torch work. `inline` runs
        steps on the event-loop thread instead, for offline use where that
        thread built the model and no HTTP needs serving meanwhile. `on_dead`
        is told why, should the loop ever stop on a fault of its own. `kv_events` is
        handed what entered and left the prefix cache, once a step (KV-event publishing)."""
        self.executor = executor
        drafting = executor.drafting
        # A proposer that measured its own acceptance (an EAGLE head's held-out record) is
        # where the policy starts its rows, unless the config says otherwise.
        if drafting.prior_rates and not config.spec.prior_rates:
            config = replace(config, spec=replace(config.spec, prior_rates=drafting.prior_rates))
        self.config = config
        self.scheduler = Scheduler(config, drafting)
        self.recorder = StepRecorder(self.scheduler, observer)
        self._kv_events = kv_events
        if kv_events is not None:
            self.scheduler.blocks.events = []
        self._streams: dict[str, RequestStream] = {}
        self._wakeup = asyncio.Event()
        self._inline = inline
        self._owns_thread = step_thread is None and not inline
        self._thread = step_thread or (None if inline else new_step_thread())
        self._task: asyncio.Task | None = None
        self._accepting = True
        # Why the loop died (a fault outside any one request's step), or None while it runs.
        self.dead_reason: str | None = None
        self._on_dead = on_dead

    # -- lifecycle --
    async def start(self) -> None:
        logger.info("speculation: %s", self.scheduler.describe_speculation())
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="specd-engine")

    async def stop(self, timeout: float = 30.0) -> None:
        """Stop admitting, let running requests finish for `timeout` s, abort the rest."""
        self._accepting = False
        deadline = time.monotonic() + timeout
        while self.dead_reason is None and self.scheduler.has_work and time.monotonic() < deadline:
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
        if self.dead_reason is not None:
            raise EngineDeadError(f"the engine stopped after an internal error ({self.dead_reason})")
        if not self._accepting:
            raise QueueFullError("the server is shutting down")
        self.scheduler.add(request)
        stream = RequestStream(request, self.abort)
        self._streams[request.request_id] = stream
        self.recorder.arrived(request.request_id, structured=request.constraint is not None)
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

    def speculation_info(self) -> dict:
        """The live speculation configuration and acceptance (the fields of GET /v1/speculation)."""
        return {
            **self.scheduler.speculation_settings(),
            # An EAGLE head's directory, draft vocabulary and training record (runners that serve one).
            "draft_head": self.scheduler.drafting.info,
            "spec_enabled": self.recorder.last_step_speculated,
            **self.recorder.acceptance(),
            "requests_running": self.num_running,
            "requests_waiting": self.num_waiting,
            "kv_cache_usage": self.kv_usage,
            "policy": self.scheduler.policy_summary(),
        }

    # -- the loop --
    async def _run(self) -> None:
        try:
            await self._loop()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a bookkeeping fault: end every request, not hang them
            self._die(exc)

    def _die(self, exc: Exception) -> None:
        logger.critical("engine loop stopped: %r", exc, exc_info=exc)
        self.dead_reason = f"{type(exc).__name__}: {exc}"
        self._accepting = False
        # Straight to the streams: the scheduler's own state is what failed.
        for request_id, stream in list(self._streams.items()):
            stream.push(
                RequestOutput(
                    request_id,
                    [],
                    finished=True,
                    finish_reason=FinishReason.ERROR,
                    error=f"the engine stopped: {self.dead_reason}",
                )
            )
        self._streams.clear()
        if self._on_dead is not None:
            self._on_dead(self.dead_reason)

    async def _loop(self) -> None:
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
                    self.recorder.idle()
                continue
            start = time.perf_counter()
            try:
                output = await self._execute(batch)
            except Exception as exc:  # noqa: BLE001 - isolate the faulty request, keep serving
                await self._isolate_fault(batch, exc)
                continue
            step_seconds = time.perf_counter() - start
            outputs = self.scheduler.update(batch, output, step_seconds)
            self._publish(outputs)
            self.recorder.step(batch, output, outputs, step_seconds, self.scheduler.last_plan)
            if self._kv_events is not None:
                self._kv_events(self.scheduler.blocks.drain_events())
            # Let the event loop run (HTTP, new submissions) between steps.
            await asyncio.sleep(0)

    async def _execute(self, batch: Batch) -> StepOutput:
        if self._inline:
            return self.executor.execute(batch)
        return await asyncio.get_running_loop().run_in_executor(self._thread, self.executor.execute, batch)

    async def _isolate_fault(self, batch: Batch, exc: Exception) -> None:
        """Find the request(s) a failed step belongs to and fail only those."""
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
                self._publish(self.scheduler.update(single, output))
        logger.error("engine step failed for %s: %r", culprits, exc)
        self._publish([o for rid in culprits if (o := self.scheduler.fail(rid, f"engine error: {exc}"))])
        # The step itself records nothing; this step's aborts, re-runs and failures are recorded here.
        self.recorder.idle()

    def _publish(self, outputs: list[RequestOutput]) -> None:
        self.recorder.published(outputs)
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            stream.push(output)
            if output.finished:
                self._streams.pop(output.request_id, None)
