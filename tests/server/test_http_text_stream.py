"""Exact text through the cycle model: multi-byte streams, stop strings across chunks,
Predicted Outputs, logprob bytes; plus API keys and queue back-pressure on that server."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tests.support.server import API_KEY

CHAT = [{"role": "user", "content": "go"}]  # the chat template ends in "\n": the cycle goes on with "A"


@pytest.fixture(scope="module")
def client(cycle_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=cycle_server.base_url, api_key=API_KEY, max_retries=0, timeout=120)


def stream_chat(client, **kwargs) -> tuple[list[str], str | None]:
    deltas, finish = [], None
    for chunk in client.chat.completions.create(model="cycle", messages=CHAT, stream=True, **kwargs):
        if chunk.choices:
            if chunk.choices[0].delta.content:
                deltas.append(chunk.choices[0].delta.content)
            finish = chunk.choices[0].finish_reason or finish
    return deltas, finish


@pytest.mark.parametrize("speculation", [False, True])
def test_multibyte_characters_are_never_split(client, cycle_text, speculation):
    deltas, finish = stream_chat(client, max_tokens=40, extra_body={"speculation": speculation})
    assert finish == "length"
    assert "".join(deltas) == cycle_text.chars(len("".join(deltas)))
    assert "😀" in "".join(deltas) and "日" in "".join(deltas)
    assert all("\ufffd" not in d for d in deltas)
    if not speculation:
        assert len(deltas) < 40  # one token per step, but split characters wait for their last byte


@pytest.mark.parametrize("speculation", [False, True])
@pytest.mark.parametrize(
    "stop, expected",
    [
        (["😀 日"], "Ab"),  # spans 8 tokens
        (["é!\nA"], "Ab😀 日"),  # spans the cycle's wrap
        (["zzz", "b😀"], "A"),
        (["!\nAb😀 日é!\nAb"], "Ab😀 日é"),  # a stop string longer than one cycle
    ],
)
def test_stop_strings_across_chunks_are_never_sent(client, stop, expected, speculation):
    deltas, finish = stream_chat(client, max_tokens=60, stop=stop, extra_body={"speculation": speculation})
    assert "".join(deltas) == expected
    assert finish == "stop"
    reply = client.chat.completions.create(model="cycle", messages=CHAT, max_tokens=60, stop=stop)
    assert reply.choices[0].message.content == expected and reply.choices[0].finish_reason == "stop"


def test_partial_stop_match_is_released_at_the_end(client):
    # 10 tokens end exactly after "日"; the stop string "日X" never completes.
    deltas, finish = stream_chat(client, max_tokens=10, stop=["日X"], extra_body={"speculation": False})
    assert "".join(deltas) == "Ab😀 日" and finish == "length"


def test_include_stop_str_in_output(client):
    reply = client.completions.create(
        model="cycle", prompt="\n", max_tokens=40, stop=["日"], extra_body={"include_stop_str_in_output": True}
    )
    assert reply.choices[0].text == "Ab😀 日" and reply.choices[0].finish_reason == "stop"


def test_completion_stream_text_and_echo(client, cycle_text):
    chunks = list(client.completions.create(model="cycle", prompt="\n", max_tokens=26, stream=True, echo=True))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == "\n" + cycle_text.chars(len(text) - 1)
    assert chunks[0].choices[0].text == "\n"


def test_prediction_tokens_are_accepted(client, cycle_text):
    two_cycles = cycle_text.chars(16)  # 8 characters, 14 tokens per cycle
    reply = client.chat.completions.create(
        model="cycle",
        messages=CHAT,
        max_tokens=28,
        temperature=0,
        prediction={"type": "content", "content": two_cycles},
    )
    assert reply.choices[0].message.content == two_cycles
    details = reply.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0 and details.rejected_prediction_tokens == 0


def test_usage_reports_speculation_without_prediction(client):
    reply = client.completions.create(model="cycle", prompt="\n", max_tokens=40, extra_body={"speculation": True})
    details = reply.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0  # the n-gram proposer learns the cycle
    assert reply.usage.completion_tokens == 40


def test_logprob_bytes_spell_the_text(client):
    reply = client.chat.completions.create(model="cycle", messages=CHAT, max_tokens=13, logprobs=True, top_logprobs=2)
    content = reply.choices[0].logprobs.content
    assert b"".join(bytes(t.bytes) for t in content).decode() == reply.choices[0].message.content
    assert any(t.token == "\ufffd" for t in content)  # a token that holds part of a character
    assert all(t.logprob > -1e-3 and t.top_logprobs[0].logprob == pytest.approx(t.logprob) for t in content)


def test_served_model_aliases_and_fault_field_ignored(client):
    assert [m.id for m in client.models.list().data] == ["cycle", "cycle-alias"]
    reply = client.completions.create(model="cycle-alias", prompt="\n", max_tokens=3, extra_body={"fault": "raise"})
    assert reply.model == "cycle-alias" and reply.choices[0].finish_reason == "length"
    assert reply.choices[0].text == "Ab\ufffd"  # 3 tokens end inside the emoji


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}])
def test_api_key_is_required_on_v1(cycle_server, headers):
    for method, path in (("GET", "/models"), ("POST", "/chat/completions"), ("GET", "/speculation")):
        response = httpx.request(method, cycle_server.base_url + path, headers=headers, json={})
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
        assert response.headers["www-authenticate"] == "Bearer"
    assert httpx.get(cycle_server.url + "/health").status_code == 200
    # With a key configured, /metrics needs it too unless --no-metrics-auth says otherwise.
    assert httpx.get(cycle_server.url + "/metrics", headers=headers).status_code == 401
    assert httpx.get(cycle_server.url + "/metrics", headers=cycle_server.headers).status_code == 200


def test_sdk_with_a_bad_key_raises(cycle_server):
    bad = openai.OpenAI(base_url=cycle_server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


async def test_queue_full_is_503_with_retry_after_then_recovers(cycle_server):
    # One running, one waiting: the rest of the flood must be refused while the first runs 300 steps.
    body = {"model": "cycle", "prompt": "\n", "max_tokens": 300, "ignore_eos": True, "speculation": False}
    async with httpx.AsyncClient(base_url=cycle_server.base_url, headers=cycle_server.headers, timeout=120) as http:
        responses = await asyncio.gather(*(http.post("/completions", json=body) for _ in range(8)))
        statuses = sorted(r.status_code for r in responses)
        assert statuses.count(200) >= 1 and statuses.count(503) >= 1, statuses
        assert set(statuses) <= {200, 503}
        for response in responses:
            if response.status_code == 503:
                assert response.headers["retry-after"] == "1"
                assert response.json()["error"]["code"] == "queue_full"
        recovered = await http.post("/completions", json={**body, "max_tokens": 3})
        assert recovered.status_code == 200
