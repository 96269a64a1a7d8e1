"""POST /v1/completions: prompts as text or token ids, echo, legacy logprobs."""

from __future__ import annotations

import time
import uuid

from fastapi import Request as HTTPRequest
from fastapi.responses import Response

from server.choices import (
    Choice,
    ChoiceUpdate,
    SSEResponse,
    TokenInfo,
    chunk_encoder,
    clamp_logprob,
    collect,
    sse_stream,
    stream_flags,
    usage_of,
)
from server.errors import BadRequestError
from server.protocol import (
    MAX_CHOICES,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Usage,
)
from server.serving import (
    ServingContext,
    check_stream_options,
    check_token_ids,
    request_record,
    sampling_params,
    submit_all,
    until_disconnected,
)


def tokenize_prompts(ctx: ServingContext, req: CompletionRequest) -> tuple[list[list[int]], list[str]]:
    """Token ids and text of each prompt (text is what `echo` repeats)."""
    prompt = req.prompt
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise BadRequestError("'prompt' must not be empty", param="prompt")
    if isinstance(prompt[0], int):
        prompt = [prompt]
    ids, texts = [], []
    for item in prompt:
        if isinstance(item, str):
            ids.append(ctx.tokenizer.encode(item, add_special_tokens=req.add_special_tokens))
            texts.append(item)
        else:
            check_token_ids(item, ctx.vocab_size, "prompt")
            ids.append(list(item))
            texts.append(ctx.tokenizer.decode(item) if req.echo else "")
    return ids, texts


def check_unsupported(req: CompletionRequest) -> None:
    if req.suffix:
        raise BadRequestError("'suffix' (insertion) is not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise BadRequestError("'best_of' is not supported (it may only equal 'n')", param="best_of")
    if req.echo and req.logprobs is not None:
        raise BadRequestError("'echo' with 'logprobs' needs prompt logprobs, which are not supported", param="echo")


def legacy_logprobs(ctx: ServingContext, tokens: list[TokenInfo], offset: int) -> CompletionLogprobs:
    result = CompletionLogprobs()
    for t in tokens:
        text, _ = ctx.token_texts(t.token_id)
        result.tokens.append(text)
        result.token_logprobs.append(clamp_logprob(t.logprob))
        result.top_logprobs.append({ctx.token_texts(i)[0]: clamp_logprob(lp) for i, lp in t.top})
        result.text_offset.append(offset + t.start)
    return result


async def create_completion(ctx: ServingContext, req: CompletionRequest, raw: HTTPRequest) -> Response:
    ctx.check_model(req.model)
    check_stream_options(req)
    check_unsupported(req)
    prompt_ids, prompt_texts = tokenize_prompts(ctx, req)
    if len(prompt_ids) * req.n > MAX_CHOICES:
        raise BadRequestError(f"at most {MAX_CHOICES} sequences (prompts x n) per request", param="n")

    prompts, params = [], []
    for ids in prompt_ids:
        max_tokens = req.max_tokens or max(1, ctx.max_model_len - len(ids))
        for j in range(req.n):
            prompts.append(ids)
            params.append(sampling_params(ctx, req, max_tokens=max_tokens, logprobs=req.logprobs, choice=j))
    echoes = [prompt_texts[i // req.n] if req.echo else "" for i in range(len(prompts))]

    record = request_record(raw)
    response_id = f"cmpl-{uuid.uuid4().hex}"
    num_prompt_tokens = sum(len(ids) for ids in prompt_ids)
    record.request_id, record.stream, record.n, record.prompt_tokens = (
        response_id,
        req.stream,
        len(prompts),
        num_prompt_tokens,
    )
    streams = submit_all(ctx, response_id, prompts, params)
    choices = [Choice(i, stream, ctx, req, ids) for i, (stream, ids) in enumerate(zip(streams, prompts))]
    created = int(time.time())
    if req.stream:
        return _stream(ctx, req, response_id, created, choices, echoes, record, num_prompt_tokens)
    work = _complete(ctx, req, response_id, created, choices, echoes, record, num_prompt_tokens)
    return await until_disconnected(raw, work)


async def _complete(ctx, req, response_id, created, choices, echoes, record, num_prompt_tokens) -> CompletionResponse:
    results = await collect(choices, record)
    return CompletionResponse(
        id=response_id,
        created=created,
        model=req.model,
        system_fingerprint=ctx.system_fingerprint,
        choices=[
            CompletionChoice(
                index=c.index,
                text=echoes[c.index] + "".join(results[c.index].text),
                logprobs=legacy_logprobs(ctx, results[c.index].tokens, len(echoes[c.index]))
                if c.want_logprobs
                else None,
                finish_reason=results[c.index].finish_reason,
            )
            for c in choices
        ],
        usage=usage_of(choices, num_prompt_tokens),
    )


def _stream(ctx, req, response_id, created, choices: list[Choice], echoes, record, num_prompt_tokens) -> SSEResponse:
    chunk = chunk_encoder(CompletionResponse, ctx, req, response_id, created)

    def render(update: ChoiceUpdate | None, usage: Usage | None) -> bytes:
        if update is None:
            return chunk([], usage)
        choice = choices[update.index]
        offset = len(echoes[update.index]) if req.echo else 0
        logprobs = legacy_logprobs(ctx, update.tokens, offset) if choice.want_logprobs else None
        item = CompletionChoice(
            index=update.index, text=update.text, logprobs=logprobs, finish_reason=update.finish_reason
        )
        return chunk([item], usage)

    _, continuous = stream_flags(req)
    opening_usage = usage_of(choices, num_prompt_tokens) if continuous else None
    opening = [chunk([CompletionChoice(index=i, text=text)], opening_usage) for i, text in enumerate(echoes) if text]
    body = sse_stream(choices, record, opening, render, req, num_prompt_tokens)
    return SSEResponse(body, choices, ctx.shutdown_timeout)
