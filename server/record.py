"""The per-request log record: filled by the endpoint, logged by the middleware.

Shared by `server.serving` (the endpoints create it), `server.choices`
(streams fill in tokens and finish reasons) and `server.middleware` (writes
the log line); it depends on none of them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from fastapi import Request as HTTPRequest

from scheduler.types import RequestOutput

RECORD_SCOPE_KEY = "specd.record"


@dataclass
class RequestRecord:
    """What the per-request log line reports; filled by the endpoint, logged by middleware."""

    endpoint: str
    arrival: float = field(default_factory=time.monotonic)
    request_id: str = "-"
    stream: bool = False
    n: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    first_token: float | None = None
    spec_accepted: int = 0
    spec_drafted: int = 0
    finish_reasons: list[str] = field(default_factory=list)
    status: int | None = None  # set when the status differs from the HTTP one (stream errors)

    def add_choice(self, last: RequestOutput | None, finish_reason: str | None) -> None:
        """Count one finished choice: its last engine output (None: it produced none) and finish reason."""
        if last is not None:
            self.completion_tokens += last.num_output_tokens
            self.spec_accepted += last.num_accepted_tokens
            self.spec_drafted += last.num_draft_tokens
        self.finish_reasons.append(finish_reason or "abort")


def request_record(request: HTTPRequest) -> RequestRecord:
    record = request.scope.get(RECORD_SCOPE_KEY)
    if record is None:
        record = request.scope[RECORD_SCOPE_KEY] = RequestRecord(endpoint=request.url.path)
    return record
