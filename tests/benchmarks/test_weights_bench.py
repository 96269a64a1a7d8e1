"""weights_bench's floor: the bytes a batch-1 decode step reads shrink with the format its
kernel table runs at one row."""

from __future__ import annotations

from benchmarks.weights_bench import step_bytes
from models.loader import ModelConfig, load_model


def test_a_step_reads_the_copies_its_tables_run_at_one_row(tiny_llama_dir):
    def read(weights: str) -> int:
        loaded = load_model(ModelConfig(str(tiny_llama_dir), dtype="float32", weights=weights, tune_kernels=False))
        return step_bytes(loaded)

    dense, int8, int4 = read("bf16"), read("int8"), read("int4")
    assert int4 < int8 < dense
    assert int8 < dense / 3  # float32 -> 1 byte per weight, and a scale per row
