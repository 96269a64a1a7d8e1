"""Paged KV through the whole engine (tiny models, float32): a prefix-cache hit and a
preemption change nothing in the output, token for token, with speculation on."""

from __future__ import annotations

import asyncio

import pytest

from models.loader import ModelConfig, load_model
from scheduler.engine import AsyncEngine
from scheduler.offline import Completion, collect
from scheduler.scheduler import SchedulerConfig
from scheduler.types import Request, SamplingParams
from speculation.config import ProposerConfig, SpecConfig
from worker.builder import build_runner
from worker.runner import RunnerConfig

BLOCK = 8
SYSTEM = "You are a careful assistant. Answer in one short line, and repeat the question first. " * 2


@pytest.fixture(scope="module")
def target(tiny_llama_dir):
    return load_model(ModelConfig(str(tiny_llama_dir), dtype="float32", device="cpu"))


@pytest.fixture(params=["ngram", "eagle"])
def proposer(request, tiny_llama_head_dir) -> ProposerConfig:
    """Prompt lookup, or an EAGLE head: its features and KV follow the same blocks."""
    if request.param == "eagle":
        return ProposerConfig("eagle", draft_head=str(tiny_llama_head_dir))
    return ProposerConfig("ngram")


def engine_parts(target, proposer, num_kv_blocks=None, prefix_caching=True, max_num_seqs=4):
    runner = build_runner(
        target,
        RunnerConfig(max_num_seqs=4, max_model_len=256, block_size=BLOCK, num_kv_blocks=num_kv_blocks),
        proposer,
    )
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_model_len=256,
        max_num_batched_tokens=256,
        eos_token_ids=target.eos_token_ids,
        spec=SpecConfig(num_speculative_tokens=4),
        num_kv_blocks=runner.config.num_kv_blocks,
        block_size=BLOCK,
        prefix_caching=prefix_caching,
    )
    return runner, config


def request(target, rid: str, text: str, max_tokens: int = 24, speculation=True) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, speculation=speculation)
    return Request(rid, target.tokenizer(text).input_ids, params)


def staggered(target, proposer, prefix_caching: bool) -> dict[str, Completion]:
    """Two long requests decode; then, mid-batch, requests that share their prompts'
    prefixes arrive: whole blocks of it, a prefix ending inside a block, and all of it."""

    async def main() -> dict[str, Completion]:
        runner, config = engine_parts(target, proposer, prefix_caching=prefix_caching)
        engine = AsyncEngine(runner, config, inline=True)
        await engine.start()
        try:
            first = [request(target, "a", SYSTEM + "What is 2 + 2?", 40), request(target, "b", "Count: 1 2 3 4", 40)]
            tasks = [asyncio.ensure_future(collect(engine, r)) for r in first]
            while engine.scheduler.get("a") is None or len(engine.scheduler.get("a").output_ids) < 4:
                await asyncio.sleep(0.01)
            later = [
                request(target, "c", SYSTEM + "What is 3 + 5?"),  # shares the system prompt's blocks
                request(target, "d", SYSTEM[:50]),  # a prefix ending inside a block of a's prompt
                request(target, "e", SYSTEM + "What is 2 + 2?", speculation=False),  # all of a's prompt
            ]
            tasks += [asyncio.ensure_future(collect(engine, r)) for r in later]
            done = await asyncio.gather(*tasks)
            return {c.request_id: c for c in done}
        finally:
            await engine.stop(timeout=0)

    return asyncio.run(main())


def test_cache_hits_mid_batch_give_the_same_tokens_as_no_caching(target, proposer):
    cached = staggered(target, proposer, prefix_caching=True)
    fresh = staggered(target, proposer, prefix_caching=False)
    for rid in "abcde":
        assert cached[rid].token_ids == fresh[rid].token_ids, rid
        assert fresh[rid].num_cached_tokens == 0
    prompt = len(target.tokenizer(SYSTEM + "What is 2 + 2?").input_ids)
    assert cached["c"].num_cached_tokens >= 2 * BLOCK
    assert 0 < cached["d"].num_cached_tokens < len(target.tokenizer(SYSTEM[:50]).input_ids)
    assert cached["e"].num_cached_tokens == (prompt - 1) // BLOCK * BLOCK  # the last block is recomputed
    assert cached["a"].num_draft_tokens > 0 and cached["c"].num_draft_tokens > 0  # speculation did run


def test_preemption_under_a_tiny_pool_keeps_every_token(target, proposer):
    prompts = ["Hello world! How are you", "def add(a, b):\n    return", "A B C D E F G", "for i in range(10):\n"]

    async def main(num_kv_blocks):
        runner, config = engine_parts(target, proposer, num_kv_blocks=num_kv_blocks)
        engine = AsyncEngine(runner, config, inline=True)
        await engine.start()
        try:
            reqs = [request(target, f"r{i}", p, max_tokens=40) for i, p in enumerate(prompts)]
            return await asyncio.gather(*(collect(engine, r) for r in reqs)), engine.scheduler
        finally:
            await engine.stop(timeout=0)

    roomy, _ = asyncio.run(main(None))
    # 12 blocks of 8 = 96 positions for four requests that each grow to ~50: some must be preempted.
    tight, scheduler = asyncio.run(main(12))
    assert scheduler.num_preemptions > 0
    assert all(c.error is None for c in tight)
    assert [c.token_ids for c in tight] == [c.token_ids for c in roomy]
    assert scheduler.blocks.num_used == 0  # nothing leaked
