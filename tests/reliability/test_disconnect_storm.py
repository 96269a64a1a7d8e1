"""Disconnect storm: 200 streaming requests hung up at random points (mid-body,
before any reply, after the headers, after k events; FIN or RST; queued, in
prefill, mid-speculation) while control streams run beside them. Afterwards
nothing runs, no KV is held, no per-request state or asyncio task is left
behind, and a fresh request is served exactly."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import httpx

from tests.reliability.rel_harness import CYCLE_NAME, cut_stream, leaked_bookkeeping, sse_events, stream_text
from tests.support.cycle import CYCLE_TEXT

NUM_CUT = 200
NUM_CONTROL = 12
IN_FLIGHT = 32
SEED = 20261129


def storm_plan(rng: random.Random) -> list[dict]:
    plan = []
    for _ in range(NUM_CUT):
        speculation = rng.choice([True, True, False, "auto", "auto"])
        chat = rng.random() < 0.4
        cut = rng.choices(["mid_body", "after_request", "after_headers", "after_events"], [1, 2, 2, 7])[0]
        body = {"model": CYCLE_NAME, "max_tokens": 300, "stream": True, "speculation": speculation}
        if chat:
            body["messages"] = [{"role": "user", "content": CYCLE_TEXT * 3 if speculation is True else "go"}]
        else:
            body["prompt"] = CYCLE_TEXT * 4 if speculation is True else rng.choice(["\n", "\nAb", CYCLE_TEXT])
        plan.append(
            {
                "path": "/v1/chat/completions" if chat else "/v1/completions",
                "body": body,
                "cut": cut,
                "after_events": rng.randint(1, 25),
                "reset": rng.random() < 0.3,
            }
        )
    return plan


async def control_stream(http: httpx.AsyncClient, index: int, cycle_text) -> bool:
    """A stream nobody cuts: it must finish with exactly the cycle's text."""
    prompt = ["\n", "\nAb", CYCLE_TEXT * 2][index % 3]
    body = {"model": CYCLE_NAME, "prompt": prompt, "max_tokens": 40, "stream": True, "speculation": index % 2 == 0}
    response = await http.post("/completions", json=body)
    text, finishes, errors = stream_text(sse_events(response.text))
    return (
        response.status_code == 200
        and not errors
        and finishes == ["length"]
        and text == cycle_text.expected(prompt, 40)
    )


async def test_disconnect_storm_leaves_nothing_behind(chaos_server, cycle_text, tally):
    server = chaos_server
    async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers, timeout=60) as http:
        # Warm-up: the engine's step thread and sse-starlette's one shutdown watcher start lazily.
        assert await control_stream(http, 0, cycle_text)
    before = server.wait_idle()
    probe_before = server.probe()
    assert leaked_bookkeeping(probe_before) == {}
    rng = random.Random(SEED)
    plan = storm_plan(rng)
    gate = asyncio.Semaphore(IN_FLIGHT)

    async def cut_one(item: dict):
        async with gate:
            return await cut_stream(
                server.port,
                item["path"],
                item["body"],
                item["cut"],
                item["after_events"],
                server.headers,
                item["reset"],
            )

    async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers, timeout=300) as http:
        controls = [control_stream(http, i, cycle_text) for i in range(NUM_CONTROL)]
        outcomes = await asyncio.gather(*(cut_one(item) for item in plan), *controls)
    cuts, control_ok = outcomes[:NUM_CUT], outcomes[NUM_CUT:]
    tally.requests_cut += NUM_CUT

    kinds = Counter()
    for item, result in zip(plan, cuts):
        assert result.status in (None, 200), (item, result)
        if result.done:
            kinds["finished before its cut point"] += 1
        elif result.events == 0:
            kinds["cut before the first event"] += 1
        elif item["body"]["speculation"] is True:
            kinds["cut mid-stream, speculating"] += 1
        else:
            kinds["cut mid-stream"] += 1
        kinds["closed with RST"] += item["reset"]
    print(f"\ndisconnect storm ({NUM_CUT} cut, {NUM_CONTROL} control): {dict(kinds)}")
    assert kinds["cut before the first event"] >= 20 and kinds["cut mid-stream, speculating"] >= 20, kinds

    lost = control_ok.count(False)
    tally.requests_lost += lost
    assert lost == 0, "a control stream did not finish with the exact text"

    after = server.wait_idle(timeout=60)
    assert after.value("specd_requests_running") == 0 and after.value("specd_requests_waiting") == 0
    assert after.value("specd_kv_cache_usage_ratio") == 0

    def finished(reason: str) -> float:
        return after.value("specd_requests_total", finish_reason=reason) - before.value(
            "specd_requests_total", finish_reason=reason
        )

    assert finished("error") == 0
    # Every request that produced an event reached the engine and was then aborted (or finished).
    ended = finished("abort") + finished("length") + finished("stop")
    reached = sum(1 for r in cuts if r.events > 0)
    assert reached + NUM_CONTROL <= ended <= NUM_CUT + NUM_CONTROL, (reached, ended)
    accepted = "specd_spec_decode_num_accepted_tokens_total"
    assert after.value(accepted) > before.value(accepted)  # the storm did cut speculating rows

    probe_after = server.probe()
    assert leaked_bookkeeping(probe_after) == {}, probe_after
    assert probe_after["tasks"] <= probe_before["tasks"], (probe_before["task_names"], probe_after["task_names"])
    assert probe_after["threads"] <= probe_before["threads"], (
        probe_before["thread_names"],
        probe_after["thread_names"],
    )
    assert probe_after["engine_running"]

    async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers, timeout=60) as http:
        assert await control_stream(http, 0, cycle_text)
        reply = await http.post("/completions", json={"model": CYCLE_NAME, "prompt": "\n", "max_tokens": 9})
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == cycle_text.expected("\n", 9)
