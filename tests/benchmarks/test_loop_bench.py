"""benchmarks.loop_bench at CI size: a tiny model through the closed loop, every mode; nothing about speed."""

from __future__ import annotations

from collections import Counter

import pytest

from benchmarks.common import chat_ids, load
from benchmarks.lengths import max_tokens_per_request
from benchmarks.loop_bench import LoopConfig, loop_section, shared_cost_model
from benchmarks.serve_client import load_prompts
from scheduler.offline import run_offline
from scheduler.scheduler import SchedulerConfig
from scheduler.types import Request, SamplingParams
from speculation.config import ProposerConfig
from speculation.cost_model import StepShape
from worker.builder import build_runner
from worker.runner import RunnerConfig


def test_closed_loop_runs_every_mode_and_counts_the_batch(tiny_llama_dir):
    target = load("float32", str(tiny_llama_dir))
    config = LoopConfig(sets=("code", "creative"), batch_sizes=(2,), rounds=2, max_tokens=6)
    text, records = loop_section(target, "float32", config)
    assert [r["mode"] for r in records] == ["off", "on", "auto"]
    by_mode = {r["mode"]: r for r in records}
    for record in records:
        assert record["requests"] == 2 and record["waves"] == 3 and record["tps"] > 0
        assert 1 <= record["rows_per_step"] <= 2  # never more rows than slots
        assert 0 <= record["accepted"] <= record["drafted"]
        assert record["tokens"] == 3 * 2 * 6  # ignore_eos: every mode emits every token
        assert record["modeled_s"] > 0 and record["model_fit"] > 0
    assert by_mode["off"]["drafted"] == 0
    # Off decodes one token per row and step: 6 requests x 6 tokens over <= 2 rows a step.
    assert by_mode["off"]["steps"] >= 6 * 6 / 2
    assert by_mode["auto"]["auto/best"] > 0 and "auto/off" in by_mode["auto"]
    assert by_mode["auto"]["auto/best modeled"] > 0
    assert "| requests | waves | mode |" in text and "Closed loop (float32, code+creative" in text


def test_waves_set_the_queue_and_modes_can_be_chosen(tiny_llama_dir):
    target = load("float32", str(tiny_llama_dir))
    config = LoopConfig(sets=("chat",), batch_sizes=(2,), rounds=1, max_tokens=4, waves=(1, 2), modes=("off", "auto"))
    _, records = loop_section(target, "float32", config)
    assert [(r["waves"], r["mode"]) for r in records] == [(1, "off"), (1, "auto"), (2, "off"), (2, "auto")]
    assert [r["tokens"] for r in records] == [2 * 4, 2 * 4, 4 * 4, 4 * 4]
    auto = records[-1]
    assert "auto/off" in auto and "auto/on" not in auto  # only the modes that ran


def test_the_shared_model_prices_steps_by_what_they_cost():
    """Steps of a known cost, fitted together and shuffled: the model recovers that cost."""

    def cost(shape: StepShape) -> float:
        return 0.05 + 0.004 * shape.num_tokens + (0.01 if shape.is_spec else 0.0)

    shapes = [StepShape(t, 100 * t, spec) for t in (1, 2, 4, 8, 12, 16) for spec in (False, True)] * 30
    model = shared_cost_model([(s, cost(s)) for s in shapes])
    for shape in (StepShape(4), StepShape(12, 1200, True)):
        assert model.predict(shape) == pytest.approx(cost(shape), rel=0.05)


def test_natural_lengths_stop_at_end_of_sequence_and_every_mode_emits_the_same_tokens(tiny_llama_dir):
    """A tiny random model rarely samples its EOS, so make one: the loop with `lengths="natural"` must
    then end requests early, by the same amount in every mode (greedy, float32: lossless)."""
    target = load("float32", str(tiny_llama_dir))
    config = LoopConfig(sets=("chat",), batch_sizes=(2,), rounds=1, max_tokens=24, waves=(2,), lengths="natural")
    fixed_text, fixed = loop_section(target, "float32", LoopConfig(**{**config.__dict__, "lengths": "fixed"}))
    # The greedy continuation's most frequent token becomes end of sequence.
    target.eos_token_ids = [_most_common_greedy_token(target)]
    text, natural = loop_section(target, "float32", config)
    assert all(r["tokens"] == 4 * 24 and r["at_max_tokens"] == 4 for r in fixed)
    assert all(r["lengths"] == "fixed" for r in fixed)
    tokens = {r["mode"]: r["tokens"] for r in natural}
    assert len(set(tokens.values())) == 1 and 4 <= tokens["off"] < 4 * 24
    assert all(r["at_max_tokens"] < 4 for r in natural)
    assert all(r["lengths"] == "natural" for r in natural) and "up to 24 tokens" in text
    assert "up to" not in fixed_text


def _most_common_greedy_token(target) -> int:
    """The token the engine's greedy off-mode output of the loop's first chat prompts repeats most."""
    prompts = [chat_ids(target, p.text) for p in load_prompts(["chat"])[:4]]
    runner = build_runner(target, RunnerConfig(max_num_seqs=4, max_model_len=512), ProposerConfig("ngram"))
    config = SchedulerConfig(max_num_seqs=4, max_model_len=512, eos_token_ids=[])
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, speculation=False)
    done = run_offline(runner, config, [Request(f"r{i}", p, params) for i, p in enumerate(prompts)])
    return Counter(t for c in done for t in c.token_ids[1:]).most_common(1)[0][0]


def test_a_range_ratio_spreads_lengths_the_same_way_in_every_mode(tiny_llama_dir):
    caps = max_tokens_per_request(40, 20, 0.5)
    assert caps == max_tokens_per_request(40, 20, 0.5) and min(caps) >= 10 and max(caps) <= 30
    assert len(set(caps)) > 5 and max_tokens_per_request(3, 20, 0.0) == [20, 20, 20]
    with pytest.raises(ValueError):
        max_tokens_per_request(3, 20, 1.0)
    target = load("float32", str(tiny_llama_dir))
    config = LoopConfig(sets=("chat",), batch_sizes=(2,), rounds=1, max_tokens=8, waves=(3,), length_range_ratio=0.5)
    text, records = loop_section(target, "float32", config)
    expected = sum(max_tokens_per_request(6, 8, 0.5))  # ignore_eos: each request runs to its own cap
    assert [r["tokens"] for r in records] == [expected] * 3 and all(r["at_max_tokens"] == 6 for r in records)
    assert "8 tokens x [0.5, 1.5]" in text
