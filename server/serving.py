"""Request <-> engine, shared by chat and text completions.

A request becomes one engine `Request` per choice (`n`, and per prompt for a
list of prompts), with `SamplingParams` built here; `server.choices` turns
the engine streams back into text (the per-request log record is in
`server.record`). Also: the serving context, and cancelling work whose client
has gone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request as HTTPRequest

from scheduler.engine import AsyncEngine, RequestStream
from scheduler.types import MAX_LOGIT_BIAS, MAX_SPEC_TOKENS, Request, SamplingParams, TokenConstraint
from server import structured_outputs
from server.detokenizer import TokenTexts
from server.errors import APIError, BadRequestError, NotFoundError
from server.middleware import request_tenant
from server.preparation import PreparationQueue
from server.protocol import SamplingFields
from server.structured_outputs import GrammarCompiler, GrammarSource
from server.traffic import TrafficLog

SEED_MASK = 2**63 - 1
T = TypeVar("T")


@dataclass
class ServingContext:
    """What the endpoints need once the model is loaded."""

    engine: AsyncEngine
    tokenizer: Any
    model_id: str
    served_names: list[str]
    max_model_len: int
    vocab_size: int
    system_fingerprint: str
    enable_fault_injection: bool
    shutdown_timeout: float = 30.0
    traffic: TrafficLog | None = None  # --record-traffic
    max_request_spec_tokens: int = MAX_SPEC_TOKENS  # --max-request-speculative-tokens
    forced_speculation: bool = True  # --forced-speculation: honour speculation=true
    eos_token_ids: list[int] = field(default_factory=list)  # what a finished grammar allows
    on_grammar_compiled: Callable[[float], None] | None = None  # seconds per compile (a metric)
    max_prep_queue: int = 64  # --max-prep-queue
    token_texts: TokenTexts = field(init=False)
    # The longest text one token stands for: a prompt longer than max_model_len times this many
    # characters cannot fit, and is refused before anything tokenizes it.
    max_token_chars: int = field(init=False)
    # Chat templates, tokenizing and grammar compiles run here, not on the event loop: one thread,
    # since a fast tokenizer shared across threads can refuse a concurrent call ("Already borrowed").
    prep: PreparationQueue = field(init=False)
    grammars: GrammarCompiler = field(init=False)

    def __post_init__(self) -> None:
        self.token_texts = TokenTexts(self.tokenizer)
        self.max_token_chars = max_token_chars(self.tokenizer)
        self.prep = PreparationQueue(self.max_prep_queue)
        self.grammars = GrammarCompiler(
            self.tokenizer, self.eos_token_ids, self.vocab_size, on_compiled=self.on_grammar_compiled
        )

    async def off_loop(self, raw: HTTPRequest, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the preparation thread, in the turn of the request's tenant (503 when its
        queue is full); if the client leaves first, the job leaves the queue unrun."""
        return await until_disconnected(raw, self.prep.run(request_tenant(raw.scope), fn, *args))

    def check_text_size(self, num_chars: int, param: str) -> None:
        """400 for text that cannot fit the context, judged by its length alone."""
        limit = self.max_model_len * self.max_token_chars
        if num_chars > limit:
            raise BadRequestError(
                f"'{param}' holds {num_chars} characters: more than {self.max_model_len} tokens of this model "
                f"(at most {self.max_token_chars} characters each) can hold",
                param=param,
                code="context_length_exceeded",
            )

    def check_model(self, name: str) -> None:
        """The `model` field must name a served model; it is never loaded on demand."""
        if name not in self.served_names:
            raise NotFoundError(
                f"the model '{name}' does not exist; this server serves {', '.join(self.served_names)}",
                param="model",
                code="model_not_found",
            )


def max_token_chars(tokenizer: Any) -> int:
    """The most characters one token of `tokenizer` decodes to (its vocabulary's longest entry,
    which byte-level entries only overstate)."""
    try:
        return max((len(token) for token in tokenizer.get_vocab()), default=1) or 1
    except Exception:  # noqa: BLE001 - a tokenizer without a vocabulary view: no early refusal
        return 1 << 20


# -- sampling parameters -----------------------------------------------------------


