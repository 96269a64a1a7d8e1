"""Overload: bursts of 10x --max-queue requests against two slots and a queue of
four. The excess get 503 + Retry-After at once, every admitted request finishes
with the exact text, memory stays flat across bursts, and the server returns to
its idle latency."""

from __future__ import annotations

import asyncio
import statistics
import time

import httpx
import pytest

from tests.reliability.rel_harness import (
    CYCLE_NAME,
    OVERLOAD_MAX_NUM_SEQS,
    OVERLOAD_MAX_QUEUE,
    leaked_bookkeeping,
    sse_events,
    stream_text,
)

BURST = 10 * OVERLOAD_MAX_QUEUE
NUM_BURSTS = 3
ADMITTED_TOKENS = 100  # long enough that the whole burst arrives while the first ones run


def request_for(index: int) -> tuple[str, dict]:
    stream = index % 2 == 1
    if index % 3 == 0:
        body = {"messages": [{"role": "user", "content": "go"}]}
        path = "/chat/completions"
    else:
        body = {"prompt": "\nAb"}
        path = "/completions"
    return path, {"model": CYCLE_NAME, "max_tokens": ADMITTED_TOKENS, "speculation": False, "stream": stream, **body}


async def timed(http: httpx.AsyncClient, path: str, body: dict) -> tuple[httpx.Response, float]:
    start = time.perf_counter()
    response = await http.post(path, json=body)
    return response, time.perf_counter() - start


def reply_text(path: str, body: dict, response: httpx.Response) -> str | None:
    """The whole text of a successful reply (None if it ended otherwise)."""
    if body["stream"]:
        text, finishes, errors = stream_text(sse_events(response.text))
        return text if finishes == ["length"] and not errors else None
    choice = response.json()["choices"][0]
    if choice["finish_reason"] != "length":
        return None
    return choice["text"] if path == "/completions" else choice["message"]["content"]


async def reference_latency(http: httpx.AsyncClient) -> float:
    """Median of three short requests, after one unmeasured (first-run work)."""
    samples = []
    for _ in range(4):
        response, seconds = await timed(http, "/completions", {"model": CYCLE_NAME, "prompt": "\n", "max_tokens": 20})
        assert response.status_code == 200
        samples.append(seconds)
    return statistics.median(samples[1:])


@pytest.mark.slow
async def test_bursts_are_shed_at_once_and_admitted_requests_finish_exactly(overload_server, cycle_text, tally):
    server = overload_server
    expected = {
        "/completions": cycle_text.expected("\nAb", ADMITTED_TOKENS),
        "/chat/completions": cycle_text.expected_chat(ADMITTED_TOKENS),
    }
    limits = httpx.Limits(max_connections=BURST + 4, max_keepalive_connections=BURST + 4)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=300, limits=limits) as http:
        idle_latency = await reference_latency(http)
        rss_before = server.proc_status()["rss"]
        shed_latencies, admitted_latencies, num_admitted, lost = [], [], 0, 0
        for _ in range(NUM_BURSTS):
            plan = [request_for(i) for i in range(BURST)]
            results = await asyncio.gather(*(timed(http, path, body) for path, body in plan))
            for (path, body), (response, seconds) in zip(plan, results):
                if response.status_code == 503:
                    assert response.headers["retry-after"] == "1"
                    error = response.json()["error"]
                    assert error["code"] == "queue_full" and error["type"] == "service_unavailable_error", error
                    shed_latencies.append(seconds)
                elif response.status_code == 200:
                    num_admitted += 1
                    admitted_latencies.append(seconds)
                    lost += reply_text(path, body, response) != expected[path]
                else:
                    lost += 1
            server.wait_idle()
        rss_after = server.proc_status()["rss"]
        recovered_latency = await reference_latency(http)

    tally.requests_shed += len(shed_latencies)
    tally.requests_lost += lost
    growth = (rss_after - rss_before) / rss_before
    print(
        f"\noverload: {NUM_BURSTS} bursts of {BURST} (queue {OVERLOAD_MAX_QUEUE}, slots {OVERLOAD_MAX_NUM_SEQS}): "
        f"{num_admitted} admitted, {len(shed_latencies)} shed; 503 latency max {max(shed_latencies) * 1000:.0f} ms; "
        f"admitted latency max {max(admitted_latencies):.2f} s; "
        f"RSS {rss_before / 2**20:.0f} -> {rss_after / 2**20:.0f} MiB "
        f"({growth * 100:+.1f}%); idle latency {idle_latency * 1000:.0f} ms -> {recovered_latency * 1000:.0f} ms"
    )
    assert lost == 0, "an admitted request did not finish with the exact text"
    # A whole burst can arrive before the engine moves anyone from the queue to a slot.
    assert num_admitted >= NUM_BURSTS * OVERLOAD_MAX_QUEUE
    assert len(shed_latencies) >= NUM_BURSTS * BURST // 2
    # No hang: every refusal came back while admitted work of the same burst was still running.
    assert max(shed_latencies) < max(admitted_latencies)
    assert growth < 0.10, f"RSS grew {growth * 100:.1f}% over {NUM_BURSTS} bursts"
    assert recovered_latency < 3 * idle_latency + 0.25, (idle_latency, recovered_latency)
    metrics = server.wait_idle()
    assert metrics.value("specd_kv_cache_usage_ratio") == 0
    assert leaked_bookkeeping(server.probe()) == {}
