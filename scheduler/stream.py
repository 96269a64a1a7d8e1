"""RequestStream: one request's outputs, as the engine publishes them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from scheduler.types import Request, RequestOutput


class RequestStream:
    """Async iterator over one request's outputs; closing it early aborts the request."""

    def __init__(self, request: Request, abort: Callable[[str], None]):
        self.request = request
        self._abort = abort
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

    def push(self, output: RequestOutput) -> None:
        """The engine's side: queue the next output."""
        self._queue.put_nowait(output)

    def abort(self) -> None:
        if not self.finished:
            self._abort(self.request.request_id)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc) -> None:
        self.abort()
