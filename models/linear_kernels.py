"""Which GEMM layout each linear layer uses, chosen per token count by timing both at load.

A decode or verify step multiplies a few token rows x [M, in] by each weight W
[out, in]. `F.linear` computes x @ W^T; on CPU its BLAS call for 2-16 rows can
cost 1.5-2x the 1-row matrix-vector product, which is what made a verify step
dear and the step's cost non-convex in its tokens. The same product as
(W @ x^T)^T hands the library the weight as the left operand and, on the
2-core AVX2 machine this was found on (float32, SmolLM2-135M's shapes), ran
M = 2-5 in 0.43-0.62 of the time and M = 16-256 in 0.73-0.87; in bfloat16 on
the same CPU the two were equal. Machines and libraries differ, so nothing is
assumed: `tune` times both layouts on the model's own weights for a ladder
of token counts and `install` makes each linear layer use the faster one for
its step's M. The output projection gets a table of its own: its weight
([vocab, hidden], 49152 x 576 for SmolLM2, a fifth of a step's bytes) is
unlike any decoder layer's, and so is its best layout (on the machine above,
transposed ran M = 2-10 in 0.3-0.65 of the time and 12-32 in 0.8-0.9, where
the decoder layers tied from 5 to 15 rows). The choice changes only the order of
floating-point sums, as a different batch composition does; CUDA keeps
cuBLAS's own choice.
"""

from __future__ import annotations

import bisect
import logging
import math
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
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
# Weights timed per pass: enough bytes that they stream from memory as in a real step, not
# from cache (a few layers of a small model, or the first rows of its output projection; all
# of a tiny one).
SAMPLE_BYTES = 64 << 20
# Past 32 rows the product is compute-bound (on 2 cores a 64 MB pass at 64 rows computes for ~6x
# what it streams), so a quarter of the sample times it as well, and the ladder to 256, which
# was most of the tuning time, costs a quarter.
LADDER_FROM, LADDER_SAMPLE_BYTES = 33, SAMPLE_BYTES // 4
REPEATS = 3
# The weight-only kernel (a layer's quantized copy) is timed at every rung, and up to this many
# rows it is timed cold: a decode step streams every weight from memory, and a sample warm in a
# large last-level cache (300 MiB on a Xeon measured) flattered the dense layouts, which read 2-4x
# the bytes; past it the product is compute-bound, and the integer dot products (64 a VNNI
# instruction) race the dense bf16 ones. Which wins is the CPU's: on a 2-core AMX Xeon a dense
# product won past 16 rows (17920 x 1536 int4, warm: 1.9 ms at 16 rows against 2.6-2.9 dense);
# on a 2-core Zen 4 without AMX the kernel won at every rung, 0.7x the packed bf16 product's
# time at 64-256 rows (Qwen2.5-Coder-1.5B's int4k products).
QUANTIZED_ROWS = 16
# The transposed layout must beat the standard one by this much: a tie is not worth a change.
MIN_GAIN = 0.05


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


# Seconds one pass took: timer(pass, layout, tokens) runs the pass once.
Timer = Callable[[Callable[[], object], int, int], float]


def wall_seconds(fn: Callable[[], object], layout: int, num_tokens: int) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


# A weight timed in a pass, its bias, and its quantized copy (if it has one).
Weight = tuple[torch.Tensor, torch.Tensor | None, QuantizedWeight | None]


