"""Choices: one output sequence each, from engine stream to the text a client sees.

A `Choice` owns its engine stream and the text state that turns token ids
into what the client may see: incremental detokenization, stop-string
holdback, and logprobs released together with their text. `run_choices`
merges the choices of one request (`n`, several prompts) into one sequence of
updates; `collect` (JSON body) and `sse_stream` (SSE body) consume it.
A `Generation` bundles what those need of one request: its choices, the
`ResponseHead` its responses repeat, its sampling fields and its log record.

This module knows nothing of the serving context: a `Choice` gets only the
tokenizer it decodes with.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from sse_starlette import EventSourceResponse

from scheduler.engine import RequestStream
from scheduler.types import FinishReason, RequestOutput
from server.detokenizer import IncrementalDetokenizer, StopStringMatcher
from server.errors import APIError, EngineError
from server.protocol import (
    ChunkSpeculation,
    CompletionTokensDetails,
    PromptTokensDetails,
    ResponseHead,
    SamplingFields,
    Usage,
)
from server.record import RequestRecord
from server.speculation_tally import SpeculationTally

logger = logging.getLogger("specd.server")

LOGPROB_FLOOR = -9999.0  # JSON has no -inf
SSE_DONE = b"data: [DONE]\n\n"


def stream_flags(req: SamplingFields) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats)."""
    options = req.stream_options
    if options is None or not options.include_usage:
        return False, False
    return True, options.continuous_usage_stats


def wants_speculation(req: SamplingFields) -> bool:
    """`stream_options.include_speculation` (allowed only when streaming)."""
    return req.stream_options is not None and req.stream_options.include_speculation


