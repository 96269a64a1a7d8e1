"""Run requests through an engine without HTTP: for `specd generate`, tests and benchmarks."""

from __future__ import annotations

import asyncio
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


async def collect(engine: AsyncEngine, request: Request) -> Completion:
    result = Completion(request.request_id)
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
) -> list[Completion]:
    """Submit all requests at once (one batch where slots allow) and wait for all;
    `on_finished` sees each completion as it ends (progress for long runs). The
    queue is made to hold them all: an offline caller has no one to retry."""
    config = replace(config, max_queue=max(config.max_queue, len(requests)))

    async def run_one(engine: AsyncEngine, request: Request) -> Completion:
        completion = await collect(engine, request)
        if on_finished is not None:
            on_finished(completion)
        return completion

    async def main() -> list[Completion]:
        engine = AsyncEngine(executor, config, inline=True)  # this thread built the model
        await engine.start()
        try:
            return list(await asyncio.gather(*(run_one(engine, r) for r in requests)))
        finally:
            await engine.stop(timeout=0)

    return asyncio.run(main())
