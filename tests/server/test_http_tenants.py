"""Tenants come from API keys (`--api-keys`): one tenant's prompts and outputs can neither
raise another's `cached_tokens` nor its suffix-decoding acceptance, whatever the body says."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest

from tests.support.metrics import wait_idle
from tests.support.server import finish_server, serve_args, start_server

KEYS = {"alpha": "key-alpha-0123", "beta": "key-beta-4567"}


@pytest.fixture(scope="module")
def two_tenants(tiny_llama_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("tenants")
    keys = logs / "api-keys"
    keys.write_text("".join(f"{tenant} {key}\n" for tenant, key in KEYS.items()))
    keys.chmod(0o600)
    args = serve_args(
        model=tiny_llama_dir, served_model_name="m", dtype="float32", device="cpu", api_keys=keys,
        draft="suffix", num_speculative_tokens=4, spec_adaptive=False,
    )  # fmt: skip
    server = start_server(args, logs, "tenants")
    yield server
    finish_server(server)


def complete(server, tenant: str, prompt: str, **fields) -> tuple[str, int, int]:
    """(text, cached prompt tokens, accepted draft tokens) of one greedy streamed completion."""
    body = {
        "model": "m", "prompt": prompt, "max_tokens": 32, "temperature": 0, "ignore_eos": True, "stream": True,
        "speculation": True, "stream_options": {"include_usage": True, "include_speculation": True}, **fields,
    }  # fmt: skip
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
    text, cached, accepted = "", 0, 0
    with httpx.stream("POST", server.base_url + "/completions", json=body, headers=headers, timeout=60) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line.removeprefix("data: "))
            for choice in chunk["choices"]:
                text += choice["text"]
                accepted += (choice.get("speculation") or {}).get("accepted_tokens", 0)
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    # The stream ends with the last token; the engine files the finished output into the tenant's
    # suffix cache at its next step. Wait for that, so the next request sees it.
    wait_idle(server.url, headers)
    return text, cached, accepted


@pytest.mark.parametrize("fields", [{}, {"user": "alpha"}, {"cache_salt": "shared"}], ids=["plain", "user", "salt"])
def test_another_key_cannot_raise_cached_tokens_or_acceptance(two_tenants, fields):
    # Within one tenant both caches pay: the test can see a leak. Where the tiny model's reply to a
    # prompt repeats itself from its first tokens, a cold request already accepts every draft it
    # can (24 of 32 tokens at K = 4) and the cache cannot show: another prompt is tried.
    for _ in range(5):
        prompt = f"Ticket {uuid.uuid4().hex}: " + "the quick brown fox jumps over the lazy dog and then " * 6
        cold_text, cold_cached, cold_accepted = complete(two_tenants, "alpha", prompt, **fields)
        warm_text, warm_cached, warm_accepted = complete(two_tenants, "alpha", prompt, **fields)
        assert cold_cached == 0 and warm_cached > 0 and warm_text == cold_text
        if warm_accepted > cold_accepted:
            break
    assert warm_accepted > cold_accepted, "no prompt left the suffix cache room to raise acceptance"
    # Another key with the very same body (naming alpha as its user, or alpha's salt): exactly
    # what a cold first request gets.
    assert complete(two_tenants, "beta", prompt, **fields) == (cold_text, 0, cold_accepted)


def test_a_salt_narrows_sharing_within_a_tenant(two_tenants):
    prompt = f"Note {uuid.uuid4().hex}: " + "one two three four five six seven eight nine ten " * 6
    complete(two_tenants, "alpha", prompt, cache_salt="team-1")
    assert complete(two_tenants, "alpha", prompt, cache_salt="team-1")[1] > 0
    assert complete(two_tenants, "alpha", prompt, cache_salt="team-2")[1] == 0
    assert complete(two_tenants, "alpha", prompt)[1] == 0  # no salt: the tenant's common scope


def test_a_key_file_key_is_required(two_tenants):
    reply = httpx.get(two_tenants.base_url + "/models", headers={"Authorization": "Bearer key-gamma-0000"})
    assert reply.status_code == 401
    reply = httpx.get(two_tenants.base_url + "/models", headers={"Authorization": f"Bearer {KEYS['beta']}"})
    assert reply.status_code == 200
