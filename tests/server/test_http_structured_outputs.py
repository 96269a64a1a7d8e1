"""Structured outputs and tool calls through the OpenAI SDK, on the tiny random model: whatever
it would say, the grammar makes the reply parse and validate (`parse()` with a Pydantic
model, JSON mode, vLLM's `structured_outputs`, required and named tool calls, streamed and
not), and a tool round trip goes back through the chat template."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel

MESSAGES = [{"role": "user", "content": "Describe a colour."}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}  # fmt: skip


class Colour(BaseModel):
    name: Literal["red", "green", "blue"]
    bright: bool
    shade: Literal["light", "dark"]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("speculation", [False, True, "auto"])
def test_parse_with_a_pydantic_model(client, model, temperature, speculation):
    completion = client.chat.completions.parse(
        model=model, messages=MESSAGES, response_format=Colour, temperature=temperature, max_tokens=64,
        extra_body={"speculation": speculation},
    )  # fmt: skip
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Colour)
    assert " " not in choice.message.content  # compact: no whitespace between tokens by default


def test_json_mode_and_vllm_fields_on_both_endpoints(client, model):
    reply = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=48, response_format={"type": "json_object"}
    )
    choice = reply.choices[0]
    if choice.finish_reason == "stop":  # a random model may fill the budget inside the object
        assert isinstance(json.loads(choice.message.content), dict)
    else:
        assert choice.finish_reason == "length" and choice.message.content.startswith("{")

    choices = ["yes", "no", "maybe later"]
    text = client.completions.create(
        model=model, prompt="Answer:", max_tokens=16, n=3, temperature=1.0,
        extra_body={"structured_outputs": {"choice": choices}},
    )  # fmt: skip
    assert all(c.text in choices and c.finish_reason == "stop" for c in text.choices)

    regex = r"[0-9]{3}-[a-z]{2}"
    text = client.completions.create(
        model=model, prompt="Code:", max_tokens=16, extra_body={"structured_outputs": {"regex": regex}}
    )
    assert re.fullmatch(regex, text.choices[0].text)

    lark = 'start: "(" item (" " item)* ")"\nitem: "a" | "bb"'
    chat = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=32, extra_body={"structured_outputs": {"grammar": lark}}
    )
    if chat.choices[0].finish_reason == "stop":
        assert re.fullmatch(r"\((a|bb)( (a|bb))*\)", chat.choices[0].message.content)


def test_a_streamed_schema_reply_parses(client, model):
    schema = {**Colour.model_json_schema(), "additionalProperties": False}  # closed, as parse() sends it
    stream = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=64, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "colour", "schema": schema, "strict": True}},
    )  # fmt: skip
    text, finish = "", None
    for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads(text), schema)


def _check_call(call, tools=(WEATHER,)) -> None:
    function = next(t["function"] for t in tools if t["function"]["name"] == call.function.name)
    assert call.id and call.type == "function"
    jsonschema.validate(json.loads(call.function.arguments), function["parameters"])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_required_and_named_tool_calls(client, model, choice):
    reply = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=128, tools=[WEATHER, TIME], tool_choice=choice,
        parallel_tool_calls=False,
    )  # fmt: skip
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls"
    assert len(message.tool_calls) == 1 and message.content is None
    _check_call(message.tool_calls[0], (WEATHER, TIME))
    if isinstance(choice, dict):
        assert message.tool_calls[0].function.name == "get_time"


def test_a_tool_round_trip_streamed_and_not(client, model):
    request = dict(model=model, max_tokens=128, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    reply = client.chat.completions.create(messages=MESSAGES, **request)
    call = reply.choices[0].message.tool_calls[0]
    _check_call(call)

    stream = client.chat.completions.create(messages=MESSAGES, stream=True, **request)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for delta in c.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                if delta.id:
                    assert entry["id"] is None  # id and name come first, once
                    entry["id"], entry["name"] = delta.id, delta.function.name
                entry["arguments"] += delta.function.arguments or ""
    assert finish == "tool_calls" and len(calls) == 1
    assert calls[0]["name"] == "get_weather" and calls[0]["id"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER["function"]["parameters"])

    # The call and its result go back through the chat template; the model answers in text.
    follow_up = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'},
    ]
    answer = client.chat.completions.create(model=model, messages=follow_up, max_tokens=8, tools=[WEATHER])
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_structured_and_free_requests_share_a_batch(tiny_server, model):
    """Concurrent requests, half under a grammar: each obeys its own (or none)."""
    import concurrent.futures

    schema = {**Colour.model_json_schema(), "additionalProperties": False}  # closed, as parse() sends it

    def one(i: int) -> tuple[int, dict]:
        body = {"model": model, "messages": MESSAGES, "max_tokens": 48, "temperature": 1.0, "seed": i}
        if i % 2:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}
        return i, httpx.post(tiny_server.base_url + "/chat/completions", json=body, timeout=120).json()

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        for i, reply in pool.map(one, range(8)):
            if i % 2:
                jsonschema.validate(json.loads(reply["choices"][0]["message"]["content"]), schema)
            else:
                assert reply["choices"][0]["finish_reason"] in ("stop", "length")


def test_metrics_count_structured_requests(tiny_server):
    text = httpx.get(tiny_server.base_url.removesuffix("/v1") + "/metrics").text
    counted = re.search(r'specd_structured_requests_total\{[^}]*finish_reason="stop"[^}]*\} (\S+)', text)
    assert counted and float(counted.group(1)) > 0
    assert re.search(r"specd_grammar_compile_seconds_count\{[^}]*\} [1-9]", text)
