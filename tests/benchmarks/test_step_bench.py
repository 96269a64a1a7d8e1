"""benchmarks.step_bench's profile at CI size: a tiny model, nothing about speed."""

from __future__ import annotations

from benchmarks.common import load
from benchmarks.step_bench import profile_section


def test_profile_names_the_operators_of_a_step(tiny_llama_dir):
    target = load("float32", str(tiny_llama_dir))
    text, records = profile_section(target, "float32", steps=3, top=5)
    assert [r["case"] for r in records] == ["batch 1 decode", "batch 16 decode"]
    for record in records:
        assert record["ms_per_step"] > 0 and record["host_op_ms_per_step"] > 0
        assert 0 < len(record["ops"]) <= 5
        names = {op["name"] for op in record["ops"]}
        assert names & {"aten::mm", "aten::addmm", "aten::matmul", "aten::linear", "aten::bmm"}  # the layers ran
        assert all(op["calls_per_step"] > 0 and op["self_device_ms_per_step"] == 0 for op in record["ops"])  # CPU
    assert "### Step profile (float32, cpu)" in text and "#### batch 16 decode" in text
