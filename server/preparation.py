"""The preparation thread's queue: bounded, fair across tenants, and cancellable.

Tokenizing, chat templates and grammar compiles run on one thread (a fast tokenizer shared
across threads can refuse a concurrent call), which every tenant shares. Its queue is not a
FIFO: each tenant has its own, and the thread takes one job from each tenant in turn, so a
tenant that queues a thousand jobs delays another's next job by at most one of its own.
At most `max_waiting` jobs wait; past that a new job is refused with 503 + Retry-After,
unless another tenant holds more waiting jobs than the newcomer's: that tenant's newest job
is refused instead. A job whose caller has gone (its awaiting task cancelled, the client
disconnected) leaves the queue at once and never runs.

Every method runs on the event loop's thread; only the job itself runs on the worker.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from server.errors import ServiceUnavailableError

T = TypeVar("T")


@dataclass(eq=False)
class _Job:
    tenant: str
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    future: asyncio.Future[Any]


def queue_full(max_waiting: int) -> ServiceUnavailableError:
    return ServiceUnavailableError(
        f"the preparation queue is full ({max_waiting} waiting requests); retry later", code="queue_full"
    )


class PreparationQueue:
    """One worker thread fed round-robin from per-tenant queues of at most `max_waiting` jobs in all."""

    def __init__(self, max_waiting: int, thread_name: str = "specd-prep"):
        if max_waiting < 1:
            raise ValueError("max_waiting must be >= 1")
        self.max_waiting = max_waiting
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=thread_name)
        self._tenants: OrderedDict[str, deque[_Job]] = OrderedDict()  # in turn order; none empty
        self._waiting = 0
        self._running: _Job | None = None

    @property
    def waiting(self) -> int:
        """Jobs queued and not yet started (the one running is not counted)."""
        return self._waiting

    async def run(self, tenant: str, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the worker, in `tenant`'s turn. Cancelling the awaiting task takes a
        queued job out unrun (a running one finishes, its result dropped)."""
        loop = asyncio.get_running_loop()
        job = _Job(tenant, fn, args, loop.create_future())
        self._admit(job)
        job.future.add_done_callback(lambda _: self._forget(job))
        self._next(loop)
        return await job.future

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _admit(self, job: _Job) -> None:
        if self._waiting >= self.max_waiting:
            greediest = max(self._tenants, key=lambda t: len(self._tenants[t]))
            own = len(self._tenants.get(job.tenant, ()))
            if len(self._tenants[greediest]) <= own + 1:  # the newcomer's tenant holds (about) as many
                raise queue_full(self.max_waiting)
            victim = self._tenants[greediest][-1]  # the greediest tenant's newest job goes
            self._forget(victim)
            victim.future.set_exception(queue_full(self.max_waiting))
        self._tenants.setdefault(job.tenant, deque()).append(job)
        self._waiting += 1

    def _forget(self, job: _Job) -> None:
        """A refused or cancelled job: out of the queue if it is still there."""
        jobs = self._tenants.get(job.tenant)
        if jobs is not None and job in jobs:
            jobs.remove(job)
            self._waiting -= 1
            if not jobs:
                del self._tenants[job.tenant]

    def _next(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the next tenant's oldest job if the worker is free."""
        job: _Job | None = None
        while self._running is None and self._tenants and job is None:
            tenant, jobs = self._tenants.popitem(last=False)
            job = jobs.popleft()
            self._waiting -= 1
            if jobs:
                self._tenants[tenant] = jobs  # back of the turn order
            if job.future.done():  # cancelled, its done callback not run yet: never started
                job = None
        if job is None:
            return
        self._running = job
        done = self._executor.submit(job.fn, *job.args)
        done.add_done_callback(lambda finished: loop.call_soon_threadsafe(self._finished, loop, job, finished))

    def _finished(self, loop: asyncio.AbstractEventLoop, job: _Job, done: concurrent.futures.Future[Any]) -> None:
        self._running = None
        if not job.future.done():  # else its caller has gone: the result goes nowhere
            error = done.exception()
            if error is None:
                job.future.set_result(done.result())
            else:
                job.future.set_exception(error)
        self._next(loop)
