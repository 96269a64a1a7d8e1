"""benchmarks.step_bench's profile at CI size: a tiny model, nothing about speed."""

from __future__ import annotations

from benchmarks.common import load
from benchmarks.step_bench import MAX_LEN, NUM_SLOTS, decode_row, profile_section, time_step
from speculation.config import ProposerConfig
from worker.builder import build_runner
from worker.runner import RunnerConfig


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


def test_a_timed_verify_case_verifies_at_every_repeat(tiny_llama_dir):
    """A "verify 1+N" case is one batch executed again and again; its random prediction is
    rejected at the first, and before the fix every later execute fed one token: a decode."""
    target = load("float32", str(tiny_llama_dir))
    runner = build_runner(target, RunnerConfig(max_num_seqs=NUM_SLOTS, max_model_len=MAX_LEN), ProposerConfig("ngram"))
    fed: list[int] = []
    hook = target.model.get_input_embeddings().register_forward_hook(lambda m, args, out: fed.append(args[0].numel()))
    try:
        time_step(runner, [decode_row("v", 40, 0, target.vocab_size, drafts=4, consecutive=True)], repeats=3)
    finally:
        hook.remove()
    assert fed == [5] * len(fed) and len(fed) >= 5  # warm-up, transfer count, 3 timed
