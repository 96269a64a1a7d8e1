"""Weight-only quantized copies: each kernel computes what its dense values do, copies stack exactly,
and a dense weight no step size reads is dropped (the tuner's side: tests/models/test_kernel_tuning.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from models import linear_kernels
from models.linear_kernels import CHUNKED, QUANTIZED, RUNGS, STANDARD_LAYOUT, TRANSPOSED, linear
from models.quantized import (
    BLOCK,
    GROUP,
    INT4,
    INT4K,
    INT6,
    INT8,
    Int4KWeight,
    Int4Weight,
    Int6Weight,
    Int8Weight,
    StackedWeight,
    concatenate,
    kernels_available,
    quantize,
    restore,
    round_rows,
)
from tests.support.q4_k import q4_k_blocks
from tests.support.tensors import quantized_layer

DTYPES = [torch.float32, torch.bfloat16]
FORMATS = [INT8, INT6, INT4]


@pytest.fixture(autouse=True)
def kernels(built_kernels):
    """Every test here multiplies through specd's int4/int8 kernels (x86 with AVX2)."""
    if not kernels_available():
        pytest.skip("specd's quantized kernels are built for x86 with AVX2 only")


def rows_as_the_kernel_rounds_them(x: torch.Tensor) -> torch.Tensor:
    """x with each group of GROUP inputs rounded to int8 on max |x| / 127, in float32."""
    groups = x.float().view(x.shape[0], -1, GROUP)
    amax = groups.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 1e-30, torch.tensor(127.0) / amax, 0.0)  # a tensor's IEEE division, as C++'s
    codes = torch.round(groups * inverse).clamp(-127, 127)
    return (codes * (amax / 127.0)).view_as(x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 17])
@pytest.mark.parametrize("shape", [(96, 128), (100, 64)])  # 100: a padded last tile
def test_the_weight_only_kernel_computes_the_dense_values_product_on_int8_rows(fmt, dtype, rows, shape):
    torch.manual_seed(0)
    weight = torch.randn(*shape)
    copy = quantize(weight, fmt)
    dense = copy.dense(dtype)
    assert copy.fmt == fmt and dense.dtype == dtype and dense.shape == weight.shape
    x = torch.randn(rows, shape[1], dtype=dtype)
    got = copy.matmul(x)
    assert got.shape == (rows, shape[0]) and got.dtype == dtype
    exact = F.linear(rows_as_the_kernel_rounds_them(x), dense.float())
    # bf16: the dense values and the result are rounded to bf16 (one ulp of a sum near 16 is 0.125)
    tolerance = {"rtol": 1e-2, "atol": 0.1} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-4}
    torch.testing.assert_close(got.float(), exact, **tolerance)
    # and within the int8 rounding of the rows (~0.5%) of the float product
    unrounded = F.linear(x.float(), dense.float())
    assert (got.float() - unrounded).norm() < 0.02 * unrounded.norm()
    assert torch.equal(round_rows(x), rows_as_the_kernel_rounds_them(x).to(dtype))


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_row_gets_the_same_bits_alone_or_among_others(fmt):
    torch.manual_seed(3)
    copy = quantize(torch.randn(64, 256), fmt)
    x = torch.randn(19, 256, dtype=torch.bfloat16)
    together = copy.matmul(x)
    for i in (0, 7, 8, 18):
        assert torch.equal(copy.matmul(x[i : i + 1])[0], together[i])


def test_rows_of_zeros_and_weights_of_one_value_are_exact():
    constant = torch.full((32, 64), 0.25)
    copy = quantize(constant, INT4)
    dense = copy.dense(torch.float32)
    assert torch.equal(dense, constant)  # a group of one value: scale 0, the minimum is the value
    x = torch.zeros(3, 64)
    x[1, 3] = 2.0
    x[2, 5] = 1e-38  # a group of float's smallest values rounds to zeros, not to inf
    assert torch.equal(copy.matmul(x), torch.tensor([[0.0] * 32, [0.5] * 32, [0.0] * 32]))


