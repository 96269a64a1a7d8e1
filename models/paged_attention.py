"""Paged attention that reads the KV pool in place, for decode rows on CPU (the kernel takes
verify rows too; `models.kv_cache` keeps those on the gather, which is faster there).

`models.kv_cache` otherwise gathers every row's blocks into a padded copy per layer and
SDPA reads that copy again: three passes over the rows' KV where attention needs one. At 32
decode rows of ~250 keys (SmolLM2, bf16, 2 cores) the gather alone took 1.9 ms a layer. The
kernel (`csrc/paged_attention.cpp`) is compiled for this machine on first use with
torch's C++ extension builder (a C++ compiler and ninja), cached under specd's cache
directory, and registered as `torch.ops.specd.paged_attention`. Where it cannot be built
the gather path serves, with a warning.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from models.kv_cache import AttentionGroup

logger = logging.getLogger("specd.models")

SOURCE = Path(__file__).with_name("csrc") / "paged_attention.cpp"
CFLAGS = ["-O3", "-march=native", "-fopenmp"]  # OpenMP: at::parallel_for runs on torch's own libgomp

MAX_HEAD_DIM = 256  # the kernel's per-key registers (kMaxHeadDim)
STALE_LOCK_S = 600  # a first build takes ~15 s on 2 cores

_available: bool | None = None  # None: not tried in this process
_enabled = False  # decode groups on CPU read the pool in place (`use`)


def available() -> bool:
    """Whether `torch.ops.specd.paged_attention` is registered in this process."""
    return bool(_available)


def enabled() -> bool:
    return _enabled


def use(wanted: bool) -> None:
    """Whether `models.kv_cache` sends CPU decode groups here (only where the kernel is loaded)."""
    global _enabled
    _enabled = wanted and available()


def load(cache_dir: Path) -> bool:
    """Build (once per machine and source: `-march=native`) and register the kernel; False,
    with the reason logged, where no compiler or ninja is at hand."""
    global _available
    if _available is not None:
        return _available
    from torch.utils import cpp_extension

    # ninja from the venv (a dependency) where the server was started without the venv on PATH.
    scripts = sysconfig.get_path("scripts")
    path = [part for part in os.environ.get("PATH", "").split(os.pathsep) if part]
    if scripts not in path:
        os.environ["PATH"] = os.pathsep.join([scripts, *path])
    started = time.perf_counter()
    try:
        build_dir = cache_dir / "kernels" / f"paged_attention-{_build_tag()}"
        build_dir.mkdir(parents=True, exist_ok=True)  # a read-only cache falls back like a missing compiler
        _clear_stale_lock(build_dir)
        library = cpp_extension.load(
            name="specd_paged_attention",
            sources=[str(SOURCE)],
            extra_cflags=CFLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )
    except (OSError, RuntimeError, ImportError, subprocess.CalledProcessError) as exc:
        logger.warning("paged attention kernel not built (%s): attention gathers KV blocks instead", _first_line(exc))
        _available = False
        return False
    _available = hasattr(torch.ops.specd, "paged_attention")
    logger.info("paged attention kernel: %s (%.1fs)", library or build_dir, time.perf_counter() - started)
    return _available


def reads(group: AttentionGroup, query: torch.Tensor, sliding_window: int | None) -> bool:
    """Decode groups whose keys would be gathered, on CPU, with the kernel loaded and enabled.
    Verify rows and prefill chunks stay with the gather and SDPA's blocked kernels: at 6-11
    queries a row the kernel's dot products ran 2-3x slower than the gather and SDPA (bf16 and
    float32, 2 cores), at 1 query 1.1-3.4x faster."""
    return (
        _enabled
        and group.block_index is not None
        and group.plan.max_q == 1
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


def _clear_stale_lock(build_dir: Path) -> None:
    """torch's builder waits forever on the lock file of a build that was killed (a pod stopped
    during its first start); no build takes minutes, so an old lock is a dead one."""
    lock = build_dir / "lock"
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink()
            logger.warning("removed a stale kernel build lock: %s", lock)
    except FileNotFoundError:
        pass


def _build_tag() -> str:
    """Source, torch and the CPU's instruction sets: a cache shared between machines never
    loads a binary built for another CPU."""
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(torch.__version__.encode())
    digest.update(" ".join(CFLAGS).encode())
    digest.update(_cpu_flags().encode())
    return digest.hexdigest()[:16]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return sys.platform


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
