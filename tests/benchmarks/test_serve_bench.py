"""The serving benchmark at CI size: a real specd (tiny Llama + its 1-layer draft), every mode.

It checks that the benchmark runs end to end and that its JSON, markdown and
plot hold what the docs promise; it asserts nothing about speed.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from benchmarks import peers, serve_bench, serve_client, serve_report
from benchmarks.peers import LlamaCppServe, Peer, VllmServe
from scheduler.types import PLAIN_REASONS
from tests.support.server import ServerError

MODES = ("off", "on", "auto")
LEVELS = (1, 2)
NUM_REQUESTS = 4
MAX_TOKENS = 8
PROMPTS = ["Hello world!", "def add(a, b):", "The quick brown fox", "for i in range(10):"]


def run_bench(tmp_path, tiny_llama_dir, tiny_draft_dir) -> tuple[int, dict, str]:
    prompt_file = tmp_path / "tiny.jsonl"
    prompt_file.write_text("".join(json.dumps({"id": f"t{i}", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    out_dir = tmp_path / "out"
    code = serve_bench.main([
        "--model", str(tiny_llama_dir), "--draft-model", str(tiny_draft_dir),
        "--dtype", "float32", "--device", "cpu", "--max-model-len", "256", "--num-speculative-tokens", "3",
        "--concurrency", ",".join(map(str, LEVELS)), "--num-requests", str(NUM_REQUESTS),
        "--max-tokens", str(MAX_TOKENS), "--prompt-sets", str(prompt_file), "--warmup", "1",
        "--max-seconds", "120", "--ready-timeout", "120", "--out-dir", str(out_dir),
    ])  # fmt: skip
    return code, json.loads((out_dir / "serve_bench.json").read_text()), (out_dir / "serve_bench.md").read_text()


def check_latencies(run: dict) -> None:
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "chunk_itl_ms", "e2e_ms"):
        stats = run[key]
        assert set(stats) == {"mean", "p50", "p95", "p99"}, key
        assert 0 <= stats["p50"] <= stats["p95"] <= stats["p99"], key
    assert run["ttft_ms"]["p50"] <= run["e2e_ms"]["p50"]


def check_speculation(run: dict) -> None:
    counters = run["server_counters"]
    if run["mode"] == "off":
        assert counters["num_draft_tokens"] == 0 and counters["steps_spec"] == 0
        assert run["acceptance_rate"] is None and run["mean_acceptance_length"] is None
        assert run["spec_step_share"] == 0
    if run["mode"] == "on":  # a draft model always proposes, so forced speculation drafts
        assert counters["num_drafts"] > 0 and counters["num_draft_tokens"] >= counters["num_drafts"]
        assert 0 <= run["acceptance_rate"] <= 1
        assert 1 <= run["mean_acceptance_length"] <= 1 + 3
        assert 0 < run["spec_step_share"] <= 1
    if run["acceptance_rate_usage"] is not None:
        assert 0 <= run["acceptance_rate_usage"] <= 1


def test_serve_bench_smoke(tmp_path, tiny_llama_dir, tiny_draft_dir):
    code, report, text = run_bench(tmp_path, tiny_llama_dir, tiny_draft_dir)
    assert code == 0, text

    runs = report["runs"]
    assert [(r["mode"], r["load_kind"], r["load"]) for r in runs] == [
        (mode, "concurrency", level) for level in LEVELS for mode in MODES
    ]
    for run in runs:
        assert run["num_requests"] == run["num_completed"] == NUM_REQUESTS, run["errors"]
        assert run["num_failed"] == run["num_cancelled"] == run["num_short"] == 0
        assert run["total_output_tokens"] == NUM_REQUESTS * MAX_TOKENS  # ignore_eos: same length in every mode
        assert run["request_throughput"] > 0 and run["output_throughput"] > 0 and run["duration_s"] > 0
        assert run["tokens_per_chunk"] >= 1
        assert 1 <= run["mean_batch_rows"] <= run["load"]  # never more running than the clients
        # Each step emits at most 1 + K tokens per row, for at most `load` rows; and takes time.
        assert run["engine_steps"] >= run["total_output_tokens"] / (run["load"] * (1 + 3))
        assert run["step_ms"] > 0
        check_latencies(run)
        check_speculation(run)
        reasons = run["plain_steps_by_reason"]  # only auto rows are the policy's to run plain
        assert set(reasons) == set(PLAIN_REASONS) and all(n >= 0 for n in reasons.values())
        assert sum(reasons.values()) <= run["server_counters"]["steps_plain"]
        assert run["mode"] == "auto" or not any(reasons.values())

    meta = report["meta"]
    assert meta["speculation"]["proposer"] == "draft_model" and meta["max_tokens"] == MAX_TOKENS
    assert "--draft-model" in meta["server_args"]
    rows = report["tradeoff"]["rows"]
    assert [r["load"] for r in rows] == list(LEVELS)
    assert all(set(r["output_throughput"]) == set(MODES) and r["auto_vs_best"] > 0 for r in rows)

    for heading in ("| mode | load |", "### Latency p50 / p95 / p99", "### Speculation trade-off"):
        assert heading in text
    mode_rows = [line for line in text.splitlines() if line.startswith(("| off |", "| on |", "| auto |"))]
    explained = [r for r in runs if any(r["plain_steps_by_reason"].values())]
    assert ("### Why `auto` rows ran plain" in text) == bool(explained)
    assert len(mode_rows) == 2 * len(runs) + len(explained)  # main, percentiles, and why auto ran plain
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "out" / "serve_bench.png").stat().st_size > 0


# -- the pieces, without a server ----------------------------------------------------------


def test_percentiles_interpolate_linearly():
    stats = serve_report.percentiles([0.004, 0.001, 0.003, 0.002, 0.005])  # seconds -> ms
    assert stats["p50"] == pytest.approx(3.0) and stats["mean"] == pytest.approx(3.0)
    assert stats["p95"] == pytest.approx(4.8) and stats["p99"] == pytest.approx(4.96)
    assert serve_report.percentiles([]) is None


def test_chunks_count_tokens_from_continuous_usage():
    result = serve_client.RequestResult("p", start=0.0)

    def chunk(content: str, completion_tokens: int, choices: bool = True) -> dict:
        usage = {
            "prompt_tokens": 5,
            "completion_tokens": completion_tokens,
            "completion_tokens_details": {"accepted_prediction_tokens": 2, "rejected_prediction_tokens": 1},
        }
        return {"choices": [{"delta": {"content": content}}] if choices else [], "usage": usage}

    for now, piece in enumerate([chunk("", 0), chunk("a", 1), chunk("bcd", 4), chunk("", 4, choices=False)]):
        serve_client.on_chunk(piece, float(now), result)
    assert result.chunk_tokens == [1, 3] and result.chunk_times == [
        1.0,
        2.0,
    ]  # the role chunk and usage chunk carry none
    assert (result.num_output_tokens, result.num_prompt_tokens, result.num_accepted, result.num_rejected) == (
        4,
        5,
        2,
        1,
    )


def test_tradeoff_names_the_crossover_and_auto_against_the_better_mode():
    tps = {1: (10, 15, 14.9), 2: (20, 18, 21), 4: (40, 41, 40), 8: (80, 60, 60)}  # off, on, auto
    runs = [{"load_kind": "concurrency", "load": level, "mode": mode, "output_throughput": value}
            for level, values in tps.items() for mode, value in zip(("off", "on", "auto"), values)]  # fmt: skip
    summary = serve_report.tradeoff(runs)
    assert summary["crossover_concurrency"] == 8  # on beat off again at 4
    assert summary["worst_auto_vs_best"] == {"load_kind": "concurrency", "load": 8, "auto_vs_best": 0.75}
    assert [round(r["on_vs_off"], 2) for r in summary["rows"]] == [1.5, 0.9, 1.02, 0.75]


def test_only_loopback_targets(capsys):
    with pytest.raises(SystemExit):
        serve_bench.parse_args(["--base-url", "http://10.0.0.5:8000"])
    assert "loopback" in capsys.readouterr().err
    assert serve_bench.parse_args(["--base-url", "http://localhost:8000"]).base_url


def test_repeats_rotate_the_modes_order():
    modes = ["off", "on", "auto"]
    assert serve_bench.rotated_modes(modes, 1) == modes
    order = serve_bench.rotated_modes(modes, 3)
    assert order == ["off", "on", "auto", "on", "auto", "off", "auto", "off", "on"]
    assert all(sorted(order[i * 3 : i * 3 + 3]) == sorted(modes) for i in range(3))  # each repeat runs each mode once


def test_natural_lengths_leave_the_end_of_sequence_to_the_model():
    prompt = serve_client.Prompt("p0", "Hello")
    assert serve_bench.parse_args([]).lengths == "fixed"
    assert serve_client.request_body("m", prompt, "auto", 64)["ignore_eos"] is True
    assert serve_bench.parse_args(["--lengths", "natural"]).lengths == "natural"
    body = serve_client.request_body("m", prompt, "off", 64, ignore_eos=False)
    assert body["ignore_eos"] is False and body["max_tokens"] == 64 and body["speculation"] is False
    assert serve_report.length_label({"max_tokens": 64}) == "64 tokens (ignore_eos)"  # reports from before the flag
    assert serve_report.length_label({"max_tokens": 64, "lengths": "natural"}) == "up to 64 tokens (to end of sequence)"


def test_a_range_ratio_spreads_each_requests_max_tokens_alike_in_every_mode():
    assert serve_bench.parse_args(["--length-range-ratio", "0.5"]).length_range_ratio == 0.5
    with pytest.raises(SystemExit):
        serve_bench.parse_args(["--length-range-ratio", "1"])
    meta = {"max_tokens": 64, "length_range_ratio": 0.5}
    assert serve_report.length_label(meta) == "64 x [0.5, 1.5] tokens (ignore_eos)"
    assert (
        serve_report.length_label({**meta, "lengths": "natural"}) == "up to 64 x [0.5, 1.5] tokens (to end of sequence)"
    )


def test_peer_columns_set_plain_decoding_and_n_gram_speculation_beside_the_peers():
    tps = {"off": 90.0, "on": 120.0, "auto": 130.0, "vllm": 100.0, "vllm-ngram-k3": 110.0, "vllm-ngram-k5": 104.0}
    runs = [{"load_kind": "concurrency", "load": 1, "mode": mode, "output_throughput": value}
            for mode, value in tps.items()]  # fmt: skip
    (row,) = serve_report.tradeoff(runs)["rows"]
    assert row["off_vs_peer"] == pytest.approx(0.9)
    assert row["auto_vs_peer_ngram"] == pytest.approx(130 / 110)  # against the peer's best K
    assert row["on_vs_peer_ngram"] == pytest.approx(120 / 110)
    assert row["auto_vs_peer"] == pytest.approx(1.3)
    text = "\n".join(serve_report.tradeoff_markdown(serve_report.tradeoff(runs)))
    assert "| load | off | on | auto | vllm | vllm-ngram-k3 | vllm-ngram-k5 | on / off |" in text
    assert "auto / best peer n-gram" in text and "off / peer" in text


def test_peer_requests_carry_only_what_the_peer_takes():
    prompt = serve_client.Prompt("p0", "Hello")
    vllm = Peer("vllm", VllmServe.__new__(VllmServe))
    body = serve_client.request_body("peer", prompt, "vllm", 64, cache_salt="s", peer=vllm)
    assert body["ignore_eos"] is True and body["stream_options"]["continuous_usage_stats"] is True
    assert "speculation" not in body and "cache_salt" not in body
    transformers = Peer("transformers", object.__new__(serve_bench.SpecdServer))
    body = serve_client.request_body("peer", prompt, "transformers", 64, peer=transformers)
    assert "ignore_eos" not in body and "stream_options" not in body


def test_a_vllm_peer_needs_its_own_python(capsys):
    with pytest.raises(SystemExit):
        serve_bench.parse_args(["--peer", "vllm"])
    assert "--peer-python" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        serve_bench.parse_args(["--peer-ngram-k", "3"])
    args = serve_bench.parse_args(["--peer", "vllm", "--peer-python", "/x/bin/python", "--peer-ngram-k", "3,5"])
    assert args.peer_ngram_k == [3, 5]


def test_vllm_n_gram_peer_drafts_with_specds_lookup_windows():
    server = VllmServe.__new__(VllmServe)
    server.ngram_k = 5
    assert server.speculative_config == {
        "method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1, "prompt_lookup_max": 4
    }  # fmt: skip
    server.ngram_k = 0
    assert server.speculative_config is None


def test_each_peer_engine_gets_a_best_against_best_column():
    tps = {"off": 10.0, "on": 20.0, "auto": 24.0, "llamacpp": 22.0, "llamacpp-lookup-k10": 30.0, "vllm": 8.0}
    runs = [{"load_kind": "concurrency", "load": 1, "mode": mode, "output_throughput": value}
            for mode, value in tps.items()]  # fmt: skip
    (row,) = serve_report.tradeoff(runs)["rows"]
    assert row["best_vs_llamacpp"] == pytest.approx(24 / 30) and row["best_vs_vllm"] == pytest.approx(3.0)
    assert row["off_vs_peer"] is None and row["auto_vs_peer_ngram"] is None  # two engines: which peer?
    del tps["vllm"]
    (row,) = serve_report.tradeoff([r for r in runs if r["mode"] != "vllm"])["rows"]
    assert row["auto_vs_peer_ngram"] == pytest.approx(24 / 30)  # prompt lookup is the speculating peer
    text = "\n".join(serve_report.tradeoff_markdown(serve_report.tradeoff(runs)))
    assert "specd best / llamacpp best" in text and "specd best / vllm best" in text


def test_a_llamacpp_peer_serves_the_gguf_with_concurrent_clients_queued(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    args = serve_bench.parse_args(["--model", str(gguf), "--peer", "llamacpp", "--llamacpp-python",
                                   "/x/bin/python", "--peer-lookup-k", "10", "--peer-threads", "2"])  # fmt: skip
    assert args.peer == ["llamacpp"] and args.peer_lookup_k == [10]
    server = LlamaCppServe.__new__(LlamaCppServe)
    server.gguf, server.python, server.threads, server.max_model_len, server.lookup_k, server.port = (
        peers.served_gguf(args),
        Path("/x/bin/python"),
        2,
        1024,
        10,
        8123,
    )
    command = server.command([])
    assert command[:3] == ["/x/bin/python", "-m", "llama_cpp.server"] and str(gguf) in command
    assert command[command.index("--interrupt_requests") + 1] == "False"
    assert command[command.index("--n_threads") + 1] == "2"
    assert command[command.index("--draft_model_num_pred_tokens") + 1] == "10"
    label = Peer("llamacpp-lookup-k10", server).label
    assert "prompt lookup K=10" in label and "2 threads" in label
    assert not Peer("llamacpp", server).takes_specd_fields
    with pytest.raises(SystemExit):
        serve_bench.parse_args(["--peer", "llamacpp"])
    with pytest.raises(SystemExit):
        serve_bench.parse_args(["--peer", "sglang"])
    args.model = str(tmp_path)  # a directory: no GGUF for llama.cpp to read
    with pytest.raises(ServerError, match="needs a GGUF"):
        peers.served_gguf(args)


def test_a_peer_environment_is_built_once(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(peers.subprocess, "run", lambda command, **kw: calls.append((command, kw.get("env"))))
    python = peers.install_peer("llamacpp", tmp_path)
    assert python == tmp_path / "llamacpp" / "bin" / "python"
    assert any("llama-cpp-python[server]==0.3.36" in command for command, _ in calls)
    env = next(env for command, env in calls if env)
    assert env["CMAKE_ARGS"] == peers.llamacpp_cmake_args()
    calls.clear()
    assert peers.install_peer("llamacpp", tmp_path) == python and not calls  # the marker says it is there


def test_llama_cpp_is_built_for_the_cpus_instructions_without_amx(monkeypatch):
    monkeypatch.setattr(peers.platform, "machine", lambda: "x86_64")
    args = peers.llamacpp_cmake_args("processor: 0\nflags\t\t: fpu avx avx2 fma f16c avx512f avx512_vnni amx_tile\n")
    assert "-DGGML_NATIVE=OFF" in args and "-DGGML_AVX512_VNNI=ON" in args and "-DGGML_AVX512_BF16=OFF" in args
    assert "AMX" not in args
    monkeypatch.setattr(peers.platform, "machine", lambda: "aarch64")
    assert peers.llamacpp_cmake_args("") == "-DGGML_NATIVE=ON"
