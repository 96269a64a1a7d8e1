"""POST /v1/chat/completions: chat template, Predicted Outputs, chat chunks."""

from __future__ import annotations

import logging

from fastapi import Request as HTTPRequest
from fastapi.responses import Response
from jinja2 import TemplateError

from models.chat_template import chat_text
from scheduler.types import InvalidRequestError
from server.choices import (
    Choice,
    ChoiceUpdate,
    Generation,
    SSEResponse,
    TokenInfo,
    chunk_encoder,
    clamp_logprob,
    collect,
    sse_stream,
    stream_flags,
)
from server.errors import BadRequestError
from server.middleware import request_tenant
from server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChoiceLogprobs,
    ContentPart,
    DeltaMessage,
    ResponseHead,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from server.record import request_record
from server.serving import (
    ServingContext,
    aborted_on_error,
    check_stream_options,
    sampling_params,
    submit_all,
    until_disconnected,
)

logger = logging.getLogger("specd.server")

ENDPOINT = "/v1/chat/completions"


def content_text(content: str | list[ContentPart] | None, param: str) -> str:
    """A message's text; content parts other than text are refused."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        if part.type not in ("text", "input_text"):
            raise BadRequestError(
                f"content part type '{part.type}' is not supported; only text parts are", param=f"{param}[{j}].type"
            )
        if part.text is None:
            raise BadRequestError("a text content part needs a 'text' string", param=f"{param}[{j}].text")
        texts.append(part.text)
    return "\n".join(texts)


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, str]]:
    """The messages as the chat template gets them: roles and plain text."""
    return [
        {
            "role": "system" if m.role == "developer" else m.role,
            "content": content_text(m.content, f"messages[{i}].content"),
        }
        for i, m in enumerate(req.messages)
    ]


# apply_chat_template's own arguments: what chat_template_kwargs may not override.
RENDER_ARGUMENTS = frozenset(
    {"conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
     "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
     "return_assistant_tokens_mask", "tokenizer_kwargs"}
)  # fmt: skip


def render_prompt(ctx: ServingContext, req: ChatCompletionRequest, messages: list[dict[str, str]]) -> list[int]:
    if req.continue_final_message and (req.add_generation_prompt or req.messages[-1].role != "assistant"):
        raise BadRequestError(
            "'continue_final_message' needs 'add_generation_prompt': false and a final assistant message",
            param="continue_final_message",
        )
    clash = RENDER_ARGUMENTS.intersection(req.chat_template_kwargs or {})
    if clash:
        raise BadRequestError(
            f"'chat_template_kwargs' may not set {', '.join(sorted(clash))} (the server sets them)",
            param="chat_template_kwargs",
        )
    tokenizer = ctx.tokenizer
    try:
        text = chat_text(
            tokenizer,
            messages,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            **(req.chat_template_kwargs or {}),
        )
    except TemplateError as exc:  # a template that rejects these messages (jinja's raise_exception): its words
        raise BadRequestError(f"the chat template rejected the messages: {exc}", param="messages") from None
    except Exception as exc:  # noqa: BLE001 - anything else the template does wrong: no internals in the reply
        # A client can cause this at will: one line, no traceback to flood the log with.
        logger.warning("the chat template failed: %r", exc)
        raise BadRequestError("the chat template could not render these messages", param="messages") from None
    return tokenizer.encode(text, add_special_tokens=False)


def prepare(
    ctx: ServingContext, req: ChatCompletionRequest, messages: list[dict[str, str]], predicted: str | None
) -> tuple[list[int], list[int] | None]:
    """The prompt's and the prediction's token ids (run on the preparation thread)."""
    prompt_ids = render_prompt(ctx, req, messages)
    if predicted is None:
        return prompt_ids, None
    prediction_ids = ctx.tokenizer.encode(predicted, add_special_tokens=False) or None
    if prediction_ids is not None and len(prediction_ids) > ctx.max_model_len:
        raise BadRequestError(
            f"'prediction' has {len(prediction_ids)} tokens; at most {ctx.max_model_len} (the context length) "
            "can ever be used",
            param="prediction.content",
            code="prediction_too_long",
        )
    return prompt_ids, prediction_ids


def check_unsupported(req: ChatCompletionRequest) -> None:
    if req.tools:
        raise BadRequestError("tools are not supported by this server", param="tools")
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise BadRequestError("only response_format type 'text' is supported", param="response_format")
    if req.top_logprobs and not req.logprobs:
        raise BadRequestError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")


def token_logprobs(ctx: ServingContext, tokens: list[TokenInfo]) -> list[TokenLogprob]:
    items = []
    for t in tokens:
        text, raw = ctx.token_texts(t.token_id)
        top = []
        for token_id, logprob in t.top:
            top_text, top_raw = ctx.token_texts(token_id)
            top.append(TopLogprob(token=top_text, logprob=clamp_logprob(logprob), bytes=top_raw))
        items.append(TokenLogprob(token=text, logprob=clamp_logprob(t.logprob), bytes=raw, top_logprobs=top))
    return items


def sized_messages(ctx: ServingContext, req: ChatCompletionRequest) -> list[dict[str, str]]:
    """The messages as the template reads them, refused (400) if their text cannot fit the context."""
    messages = chat_messages(req)
    ctx.check_text_size(sum(len(m["content"]) for m in messages), "messages")
    return messages


async def render_chat(ctx: ServingContext, req: ChatCompletionRequest) -> dict:
    """POST /v1/chat/completions/render: the prompt's token ids as this server would compute it,
    nothing generated (what cache-aware routers and llm-d's token producer key replicas by)."""
    ctx.check_model(req.model)
    messages = sized_messages(ctx, req)
    return {"token_ids": await ctx.off_loop(render_prompt, ctx, req, messages)}


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest, raw: HTTPRequest) -> Response:
    ctx.check_model(req.model)
    check_stream_options(req)
    check_unsupported(req)
    messages = sized_messages(ctx, req)
    predicted = content_text(req.prediction.content, "prediction.content") if req.prediction is not None else None
    if predicted is not None:
        ctx.check_text_size(len(predicted), "prediction.content")
    prompt_ids, prediction_ids = await ctx.off_loop(prepare, ctx, req, messages, predicted)
    requested = req.max_completion_tokens or req.max_tokens
    max_tokens = requested or max(1, ctx.max_model_len - len(prompt_ids))
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = [sampling_params(ctx, req, max_tokens=max_tokens, logprobs=logprobs, choice=i) for i in range(req.n)]

    record = request_record(raw)
    head = ResponseHead.new("chatcmpl", req.model, ctx.system_fingerprint)
    record.request_id, record.stream, record.n, record.prompt_tokens = head.id, req.stream, req.n, len(prompt_ids)
    tenant = request_tenant(raw.scope)
    try:
        streams = submit_all(
            ctx, head.id, [prompt_ids] * req.n, params, prediction_ids, tenant=tenant, cache_salt=req.cache_salt
        )
    except InvalidRequestError as exc:
        if exc.param == "prompt":  # the engine sees a prompt; a chat request's prompt is its messages
            exc.param = "messages"
        raise
    with aborted_on_error(streams):
        choices = [Choice(i, stream, ctx.tokenizer, req, prompt_ids) for i, stream in enumerate(streams)]
        on_finish = ctx.traffic.recorder(ENDPOINT, head.id, tenant, {"messages": messages}) if ctx.traffic else None
        gen = Generation(head, req, choices, record, len(prompt_ids), on_finish=on_finish)
        if req.stream:
            return _stream(ctx, gen)
    return await until_disconnected(raw, _complete(ctx, gen))


