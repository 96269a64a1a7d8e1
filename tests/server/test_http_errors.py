"""Every error status as an OpenAI error object; engine faults fail one request only."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tests.support.server import finish_server, serve_args, start_server

MESSAGES = [{"role": "user", "content": "Hello"}]


def post(server, path: str, **kwargs) -> httpx.Response:
    return httpx.post(server.base_url + path, timeout=60, **kwargs)


def assert_error(response: httpx.Response, status: int, param=None, code=None, error_type=None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and "Traceback" not in error["message"]
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    if error_type is not None:
        assert error["type"] == error_type
    return error


@pytest.mark.parametrize(
    "field, value, param",
    [
        ("temperature", -1, "temperature"),
        ("top_p", 0, "top_p"),
        ("top_k", -5, "top_k"),
        ("min_p", 2, "min_p"),
        ("presence_penalty", 3, "presence_penalty"),
        ("repetition_penalty", 0, "repetition_penalty"),
        ("logit_bias", {"abc": 1}, "logit_bias"),
        ("logit_bias", {"999999": 1}, "logit_bias"),
        ("logit_bias", {"5": 500}, "logit_bias"),
        ("speculation", "sometimes", "speculation"),
        ("num_speculative_tokens", 99, "num_speculative_tokens"),
        ("n", 0, "n"),
        ("max_tokens", 0, "max_tokens"),
        ("stop", ["x"] * 17, "stop"),
        ("stop", ["x" * 300], "stop"),
        ("stream_options", {"include_usage": True}, "stream_options"),
        ("top_logprobs", 2, "top_logprobs"),
        ("tools", [{"type": "function", "function": {"name": "f f"}}], "tools[0].function.name"),
        ("tool_choice", "required", "tool_choice"),
        ("response_format", {"type": "xml"}, "response_format.type"),
        ("response_format", {"type": "json_schema"}, "response_format.json_schema"),
        (
            "response_format",
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}},
            "response_format.json_schema.schema",
        ),
        (
            "response_format",
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"format": "weird"}}},
            "response_format.json_schema.schema",
        ),
        ("structured_outputs", {"regex": "(a|b"}, "structured_outputs.regex"),
        ("structured_outputs", {"regex": "a", "choice": ["a"]}, "structured_outputs"),
        ("structured_outputs", {"choice": []}, "structured_outputs.choice"),
        ("structured_outputs", {"grammar": "start: undefined_rule"}, "structured_outputs.grammar"),
    ],
)
def test_invalid_chat_values_are_400_with_param(tiny_server, model, field, value, param):
    body = {"model": model, "messages": MESSAGES, "max_tokens": 2, field: value}
    assert_error(
        post(tiny_server, "/chat/completions", json=body), 400, param=param, error_type="invalid_request_error"
    )


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": "not a list"}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content[0].type",
        ),
        ({"messages": MESSAGES, "temperature": "hot"}, "temperature"),
        ({"messages": MESSAGES, "model": None}, "model"),
        ({"messages": MESSAGES, "cache_salt": ""}, "cache_salt"),
    ],
)
def test_schema_errors_are_400_not_422(tiny_server, model, body, param):
    assert_error(post(tiny_server, "/chat/completions", json={"model": model, **body}), 400, param=param)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, 99999]}, "prompt"),
        ({"prompt": "hi", "suffix": "end"}, "suffix"),
        ({"prompt": "hi", "best_of": 3}, "best_of"),
        ({"prompt": "hi", "echo": True, "logprobs": 1}, "echo"),
        ({"prompt": "hi", "logprobs": 50}, "logprobs"),
        ({"prompt": ["hi"] * 20, "n": 16}, "n"),
    ],
)
def test_invalid_completion_requests(tiny_server, model, body, param):
    assert_error(post(tiny_server, "/completions", json={"model": model, **body}), 400, param=param)


def test_body_that_is_not_json_or_not_an_object(tiny_server):
    assert_error(
        post(tiny_server, "/chat/completions", content=b"{not json", headers={"content-type": "application/json"}), 400
    )
    assert_error(post(tiny_server, "/chat/completions", json=[1, 2]), 400)


def test_context_length_exceeded(tiny_server, model):
    long_prompt = list(range(10, 300)) * 2  # 580 tokens > max_model_len 512
    error = assert_error(
        post(tiny_server, "/completions", json={"model": model, "prompt": long_prompt}), 400, param="prompt"
    )
    assert error["code"] == "context_length_exceeded"
    error = assert_error(
        post(tiny_server, "/completions", json={"model": model, "prompt": "hi", "max_tokens": 600}),
        400,
        param="max_tokens",
    )
    assert error["code"] == "context_length_exceeded"


def test_unknown_model_is_404_and_never_loaded(tiny_server, tiny_llama_dir):
    for name in ("gpt-4", "HuggingFaceTB/SmolLM2-135M-Instruct", str(tiny_llama_dir) + "/"):
        body = {"model": name, "messages": MESSAGES}
        assert_error(post(tiny_server, "/chat/completions", json=body), 404, param="model", code="model_not_found")


def test_unknown_route_and_method(tiny_server):
    assert_error(httpx.get(tiny_server.base_url + "/nothing-here"), 404, code="not_found")
    assert_error(httpx.post(tiny_server.url + "/v2/completions", json={}), 404)
    assert_error(httpx.get(tiny_server.base_url + "/chat/completions"), 405, code="method_not_allowed")
    assert_error(httpx.delete(tiny_server.base_url + "/models"), 405)


def test_body_over_the_limit_is_413(tiny_server, model):
    big = {"model": model, "prompt": "x" * 70_000}
    assert_error(post(tiny_server, "/completions", json=big), 413, code="request_too_large")

    def chunked():  # no Content-Length: the limit is enforced on the bytes received
        yield b'{"model": "m", "prompt": "'
        for _ in range(20):
            yield b"y" * 4096
        yield b'"}'

    assert_error(
        post(tiny_server, "/completions", content=chunked(), headers={"content-type": "application/json"}), 413
    )


async def test_engine_fault_fails_one_request_and_others_finish(tiny_server, model):
    async with httpx.AsyncClient(base_url=tiny_server.base_url, timeout=120) as http:

        async def complete(**extra):
            body = {"model": model, "prompt": "Hello world", "max_tokens": 12, "ignore_eos": True, **extra}
            return await http.post("/completions", json=body)

        responses = await asyncio.gather(
            complete(), complete(fault="raise"), complete(), complete(fault="nan"), complete()
        )
    for index in (0, 2, 4):
        assert responses[index].status_code == 200
        assert responses[index].json()["usage"]["completion_tokens"] == 12
    for index in (1, 3):
        assert_error(responses[index], 500, code="engine_error", error_type="server_error")
    assert httpx.get(tiny_server.url + "/health").status_code == 200
    assert httpx.get(tiny_server.url + "/ready").status_code == 200


def test_engine_fault_mid_stream_is_an_error_event(tiny_server, model):
    client = openai.OpenAI(base_url=tiny_server.base_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.APIError, match="engine"):
        for _ in client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=5, stream=True, extra_body={"fault": "nan"}
        ):
            pass
    reply = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=3)
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_a_request_larger_than_the_kv_pool_is_a_400_naming_it(tiny_llama_dir, tmp_path, model):
    """A pool of 4 blocks of 16 (64 tokens): what cannot fit is refused up front, with the limit."""
    args = serve_args(model=tiny_llama_dir, dtype="float32", device="cpu", num_kv_blocks=4, max_num_seqs=2)
    server = start_server(args, tmp_path, "tiny-pool")
    try:
        body = {"model": model, "messages": MESSAGES, "max_tokens": 200}
        error = assert_error(post(server, "/chat/completions", json=body), 400, param="max_tokens")
        assert "the KV cache (4 blocks of 16) holds 64 tokens" in error["message"]
        reply = post(server, "/chat/completions", json={"model": model, "messages": MESSAGES})
        assert reply.status_code == 200  # the default max_tokens fits the pool
        assert httpx.get(server.base_url + "/models").json()["data"][0]["max_model_len"] == 64
    finally:
        finish_server(server)
