"""The grammar-engine benchmark on the tiny tokenizer: its walked documents are valid instances
of their schemas, and it runs end to end with llguidance alone (xgrammar is not installed in CI)."""

from __future__ import annotations

import json

import jsonschema
import llguidance.hf
from transformers import AutoTokenizer

from benchmarks import grammar_bench
from benchmarks.structured_bench import load_tasks


def test_walked_documents_validate_against_their_schemas(tiny_llama_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    schemas = [task.schema for task in load_tasks()][:4]
    ll = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))
    docs = grammar_bench.documents(ll, schemas, len(tokenizer), tokenizer)
    finished = 0
    for schema, doc in zip(schemas, docs):
        assert doc
        text = tokenizer.decode(doc)
        if len(doc) < grammar_bench.DOC_TOKENS:  # ended by the grammar: a whole document
            jsonschema.validate(json.loads(text), schema)
            finished += 1
    assert finished


def test_the_table_has_llguidance(tiny_llama_dir, capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(grammar_bench, "default_cache_dir", lambda: tmp_path)  # no xgrammar there
    assert grammar_bench.main(["--model", str(tiny_llama_dir)]) == 0
    out = capsys.readouterr().out
    assert "| engine | tokenizer set-up s |" in out and "| llguidance |" in out