def sampling_params(
    ctx: ServingContext,
    req: SamplingFields,
    *,
    max_tokens: int,
    logprobs: int | None,
    choice: int,
) -> SamplingParams:
    """One choice's `SamplingParams`; choice i of a seeded request uses seed + i."""
    seed = None if req.seed is None else (req.seed + choice) & SEED_MASK
    fault = (req.model_extra or {}).get("fault") if ctx.enable_fault_injection else None
    k = req.num_speculative_tokens
    if k is not None and k > ctx.max_request_spec_tokens:
        raise BadRequestError(
            f"'num_speculative_tokens' is at most {ctx.max_request_spec_tokens} on this server, got {k}",
            param="num_speculative_tokens",
        )
    stop_token_ids = list(req.stop_token_ids or [])
    check_token_ids(stop_token_ids, ctx.vocab_size, "stop_token_ids")

    def given(value, default):
        return default if value is None else value

    return SamplingParams(
        max_tokens=max_tokens,
        temperature=given(req.temperature, 1.0),
        top_p=given(req.top_p, 1.0),
        top_k=given(req.top_k, 0),
        min_p=given(req.min_p, 0.0),
        presence_penalty=given(req.presence_penalty, 0.0),
        frequency_penalty=given(req.frequency_penalty, 0.0),
        repetition_penalty=given(req.repetition_penalty, 1.0),
        logit_bias=parse_logit_bias(req.logit_bias, ctx.vocab_size),
        seed=seed,
        stop_token_ids=stop_token_ids,
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        speculation=req.speculation if req.speculation is not True or ctx.forced_speculation else "auto",
        num_speculative_tokens=k,
        fault=fault if isinstance(fault, str) else None,
    )


def parse_logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float]:
    if bias and len(bias) > MAX_LOGIT_BIAS:  # before parsing: the size bound is the cheap check
        raise BadRequestError(
            f"'logit_bias' may hold at most {MAX_LOGIT_BIAS} entries, got {len(bias)}", param="logit_bias"
        )
    parsed: dict[int, float] = {}
    for key, value in (bias or {}).items():
        try:
            token_id = int(key)
        except ValueError:
            raise BadRequestError(f"'logit_bias' keys must be token ids, got {key!r}", param="logit_bias") from None
        if not 0 <= token_id < vocab_size:
            raise BadRequestError(f"'logit_bias' token id {token_id} is outside the vocabulary", param="logit_bias")
        parsed[token_id] = value
    return parsed


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    bad = next((i for i in ids if not 0 <= i < vocab_size), None)
    if bad is not None:
        raise BadRequestError(f"token id {bad} is outside the vocabulary (0..{vocab_size - 1})", param=param)


def grammar_source(req: SamplingFields) -> GrammarSource | None:
    """The grammar the request's `response_format` or `structured_outputs` asks for (400 when
    both are given, or either is malformed); None for free text."""
    from_format = structured_outputs.from_response_format(req.response_format)
    from_fields = structured_outputs.from_structured_outputs(req.structured_outputs)
    if from_format is not None and from_fields is not None:
        raise BadRequestError(
            "give either 'response_format' or 'structured_outputs', not both", param="structured_outputs"
        )
    return from_format or from_fields


def check_stream_options(req: SamplingFields) -> None:
    if req.stream_options is not None and not req.stream:
        raise BadRequestError("'stream_options' is only allowed when 'stream' is true", param="stream_options")


# -- submitting --------------------------------------------------------------------


def submit_all(
    ctx: ServingContext,
    request_id: str,
    prompts: list[list[int]],
    params: list[SamplingParams],
    prediction_ids: list[int] | None = None,
    tenant: str = "",
    cache_salt: str | None = None,
    constraints: list[TokenConstraint] | None = None,
) -> list[RequestStream]:
    """Queue one engine request per choice; all or none (a refusal aborts the ones queued).
    `constraints`: each choice's grammar (structured outputs)."""
    streams: list[RequestStream] = []
    try:
        for i, (prompt_ids, p) in enumerate(zip(prompts, params)):
            request = Request(
                f"{request_id}-{i}",
                prompt_ids,
                p,
                prediction_ids=prediction_ids,
                tenant=tenant,
                cache_salt=cache_salt,
                constraint=constraints[i] if constraints is not None else None,
            )
            streams.append(ctx.engine.submit(request))
    except Exception:
        for stream in streams:
            stream.abort()
        raise
    return streams


@contextmanager
def aborted_on_error(streams: list[RequestStream]) -> Iterator[None]:
    """Between queueing a request's choices and handing them to a response (which aborts them
    however it ends), any failure aborts them: nothing would read them, and they would run on
    to max_tokens."""
    try:
        yield
    except BaseException:
        for stream in streams:
            stream.abort()
        raise


# -- disconnects -------------------------------------------------------------------


class ClientDisconnected(APIError):
    status_code = 499  # nginx's "client closed request": only ever seen in logs


async def until_disconnected(request: HTTPRequest, work: Awaitable[Any]) -> Any:
    """Await `work`, cancelling it (and so aborting its engine requests) if the client leaves."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected("the client closed the connection")
    return task.result()


async def _wait_for_disconnect(request: HTTPRequest) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
