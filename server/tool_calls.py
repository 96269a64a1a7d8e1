"""Tool calls: the grammar that enforces them and the parser that reads them back.

The format is the Hermes one that Qwen2.5's chat template teaches its models: each call is
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`. With `tool_choice` `auto`
the model chooses, and `ToolCallParser` reads calls out of its text. With `required` or a
named function, `tool_grammar` makes the output exactly one call (or, with
`parallel_tool_calls`, one or more), each of a declared function with arguments that obey
its `parameters` schema; the same parser reads them.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from server.structured_outputs import GrammarSource

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOLS_PARAM = "tools"


def tool_grammar(
    functions: list[dict[str, Any]], parallel: bool, special_tokens: bool, any_whitespace: bool = False
) -> GrammarSource:
    """A Lark grammar whose sentences are tool calls of `functions` (OpenAI function objects:
    name, parameters). `special_tokens`: the tags are single added tokens of the vocabulary."""
    variants = []
    for function in functions:
        parameters = function.get("parameters") or {"type": "object"}
        variants.append(
            {
                "type": "object",
                "properties": {"name": {"const": function["name"]}, "arguments": parameters},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = variants[0] if len(variants) == 1 else {"anyOf": variants}
    if not any_whitespace:
        schema = {**schema, "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}
    open_tag, close_tag = (CALL_OPEN, CALL_CLOSE) if special_tokens else (json.dumps(CALL_OPEN), json.dumps(CALL_CLOSE))
    more = ' ("\\n" call)*' if parallel else ""
    lark = f'start: call{more}\ncall: {open_tag} "\\n" body "\\n" {close_tag}\nbody: %json {json.dumps(schema)}\n'
    return GrammarSource("grammar", lark, TOOLS_PARAM)


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it


def _parse_call(body: str) -> ToolCall | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", value["name"], text)


@dataclass
class ToolCallParser:
    """Reads Hermes tool calls out of a stream of text: `push` returns the content that can be
    shown (text that might begin a call is held back) and the calls completed so far;
    `finish` the rest. A block that does not parse as a call stays content."""

    calls: list[ToolCall] = field(default_factory=list)
    _buffer: str = ""
    _in_call: bool = False

    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buffer += text
        content, new = [], []
        while True:
            if self._in_call:
                end = self._buffer.find(CALL_CLOSE)
                if end < 0:
                    break
                body, self._buffer = self._buffer[:end], self._buffer[end + len(CALL_CLOSE) :]
                self._in_call = False
                call = _parse_call(body.strip())
                if call is None:
                    content.append(CALL_OPEN + body + CALL_CLOSE)
                else:
                    new.append(call)
                    self.calls.append(call)
                continue
            start = self._buffer.find(CALL_OPEN)
            if start < 0:
                keep = _partial_suffix(self._buffer, CALL_OPEN)
                content.append(self._visible(self._buffer[: len(self._buffer) - keep]))
                self._buffer = self._buffer[len(self._buffer) - keep :]
                break
            content.append(self._visible(self._buffer[:start]))
            self._buffer = self._buffer[start + len(CALL_OPEN) :]
            self._in_call = True
        return "".join(content), new

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The end of the text: an unclosed call that parses is a call; anything else is content."""
        rest, self._buffer = self._buffer, ""
        new = []
        if self._in_call:
            self._in_call = False
            call = _parse_call(rest.strip())
            if call is None:
                rest = CALL_OPEN + rest
            else:
                new, rest = [call], ""
        self.calls += new
        return self._visible(rest), new

    def _visible(self, text: str) -> str:
        # Once a call was made, what separates calls (newlines) is not content.
        return text if not self.calls or text.strip() else ""


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
