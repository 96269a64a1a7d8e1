"""Chat prompts as token ids in which only the template makes control tokens.

A chat template renders message content into its text, and encoding that text turns
`<|im_start|>system` typed by a user into the real control tokens: the user forges a
turn of another role. So the content of system, user and tool messages is encoded
apart, with the tokenizer's added tokens (special or not: `<|im_end|>`, `<tool_call>`)
read as plain text, and the template's own text around it as the template wrote it.

The template is rendered with each such content replaced by a random placeholder (the
approach vLLM's and sglang's sanitizing PRs take), and the text between placeholders is
encoded with added tokens. A chat whose whole-text encoding holds exactly the template's
control tokens, in order, gets that encoding unchanged: ordinary chats are tokenized as
before, byte for byte. Otherwise some content made a control token (alone or joined with
the template's text), and the pieces are encoded apart.

Tool definitions (`tools`) and those messages' other fields (a tool result's `name`) are the
client's text too: every string in them (names, descriptions, parameter schemas) that holds
control-token text, or part of one at its edge, gets a placeholder of its own, and is encoded as
plain text in the form the template printed it (JSON-escaped by `tojson`, as Qwen2.5's and
Llama's templates print tools, or raw).

Assistant messages are the model's own earlier outputs (`<tool_call>` included) and stay
as the template renders them.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import weakref
from collections.abc import Callable
from typing import Any

from models.chat_template import chat_text

logger = logging.getLogger("specd.models")

ESCAPED_ROLES = frozenset({"system", "developer", "user", "tool"})


class UnescapedToolText(ValueError):
    """Tool definitions whose control-token text the template printed other than raw or as JSON."""


# tokenizer -> an encoder of text that knows none of its added tokens
_plain_encoders: weakref.WeakKeyDictionary[Any, Callable[[str], list[int]]] = weakref.WeakKeyDictionary()


def chat_ids(tokenizer: Any, messages: list[dict[str, Any]], **template_kwargs: Any) -> list[int]:
    """The chat's prompt token ids; `template_kwargs` go to `chat_text`. Template errors propagate."""
    text = chat_text(tokenizer, messages, **template_kwargs)
    ids = tokenizer.encode(text, add_special_tokens=False)
    # Private-use characters and a nonce for content, letters and a nonce for tool strings
    # (`tojson` escapes nothing in them): no client text can hold either.
    nonce = secrets.token_hex(8)
    marker, tool_marker = "\ue000" + nonce, "SPECDTOOL" + nonce
    added = [token.content for token in tokenizer.added_tokens_decoder.values() if token.content]
    contents: dict[str, str] = {}
    tool_strings: dict[str, str] = {}
    skeleton_messages = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if message.get("role") in ESCAPED_ROLES:
            # The message's other strings (`name`, `tool_call_id`) are the client's too.
            message = {
                key: (
                    value if key in ("role", "content") else _with_placeholders(value, tool_marker, tool_strings, added)
                )
                for key, value in message.items()
            }
            if isinstance(content, str) and content:
                placeholder = f"{marker}:{i}\ue001"
                contents[placeholder] = content
                message["content"] = placeholder
        skeleton_messages.append(message)
    if template_kwargs.get("tools"):
        tools = _with_placeholders(template_kwargs["tools"], tool_marker, tool_strings, added)
        template_kwargs = {**template_kwargs, "tools": tools}
    if not contents and not tool_strings:
        return ids
    skeleton = chat_text(tokenizer, skeleton_messages, **template_kwargs)
    pattern = f"({re.escape(marker)}:\\d+\ue001|{tool_marker}_\\d+_)"
    pieces = re.split(pattern, skeleton)
    template_ids = [tokenizer.encode(piece, add_special_tokens=False) for piece in pieces[0::2]]
    control = set(tokenizer.added_tokens_decoder)
    if [t for t in ids if t in control] == [t for piece in template_ids for t in piece if t in control]:
        return ids
    texts = _placeholder_texts(pieces, contents, tool_strings, text)
    if texts is None:  # a template that changed a tool string's text some other way: refuse to guess
        raise UnescapedToolText(
            "tool definitions or message fields hold control-token text that this chat template prints in a form "
            "specd cannot escape"
        )
    logger.info("message content or tool definitions held control-token text: encoded as plain text")
    plain = plain_encoder(tokenizer)
    escaped: list[int] = []
    for j in range(len(pieces)):
        escaped += template_ids[j // 2] if j % 2 == 0 else plain(texts[j // 2])
    return escaped


def _with_placeholders(value: Any, marker: str, strings: dict[str, str], added: list[str]) -> Any:
    """`value` (tool definitions) with every string that could make a control token (it holds
    an added token's text, or starts or ends with part of one) replaced by a placeholder recorded
    in `strings`, object keys included. Other strings stay: a template may test them (`type` is
    `"function"`) or look keys up by name."""
    if isinstance(value, str):
        if not _could_make_control(value, added):
            return value
        placeholder = f"{marker}_{len(strings)}_"
        strings[placeholder] = value
        return placeholder
    if isinstance(value, dict):
        return {
            _with_placeholders(k, marker, strings, added): _with_placeholders(v, marker, strings, added)
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [_with_placeholders(v, marker, strings, added) for v in value]
    return value


def _could_make_control(text: str, added: list[str]) -> bool:
    return any(
        token in text or any(text.endswith(token[:i]) or text.startswith(token[i:]) for i in range(1, len(token)))
        for token in added
    )


def _placeholder_texts(
    pieces: list[str], contents: dict[str, str], tool_strings: dict[str, str], text: str
) -> list[str] | None:
    """The text each placeholder in `pieces` (odd indices) stands for in the real rendering
    `text`: message content as it is; a tool string JSON-escaped (`tojson`) or raw, whichever
    the template printed there, found by walking `text`. None where neither follows."""
    texts: list[str] = []
    pos = 0
    for j, piece in enumerate(pieces):
        if j % 2 == 0:
            if not text.startswith(piece, pos):
                return None
            pos += len(piece)
            continue
        after = pieces[j + 1]
        if piece in contents:
            forms = [contents[piece]]
        else:
            forms = [_json_escaped(tool_strings[piece]), tool_strings[piece]]
        form = next((f for f in forms if text.startswith(f, pos) and text.startswith(after, pos + len(f))), None)
        if form is None:
            return None
        texts.append(form)
        pos += len(form)
    return texts if pos == len(text) else None


def _json_escaped(value: str) -> str:
    return json.dumps(value, ensure_ascii=False)[1:-1]  # as transformers' `tojson` filter writes it


def plain_encoder(tokenizer: Any) -> Callable[[str], list[int]]:
    """Encodes text as the tokenizer's model does, with no added token matched (built once per
    tokenizer: a copy of its `tokenizers` pipeline without the added vocabulary)."""
    try:
        return _plain_encoders[tokenizer]
    except KeyError:
        pass
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is not None:
        from tokenizers import Tokenizer

        spec = json.loads(backend.to_str())
        spec["added_tokens"] = []
        bare = Tokenizer.from_str(json.dumps(spec))

        def encode(text: str) -> list[int]:
            return bare.encode(text, add_special_tokens=False).ids

    else:  # a slow (Python) tokenizer: it splits on special tokens only

        def encode(text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)

    _plain_encoders[tokenizer] = encode
    return encode
