"""Fixtures for the models package's tests."""

from __future__ import annotations

import shutil

import pytest

from models import cpu_kernels, layer_ops, paged_attention
from models.loader import default_cache_dir

HAS_COMPILER = any(shutil.which(name) for name in ("c++", "g++"))


@pytest.fixture
def built_kernels():
    """specd's CPU kernels, built as a server builds them; with a compiler at hand they must build.
    The attention and layer switches are restored after the test."""
    if not HAS_COMPILER:
        pytest.skip("no C++ compiler on this machine: torch's operations serve (test_failed_build_falls_back)")
    assert cpu_kernels.load(default_cache_dir())
    attention, fused = paged_attention.enabled(), layer_ops.enabled()
    yield cpu_kernels
    paged_attention.use(attention)
    layer_ops.use(fused)