@torch.inference_mode()
def tune(layers: Iterable[Any], timer: Timer = wall_seconds, dense_only: bool = False) -> KernelTable:
    """Time the layouts over a sample of `layers`' weights at every rung; the median of
    `REPEATS` interleaved passes decides. Layers with a quantized copy (all or none of them)
    also time the weight-only kernel, unless `dense_only`."""
    started = time.perf_counter()
    weights = [(layer.weight, layer.bias, None if dense_only else getattr(layer, "quantized_weight", None))
               for layer in layers]  # fmt: skip
    sample = _sample(weights, SAMPLE_BYTES)
    ladder_sample = _sample(sample, LADDER_SAMPLE_BYTES)
    if not sample:
        return STANDARD
    weight = sample[0][0]
    widths = {w.shape[1] for w, _, _ in sample}
    inputs = {n: torch.randn(RUNGS[-1], n, dtype=weight.dtype, device=weight.device) for n in widths}
    packing = can_pack(weight)
    quantized = all(q is not None for _, _, q in sample)
    packed = {id(timed): [pack(w) if packing else None for w, _, _ in timed] for timed in (sample, ladder_sample)}
    layouts, ratios = [], []
    chosen_seconds, weight_only_seconds, standard_seconds = [], [], []  # per rung, the medians
    for m in RUNGS:
        rows = {n: x[:m] for n, x in inputs.items()}
        timed = sample if m < LADDER_FROM else ladder_sample
        candidates: tuple[int, ...] = (TRANSPOSED, PADDED) if m == 1 else (TRANSPOSED,)
        candidates += (PACKED,) if packing else ()
        candidates += (QUANTIZED,) if quantized else ()
        cold = quantized and m <= QUANTIZED_ROWS

        def run(layout: int, rows=rows, timed=timed) -> Callable[[], None]:
            def passes() -> None:
                for (w, b, q), p in zip(timed, packed[id(timed)]):
                    linear(rows[w.shape[1]], w, b, layout, p, q)

            return passes

        runs = {layout: run(layout) for layout in (STANDARD_LAYOUT, *candidates)}
        for fn in runs.values():
            fn()  # warm every kernel up
        times: dict[int, list[float]] = {layout: [] for layout in runs}
        for _ in range(REPEATS):  # interleaved, so a slow moment hurts every layout alike
            for layout, fn in runs.items():
                if cold:
                    evict_caches()
                times[layout].append(timer(fn, layout, m))
        median = {layout: statistics.median(t) for layout, t in times.items()}
        best = min(candidates, key=median.__getitem__)
        ratio = median[best] / max(median[STANDARD_LAYOUT], 1e-12)
        chosen = best if ratio < 1.0 - MIN_GAIN else STANDARD_LAYOUT
        layouts.append(chosen)
        ratios.append(round(ratio if chosen != STANDARD_LAYOUT else 1.0, 3))
        chosen_seconds.append(median[chosen])
        weight_only_seconds.append(median.get(QUANTIZED, math.inf))
        standard_seconds.append(median[STANDARD_LAYOUT])
    if quantized and sum(weight_only_seconds) <= (1.0 + MIN_GAIN) * sum(chosen_seconds):
        # A tie over the whole ladder goes to the weight-only kernel at every step size: the
        # dense weight (and any packed copy) then need not stay in memory (`drop_dense`), and a
        # rung or two won by a dense layout on a noisy pass does not keep them.
        layouts = [QUANTIZED] * len(RUNGS)
        ratios = [round(q / max(s, 1e-12), 3) for q, s in zip(weight_only_seconds, standard_seconds)]
    beyond = QUANTIZED if layouts[-1] == QUANTIZED else STANDARD_LAYOUT
    return KernelTable(tuple(layouts), tuple(ratios), time.perf_counter() - started, beyond)


