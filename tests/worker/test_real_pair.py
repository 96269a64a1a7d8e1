"""The real pair, end to end: Qwen2.5-Coder-1.5B-Instruct with its 0.5B sibling as the draft
model, by catalogue name. Runs only where both are pulled (`specd models pull ...`; CI pulls
nothing): `make test-realpair`. Minutes: the 1.5B converts once, then decodes at a few tokens/s."""

from __future__ import annotations

import json

import httpx
import pytest

from models import catalogue
from models.chat_template import chat_text
from models.loader import ModelConfig, default_cache_dir, load_model
from scheduler.offline import run_offline
from scheduler.scheduler import SchedulerConfig
from scheduler.types import Request, SamplingParams
from speculation.config import ProposerConfig, SpecConfig
from tests.support.server import finish_server, serve_args, start_server
from worker.builder import build_runner
from worker.runner import RunnerConfig

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
PULLED = all(catalogue.is_pulled(catalogue.CATALOGUE[name], default_cache_dir()) for name in (TARGET, DRAFT))
pytestmark = [
    pytest.mark.realpair,
    pytest.mark.skipif(not PULLED, reason=f"needs `specd models pull {TARGET}` and `specd models pull {DRAFT}`"),
]


def test_greedy_output_with_the_draft_model_equals_plain_decoding_in_float32():
    """Batch-invariant: the quantized layers round their rows to int8, so outside that mode a row a
    verify step computes a last bit apart from a one-token step can flip a near-tie (docs/determinism.md)."""
    from benchmarks.public_sets import load

    target = load_model(ModelConfig(TARGET, dtype="float32", device="cpu", batch_invariant=True))
    prompts = [text for _, text in load("humaneval")[:8]]
    tokenizer = target.tokenizer
    ids = [tokenizer.encode(chat_text(tokenizer, [{"role": "user", "content": p}]), add_special_tokens=False)
           for p in prompts]  # fmt: skip
    config = SchedulerConfig(max_num_seqs=8, max_model_len=1024, spec=SpecConfig(num_speculative_tokens=4))

    def generate(proposer: ProposerConfig, speculation: bool) -> list[list[int]]:
        runner = build_runner(target, RunnerConfig(max_num_seqs=8, max_model_len=1024), proposer)
        params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True, speculation=speculation)
        done = run_offline(runner, config, [Request(f"r{i}", list(p), params) for i, p in enumerate(ids)])
        assert all(c.error is None for c in done)
        if speculation:
            assert sum(c.num_accepted_tokens for c in done) > 0  # the 0.5B agrees with the 1.5B often
        return [c.token_ids for c in done]

    plain = generate(ProposerConfig("none"), False)
    assert generate(ProposerConfig(draft_model=DRAFT), True) == plain


def test_a_streamed_chat_by_name(tmp_path):
    server = start_server(serve_args(model=TARGET, draft_model=DRAFT, max_model_len=2048), tmp_path, "pair")
    try:
        ask = "Write a Python function that reverses a string."
        body = {"model": TARGET, "stream": True, "max_tokens": 32, "temperature": 0,
                "messages": [{"role": "user", "content": ask}]}  # fmt: skip
        text, finish = "", None
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=300) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    choice = json.loads(line[6:])["choices"][0]
                    text += choice["delta"].get("content") or ""
                    finish = choice.get("finish_reason") or finish
        assert "def " in text and finish in ("stop", "length")
    finally:
        finish_server(server)
