"""The app in process: loading state, auth on /metrics, CORS, the playground page, an engine that dies."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from server.app import create_app
from server.config import Settings
from server.playground import playground_page


def client_for(**settings) -> httpx.AsyncClient:
    app = create_app(Settings(model="unused", **settings))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1")


async def test_health_is_up_while_ready_and_generation_wait_for_the_model():
    async with client_for() as http:
        assert (await http.get("/health")).status_code == 200
        ready = await http.get("/ready")
        assert ready.status_code == 503 and ready.json() == {"status": "loading"}
        reply = await http.post("/v1/completions", json={"model": "unused", "prompt": "hi"})
        assert reply.status_code == 503 and reply.headers["retry-after"] == "1"
        assert reply.json()["error"]["code"] == "model_loading"
        assert (await http.get("/v1/models")).status_code == 503
        assert "specd_requests_running" in (await http.get("/metrics")).text


@pytest.mark.parametrize("metrics_auth, status", [(False, 200), (True, 401)])
async def test_metrics_auth(metrics_auth, status):
    async with client_for(api_key="k" * 8, metrics_auth=metrics_auth) as http:
        assert (await http.get("/metrics")).status_code == status
        assert (await http.get("/metrics", headers={"Authorization": "Bearer " + "k" * 8})).status_code == 200
        assert (await http.get("/health")).status_code == 200
        assert (await http.get("/v1/models")).status_code == 401


async def test_cors_preflight_needs_no_key():
    async with client_for(api_key="k" * 8, allowed_origins="http://ui.example") as http:
        preflight = await http.options(
            "/v1/chat/completions",
            headers={
                "Origin": "http://ui.example",
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization,content-type",
            },
        )
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "http://ui.example"
        other = await http.get("/health", headers={"Origin": "http://evil.example"})
        assert "access-control-allow-origin" not in other.headers


@pytest.mark.parametrize("path", ["/", "/playground"])
async def test_playground_page_is_served_without_a_key(path):
    async with client_for(api_key="k" * 8) as http:
        page = await http.get(path)
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "connect-src 'self'" in page.headers["content-security-policy"]
        assert "<title>specd playground</title>" in page.text
        assert "/v1/chat/completions" in page.text and "include_speculation" in page.text
        assert (await http.get("/v1/models")).status_code == 401  # the API it calls still needs the key


def test_playground_page_is_self_contained_and_small():
    page = playground_page()
    assert len(page.encode()) < 24_000
    assert not re.search(r"""(src|href)\s*=|@import|url\(|https?://""", page)  # nothing loaded from anywhere


async def test_no_playground_leaves_the_root_unrouted():
    async with client_for(playground=False) as http:
        for path in ("/", "/playground"):
            reply = await http.get(path)
            assert reply.status_code == 404 and reply.json()["error"]["code"] == "not_found"


async def test_an_engine_that_dies_fails_its_requests_reports_dead_and_asks_to_exit(tiny_llama_dir, caplog):
    """The engine loop's own fault (not one request's step): the request in flight gets a
    500 (the reason goes to the log, not to the client), new requests a 503 `engine_dead`,
    /health and /ready 503 without the reason, and the CLI's on_fatal is called so the
    process exits 1 for a supervisor to restart."""
    exits: list[bool] = []
    app = create_app(Settings(model=str(tiny_llama_dir), dtype="float32"), on_fatal=lambda: exits.append(True))
    state = app.state.specd
    await state.start_engine()  # what the lifespan does, in this test's loop
    try:

        def broken_update(*args, **kwargs):
            raise RuntimeError("free list corrupted")

        state.engine.scheduler.update = broken_update
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as http:
            body = {"model": str(tiny_llama_dir), "prompt": "Hello", "max_tokens": 8}
            failed = await http.post("/v1/completions", json=body)
            assert failed.status_code == 500 and failed.json()["error"]["code"] == "engine_error"
            assert "corrupted" not in failed.text and "free list corrupted" in caplog.text
            assert exits == [True]
            refused = await http.post("/v1/completions", json=body)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_dead"
            for path in ("/health", "/ready"):
                probe = await http.get(path)
                assert probe.status_code == 503 and probe.json() == {"status": "engine_dead"}
    finally:
        await state.stop_engine()


async def test_the_grammar_tokenizer_is_built_before_the_server_is_ready(tiny_llama_dir):
    """Built by the first structured request instead, it held the GIL for 0.4-1.5 s: every
    tenant's streams and /health stalled (found by the hostile-client test)."""
    app = create_app(Settings(model=str(tiny_llama_dir), dtype="float32"))
    state = app.state.specd
    await state.start_engine()
    try:
        assert state.serving is not None and state.serving.grammars._tokenizer is not None
    finally:
        await state.stop_engine()


def compact(body: dict) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


MIB4 = 4 * 1024 * 1024
JSON_HEADERS = {"content-type": "application/json"}


@pytest.mark.parametrize(
    "path, prompt",
    [
        ("/v1/completions", [0] * (MIB4 // 2 - 32)),  # ~2M token ids
        ("/v1/completions/render", [""] * (MIB4 // 3 - 32)),  # ~1.4M prompts
        ("/v1/completions", [[0]] * (MIB4 // 4 - 32)),  # ~1M token-id lists
    ],
    ids=["2M-ids", "1.4M-prompts", "1M-id-lists"],
)
async def test_a_body_of_millions_of_values_is_refused_before_it_is_parsed(path, prompt):
    """At the shipped body limit: 413 from the bytes alone, before the route would parse the JSON and
    answer 503 (no model loads here), so no parser or validator walks a million values."""
    body = compact({"model": "unused", "prompt": prompt})
    assert len(body) <= MIB4
    async with client_for() as http:
        reply = await http.post(path, content=body, headers=JSON_HEADERS)
        assert reply.status_code == 413, reply.text
        error = reply.json()["error"]
        assert error["code"] == "request_too_large" and "JSON" in error["message"]


async def test_a_body_that_fits_the_context_is_never_refused_for_its_values():
    """128 prompts of 2047 token ids each (the most a request may carry at the default context), and
    text full of commas and brackets, pass the count (then meet the loading model's 503)."""
    prompts = [[1] * 2047 for _ in range(128)]
    text = "f(a, [b], {c}), " * 2000
    async with client_for() as http:
        for body in ({"model": "unused", "prompt": prompts}, {"model": "unused", "prompt": text}):
            reply = await http.post("/v1/completions", content=compact(body), headers=JSON_HEADERS)
            assert reply.status_code == 503 and reply.json()["error"]["code"] == "model_loading"
