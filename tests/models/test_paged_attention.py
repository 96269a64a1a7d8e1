"""models.paged_attention: the in-place kernel against plain attention over gathered keys, and
the dispatch in `models.kv_cache.attend` (the build and its fallback: test_cpu_kernels.py)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from models import paged_attention
from models.attention_timing import tune_paged_limits
from models.kv_cache import PAGED_ROWS, LayoutPlan, attend, paged_limit
from models.transfer import HostBuffer


@pytest.fixture
def kernel(built_kernels):
    return paged_attention


def pool_and_tables(
    rng: random.Random, lens_before: list[int], new: list[int], block_size: int, kv_heads: int, head_dim: int, dtype
) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    """K and V pools [KVH, slots, D] and each row's blocks, scattered over the pool."""
    needed = [-(-(s + n) // block_size) for s, n in zip(lens_before, new)]
    blocks = list(range(sum(needed) + 7))
    rng.shuffle(blocks)
    tables, at = [], 0
    for count in needed:
        tables.append(blocks[at : at + count])
        at += count
    shape = (kv_heads, len(blocks) * block_size, head_dim)
    return torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype), tables


def reference(q, k_pool, v_pool, tables, starts, lens, block_size, scale) -> torch.Tensor:
    """Row by row in float64: keys gathered position by position, causal from each row's start."""
    out, at = [], 0
    group = q.shape[1] // k_pool.shape[0]
    for table, start, n in zip(tables, starts, lens):
        slots = [table[p // block_size] * block_size + p % block_size for p in range(start + n)]
        key = k_pool[:, slots].double().repeat_interleave(group, 0)  # [H, keys, D]
        value = v_pool[:, slots].double().repeat_interleave(group, 0)
        query = q[at : at + n].double().transpose(0, 1)  # [H, n, D]
        visible = torch.arange(start + n)[None, :] <= (start + torch.arange(n))[:, None]
        out.append(F.scaled_dot_product_attention(query, key, value, attn_mask=visible, scale=scale).transpose(0, 1))
        at += n
    return torch.cat(out)


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4)])
@pytest.mark.parametrize("block_size", [16, 5, 1])
@pytest.mark.parametrize("queries", [1, 4])
def test_kernel_matches_attention_over_gathered_keys(kernel, dtype, tolerance, heads, kv_heads, block_size, queries):
    check_kernel(kernel, dtype, tolerance, heads, kv_heads, block_size, queries, head_dim=16)


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("head_dim", [8, 20, 24, 32, 64, 128, 256])
def test_kernel_matches_at_every_head_dim(kernel, dtype, tolerance, head_dim):
    """Head dims that fill whole SIMD vectors (unrolled) and ones that leave a padded tail
    (20 fills neither 8- nor 16-lane vectors, 24 only 8-lane ones)."""
    check_kernel(kernel, dtype, tolerance, 8, 2, 16, 1, head_dim)


def check_kernel(kernel, dtype, tolerance, heads, kv_heads, block_size, queries, head_dim):
    rng = random.Random(f"{dtype}{heads}{block_size}{queries}{head_dim}")
    torch.manual_seed(rng.randrange(1 << 30))
    starts = [0, 1, 15, 16, 33, rng.randrange(60)]
    lens = [queries] * len(starts)
    k_pool, v_pool, tables = pool_and_tables(rng, starts, lens, block_size, kv_heads, head_dim, dtype)
    q = torch.randn(sum(lens), heads, head_dim, dtype=dtype)
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [t[0]] * (width - len(t)) for t in tables])
    query_start = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    scale = head_dim**-0.5
    got = kernel.paged_attention(q, k_pool, v_pool, table, query_start, torch.tensor(starts), block_size, scale)
    want = reference(q, k_pool, v_pool, tables, starts, lens, block_size, scale)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.double(), want, atol=tolerance, rtol=tolerance)


def layout_for(tables, starts, lens, block_size, paged_limits=()):
    plan = LayoutPlan.build(tables, starts, lens, block_size, paged_limits)
    buf = HostBuffer()
    plan.add_to(buf, "l")
    return plan.resolve(buf.upload(torch.device("cpu")), "l")


