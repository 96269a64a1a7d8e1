"""POST /v1/chat/completions: chat template, Predicted Outputs, chat chunks."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import Response
from jinja2 import TemplateError

from models.chat_escape import UnescapedToolText, chat_ids
from scheduler.types import InvalidRequestError, TokenConstraint
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
    DeltaFunction,
    DeltaMessage,
    DeltaToolCall,
    NamedToolChoice,
    ResponseFunction,
    ResponseHead,
    ResponseToolCall,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from server.record import request_record
from server.serving import (
    ServingContext,
    aborted_on_error,
    check_stream_options,
    grammar_source,
    sampling_params,
    submit_all,
    until_disconnected,
)
from server.structured_outputs import GrammarSource
from server.tool_calls import CALL_OPEN, ToolCall, ToolCallParser, tool_grammar

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


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as the chat template gets them: roles, plain text, and the tool calls an
    assistant made (arguments as objects, as templates write them) or the call a tool answers."""
    messages = []
    for i, m in enumerate(req.messages):
        message: dict[str, Any] = {
            "role": "system" if m.role == "developer" else m.role,
            "content": content_text(m.content, f"messages[{i}].content"),
        }
        if m.tool_calls:
            message["tool_calls"] = [
                {"id": call.id, "type": "function",
                 "function": {"name": call.function.name, "arguments": _arguments(call.function.arguments)}}
                for call in m.tool_calls
            ]  # fmt: skip
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.name is not None and m.role == "tool":
            message["name"] = m.name
        messages.append(message)
    return messages


def _arguments(arguments: str | dict[str, Any]) -> Any:
    if isinstance(arguments, dict):
        return arguments
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments  # as the client sent it


@dataclass(frozen=True)
class ToolUse:
    """What a request's `tools` and `tool_choice` ask: the functions the template is shown, and
    whether the reply is read for tool calls."""

    functions: list[dict[str, Any]]
    parse: bool  # tool_choice auto, required or named: tool calls are read out of the text
    required: list[dict[str, Any]] | None  # functions the grammar forces a call of (required, named)


def tool_use(req: ChatCompletionRequest) -> ToolUse | None:
    if not req.tools:
        if req.tool_choice not in (None, "none"):
            raise BadRequestError("'tool_choice' needs 'tools'", param="tool_choice")
        return None
    functions = [t.function.model_dump(exclude_none=True) for t in req.tools]
    choice = req.tool_choice or "auto"
    if isinstance(choice, NamedToolChoice):
        named = [f for f in functions if f["name"] == choice.function.name]
        if not named:
            raise BadRequestError(
                f"'tool_choice' names the function '{choice.function.name}', which 'tools' does not declare",
                param="tool_choice.function.name",
            )
        return ToolUse(functions, True, named)
    return ToolUse(functions, choice != "none", functions if choice == "required" else None)


# apply_chat_template's own arguments: what chat_template_kwargs may not override.
RENDER_ARGUMENTS = frozenset(
    {"conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
     "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
     "return_assistant_tokens_mask", "tokenizer_kwargs"}
)  # fmt: skip


def render_prompt(ctx: ServingContext, req: ChatCompletionRequest, messages: list[dict[str, Any]]) -> list[int]:
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
        # Content of system, user and tool messages stays text: typed control tokens forge nothing.
        return chat_ids(
            tokenizer,
            messages,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            tools=[{"type": "function", "function": t.function.model_dump(exclude_none=True)} for t in req.tools]
            if req.tools
            else None,
            **(req.chat_template_kwargs or {}),
        )
    except UnescapedToolText as exc:
        raise BadRequestError(str(exc), param="tools" if req.tools else "messages") from None
    except TemplateError as exc:  # a template that rejects these messages (jinja's raise_exception): its words
        raise BadRequestError(f"the chat template rejected the messages: {exc}", param="messages") from None
    except Exception as exc:  # noqa: BLE001 - anything else the template does wrong: no internals in the reply
        # A client can cause this at will: one line, no traceback to flood the log with.
        logger.warning("the chat template failed: %r", exc)
        raise BadRequestError("the chat template could not render these messages", param="messages") from None


