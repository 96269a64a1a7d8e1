"""uvicorn's HTTP protocol with a deadline on reading a request's headers.

uvicorn times out a keep-alive connection only until its next byte arrives, and a new
connection not at all: a client that sends a request line and then one header byte every few
seconds holds its connection (and a slot of --limit-concurrency) for as long as it likes
(slowloris). Here every wait for a request's headers, on a new connection or between
keep-alive requests, has --header-timeout seconds to see them complete; then the connection
closes. Request bodies and responses are not timed: a long stream is not a slow client.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

logger = logging.getLogger("specd.server")


class HeaderDeadline:
    """Mixed into a uvicorn HTTP protocol class (h11 or httptools): both start a request by
    setting `self.cycle` once its headers are parsed, which is what the deadline waits for."""

    header_timeout: float = 20.0
    cycle: Any
    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop
    _header_deadline: asyncio.TimerHandle | None = None
    _waiting_since: Any = None

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._arm_header_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)  # type: ignore[misc]
        if self.cycle is not self._waiting_since:
            self._cancel_header_deadline()  # a request's headers arrived

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        if not self.transport.is_closing():
            self._arm_header_deadline()  # the next request's headers have their own deadline

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_deadline()
        super().connection_lost(exc)  # type: ignore[misc]

    def _arm_header_deadline(self) -> None:
        self._cancel_header_deadline()
        self._waiting_since = self.cycle
        self._header_deadline = self.loop.call_later(self.header_timeout, self._header_deadline_passed)

    def _cancel_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _header_deadline_passed(self) -> None:
        self._header_deadline = None
        waiting = self.cycle is self._waiting_since and (self.cycle is None or self.cycle.response_complete)
        if waiting and not self.transport.is_closing():
            logger.info("closed a connection whose request headers took over %.0fs", self.header_timeout)
            self.transport.close()


def protocol_class(header_timeout: float) -> type:
    """The protocol uvicorn's `http="auto"` would pick (httptools where installed, else h11),
    with the header deadline."""
    base: type
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        base = HttpToolsProtocol
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol

        base = H11Protocol
    return type(f"HeaderDeadline{base.__name__}", (HeaderDeadline, base), {"header_timeout": float(header_timeout)})