async def _complete(ctx: ServingContext, gen: Generation) -> ChatCompletionResponse:
    results = await collect(gen)
    return ChatCompletionResponse(
        **gen.head.fields(),
        choices=[
            ChatChoice(
                index=c.index,
                message=AssistantMessage(content="".join(results[c.index].text)),
                logprobs=ChoiceLogprobs(content=token_logprobs(ctx, results[c.index].tokens))
                if c.want_logprobs
                else None,
                finish_reason=results[c.index].finish_reason,
            )
            for c in gen.choices
        ],
        usage=gen.usage(),
    )


def _stream(ctx: ServingContext, gen: Generation) -> SSEResponse:
    want_logprobs = gen.choices[0].want_logprobs

    chunk = chunk_encoder(ChatCompletionChunk, gen.head)

    def render(update: ChoiceUpdate | None, usage: Usage | None) -> bytes:
        if update is None:
            return chunk([], usage)
        logprobs = ChoiceLogprobs(content=token_logprobs(ctx, update.tokens)) if want_logprobs else None
        delta = DeltaMessage(content=update.text) if update.text else DeltaMessage()
        return chunk(
            [
                ChatChunkChoice(
                    index=update.index,
                    delta=delta,
                    logprobs=logprobs,
                    finish_reason=update.finish_reason,
                    speculation=update.speculation,
                )
            ],
            usage,
        )

    _, continuous = stream_flags(gen.req)
    opening_usage = gen.usage() if continuous else None
    opening = [
        chunk([ChatChunkChoice(index=c.index, delta=DeltaMessage(role="assistant", content=""))], opening_usage)
        for c in gen.choices
    ]
    return SSEResponse(sse_stream(gen, opening, render), gen.choices, ctx.shutdown_timeout)
