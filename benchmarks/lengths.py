"""Per-request output lengths for the benchmarks' closed loops.

Requests of one length keep a closed loop in lock step: with speculation off every
slot finishes together, and a mode that finishes some requests early ends its run on
a tail of emptier steps, which measures the benchmark's last request more than the
engine. A range ratio r gives request i a max_tokens drawn once, uniformly in
max_tokens x [1 - r, 1 + r], seeded by i alone (as vLLM's benchmark's
--random-range-ratio), so every mode and round sends the same lengths.
"""

from __future__ import annotations

import math
import random


def max_tokens_for(index: int, max_tokens: int, range_ratio: float) -> int:
    """Request `index`'s max_tokens."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError("the length range ratio must be in [0, 1)")
    if not range_ratio:
        return max_tokens
    low, high = math.ceil(max_tokens * (1 - range_ratio)), math.floor(max_tokens * (1 + range_ratio))
    return random.Random(index).randint(max(low, 1), high)


def max_tokens_per_request(num: int, max_tokens: int, range_ratio: float) -> list[int]:
    return [max_tokens_for(i, max_tokens, range_ratio) for i in range(num)]
