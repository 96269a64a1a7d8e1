"""Speculation under a grammar, end to end through the engine on the tiny model (float32):
every row's output obeys its grammar, grammar-forced drafts are verified and accepted, and
greedy output with speculation (every proposer, `auto`, beside unconstrained rows) equals
greedy output without it."""

from __future__ import annotations

import json

import jsonschema
import pytest

from models.grammar import GrammarTokenizer, json_schema_grammar, regex_grammar
from models.loader import ModelConfig, load_model
from scheduler.offline import run_offline
from scheduler.scheduler import SchedulerConfig
from scheduler.types import FinishReason, Request, SamplingParams
from speculation.config import ProposerConfig, SpecConfig
from worker.builder import build_runner
from worker.runner import RunnerConfig

SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue", "yellow"]},
        "ok": {"type": "boolean"},
        "size": {"enum": ["small", "medium", "large"]},
        "tags": {"type": "array", "items": {"enum": ["alpha", "beta"]}, "maxItems": 2},
    },
    "required": ["colour", "ok", "size", "tags"],
    "additionalProperties": False,
}
PROMPTS = ["Hello world! How are you", "def add(a, b):\n    return", "A B C D E F G", "for i in range(10):\n"]


@pytest.fixture(scope="module")
def target(tiny_llama_dir):
    return load_model(ModelConfig(str(tiny_llama_dir), dtype="float32", device="cpu"))


@pytest.fixture(scope="module")
def grammar_tokenizer(target):
    return GrammarTokenizer(target.tokenizer, target.eos_token_ids, target.vocab_size)


def generate(target, proposer, grammars, speculation, temperature=0.0, seed=0, unconstrained=0):
    """Each prompt under its grammar (None: free text), plus `unconstrained` free rows."""
    runner = build_runner(target, RunnerConfig(max_num_seqs=8, max_model_len=256), proposer)
    config = SchedulerConfig(
        max_num_seqs=8, max_model_len=256, eos_token_ids=target.eos_token_ids, spec=SpecConfig(num_speculative_tokens=4)
    )
    requests = []
    for i, prompt in enumerate(PROMPTS):
        params = SamplingParams(max_tokens=60, temperature=temperature, seed=seed + i, speculation=speculation)
        ids = target.tokenizer.encode(prompt)
        constraint = grammars[i % len(grammars)].start() if grammars else None
        requests.append(Request(f"r{i}", ids, params, constraint=constraint))
    for i in range(unconstrained):
        params = SamplingParams(max_tokens=20, temperature=0.0, seed=i, speculation=speculation)
        requests.append(Request(f"free{i}", target.tokenizer.encode(PROMPTS[i]), params))
    done = run_offline(runner, config, requests)
    assert all(c.error is None for c in done), [c.error for c in done]
    return done


def parsed(target, completion) -> dict:
    assert completion.finish_reason is FinishReason.STOP
    value = json.loads(target.tokenizer.decode(completion.token_ids))
    jsonschema.validate(value, SCHEMA)
    return value


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_output_obeys_its_schema(target, grammar_tokenizer, temperature):
    grammar = grammar_tokenizer.compile(json_schema_grammar(SCHEMA, any_whitespace=False))
    for completion in generate(target, ProposerConfig("ngram"), [grammar], True, temperature)[: len(PROMPTS)]:
        parsed(target, completion)


@pytest.mark.parametrize("proposer", ["ngram", "suffix", "draft_model", "none"])
def test_greedy_with_speculation_equals_without_under_a_grammar(target, grammar_tokenizer, tiny_draft_dir, proposer):
    grammars = [
        grammar_tokenizer.compile(json_schema_grammar(SCHEMA, any_whitespace=False)),
        grammar_tokenizer.compile(regex_grammar(r"(ab|cd|[a-z ]){5,30}\.")),
    ]
    config = ProposerConfig(proposer, draft_model=str(tiny_draft_dir) if proposer == "draft_model" else None)
    plain = generate(target, ProposerConfig("none"), grammars, False, unconstrained=2)
    for mode in (True, "auto"):
        spec = generate(target, config, grammars, mode, unconstrained=2)
        assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
        if mode is True:
            assert sum(c.num_accepted_tokens for c in spec) > 0  # forced drafts at least
    for completion in plain[: len(PROMPTS) : 2]:
        parsed(target, completion)


def test_forced_tokens_are_drafted_and_accepted(target, grammar_tokenizer):
    grammar = grammar_tokenizer.compile(json_schema_grammar(SCHEMA, any_whitespace=False))
    done = generate(target, ProposerConfig("none"), [grammar], True)
    drafts = sum(c.num_draft_tokens for c in done)
    # Keys, quotes and the rest of each enum value: most of such an answer is forced.
    assert drafts > 0 and sum(c.num_accepted_tokens for c in done) == drafts
    assert sum(c.num_chunks for c in done) < sum(len(c.token_ids) for c in done) / 2


def test_sampled_output_under_a_grammar_keeps_the_target_distribution(target, grammar_tokenizer):
    """At temperature 1, speculation (forced drafts and n-gram drafts, verified under the mask)
    draws the same distribution over a grammar's sentences as plain decoding (chi-square)."""
    import llguidance
    from scipy.stats import chi2_contingency

    choices = ["red", "green", "blue", "red green", "green blue", "blue red blue", "hello world"]
    grammar = grammar_tokenizer.compile(llguidance.grammar_from("choice", json.dumps(choices)))

    def texts(speculation) -> list[str]:
        out = []
        for batch in range(40):
            done = generate(target, ProposerConfig("ngram"), [grammar], speculation, 1.0, seed=1000 * batch)
            out += [target.tokenizer.decode(c.token_ids) for c in done]
        return out

    plain, spec = texts(False), texts(True)
    assert set(plain) <= set(choices) and set(spec) <= set(choices)
    seen = sorted(set(plain) | set(spec))
    table = [[group.count(t) for t in seen] for group in (plain, spec)]
    assert len(seen) >= 3 and chi2_contingency(table)[1] > 1e-3