@dataclass
class Prepared:
    """A chat request's work done on the preparation thread."""

    prompt_ids: list[int]
    prediction_ids: list[int] | None
    constraints: list[TokenConstraint] | None  # one grammar state per choice


def prepare(
    ctx: ServingContext,
    req: ChatCompletionRequest,
    messages: list[dict[str, Any]],
    predicted: str | None,
    grammar: GrammarSource | None,
) -> Prepared:
    """The prompt's and the prediction's token ids, and each choice's grammar (run on the
    preparation thread)."""
    constraints: list[TokenConstraint] | None = None
    if grammar is not None:  # first: a bad grammar is refused before the prompt is rendered
        constraints = list(ctx.grammars.states(grammar, req.n))
    prompt_ids = render_prompt(ctx, req, messages)
    if predicted is None:
        return Prepared(prompt_ids, None, constraints)
    prediction_ids = ctx.tokenizer.encode(predicted, add_special_tokens=False) or None
    if prediction_ids is not None and len(prediction_ids) > ctx.max_model_len:
        raise BadRequestError(
            f"'prediction' has {len(prediction_ids)} tokens; at most {ctx.max_model_len} (the context length) "
            "can ever be used",
            param="prediction.content",
            code="prediction_too_long",
        )
    return Prepared(prompt_ids, prediction_ids, constraints)


def check_unsupported(req: ChatCompletionRequest) -> None:
    if req.top_logprobs and not req.logprobs:
        raise BadRequestError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")


def chat_grammar(ctx: ServingContext, req: ChatCompletionRequest, tools: ToolUse | None) -> GrammarSource | None:
    """The grammar the reply obeys: from `response_format` / `structured_outputs`, or the tool
    calls `tool_choice` requires (not both)."""
    source = grammar_source(req)
    if tools is None or tools.required is None:
        return source
    if source is not None:
        raise BadRequestError(
            "a required tool call and a response format cannot both constrain the reply", param="tool_choice"
        )
    return tool_grammar(tools.required, req.parallel_tool_calls, ctx.grammars.special_token(CALL_OPEN))


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


def sized_messages(ctx: ServingContext, req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as the template reads them, refused (400) if their text cannot fit the context."""
    messages = chat_messages(req)
    ctx.check_text_size(sum(len(m["content"]) for m in messages), "messages")
    return messages


async def render_chat(ctx: ServingContext, req: ChatCompletionRequest, raw: HTTPRequest) -> Response:
    """POST /v1/chat/completions/render: the prompt's token ids as this server would compute it,
    nothing generated (what cache-aware routers and llm-d's token producer key replicas by)."""
    ctx.check_model(req.model)
    messages = sized_messages(ctx, req)
    body = await ctx.off_loop(raw, _rendered, ctx, req, messages)
    return Response(body, media_type="application/json")


def _rendered(ctx: ServingContext, req: ChatCompletionRequest, messages: list[dict[str, Any]]) -> bytes:
    return json.dumps({"token_ids": render_prompt(ctx, req, messages)}, separators=(",", ":")).encode()


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest, raw: HTTPRequest) -> Response:
    ctx.check_model(req.model)
    check_stream_options(req)
    check_unsupported(req)
    tools = tool_use(req)
    grammar = chat_grammar(ctx, req, tools)
    messages = sized_messages(ctx, req)
    predicted = content_text(req.prediction.content, "prediction.content") if req.prediction is not None else None
    if predicted is not None:
        ctx.check_text_size(len(predicted), "prediction.content")
    prepared = await ctx.off_loop(raw, prepare, ctx, req, messages, predicted, grammar)
    prompt_ids, prediction_ids = prepared.prompt_ids, prepared.prediction_ids
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
            ctx,
            head.id,
            [prompt_ids] * req.n,
            params,
            prediction_ids,
            tenant=tenant,
            cache_salt=req.cache_salt,
            constraints=prepared.constraints,
        )
    except InvalidRequestError as exc:
        if exc.param == "prompt":  # the engine sees a prompt; a chat request's prompt is its messages
            exc.param = "messages"
        raise
    with aborted_on_error(streams):
        choices = [Choice(i, stream, ctx.tokenizer, req, prompt_ids) for i, stream in enumerate(streams)]
        on_finish = ctx.traffic.recorder(ENDPOINT, head.id, tenant, {"messages": messages}) if ctx.traffic else None
        gen = Generation(head, req, choices, record, len(prompt_ids), on_finish=on_finish)
        parse_tools = tools is not None and tools.parse
        if req.stream:
            return _stream(ctx, gen, parse_tools)
    return await until_disconnected(raw, _complete(ctx, gen, parse_tools))


