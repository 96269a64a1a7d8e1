"""BlockPool: reference counts, the prefix cache's keys, LRU eviction."""

from __future__ import annotations

import pytest

from scheduler.kv_blocks import BlockPool, block_key, blocks_for, root_key


def keys(tokens: list[int], block_size: int, tenant: str = "") -> list[bytes]:
    out, parent = [], root_key("model", tenant)
    for i in range(len(tokens) // block_size):
        parent = block_key(parent, tokens[i * block_size : (i + 1) * block_size])
        out.append(parent)
    return out


def test_blocks_for_rounds_up():
    assert [blocks_for(n, 4) for n in (0, 1, 4, 5, 8)] == [0, 1, 1, 2, 2]


def test_keys_chain_over_the_prefix_and_differ_across_tenants_and_models():
    a = keys(list(range(12)), 4)
    b = keys([0, 1, 2, 3, 9, 9, 9, 9, 8, 9, 10, 11], 4)
    assert a[0] == b[0] and a[1] != b[1]
    assert a[2] != b[2]  # same tokens in block 2, different parent: a different key
    assert keys(list(range(12)), 4, tenant="team-a") != a
    assert keys(list(range(12)), 4, tenant="team-a") != keys(list(range(12)), 4, tenant="team-b")
    assert root_key("model", "") != root_key("other-model", "")


def test_allocate_release_and_reference_counts():
    pool = BlockPool(4, 2)
    first = pool.allocate(3)
    assert pool.num_free == 1 and pool.num_used == 3
    pool.take(first[:1])  # a second request shares block 0
    pool.release(first)
    assert pool.num_used == 1 and pool.ref_count[first[0]] == 1
    pool.release(first[:1])
    assert pool.num_used == 0 and pool.num_free == 4
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.allocate(5)


def test_a_released_block_stays_cached_until_allocation_evicts_it_least_recent_first():
    pool = BlockPool(4, 2)
    ks = keys([1, 2, 3, 4, 5, 6], 2)
    a = pool.allocate(3)
    for block, key in zip(a, ks):
        pool.cache(block, key)
    pool.release(a)  # tail first: a[2], a[1], a[0] queued behind the never-used block
    assert pool.lookup(ks) == a and pool.num_free == 4
    (fresh,) = pool.allocate(1)
    assert fresh not in a  # the never-used block goes first
    (evicted,) = pool.allocate(1)
    assert evicted == a[2]  # then the sequence's tail: its prefix stays hittable longest
    assert pool.lookup(ks) == a[:2]
    assert pool.num_cached == 2


def test_eviction_never_takes_a_block_in_use():
    pool = BlockPool(3, 2)
    (shared,) = pool.allocate(1)
    key = keys([7, 7], 2)[0]
    pool.cache(shared, key)
    pool.release([shared])
    pool.take(pool.lookup([key]))  # a new request hits it: back in use
    assert pool.num_free == 2
    assert shared not in pool.allocate(2)
    assert pool.lookup([key]) == [shared]


def test_num_needed_counts_free_hits_and_fresh_blocks():
    pool = BlockPool(4, 2)
    a, b = pool.allocate(2)
    pool.release([b])
    assert pool.num_needed([a, b], 1) == 2  # b is free (a hit would take it), a is held, plus one fresh


def test_first_key_wins_and_caching_off_finds_nothing():
    pool = BlockPool(4, 2)
    key = keys([1, 1], 2)[0]
    x, y = pool.allocate(2)
    pool.cache(x, key)
    pool.cache(y, key)  # the same tokens computed twice: the first block stays the entry
    assert pool.lookup([key]) == [x] and pool.key_of[y] is None
    off = BlockPool(4, 2, enable_caching=False)
    (z,) = off.allocate(1)
    off.cache(z, key)
    assert off.lookup([key]) == [] and off.num_cached == 0
