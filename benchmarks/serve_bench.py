"""Serving benchmark: latency and throughput vs load, with speculation off, on and auto.

    python -m benchmarks.serve_bench                                  # bundled SmolLM2, n-gram, every prompt set
    python -m benchmarks.serve_bench --concurrency 1,4,16 --num-requests 16 --max-tokens 64
    python -m benchmarks.serve_bench --concurrency '' --request-rate 0.5,1,2   # Poisson arrivals instead
    python -m benchmarks.serve_bench --base-url http://127.0.0.1:8000          # a specd already running
    python -m benchmarks.serve_bench --modes off --peer transformers           # plain decoding vs a peer server
    python -m benchmarks.serve_bench --draft suffix --passes 2 --prompt-sets agent   # a cold then a warm pass
    python -m benchmarks.serve_bench --model qwen2.5-coder-1.5b-instruct --draft-model qwen2.5-coder-0.5b-instruct \
        --prompt-sets humaneval   # the real pair (`specd models pull` both) on HumanEval; or mtbench

One specd process serves every mode: each request picks its mode with the
`speculation` field (off: false, on: true, auto: field left out, so the
server's default policy decides). Requests are streamed chat completions,
greedy, `ignore_eos` and a fixed `max_tokens`, so every mode generates the
same tokens. Equal lengths keep a closed loop in lock step, which favours `off`
(`benchmarks.lengths`); `--length-range-ratio R` draws each request's
`max_tokens` in max_tokens x [1 - R, 1 + R], the same in every mode, and
`--lengths natural` lets each request stop at its end of sequence (greedy
decoding is lossless, so the modes still generate the same tokens). Token
counts come from the usage the server attaches to every chunk
(`stream_options.continuous_usage_stats`); acceptance and the share of
speculative steps are deltas of the server's Prometheus counters around each
run, so a server used by anyone else meanwhile skews them.

Latencies, per request: TTFT = first token - send; TPOT = (last token - first
token) / (tokens - 1); ITL = per token (a chunk of n tokens after a gap g counts n
gaps of g/n, as specd_inter_token_latency_seconds); chunk ITL = the gap a
streaming client sees.

`--peer transformers`, `--peer vllm --peer-python PATH` or `--peer llamacpp` (comma-separated;
`--install-peers` builds their environments) runs the same loads
against a peer engine on the same model directory, dtype and max-model-len
(`benchmarks.peers`): its plain decoding beside `off`, and with vLLM one
n-gram server per `--peer-ngram-k` beside `on` and `auto`. Every server is up
for the whole run and the modes interleave load by load, so each ratio
compares runs of one time window. Output: a markdown table (stdout and OUT_DIR/serve_bench.md),
OUT_DIR/serve_bench.json and OUT_DIR/serve_bench.png.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import os
import platform
import random
import shlex
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import httpx

from benchmarks.lengths import max_tokens_for
from benchmarks.peers import PEERS, Peer, scrape_peer, start_peers, wait_peer_idle
from benchmarks.serve_client import (
    MODES,
    Prompt,
    RequestResult,
    load_prompts,
    request_body,
    timed_send,
)
from benchmarks.serve_report import plot, plot_title, progress_line, summarize, write_report
from tests.support.metrics import Metrics, wait_idle
from tests.support.server import ServerError, SpecdServer, serve_args

PROMPT_SETS = ("code", "chat", "extraction", "creative")
LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}
COUNTERS = {
    "specd_spec_decode_num_drafts_total": "num_drafts",
    "specd_spec_decode_num_draft_tokens_total": "num_draft_tokens",
    "specd_spec_decode_num_accepted_tokens_total": "num_accepted_tokens",
    # The policy's cost model, checked: step time predicted against measured (steps with a prediction).
    "specd_cost_model_predicted_seconds_total": "cost_predicted_seconds",
    "specd_cost_model_observed_seconds_total": "cost_observed_seconds",
    # Running requests per step, summed, and the steps counted: the batch's mean occupancy.
    "specd_batch_size_sum": "batch_rows",
    "specd_batch_size_count": "batch_steps",
}


# -- the server --------------------------------------------------------------------


# specd itself runs as tests.support.server.SpecdServer (the one server process of
# the test suites): `python -m server.cli serve` on 127.0.0.1 and a free port.


def server_args(args: argparse.Namespace) -> list[str]:
    levels = args.concurrency + ([args.max_concurrency] if args.max_concurrency else [])
    given = serve_args(
        model=args.model,
        draft=args.draft,
        draft_model=args.draft_model,
        draft_head=args.draft_head,
        num_speculative_tokens=args.num_speculative_tokens,
        spec_disable_batch_size=args.spec_disable_batch_size,
        max_num_seqs=args.max_num_seqs or max([16, *levels]),
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        device=args.device,
        log_level="warning",
    )
    return given + shlex.split(args.server_args)


# -- one run: a mode at a load -----------------------------------------------------


@dataclass
class Load:
    kind: str  # "concurrency" | "rate"
    value: float
    num_requests: int


async def drive(
    client: httpx.AsyncClient,
    model: str,
    prompts: list[Prompt],
    mode: str,
    load: Load,
    args: argparse.Namespace,
    peer: Peer | None = None,
) -> list[RequestResult]:
    """Send `load.num_requests` requests; whatever still runs after `args.max_seconds` is cancelled."""
    results: list[RequestResult] = []
    order = itertools.count()

    def next_body() -> tuple[dict, str]:
        index = next(order)
        prompt = prompts[index % len(prompts)]
        # Each (mode, load) its own tenant: what one run cached never warms another; passes share it.
        salt = f"{mode}-{load.kind}-{load.value}" if args.isolate_runs else None
        ignore_eos = args.lengths == "fixed"
        max_tokens = max_tokens_for(index, args.max_tokens, args.length_range_ratio)
        return request_body(model, prompt, mode, max_tokens, salt, ignore_eos, peer), prompt.id

    async def worker() -> None:
        while len(results) < load.num_requests:
            await timed_send(client, *next_body(), results)

    async def arrivals() -> None:
        rng = random.Random(args.seed)
        limit = asyncio.Semaphore(args.max_concurrency or load.num_requests)
        tasks, due = [], time.perf_counter()

        async def limited(body: dict, prompt_id: str) -> None:
            async with limit:
                await timed_send(client, body, prompt_id, results)

        for _ in range(load.num_requests):
            if math.isfinite(load.value):
                due += rng.expovariate(load.value)
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
            tasks.append(asyncio.create_task(limited(*next_body())))
        await asyncio.gather(*tasks)

    work = asyncio.gather(*(worker() for _ in range(int(load.value)))) if load.kind == "concurrency" else arrivals()
    try:
        await asyncio.wait_for(work, timeout=args.max_seconds)
    except TimeoutError:
        pass
    return results


async def scrape(client: httpx.AsyncClient) -> dict[str, float]:
    """The speculation counters and engine steps by mode, summed over their other labels."""
    metrics = Metrics((await client.get("/metrics")).text)
    totals = {key: metrics.value(name, default=0.0) for name, key in COUNTERS.items()}
    totals.update(steps_spec=0.0, steps_plain=0.0)
    for mode, value in metrics.by_label("specd_engine_steps_total", "mode").items():
        totals[f"steps_{mode or 'unknown'}"] = value
    for reason, value in metrics.by_label("specd_spec_policy_plain_steps_total", "reason").items():
        totals[f"plain_{reason}"] = value  # why speculation-auto rows ran plain
    return totals


def auth_headers(args: argparse.Namespace) -> dict[str, str]:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


# -- the benchmark -----------------------------------------------------------------


def plan(args: argparse.Namespace) -> list[Load]:
    loads = [Load("concurrency", c, args.num_requests or max(8, 2 * c)) for c in args.concurrency]
    return loads + [Load("rate", r, args.num_requests or 16) for r in args.request_rate]


def http_client(base_url: str, args: argparse.Namespace) -> httpx.AsyncClient:
    headers = auth_headers(args)
    timeout = httpx.Timeout(args.max_seconds + 30, connect=10)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout, limits=limits, trust_env=False)


def rotated_modes(modes: list[str], repeats: int) -> list[str]:
    """The modes of each repeat, the order rotated by one every repeat: a mode
    that runs right after another pays whatever the other left behind (on this
    CPU the run after `on` was ~6% slower), so each mode takes every place in turn."""
    return [modes[(i + r) % len(modes)] for r in range(repeats) for i in range(len(modes))]


async def benchmark(
    base_url: str, args: argparse.Namespace, prompts: list[Prompt], meta: dict, peers: list[Peer] = ()
) -> list[dict]:
    """Every load x mode (specd's and the peers'); the report is rewritten after each run, so a
    cut-short benchmark keeps its runs."""
    clients = {mode: http_client(base_url, args) for mode in args.modes}
    by_mode = {peer.mode: peer for peer in peers}
    clients.update({peer.mode: http_client(peer.server.url, args) for peer in peers})
    modes = [*args.modes, *by_mode]
    try:
        specd = clients[args.modes[0]]
        model = (await specd.get("/v1/models")).json()["data"][0]["id"]
        meta.update(model=model, speculation=(await specd.get("/v1/speculation")).json())
        models = {mode: model for mode in args.modes}
        for peer in peers:
            models[peer.mode] = (await clients[peer.mode].get("/v1/models")).json()["data"][0]["id"]
        for mode in modes if args.warmup else []:  # warm-up, not measured
            await drive(clients[mode], models[mode], prompts, mode, Load("concurrency", 1, args.warmup), args,
                        by_mode.get(mode))  # fmt: skip
        runs: list[dict] = []
        for load in [load for _ in range(args.passes) for load in plan(args)]:
            pooled = {mode: ([], [0.0], Counter()) for mode in modes}  # results, seconds, counter deltas
            for mode in rotated_modes(modes, args.repeats):
                client, peer = clients[mode], by_mode.get(mode)
                before = await settle(client, peer, base_url, args)
                start = time.perf_counter()
                results = await drive(client, models[mode], prompts, mode, load, args, peer)
                seconds = time.perf_counter() - start
                after = await scrape(client) if peer is None else await scrape_peer(client, peer)
                pooled[mode][0].extend(results)
                pooled[mode][1][0] += seconds
                pooled[mode][2].update({key: after[key] - before.get(key, 0.0) for key in after})
            served = sum(run["mode"] == modes[0] and run["load"] == load.value for run in runs)
            for mode, (results, seconds, delta) in pooled.items():
                counters = dict.fromkeys([*COUNTERS.values(), "steps_spec", "steps_plain"], 0.0) | delta
                runs.append(summarize(mode, load, results, seconds[0], counters, args) | {"pass": served + 1})
                print(progress_line(runs[-1]), file=sys.stderr, flush=True)
            write_report(args.out_dir, meta, runs)
        return runs
    finally:
        for client in clients.values():
            await client.aclose()


async def settle(client: httpx.AsyncClient, peer: Peer | None, base_url: str, args: argparse.Namespace) -> dict:
    """Wait until the server runs nothing (aborted requests leave at the next step); its counters then."""
    if peer is not None:
        await wait_peer_idle(client, peer)
        return await scrape_peer(client, peer)
    try:
        await asyncio.to_thread(wait_idle, base_url.rstrip("/"), auth_headers(args), 60)
    except TimeoutError:
        pass  # still busy after a minute: this run starts anyway
    return await scrape(client)


# -- command line ------------------------------------------------------------------


def numbers(text: str, kind=int) -> list:
    return [kind(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serve_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    g = p.add_argument_group("target")
    g.add_argument("--base-url", help="benchmark this running specd (loopback only) instead of starting one")
    g.add_argument("--api-key", help="bearer key for --base-url")
    g.add_argument(
        "--ready-timeout",
        type=float,
        default=900,
        help="seconds to wait for /ready (a first start converts GGUFs) [900]",
    )
    g = p.add_argument_group("server started by the benchmark (ignored with --base-url)")
    g.add_argument("--model", help="target model (default: specd's, the bundled SmolLM2-135M-Instruct)")
    g.add_argument(
        "--draft", choices=("ngram", "suffix", "draft_model", "eagle", "none"), help="proposer [specd's default]"
    )
    g.add_argument("--draft-model", help="draft model directory or Hub id")
    g.add_argument("--draft-head", help="EAGLE draft head directory (--draft eagle) [specd's default]")
    g.add_argument("--num-speculative-tokens", type=int, help="K [specd's default]")
    g.add_argument("--spec-disable-batch-size", type=int, help="auto rows stop drafting above this batch [specd's]")
    g.add_argument("--max-num-seqs", type=int, help="requests running at once [max(16, largest concurrency)]")
    g.add_argument("--max-model-len", type=int, default=1024, help="prompt + completion tokens per request [1024]")
    g.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), help="[specd's default]")
    g.add_argument("--device", help="cpu, cuda or cuda:N [specd's default]")
    g.add_argument("--server-args", default="", help="more `specd serve` flags, one quoted string")
    g.add_argument("--peer", type=lambda s: s.split(","), default=[],
                   help="comma-separated engines to run every load against too, on the same model, "
                        "interleaved with specd's modes: transformers = `transformers serve "
                        "--continuous-batching` (plain decoding); vllm = `vllm serve` from --peer-python's "
                        "environment (plain, and n-gram with each --peer-ngram-k); llamacpp = llama.cpp's "
                        "server on the GGUF file (plain, and prompt lookup with each --peer-lookup-k)")  # fmt: skip
    g.add_argument("--peer-python", help="--peer vllm: the python of the environment vLLM is installed in "
                   "(default with --install-peers: <cache>/peers/vllm, built once)")  # fmt: skip
    g.add_argument("--llamacpp-python", help="--peer llamacpp: the python of llama-cpp-python[server]'s "
                   "environment (default with --install-peers: <cache>/peers/llamacpp, built once)")  # fmt: skip
    g.add_argument("--install-peers", action="store_true",
                   help="build each --peer's environment under <cache>/peers/ if it is missing (pinned "
                        "versions; llama.cpp compiles for this CPU, ~9 min on 2 cores)")  # fmt: skip
    g.add_argument(
        "--peer-lookup-k",
        type=numbers,
        default=[],
        help="--peer llamacpp: one prompt-lookup server per draft length, beside on and auto [none]",
    )
    g.add_argument("--peer-threads", type=int, help="--peer llamacpp: threads [every core]")
    g.add_argument("--peer-ngram-k", type=numbers, default=[],
                   help="--peer vllm: one n-gram speculating vLLM server per draft length, beside on and auto "
                        "(lookup windows 1-4, as specd's) [none]")  # fmt: skip
    g.add_argument(
        "--peer-kv-gib", type=int, default=1, help="--peer vllm: VLLM_CPU_KVCACHE_SPACE per server (whole GiB) [1]"
    )
    g = p.add_argument_group("load")
    g.add_argument(
        "--prompt-sets",
        type=lambda s: s.split(","),
        default=list(PROMPT_SETS),
        help="names under benchmarks/prompt_sets/, public sets read from their PyPI packages (mtbench: MT-Bench's "
        f"first turns, humaneval), or .jsonl paths [{','.join(PROMPT_SETS)}]",
    )
    g.add_argument("--modes", type=lambda s: s.split(","), default=list(MODES), help="speculation modes [off,on,auto]")
    g.add_argument(
        "--concurrency",
        type=numbers,
        default=[1, 2, 4, 8, 16, 32],
        help="closed-loop levels: that many requests in flight [1,2,4,8,16,32]; '' for none",
    )
    g.add_argument(
        "--request-rate",
        type=lambda s: numbers(s, float),
        default=[],
        help="Poisson arrival rates in requests/s ('inf': all at once) [none]",
    )
    g.add_argument("--max-concurrency", type=int, help="cap on requests in flight for --request-rate runs [none]")
    g.add_argument("--num-requests", type=int, help="requests per run [max(8, 2 x concurrency); 16 per rate]")
    g.add_argument("--max-tokens", type=int, default=128, help="tokens generated per request [128]")
    g.add_argument(
        "--lengths",
        choices=["fixed", "natural"],
        default="fixed",
        help="fixed: every request generates --max-tokens (ignore_eos); natural: each stops at its end of "
        "sequence, up to --max-tokens (greedy: the same tokens in every mode, lengths that differ) [fixed]",
    )
    g.add_argument(
        "--length-range-ratio",
        type=float,
        default=0.0,
        help="request i's max tokens drawn uniformly in --max-tokens x [1 - R, 1 + R], seeded by i, so every "
        "mode gets the same (vLLM's --random-range-ratio): a closed loop out of lock step [0: all equal]",
    )
    g.add_argument(
        "--max-seconds", type=float, default=300, help="per run: requests still running then are cancelled [300]"
    )
    g.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run each load this many times, modes interleaved in rotating order, and pool the results [1]",
    )
    g.add_argument(
        "--passes",
        type=int,
        default=1,
        help="serve every load this many times on the same server (later passes see what a cache of "
        "earlier outputs, such as --draft suffix's, learned) [1]",
    )
    g.add_argument(
        "--isolate-runs",
        action="store_true",
        help="send each mode x load as its own tenant (cache_salt), so caches shared across requests (prefix "
        "cache, suffix trees) never carry one run's prompts into another; passes of a run share it",
    )
    g.add_argument("--warmup", type=int, default=2, help="unmeasured requests per mode before the runs [2]")
    g.add_argument("--seed", type=int, default=0, help="seed of the Poisson arrivals [0]")
    g = p.add_argument_group("output")
    g.add_argument(
        "--out-dir",
        type=Path,
        default=Path("benchmarks/results/latest"),
        help="where serve_bench.{md,json,png} and server.log go [benchmarks/results/latest]",
    )
    g.add_argument("--no-plot", action="store_true", help="skip the PNG")
    args = p.parse_args(argv)
    if unknown := set(args.modes) - set(MODES):
        p.error(f"unknown modes {sorted(unknown)}; choose from {','.join(MODES)}")
    if not args.concurrency and not args.request_rate:
        p.error("nothing to run: give --concurrency and/or --request-rate")
    if not 0.0 <= args.length_range_ratio < 1.0:
        p.error("--length-range-ratio must be in [0, 1)")
    if unknown := set(args.peer) - set(PEERS):
        p.error(f"--peer: unknown engines {sorted(unknown)} (known: {', '.join(PEERS)})")
    if "vllm" in args.peer and not (args.peer_python or args.install_peers):
        p.error("--peer vllm needs --peer-python PATH (vLLM's own environment, its own torch) or --install-peers")
    if "llamacpp" in args.peer and not (args.llamacpp_python or args.install_peers):
        p.error("--peer llamacpp needs --llamacpp-python PATH or --install-peers")
    if args.peer_ngram_k and "vllm" not in args.peer:
        p.error("--peer-ngram-k needs --peer vllm")
    if args.peer_lookup_k and "llamacpp" not in args.peer:
        p.error("--peer-lookup-k needs --peer llamacpp")
    if args.base_url and urlparse(args.base_url).hostname not in LOOPBACK_HOSTS:
        p.error("--base-url must be a loopback address (127.0.0.1, localhost, ::1)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prompts = load_prompts(args.prompt_sets)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    server = None if args.base_url else SpecdServer(server_args(args), args.out_dir / "server.log")
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "loadavg_at_start": os.getloadavg(),
        "prompt_sets": args.prompt_sets,
        "num_prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "lengths": args.lengths,
        "length_range_ratio": args.length_range_ratio,
        "modes": args.modes,
        "repeats": args.repeats,
        "server_args": server_args(args) if server else None,
        "base_url": args.base_url,
        "argv": sys.argv[1:] if argv is None else argv,
    }
    peers: list[Peer] = []
    try:
        peers = start_peers(args, args.out_dir)
        meta["peers"] = {peer.mode: peer.label for peer in peers}
        for waiting in [*([server] if server else []), *(peer.server for peer in peers)]:
            waiting.wait_ready(args.ready_timeout)
        runs = asyncio.run(benchmark(args.base_url or server.url, args, prompts, meta, peers))
    except (ServerError, httpx.HTTPError) as exc:
        print(f"serve_bench: error: {exc}", file=sys.stderr)
        return 2
    finally:
        for running in [*([server] if server else []), *(peer.server for peer in peers)]:
            running.stop()
    meta["loadavg_at_end"] = os.getloadavg()
    text = write_report(args.out_dir, meta, runs)
    if not args.no_plot and not plot(runs, plot_title(meta), args.out_dir / "serve_bench.png"):
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
    print(text)
    print(f"written to {args.out_dir}/serve_bench.{{md,json{'' if args.no_plot else ',png'}}}", file=sys.stderr)
    return 1 if any(r["num_failed"] for r in runs) else 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so `finally` stops the server
    sys.exit(main())
