"""benchmarks.lengths: per-request output lengths, the same in every mode."""

from __future__ import annotations

import pytest

from benchmarks.lengths import max_tokens_for, max_tokens_per_request


def test_a_range_ratio_draws_each_length_once_from_its_index():
    caps = max_tokens_per_request(200, 64, 0.5)
    assert caps == [max_tokens_for(i, 64, 0.5) for i in range(200)]  # seeded by the index alone
    assert min(caps) >= 32 and max(caps) <= 96 and len(set(caps)) > 30
    assert 56 <= sum(caps) / len(caps) <= 72  # centred on max_tokens
    assert max_tokens_per_request(3, 64, 0.0) == [64, 64, 64]
    assert min(max_tokens_per_request(50, 1, 0.9)) >= 1  # never a request that asks for nothing


@pytest.mark.parametrize("ratio", [-0.1, 1.0, 1.5])
def test_a_ratio_outside_zero_to_one_is_refused(ratio):
    with pytest.raises(ValueError):
        max_tokens_for(0, 64, ratio)
