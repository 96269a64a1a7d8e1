"""Which GEMM layout each linear layer uses, per token count, and the products themselves.

A decode or verify step multiplies a few token rows x [M, in] by each weight W
[out, in]. `F.linear` computes x @ W^T; on CPU its BLAS call for 2-16 rows can
cost 1.5-2x the 1-row matrix-vector product, which is what made a verify step
dear and the step's cost non-convex in its tokens. The same product as
(W @ x^T)^T hands the library the weight as the left operand and, on the
2-core AVX2 machine this was found on (float32, SmolLM2-135M's shapes), ran
M = 2-5 in 0.43-0.62 of the time and M = 16-256 in 0.73-0.87; in bfloat16 on
the same CPU the two were equal. Machines and libraries differ, so nothing is
assumed: `models.kernel_tuning` times the layouts on the model's own weights
for a ladder of token counts (`RUNGS`), and `install` makes each linear layer
use the faster one for its step's M (a `KernelTable`). The output projection
gets a table of its own: its weight ([vocab, hidden], 49152 x 576 for SmolLM2,
a fifth of a step's bytes) is unlike any decoder layer's, and so is its best
layout (on the machine above, transposed ran M = 2-10 in 0.3-0.65 of the time
and 12-32 in 0.8-0.9, where the decoder layers tied from 5 to 15 rows). The
choice changes only the order of floating-point sums, as a different batch
composition does; CUDA keeps cuBLAS's own choice.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from models.quantized import QuantizedWeight, round_rows

logger = logging.getLogger("specd.models")

# Token counts timed; a step of M tokens takes the choice of the largest rung <= M. Every count
# up to 32 (decode and verify steps), as BLAS kernels switch at odd sizes (on the AVX2 CPU
# above, 8 rows ran in 0.89 of the time transposed and 11 in 1.05); past the last rung (long
# prefill chunks) the last rung's choice where it is the weight-only kernel (its time grows
# row by row, as a compute-bound dense product's does), else the standard layout.
RUNGS = (*range(1, 33), 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)


# x @ W^T; (W @ x^T)^T; one row computed as two, transposed; oneDNN on a weight reordered once
# for its kernels (`pack`). On an AMX CPU in bf16 the packed product of SmolLM2's MLP weights ran
# 1-64 rows in 0.5-0.7 of F.linear's time; on float32 it is often no faster: the timing decides.
# QUANTIZED: the layer's weight-only int8/int6/int4 copy (`models.quantized`), for layers that have one.
# CHUNKED: x @ W^T in calls of exactly INVARIANT_ROWS rows, the last one padded (`--batch-invariant`).
# ROWWISE: specd's own product that computes each row alone (`csrc/row_linear.cpp`): a dense output
# projection's, where every step size must give a token the same logits.
STANDARD_LAYOUT, TRANSPOSED, PADDED, PACKED, QUANTIZED, CHUNKED, ROWWISE = 0, 1, 2, 3, 4, 5, 6
# A BLAS library picks its kernel (and so the order of a row's sums) by the call's row count:
# in bf16 on an AMX Xeon, F.linear gave a row other bits past 32 rows than alone, and in
# float32 at every count from 2. A call of one fixed size gives each row the same bits wherever
# it sits and whatever shares the call (checked at load: `check_row_invariance`).
INVARIANT_ROWS = 16
LAYOUT_NAMES = {
    STANDARD_LAYOUT: "x @ W^T",
    TRANSPOSED: "(W @ x^T)^T",
    PADDED: "(W @ [x; x]^T)^T",
    PACKED: "packed",
    QUANTIZED: "weight-only",
    CHUNKED: f"x @ W^T in {INVARIANT_ROWS}-row calls",
    ROWWISE: "row by row",
}


@dataclass(frozen=True)
class KernelTable:
    """Per rung of `RUNGS`, the layout that runs and its time relative to x @ W^T."""

    layouts: tuple[int, ...] = ()
    ratios: tuple[float, ...] = ()
    seconds: float = 0.0  # what tuning took
    beyond: int = STANDARD_LAYOUT  # past the last rung
    # The layout for every token count up to the last rung: a list lookup per call, as the
    # dispatch runs once per linear layer per step.
    _by_tokens: list[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_tokens", [self._choose(m) for m in range(RUNGS[-1] + 1)])

    def _choose(self, num_tokens: int) -> int:
        if not self.layouts or num_tokens < 1:
            return STANDARD_LAYOUT
        return self.layouts[bisect.bisect_right(RUNGS, num_tokens) - 1]

    def uses(self, layout: int) -> bool:
        return layout in self.layouts

    @property
    def weight_only(self) -> bool:
        """Every step size runs the weight-only kernel: the dense weight is never read."""
        return bool(self.layouts) and self.beyond == QUANTIZED and all(x == QUANTIZED for x in self.layouts)

    def layout(self, num_tokens: int) -> int:
        return self._by_tokens[num_tokens] if num_tokens <= RUNGS[-1] else self.beyond

    def describe(self) -> str:
        """The table as one log line: runs of token counts sharing a layout."""
        if not self.layouts:
            return "x @ W^T everywhere (not tuned)"
        names = LAYOUT_NAMES
        parts, i = [], 0
        while i < len(RUNGS):
            j = i
            while j + 1 < len(RUNGS) and self.layouts[j + 1] == self.layouts[i]:
                j += 1
            last = RUNGS[j + 1] - 1 if j + 1 < len(RUNGS) else RUNGS[-1]
            text = f"{RUNGS[i]}-{last} tokens: {names[self.layouts[i]]}"
            if self.layouts[i] != STANDARD_LAYOUT:
                ratios = self.ratios[i : j + 1]
                text += f" ({min(ratios):.2f}-{max(ratios):.2f} of the time)"
            parts.append(text)
            i = j + 1
        return f"{'; '.join(parts)}; {names[self.beyond]} above {RUNGS[-1]} (tuned in {self.seconds:.1f}s)"


STANDARD = KernelTable()
DENSE = "dense"
# Where nothing was timed (`--no-tune-kernels`), a quantized copy runs steps of up to 8 rows: on
# the CPUs measured, the weight-only kernel beat a dense product by 2x or more up to 8 rows.
UNTUNED_QUANTIZED = KernelTable(
    tuple(QUANTIZED if m <= 8 else STANDARD_LAYOUT for m in RUNGS), tuple(1.0 for _ in RUNGS)
)


@dataclass(frozen=True)
class ModelKernels:
    """A model's tables: its dense decoder layers', its output projection's, and one per format
    for the decoder layers that have a quantized copy."""

    layers: KernelTable = STANDARD
    output: KernelTable = STANDARD
    quantized: tuple[tuple[str, KernelTable], ...] = ()
    untimed_quantized: KernelTable = UNTUNED_QUANTIZED  # a format nothing timed

    @property
    def is_tuned(self) -> bool:
        return bool(self.layers.layouts or self.output.layouts or self.quantized)

    def table_for(self, product: Any) -> KernelTable:
        """The table a decoder product follows: its format's, or the dense layers'."""
        weight = getattr(product, "quantized_weight", None)
        if weight is None:
            return self.layers
        return next((table for fmt, table in self.quantized if fmt == weight.fmt), self.untimed_quantized)

    def describe(self) -> str:
        text = f"layers: {self.layers.describe()}; output projection: {self.output.describe()}"
        return text + "".join(f"; {fmt} layers: {table.describe()}" for fmt, table in self.quantized)


UNTUNED = ModelKernels()
# `--batch-invariant`: every dense product in fixed-size calls (`chunked_linear`).
# Quantized ones run their weight-only kernel at every size: it gives a row the same bits whatever
# shares the call, and reads a quarter of the dense bytes.
INVARIANT_TABLE = KernelTable(tuple(CHUNKED for _ in RUNGS), tuple(1.0 for _ in RUNGS), beyond=CHUNKED)
WEIGHT_ONLY_TABLE = KernelTable(tuple(QUANTIZED for _ in RUNGS), tuple(1.0 for _ in RUNGS), beyond=QUANTIZED)
INVARIANT = ModelKernels(layers=INVARIANT_TABLE, output=INVARIANT_TABLE, untimed_quantized=WEIGHT_ONLY_TABLE)


ROWWISE_TABLE = KernelTable(tuple(ROWWISE for _ in RUNGS), tuple(1.0 for _ in RUNGS), beyond=ROWWISE)


def step_invariant_kernels(kernels: ModelKernels, output: nn.Module | None) -> ModelKernels:
    """`kernels` with every quantized decoder layer on its weight-only kernel at every size, and
    the `output` projection on its weight-only kernel or, dense, row by row (`ROWWISE`); the dense
    decoder layers keep their table. Both kernels compute each row alone, so a token's products
    no longer depend on its step's size: a prefill chunk, a cached prefix's tail, a decode and a
    verify give it the same bits (`models.loader`: float32's default for quantized models)."""
    output_quantized = output is not None and quantized_format(output) != DENSE
    return replace(
        kernels,
        output=WEIGHT_ONLY_TABLE if output_quantized else ROWWISE_TABLE,
        quantized=tuple((fmt, WEIGHT_ONLY_TABLE) for fmt, _ in kernels.quantized),
        untimed_quantized=WEIGHT_ONLY_TABLE,
    )


# x @ W^T for every product, quantized ones too (a benchmark's baseline).
STANDARD_ONLY = ModelKernels(untimed_quantized=STANDARD)


class TunedLinear(nn.Linear):
    """An `nn.Linear` whose product layout follows a `KernelTable` (same weights, same state dict;
    a table that packs keeps the packed copy beside the weight, `packed_weight`; a quantized layer
    keeps its weight-only copy, `quantized_weight`, whose values the dense weight holds)."""

    kernel_table: KernelTable = STANDARD
    packed_weight: torch.Tensor | None = None
    quantized_weight: QuantizedWeight | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layout = self.kernel_table.layout(x.numel() // self.in_features)
        return linear(x, self.weight, self.bias, layout, self.packed_weight, self.quantized_weight)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    layout: int,
    packed: torch.Tensor | None = None,
    quantized: QuantizedWeight | None = None,
) -> torch.Tensor:
    """x @ W^T + b in `layout` (PACKED needs `packed`, `pack(weight)`; QUANTIZED needs `quantized`).
    A quantized layer's dense layouts multiply the rows as its kernel rounds them (`round_rows`),
    so every layout computes one model."""
    if quantized is not None and layout != QUANTIZED:
        x = round_rows(x)
    if layout == STANDARD_LAYOUT:
        return F.linear(x, weight, bias)
    if layout == CHUNKED:
        return chunked_linear(x, weight, bias)
    if layout == ROWWISE:
        return torch.ops.specd.row_linear(x, weight, bias)
    if layout == QUANTIZED:
        assert quantized is not None, "the weight-only layout needs the quantized copy"
        out = quantized.matmul(x.reshape(-1, x.shape[-1]).contiguous())  # its kernels read rows densely
        if bias is not None:
            out += bias
        return out.view(*x.shape[:-1], weight.shape[0])
    if layout == PACKED:
        assert packed is not None, "the packed layout needs the packed weight"
        rows = x.reshape(-1, x.shape[-1])
        out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
        return out.view(*x.shape[:-1], weight.shape[0])
    return transposed_linear(x, weight, bias, padded=layout == PADDED)


def chunked_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W^T + b in calls of exactly `INVARIANT_ROWS` rows (zeros pad the last), so a row's
    bits do not depend on how many rows the step has."""
    rows = x.reshape(-1, x.shape[-1])
    num_rows = rows.shape[0]
    pad = -num_rows % INVARIANT_ROWS
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])
    out = torch.cat([F.linear(chunk, weight, bias) for chunk in rows.split(INVARIANT_ROWS)])
    return out[:num_rows].view(*x.shape[:-1], weight.shape[0])


def check_row_invariance(weights: Iterable[torch.Tensor]) -> None:
    """Raise unless `chunked_linear` gives each row the same bits at every place in a call, for
    each weight (the model's own shapes: libraries switch kernels by shape too)."""
    generator = torch.Generator().manual_seed(0)
    for weight in weights:
        rows = torch.randn(INVARIANT_ROWS, weight.shape[1], generator=generator).to(weight.device, weight.dtype)
        together = chunked_linear(rows, weight, None)
        for i in range(INVARIANT_ROWS):
            if not torch.equal(chunked_linear(rows[i : i + 1], weight, None)[0], together[i]):
                raise RuntimeError(
                    f"--batch-invariant: a {tuple(weight.shape)} {weight.dtype} product gives row {i} other bits "
                    "than the same row alone on this machine's BLAS; the mode cannot hold here"
                )


def can_pack(weight: torch.Tensor) -> bool:
    """oneDNN's reordered weights: CPU builds with oneDNN, bf16 and float32."""
    return (
        weight.device.type == "cpu"
        and weight.dtype in (torch.bfloat16, torch.float32)
        and torch.backends.mkldnn.is_available()
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] reordered once into oneDNN's blocked layout (a copy of its bytes)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def transposed_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, padded: bool = False
) -> torch.Tensor:
    """x @ W^T + b computed as (W @ x^T)^T, contiguous like F.linear's output. `padded` (one
    row only) multiplies the row twice and keeps one: where a 2-column GEMM beats the 1-row
    matrix-vector kernel, as it did on the AVX2 CPU above (0.73 of the time)."""
    rows = x.reshape(-1, x.shape[-1])
    if padded:
        out = torch.mm(weight, rows.repeat(2, 1).t())[:, :1].t().contiguous()
    else:
        out = torch.mm(weight, rows.t()).t().contiguous()
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.shape[0])


