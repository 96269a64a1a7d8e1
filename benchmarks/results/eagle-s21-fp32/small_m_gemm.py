"""Small-M float32 GEMMs of SmolLM2-135M's decoder layers: why a float32 verify costs more than a decode.

All 30 layers' linear products (q, k, v, o, gate, up, down; random weights, 390 MB, so they stream
from memory as in a real step) for M = 1, 2, 5, 8, 16 token rows, `F.linear` against MKL's packed
GEMM (`torch.ops.mkl._mkl_linear`, weights packed once for M = 5), ms per pass (mean of 20):

    .venv/bin/python benchmarks/results/eagle-s21-fp32/small_m_gemm.py
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

ROWS = (1, 2, 5, 8, 16)
SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)] * 30


def ms_per_pass(run, repeats: int = 20) -> float:
    for _ in range(3):
        run()
    started = time.perf_counter()
    for _ in range(repeats):
        run()
    return (time.perf_counter() - started) / repeats * 1e3


@torch.inference_mode()
def main() -> None:
    torch.manual_seed(0)
    weights = [torch.randn(out, inp) * 0.02 for out, inp in SHAPES]
    kinds = {"F.linear": None}
    if hasattr(torch.ops.mkl, "_mkl_linear"):
        kinds["mkl packed"] = [torch.ops.mkl._mkl_reorder_linear_weight(w, 5) for w in weights]
    for kind, packed in kinds.items():
        cells = []
        for m in ROWS:
            inputs = {n: torch.randn(m, n) for n in (576, 1536)}

            def run(m=m, inputs=inputs, packed=packed) -> None:
                for i, w in enumerate(weights):
                    x = inputs[w.shape[1]]
                    if packed is None:
                        F.linear(x, w)
                    else:
                        torch.ops.mkl._mkl_linear(x, packed[i], w, None, m)

            cells.append(f"M={m}: {ms_per_pass(run):.1f} ms")
        print(f"{kind:>10}: " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
