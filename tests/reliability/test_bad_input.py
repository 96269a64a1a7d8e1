"""Bad-input battery: every malformed or out-of-range request over both endpoints
gets a 4xx OpenAI error object naming its `param`, the server stays healthy, and
a reference request returns the same text before and after the battery."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import httpx
import pytest

from tests.reliability.rel_harness import INPUT_MAX_BODY_BYTES, INPUT_MAX_MODEL_LEN, INPUT_MODEL

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
JSON = {"content-type": "application/json"}
MESSAGES = [{"role": "user", "content": "Hello"}]
DROP = object()  # a field removed from the base body


def user(content) -> list[dict]:
    """A one-message conversation whose user content is `content` (any JSON value)."""
    return [{"role": "user", "content": content}]


def body(path: str, **fields) -> dict:
    """A valid request for `path` with `fields` replaced (DROP removes one)."""
    base = {"model": INPUT_MODEL, "max_tokens": 2}
    base.update({"prompt": "Hello"} if path == CMPL else {"messages": MESSAGES})
    base.update(fields)
    return {k: v for k, v in base.items() if v is not DROP}


@dataclass
class Case:
    name: str
    path: str
    json: object = None  # sent with json.dumps (NaN allowed, surrogates escaped)
    raw: bytes | None = None  # sent as is
    headers: dict[str, str] = field(default_factory=lambda: dict(JSON))
    status: int = 400
    param: str | None = None
    code: str | None = None


def chunked_oversize(max_body_bytes: int = INPUT_MAX_BODY_BYTES):
    yield b'{"model": "tiny", "prompt": "'
    for _ in range(max_body_bytes // 8192 + 2):
        yield b"z" * 8192
    yield b'"}'


def sized_cases(max_model_len: int, max_body_bytes: int) -> list[Case]:
    """The cases that a server's limits size: over the body limit, over the context in tokens, text
    over what the context could hold, and bodies filled with as many values as they can hold (a
    million prompts, ids or lists: refused from the body's bytes before they are parsed)."""
    half = max_body_bytes // 2  # characters: more text than any context here holds
    fill = max_body_bytes - 64  # what a body's values may take up
    over_context = "one two three " * (max_model_len // 2)  # ~1.5 tokens a word: over the context
    too_many = {"status": 413, "code": "request_too_large"}
    render = CMPL + "/render"
    return [
        Case("body-over-limit-cmpl", CMPL, json=body(CMPL, prompt="x" * (max_body_bytes + 10)), **too_many),
        Case("body-over-limit-chat", CHAT, json=body(CHAT, messages=user("y" * max_body_bytes)), status=413),
        Case("body-over-limit-chunked", CMPL, raw=None, status=413),  # body from chunked_oversize()
        Case(
            "prompt-over-context",
            CMPL,
            json=body(CMPL, prompt=[5] * (max_model_len + 4)),
            param="prompt",
            code="context_length_exceeded",
        ),
        Case(
            "prompt-ids-64x-context",
            render,
            json=body(CMPL, prompt=[5] * (max_model_len * 64)),
            param="prompt",
            code="context_length_exceeded",
        ),  # fmt: skip
        Case(
            "messages-over-context",
            CHAT,
            json=body(CHAT, messages=user("a " * (max_model_len + 4))),
            param="messages",
            code="context_length_exceeded",
        ),
        Case(
            "prompt-text-over-limit",
            CMPL,
            json=body(CMPL, prompt="x" * half),
            param="prompt",
            code="context_length_exceeded",
        ),  # fmt: skip
        Case(
            "prompts-text-over-limit",
            render,
            json=body(CMPL, prompt=["y" * (half // 2), "z" * (half // 2)]),
            param="prompt",
            code="context_length_exceeded",
        ),  # fmt: skip
        Case(
            "messages-text-over-limit",
            CHAT,
            json=body(CHAT, messages=user("w" * half)),
            param="messages",
            code="context_length_exceeded",
        ),  # fmt: skip
        Case(
            "render-messages-text-over-limit",
            CHAT + "/render",
            json=body(CHAT, messages=user("v" * half)),
            param="messages",
            code="context_length_exceeded",
        ),  # fmt: skip
        Case(
            "prediction-text-over-limit",
            CHAT,
            json=body(CHAT, prediction={"type": "content", "content": "p" * half}),
            param="prediction.content",
            code="context_length_exceeded",
        ),  # fmt: skip
        Case(
            "prediction-over-context",
            CHAT,
            json=body(CHAT, prediction={"type": "content", "content": over_context}),
            param="prediction.content",
            code="prediction_too_long",
        ),  # fmt: skip
        Case("render-prompts-129", render, json=body(CMPL, prompt=[""] * 129), param="prompt"),
        # A body full of values: ~1.4M empty prompts, ~2M token ids, ~1M id lists, ~1M lists unknown.
        Case("render-prompts-filling-the-body", render, json=body(CMPL, prompt=[""] * (fill // 3)), **too_many),
        Case("prompt-ids-filling-the-body", CMPL, json=body(CMPL, prompt=[0] * (fill // 2)), **too_many),
        Case("render-ids-filling-the-body", render, json=body(CMPL, prompt=[0] * (fill // 2)), **too_many),
        Case("prompt-id-lists-filling-the-body", CMPL, json=body(CMPL, prompt=[[0]] * (fill // 4)), **too_many),
        Case("unknown-field-filling-the-body", CMPL, json=body(CMPL, zzz=[[0]] * (fill // 4)), **too_many),
    ]


TEN_THOUSAND_STOPS = [f"s{i}" for i in range(10_000)]
TEN_THOUSAND_BIASES = {str(i): 1.0 for i in range(10_000)}

# The cases whose request no server limit sizes (`sized_cases` adds the rest).
FIXED_CASES = [
    # -- not JSON, not an object, wrong or missing content type --
    Case("malformed-json-cmpl", CMPL, raw=b'{"model": "tiny", "prompt": '),
    Case("malformed-json-chat", CHAT, raw=b'{"model": "tiny", "messages": [}'),
    Case("array-body-cmpl", CMPL, json=[1, 2, 3]),
    Case("array-body-chat", CHAT, json=[body(CHAT)]),
    Case("string-body", CMPL, json="hello"),
    Case("empty-body", CHAT, raw=b""),
    Case("no-content-type-cmpl", CMPL, raw=json.dumps(body(CMPL)).encode(), headers={}),
    Case("no-content-type-chat", CHAT, raw=json.dumps(body(CHAT)).encode(), headers={}),
    Case(
        "form-encoded", CMPL, raw=b"model=tiny&prompt=hi", headers={"content-type": "application/x-www-form-urlencoded"}
    ),
    Case("text-plain", CHAT, raw=json.dumps(body(CHAT)).encode(), headers={"content-type": "text/plain"}),
    Case("invalid-utf8-cmpl", CMPL, raw=b'{"model": "tiny", "prompt": "\xff\xfe\xfa"}'),
    Case("invalid-utf8-chat", CHAT, raw=b'{"model": "tiny", "messages": [{"role": "user", "content": "\xc3\x28"}]}'),
    # 100,000 arrays: refused from the bytes, before the parser would recurse into them.
    Case("nested-100k-deep", CMPL, raw=b"[" * 100_000 + b"]" * 100_000, status=413, code="request_too_large"),
    # -- lone surrogates and non-finite numbers --
    Case("surrogate-prompt", CMPL, json=body(CMPL, prompt="a\ud800b"), param="prompt"),
    Case("surrogate-content", CHAT, json=body(CHAT, messages=user("\udfff")), param="messages[0].content"),
    Case("surrogate-stop", CHAT, json=body(CHAT, stop=["ok", "\udc00"]), param="stop[1]"),
    Case("surrogate-model", CMPL, json=body(CMPL, model="tiny\ud83d"), param="model"),
    Case("surrogate-key", CHAT, json={**body(CHAT), "\ud800": 1}),
    Case("nan-temperature", CMPL, raw=b'{"model": "tiny", "prompt": "hi", "temperature": NaN}', param="temperature"),
    Case(
        "infinity-top-p",
        CHAT,
        raw=b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_p": Infinity}',
        param="top_p",
    ),
    Case(
        "nan-logit-bias", CMPL, raw=b'{"model": "tiny", "prompt": "hi", "logit_bias": {"5": NaN}}', param="logit_bias"
    ),
    # -- model --
    Case("missing-model", CMPL, json=body(CMPL, model=DROP), param="model"),
    Case("model-not-a-string", CHAT, json=body(CHAT, model=7), param="model"),
    Case("empty-model", CMPL, json=body(CMPL, model=""), status=404, param="model", code="model_not_found"),
    Case("unknown-model", CHAT, json=body(CHAT, model="gpt-4o"), status=404, param="model", code="model_not_found"),
    Case(
        "path-model", CMPL, json=body(CMPL, model="../../etc/passwd"), status=404, param="model", code="model_not_found"
    ),
    # -- prompt --
    Case("missing-prompt", CMPL, json=body(CMPL, prompt=DROP), param="prompt"),
    Case("prompt-object", CMPL, json=body(CMPL, prompt={"text": "hi"}), param="prompt"),
    Case("prompt-empty-list", CMPL, json=body(CMPL, prompt=[]), param="prompt"),
    Case("prompt-empty-string", CMPL, json=body(CMPL, prompt=""), param="prompt"),
    Case("prompt-empty-ids", CMPL, json=body(CMPL, prompt=[[]]), param="prompt"),
    Case("prompt-mixed-types", CMPL, json=body(CMPL, prompt=[1, "a"]), param="prompt"),
    Case("prompt-id-out-of-vocab", CMPL, json=body(CMPL, prompt=[5, 99_999]), param="prompt"),
    Case("prompt-id-negative", CMPL, json=body(CMPL, prompt=[-1, 5]), param="prompt"),
    Case("prompt-id-huge", CMPL, json=body(CMPL, prompt=[[1], [2**70]]), param="prompt"),
    # -- max_tokens --
    Case("max-tokens-zero", CMPL, json=body(CMPL, max_tokens=0), param="max_tokens"),
    Case("max-tokens-negative", CHAT, json=body(CHAT, max_tokens=-5), param="max_tokens"),
    Case("max-tokens-string", CMPL, json=body(CMPL, max_tokens="ten"), param="max_tokens"),
    Case("max-tokens-fraction", CMPL, json=body(CMPL, max_tokens=1.5), param="max_tokens"),
    Case(
        "max-tokens-over-context",
        CHAT,
        json=body(CHAT, max_tokens=10**9),
        param="max_tokens",
        code="context_length_exceeded",
    ),
    Case("max-completion-tokens-zero", CHAT, json=body(CHAT, max_completion_tokens=0), param="max_completion_tokens"),
    # -- sampling values out of range or of the wrong type --
    Case("temperature-negative", CMPL, json=body(CMPL, temperature=-0.1), param="temperature"),
    Case("temperature-huge", CHAT, json=body(CHAT, temperature=101), param="temperature"),
    Case("temperature-above-openai-range", CMPL, json=body(CMPL, temperature=3), param="temperature"),
    Case(
        "temperature-above-openai-range-chat-stream",
        CHAT,
        json=body(CHAT, temperature=2.5, stream=True),
        param="temperature",
    ),
    Case("temperature-string", CMPL, json=body(CMPL, temperature="hot"), param="temperature"),
    Case("top-p-zero", CHAT, json=body(CHAT, top_p=0), param="top_p"),
    Case("top-p-over-one", CMPL, json=body(CMPL, top_p=1.5), param="top_p"),
    Case("top-k-negative", CMPL, json=body(CMPL, top_k=-2), param="top_k"),
    Case("top-k-string", CHAT, json=body(CHAT, top_k="5x"), param="top_k"),
    Case("min-p-over-one", CHAT, json=body(CHAT, min_p=1.5), param="min_p"),
    Case("presence-penalty", CMPL, json=body(CMPL, presence_penalty=2.5), param="presence_penalty"),
    Case("frequency-penalty", CHAT, json=body(CHAT, frequency_penalty=-3), param="frequency_penalty"),
    Case("repetition-penalty-zero", CMPL, json=body(CMPL, repetition_penalty=0), param="repetition_penalty"),
    Case("seed-string", CHAT, json=body(CHAT, seed="abc"), param="seed"),
    Case("seed-fraction", CMPL, json=body(CMPL, seed=1.5), param="seed"),
    # -- n --
    Case("n-zero", CMPL, json=body(CMPL, n=0), param="n"),
    Case("n-over-limit", CHAT, json=body(CHAT, n=17), param="n"),
    Case("n-huge", CMPL, json=body(CMPL, n=10**12), param="n"),
    Case("n-string", CHAT, json=body(CHAT, n="two"), param="n"),
    Case("prompts-times-n", CMPL, json=body(CMPL, prompt=["hi"] * 20, n=16), param="n"),
    # -- stop --
    Case("stop-10000-cmpl", CMPL, json=body(CMPL, stop=TEN_THOUSAND_STOPS), param="stop"),
    Case("stop-10000-chat", CHAT, json=body(CHAT, stop=TEN_THOUSAND_STOPS), param="stop"),
    Case("stop-too-long", CHAT, json=body(CHAT, stop=["x" * 300]), param="stop"),
    Case("stop-wrong-type", CMPL, json=body(CMPL, stop=123), param="stop"),
    Case("stop-token-ids-strings", CMPL, json=body(CMPL, stop_token_ids=["a"]), param="stop_token_ids[0]"),
    # -- logit_bias --
    Case("logit-bias-10000-cmpl", CMPL, json=body(CMPL, logit_bias=TEN_THOUSAND_BIASES), param="logit_bias"),
    Case("logit-bias-10000-chat", CHAT, json=body(CHAT, logit_bias=TEN_THOUSAND_BIASES), param="logit_bias"),
    Case("logit-bias-key-not-id", CHAT, json=body(CHAT, logit_bias={"abc": 1}), param="logit_bias"),
    Case("logit-bias-out-of-vocab", CMPL, json=body(CMPL, logit_bias={"99999": 1}), param="logit_bias"),
    Case("logit-bias-value-range", CMPL, json=body(CMPL, logit_bias={"5": 500}), param="logit_bias"),
    Case("logit-bias-value-string", CHAT, json=body(CHAT, logit_bias={"5": "x"}), param="logit_bias"),
    # -- streaming --
    Case("stream-not-bool", CMPL, json=body(CMPL, stream="maybe"), param="stream"),
    Case(
        "stream-options-without-stream",
        CHAT,
        json=body(CHAT, stream_options={"include_usage": True}),
        param="stream_options",
    ),
    Case(
        "stream-options-bad-type",
        CMPL,
        json=body(CMPL, stream=True, stream_options={"include_usage": "x"}),
        param="stream_options.include_usage",
    ),
    # -- speculation extensions --
    Case("speculation-word", CHAT, json=body(CHAT, speculation="sometimes"), param="speculation"),
    Case("speculation-int", CMPL, json=body(CMPL, speculation=1), param="speculation"),
    Case("num-spec-tokens-over", CMPL, json=body(CMPL, num_speculative_tokens=17), param="num_speculative_tokens"),
    Case("num-spec-tokens-negative", CHAT, json=body(CHAT, num_speculative_tokens=-1), param="num_speculative_tokens"),
    # -- logprobs --
    Case("logprobs-over", CMPL, json=body(CMPL, logprobs=21), param="logprobs"),
    Case("logprobs-string", CMPL, json=body(CMPL, logprobs="x"), param="logprobs"),
    Case("top-logprobs-over", CHAT, json=body(CHAT, logprobs=True, top_logprobs=21), param="top_logprobs"),
    Case("top-logprobs-without-logprobs", CHAT, json=body(CHAT, top_logprobs=2), param="top_logprobs"),
    # -- completion-only fields --
    Case("echo-with-logprobs", CMPL, json=body(CMPL, echo=True, logprobs=1), param="echo"),
    Case("suffix", CMPL, json=body(CMPL, suffix="end"), param="suffix"),
    Case("best-of", CMPL, json=body(CMPL, best_of=3), param="best_of"),
    # -- messages --
    Case("missing-messages", CHAT, json=body(CHAT, messages=DROP), param="messages"),
    Case("messages-string", CHAT, json=body(CHAT, messages="hi"), param="messages"),
    Case("messages-empty", CHAT, json=body(CHAT, messages=[]), param="messages"),
    Case("message-not-object", CHAT, json=body(CHAT, messages=["hi"]), param="messages[0]"),
    Case(
        "role-unknown", CHAT, json=body(CHAT, messages=[{"role": "robot", "content": "hi"}]), param="messages[0].role"
    ),
    Case(
        "role-function",
        CHAT,
        json=body(CHAT, messages=[{"role": "function", "content": "hi"}]),
        param="messages[0].role",
    ),
    Case("role-missing", CHAT, json=body(CHAT, messages=[{"content": "hi"}]), param="messages[0].role"),
    Case("content-number", CHAT, json=body(CHAT, messages=user(5)), param="messages[0].content"),
    Case(
        "content-image-part",
        CHAT,
        json=body(CHAT, messages=user([{"type": "image_url", "image_url": {"url": "x"}}])),
        param="messages[0].content[0].type",
    ),
    Case(
        "content-audio-part",
        CHAT,
        json=body(CHAT, messages=user([{"type": "text", "text": "a"}, {"type": "input_audio"}])),
        param="messages[0].content[1].type",
    ),
    Case(
        "content-text-part-no-text",
        CHAT,
        json=body(CHAT, messages=user([{"type": "text"}])),
        param="messages[0].content[0].text",
    ),
    Case("content-part-not-object", CHAT, json=body(CHAT, messages=user(["hi"])), param="messages[0].content"),
    # -- chat-only fields --
    Case(
        "prediction-bad-type",
        CHAT,
        json=body(CHAT, prediction={"type": "image", "content": "x"}),
        param="prediction.type",
    ),
    Case(
        "response-format-unknown", CHAT, json=body(CHAT, response_format={"type": "xml"}), param="response_format.type"
    ),
    Case(
        "tool-choice-undeclared",
        CHAT,
        json=body(
            CHAT,
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        ),
        param="tool_choice.function.name",
    ),  # fmt: skip
    Case("grammar-regex", CMPL, json=body(CMPL, structured_outputs={"regex": "(a"}), param="structured_outputs.regex"),
    Case("continue-final-misuse", CHAT, json=body(CHAT, continue_final_message=True), param="continue_final_message"),
    Case(
        "template-kwargs-clash",
        CHAT,
        json=body(CHAT, chat_template_kwargs={"tokenize": True}),
        param="chat_template_kwargs",
    ),  # fmt: skip
    Case("template-kwargs-string", CHAT, json=body(CHAT, chat_template_kwargs="x"), param="chat_template_kwargs"),
    Case("user-number", CHAT, json=body(CHAT, user=5), param="user"),
    # -- every list and name bounded, every size judged before the work it would cost --
    Case("stop-token-ids-65", CMPL, json=body(CMPL, stop_token_ids=list(range(65))), param="stop_token_ids"),
    Case("stop-token-id-out-of-vocab", CHAT, json=body(CHAT, stop_token_ids=[10**9]), param="stop_token_ids"),
    Case("stop-token-id-negative", CMPL, json=body(CMPL, stop_token_ids=[-1]), param="stop_token_ids"),
    Case("messages-1025", CHAT, json=body(CHAT, messages=MESSAGES * 1025), param="messages"),
    Case(
        "content-parts-257",
        CHAT,
        json=body(CHAT, messages=user([{"type": "text", "text": "a"}] * 257)),
        param="messages[0].content",
    ),  # fmt: skip
    Case("tools-129", CHAT, json=body(CHAT, tools=[{"type": "function"}] * 129), param="tools"),
    Case(
        "template-kwargs-33",
        CHAT,
        json=body(CHAT, chat_template_kwargs={f"k{i}": i for i in range(33)}),
        param="chat_template_kwargs",
    ),  # fmt: skip
    Case("model-257-chars", CMPL, json=body(CMPL, model="m" * 257), param="model"),
    Case("user-257-chars", CHAT, json=body(CHAT, user="u" * 257), param="user"),
    Case("cache-salt-257-chars", CMPL, json=body(CMPL, cache_salt="s" * 257), param="cache_salt"),
    Case(
        "name-257-chars",
        CHAT,
        json=body(CHAT, messages=[{"role": "user", "content": "hi", "name": "n" * 257}]),
        param="messages[0].name",
    ),  # fmt: skip
    # -- unknown fields are ignored, as OpenAI does --
    Case(
        "unknown-fields-cmpl",
        CMPL,
        json=body(CMPL, metadata={"a": 1}, store=True, frobnicate=[1, {"x": None}]),
        status=200,
    ),
    Case(
        "unknown-fields-chat", CHAT, json=body(CHAT, parallel_tool_calls=False, service_tier="auto", zzz=1), status=200
    ),
    Case(
        "unknown-message-fields",
        CHAT,
        json=body(CHAT, messages=[{"role": "user", "content": "hi", "weight": 3}]),
        status=200,
    ),
]
CASES = [*FIXED_CASES, *sized_cases(INPUT_MAX_MODEL_LEN, INPUT_MAX_BODY_BYTES)]

REFERENCE = [
    (
        CMPL,
        {"model": INPUT_MODEL, "prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0, "ignore_eos": True},
    ),
    (CHAT, {"model": INPUT_MODEL, "messages": MESSAGES, "max_tokens": 12, "temperature": 0, "ignore_eos": True}),
]


def reference_texts(server) -> list[str]:
    texts = []
    for path, request in REFERENCE:
        reply = httpx.post(server.url + path, json=request, timeout=60)
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        texts.append(choice["text"] if path == CMPL else choice["message"]["content"])
    return texts


@pytest.fixture(scope="module")
def reference_before(input_server) -> list[str]:
    return reference_texts(input_server)


def encoded(case: Case) -> bytes:
    """The case's body: raw, or its JSON without spaces (a body filled with values fills it to the limit)."""
    return case.raw if case.raw is not None else json.dumps(case.json, separators=(",", ":")).encode()


def send(server, case: Case) -> httpx.Response:
    if case.name == "body-over-limit-chunked":
        return httpx.post(server.url + case.path, content=chunked_oversize(), headers=JSON, timeout=60)
    return httpx.post(server.url + case.path, content=encoded(case), headers=case.headers, timeout=60)


def assert_openai_error(response: httpx.Response, status: int, param: str | None, code: str | None = None) -> dict:
    assert response.status_code == status, response.text[:500]
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert "Traceback" not in error["message"] and 'File "' not in error["message"]
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


def test_the_battery_has_at_least_40_cases_over_both_endpoints():
    assert len(CASES) >= 40
    assert len({c.name for c in CASES}) == len(CASES)
    assert sum(c.path == CMPL for c in CASES) >= 20 and sum(c.path == CHAT for c in CASES) >= 20


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input(input_server, reference_before, tally, case):
    tally.cases_tried += 1
    response = send(input_server, case)
    if case.status == 200:
        assert response.status_code == 200, response.text[:500]
        assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")
    else:
        assert_openai_error(response, case.status, case.param, case.code)
    assert httpx.get(input_server.url + "/health", timeout=10).status_code == 200


def test_server_unchanged_after_the_battery(input_server, reference_before):
    assert httpx.get(input_server.url + "/ready", timeout=10).status_code == 200
    metrics = input_server.wait_idle()
    assert metrics.value("specd_kv_cache_usage_ratio") == 0
    assert metrics.value("specd_requests_total", finish_reason="error") == 0
    assert reference_texts(input_server) == reference_before
