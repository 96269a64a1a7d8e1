"""Many clients at once: batched results equal sequential ones; disconnects free everything."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import openai
import pytest

PROMPTS = [f"Request number {i}: the quick brown fox" for i in range(20)]


async def test_20_concurrent_streams_equal_one_by_one(tiny_server, model):
    client = openai.AsyncOpenAI(base_url=tiny_server.base_url, api_key="unused", max_retries=0, timeout=300)

    async def stream(prompt: str) -> str:
        chunks = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=12,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])

    one_by_one = [await stream(p) for p in PROMPTS]
    together = await asyncio.gather(*(stream(p) for p in PROMPTS))
    assert together == one_by_one
    assert len(set(one_by_one)) > 1  # the prompts really differ


async def test_20_clients_disconnecting_mid_stream(tiny_server, model):
    aborted_before = tiny_server.metrics().value("specd_requests_total", finish_reason="abort")
    body = {"model": model, "prompt": "Hello", "max_tokens": 400, "ignore_eos": True, "stream": True}

    async def leave_early(http: httpx.AsyncClient) -> int:
        async with http.stream("POST", "/completions", json=body) as response:
            events = 0
            async for line in response.aiter_lines():
                events += line.startswith("data: ")
                if events == 3:
                    return events  # closing the response drops the connection
        return events

    async with httpx.AsyncClient(base_url=tiny_server.base_url, timeout=120) as http:
        assert await asyncio.gather(*(leave_early(http) for _ in range(20))) == [3] * 20
    tiny_server.wait_idle(timeout=60)
    info = httpx.get(tiny_server.base_url + "/speculation").json()
    assert info["requests_running"] == info["requests_waiting"] == 0
    assert info["kv_cache_usage"] == 0
    assert tiny_server.metrics().value("specd_kv_cache_usage_ratio") == 0
    assert tiny_server.metrics().value("specd_requests_running") == 0
    assert tiny_server.metrics().value("specd_requests_total", finish_reason="abort") == aborted_before + 20
    assert "status=499 stream=true" in tiny_server.log()
    reply = httpx.post(
        tiny_server.base_url + "/completions", json={"model": model, "prompt": "Hi", "max_tokens": 2}, timeout=60
    )
    assert reply.status_code == 200


def test_non_stream_client_disconnect_aborts(tiny_server, model):
    aborted_before = tiny_server.metrics().value("specd_requests_total", finish_reason="abort")
    body = {"model": model, "prompt": "Hello", "max_tokens": 500, "ignore_eos": True, "n": 4}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(tiny_server.base_url + "/completions", json=body, timeout=httpx.Timeout(60, read=0.3))
    tiny_server.wait_idle(timeout=60)
    assert tiny_server.metrics().value("specd_requests_total", finish_reason="abort") == aborted_before + 4


def test_request_log_line(tiny_server, model):
    httpx.post(
        tiny_server.base_url + "/completions", json={"model": model, "prompt": "log me", "max_tokens": 3}, timeout=60
    )
    deadline = time.monotonic() + 10
    pattern = re.compile(
        r"specd\.request: id=cmpl-\w+ endpoint=/v1/completions status=200 stream=false n=1 prompt_tokens=\d+ "
        r"completion_tokens=\d+ ttft_s=[\d.]+ e2e_s=[\d.]+ spec_accepted=\d+ spec_drafted=\d+ finish_reason=\w+"
    )
    while not pattern.search(tiny_server.log()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pattern.search(tiny_server.log())
    assert "GET /metrics" not in tiny_server.log()  # no access log by default
