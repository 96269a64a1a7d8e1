"""specd's CPU kernels (`csrc/`): one library compiled for this machine on first use with
torch's C++ extension builder (a C++ compiler and ninja), cached under specd's cache
directory, registered as `torch.ops.specd.*`:

- `paged_attention.cpp`: decode attention that reads the KV pool in place (`models.paged_attention`);
- `layer_ops.cpp`: a decoder layer's small operations fused (`models.layer_ops`);
- `token_mask.cpp`: grammar bitmasks applied to logits in place (`models.grammar`);
- `row_linear.cpp`: a dense linear layer that computes each token row alone (`models.linear_kernels`);
- `quant_linear.cpp`: int4, int6 and int8 weight-only linear layers (`models.quantized`), on x86 with
  AVX2 (elsewhere they are not registered, and quantized layers run their dense values).

Built with `-march=native`, so the SIMD width (`csrc/simd.h`) is the machine's own: AVX-512 or
AVX2. Where it cannot be built (no compiler, a read-only cache), torch's operations serve,
with a warning.
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

import torch

logger = logging.getLogger("specd.models")

CSRC = Path(__file__).with_name("csrc")
SOURCES = [
    CSRC / "paged_attention.cpp",
    CSRC / "layer_ops.cpp",
    CSRC / "token_mask.cpp",
    CSRC / "row_linear.cpp",
    CSRC / "quant_linear.cpp",
]
HEADERS = [CSRC / "simd.h"]
CFLAGS = ["-O3", "-march=native", "-fopenmp"]  # OpenMP: at::parallel_for runs on torch's own libgomp
# Registered wherever the library builds (the int4/int6/int8 ops: on x86 only, so not listed).
OPS = ("paged_attention", "rms_norm", "add_rms_norm", "silu_mul", "rotary_kv", "apply_token_bitmask", "row_linear")

STALE_LOCK_S = 600  # a first build takes ~15 s on 2 cores

_available: bool | None = None  # None: not tried in this process


def available() -> bool:
    """Whether the kernels are registered in this process."""
    return bool(_available)


def load(cache_dir: Path) -> bool:
    """Build (once per machine and source: `-march=native`) and register the kernels; False,
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
        build_dir = cache_dir / "kernels" / f"cpu-{_build_tag()}"
        build_dir.mkdir(parents=True, exist_ok=True)  # a read-only cache falls back like a missing compiler
        _clear_stale_lock(build_dir)
        library = cpp_extension.load(
            name="specd_cpu_kernels",
            sources=[str(source) for source in SOURCES],
            extra_cflags=CFLAGS,
            extra_include_paths=[str(CSRC)],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )
    except (OSError, RuntimeError, ImportError, subprocess.CalledProcessError) as exc:
        logger.warning(
            "CPU kernels not built (%s): attention gathers KV blocks and layers run torch operations instead",
            _first_line(exc),
        )
        _available = False
        return False
    _available = all(hasattr(torch.ops.specd, op) for op in OPS)
    logger.info("CPU kernels: %s (%.1fs)", library or build_dir, time.perf_counter() - started)
    return _available


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
    digest = hashlib.sha256()
    for source in SOURCES + HEADERS:
        digest.update(source.read_bytes())
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