@dataclass
class TokenInfo:
    """A generated token with its logprobs; its text spans [start, end) of the choice's text."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    start: int
    end: int


@dataclass
class ChoiceUpdate:
    index: int
    text: str
    tokens: list[TokenInfo]
    finish_reason: str | None
    speculation: ChunkSpeculation | None = None


class Choice:
    """One output sequence: an engine stream and the text the client has seen."""

    def __init__(
        self,
        index: int,
        stream: RequestStream,
        tokenizer: Any,
        req: SamplingFields,
        prompt_ids: list[int],
    ):
        self.index = index
        self.stream = stream
        self.prompt_ids = prompt_ids  # shared by the choices of one prompt
        self.want_logprobs = stream.request.params.logprobs is not None
        self.has_prediction = stream.request.prediction_ids is not None
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, req.skip_special_tokens)
        stops = [req.stop] if isinstance(req.stop, str) else req.stop or []
        self._stops = StopStringMatcher(stops, req.include_stop_str_in_output)
        self._pending: list[TokenInfo] = []
        self._num_decoded = 0  # characters decoded (shown or held back)
        self.num_shown = 0  # characters released to the client
        self._shown: list[str] = []  # the text released, for --record-traffic
        self.last: RequestOutput | None = None
        self.finish_reason: str | None = None
        self.num_completion_tokens: int | None = None  # set when a stop string ends the output
        self._tally = SpeculationTally() if wants_speculation(req) else None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        """The text released to the client so far."""
        return "".join(self._shown)

    @property
    def num_tokens(self) -> int:
        """Completion tokens so far, as usage counts them (up to a stop string's last token)."""
        if self.num_completion_tokens is not None:
            return self.num_completion_tokens
        return self.last.num_output_tokens if self.last is not None else 0

    def update(self, out: RequestOutput) -> ChoiceUpdate | None:
        """Apply one engine output; None when there is nothing to send yet."""
        self.last = out
        if out.finished and out.finish_reason is FinishReason.ERROR:
            self.finish_reason = "error"
            # Why it failed (an exception's text) is for the server's log, not for the client.
            logger.error("request %s failed in the engine: %s", out.request_id, out.error or "unknown error")
            raise EngineError(
                f"the engine failed this request ({out.request_id}); the server log has the details",
                code="engine_error",
            )
        if self._tally is not None:
            self._tally.add(out)
        piece, token_ends = "", []
        if self._stops.active:  # token by token, so a stop string can be traced to the token that completed it
            for token_id in out.new_token_ids:
                piece += self._detokenizer.push([token_id])
                token_ends.append(self._num_decoded + len(piece))
        elif out.new_token_ids:
            piece = self._detokenizer.push(out.new_token_ids)
        if out.finished:
            piece += self._detokenizer.flush()
        if self.want_logprobs and out.new_token_ids:
            self._remember_tokens(out, self._num_decoded, self._num_decoded + len(piece))
        self._num_decoded += len(piece)

        text, matched = self._stops.push(piece)
        if matched:
            self.finish_reason = "stop"
            self.stream.abort()
            # Tokens the engine accepted past the stop string (same step) are not part of the completion.
            stop_end = self._stops.stop_end or 0
            used = next((i + 1 for i, end in enumerate(token_ends) if end >= stop_end), len(token_ends))
            self.num_completion_tokens = out.num_output_tokens - len(out.new_token_ids) + used
        elif out.finished:
            text += self._stops.flush()
            self.finish_reason = out.finish_reason.value if out.finish_reason else "stop"
        self.num_shown += len(text)
        if text:
            self._shown.append(text)
        tokens = self._release_tokens()
        if not text and not tokens and self.finish_reason is None:
            return None
        speculation = self._tally.take(self.num_tokens, *self.usage_details()) if self._tally is not None else None
        return ChoiceUpdate(self.index, text, tokens, self.finish_reason, speculation)

    def _remember_tokens(self, out: RequestOutput, start: int, end: int) -> None:
        tops = out.new_top_logprobs or [[] for _ in out.new_token_ids]
        logprobs = out.new_logprobs or [0.0] * len(out.new_token_ids)
        for token_id, logprob, top in zip(out.new_token_ids, logprobs, tops):
            self._pending.append(TokenInfo(token_id, logprob, top or [], start, end))

    def _release_tokens(self) -> list[TokenInfo]:
        """Tokens whose text has been shown; at the end, those that contributed to it."""
        if not self._pending:
            return []
        if self.finish_reason is None:
            n = next((i for i, t in enumerate(self._pending) if t.end > self.num_shown), len(self._pending))
        elif self.finish_reason == "stop":
            n = sum(1 for t in self._pending if t.start < self.num_shown)
        else:
            n = len(self._pending)
        released, self._pending = self._pending[:n], self._pending[n:]
        return released

    def usage_details(self) -> tuple[int, int]:
        """(accepted, rejected) speculation tokens for `completion_tokens_details`.

        With a `prediction`: OpenAI's meaning, prediction tokens the output
        kept / discarded. Without: the speculative drafts of this request
        (accepted draft tokens / proposed but rejected ones).
        """
        out = self.last
        if out is None:
            return 0, 0
        if self.has_prediction:
            return out.num_prediction_accepted, out.num_prediction_rejected
        return out.num_accepted_tokens, out.num_draft_tokens - out.num_accepted_tokens


async def run_choices(choices: list[Choice], record: RequestRecord) -> AsyncIterator[ChoiceUpdate]:
    """Updates from every choice, in the order the engine produced them, until all finish."""
    if len(choices) == 1:
        choice = choices[0]
        async for out in choice.stream:
            if out.new_token_ids and record.first_token is None:
                record.first_token = time.monotonic()
            update = choice.update(out)
            if update is not None:
                yield update
            if choice.finished:
                return
        return

    queue: asyncio.Queue[tuple[Choice, RequestOutput]] = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        async for out in choice.stream:
            queue.put_nowait((choice, out))

    pumps = [asyncio.create_task(pump(c)) for c in choices]
    try:
        while not all(c.finished for c in choices):
            choice, out = await queue.get()
            if choice.finished:
                continue
            if out.new_token_ids and record.first_token is None:
                record.first_token = time.monotonic()
            update = choice.update(out)
            if update is not None:
                yield update
    finally:
        for task in pumps:
            task.cancel()


def abort_all(choices: list[Choice]) -> None:
    for choice in choices:
        choice.stream.abort()


def finish_all(choices: list[Choice], record: RequestRecord) -> None:
    """However a request ends: abort what still runs, and count every choice in the log record."""
    abort_all(choices)
    for choice in choices:
        record.add_choice(choice.last, choice.finish_reason)


def usage_of(choices: list[Choice], num_prompt_tokens: int) -> Usage:
    completion = accepted = rejected = 0
    # Each prompt counts once however many choices ran it: its best cache hit among them.
    cached: dict[int, int] = {}
    for choice in choices:
        if choice.last is not None:
            key = id(choice.prompt_ids)
            cached[key] = max(cached.get(key, 0), choice.last.num_cached_tokens)
        completion += choice.num_tokens
        a, r = choice.usage_details()
        accepted += a
        rejected += r
    return Usage(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=completion,
        total_tokens=num_prompt_tokens + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(cached.values())),
        completion_tokens_details=CompletionTokensDetails(
            accepted_prediction_tokens=accepted, rejected_prediction_tokens=rejected
        ),
    )


