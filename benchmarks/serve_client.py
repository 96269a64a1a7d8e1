"""serve_bench's client side: the prompt sets, one request's body, and a streamed request timed
chunk by chunk (TTFT, inter-token gaps, the usage the server attaches). Shared by every
benchmark that talks HTTP to a server (serve_bench, prefix_bench, loop_bench, replica_bench)."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks import public_sets
from benchmarks.peers import Peer

PROMPT_SET_DIR = Path(__file__).resolve().parent / "prompt_sets"
MODES = {"off": False, "on": True, "auto": None}  # None: no `speculation` field


# -- prompts -----------------------------------------------------------------------


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str


def load_prompts(names: list[str]) -> list[Prompt]:
    """Prompts of each set (a name under prompt_sets/, a public set of `benchmarks.public_sets`,
    or a .jsonl path), interleaved set by set."""
    sets = []
    for name in names:
        if name in public_sets.PUBLIC_SETS:
            sets.append([Prompt(i, text) for i, text in public_sets.load(name)])
            continue
        path = Path(name) if name.endswith(".jsonl") else PROMPT_SET_DIR / f"{name}.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        sets.append([Prompt(str(row["id"]), row["prompt"]) for row in rows])
    return [p for group in itertools.zip_longest(*sets) for p in group if p is not None]


# -- one request -------------------------------------------------------------------


@dataclass
class RequestResult:
    prompt_id: str
    start: float
    max_tokens: int = 0  # what the request asked for
    end: float = 0.0
    ok: bool = False
    error: str | None = None
    chunk_times: list[float] = field(default_factory=list)  # chunks that carried tokens
    chunk_tokens: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_accepted: int = 0  # usage.completion_tokens_details
    num_rejected: int = 0
    finish_reason: str | None = None
    text: str = ""  # the reply (a multi-turn client sends it back)


def request_body(
    model: str,
    prompt: Prompt,
    mode: str,
    max_tokens: int,
    cache_salt: str | None = None,
    ignore_eos: bool = True,
    peer: Peer | None = None,
) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt.text}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    if peer is not None:
        if not peer.takes_specd_fields:  # plain OpenAI: transformers serve refuses fields it does not know
            del body["ignore_eos"], body["stream_options"]
        return body
    if MODES[mode] is not None:
        body["speculation"] = MODES[mode]
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    return body


async def send(client: httpx.AsyncClient, body: dict, result: RequestResult) -> None:
    """Stream one chat completion into `result`; errors become `result.error`."""
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                body_text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body_text[:300]}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    result.ok = result.error is None
                    break
                on_chunk(json.loads(data), time.perf_counter(), result)
            else:  # a server that ends the stream without [DONE] (transformers serve) but finished the choice
                result.ok = result.error is None and result.finish_reason is not None
    except asyncio.CancelledError:
        result.error = "cancelled at the time limit"
        raise
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        result.end = time.perf_counter()


def on_chunk(chunk: dict, now: float, result: RequestResult) -> None:
    if "error" in chunk:
        result.error = str(chunk["error"].get("message"))
        return
    usage = chunk.get("usage")
    for choice in chunk.get("choices") or []:
        result.finish_reason = choice.get("finish_reason") or result.finish_reason
        result.text += (choice.get("delta") or {}).get("content") or ""
    if chunk.get("choices"):
        if usage:
            num_new = usage["completion_tokens"] - result.num_output_tokens
        else:  # a server without continuous usage: one token per chunk with text
            num_new = int(any((c.get("delta") or {}).get("content") for c in chunk["choices"]))
        if num_new > 0:
            result.chunk_times.append(now)
            result.chunk_tokens.append(num_new)
            result.num_output_tokens += num_new
    if usage:
        details = usage.get("completion_tokens_details") or {}
        result.num_prompt_tokens = usage.get("prompt_tokens", 0)
        result.num_output_tokens = usage["completion_tokens"]
        result.num_accepted = details.get("accepted_prediction_tokens", 0)
        result.num_rejected = details.get("rejected_prediction_tokens", 0)


async def timed_send(client: httpx.AsyncClient, body: dict, prompt_id: str, results: list[RequestResult]) -> None:
    result = RequestResult(prompt_id, time.perf_counter(), body.get("max_tokens", 0))
    results.append(result)
    await send(client, body, result)
