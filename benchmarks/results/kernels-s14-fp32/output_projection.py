"""SmolLM2's output projection shape (49152 x 576, float32) alone: x @ W^T against (W @ x^T)^T.

.venv/bin/python benchmarks/results/kernels-s14-fp32/output_projection.py
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F


def median_ms(fn, repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    weight = torch.randn(49152, 576)
    print("| rows | x @ W^T ms | (W @ x^T)^T ms |\n|---|---|---|")
    for m in (1, 2, 4, 6, 8, 9, 10, 12, 16, 20, 24, 32):
        x = torch.randn(m, 576)
        standard = median_ms(lambda x=x: F.linear(x, weight))
        transposed = median_ms(lambda x=x: torch.mm(weight, x.t()).t().contiguous())
        print(f"| {m} | {standard:.1f} | {transposed:.1f} |")


if __name__ == "__main__":
    main()
