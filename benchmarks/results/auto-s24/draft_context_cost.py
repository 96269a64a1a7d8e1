"""Session 24: does a draft token cost more on a row with a longer context? One `execute` of
decode rows against the same rows verifying 4 or 10 drafts each, at contexts of 100, 700 and
1500 tokens (benchmarks.step_bench's rows; median of 9 after a warm-up).

    PYTHONPATH=. .venv/bin/python benchmarks/results/auto-s24/draft_context_cost.py bfloat16
"""

import statistics
import sys

from benchmarks.step_bench import MAX_LEN, NUM_SLOTS, decode_row, execute_seconds
from models.builder import ProposerConfig, build_runner
from models.loader import ModelConfig, load_model
from models.runner import RunnerConfig
from scheduler.types import Batch

dtype = sys.argv[1] if len(sys.argv) > 1 else "bfloat16"
target = load_model(ModelConfig(None, dtype=dtype, device="cpu"))
runner = build_runner(target, RunnerConfig(max_num_seqs=NUM_SLOTS, max_model_len=MAX_LEN), ProposerConfig("ngram"))
vocab = target.vocab_size


def ms(rows) -> float:
    batch = Batch(rows=rows)
    runner.execute(batch)
    return statistics.median(execute_seconds(runner, batch) for _ in range(9)) * 1e3


for num_rows in (1, 4, 8):
    for context in (100, 700, 1500):
        base = ms([decode_row(f"a{context}-{i}", context, i, vocab) for i in range(num_rows)])
        cells = [f"rows {num_rows} context {context:5d}: decode {base:6.1f} ms"]
        for k in (4, 10):
            verify = ms([decode_row(f"b{context}-{k}-{i}", context, i, vocab, drafts=k) for i in range(num_rows)])
            cells.append(f"+{k} drafts: {verify - base:6.1f} ms ({(verify - base) / (num_rows * k):.2f} per draft)")
        print(" | ".join(cells), flush=True)
