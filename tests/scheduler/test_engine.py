"""The engine end to end on real (tiny and SmolLM2) models: exactness, seeds, aborts, capacity."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from models.loader import ModelConfig, load_model
from scheduler.engine import AsyncEngine, EngineDeadError
from scheduler.offline import collect, run_offline
from scheduler.scheduler import SchedulerConfig
from scheduler.types import FinishReason, Request, SamplingParams
from speculation.config import ProposerConfig, SpecConfig
from speculation.proposer import Drafting
from worker.builder import build_runner
from worker.runner import RunnerConfig

PROMPTS = ["Hello world", "def add(a, b):", "The quick brown fox", "for i in range(10):\n"]


def make_runner(model_dir, method="none", draft=None, max_num_seqs=4, max_model_len=256):
    target = load_model(ModelConfig(str(model_dir), dtype="float32", device="cpu"))
    runner = build_runner(
        target, RunnerConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len), ProposerConfig(method, draft)
    )
    return target, runner


def sched_config(target, max_num_seqs=4, **spec) -> SchedulerConfig:
    return SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_model_len=256,
        max_num_batched_tokens=128,
        eos_token_ids=target.eos_token_ids,
        spec=SpecConfig(**spec),
    )


def hf_greedy(model_dir_or_loaded, prompt_ids: list[int], n: int) -> list[int]:
    model = model_dir_or_loaded.model
    out = model.generate(
        torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(prompt_ids) :].tolist()


def greedy_requests(tokenizer, tag: str, n: int = 24, **params) -> list[Request]:
    return [
        Request(
            f"{tag}{i}", tokenizer(p).input_ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **params)
        )
        for i, p in enumerate(PROMPTS)
    ]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_matches_hf_generate_alone_and_batched(arch, tiny_llama_dir, tiny_qwen2_dir):
    model_dir = tiny_llama_dir if arch == "llama" else tiny_qwen2_dir
    target, runner = make_runner(model_dir)
    reference = load_model(ModelConfig(str(model_dir), dtype="float32", device="cpu"))
    config = sched_config(target)
    expected = [hf_greedy(reference, r.prompt_ids, 24) for r in greedy_requests(target.tokenizer, "x")]
    batched = run_offline(runner, config, greedy_requests(target.tokenizer, "b"))
    assert [c.token_ids for c in batched] == expected
    for i, request in enumerate(greedy_requests(target.tokenizer, "a")):
        (alone,) = run_offline(runner, config, [request])
        assert alone.token_ids == expected[i]
        assert alone.finish_reason is FinishReason.LENGTH


def test_seeded_sampling_is_independent_of_the_batch(tiny_llama_dir):
    target, runner = make_runner(tiny_llama_dir)
    config = sched_config(target)
    ids = target.tokenizer("Hello world").input_ids

    def sampled(rid, seed, **kw):
        return Request(
            rid, ids, SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=seed, ignore_eos=True, **kw)
        )

    (alone,) = run_offline(runner, config, [sampled("alone", 1234)])
    together = run_offline(runner, config, [sampled("n1", 7), sampled("in-batch", 1234), sampled("n2", 8)])
    assert together[1].token_ids == alone.token_ids
    assert together[0].token_ids != alone.token_ids  # other seeds, other samples
    (again,) = run_offline(runner, config, [sampled("again", 1234, presence_penalty=0.0)])
    assert again.token_ids == alone.token_ids


def test_abort_frees_kv_and_many_requests_leave_usage_zero(tiny_llama_dir):
    target, runner = make_runner(tiny_llama_dir, max_num_seqs=8)
    config = sched_config(target, max_num_seqs=8)
    ids = target.tokenizer("The quick brown fox").input_ids

    async def main():
        engine = AsyncEngine(runner, config)
        await engine.start()
        long = Request("long", ids, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
        stream = engine.submit(long)
        received = 0
        async for out in stream:
            received += len(out.new_token_ids)
            if received >= 5:
                break
        assert engine.kv_usage > 0
        stream.abort()
        async for out in stream:
            last = out
        assert last.finish_reason is FinishReason.ABORT
        assert engine.kv_usage == 0 and engine.num_running == 0

        requests = [
            Request(f"r{i}", ids, SamplingParams(max_tokens=3 + i % 5, temperature=0.8, ignore_eos=True))
            for i in range(100)
        ]
        results = await asyncio.gather(*(collect(engine, r) for r in requests))
        assert all(r.finish_reason is FinishReason.LENGTH for r in results)
        assert engine.kv_usage == 0 and engine.num_running == 0 and engine.num_waiting == 0
        await engine.stop(timeout=1)

    asyncio.run(main())


def test_failures_stay_with_their_request(tiny_llama_dir):
    target = load_model(ModelConfig(str(tiny_llama_dir), dtype="float32", device="cpu"))
    runner = build_runner(
        target, RunnerConfig(max_num_seqs=4, max_model_len=256, enable_fault_injection=True), ProposerConfig("ngram")
    )
    config = sched_config(target)
    (expected,) = [c.token_ids for c in run_offline(runner, config, greedy_requests(target.tokenizer, "e", n=16)[:1])]
    good = greedy_requests(target.tokenizer, "g", n=16)
    bad_raise = Request("raise", good[1].prompt_ids, SamplingParams(max_tokens=8, fault="raise"))
    bad_nan = Request("nan", good[2].prompt_ids, SamplingParams(max_tokens=8, fault="nan"))
    results = run_offline(runner, config, [good[0], bad_raise, bad_nan])
    assert results[0].token_ids == expected and results[0].finish_reason is FinishReason.LENGTH
    assert results[1].finish_reason is FinishReason.ERROR and "injected" in results[1].error
    assert results[2].finish_reason is FinishReason.ERROR and "non-finite" in results[2].error


@pytest.fixture(scope="module")
def smollm2(specd_cache_dir):
    # Dense weights: a quantized layer rounds its input rows to int8, and a row a last bit apart (HF's
    # forward against ours, a verify against a one-token step) can round to another code, so greedy
    # text matches only where no near-tie falls (docs/determinism.md); tests/models/test_weights.py
    # holds speculation to the quantized model.
    config = ModelConfig(None, dtype="float32", device="cpu", cache_dir=specd_cache_dir, weights="bf16")
    target = load_model(config)
    reference = load_model(config)
    return target, reference


@pytest.fixture(scope="module")
def smollm2_head(smollm2, tmp_path_factory):
    """A freshly initialised EAGLE head for SmolLM2 (the bundled one may not exist yet), perturbed so
    its drafts depend on the features; losslessness needs no training."""
    from models.eagle_head import new_head, save_head

    target, _ = smollm2
    head = new_head(target.model, torch.arange(8192))  # the most frequent ids are among the first (BPE merges)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        head.fc.weight.add_(torch.randn(head.fc.weight.shape, generator=generator) * 0.02)
    path = tmp_path_factory.mktemp("heads") / "smollm2"
    save_head(head, path, dtype=torch.float32)
    return path


@pytest.mark.parametrize("method", ["ngram", "suffix", "eagle"])
def test_smollm2_greedy_matches_hf_generate(smollm2, smollm2_head, method):
    target, reference = smollm2
    proposer = ProposerConfig(method, draft_head=str(smollm2_head) if method == "eagle" else None)
    runner = build_runner(target, RunnerConfig(max_num_seqs=4, max_model_len=512), proposer)
    config = sched_config(target, num_speculative_tokens=4)
    tok = target.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True) for p in PROMPTS]
    prompts = [p if isinstance(p, list) else p["input_ids"] for p in prompts]
    expected = [hf_greedy(reference, p, 24) for p in prompts]

    def requests(tag, speculation):
        return [
            Request(
                f"{tag}{i}", p, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, speculation=speculation)
            )
            for i, p in enumerate(prompts)
        ]

    assert [c.token_ids for c in run_offline(runner, config, requests("plain", False))] == expected
    spec = run_offline(runner, config, requests("spec", True))
    assert [c.token_ids for c in spec] == expected
    assert sum(c.num_draft_tokens for c in spec) > 0
    (alone,) = run_offline(runner, config, requests("one", True)[:1])
    assert alone.token_ids == expected[0]
    if method == "suffix":  # most of its tokens came from the "spec" pass's cached output
        assert alone.num_accepted_tokens >= 16


def test_a_failing_metrics_observer_never_stops_the_engine(tiny_llama_dir):
    target, runner = make_runner(tiny_llama_dir, "ngram")
    config = sched_config(target)

    def broken(stats):
        raise ValueError("observer bug")

    async def main():
        engine = AsyncEngine(runner, config, observer=broken, inline=True)
        await engine.start()
        try:
            return await asyncio.wait_for(collect(engine, greedy_requests(target.tokenizer, "o", n=8)[0]), 30)
        finally:
            await engine.stop(timeout=1)

    result = asyncio.run(main())
    assert result.finish_reason is FinishReason.LENGTH and len(result.token_ids) == 8


def test_a_fault_in_the_loops_own_bookkeeping_ends_every_request_instead_of_hanging_them(tiny_llama_dir):
    """A fault outside any request's step (here `Scheduler.update`) leaves state nothing can
    trust: every request in flight, running or queued, ends with the reason, new ones are
    refused, the owner is told, and stopping does not wait for work that can never finish."""
    target, runner = make_runner(tiny_llama_dir, "ngram", max_num_seqs=2)
    config = sched_config(target, max_num_seqs=2)
    deaths: list[str] = []

    async def main():
        engine = AsyncEngine(runner, config, inline=True, on_dead=deaths.append)
        update, calls = engine.scheduler.update, []

        def failing_update(*args, **kwargs):
            calls.append(1)
            if len(calls) == 3:
                raise KeyError("block 17")
            return update(*args, **kwargs)

        engine.scheduler.update = failing_update
        await engine.start()
        requests = greedy_requests(target.tokenizer, "d", n=16)  # 4 requests, 2 running at a time
        results = await asyncio.wait_for(asyncio.gather(*(collect(engine, r) for r in requests)), 30)
        with pytest.raises(EngineDeadError, match="block 17"):
            engine.submit(greedy_requests(target.tokenizer, "late")[0])
        await asyncio.wait_for(engine.stop(timeout=30), 5)
        return engine, results

    engine, results = asyncio.run(main())
    assert not engine.is_running and deaths == ["KeyError: 'block 17'"]
    for result in results:
        assert result.finish_reason is FinishReason.ERROR and result.error == "the engine stopped: KeyError: 'block 17'"
    assert sum(len(r.token_ids) for r in results) > 0  # tokens had streamed before the fault


def test_the_policy_starts_from_the_proposers_own_acceptance_record():
    """An executor whose proposer measured its own acceptance (an EAGLE head's held-out
    record) gives the policy its starting rates; a config that names them keeps its own."""

    class Recorded:
        drafting = Drafting("eagle", prior_rates=(0.27, 0.24))

        def execute(self, batch):
            raise AssertionError("no step runs here")

    config = SchedulerConfig(max_num_seqs=1, max_model_len=64, eos_token_ids=[0])
    assert AsyncEngine(Recorded(), config, inline=True).scheduler.policy.config.prior_rates == (0.27, 0.24)
    pinned = SchedulerConfig(max_num_seqs=1, max_model_len=64, eos_token_ids=[0], spec=SpecConfig(prior_rates=(0.5,)))
    assert AsyncEngine(Recorded(), pinned, inline=True).scheduler.policy.config.prior_rates == (0.5,)


class SlowRunner:
    """The runner, with every step taking at least `seconds` (a slow machine)."""

    def __init__(self, runner, seconds: float):
        self.runner, self.seconds = runner, seconds

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def execute(self, batch):
        time.sleep(self.seconds)
        return self.runner.execute(batch)


@pytest.mark.slow
def test_run_offline_stops_at_its_deadline_and_keeps_what_came(tiny_llama_dir):
    target, runner = make_runner(tiny_llama_dir, max_num_seqs=2)
    ids = target.tokenizer("The quick brown fox").input_ids

    def request(name: str, n: int) -> Request:
        return Request(name, ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))

    # Two slots: "short" ends within a few steps and "late" takes its slot; the two long ones run
    # ~50 of their 200 steps by the deadline; "never" waits behind them.
    requests = [request("short", 3), request("long", 200), request("late", 200), request("never", 3)]
    finished: list[str] = []
    completions = run_offline(
        SlowRunner(runner, 0.02),
        sched_config(target, max_num_seqs=2),
        requests,
        on_finished=lambda c: finished.append(c.request_id),
        deadline=time.monotonic() + 1.0,
    )
    by_id = {c.request_id: c for c in completions}
    answer = hf_greedy(load_model(ModelConfig(str(tiny_llama_dir), dtype="float32", device="cpu")), ids, 200)
    assert [c.request_id for c in completions] == ["short", "long", "late", "never"]  # the requests' order
    assert finished == ["short"] and by_id["short"].finish_reason is FinishReason.LENGTH
    assert by_id["short"].token_ids == answer[:3]
    for name in ("long", "late"):
        cut = by_id[name]
        assert cut.finish_reason is FinishReason.ABORT and 0 < len(cut.token_ids) < 200
        assert cut.token_ids == answer[: len(cut.token_ids)]  # a prefix of its answer
    assert by_id["never"].finish_reason is FinishReason.ABORT and by_id["never"].token_ids == []
