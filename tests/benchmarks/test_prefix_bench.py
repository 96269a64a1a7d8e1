"""The prefix-caching benchmark at CI size (tiny Llama): it runs end to end and its
report holds what the docs promise; it asserts nothing about speed."""

from __future__ import annotations

import json

from benchmarks import prefix_bench


def test_prefix_bench_smoke(tmp_path, tiny_llama_dir):
    out_dir = tmp_path / "out"
    code = prefix_bench.main([
        "--model", str(tiny_llama_dir), "--dtype", "float32", "--device", "cpu",
        "--turns", "2", "--shared", "4", "--system-chars", "400", "--capacity", "6", "--capacity-chars", "120",
        "--repeats", "1",
        "--max-seconds", "120", "--out-dir", str(out_dir),
    ])  # fmt: skip
    assert code == 0
    runs = json.loads((out_dir / "prefix_bench.json").read_text())["runs"]
    on, off = runs["caching"], runs["no caching"]
    assert len(on["turn_ttft_s"][0]) == len(off["turn_ttft_s"][0]) == 2
    (shared_on,), (shared_off,) = on["shared"], off["shared"]
    # Token counts, not times: without the cache every prompt token is computed; with it,
    # what is not computed was a hit (each run's prompts start with their own random line).
    assert shared_off["cache_hit_tokens"] == 0 and shared_on["cache_hit_tokens"] > 0
    assert shared_off["prompt_tokens_computed"] == shared_off["prompt_tokens_sent"]
    assert shared_on["prompt_tokens_computed"] + shared_on["cache_hit_tokens"] == shared_on["prompt_tokens_sent"]
    assert 1 <= on["capacity"]["running"] <= 6 and "capacity" not in off
    text = (out_dir / "prefix_bench.md").read_text()
    assert "(a) multi-turn chat" in text and "(b) 4 requests" in text and "(c) 6 short chats" in text
