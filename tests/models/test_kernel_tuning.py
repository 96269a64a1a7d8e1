"""models.kernel_tuning: the tuner keeps the faster layout per token count, times the weight-only
kernel at every rung (small ones cold), samples the model's own weights, and gives the output
projection its own table."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from models import kernel_tuning, linear_kernels
from models.kernel_tuning import tune, tune_model
from models.linear_kernels import (
    PACKED,
    PADDED,
    QUANTIZED,
    RUNGS,
    STANDARD_LAYOUT,
    TRANSPOSED,
    KernelTable,
    install,
    linear_layers,
)
from models.loader import ModelConfig, load_model
from models.quantized import INT4, kernels_available
from tests.support.tensors import quantized_layer


@pytest.fixture
def quantized_kernels(built_kernels):
    if not kernels_available():
        pytest.skip("specd's quantized kernels are built for x86 with AVX2 only")


def fake_timer(cost):
    """A timer that runs each pass but reports `cost(layout, tokens)` instead of the clock."""
    calls = []

    def timer(fn, layout, num_tokens) -> float:
        fn()
        calls.append((layout, num_tokens))
        return cost(layout, num_tokens)

    return timer, calls


def test_tuner_keeps_the_faster_layout_per_token_count():
    layers = [nn.Linear(16, 32), nn.Linear(32, 16)]

    def cost(layout, m):
        if layout == STANDARD_LAYOUT:
            return 1.0
        if layout == PADDED:
            return 0.7  # one row computed as two beats the matrix-vector kernel
        if layout == PACKED:
            return 1.1  # never the faster here
        return 0.5 if 2 <= m <= 9 or m == 16 else 0.97 if m < 64 else 1.3  # 0.97: inside MIN_GAIN

    timer, calls = fake_timer(cost)
    table = tune(layers, timer)
    assert len(table.layouts) == len(RUNGS)
    assert table.layout(1) == PADDED
    assert [m for m in range(2, 40) if table.layout(m) == TRANSPOSED] == [*range(2, 10), 16]
    assert all(table.layout(m) == STANDARD_LAYOUT for m in (10, 15, 17, 64, 200, RUNGS[-1] + 1, 5000))
    assert table.ratios[RUNGS.index(2)] == 0.5 and table.ratios[RUNGS.index(64)] == 1.0
    # Every rung times x @ W^T, the transposed and the packed layouts (and at 1 row the padded one).
    assert len(calls) == sum(kernel_tuning.REPEATS * (4 if m == 1 else 3) for m in RUNGS)
    assert "2-9 tokens: (W @ x^T)^T (0.50-0.50 of the time)" in table.describe()


def test_the_sample_takes_whole_weights_then_the_first_rows_of_the_one_that_crosses_the_budget():
    layers = [nn.Linear(16, 8), nn.Linear(16, 8, bias=False), nn.Linear(16, 100), nn.Linear(16, 8)]
    weights = [(m.weight, m.bias, None) for m in layers]
    sample = kernel_tuning._sample(weights, (2 * 8 * 16 + 3 * 16) * 4)  # float32
    assert [tuple(w.shape) for w, _, _ in sample] == [(8, 16), (8, 16), (3, 16)]
    assert sample[1][1] is None and sample[2][1].shape == (3,)
    assert sample[2][0].data_ptr() == layers[2].weight.data_ptr()  # a view: nothing copied
    assert [tuple(w.shape) for w, _, _ in kernel_tuning._sample(sample, 8 * 16 * 4 + 1)] == [(8, 16), (1, 16)]


def test_past_32_rows_the_tuner_times_a_quarter_of_the_sample(monkeypatch):
    """The ladder is compute-bound: its passes run over LADDER_SAMPLE_BYTES, the small rungs over all."""
    monkeypatch.setattr(kernel_tuning, "SAMPLE_BYTES", 4 * 32 * 16 * 4)  # four 32x16 float32 weights
    monkeypatch.setattr(kernel_tuning, "LADDER_SAMPLE_BYTES", 32 * 16 * 4)  # one
    layers = [nn.Linear(16, 32, bias=False) for _ in range(6)]
    seen: dict[int, int] = {}
    original = linear_kernels.transposed_linear

    def counting(x, weight, bias, padded=False):
        seen[x.shape[0]] = seen.get(x.shape[0], 0) + 1
        return original(x, weight, bias, padded)

    monkeypatch.setattr(linear_kernels, "transposed_linear", counting)
    tune(layers, fake_timer(lambda layout, m: 1.0)[0])
    passes = 1 + kernel_tuning.REPEATS  # a warm-up, then the timed repeats
    assert seen[2] == seen[32] == 4 * passes  # every weight of the sample
    assert seen[40] == seen[256] == 1 * passes  # the ladder's quarter


def test_the_output_projection_is_tuned_on_its_own_weights(tiny_llama_dir, monkeypatch):
    """Its shape is unlike any decoder layer's, and so is its best layout: it gets its own table."""
    model = load_model(ModelConfig(str(tiny_llama_dir), dtype="float32", device="cpu", tune_kernels=False)).model
    output = model.get_output_embeddings()
    tuned: list[list[nn.Linear]] = []
    layers_table = KernelTable((TRANSPOSED,) * len(RUNGS), (0.5,) * len(RUNGS))
    output_table = KernelTable((STANDARD_LAYOUT,) * len(RUNGS), (1.0,) * len(RUNGS))

    def fake_tune(layers, dense_only=False):
        tuned.append(list(layers))
        return output_table if layers == [output] else layers_table

    monkeypatch.setattr(kernel_tuning, "tune", fake_tune)
    monkeypatch.setattr(kernel_tuning, "_TABLES", {})
    kernels = tune_model(model)
    assert kernels.layers is layers_table and kernels.output is output_table
    assert tuned[1] == [output] and output not in tuned[0] and len(tuned[0]) == len(linear_layers(model)) - 1
    assert output.kernel_table is output_table
    assert all(m.kernel_table is layers_table for m in linear_layers(model) if m is not output)
    assert "output projection: 1-256 tokens: x @ W^T" in kernels.describe()


