"""benchmarks.loop_bench at CI size: a tiny model through the closed loop, every mode; nothing about speed."""

from __future__ import annotations

import pytest

from benchmarks.common import load
from benchmarks.loop_bench import LoopConfig, loop_section, shared_cost_model
from scheduler.cost_model import StepShape


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