@pytest.mark.parametrize("fmt,bound", [(INT8, 1 / 254), (INT6, 1 / 62), (INT4, 1 / 30)])
def test_the_codes_stay_within_half_a_step_of_the_weight(fmt, bound):
    """Symmetric int8 per group: half of max|w| / 127; symmetric int6 per block: half of max|w| / 31;
    asymmetric int4 per group: half of range / 15."""
    torch.manual_seed(1)
    weight = torch.randn(64, 256)
    dense = quantize(weight, fmt).dense(torch.float32)
    groups = weight.view(64, -1, GROUP)
    if fmt == INT8:  # plus float16's rounding of the scale (2^-11 of it, 127 steps)
        scale = groups.abs().amax(-1).repeat_interleave(GROUP, dim=1) * (1 + 127 * 2 * 2**-11)
    elif fmt == INT6:  # plus float16's rounding of the scale (2^-11 of it, 31 steps)
        blocks = weight.view(64, -1, BLOCK)
        scale = blocks.abs().amax(-1).repeat_interleave(BLOCK, dim=1) * (1 + 31 * 2 * 2**-11)
    else:  # plus float16's rounding of the group's scale and minimum (2^-11 of each, 15 steps)
        scale = (groups.amax(-1) - groups.amin(-1)).repeat_interleave(GROUP, dim=1) * (1 + 15 * 2 * 2**-11)
        scale = scale + (groups.amin(-1).abs() * 30 * 2**-11).repeat_interleave(GROUP, dim=1)
    assert ((dense - weight).abs() <= scale * bound + 1e-6).all()


def test_inputs_in_whole_groups_or_the_layer_stays_dense():
    huge = torch.randn(32, 64)
    huge[0, 0] = 1e6  # beyond what float16 scales hold
    for fmt in FORMATS:
        assert quantize(torch.randn(32, 48), fmt) is None  # 48 inputs: not whole groups of 32
        assert quantize(huge, fmt) is None
    with pytest.raises(ValueError, match="unknown weight format"):
        quantize(torch.randn(4, 32), "int3")


@pytest.mark.parametrize("fmt", FORMATS)
def test_copies_of_one_format_stack_into_one_exact_product(fmt):
    torch.manual_seed(2)
    parts = [quantize(torch.randn(n, 128), fmt) for n in (128, 64, 40)]
    fused = concatenate(parts)
    assert not isinstance(fused, StackedWeight) and fused.out_features == 232  # the last part's tile padded
    x = torch.randn(2, 128)
    assert torch.equal(fused.matmul(x), torch.cat([p.matmul(x) for p in parts], dim=-1))
    padded_first = concatenate([parts[2], parts[0]])  # a padded tile cannot sit before another
    assert isinstance(padded_first, StackedWeight) and padded_first.out_features == 168


def test_copies_in_different_formats_run_one_call_per_format():
    parts = [quantize(torch.randn(64, 128), fmt) for fmt in (INT4, INT4, INT6)]
    stacked = concatenate(parts)
    assert isinstance(stacked, StackedWeight) and stacked.fmt == "int4+int6" and stacked.out_features == 192
    assert [(p.fmt, p.out_features) for p in stacked.parts] == [(INT4, 128), (INT6, 64)]  # q and k stacked
    x = torch.randn(3, 128)
    assert torch.equal(stacked.matmul(x), torch.cat([p.matmul(x) for p in parts], dim=-1))


@pytest.mark.parametrize("fmt,kind", [(INT8, Int8Weight), (INT6, Int6Weight), (INT4, Int4Weight)])
def test_the_head_of_a_copy_is_its_first_rows(fmt, kind):
    copy = quantize(torch.randn(320, 128), fmt)
    head = copy.head(100)
    assert head.out_features == 112  # whole tiles of 16 rows
    x = torch.randn(2, 128)
    assert torch.equal(head.matmul(x), copy.matmul(x)[:, : head.out_features])
    assert isinstance(head, kind)


def test_drop_dense_frees_a_weight_only_where_no_step_size_reads_it():
    layer = quantized_layer(INT4)
    x = torch.randn(3, 128)
    layer.kernel_table = linear_kernels.WEIGHT_ONLY_TABLE
    expected = layer(x)
    layer.kernel_table = linear_kernels.UNTUNED_QUANTIZED  # dense past 8 rows
    assert not linear_kernels.drop_dense(layer) and not layer.weight.is_meta
    layer.kernel_table = linear_kernels.WEIGHT_ONLY_TABLE
    assert linear_kernels.drop_dense(layer) and layer.weight.is_meta and layer.weight.shape == (64, 128)
    torch.testing.assert_close(layer(x), expected, rtol=0, atol=0)
    assert not linear_kernels.drop_dense(nn.Linear(128, 64))


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_quantized_layer_computes_the_same_product_in_every_layout(fmt):
    layer = quantized_layer(fmt)
    x = torch.randn(2, 3, 128)
    weight_only = linear(x, layer.weight, layer.bias, QUANTIZED, quantized=layer.quantized_weight)
    for layout in (STANDARD_LAYOUT, TRANSPOSED, CHUNKED):  # the dense layouts round the rows as the kernel does
        dense = linear(x, layer.weight, layer.bias, layout, quantized=layer.quantized_weight)
        torch.testing.assert_close(weight_only, dense, rtol=1e-4, atol=1e-4)
    assert len(RUNGS) == len(linear_kernels.UNTUNED_QUANTIZED.layouts)
    assert linear_kernels.UNTUNED_QUANTIZED.layout(1) == QUANTIZED
    assert linear_kernels.UNTUNED_QUANTIZED.layout(8) == QUANTIZED
    assert linear_kernels.UNTUNED_QUANTIZED.layout(9) == STANDARD_LAYOUT


