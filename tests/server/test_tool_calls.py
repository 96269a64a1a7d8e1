"""Hermes tool calls read out of text, whole or streamed in any pieces."""

from __future__ import annotations

import json

import pytest

from server.tool_calls import ToolCallParser, tool_grammar

TEXT = (
    'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
)


@pytest.mark.parametrize("piece", [1, 3, 7, len(TEXT)])
def test_calls_and_content_whatever_the_pieces(piece):
    parser, content = ToolCallParser(), ""
    for i in range(0, len(TEXT), piece):
        shown, _ = parser.push(TEXT[i : i + piece])
        assert "<" not in shown  # a tag's beginning is held back
        content += shown
    rest, _ = parser.finish()
    assert content + rest == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"zone": "CET"}),
    ]
    assert len({c.id for c in parser.calls}) == 2


def test_what_is_not_a_call_stays_content():
    parser = ToolCallParser()
    shown, calls = parser.push("a < b and <tool_call>not json</tool_call> done")
    rest, more = parser.finish()
    assert shown + rest == "a < b and <tool_call>not json</tool_call> done" and not calls + more


def test_an_unclosed_call_at_the_end_is_a_call_if_it_parses():
    parser = ToolCallParser()
    parser.push('<tool_call>\n{"name": "f", "arguments": {}}')
    rest, calls = parser.finish()
    assert rest == "" and [c.name for c in calls] == ["f"]


def test_the_grammar_names_single_token_tags_as_tokens():
    functions = [{"name": "f", "parameters": {"type": "object"}}]
    as_tokens = tool_grammar(functions, parallel=True, special_tokens=True).text
    as_text = tool_grammar(functions, parallel=False, special_tokens=False).text
    assert "call: <tool_call>" in as_tokens and '("\\n" call)*' in as_tokens
    assert 'call: "<tool_call>"' in as_text and "call)*" not in as_text
