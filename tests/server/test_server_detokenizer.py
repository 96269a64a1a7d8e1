"""Incremental detokenization and stop-string holdback, without a server."""

from __future__ import annotations

import pytest

from server.detokenizer import IncrementalDetokenizer, StopStringMatcher, TokenTexts
from tests.support.tiny_models import build_tokenizer

TEXTS = ["Café naïve — über 日本語 😀 emoji", "Hello world! 😀😀 é", "plain ascii only"]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("step", [1, 2, 3])
def test_pieces_never_split_a_character(tokenizer, text, step):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids) or text.isascii()
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids=tokenizer.encode("prompt: "))
    pieces = [detokenizer.push(ids[i : i + step]) for i in range(0, len(ids), step)]
    pieces.append(detokenizer.flush())
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == text


def test_flush_renders_an_unfinished_character(tokenizer):
    ids = tokenizer.encode("ab😀", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert detokenizer.push(ids[:-1]) == "ab"  # the emoji's last byte is missing
    assert detokenizer.flush() == "\ufffd"


def test_special_tokens_are_skipped_unless_asked(tokenizer):
    ids = tokenizer.encode("hi", add_special_tokens=False) + [tokenizer.eos_token_id]
    assert IncrementalDetokenizer(tokenizer).push(ids) == "hi"
    assert IncrementalDetokenizer(tokenizer, skip_special_tokens=False).push(ids) == "hi<|im_end|>"


def feed(matcher: StopStringMatcher, pieces: list[str]) -> tuple[list[str], bool]:
    shown = []
    for piece in pieces:
        text, matched = matcher.push(piece)
        shown.append(text)
        if matched:
            return shown, True
    shown.append(matcher.flush())
    return shown, False


def test_stop_string_across_pieces_is_held_back_and_never_shown():
    shown, matched = feed(StopStringMatcher(["STOP"]), ["abc S", "T", "O", "Pxyz"])
    assert matched
    assert shown == ["abc ", "", "", ""]


def test_held_text_is_released_when_it_cannot_match():
    shown, matched = feed(StopStringMatcher(["STOP"]), ["abc ST", "ay", " here"])
    assert not matched
    assert shown == ["abc ", "STay", " here", ""]


def test_partial_match_at_the_end_is_flushed():
    shown, matched = feed(StopStringMatcher(["</end>"]), ["text </e"])
    assert not matched
    assert "".join(shown) == "text </e"


def test_earliest_of_several_stop_strings_wins():
    shown, matched = feed(StopStringMatcher(["world", "lo w"]), ["hello world"])
    assert matched and "".join(shown) == "hel"


def test_include_stop_keeps_the_stop_string():
    shown, matched = feed(StopStringMatcher(["\n\n"], include_stop=True), ["a\n", "\nb"])
    assert matched and "".join(shown) == "a\n\n"


def test_stop_string_with_repeated_prefix():
    # "aab" against "aaab": the holdback must keep "aa" after "aaa", not just "a".
    shown, matched = feed(StopStringMatcher(["aab"]), ["xaa", "a", "b"])
    assert matched and "".join(shown) == "xa"


def test_no_stop_strings_pass_text_through():
    assert StopStringMatcher([]).push("anything") == ("anything", False)


def test_token_texts_give_exact_bytes(tokenizer):
    texts = TokenTexts(tokenizer)
    ids = tokenizer.encode("日本 😀 é", add_special_tokens=False)
    raw = b"".join(bytes(texts(i)[1]) for i in ids)
    assert raw.decode("utf-8") == "日本 😀 é"
    assert texts(tokenizer.eos_token_id) == ("<|im_end|>", list(b"<|im_end|>"))
