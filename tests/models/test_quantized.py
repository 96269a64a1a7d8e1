"""Weight-only quantized copies: each kernel computes what its dense values do, copies stack exactly,
and the tuner offers the weight-only kernel only to layers that have one, timed cold."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from models import linear_kernels
from models.linear_kernels import QUANTIZED, RUNGS, STANDARD_LAYOUT, TunedLinear, linear, tune
from models.quantized import GROUP, INT4, INT8, Int4Weight, Int8Weight, StackedWeight, concatenate, quantize

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", [INT8, INT4])
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_the_weight_only_kernel_computes_the_dense_values_product(fmt, dtype, rows):
    torch.manual_seed(0)
    weight = torch.randn(96, 128)
    copy, dense = quantize(weight, fmt, dtype)
    assert copy.fmt == fmt and dense.dtype == dtype and dense.shape == weight.shape
    x = torch.randn(rows, 128, dtype=dtype)
    tolerance = {"rtol": 2e-2, "atol": 5e-2} if dtype == torch.bfloat16 else {"rtol": 1e-4, "atol": 1e-4}
    torch.testing.assert_close(copy.matmul(x).float(), F.linear(x, dense).float(), **tolerance)


@pytest.mark.parametrize("fmt,bound", [(INT8, 1 / 254), (INT4, 1 / 30)])
def test_the_codes_stay_within_half_a_step_of_the_weight(fmt, bound):
    """Symmetric int8 per row: half of max|w| / 127; asymmetric int4 per group: half of range / 15."""
    torch.manual_seed(1)
    weight = torch.randn(64, 256)
    _, dense = quantize(weight, fmt, torch.float32)
    if fmt == INT8:
        scale = weight.abs().amax(dim=1, keepdim=True)
    else:
        groups = weight.view(64, -1, GROUP)
        scale = (groups.amax(-1) - groups.amin(-1)).repeat_interleave(GROUP, dim=1)
    assert ((dense - weight).abs() <= scale * bound + 1e-6).all()


def test_int4_needs_whole_groups_and_falls_back_to_int8():
    copy, _ = quantize(torch.randn(32, 48), INT4, torch.float32)  # 48 inputs: not whole groups of 32
    assert isinstance(copy, Int8Weight)
    with pytest.raises(ValueError, match="unknown weight format"):
        quantize(torch.randn(4, 32), "int3", torch.float32)


@pytest.mark.parametrize("fmt", [INT8, INT4])
def test_copies_of_one_format_stack_into_one_exact_product(fmt):
    torch.manual_seed(2)
    parts = [quantize(torch.randn(n, 128), fmt, torch.float32)[0] for n in (128, 64, 64)]
    fused = concatenate(parts)
    assert not isinstance(fused, StackedWeight) and fused.out_features == 256
    x = torch.randn(2, 128)
    assert torch.equal(fused.matmul(x), torch.cat([p.matmul(x) for p in parts], dim=-1))


def test_copies_in_different_formats_run_one_call_each():
    parts = [quantize(torch.randn(64, 128), fmt, torch.float32)[0] for fmt in (INT4, INT4, INT8)]
    stacked = concatenate(parts)
    assert isinstance(stacked, StackedWeight) and stacked.fmt == "int4+int8" and stacked.out_features == 192
    x = torch.randn(3, 128)
    assert torch.equal(stacked.matmul(x), torch.cat([p.matmul(x) for p in parts], dim=-1))


@pytest.mark.parametrize("fmt", [INT8, INT4])
def test_the_head_of_a_copy_is_its_first_rows(fmt):
    copy, _ = quantize(torch.randn(320, 128), fmt, torch.float32)
    head = copy.head(100)
    assert head.out_features == (100 if fmt == INT8 else 128)  # int4: whole blocks of 64 rows
    x = torch.randn(2, 128)
    assert torch.equal(head.matmul(x), copy.matmul(x)[:, : head.out_features])
    assert isinstance(head, Int4Weight if fmt == INT4 else Int8Weight)


def quantized_layer(fmt: str, n: int = 64, k: int = 128) -> TunedLinear:
    layer = nn.Linear(k, n)
    copy, dense = quantize(layer.weight, fmt, torch.float32)
    with torch.no_grad():
        layer.weight.copy_(dense)
    layer.__class__ = TunedLinear
    layer.quantized_weight = copy
    return layer


def test_the_tuner_offers_the_weight_only_kernel_at_small_steps_and_times_them_cold(monkeypatch):
    layers = [quantized_layer(INT4) for _ in range(3)]
    evictions = []
    monkeypatch.setattr(linear_kernels, "evict_caches", lambda: evictions.append(1))
    seen = []

    def timer(fn, layout, m):
        fn()
        seen.append((layout, m))
        return 0.3 if layout == QUANTIZED else 1.0

    table = tune(layers, timer)
    limit = linear_kernels.QUANTIZED_ROWS
    assert [m for m in range(1, 300) if table.layout(m) == QUANTIZED] == list(range(1, limit + 1))
    assert {m for layout, m in seen if layout == QUANTIZED} == set(range(1, limit + 1))
    # Every timed pass of those rungs (every layout's) followed an eviction; the rest none.
    assert len(evictions) == sum(1 for _, m in seen if m <= limit)
    dense = tune([nn.Linear(128, 64) for _ in range(3)], timer)
    assert not dense.uses(QUANTIZED)


@pytest.mark.parametrize("fmt", [INT8, INT4])
def test_a_quantized_layer_computes_the_same_product_in_every_layout(fmt):
    layer = quantized_layer(fmt)
    x = torch.randn(2, 3, 128)
    dense = linear(x, layer.weight, layer.bias, STANDARD_LAYOUT)
    weight_only = linear(x, layer.weight, layer.bias, QUANTIZED, quantized=layer.quantized_weight)
    torch.testing.assert_close(weight_only, dense, rtol=1e-4, atol=1e-4)
    assert len(RUNGS) == len(linear_kernels.UNTUNED_QUANTIZED.layouts)
    assert linear_kernels.UNTUNED_QUANTIZED.layout(1) == QUANTIZED
    assert linear_kernels.UNTUNED_QUANTIZED.layout(5) == STANDARD_LAYOUT
