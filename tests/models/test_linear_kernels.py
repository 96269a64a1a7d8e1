"""models.linear_kernels: the layouts compute the same product, tuned layers follow their table, load installs it."""

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
    linear_params,
    transposed_linear,
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


def test_linear_params_count_each_weight_once_tied_output_included():
    tied = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 6), nn.Linear(6, 4), nn.Linear(4, 10, bias=False))
    tied[3].weight = tied[0].weight  # an output projection that is the input embedding
    assert linear_params(tied) == 24 + 24 + 40  # counted once, as a projection; a lookup reads one row
    untied = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False), nn.Linear(4, 10, bias=False))
    assert linear_params(untied) == 80
