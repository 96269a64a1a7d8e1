"""Property-based layer: request bodies generated from the app's own OpenAPI
schema (every field, valid values mixed with wild JSON: NaN, huge integers,
lone surrogates, nesting, unknown keys) and raw byte bodies. Whatever is sent,
the server answers 200 or a 4xx OpenAI error object, never a 5xx."""

from __future__ import annotations

import json
import os

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server.app import create_app
from server.config import Settings
from tests.reliability.rel_harness import INPUT_MODEL, sse_events, stream_text

EXAMPLES = int(os.environ.get("SPECD_FUZZ_EXAMPLES", "120"))  # raise it for a longer hunt
ALLOWED = {200, 400, 404, 413}
FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)

# Any character, lone surrogates (category Cs) included.
ANY_CHAR = st.characters(exclude_categories=())
WILD = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(ANY_CHAR, max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(ANY_CHAR, max_size=6), inner, max_size=3),
    max_leaves=8,
)


def openapi_components() -> dict:
    """The request schemas as the app publishes them (docs are off; the schema is built in-process)."""
    return create_app(Settings(model="unused")).openapi()["components"]["schemas"]


def from_schema(schema: dict, components: dict) -> st.SearchStrategy:
    """Values valid for a JSON-schema node (the subset FastAPI emits), bounded in size."""
    if "$ref" in schema:
        return from_schema(components[schema["$ref"].rsplit("/", 1)[1]], components)
    if "anyOf" in schema:
        return st.one_of([from_schema(option, components) for option in schema["anyOf"]])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "string":
        return st.text(max_size=40)
    if kind == "integer":
        low, high = schema.get("minimum"), schema.get("maximum")
        bounded = st.integers(None if low is None else int(low), None if high is None else int(high))
        small = st.integers(-2, 60)  # token ids, lengths and counts that mostly make sense
        return small | small | small | bounded
    if kind == "number":
        return st.floats(schema.get("minimum"), schema.get("maximum"), allow_nan=False) | st.floats(-3, 3)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        return st.lists(
            from_schema(schema.get("items", {}), components), min_size=schema.get("minItems", 0), max_size=4
        )
    if kind == "object" and "properties" in schema:
        return object_bodies(schema, components, mutate=False)
    if kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        values = from_schema(schema["additionalProperties"], components)
        return st.dictionaries(st.text(max_size=6) | st.integers(0, 400).map(str), values, max_size=4)
    return WILD


def object_bodies(schema: dict, components: dict, mutate: bool = True) -> st.SearchStrategy:
    """Mostly valid objects: the required properties and up to four optional ones from the
    schema; with `mutate`, sometimes one property made wild, a required one dropped, or
    unknown keys added."""
    values = {
        name: st.sampled_from([INPUT_MODEL, INPUT_MODEL, "x"]) if name == "model" else from_schema(prop, components)
        for name, prop in schema["properties"].items()
    }
    required = [name for name in schema["properties"] if name in schema.get("required", [])]
    optional = [name for name in schema["properties"] if name not in required]

    @st.composite
    def build(draw) -> dict:
        extra = st.lists(st.sampled_from(optional), max_size=4, unique=True) if optional else st.just([])
        chosen = required + draw(extra)
        obj = {name: draw(values[name]) for name in chosen}
        mutation = draw(st.sampled_from(["none", "none", "wild", "drop", "unknown"])) if mutate else "none"
        if mutation == "wild":
            obj[draw(st.sampled_from(list(values)))] = draw(WILD)
        elif mutation == "drop" and required:
            obj.pop(draw(st.sampled_from(required)))
        elif mutation == "unknown":
            obj.update(draw(st.dictionaries(st.text(ANY_CHAR, max_size=8), WILD, min_size=1, max_size=2)))
        return obj

    return build()


COMPONENTS = openapi_components()
CHAT_BODIES = object_bodies(COMPONENTS["ChatCompletionRequest"], COMPONENTS)
COMPLETION_BODIES = object_bodies(COMPONENTS["CompletionRequest"], COMPONENTS)


