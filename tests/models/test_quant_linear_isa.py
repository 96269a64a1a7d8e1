"""The int4/int8 kernels built for other x86 instruction sets than this machine's give the same bits.

specd builds its kernels with `-march=native`, so a server on an AVX2-only CPU runs other code
(256-bit vectors, `vpmaddubsw` instead of VNNI) than the AVX-512 machine a figure came from. The
dot products are exact integers and every row's float sums run in one order on each path, so
each build must agree with this machine's to the bit. Each variant is built in a subprocess (its
ops have the same names) for a CPU this one can run, else skipped.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from models import cpu_kernels
from models.quantized import INT4, INT4K, INT6, INT8, Int4KWeight, kernels_available, quantize
from tests.support.q4_k import q4_k_blocks

# -march value -> the /proc/cpuinfo flags the build needs to run here
VARIANTS = {
    "haswell": {"avx2", "fma", "f16c"},  # AVX2, no VNNI: 256-bit vpmaddubsw
    "skylake-avx512": {"avx512f", "avx512bw", "avx512vl"},  # AVX-512, no VNNI
    "alderlake": {"avx2", "avx_vnni"},  # AVX-VNNI: 256-bit vpdpbusd
}

# (format, outputs, inputs, token rows): the rows cover every accumulator chain count
CASES = [(INT4, 100, 256, 1), (INT4, 96, 128, 11), (INT8, 100, 256, 2), (INT8, 48, 64, 9), (INT6, 100, 256, 1),
         (INT6, 48, 64, 3), (INT6, 96, 128, 10), (INT4K, 100, 256, 1), (INT4K, 48, 512, 6)]  # fmt: skip

BUILD = textwrap.dedent(
    """
    import sys, torch
    from torch.utils import cpp_extension
    source, march, build, cases, out = sys.argv[1:6]
    cpp_extension.load(name="specd_quant_" + march.replace("-", "_"), sources=[source],
                       extra_cflags=["-O3", "-march=" + march, "-fopenmp"], extra_ldflags=["-fopenmp"],
                       build_directory=build, is_python_module=False)
    results = []
    for fmt, copy, x in torch.load(cases):
        results.append(getattr(torch.ops.specd, fmt + "_linear")(x, *copy))
    results.append(torch.ops.specd.int8_round(x))
    torch.save(results, out)
    """
)


def _cpu_flags() -> set[str]:
    return set(cpu_kernels._cpu_flags().partition(":")[2].split())


@pytest.mark.parametrize("march", sorted(VARIANTS))
def test_a_build_for_another_instruction_set_gives_the_same_bits(built_kernels, march, tmp_path: Path):
    if not kernels_available():
        pytest.skip("specd's quantized kernels are built for x86 with AVX2 only")
    if missing := VARIANTS[march] - _cpu_flags():
        pytest.skip(f"this CPU cannot run a -march={march} build (no {', '.join(sorted(missing))})")
    torch.manual_seed(0)
    cases = []
    for fmt, n, k, rows in CASES:
        copy = Int4KWeight.from_q4_k(q4_k_blocks(n, k), n, k) if fmt == INT4K else quantize(torch.randn(n, k), fmt)
        cases.append((fmt, copy.tensors, torch.randn(rows, k, dtype=torch.bfloat16)))
    torch.save(cases, tmp_path / "cases.pt")
    source = cpu_kernels.CSRC / "quant_linear.cpp"
    subprocess.run(
        [sys.executable, "-c", BUILD, str(source), march, str(tmp_path), str(tmp_path / "cases.pt"),
         str(tmp_path / "out.pt")],
        check=True, timeout=300, capture_output=True,
    )  # fmt: skip
    theirs = torch.load(tmp_path / "out.pt")
    ours = [getattr(torch.ops.specd, f"{fmt}_linear")(x, *copy) for fmt, copy, x in cases]
    ours.append(torch.ops.specd.int8_round(cases[-1][2]))
    for mine, other in zip(ours, theirs, strict=True):
        assert torch.equal(mine, other)
