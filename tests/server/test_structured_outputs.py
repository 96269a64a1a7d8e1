"""The request fields that ask for a grammar: what each becomes, and what is refused before any work."""

from __future__ import annotations

import json
import time

import pytest

from models.grammar import GrammarTokenizer
from server.errors import BadRequestError
from server.structured_outputs import (
    MAX_GRAMMAR_CHARS,
    GrammarCompiler,
    GrammarSource,
    from_response_format,
    from_structured_outputs,
)
from tests.support.tiny_models import build_tokenizer


def test_each_field_becomes_one_source():
    assert from_response_format(None) is None and from_response_format({"type": "text"}) is None
    assert from_response_format({"type": "json_object"}).kind == "json"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    source = from_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert json.loads(source.text) == schema and not source.any_whitespace
    assert from_structured_outputs({"json": json.dumps(schema)}).text == source.text  # schema as text too
    assert from_structured_outputs({"json": schema, "disable_any_whitespace": False}).any_whitespace
    assert from_structured_outputs({"regex": "a+"}).kind == "regex"
    assert from_structured_outputs({"choice": ["a", "b"]}).kind == "choice"
    assert from_structured_outputs({"grammar": 'root ::= "a"'}).kind == "grammar"


@pytest.mark.parametrize(
    "text, allowed, refused",
    [
        ('root ::= "a" | "b"', ["a", "b"], ["c"]),  # GBNF
        ('start: "x ::= y" | "b"', ["x ::= y", "b"], ["x"]),  # Lark, "::=" inside a literal
        ('start: "a"\n// a comment mentioning root ::= x\n', ["a"], ["x"]),
    ],
)
def test_grammar_text_is_lark_or_gbnf_as_llguidance_reads_it(text, allowed, refused):
    tokenizer = build_tokenizer()
    grammar = GrammarTokenizer(tokenizer, [tokenizer.eos_token_id], len(tokenizer)).compile(
        from_structured_outputs({"grammar": text}).grammar_text()
    )
    for sentence, ok in [(s, True) for s in allowed] + [(s, False) for s in refused]:
        state = grammar.start()
        ids = tokenizer.encode(sentence, add_special_tokens=False)
        whole = state.accepts(ids) == len(ids) and state.advance(ids) and state.matcher.is_accepting()
        assert whole == ok, (text, sentence)


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"json": {"type": "nonsense"}}, "structured_outputs.json"),
        ({"json": "{not json"}, "structured_outputs.json"),
        ({"regex": ""}, "structured_outputs.regex"),
        ({"choice": ["a", 1]}, "structured_outputs.choice"),
        ({}, None),
        ({"regex": "a", "grammar": "b"}, "structured_outputs"),
    ],
)
def test_malformed_fields_are_refused_naming_them(fields, param):
    if param is None:
        assert from_structured_outputs(fields) is None
        return
    with pytest.raises(BadRequestError) as refused:
        from_structured_outputs(fields)
    assert refused.value.param == param


def test_a_megabyte_schema_is_refused_by_its_size_at_once():
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(40_000)}}
    start = time.perf_counter()
    with pytest.raises(BadRequestError, match=str(MAX_GRAMMAR_CHARS)) as refused:
        from_response_format({"type": "json_schema", "json_schema": {"name": "big", "schema": schema}})
    assert refused.value.param == "response_format.json_schema.schema"
    assert time.perf_counter() - start < 1.0


def test_compiled_grammars_are_cached_by_content_and_refusals_name_the_field():
    tokenizer = build_tokenizer()
    compiled: list[float] = []
    compiler = GrammarCompiler(tokenizer, [tokenizer.eos_token_id], len(tokenizer), on_compiled=compiled.append)
    source = GrammarSource("regex", "[ab]{3}", "structured_outputs.regex")
    assert compiler.compile(source) is compiler.compile(GrammarSource("regex", "[ab]{3}", "structured_outputs.regex"))
    assert len(compiled) == 1
    states = compiler.states(source, 2)
    assert states[0] is not states[1] and states[0].accepts(tokenizer.encode("abab")) < 4
    with pytest.raises(BadRequestError) as refused:
        compiler.compile(GrammarSource("json", json.dumps({"format": "weird"}), "response_format.json_schema.schema"))
    assert refused.value.param == "response_format.json_schema.schema"


def test_prepare_builds_the_grammar_tokenizer_once_and_a_failure_is_logged_not_raised(caplog):
    tokenizer = build_tokenizer()
    compiler = GrammarCompiler(tokenizer, [tokenizer.eos_token_id], len(tokenizer))
    compiler.prepare()
    built = compiler.tokenizer
    compiler.compile(GrammarSource("regex", "[ab]{3}", "structured_outputs.regex"))
    assert compiler.tokenizer is built

    tries: list[int] = []

    class Unreadable:
        def __len__(self) -> int:
            tries.append(1)
            raise RuntimeError("no vocabulary here")

    broken = GrammarCompiler(Unreadable(), [], 16)
    broken.prepare()
    assert "structured outputs are unavailable" in caplog.text and tries
    built = len(tries)
    with pytest.raises(BadRequestError) as refused:  # at once: the build is not tried again
        broken.compile(GrammarSource("regex", "[ab]{3}", "structured_outputs.regex"))
    assert refused.value.code == "structured_outputs_unavailable" and "no vocabulary here" in refused.value.message
    assert len(tries) == built