def drop_dense(layer: nn.Module) -> bool:
    """Free `layer`'s dense weight where its table runs the weight-only kernel at every step size
    (True if it did): the weight becomes a meta tensor, its shape without storage. A table with
    a dense layout is refused from then on (`install`); transformers' forward is the loader's to
    refuse (`models.forward.refuse_transformers_forward`)."""
    if not isinstance(layer, TunedLinear) or not reads_no_dense(layer.quantized_weight, layer.kernel_table):
        return False
    layer.weight = dense_placeholder(layer.weight)
    return True


def reads_no_dense(quantized: QuantizedWeight | None, table: KernelTable) -> bool:
    """A product with this copy and table never reads its dense weight: `drop_dense` may free it."""
    return quantized is not None and table.weight_only


def check_dense_kept(weight: torch.Tensor, table: KernelTable) -> None:
    """Raise where `table` would read a dense weight `drop_dense` freed."""
    if weight.is_meta and not table.weight_only:
        raise RuntimeError(
            "a layer whose dense weight was freed (keep_dense_weights=False) runs only its weight-only kernel"
        )


def dense_placeholder(weight: torch.Tensor) -> nn.Parameter:
    """A weight's shape and dtype on the meta device: what stands for a dropped dense weight."""
    return nn.Parameter(torch.empty(weight.shape, dtype=weight.dtype, device="meta"), requires_grad=False)


