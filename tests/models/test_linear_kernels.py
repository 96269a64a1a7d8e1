"""models.linear_kernels: the layouts compute the same product, the tuner keeps the faster, load installs it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from models import linear_kernels
from models.linear_kernels import (
    PADDED,
    RUNGS,
    STANDARD,
    STANDARD_LAYOUT,
    TRANSPOSED,
    KernelTable,
    TunedLinear,
    install,
    linear_layers,
    transposed_linear,
    tune,
)
from models.loader import ModelConfig, load_model


@pytest.mark.parametrize("shape", [(1, 1, 24), (1, 5, 24), (3, 7, 24), (40, 24)])
@pytest.mark.parametrize("bias", [False, True])
def test_transposed_layout_computes_linear(shape, bias):
    torch.manual_seed(0)
    layer = nn.Linear(24, 40, bias=bias)
    x = torch.randn(*shape)
    out = transposed_linear(x, layer.weight, layer.bias)
    assert out.shape == (*shape[:-1], 40) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-6)
    if x.numel() == 24:
        padded = transposed_linear(x, layer.weight, layer.bias, padded=True)
        torch.testing.assert_close(padded, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-6)


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
        return 0.5 if 2 <= m <= 9 or m == 16 else 0.97 if m < 64 else 1.3  # 0.97: inside MIN_GAIN

    timer, calls = fake_timer(cost)
    table = tune(layers, timer)
    assert len(table.layouts) == len(RUNGS)
    assert table.layout(1) == PADDED
    assert [m for m in range(2, 40) if table.layout(m) == TRANSPOSED] == [*range(2, 10), 16]
    assert all(table.layout(m) == STANDARD_LAYOUT for m in (10, 15, 17, 64, 200, RUNGS[-1] + 1, 5000))
    assert table.ratios[RUNGS.index(2)] == 0.5 and table.ratios[RUNGS.index(64)] == 1.0
    assert len(calls) == sum(linear_kernels.REPEATS * (3 if m == 1 else 2) for m in RUNGS)
    assert "2-9 tokens: (W @ x^T)^T (0.50-0.50 of the time)" in table.describe()


def test_tuned_layers_follow_the_table_and_keep_their_outputs(tiny_llama_dir):
    plain = load_model(ModelConfig(str(tiny_llama_dir), dtype="float32", device="cpu", tune_kernels=False))
    assert plain.kernel_table is STANDARD
    assert all(type(m) is nn.Linear for m in linear_layers(plain.model))

    tuned = load_model(ModelConfig(str(tiny_llama_dir), dtype="float32", device="cpu"))
    layers = linear_layers(tuned.model)
    assert layers and all(isinstance(m, TunedLinear) for m in layers)
    assert len(tuned.kernel_table.layouts) == len(RUNGS)
    assert tuned.model.state_dict().keys() == plain.model.state_dict().keys()

    # Force each layout in turn: the model's logits stay those of the untuned model.
    ids = torch.randint(0, 100, (1, 6))
    with torch.inference_mode():
        expected = plain.model(input_ids=ids).logits
        for layout in (STANDARD_LAYOUT, TRANSPOSED):
            install(layers, KernelTable((layout,) * len(RUNGS), (1.0,) * len(RUNGS)))
            torch.testing.assert_close(tuned.model(input_ids=ids).logits, expected, rtol=1e-4, atol=1e-5)
        install(layers, KernelTable((PADDED,) + (STANDARD_LAYOUT,) * (len(RUNGS) - 1), (1.0,) * len(RUNGS)))
        one = tuned.model(input_ids=ids[:, :1]).logits
        torch.testing.assert_close(one, plain.model(input_ids=ids[:, :1]).logits, rtol=1e-4, atol=1e-5)
