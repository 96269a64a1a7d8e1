"""Which attention paths a model takes on this CPU, timed at load on its own heads
(`models.loader`): where they win depends on the heads, the rows and the machine, so it is
measured, not fixed.

- `tune_attention`: SDPA or two plain matmuls (`kv_cache.grouped_attention`) for gathered rows in
  reduced precision (`kv_cache.GROUPED`).
- `tune_paged_limits`: up to how many queries a row verify groups read the pool in place through
  the paged kernel (`models.paged_attention`) rather than the gather (`LoadedModel.paged_limits`);
  decode rows always do.
"""

from __future__ import annotations

import logging
import time
from functools import partial

import torch
import torch.nn.functional as F

from models import paged_attention
from models.kv_cache import GROUPED, PAGED_ROWS, PagedLimits, StepLayout, attend, grouped_attention
from scheduler.kv_blocks import blocks_for

logger = logging.getLogger("specd.models")

# (rows, new tokens per row, keys): batch-1 and batch-8 decode, a batch of 4 verifies.
TUNED_SHAPES = ((1, 1, 512), (8, 1, 512), (4, 5, 512))


@torch.inference_mode()
def tune_attention(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Time SDPA against the grouped matmuls on decode and verify shapes of this model's heads,
    once per process and dtype (CPU, reduced precision only); True where grouped wins by 5%."""
    if dtype == torch.float32 or dtype in GROUPED:
        return GROUPED.get(dtype, False)
    started = time.perf_counter()
    totals = {"sdpa": 0.0, "grouped": 0.0}
    for rows, new, keys in TUNED_SHAPES:
        q = torch.randn(rows, num_heads, new, head_dim, dtype=dtype)
        k = torch.randn(num_kv_heads, rows, keys, head_dim, dtype=dtype)
        v = torch.randn_like(k)
        mask = torch.ones(rows, 1, new, keys, dtype=torch.bool).tril(keys - new)
        gqa = num_kv_heads != num_heads
        runs = {
            "sdpa": partial(
                F.scaled_dot_product_attention, q, k.transpose(0, 1), v.transpose(0, 1), mask, enable_gqa=gqa
            ),
            "grouped": partial(grouped_attention, q, k, v, mask, None),
        }
        for run in runs.values():
            run()
        for _ in range(5):  # interleaved: a slow moment hurts both alike
            for name, run in runs.items():
                start = time.perf_counter()
                for _ in range(10):
                    run()
                totals[name] += time.perf_counter() - start
    grouped = GROUPED[dtype] = totals["grouped"] < 0.95 * totals["sdpa"]
    logger.info(
        "attention (%s): %s (grouped matmuls / SDPA %.2f; timed in %.1fs)",
        str(dtype).removeprefix("torch."),
        "grouped matmuls" if grouped else "SDPA",
        totals["grouped"] / totals["sdpa"],
        time.perf_counter() - started,
    )
    return grouped


PAGED_QUERIES = range(2, 9)  # verify rows of K = 1..7 drafts
PAGED_CONTEXT = 384  # keys each timed row reads
PAGED_BLOCK_SIZE = 16  # the pool's blocks as timed (`RunnerConfig.block_size`'s default)
_PAGED_LIMITS: dict[tuple[int, int, int, torch.dtype], PagedLimits] = {}


@torch.inference_mode()
def tune_paged_limits(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> PagedLimits:
    """Per PAGED_ROWS, the most queries a row for which the paged kernel reads a verify group
    faster than the gather and SDPA on this CPU, for this model's heads. It depends on the heads,
    the rows and the machine: on a 2-core EPYC the kernel read one Qwen2.5-Coder-1.5B verify row
    of 2-8 queries (12 heads of 128 over 2 kv heads) in 0.46-0.76 of the gather's time, and 16
    rows of 4 in 0.96. Timed once per process and shape over PAGED_CONTEXT keys, interleaved,
    the fastest of 7 tries each; each count stops at the first number of queries where the
    kernel is not 5% faster."""
    if not paged_attention.enabled() or head_dim > paged_attention.MAX_HEAD_DIM:
        return ()
    key = (num_heads, num_kv_heads, head_dim, dtype)
    if key in _PAGED_LIMITS:
        return _PAGED_LIMITS[key]
    started = time.perf_counter()
    blocks = blocks_for(PAGED_CONTEXT, PAGED_BLOCK_SIZE)
    pool = torch.randn(num_kv_heads, max(PAGED_ROWS) * blocks * PAGED_BLOCK_SIZE, head_dim, dtype=dtype)
    values = torch.randn_like(pool)
    tables = [list(range(r * blocks, (r + 1) * blocks)) for r in range(max(PAGED_ROWS))]
    limits, ratios = [], []
    for rows in PAGED_ROWS:
        limit = 1
        for queries in PAGED_QUERIES:
            q = torch.randn(rows * queries, num_heads, head_dim, dtype=dtype)
            starts, lens = [PAGED_CONTEXT - queries] * rows, [queries] * rows
            layouts = {
                paged: StepLayout.build(tables[:rows], starts, lens, PAGED_BLOCK_SIZE, torch.device("cpu"), (paged,))
                for paged in (queries, 1)
            }
            for layout in layouts.values():
                attend(layout, q, pool, values, None)
            best = dict.fromkeys(layouts, float("inf"))
            for _ in range(7):  # interleaved, the fastest of each: a slow moment hurts neither
                for paged, layout in layouts.items():
                    start = time.perf_counter()
                    for _ in range(3):
                        attend(layout, q, pool, values, None)
                    best[paged] = min(best[paged], time.perf_counter() - start)
            ratio = best[queries] / best[1]
            ratios.append(f"{rows}x{queries}: {ratio:.2f}")
            if ratio >= 0.95:
                break
            limit = queries
        limits.append(limit)
    _PAGED_LIMITS[key] = result = tuple(limits)
    logger.info(
        "attention (%d heads of %d): verify groups of %s rows read the pool in place up to %s queries a row "
        "(paged / gather %s; timed in %.1fs)",
        num_heads,
        head_dim,
        "/".join(map(str, PAGED_ROWS)),
        "/".join(map(str, result)),
        ", ".join(ratios),
        time.perf_counter() - started,
    )
    return result
