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

# tokenizer -> an encoder of text that knows none of its added tokens
_plain_encoders: weakref.WeakKeyDictionary[Any, Callable[[str], list[int]]] = weakref.WeakKeyDictionary()


def chat_ids(tokenizer: Any, messages: list[dict[str, Any]], **template_kwargs: Any) -> list[int]:
    """The chat's prompt token ids; `template_kwargs` go to `chat_text`. Template errors propagate."""
    ids = tokenizer.encode(chat_text(tokenizer, messages, **template_kwargs), add_special_tokens=False)
    marker = "\ue000" + secrets.token_hex(8)  # private-use characters and a nonce: no content can hold it
    contents: dict[str, str] = {}
    skeleton_messages = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if message.get("role") in ESCAPED_ROLES and isinstance(content, str) and content:
            placeholder = f"{marker}:{i}\ue001"
            contents[placeholder] = content
            message = {**message, "content": placeholder}
        skeleton_messages.append(message)
    if not contents:
        return ids
    skeleton = chat_text(tokenizer, skeleton_messages, **template_kwargs)
    pieces = re.split(f"({re.escape(marker)}:\\d+\ue001)", skeleton)
    template_ids = [tokenizer.encode(piece, add_special_tokens=False) for piece in pieces[0::2]]
    control = set(tokenizer.added_tokens_decoder)
    if [t for t in ids if t in control] == [t for piece in template_ids for t in piece if t in control]:
        return ids
    logger.info("message content held control-token text: encoded as plain text")
    plain = plain_encoder(tokenizer)
    escaped: list[int] = []
    for j, piece in enumerate(pieces):
        escaped += template_ids[j // 2] if j % 2 == 0 else plain(contents[piece])
    return escaped


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
