"""benchmarks.loop_bench at CI size: a tiny model through the closed loop, every mode; nothing about speed."""

from __future__ import annotations

from benchmarks.common import load
from benchmarks.loop_bench import LoopConfig, loop_section


def test_closed_loop_runs_every_mode_and_counts_the_batch(tiny_llama_dir):
    target = load("float32", str(tiny_llama_dir))
    config = LoopConfig(sets=("code", "creative"), batch_sizes=(2,), rounds=2, max_tokens=6)
    text, records = loop_section(target, "float32", config)
    assert [r["mode"] for r in records] == ["off", "on", "auto"]
    by_mode = {r["mode"]: r for r in records}
    for record in records:
        assert record["requests"] == 2 and record["tps"] > 0
        assert 1 <= record["rows_per_step"] <= 2  # never more rows than slots
        assert 0 <= record["accepted"] <= record["drafted"]
    assert by_mode["off"]["drafted"] == 0
    # Off decodes one token per row and step: 6 requests x 6 tokens over <= 2 rows a step.
    assert by_mode["off"]["steps"] >= 6 * 6 / 2
    assert by_mode["auto"]["auto/best"] > 0 and "auto/off" in by_mode["auto"]
    assert "| requests | mode |" in text and "Closed loop (float32, code+creative" in text