def linear_layers(model: nn.Module) -> list[nn.Linear]:
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


def linear_params(model: nn.Module) -> int:
    """Weights a token's forward multiplies by: its linear layers', the output projection's among
    them, each weight once (an embedding lookup reads one row)."""
    return sum({id(m.weight): m.weight.numel() for m in linear_layers(model)}.values())


def quantized_format(product: Any) -> str:
    """The format of `product`'s quantized copy, or DENSE."""
    weight = getattr(product, "quantized_weight", None)
    return weight.fmt if weight is not None else DENSE


def install_model(model: nn.Module, kernels: ModelKernels) -> None:
    """Make `model`'s decoder layers and its output projection follow their tables in `kernels`."""
    output, layers = split_output(model)
    for layer in layers:
        install([layer], kernels.table_for(layer))
    if output is not None:
        untimed_copy = not kernels.output.layouts and getattr(output, "quantized_weight", None) is not None
        install([output], kernels.untimed_quantized if untimed_copy else kernels.output)


def split_output(model: nn.Module) -> tuple[nn.Linear | None, list[nn.Linear]]:
    """The output projection (None if the model has none as an nn.Linear) and the other linear layers."""
    get_output = getattr(model, "get_output_embeddings", None)
    output = get_output() if callable(get_output) else None
    output = output if isinstance(output, nn.Linear) else None
    return output, [m for m in linear_layers(model) if m is not output]


def install(layers: Iterable[nn.Linear], table: KernelTable) -> None:
    packs = table.uses(PACKED)
    for layer in layers:
        if type(layer) is nn.Linear:
            layer.__class__ = TunedLinear
        if isinstance(layer, TunedLinear):
            check_dense_kept(layer.weight, table)
            layer.kernel_table = table
            if packs and layer.packed_weight is None:
                layer.packed_weight = pack(layer.weight)