def test_int4_keeps_weights_that_sit_on_a_grid_of_16_levels_or_fewer():
    """A Q4_K sub-block: w = scale * q - offset, q in 0..15, its codes spanning only part of that
    range. Requantized on its own grid it keeps its values, where 15 min-max steps would move them."""
    torch.manual_seed(4)
    n, k = 32, 256
    scale = torch.rand(n, k // GROUP, 1) * 0.01 + 0.001
    offset = torch.rand(n, k // GROUP, 1) * 0.1
    first = torch.randint(0, 4, (n, k // GROUP, 1))
    q = first + torch.randint(0, 12, (n, k // GROUP, GROUP))  # spans 0..14 at most, fewer levels in most groups
    q[..., :2] = torch.cat([first, first + 11], dim=-1)  # ... and some q between
    weight = (scale * q - offset).view(n, k)
    dense = quantize(weight, INT4).dense(torch.float32)
    # float16's rounding of a group's scale and minimum apart (2^-11 of each)
    assert (dense - weight).abs().max() < 16 * scale.max() * 2**-11 + offset.max() * 2**-11
    levels = torch.cat([torch.tensor([0.0, 1.0]), torch.rand(30)]) * 3  # float weights: 15 steps, as before
    on_fifteen = quantize(levels.repeat(16, 1), INT4).dense(torch.float32)
    assert (on_fifteen - levels).abs().max() <= 3 / 30 + 1e-3
    assert (on_fifteen - levels).abs().max() > 3 / 15 / 8  # values between its 16 levels moved


def test_int6_keeps_q6_k_and_q5_0_weights_on_their_own_grid():
    """Q6_K: w = d * sc * q per block of 16 (sc an int8 under a float16 d per 256, q in -32..31);
    Q5_0: w = d * q per 32 (q in -16..15). Each block's values sit on a grid int6's codes and one
    float16 scale hold: only that scale's rounding moves them (2^-11 of a value at most)."""
    torch.manual_seed(5)
    n, k = 32, 512
    d = (torch.rand(n, k // 256, 1, 1) * 0.01 + 0.002).half().float()
    sc = torch.randint(-128, 128, (n, k // 256, 16, 1)).float()
    sc[sc == 0] = 1
    q6 = torch.randint(-32, 32, (n, k // 256, 16, 16)).float()
    q6[..., 0, :2] = torch.tensor([-32.0, 31.0])  # the full range in some blocks, a narrower one in most
    q6_k = (d * sc * q6).view(n, k)
    q5 = torch.randint(-16, 16, (n, k // 32, 32)).float()
    q5_0 = ((torch.rand(n, k // 32, 1) * 0.01 + 0.002).half().float() * q5).view(n, k)
    for weight in (q6_k, q5_0):
        dense = quantize(weight, INT6).dense(torch.float32)
        assert ((dense - weight).abs() <= weight.abs() * 2**-11 + 1e-9).all()
    on_31 = quantize(torch.randn(16, 64), INT6).dense(torch.float32)  # float weights: 31 steps from 0 to the peak
    blocks = on_31.view(16, -1, BLOCK)
    steps = blocks / (blocks.abs().amax(-1, keepdim=True) / 31)
    assert (steps - steps.round()).abs().max() < 0.02


@pytest.mark.parametrize("rows", [1, 3, 9])
def test_int4k_holds_a_q4_k_tensor_to_the_bit(rows):
    from gguf.quants import GGMLQuantizationType, dequantize

    n, k = 40, 512  # 40: a padded last tile
    blocks = q4_k_blocks(n, k)
    reference = torch.from_numpy(dequantize(blocks, GGMLQuantizationType.Q4_K).copy())  # what transformers loads
    copy = Int4KWeight.from_q4_k(blocks, n, k)
    assert copy.fmt == INT4K and (copy.out_features, copy.in_features) == (n, k)
    assert torch.equal(copy.dense(torch.float32), reference)
    assert copy.nbytes() == 48 * k * 37 // 64  # 4.625 bits a weight, over whole tiles
    x = torch.randn(rows, k)
    exact = F.linear(rows_as_the_kernel_rounds_them(x), reference)
    torch.testing.assert_close(copy.matmul(x), exact, rtol=1e-5, atol=1e-4)
    restored = restore(INT4K, copy.tensors, n)
    assert torch.equal(restored.matmul(x), copy.matmul(x))
    with pytest.raises(ValueError, match="Q4_K blocks"):
        quantize(reference, INT4K)
