"""models.host_memory: the KV pool's allocation on huge pages; freed heap pages returned."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch

from models import host_memory
from models.kv_cache import KVCache

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping that holds `address` in this process."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            low, high = (int(part, 16) for part in head.split("-"))
            inside = low <= address < high
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_zeros_is_zeros():
    tensor = host_memory.zeros((3, 1000, 64), torch.bfloat16, torch.device("cpu"))
    assert tensor.shape == (3, 1000, 64) and tensor.dtype == torch.bfloat16
    assert not tensor.any()


@pytest.mark.skipif(not THP.exists(), reason="this kernel has no transparent huge pages to advise")
def test_a_large_pool_is_advised_onto_huge_pages():
    tensor = host_memory.zeros((16 << 20,), torch.uint8, torch.device("cpu"))
    inner = (tensor.data_ptr() + host_memory.HUGE_PAGE - 1) & ~(host_memory.HUGE_PAGE - 1)
    assert "hg" in vm_flags(inner)  # MADV_HUGEPAGE on the mapping


def test_a_tensor_without_a_whole_huge_page_is_left_alone():
    assert host_memory.advise_huge_pages(torch.empty(1000)) is False


def test_kv_pools_are_one_allocation_with_separate_layers():
    cache = KVCache(3, 8, 4, 2, 16, torch.float32, torch.device("cpu"))
    pools = cache.keys + cache.values
    assert all(p.shape == (2, 32, 16) and p.is_contiguous() for p in pools)
    assert len({p.untyped_storage().data_ptr() for p in pools}) == 1
    cache.keys[1].fill_(1.0)
    assert cache.keys[1].all() and not cache.keys[0].any() and not cache.keys[2].any()
    assert not any(v.any() for v in cache.values)
    assert cache.num_bytes == 2 * 3 * 2 * 32 * 16 * 4


def test_freed_heap_pages_go_back_to_the_os_under_glibc():
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("malloc_trim is glibc's")
    assert host_memory.return_freed_pages()