def test_attend_reads_decode_rows_in_place_and_verify_rows_up_to_their_limit(kernel, monkeypatch):
    rng = random.Random(0)
    block_size, starts, lens = 4, [9, 3, 20, 6], [1, 1, 5, 3]  # two decode rows; a verify group of 2 rows, 5 queries
    k_pool, v_pool, tables = pool_and_tables(rng, starts, lens, block_size, 2, 8, torch.float32)
    q = torch.randn(sum(lens), 4, 8)
    calls: list[int] = []
    real = paged_attention.paged_attention
    monkeypatch.setattr(
        paged_attention, "paged_attention", lambda query, *a: calls.append(len(query)) or real(query, *a)
    )
    paged_attention.use(True)
    want = reference(q, k_pool, v_pool, tables, starts, lens, block_size, 8**-0.5)
    # the verify group (2 rows) reads in place up to its limit (the second: groups of 2-4 rows), else SDPA
    for limits, read in [((), [2]), ((8, 5), [2, 8]), ((8, 4), [2]), ((5,), [2, 8])]:
        calls.clear()
        got = attend(layout_for(tables, starts, lens, block_size, limits), q, k_pool, v_pool, 8**-0.5)
        assert calls == read, limits
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    assert [paged_limit((8, 6, 4), rows) for rows in (1, 2, 4, 5, 16, 40)] == [8, 6, 6, 4, 4, 4]
    assert paged_limit((), 1) == 1
    got = attend(layout_for(tables, starts, lens, block_size), q, k_pool, v_pool, 8**-0.5)
    paged_attention.use(False)
    calls.clear()
    gathered = attend(layout_for(tables, starts, lens, block_size), q, k_pool, v_pool, 8**-0.5)
    assert calls == []
    torch.testing.assert_close(gathered, got, atol=1e-5, rtol=1e-5)


def test_a_head_dim_past_the_kernel_s_limit_stays_with_the_gather(kernel, monkeypatch):
    rng = random.Random(2)
    head_dim = paged_attention.MAX_HEAD_DIM + 32
    block_size, starts, lens = 4, [9, 3], [1, 1]
    k_pool, v_pool, tables = pool_and_tables(rng, starts, lens, block_size, 1, head_dim, torch.float32)
    q = torch.randn(2, 2, head_dim)
    calls: list[int] = []
    monkeypatch.setattr(paged_attention, "paged_attention", lambda query, *a: calls.append(len(query)))
    paged_attention.use(True)
    got = attend(layout_for(tables, starts, lens, block_size), q, k_pool, v_pool, head_dim**-0.5)
    assert calls == []
    want = reference(q, k_pool, v_pool, tables, starts, lens, block_size, head_dim**-0.5)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_a_decode_row_reads_the_same_alone_as_among_others(kernel):
    """Each (row, KV head) is one thread's work in a fixed order: the bits of a row's output do not
    depend on which rows share its step (the gather path pads rows to the longest)."""
    rng = random.Random(1)
    block_size, starts = 16, [40, 7, 130, 64]
    k_pool, v_pool, tables = pool_and_tables(rng, starts, [1] * 4, block_size, 3, 64, torch.bfloat16)
    q = torch.randn(4, 9, 64, dtype=torch.bfloat16)
    paged_attention.use(True)
    together = attend(layout_for(tables, starts, [1] * 4, block_size), q, k_pool, v_pool, 0.125)
    for row in range(4):
        alone = attend(
            layout_for([tables[row]], [starts[row]], [1], block_size), q[row : row + 1], k_pool, v_pool, 0.125
        )
        assert torch.equal(alone[0], together[row])


def test_the_limits_are_timed_once_per_shape_and_only_where_the_kernel_runs(kernel, monkeypatch):
    monkeypatch.setattr("models.attention_timing._PAGED_LIMITS", {})  # none timed yet in this process
    paged_attention.use(False)
    assert tune_paged_limits(4, 2, 16, torch.float32) == ()
    paged_attention.use(True)
    limits = tune_paged_limits(4, 2, 16, torch.float32)
    assert len(limits) == len(PAGED_ROWS) and all(1 <= limit <= 8 for limit in limits)
    monkeypatch.setattr("models.attention_timing.attend", lambda *a: pytest.fail("timed twice"))
    assert tune_paged_limits(4, 2, 16, torch.float32) == limits
    assert tune_paged_limits(4, 2, paged_attention.MAX_HEAD_DIM + 32, torch.float32) == ()
