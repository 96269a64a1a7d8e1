"""Paged attention that reads the KV pool in place, for decode rows on CPU, and verify rows of up
to `LoadedModel.paged_limits` queries where it beat the gather at load
(`models.attention_timing.tune_paged_limits`).

`models.kv_cache` otherwise gathers every row's blocks into a padded copy per layer and
SDPA reads that copy again: three passes over the rows' KV where attention needs one. At 32
decode rows of ~250 keys (SmolLM2, bf16, 2 cores) the gather alone took 1.9 ms a layer. The
kernel (`csrc/paged_attention.cpp`, built by `models.cpu_kernels`) is
`torch.ops.specd.paged_attention`; where it is not built the gather path serves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from models import cpu_kernels

if TYPE_CHECKING:
    from models.kv_cache import AttentionGroup

MAX_HEAD_DIM = 256  # the kernel's per-key registers (kMaxHeadDim)

_enabled = False  # decode groups on CPU read the pool in place (`use`)
_everywhere = False  # verify rows and prefill chunks too (`--batch-invariant`)


def enabled() -> bool:
    return _enabled


def everywhere() -> bool:
    return _enabled and _everywhere


def use(wanted: bool, everywhere: bool = False) -> None:
    """Whether `models.kv_cache` sends CPU decode groups here (only where the kernels are loaded),
    and with `everywhere` every group: the kernel computes each query alone, over its keys in
    block order, so a token's attention has the same bits in a decode, a verify or a prefill."""
    global _enabled, _everywhere
    _enabled = wanted and cpu_kernels.available()
    _everywhere = everywhere


def reads(group: AttentionGroup, query: torch.Tensor, sliding_window: int | None) -> bool:
    """Groups planned for the kernel (decode rows, and verify rows where it was faster at load),
    on CPU, with the kernel loaded and enabled. Prefill chunks stay with the gather and SDPA's
    blocked kernels: for SmolLM2 at 6-11 queries a row the kernel ran 1.4-2.5x slower than the
    gather and SDPA (bf16 and float32, 2 cores), at 1 query 1.5-3.2x faster."""
    return (
        group.plan.paged  # a decode group, planned while the kernel was enabled
        and not sliding_window
        and query.device.type == "cpu"
        and query.dtype in (torch.float32, torch.bfloat16)
        and query.shape[-1] <= MAX_HEAD_DIM
    )


def attend_group(group: AttentionGroup, q, k_pool, v_pool, scaling: float | None) -> torch.Tensor:
    """`models.kv_cache`'s attention for a group that `reads` takes: q [n, H, D] -> [n, H, D]."""
    assert group.block_index is not None and group.query_start is not None
    plan = group.plan
    table = group.block_index.view(plan.num_rows, plan.num_blocks)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    return paged_attention(q, k_pool, v_pool, table, group.query_start, group.grid_start, group.block_size, scale)


def paged_attention(
    query: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    block_table: torch.Tensor,
    query_start: torch.Tensor,
    context_start: torch.Tensor,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """query [T, H, D], rows' queries back to back (row r: query_start[r]:query_start[r + 1], at
    positions context_start[r] + i); pools [KVH, slots, D]; block_table [rows, blocks] -> [T, H, D]."""
    return torch.ops.specd.paged_attention(
        query, key_pool, value_pool, block_table, query_start, context_start, block_size, scale
    )
