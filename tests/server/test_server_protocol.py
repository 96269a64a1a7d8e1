"""Request models: every list and name a client sends has a bound, checked before any work."""

import pytest
from pydantic import ValidationError

from scheduler.types import MAX_STOP_TOKEN_IDS
from server.protocol import (
    MAX_CONTENT_PARTS,
    MAX_ID_CHARS,
    MAX_MESSAGES,
    MAX_STOP_STRINGS,
    MAX_TEMPLATE_KWARGS,
    MAX_TOOLS,
    ChatCompletionRequest,
    CompletionRequest,
)

MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(**{"model": "m", "messages": MESSAGES, **fields})


@pytest.mark.parametrize(
    "fields",
    [
        {"messages": MESSAGES * (MAX_MESSAGES + 1)},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * (MAX_CONTENT_PARTS + 1)}]},
        {"messages": [{"role": "user", "content": "hi", "name": "n" * (MAX_ID_CHARS + 1)}]},
        {"tools": [{"type": "function"}] * (MAX_TOOLS + 1)},
        {"chat_template_kwargs": {f"k{i}": i for i in range(MAX_TEMPLATE_KWARGS + 1)}},
        {"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))},
        {"stop": ["x"] * (MAX_STOP_STRINGS + 1)},
        {"model": "m" * (MAX_ID_CHARS + 1)},
        {"user": "u" * (MAX_ID_CHARS + 1)},
        {"cache_salt": "s" * (MAX_ID_CHARS + 1)},
        {"cache_salt": ""},
        {"prediction": {"type": "content", "content": [{"type": "text", "text": "a"}] * (MAX_CONTENT_PARTS + 1)}},
    ],
    ids=lambda fields: next(iter(fields)),
)
def test_oversized_fields_are_refused_by_the_model(fields):
    with pytest.raises(ValidationError):
        chat(**fields)


def test_fields_at_their_bounds_are_accepted():
    request = chat(
        messages=MESSAGES * MAX_MESSAGES,
        stop_token_ids=list(range(MAX_STOP_TOKEN_IDS)),
        user="u" * MAX_ID_CHARS,
        cache_salt="s" * MAX_ID_CHARS,
    )
    assert len(request.messages) == MAX_MESSAGES
    assert CompletionRequest(model="m", prompt="x", stop_token_ids=[1, 2]).stop_token_ids == [1, 2]


def test_user_is_not_a_request_tenant():
    # The tenant comes from the credential (server.auth); the body has no say in it.
    assert not hasattr(chat(user="alice"), "tenant")


def test_a_lone_surrogate_is_found_with_its_path_among_token_ids_and_nesting():
    from server.protocol import find_invalid_text

    assert find_invalid_text({"model": "m", "prompt": [0] * 100_000}) == (False, None)
    assert find_invalid_text({"prompt": [1, 2, "\ud800"]}) == (True, "prompt[2]")
    assert find_invalid_text({"prompt": [[1, 2], [3, "\udc00"]]}) == (True, "prompt[1][1]")
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a\ud800"}]}]}
    assert find_invalid_text(body) == (True, "messages[0].content[0].text")
    assert find_invalid_text({"a\ud800": 1}) == (True, None)  # a key: the body itself is named
    assert find_invalid_text({"logit_bias": {"5": 1.0}, "stop": ["x", None]}) == (False, None)


def test_a_list_of_prompts_is_counted_before_its_elements_are_validated():
    from pydantic import ValidationError

    from server.protocol import MAX_CHOICES, CompletionRequest, find_invalid_text

    for prompts in ([""] * (MAX_CHOICES + 1), [[1]] * (MAX_CHOICES + 1), ["a", 1.5] * 100):
        with pytest.raises(ValidationError, match=f"at most {MAX_CHOICES} prompts"):
            CompletionRequest(model="m", prompt=prompts)
    assert CompletionRequest(model="m", prompt=[7] * 5000).prompt == [7] * 5000  # ids: bounded by the context
    assert CompletionRequest(model="m", prompt=[""] * MAX_CHOICES).prompt == [""] * MAX_CHOICES
    # A list of strings is judged in one join; a bad one is still found with its index.
    assert find_invalid_text({"prompt": ["a"] * 1000}) == (False, None)
    assert find_invalid_text({"prompt": ["a", "b", "c\udfff"]}) == (True, "prompt[2]")
