"""Run requests through an engine without HTTP: for `specd generate`, tests and benchmarks."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from scheduler.engine import AsyncEngine, Executor
from scheduler.scheduler import SchedulerConfig
from scheduler.types import FinishReason, Request


@dataclass
class Completion:
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_chunks: int = 0  # outputs that carried tokens (steps that emitted)


async def collect(engine: AsyncEngine, request: Request, result: Completion | None = None) -> Completion:
    """The request's outputs gathered as they come, into `result` if given (so a caller that
    cancels this keeps what had come)."""
    result = Completion(request.request_id) if result is None else result
    async with engine.submit(request) as stream:
        async for out in stream:
            if out.new_token_ids:
                result.num_chunks += 1
            result.token_ids += out.new_token_ids
            result.logprobs += out.new_logprobs or []
            if out.finished:
                result.finish_reason = out.finish_reason
                result.error = out.error
                result.num_draft_tokens = out.num_draft_tokens
                result.num_accepted_tokens = out.num_accepted_tokens
                result.num_cached_tokens = out.num_cached_tokens
    return result


def run_offline(
    executor: Executor,
    config: SchedulerConfig,
    requests: list[Request],
    on_finished: Callable[[Completion], None] | None = None,
    deadline: float | None = None,
) -> list[Completion]:
    """Submit all requests at once (one batch where slots allow) and wait for all;
    `on_finished` sees each completion as it ends (progress for long runs). The
    queue is made to hold them all: an offline caller has no one to retry. At
    `deadline` (a `time.monotonic()` value) the requests not finished are aborted
    and returned with the tokens they had (finish reason abort; none if they never
    ran)."""
    config = replace(config, max_queue=max(config.max_queue, len(requests)))
    completions = [Completion(r.request_id) for r in requests]

    async def run_one(engine: AsyncEngine, request: Request, completion: Completion) -> None:
        await collect(engine, request, completion)
        if on_finished is not None:
            on_finished(completion)

    async def main() -> None:
        engine = AsyncEngine(executor, config, inline=True)  # this thread built the model
        await engine.start()
        try:
            tasks = [asyncio.ensure_future(run_one(engine, r, c)) for r, c in zip(requests, completions)]
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            _, cut = await asyncio.wait(tasks, timeout=timeout)
            for task in cut:
                task.cancel()  # closing its stream aborts the request
            await asyncio.gather(*cut, return_exceptions=True)
            for task in tasks:
                if not task.cancelled():
                    task.result()  # a request that failed to submit raises here, as before
        finally:
            await engine.stop(timeout=0)

    asyncio.run(main())
    for completion in completions:
        if completion.finish_reason is None:
            completion.finish_reason = FinishReason.ABORT
    return completions