def _message(text: str, finish_reason: str | None, parse_tools: bool) -> tuple[AssistantMessage, str | None]:
    """The reply as a message; with tools, the calls read out of its text (finish reason `tool_calls`)."""
    if not parse_tools:
        return AssistantMessage(content=text), finish_reason
    parser = ToolCallParser()
    content, _ = parser.push(text)
    rest, _ = parser.finish()
    content += rest
    if not parser.calls:
        return AssistantMessage(content=content), finish_reason
    calls = [
        ResponseToolCall(id=c.id, function=ResponseFunction(name=c.name, arguments=c.arguments)) for c in parser.calls
    ]
    reason = "tool_calls" if finish_reason == "stop" else finish_reason
    return AssistantMessage(content=content or None, tool_calls=calls), reason


async def _complete(ctx: ServingContext, gen: Generation, parse_tools: bool) -> ChatCompletionResponse:
    results = await collect(gen)
    choices = []
    for c in gen.choices:
        result = results[c.index]
        message, finish_reason = _message("".join(result.text), result.finish_reason, parse_tools)
        choices.append(
            ChatChoice(
                index=c.index,
                message=message,
                logprobs=ChoiceLogprobs(content=token_logprobs(ctx, result.tokens)) if c.want_logprobs else None,
                finish_reason=finish_reason,
            )
        )
    return ChatCompletionResponse(**gen.head.fields(), choices=choices, usage=gen.usage())


def _stream(ctx: ServingContext, gen: Generation, parse_tools: bool) -> SSEResponse:
    want_logprobs = gen.choices[0].want_logprobs
    chunk = chunk_encoder(ChatCompletionChunk, gen.head)
    parsers = {c.index: ToolCallParser() for c in gen.choices} if parse_tools else {}

    def render(update: ChoiceUpdate | None, usage: Usage | None) -> bytes:
        if update is None:
            return chunk([], usage)
        logprobs = ChoiceLogprobs(content=token_logprobs(ctx, update.tokens)) if want_logprobs else None
        text, finish_reason = update.text, update.finish_reason
        calls: list[ToolCall] = []
        parser = parsers.get(update.index)
        if parser is not None:
            text, calls = parser.push(text)
            if finish_reason is not None:
                rest, more = parser.finish()
                text, calls = text + rest, calls + more
                if parser.calls and finish_reason == "stop":
                    finish_reason = "tool_calls"
        # A tool call streams as OpenAI's do: a delta with its id and name, then its arguments.
        parts = []
        if calls:
            assert parser is not None
            if text:
                parts.append(chunk([ChatChunkChoice(index=update.index, delta=DeltaMessage(content=text))], None))
                text = ""
            for j, call in enumerate(calls, start=len(parser.calls) - len(calls)):
                for delta in (
                    DeltaToolCall(
                        index=j, id=call.id, type="function", function=DeltaFunction(name=call.name, arguments="")
                    ),
                    DeltaToolCall(index=j, function=DeltaFunction(arguments=call.arguments)),
                ):
                    parts.append(
                        chunk([ChatChunkChoice(index=update.index, delta=DeltaMessage(tool_calls=[delta]))], None)
                    )
            if finish_reason is None and logprobs is None and update.speculation is None and usage is None:
                return b"".join(parts)
        closing = ChatChunkChoice(
            index=update.index,
            delta=DeltaMessage(content=text) if text else DeltaMessage(),
            logprobs=logprobs,
            finish_reason=finish_reason,
            speculation=update.speculation,
        )
        return b"".join([*parts, chunk([closing], usage)])

    _, continuous = stream_flags(gen.req)
    opening_usage = gen.usage() if continuous else None
    opening = [
        chunk([ChatChunkChoice(index=c.index, delta=DeltaMessage(role="assistant", content=""))], opening_usage)
        for c in gen.choices
    ]
    return SSEResponse(sse_stream(gen, opening, render), gen.choices, ctx.shutdown_timeout)
