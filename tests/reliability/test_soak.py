"""The soak's short version (`benchmarks/soak.py` runs the long one): mixed requests, then no
RSS growth after warm-up, no leaked KV or per-request state, no extra tasks or
threads, and a last-quarter p99 in line with the first."""

from __future__ import annotations

import pytest

from benchmarks.soak import run_soak

CI_REQUESTS = 200


@pytest.mark.slow
async def test_short_soak(chaos_server, cycle_text, tally):
    report = await run_soak(chaos_server, cycle_text, CI_REQUESTS, concurrency=8)
    report.add_to(tally)
    print("\n" + report.table())
    assert report.problems() == []
