"""models.linear_kernels: the layouts compute the same product, the tuner keeps the faster, load installs it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from models import linear_kernels
from models.linear_kernels import (
    PACKED,
    PADDED,
    ROWWISE,
    RUNGS,
    STANDARD_LAYOUT,
    TRANSPOSED,
    UNTUNED,
    KernelTable,
    TunedLinear,
    install,
    linear_layers,
    transposed_linear,
    tune,
    tune_model,
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
    assert len(calls) == sum(linear_kernels.REPEATS * (4 if m == 1 else 3) for m in RUNGS)
    assert "2-9 tokens: (W @ x^T)^T (0.50-0.50 of the time)" in table.describe()


def test_tuned_layers_follow_the_table_and_keep_their_outputs(tiny_llama_dir):
    plain = load_model(ModelConfig(str(tiny_llama_dir), dtype="float32", device="cpu", tune_kernels=False))
    assert plain.kernels is UNTUNED and not plain.kernels.is_tuned
    assert all(type(m) is nn.Linear for m in linear_layers(plain.model))

    tuned = load_model(ModelConfig(str(tiny_llama_dir), dtype="float32", device="cpu"))
    layers = linear_layers(tuned.model)
    assert layers and all(isinstance(m, TunedLinear) for m in layers)
    kernels = tuned.kernels
    assert kernels.is_tuned and len(kernels.layers.layouts) == len(kernels.output.layouts) == len(RUNGS)
    output = tuned.model.get_output_embeddings()
    assert output.kernel_table is kernels.output
    fused = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
    for name, m in tuned.model.named_modules():
        if isinstance(m, TunedLinear) and m is not output:
            # A table that packs goes to the fused product (llama.Projection); its members then
            # run their plain views, as transformers' own forward does.
            packs = name.rsplit(".", 1)[-1] in fused and kernels.layers.uses(PACKED)
            assert m.kernel_table is (linear_kernels.STANDARD if packs else kernels.layers), name
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


def test_the_sample_takes_whole_weights_then_the_first_rows_of_the_one_that_crosses_the_budget():
    layers = [nn.Linear(16, 8), nn.Linear(16, 8, bias=False), nn.Linear(16, 100), nn.Linear(16, 8)]
    weights = [(m.weight, m.bias, None) for m in layers]
    sample = linear_kernels._sample(weights, (2 * 8 * 16 + 3 * 16) * 4)  # float32
    assert [tuple(w.shape) for w, _, _ in sample] == [(8, 16), (8, 16), (3, 16)]
    assert sample[1][1] is None and sample[2][1].shape == (3,)
    assert sample[2][0].data_ptr() == layers[2].weight.data_ptr()  # a view: nothing copied
    assert [tuple(w.shape) for w, _, _ in linear_kernels._sample(sample, 8 * 16 * 4 + 1)] == [(8, 16), (1, 16)]


def test_past_32_rows_the_tuner_times_a_quarter_of_the_sample(monkeypatch):
    """The ladder is compute-bound: its passes run over LADDER_SAMPLE_BYTES, the small rungs over all."""
    monkeypatch.setattr(linear_kernels, "SAMPLE_BYTES", 4 * 32 * 16 * 4)  # four 32x16 float32 weights
    monkeypatch.setattr(linear_kernels, "LADDER_SAMPLE_BYTES", 32 * 16 * 4)  # one
    layers = [nn.Linear(16, 32, bias=False) for _ in range(6)]
    seen: dict[int, int] = {}
    original = linear_kernels.transposed_linear

    def counting(x, weight, bias, padded=False):
        seen[x.shape[0]] = seen.get(x.shape[0], 0) + 1
        return original(x, weight, bias, padded)

    monkeypatch.setattr(linear_kernels, "transposed_linear", counting)
    tune(layers, fake_timer(lambda layout, m: 1.0)[0])
    passes = 1 + linear_kernels.REPEATS  # a warm-up, then the timed repeats
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

    monkeypatch.setattr(linear_kernels, "tune", fake_tune)
    monkeypatch.setattr(linear_kernels, "_TABLES", {})
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_layout_gives_a_row_the_same_bits_whatever_shares_its_step(dtype):
    """`--batch-invariant`'s product: the right values, and one row's bits alone, first or last in
    a step, and in a step past one call (BLAS libraries switch kernels by row count; this is
    what the layout is for)."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=g).to(dtype)
    bias = torch.randn(96, generator=g).to(dtype)
    rows = torch.randn(40, 64, generator=g).to(dtype)
    together = linear_kernels.chunked_linear(rows, weight, bias)
    torch.testing.assert_close(together, F.linear(rows, weight, bias))
    for i in (0, 15, 16, 39):
        alone = linear_kernels.chunked_linear(rows[i : i + 1], weight, bias)[0]
        assert torch.equal(alone, together[i])
    linear_kernels.check_row_invariance([weight])


def test_row_invariance_is_refused_where_the_library_cannot_hold_it(monkeypatch):
    """A BLAS whose row results depend on the row's place in the call (faked here) fails the
    check at load, rather than serving a mode that does not hold."""
    real = F.linear

    def placed(x, weight, bias=None):
        out = real(x, weight, bias)
        return out + torch.arange(out.shape[0], dtype=out.dtype)[:, None] * 1e-3

    monkeypatch.setattr(linear_kernels.F, "linear", placed)
    with pytest.raises(RuntimeError, match="batch-invariant"):
        linear_kernels.check_row_invariance([torch.randn(8, 8)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dims", [(70, 576), (9, 20), (5, 7)])  # whole vectors; a tail; less than one vector
def test_the_row_by_row_product_computes_linear_and_each_row_alone(built_kernels, dtype, dims):
    """ROWWISE (`csrc/row_linear.cpp`): F.linear's product, within the dtype's rounding, and a row's
    bits are the same at every row count and whatever rows share the call: the property a step of
    any size needs to give a token the same logits (torch's own product lacks it in float32)."""
    outputs, dim = dims
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(outputs, dim, generator=generator).to(dtype)
    bias = torch.randn(outputs, generator=generator).to(dtype)
    rows = torch.randn(17, dim, generator=generator).to(dtype)
    out = linear_kernels.linear(rows, weight, bias, ROWWISE)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-7, atol=2e-2)
    torch.testing.assert_close(out.float(), F.linear(rows.float(), weight.float(), bias.float()), **tolerance)
    for start, count in [(0, 1), (3, 1), (3, 5), (12, 5), (0, 16)]:
        alone = linear_kernels.linear(rows[start : start + count], weight, bias, ROWWISE)
        assert torch.equal(alone, out[start : start + count])
    shuffled = torch.randn(4, dim, generator=generator).to(dtype)
    beside = linear_kernels.linear(torch.cat([shuffled, rows[5:6]]), weight, None, ROWWISE)
    assert torch.equal(beside[-1], linear_kernels.linear(rows[5:6], weight, None, ROWWISE)[0])
