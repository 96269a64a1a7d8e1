"""A GGUF's tokenizer as transformers should have converted it: every control and user-defined
token of the GGUF vocabulary an added token.

Some transformers releases (5.17 among them) keep only the bos/eos/pad tokens as added tokens when
they convert a GGUF tokenizer; the rest of the GGUF's control tokens (`<|object_ref_start|>`,
`<|fim_prefix|>`) and user-defined ones (Qwen2.5's `<tool_call>`) then encode as plain BPE pieces.
A tool call in the chat history would reach the model spelled in a dozen tokens instead of the one
it was trained on, and the chat-template escaping (`models.chat_escape`) could not see them as
control tokens. The GGUF's own token types say which tokens these are.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken
from transformers import PreTrainedTokenizerBase

# llama.cpp's token types (gguf.TokenType): CONTROL tokens are special, USER_DEFINED ones are
# added tokens that decode as text.
_CONTROL, _USER_DEFINED = 3, 4


def gguf_added_tokens(path: Path) -> list[tuple[int, str, bool]]:
    """(id, text, special) for every control and user-defined token in the GGUF's vocabulary."""
    import gguf  # transformers' own GGUF reader dependency

    fields = gguf.GGUFReader(path).fields
    tokens, types = fields.get("tokenizer.ggml.tokens"), fields.get("tokenizer.ggml.token_type")
    if tokens is None or types is None:
        return []
    added = []
    for i, (token_index, type_index) in enumerate(zip(tokens.data, types.data, strict=True)):
        kind = int(types.parts[type_index][0])
        if kind in (_CONTROL, _USER_DEFINED):
            added.append((i, bytes(tokens.parts[token_index]).decode("utf-8"), kind == _CONTROL))
    return added


def restore_added_tokens(tokenizer: PreTrainedTokenizerBase, path: Path) -> int:
    """Make every control and user-defined GGUF token an added token of `tokenizer` with its GGUF
    id; return how many were missing. A token whose text the vocabulary maps to another id is left
    alone rather than given a second id."""
    have = set(tokenizer.added_tokens_decoder)
    missing = [(i, text, special) for i, text, special in gguf_added_tokens(path) if i not in have]
    restored = 0
    for i, text, special in missing:
        if tokenizer.convert_tokens_to_ids(text) != i:
            continue
        token = AddedToken(text, special=special, normalized=False, lstrip=False, rstrip=False, single_word=False)
        tokenizer.add_tokens([token], special_tokens=special)
        restored += 1
    return restored