@dataclass
class Generation:
    """One request in flight: its choices and what its response (or its stream's chunks) needs."""

    head: ResponseHead
    req: SamplingFields
    choices: list[Choice]
    record: RequestRecord
    num_prompt_tokens: int
    # Called once when the request ends, however it ends (--record-traffic writes its line).
    on_finish: Callable[[Generation], None] | None = field(default=None, kw_only=True)

    def usage(self) -> Usage:
        return usage_of(self.choices, self.num_prompt_tokens)

    def finish(self) -> None:
        """However the request ends: abort what still runs, count every choice, then `on_finish`."""
        finish_all(self.choices, self.record)
        if self.on_finish is not None:
            try:
                self.on_finish(self)
            except Exception:  # noqa: BLE001 - bookkeeping never fails a request
                logger.exception("request %s: on_finish failed", self.record.request_id)


async def collect(gen: Generation) -> dict[int, Collected]:
    """Run a non-streamed request to the end: each choice's text, tokens and finish reason."""
    choices, record = gen.choices, gen.record
    results = {c.index: Collected() for c in choices}
    try:
        async for update in run_choices(choices, record):
            result = results[update.index]
            result.text.append(update.text)
            result.tokens += update.tokens
            result.finish_reason = update.finish_reason or result.finish_reason
    finally:
        gen.finish()
    return results


@dataclass
class Collected:
    text: list[str] = field(default_factory=list)
    tokens: list[TokenInfo] = field(default_factory=list)
    finish_reason: str | None = None


async def sse_stream(
    gen: Generation,
    opening: list[bytes],
    render: Callable[[ChoiceUpdate | None, Usage | None], bytes],
) -> AsyncIterator[bytes]:
    """SSE body: `opening` chunks, one chunk per update, the usage chunk, `[DONE]`.

    `render(None, usage)` is the usage chunk. An engine failure after the
    headers went out is sent as an error event (the OpenAI SDKs raise it).
    """
    choices, record = gen.choices, gen.record
    include_usage, continuous = stream_flags(gen.req)
    try:
        for chunk in opening:
            yield chunk
        async for update in run_choices(choices, record):
            yield render(update, gen.usage() if continuous else None)
        if include_usage:
            yield render(None, gen.usage())
    except APIError as exc:
        record.status = exc.status_code
        yield sse_error(exc)
    except (asyncio.CancelledError, GeneratorExit):  # the client left (or shutdown cut the stream)
        record.status = 499
        raise
    except Exception:  # noqa: BLE001 - the headers are sent: report in-band, never a traceback
        logger.exception("stream %s failed", record.request_id)
        record.status = 500
        yield sse_error(EngineError("internal server error", code="internal_error"))
    finally:
        gen.finish()
    yield SSE_DONE


class SSEResponse(EventSourceResponse):
    """`text/event-stream` with OpenAI's framing; its engine requests are aborted however it ends.

    The body generator aborts them when it closes, but a client that leaves
    before the body starts never runs it. On SIGTERM, streams get
    `grace_seconds` to finish before they are cut.
    """

    def __init__(self, body: AsyncIterator[bytes], choices: list[Choice], grace_seconds: float):
        super().__init__(body, sep="\n", ping=15, shutdown_grace_period=grace_seconds)
        self._choices = choices

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            abort_all(self._choices)


def clamp_logprob(value: float) -> float:
    return value if value >= LOGPROB_FLOOR else LOGPROB_FLOOR  # also maps NaN to the floor


def sse(payload: str) -> bytes:
    return b"data: " + payload.encode() + b"\n\n"


def sse_error(exc: APIError) -> bytes:
    body = {"error": {"message": exc.message, "type": exc.error_type, "param": exc.param, "code": exc.code}}
    return sse(json.dumps(body))


def chunk_encoder(response_cls, head: ResponseHead) -> Callable[[list, Usage | None], bytes]:
    """SSE encoder for one streamed response: its chunks share the `head`."""

    def encode(items: list, usage: Usage | None) -> bytes:
        body = response_cls(**head.fields(), choices=items, usage=usage)
        return sse(body.model_dump_json(exclude_none=True))

    return encode