def test_the_packed_layout_wins_where_it_is_faster_and_computes_the_same_product():
    layers = [nn.Linear(16, 32), nn.Linear(32, 16, bias=False)]
    timer, _ = fake_timer(lambda layout, m: 0.6 if layout == PACKED and m <= 8 else 1.0)
    table = tune(layers, timer)
    assert [m for m in range(1, 12) if table.layout(m) == PACKED] == [*range(1, 9)]
    install(layers, table)
    for layer in layers:
        assert layer.packed_weight is not None
        x = torch.randn(5, layer.in_features)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
        assert layer(x[None]).shape == (1, 5, layer.out_features)  # leading dims kept


def test_the_tuner_times_the_weight_only_kernel_at_every_rung_and_small_steps_cold(monkeypatch, quantized_kernels):
    layers = [quantized_layer(INT4) for _ in range(3)]
    evictions = []
    monkeypatch.setattr(kernel_tuning, "evict_caches", lambda: evictions.append(1))
    seen = []
    limit = kernel_tuning.QUANTIZED_ROWS

    def timer(fn, layout, m):  # an AMX CPU: the kernel wins decode steps, dense products prefill
        fn()
        seen.append((layout, m))
        return (0.3 if m <= limit else 1.5) if layout == QUANTIZED else 1.0

    table = tune(layers, timer)
    assert [m for m in range(1, 300) if table.layout(m) == QUANTIZED] == list(range(1, limit + 1))
    assert table.layout(RUNGS[-1] + 1) == STANDARD_LAYOUT and "x @ W^T above" in table.describe()
    assert {m for layout, m in seen if layout == QUANTIZED} == set(RUNGS)
    # Every timed pass of the small rungs (every layout's) followed an eviction; the rest none.
    assert len(evictions) == sum(1 for _, m in seen if m <= limit)
    dense = tune([nn.Linear(128, 64) for _ in range(3)], timer)
    assert not dense.uses(QUANTIZED)


def test_where_the_weight_only_kernel_wins_every_rung_it_runs_past_the_last(monkeypatch, quantized_kernels):
    """A CPU without AMX: its integer dot products beat the dense bf16 ones at prefill sizes too,
    and a longer chunk than the last rung keeps the kernel (both costs grow row by row)."""
    monkeypatch.setattr(kernel_tuning, "evict_caches", lambda: None)
    table = tune([quantized_layer(INT4) for _ in range(2)], lambda fn, layout, m: 0.7 if layout == QUANTIZED else 1.0)
    assert all(table.layout(m) == QUANTIZED for m in (1, 16, 17, 64, RUNGS[-1], RUNGS[-1] + 1, 4096))
    assert table.describe().endswith(f"weight-only above {RUNGS[-1]} (tuned in {table.seconds:.1f}s)")


def test_a_tie_over_the_ladder_goes_to_the_weight_only_kernel_at_every_step_size(monkeypatch, quantized_kernels):
    monkeypatch.setattr(kernel_tuning, "evict_caches", lambda: None)
    # within MIN_GAIN of the fastest dense layout: the kernel runs every step size
    table = tune([quantized_layer(INT4)], lambda fn, layout, m: 1.03 if layout == QUANTIZED else 1.0)
    assert table.weight_only and table.describe().startswith("1-256 tokens: weight-only (1.03-1.03")
    # a dense layout winning one rung (a noisy pass) does not keep the dense weight
    table = tune([quantized_layer(INT4)], lambda fn, layout, m: 0.8 if (layout == QUANTIZED) != (m == 128) else 1.0)
    assert table.weight_only
    # a dense product well ahead on the prefill rungs keeps them
    prefill_dense = lambda fn, layout, m: (0.5 if m <= 16 else 1.2) if layout == QUANTIZED else 1.0  # noqa: E731
    table = tune([quantized_layer(INT4)], prefill_dense)
    assert not table.weight_only and table.layout(16) == QUANTIZED and table.layout(17) == STANDARD_LAYOUT