@pytest.fixture(scope="module")
def http(input_server):
    with httpx.Client(base_url=input_server.url, timeout=120) as client:
        yield client


def check_reply(response: httpx.Response, sent: object) -> None:
    context = f"sent {json.dumps(sent)[:600]} got {response.status_code} {response.text[:400]}"
    assert response.status_code in ALLOWED, context
    if response.status_code != 200:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, context
        assert error["type"] == "invalid_request_error", context
        return
    if response.headers["content-type"].startswith("text/event-stream"):
        events = sse_events(response.text)
        assert events and events[-1] == "[DONE]", context
        _, finishes, errors = stream_text(events)
        assert not errors and finishes, context
        return
    reply = response.json()
    assert reply["object"] in ("text_completion", "chat.completion") and reply["choices"], context
    assert reply["usage"]["completion_tokens"] >= 0, context


def post_json(http: httpx.Client, path: str, body: object) -> httpx.Response:
    return http.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})


@FUZZ_SETTINGS
@given(body=CHAT_BODIES)
def test_chat_bodies_from_the_schema_never_5xx(http, tally, body):
    tally.cases_tried += 1
    check_reply(post_json(http, "/v1/chat/completions", body), body)


@FUZZ_SETTINGS
@given(body=COMPLETION_BODIES)
def test_completion_bodies_from_the_schema_never_5xx(http, tally, body):
    tally.cases_tried += 1
    check_reply(post_json(http, "/v1/completions", body), body)


VALID = json.dumps({"model": INPUT_MODEL, "prompt": "Hello", "max_tokens": 2}).encode()


@st.composite
def raw_bodies(draw) -> bytes:
    """Random bytes, or a valid body cut short or with one byte changed."""
    kind = draw(st.sampled_from(["random", "truncated", "flipped"]))
    if kind == "random":
        return draw(st.binary(max_size=200))
    if kind == "truncated":
        return VALID[: draw(st.integers(0, len(VALID) - 1))]
    index = draw(st.integers(0, len(VALID) - 1))
    return VALID[:index] + bytes([draw(st.integers(0, 255))]) + VALID[index + 1 :]


@FUZZ_SETTINGS
@given(raw=raw_bodies(), path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_raw_bodies_never_5xx(http, tally, raw, path):
    tally.cases_tried += 1
    response = http.post(path, content=raw, headers={"content-type": "application/json"})
    check_reply(response, raw.decode("latin-1"))


def test_server_healthy_after_fuzzing(input_server):
    metrics = input_server.wait_idle()
    assert metrics.value("specd_kv_cache_usage_ratio") == 0
    assert metrics.value("specd_requests_total", finish_reason="error") == 0
    assert httpx.get(input_server.url + "/ready", timeout=10).status_code == 200


# -- what the fuzzer found (fixed): valid extremes that once failed the request ------------

GREEDY_EQUIVALENTS = [
    {"temperature": 2.7205368358554776e-135},  # underflowed to 0.0 in float32: inf logits, NaN probabilities
    {"temperature": 1e-300, "top_k": 5},
    {"temperature": 0.7, "top_p": 1e-300},  # top_p underflowed to 0.0 and masked even the top token
]


@pytest.mark.parametrize("extreme", GREEDY_EQUIVALENTS, ids=lambda e: ",".join(e))
def test_vanishing_temperature_or_top_p_decodes_greedily(http, extreme):
    body = {"model": INPUT_MODEL, "prompt": "Hello world", "max_tokens": 8, "ignore_eos": True, "seed": 3}
    greedy = http.post("/v1/completions", json={**body, "temperature": 0})
    reply = http.post("/v1/completions", json={**body, **extreme})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]


@pytest.mark.parametrize("penalty", [1e-300, 1e-40, 1e-7])
def test_vanishing_repetition_penalty_still_decodes(http, penalty):
    body = {
        "model": INPUT_MODEL,
        "prompt": "Hello world",
        "max_tokens": 8,
        "ignore_eos": True,
        "repetition_penalty": penalty,
    }
    reply = http.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 8
