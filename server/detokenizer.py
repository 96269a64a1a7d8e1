"""Streaming text: incremental detokenization, stop-string holdback, token bytes.

Decoding a growing token list one step at a time must neither split a
multi-byte character (byte-level BPE spreads one emoji over several tokens)
nor lose the spaces that SentencePiece tokenizers only render in context.
`IncrementalDetokenizer` decodes a small window: the tokens already shown
(for context) plus the new ones, and releases the difference once it no
longer ends in an incomplete character.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded as left context for the first output tokens.
PROMPT_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        # ids[prefix_offset:read_offset] were already shown; their text is the context.
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        # Characters past ids[:read_offset] already released (those before an unfinished one).
        self._num_sent_ahead = 0

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def push(self, token_ids: list[int]) -> str:
        """Text completed by `token_ids`; an unfinished character waits for the next push."""
        self._ids.extend(token_ids)
        return self._release(final=False)

    def flush(self) -> str:
        """Whatever is left at the end (an unfinished character becomes U+FFFD)."""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        shown = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        new = full[len(shown) + self._num_sent_ahead :]
        stable = new if final else new.rstrip(REPLACEMENT_CHAR)
        if len(stable) < len(new):
            # Complete characters before an unfinished one can go now; the window stays.
            self._num_sent_ahead += len(stable)
            return stable
        if len(full) > len(shown):
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            self._num_sent_ahead = 0
        return stable


class StopStringMatcher:
    """Holds back text that could be the start of a stop string.

    Text is released only once no stop string can begin in it; a matched stop
    string and everything after it are never released (unless
    `include_stop` keeps the stop string itself).
    """

    def __init__(self, stops: list[str], include_stop: bool = False):
        self._stops = [s for s in stops if s]
        self._include_stop = include_stop
        self._held = ""
        self._consumed = 0  # characters pushed so far
        self.stop_end: int | None = None  # where the matched stop string ends, in characters of the output

    @property
    def active(self) -> bool:
        return bool(self._stops)

    def push(self, text: str) -> tuple[str, bool]:
        """The text safe to show now, and whether a stop string matched (the output ends)."""
        if not self._stops:
            return text, False
        base = self._consumed - len(self._held)  # output offset of the held text
        self._consumed += len(text)
        held = self._held + text
        match = self._first_match(held)
        if match is not None:
            start, stop = match
            self.stop_end = base + start + len(stop)
            self._held = ""
            return held[: start + len(stop) if self._include_stop else start], True
        keep = self._partial_match_length(held)
        self._held = held[len(held) - keep :] if keep else ""
        return held[: len(held) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _first_match(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self._stops:
            index = text.find(stop)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        return best

    def _partial_match_length(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stops:
            tail = text[-(len(stop) - 1) :] if len(stop) > 1 else ""
            start = tail.find(stop[0])
            while start != -1 and len(tail) - start > longest:
                if stop.startswith(tail[start:]):
                    longest = len(tail) - start
                    break
                start = tail.find(stop[0], start + 1)
        return longest


# -- per-token text for logprobs ---------------------------------------------------

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """The inverse of GPT-2's byte -> printable character map used by byte-level BPE."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


class TokenTexts:
    """Each token's own text and exact bytes (a token may hold part of a character)."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        cached = self._cache.get(token_id)
        if cached is None:
            raw = self._token_bytes(token_id)
            cached = self._cache[token_id] = (raw.decode("utf-8", errors="replace"), list(raw))
        return cached

    def _token_bytes(self, token_id: int) -> bytes:
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        if piece in self._tokenizer.all_special_tokens:
            return piece.encode()
        byte_token = _BYTE_TOKEN.fullmatch(piece)
        if byte_token:  # SentencePiece byte fallback
            return bytes([int(byte_token.group(1), 16)])
        decoded = self._tokenizer.decode([token_id])
        if REPLACEMENT_CHAR not in decoded:
            return piece.replace("\u2581", " ").encode() if piece.startswith("\u2581") else decoded.encode()
        byte_map = _byte_level_decoder()
        if all(ch in byte_map for ch in piece):  # byte-level BPE: each char stands for one byte
            return bytes(byte_map[ch] for ch in piece)
        return decoded.encode()