@lru_cache(maxsize=1)
def _eviction_buffer() -> torch.Tensor:
    """Twice the last-level cache (sysfs; 64 MiB where unknown), capped at 1 GiB."""
    size = 32 << 20
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
            size = max(size, int(text[:-1]) << {"K": 10, "M": 20, "G": 30}[text[-1]])
        except (OSError, ValueError, KeyError, IndexError):
            continue
    return torch.ones(min(2 * size, 1 << 30) // 4, dtype=torch.float32)


def evict_caches() -> None:
    """Read a buffer larger than the last-level cache, so the next pass reads its weights from memory."""
    _eviction_buffer().sum()


def _sample(weights: Iterable[Weight], budget: int) -> list[Weight]:
    """The first `budget` bytes of `weights`: whole weights, and the first rows of the one that
    crosses the budget (a row slice is still a weight of that shape's kind; a view, not a copy).
    A quantized copy is cut to the same rows, or the few more its kernel's layout blocks by."""
    sample: list[Weight] = []
    for w, b, q in weights:
        if budget <= 0:
            break
        rows = max(1, min(w.shape[0], budget // max(w.shape[1] * w.element_size(), 1)))
        if q is not None and rows < w.shape[0]:
            q = q.head(rows)
            rows = q.out_features
        sample.append((w[:rows], None if b is None else b[:rows], q))
        budget -= rows * w.shape[1] * w.element_size()
    return sample


# One table per process for each dtype, thread count and set of weight shapes (CPU only): engines built in one
# process (tests, a draft sharing the target's shapes) then compute alike.
_TABLES: dict[tuple, KernelTable] = {}


def tune_model(model: nn.Module, gemms: Sequence[Any] | None = None, step_invariant: bool = False) -> ModelKernels:
    """Tune `model`'s decoder layers and its output projection (CPU only), each on its own
    weights, and make them follow their tables; returns them. `gemms`: the decoder's products
    as they really run, when not its linear layers one by one (a forward that fuses q, k and v
    multiplies by their concatenation, and that shape is what is timed). Products with a
    quantized copy get a table per format, where the weight-only kernel is one of the layouts;
    with `step_invariant` they and the output projection take `step_invariant_kernels`' tables
    untimed, and only the dense table is timed."""
    output, layers = _split(model)
    if not layers or layers[0].weight.device.type != "cpu":
        return UNTUNED
    groups: dict[str, list[Any]] = {}
    for product in gemms or layers:
        groups.setdefault(quantized_format(product), []).append(product)
    dense = groups.pop(DENSE, [])
    # Every product quantized: the dense table is still timed on their dense weights, for the
    # steps too large for the weight-only kernel's table to matter and for a draft head's layers.
    products = dense or [p for group in groups.values() for p in group]
    layers_table = _table(products, "decoder layers", dense_only=True)
    if step_invariant:
        kernels = step_invariant_kernels(ModelKernels(layers_table), output)
    else:
        quantized = tuple((fmt, _table(group, f"{fmt} decoder layers")) for fmt, group in sorted(groups.items()))
        output_table = _table([output], "output projection") if output is not None else STANDARD
        kernels = ModelKernels(layers_table, output_table, quantized)
    install_model(model, kernels)
    _eviction_buffer.cache_clear()  # up to 1 GiB, needed only while timing
    return kernels


def quantized_format(product: Any) -> str:
    """The format of `product`'s quantized copy, or DENSE."""
    weight = getattr(product, "quantized_weight", None)
    return weight.fmt if weight is not None else DENSE


def install_model(model: nn.Module, kernels: ModelKernels) -> None:
    """Make `model`'s decoder layers and its output projection follow their tables in `kernels`."""
    output, layers = _split(model)
    for layer in layers:
        install([layer], kernels.table_for(layer))
    if output is not None:
        untimed_copy = not kernels.output.layouts and getattr(output, "quantized_weight", None) is not None
        install([output], kernels.untimed_quantized if untimed_copy else kernels.output)


def _split(model: nn.Module) -> tuple[nn.Linear | None, list[nn.Linear]]:
    """The output projection (None if the model has none as an nn.Linear) and the other linear layers."""
    get_output = getattr(model, "get_output_embeddings", None)
    output = get_output() if callable(get_output) else None
    output = output if isinstance(output, nn.Linear) else None
    return output, [m for m in linear_layers(model) if m is not output]


def _table(layers: list[Any], role: str, dense_only: bool = False) -> KernelTable:
    """The process's table for these layers' shapes, tuned (and logged) the first time only
    (`dense_only`: their dense layouts, whatever copies they have)."""
    weight = layers[0].weight
    shapes = tuple(sorted({tuple(m.weight.shape) for m in layers}))
    fmt = DENSE if dense_only else quantized_format(layers[0])
    key = (weight.dtype, torch.get_num_threads(), fmt, shapes)
    table = _TABLES.get(key)
    if table is None:
        logger.info("timing GEMM layouts for the %s (--no-tune-kernels skips this)", role)
        table = _TABLES[key] = tune(layers, dense_only=dense_only)
        logger.info("linear kernels, %s: %s", role, table.describe())
    return table


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
