"""Timing the GEMM layouts at load: the `KernelTable`s `models.linear_kernels` follows.

`tune` times every layout a product can run (and its quantized copy's weight-only kernel)
on a sample of the model's own weights at each rung of `RUNGS`; the median of interleaved
passes decides, and a layout must win by `MIN_GAIN` to replace x @ W^T. `tune_model` does
it once per process for each set of shapes, dtype and thread count, for a model's decoder
layers (per weight format) and its output projection, and installs the tables.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from torch import nn

from models.linear_kernels import (
    DENSE,
    PACKED,
    PADDED,
    QUANTIZED,
    RUNGS,
    STANDARD,
    STANDARD_LAYOUT,
    TRANSPOSED,
    UNTUNED,
    KernelTable,
    ModelKernels,
    can_pack,
    install_model,
    linear,
    pack,
    quantized_format,
    split_output,
    step_invariant_kernels,
)
from models.quantized import QuantizedWeight

logger = logging.getLogger("specd.models")

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
    output, layers = split_output(model)
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
