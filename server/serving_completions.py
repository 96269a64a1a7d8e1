"""POST /v1/completions: prompts as text or token ids, echo, legacy logprobs."""

from __future__ import annotations

import json
from dataclasses import dataclass

from fastapi import Request as HTTPRequest
from fastapi.responses import Response

from scheduler.types import TokenConstraint
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
    MAX_CHOICES,
    CompletionChoice,
    CompletionChunkChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    ResponseHead,
    Usage,
)
from server.record import request_record
from server.serving import (
    ServingContext,
    aborted_on_error,
    check_stream_options,
    check_token_ids,
    grammar_source,
    sampling_params,
    submit_all,
    until_disconnected,
)

ENDPOINT = "/v1/completions"


@dataclass
class CompletionGeneration(Generation):
    """A text completion in flight; `echoes[i]` is the prompt text choice i repeats (`echo`), else ''."""

    echoes: list[str]


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


def given_prompts(req: CompletionRequest) -> list:
    """`prompt` as a list: of texts, of token-id lists, or of token ids (one prompt)."""
    return [req.prompt] if isinstance(req.prompt, str) or not req.prompt else req.prompt


def check_prompt_count(prompts: list, n: int = 1) -> None:
    """400 for more than `MAX_CHOICES` sequences (prompts x n), judged before any per-prompt work:
    generation and render alike (a body of a million empty prompts must cost nothing)."""
    if not isinstance(prompts[0], int) and len(prompts) * n > MAX_CHOICES:
        raise BadRequestError(
            f"at most {MAX_CHOICES} sequences (prompts x n) per request, got {len(prompts)} prompts"
            + (f" x n={n}" if n > 1 else ""),
            param="n" if n > 1 and len(prompts) <= MAX_CHOICES else "prompt",
        )


def check_prompt_sizes(ctx: ServingContext, prompts: list) -> None:
    """400 for a prompt that cannot fit the context, judged by its length alone: text before it is
    tokenized, token ids before any id is looked at (on the event loop, so never one by one)."""
    for item in [prompts] if isinstance(prompts[0], int) else prompts:
        if isinstance(item, str):
            ctx.check_text_size(len(item), "prompt")
        elif len(item) >= ctx.max_model_len:
            raise BadRequestError(
                f"this model's maximum context length is {ctx.max_model_len} tokens, but the prompt has "
                f"{len(item)} tokens",
                param="prompt",
                code="context_length_exceeded",
            )


async def render_completion(ctx: ServingContext, req: CompletionRequest, raw: HTTPRequest) -> Response:
    """POST /v1/completions/render: each prompt's token ids, nothing generated (vLLM's shape).
    Encoded on the preparation thread too: no response model walks the ids on the event loop."""
    ctx.check_model(req.model)
    prompts = given_prompts(req)
    check_prompt_count(prompts)
    check_prompt_sizes(ctx, prompts)
    body = await ctx.off_loop(raw, _rendered, ctx, req)
    return Response(body, media_type="application/json")


def _rendered(ctx: ServingContext, req: CompletionRequest) -> bytes:
    prompt_ids, _ = tokenize_prompts(ctx, req)
    return json.dumps([{"token_ids": ids} for ids in prompt_ids], separators=(",", ":")).encode()


async def create_completion(ctx: ServingContext, req: CompletionRequest, raw: HTTPRequest) -> Response:
    ctx.check_model(req.model)
    check_stream_options(req)
    check_unsupported(req)
    prompts_given = given_prompts(req)
    check_prompt_count(prompts_given, req.n)
    check_prompt_sizes(ctx, prompts_given)
    grammar = grammar_source(req)
    if grammar is not None:  # compiled before the prompts are tokenized: a bad grammar costs nothing more
        await ctx.off_loop(raw, ctx.grammars.compile, grammar)
    prompt_ids, prompt_texts = await ctx.off_loop(raw, tokenize_prompts, ctx, req)
    if len(prompt_ids) * req.n > MAX_CHOICES:
        raise BadRequestError(f"at most {MAX_CHOICES} sequences (prompts x n) per request", param="n")
    constraints: list[TokenConstraint] | None = None
    if grammar is not None:
        constraints = list(await ctx.off_loop(raw, ctx.grammars.states, grammar, len(prompt_ids) * req.n))

    prompts, params = [], []
    for ids in prompt_ids:
        max_tokens = req.max_tokens or max(1, ctx.max_model_len - len(ids))
        for j in range(req.n):
            prompts.append(ids)
            params.append(sampling_params(ctx, req, max_tokens=max_tokens, logprobs=req.logprobs, choice=j))
    echoes = [prompt_texts[i // req.n] if req.echo else "" for i in range(len(prompts))]

    record = request_record(raw)
    head = ResponseHead.new("cmpl", req.model, ctx.system_fingerprint)
    num_prompt_tokens = sum(len(ids) for ids in prompt_ids)
    record.request_id, record.stream, record.n, record.prompt_tokens = (
        head.id,
        req.stream,
        len(prompts),
        num_prompt_tokens,
    )
    tenant = request_tenant(raw.scope)
    streams = submit_all(
        ctx, head.id, prompts, params, tenant=tenant, cache_salt=req.cache_salt, constraints=constraints
    )
    with aborted_on_error(streams):
        choices = [Choice(i, s, ctx.tokenizer, req, ids) for i, (s, ids) in enumerate(zip(streams, prompts))]
        on_finish = None
        if ctx.traffic:
            texts = [t or ctx.tokenizer.decode(ids) for t, ids in zip(prompt_texts, prompt_ids)]  # ids: as text
            prompt = {"prompt": texts[0] if len(texts) == 1 else texts}
            on_finish = ctx.traffic.recorder(ENDPOINT, head.id, tenant, prompt)
        gen = CompletionGeneration(head, req, choices, record, num_prompt_tokens, echoes, on_finish=on_finish)
        if req.stream:
            return _stream(ctx, gen)
    return await until_disconnected(raw, _complete(ctx, gen))


async def _complete(ctx: ServingContext, gen: CompletionGeneration) -> CompletionResponse:
    results = await collect(gen)
    echoes = gen.echoes
    return CompletionResponse(
        **gen.head.fields(),
        choices=[
            CompletionChoice(
                index=c.index,
                text=echoes[c.index] + "".join(results[c.index].text),
                logprobs=legacy_logprobs(ctx, results[c.index].tokens, len(echoes[c.index]))
                if c.want_logprobs
                else None,
                finish_reason=results[c.index].finish_reason,
            )
            for c in gen.choices
        ],
        usage=gen.usage(),
    )


def _stream(ctx: ServingContext, gen: CompletionGeneration) -> SSEResponse:
    choices, echoes = gen.choices, gen.echoes
    chunk = chunk_encoder(CompletionResponse, gen.head)

    def render(update: ChoiceUpdate | None, usage: Usage | None) -> bytes:
        if update is None:
            return chunk([], usage)
        choice = choices[update.index]
        offset = len(echoes[update.index])  # '' without `echo`
        logprobs = legacy_logprobs(ctx, update.tokens, offset) if choice.want_logprobs else None
        item = CompletionChunkChoice(
            index=update.index,
            text=update.text,
            logprobs=logprobs,
            finish_reason=update.finish_reason,
            speculation=update.speculation,
        )
        return chunk([item], usage)

    _, continuous = stream_flags(gen.req)
    opening_usage = gen.usage() if continuous else None
    opening = [chunk([CompletionChoice(index=i, text=text)], opening_usage) for i, text in enumerate(echoes) if text]
    return SSEResponse(sse_stream(gen, opening, render), choices, ctx.shutdown_timeout)
