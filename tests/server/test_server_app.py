"""The app without a model (its lifespan never runs): loading state, auth on /metrics, CORS, the playground page."""

from __future__ import annotations

import re

import httpx
import pytest

from server.app import create_app
from server.config import Settings
from server.playground import playground_page


def client_for(**settings) -> httpx.AsyncClient:
    app = create_app(Settings(model="unused", **settings))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://specd")


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
    async with client_for(api_key="k", metrics_auth=metrics_auth) as http:
        assert (await http.get("/metrics")).status_code == status
        assert (await http.get("/metrics", headers={"Authorization": "Bearer k"})).status_code == 200
        assert (await http.get("/health")).status_code == 200
        assert (await http.get("/v1/models")).status_code == 401


async def test_cors_preflight_needs_no_key():
    async with client_for(api_key="k", allowed_origins="http://ui.example") as http:
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
    async with client_for(api_key="k") as http:
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
