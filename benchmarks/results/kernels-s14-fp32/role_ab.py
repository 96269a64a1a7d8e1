"""One GEMM-layout table for every linear layer (the decoder layers') against the output
projection on its own table, alternating on one runner, median of 9 steps each.

    .venv/bin/python benchmarks/results/kernels-s14-fp32/role_ab.py   # from the repository root
"""

from __future__ import annotations

import statistics
import sys

sys.path.insert(0, ".")

from benchmarks.common import load  # noqa: E402
from benchmarks.step_bench import MAX_LEN, NUM_SLOTS, decode_row, seconds_with  # noqa: E402
from models.builder import ProposerConfig, build_runner  # noqa: E402
from models.linear_kernels import ModelKernels  # noqa: E402
from models.runner import RunnerConfig  # noqa: E402
from scheduler.types import Batch  # noqa: E402


def main() -> None:
    target = load("float32")
    own = target.kernels
    one = ModelKernels(own.layers, own.layers)
    runner = build_runner(target, RunnerConfig(max_num_seqs=NUM_SLOTS, max_model_len=MAX_LEN), ProposerConfig("ngram"))
    vocab, ctx = target.vocab_size, 300
    cases = [
        ("batch 1 decode", [decode_row("d", ctx, 0, vocab, consecutive=True)]),
        ("batch 1 verify 1+4", [decode_row("b", ctx, 0, vocab, drafts=4, consecutive=True)]),
        ("batch 1 verify 1+10", [decode_row("c", ctx, 0, vocab, drafts=10, consecutive=True)]),
        ("batch 8 decode", [decode_row(f"e{i}", ctx, i, vocab) for i in range(8)]),
        ("batch 4 verify 1+4", [decode_row(f"f{i}", ctx, i, vocab, drafts=4) for i in range(4)]),
        ("batch 16 decode", [decode_row(f"g{i}", ctx, i, vocab) for i in range(16)]),
        ("batch 16 verify 1+4", [decode_row(f"i{i}", ctx, i, vocab, drafts=4) for i in range(16)]),
    ]

    print("| case | ms, one table | ms, output projection on its own | ratio |\n|---|---|---|---|")
    for name, rows in cases:
        batch = Batch(rows=rows)
        for kernels in (one, own):  # warm-up
            seconds_with(target, runner, kernels, batch)
        single, split = [], []
        for _ in range(9):
            single.append(seconds_with(target, runner, one, batch))
            split.append(seconds_with(target, runner, own, batch))
        a, b = statistics.median(single) * 1e3, statistics.median(split) * 1e3
        print(f"| {name} | {a:.1f} | {b:.1f} | {b / a:.2f} |")


if __name__ == "__main__":
    main()
