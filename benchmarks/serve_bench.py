"""Serving benchmark: latency and throughput vs load, with speculation off, on and auto.

    python -m benchmarks.serve_bench                                  # bundled SmolLM2, n-gram, every prompt set
    python -m benchmarks.serve_bench --concurrency 1,4,16 --num-requests 16 --max-tokens 64
    python -m benchmarks.serve_bench --concurrency '' --request-rate 0.5,1,2   # Poisson arrivals instead
    python -m benchmarks.serve_bench --base-url http://127.0.0.1:8000          # a specd already running
    python -m benchmarks.serve_bench --modes off --peer transformers           # plain decoding vs a peer server
    python -m benchmarks.serve_bench --draft suffix --passes 2 --prompt-sets agent   # a cold then a warm pass

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

`--peer transformers` then runs the same loads against `transformers serve
--continuous-batching` (transformers' own batching server) on the same model
directory, dtype and device, as the mode "transformers": plain decoding only,
so `off / transformers` is specd's batched step against a peer measured in the
same run. The peer ignores `ignore_eos`, so its requests may stop early; tok/s
counts the tokens it sent. Output: a markdown table (stdout and OUT_DIR/serve_bench.md),
OUT_DIR/serve_bench.json and OUT_DIR/serve_bench.png.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import platform
import random
import shlex
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx

from benchmarks.lengths import max_tokens_for
from scheduler.policy import PLAIN_REASONS
from tests.support.metrics import Metrics, wait_idle
from tests.support.server import ServerError, SpecdServer, serve_args

PROMPT_SET_DIR = Path(__file__).resolve().parent / "prompt_sets"
PROMPT_SETS = ("code", "chat", "extraction", "creative")
MODES = {"off": False, "on": True, "auto": None}  # None: no `speculation` field
PEER_MODE = "transformers"  # plain requests to the --peer server
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


# -- prompts -----------------------------------------------------------------------


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str


def load_prompts(names: list[str]) -> list[Prompt]:
    """Prompts of each set (a name under prompt_sets/ or a .jsonl path), interleaved set by set."""
    sets = []
    for name in names:
        path = Path(name) if name.endswith(".jsonl") else PROMPT_SET_DIR / f"{name}.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        sets.append([Prompt(str(row["id"]), row["prompt"]) for row in rows])
    return [p for group in itertools.zip_longest(*sets) for p in group if p is not None]


# -- the server --------------------------------------------------------------------


# specd itself runs as tests.support.server.SpecdServer (the one server process of
# the test suites): `python -m server.cli serve` on 127.0.0.1 and a free port.


class TransformersServeProcess(SpecdServer):
    """The peer: `transformers serve --continuous-batching` on the model directory specd serves."""

    name = "transformers serve"
    ready_path = "/health"

    def __init__(self, args: argparse.Namespace, log_path: Path):
        from models.loader import ModelConfig, local_model_dir, resolve_device, resolve_dtype

        model_dir = local_model_dir(ModelConfig(args.model))
        if model_dir is None:
            raise ServerError(f"--peer needs a local model directory or GGUF, got {args.model!r}")
        device = resolve_device(args.device or "auto")
        self.model_dir, self.device = model_dir, str(device)
        self.dtype = str(resolve_dtype(args.dtype or "auto", device)).removeprefix("torch.")
        super().__init__([], log_path)

    def command(self, args: list[str]) -> list[str]:
        return [str(Path(sys.executable).with_name("transformers")), "serve", "--continuous-batching",
                "--host", "127.0.0.1", "--port", str(self.port), "--dtype", self.dtype, "--device", self.device,
                "--log-level", "warning", str(self.model_dir)]  # fmt: skip


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


# -- one request -------------------------------------------------------------------


@dataclass
class RequestResult:
    prompt_id: str
    start: float
    max_tokens: int = 0  # what the request asked for
    end: float = 0.0
    ok: bool = False
    error: str | None = None
    chunk_times: list[float] = field(default_factory=list)  # chunks that carried tokens
    chunk_tokens: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_accepted: int = 0  # usage.completion_tokens_details
    num_rejected: int = 0
    finish_reason: str | None = None
    text: str = ""  # the reply (a multi-turn client sends it back)


def request_body(
    model: str, prompt: Prompt, mode: str, max_tokens: int, cache_salt: str | None = None, ignore_eos: bool = True
) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt.text}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    if mode == PEER_MODE:  # plain OpenAI: the peer refuses fields it does not know
        del body["ignore_eos"], body["stream_options"]
    elif MODES[mode] is not None:
        body["speculation"] = MODES[mode]
    if cache_salt is not None and mode != PEER_MODE:
        body["cache_salt"] = cache_salt
    return body


async def send(client: httpx.AsyncClient, body: dict, result: RequestResult) -> None:
    """Stream one chat completion into `result`; errors become `result.error`."""
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                body_text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body_text[:300]}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    result.ok = result.error is None
                    break
                on_chunk(json.loads(data), time.perf_counter(), result)
            else:  # a server that ends the stream without [DONE] (transformers serve) but finished the choice
                result.ok = result.error is None and result.finish_reason is not None
    except asyncio.CancelledError:
        result.error = "cancelled at the time limit"
        raise
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        result.end = time.perf_counter()


def on_chunk(chunk: dict, now: float, result: RequestResult) -> None:
    if "error" in chunk:
        result.error = str(chunk["error"].get("message"))
        return
    usage = chunk.get("usage")
    for choice in chunk.get("choices") or []:
        result.finish_reason = choice.get("finish_reason") or result.finish_reason
        result.text += (choice.get("delta") or {}).get("content") or ""
    if chunk.get("choices"):
        if usage:
            num_new = usage["completion_tokens"] - result.num_output_tokens
        else:  # a server without continuous usage: one token per chunk with text
            num_new = int(any((c.get("delta") or {}).get("content") for c in chunk["choices"]))
        if num_new > 0:
            result.chunk_times.append(now)
            result.chunk_tokens.append(num_new)
            result.num_output_tokens += num_new
    if usage:
        details = usage.get("completion_tokens_details") or {}
        result.num_prompt_tokens = usage.get("prompt_tokens", 0)
        result.num_output_tokens = usage["completion_tokens"]
        result.num_accepted = details.get("accepted_prediction_tokens", 0)
        result.num_rejected = details.get("rejected_prediction_tokens", 0)


async def timed_send(client: httpx.AsyncClient, body: dict, prompt_id: str, results: list[RequestResult]) -> None:
    result = RequestResult(prompt_id, time.perf_counter(), body.get("max_tokens", 0))
    results.append(result)
    await send(client, body, result)


# -- one run: a mode at a load -----------------------------------------------------


@dataclass
class Load:
    kind: str  # "concurrency" | "rate"
    value: float
    num_requests: int


async def drive(
    client: httpx.AsyncClient, model: str, prompts: list[Prompt], mode: str, load: Load, args: argparse.Namespace
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
        return request_body(model, prompt, mode, max_tokens, salt, ignore_eos), prompt.id

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


# -- statistics --------------------------------------------------------------------


def percentiles(values: list[float], scale: float = 1e3) -> dict[str, float] | None:
    """mean, p50, p95, p99 (linear interpolation), times `scale` (seconds -> ms)."""
    if not values:
        return None
    ordered = sorted(values)

    def at(q: float) -> float:
        pos = (len(ordered) - 1) * q
        low = math.floor(pos)
        high = min(low + 1, len(ordered) - 1)
        return (ordered[low] + (ordered[high] - ordered[low]) * (pos - low)) * scale

    return {"mean": sum(ordered) / len(ordered) * scale, "p50": at(0.5), "p95": at(0.95), "p99": at(0.99)}


def ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def summarize(
    mode: str, load: Load, results: list[RequestResult], seconds: float, delta: dict, args: argparse.Namespace
) -> dict:
    """One mode at one load: `results` of every repeat, their `seconds` and server counter deltas added up."""
    done = [r for r in results if r.ok]
    ttft, tpot, e2e, itl, chunk_itl = [], [], [], [], []
    for r in done:
        if not r.chunk_times:
            continue
        ttft.append(r.chunk_times[0] - r.start)
        e2e.append(r.end - r.start)
        if r.num_output_tokens > 1:
            tpot.append((r.chunk_times[-1] - r.chunk_times[0]) / (r.num_output_tokens - 1))
        for prev, now, num_tokens in zip(r.chunk_times, r.chunk_times[1:], r.chunk_tokens[1:]):
            chunk_itl.append(now - prev)
            itl += [(now - prev) / num_tokens] * num_tokens
    num_steps = delta["steps_spec"] + delta["steps_plain"]
    accepted_per_draft = ratio(delta["num_accepted_tokens"], delta["num_drafts"])
    num_accepted = sum(r.num_accepted for r in done)
    num_output = sum(r.num_output_tokens for r in results)
    errors = [r.error for r in results if r.error]
    return {
        "mode": mode,
        "load_kind": load.kind,
        "load": load.value if math.isfinite(load.value) else "inf",
        "num_requests": len(results),
        "num_completed": len(done),
        "num_failed": sum(1 for e in errors if not e.startswith("cancelled")),
        "num_cancelled": sum(1 for e in errors if e.startswith("cancelled")),
        # Short of max_tokens: a fault with fixed lengths, the point of natural ones.
        "num_short": sum(1 for r in done if r.num_output_tokens != r.max_tokens) if args.lengths == "fixed" else 0,
        "errors": sorted(set(errors))[:5],
        "duration_s": seconds,
        "total_output_tokens": num_output,
        "request_throughput": len(done) / seconds,
        "output_throughput": num_output / seconds,
        "ttft_ms": percentiles(ttft),
        "tpot_ms": percentiles(tpot),
        "itl_ms": percentiles(itl),
        "chunk_itl_ms": percentiles(chunk_itl),
        "e2e_ms": percentiles(e2e),
        "acceptance_rate": ratio(delta["num_accepted_tokens"], delta["num_draft_tokens"]),
        "mean_acceptance_length": None if accepted_per_draft is None else 1 + accepted_per_draft,
        "spec_step_share": ratio(delta["steps_spec"], num_steps),
        "engine_steps": num_steps,
        # The engine's own time per step (its forwards, not HTTP): two runs of the same step
        # shapes that differ here differ in the machine's speed, not in what the policy chose.
        "step_ms": ratio(delta["cost_observed_seconds"] * 1e3, num_steps),
        # A closed loop of equal-length requests keeps `off` in lock step (every slot busy to
        # the end); a mode that finishes some requests early leaves slots idle in the tail.
        "mean_batch_rows": ratio(delta["batch_rows"], delta["batch_steps"]),
        # Summed over the run's steps: 1.0 is a cost model that predicted the run's time exactly.
        "step_time_predicted_over_measured": ratio(delta["cost_predicted_seconds"], delta["cost_observed_seconds"]),
        "acceptance_rate_usage": ratio(num_accepted, num_accepted + sum(r.num_rejected for r in done)),
        "tokens_per_chunk": ratio(sum(sum(r.chunk_tokens) for r in done), sum(len(r.chunk_tokens) for r in done)),
        # Steps whose speculation-auto rows ran plain, by the policy's reason (PLAIN_REASONS).
        "plain_steps_by_reason": {r: delta[f"plain_{r}"] for r in PLAIN_REASONS if f"plain_{r}" in delta},
        "server_counters": dict(delta),
        "loadavg_1m": os.getloadavg()[0],
    }


# -- the benchmark -----------------------------------------------------------------


def plan(args: argparse.Namespace) -> list[Load]:
    loads = [Load("concurrency", c, args.num_requests or max(8, 2 * c)) for c in args.concurrency]
    return loads + [Load("rate", r, args.num_requests or 16) for r in args.request_rate]


def http_client(base_url: str, args: argparse.Namespace) -> httpx.AsyncClient:
    headers = auth_headers(args)
    timeout = httpx.Timeout(args.max_seconds + 30, connect=10)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout, limits=limits, trust_env=False)


async def benchmark_peer(base_url: str, args: argparse.Namespace, prompts: list[Prompt], meta: dict) -> list[dict]:
    """The same loads against the peer server: plain requests, no counters to scrape."""
    async with http_client(base_url, args) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        meta["peer_model"] = model
        if args.warmup:
            await drive(client, model, prompts, PEER_MODE, Load("concurrency", 1, args.warmup), args)
        runs = []
        zeros = dict.fromkeys([*COUNTERS.values(), "steps_spec", "steps_plain"], 0.0)
        for load in plan(args):
            results, seconds = [], 0.0
            for _ in range(args.repeats):
                await asyncio.sleep(1.0)  # the peer exposes no queue state: let it drain
                start = time.perf_counter()
                results += await drive(client, model, prompts, PEER_MODE, load, args)
                seconds += time.perf_counter() - start
            runs.append(summarize(PEER_MODE, load, results, seconds, zeros, args))
            print(progress_line(runs[-1]), file=sys.stderr, flush=True)
        return runs


def rotated_modes(modes: list[str], repeats: int) -> list[str]:
    """The modes of each repeat, the order rotated by one every repeat: a mode
    that runs right after another pays whatever the other left behind (on this
    CPU the run after `on` was ~6% slower), so each mode takes every place in turn."""
    return [modes[(i + r) % len(modes)] for r in range(repeats) for i in range(len(modes))]


async def benchmark(base_url: str, args: argparse.Namespace, prompts: list[Prompt], meta: dict) -> list[dict]:
    """Every load x mode; the report is rewritten after each run, so a cut-short benchmark keeps its runs."""
    client = http_client(base_url, args)
    async with client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        meta.update(model=model, speculation=(await client.get("/v1/speculation")).json())
        for mode in args.modes if args.warmup else []:  # warm-up, not measured
            await drive(client, model, prompts, mode, Load("concurrency", 1, args.warmup), args)
        runs: list[dict] = []
        for load in [load for _ in range(args.passes) for load in plan(args)]:
            pooled = {mode: ([], [0.0], Counter()) for mode in args.modes}  # results, seconds, counter deltas
            for mode in rotated_modes(args.modes, args.repeats):
                try:  # until nothing runs or waits: aborted requests leave at the next step
                    await asyncio.to_thread(wait_idle, base_url.rstrip("/"), auth_headers(args), 60)
                except TimeoutError:
                    pass  # still busy after a minute: this run starts anyway
                before = await scrape(client)
                start = time.perf_counter()
                results = await drive(client, model, prompts, mode, load, args)
                seconds = time.perf_counter() - start
                after = await scrape(client)
                pooled[mode][0].extend(results)
                pooled[mode][1][0] += seconds
                pooled[mode][2].update({key: after[key] - before.get(key, 0.0) for key in after})
            served = sum(run["mode"] == args.modes[0] and run["load"] == load.value for run in runs)
            for mode, (results, seconds, delta) in pooled.items():
                runs.append(summarize(mode, load, results, seconds[0], delta, args) | {"pass": served + 1})
                print(progress_line(runs[-1]), file=sys.stderr, flush=True)
            write_report(args.out_dir, meta, runs)
        return runs


# -- reports -----------------------------------------------------------------------


def load_label(run: dict) -> str:
    label = f"c={run['load']}" if run["load_kind"] == "concurrency" else f"{run['load']} req/s"
    return label + (f" pass {run['pass']}" if run.get("pass", 1) > 1 else "")


def fmt(value, digits: int = 1) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def pct(stats: dict | None, key: str, scale: float = 1.0, digits: int = 1) -> str:
    return fmt(stats[key] * scale, digits) if stats else "-"


def share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def md_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def tradeoff(runs: list[dict]) -> dict:
    """Per load: output tok/s by mode, on/off and auto/best(off, on); the crossover concurrency."""
    by_load: dict[tuple, dict[str, dict]] = {}
    for run in runs:
        by_load.setdefault((run["load_kind"], run["load"]), {})[run["mode"]] = run
    rows = []
    for (kind, load), modes in by_load.items():
        tps = {mode: run["output_throughput"] for mode, run in modes.items()}
        best = max(tps.get("off", 0.0), tps.get("on", 0.0))
        rows.append({"load_kind": kind, "load": load, "output_throughput": tps,
                     "off_vs_peer": ratio(tps["off"], tps[PEER_MODE]) if "off" in tps and tps.get(PEER_MODE) else None,
                     "on_vs_off": ratio(tps.get("on", 0.0), tps.get("off", 0.0)) if "on" in tps else None,
                     "auto_vs_best": ratio(tps["auto"], best) if "auto" in tps and best else None})  # fmt: skip
    levels = [r for r in rows if r["load_kind"] == "concurrency" and r["on_vs_off"] is not None]
    crossover = None  # lowest concurrency from which speculation (on) never beats off again
    for row in reversed(levels):
        if row["on_vs_off"] >= 1.0:
            break
        crossover = row["load"]
    worst = min((r for r in rows if r["auto_vs_best"] is not None), key=lambda r: r["auto_vs_best"], default=None)
    return {"rows": rows, "crossover_concurrency": crossover, "on_always_faster": bool(levels) and crossover is None,
            "worst_auto_vs_best": worst and {"load_kind": worst["load_kind"], "load": worst["load"],
                                             "auto_vs_best": worst["auto_vs_best"]}}  # fmt: skip


def markdown(report: dict) -> str:
    meta, runs = report["meta"], report["runs"]
    spec = meta["speculation"]
    text = [
        "## specd serving benchmark\n",
        f"`{meta['model']}`, proposer {spec.get('proposer')}, K={spec.get('num_speculative_tokens')}, "
        f"spec-disable-batch-size {spec.get('spec_disable_batch_size')}; prompts {'+'.join(meta['prompt_sets'])}; "
        f"{length_label(meta)} per request (greedy); {meta['machine']}, {meta['date']}.\n",
    ]
    rows = [[r["mode"], load_label(r), f"{r['num_completed']}/{r['num_requests']}", fmt(r["request_throughput"], 2),
             fmt(r["output_throughput"]), pct(r["ttft_ms"], "p50"), pct(r["tpot_ms"], "p50"), pct(r["itl_ms"], "p50"),
             pct(r["e2e_ms"], "p50", 1e-3, 2), share(r["acceptance_rate"]), fmt(r["mean_acceptance_length"], 2),
             share(r["spec_step_share"]), fmt(r.get("mean_batch_rows"), 1), fmt(r.get("engine_steps"), 0),
             fmt(r.get("step_ms"), 1)] for r in runs]  # fmt: skip
    text.append(md_table(["mode", "load", "done", "req/s", "out tok/s", "TTFT p50 ms", "TPOT p50 ms", "ITL p50 ms",
                          "e2e p50 s", "accept", "accept len", "spec steps", "rows/step", "steps",
                          "ms / step"], rows))  # fmt: skip

    def three(stats: dict | None, scale: float = 1.0, digits: int = 1) -> str:
        return " / ".join(pct(stats, q, scale, digits) for q in ("p50", "p95", "p99"))

    rows = [[r["mode"], load_label(r), three(r["ttft_ms"]), three(r["tpot_ms"]), three(r["itl_ms"]),
             three(r["e2e_ms"], 1e-3, 2)] for r in runs]  # fmt: skip
    text += ["\n### Latency p50 / p95 / p99\n",
             md_table(["mode", "load", "TTFT ms", "TPOT ms", "ITL ms", "e2e s"], rows)]  # fmt: skip
    text += tradeoff_markdown(report["tradeoff"])
    text += plain_reasons_markdown(runs)
    failed = [r for r in runs if r["num_failed"] or r["num_cancelled"] or r["num_short"]]
    for r in failed:
        text.append(f"\n{r['mode']} {load_label(r)}: {r['num_failed']} failed, {r['num_cancelled']} cancelled at the "
                    f"time limit, {r['num_short']} short of max_tokens; {'; '.join(r['errors'])}")  # fmt: skip
    return "\n".join(text) + "\n"


def plain_reasons_markdown(runs: list[dict]) -> list[str]:
    """Where `auto` ran plain, by the policy's reason, for the runs that counted any."""
    runs = [r for r in runs if any(r.get("plain_steps_by_reason", {}).values())]
    if not runs:
        return []
    rows = [[r["mode"], load_label(r), fmt(r.get("engine_steps"), 0), share(r["spec_step_share"]),
             *(fmt(r["plain_steps_by_reason"].get(reason), 0) for reason in PLAIN_REASONS)]
            for r in runs]  # fmt: skip
    return ["\n### Why `auto` rows ran plain (steps)\n",
            md_table(["mode", "load", "steps", "spec steps", *PLAIN_REASONS], rows)]  # fmt: skip


def tradeoff_markdown(summary: dict) -> list[str]:
    peer = any(r["off_vs_peer"] is not None for r in summary["rows"])
    modes = [*MODES, PEER_MODE] if peer else list(MODES)
    rows = [[f"c={r['load']}" if r["load_kind"] == "concurrency" else f"{r['load']} req/s",
             *(fmt(r["output_throughput"].get(m)) for m in modes), fmt(r["on_vs_off"], 2), fmt(r["auto_vs_best"], 2),
             *([fmt(r["off_vs_peer"], 2)] if peer else [])]
            for r in summary["rows"]]  # fmt: skip
    text = ["\n### Speculation trade-off (output tok/s)\n",
            md_table(["load", *modes, "on / off", "auto / best of off, on", *(["off / transformers"] if peer else [])],
                     rows), ""]  # fmt: skip
    if summary["crossover_concurrency"] is not None:
        level = summary["crossover_concurrency"]
        text.append(f"Speculation stops paying from concurrency {level} (on < off there and above).")
    elif summary["on_always_faster"]:
        text.append("Speculation (on) beat off at every concurrency measured.")
    worst = summary["worst_auto_vs_best"]
    if worst:
        verdict = "within 3% of" if worst["auto_vs_best"] >= 0.97 else "more than 3% below"
        text.append(f"Auto's worst load: {worst['load_kind']} {worst['load']}, {worst['auto_vs_best']:.2f} of the "
                    f"better of off/on ({verdict} it).")  # fmt: skip
    return text


def length_label(meta: dict) -> str:
    ratio = meta.get("length_range_ratio") or 0.0
    tokens = (
        f"{meta['max_tokens']} x [{1 - ratio:g}, {1 + ratio:g}] tokens" if ratio else f"{meta['max_tokens']} tokens"
    )
    if meta.get("lengths", "fixed") == "fixed":
        return f"{tokens} (ignore_eos)"
    return f"up to {tokens} (to end of sequence)"


def plot_title(meta: dict) -> str:
    spec = meta["speculation"]
    return (
        f"{meta['model']} ({spec.get('proposer')}, K={spec.get('num_speculative_tokens')}, auto threshold "
        f"{spec.get('spec_disable_batch_size')}), {length_label(meta)}/request, {meta['machine']}"
    )


def progress_line(run: dict) -> str:
    return (f"{run['mode']:>4} {load_label(run):>10}: {run['num_completed']}/{run['num_requests']} done in "
            f"{run['duration_s']:.1f}s, {run['output_throughput']:.1f} tok/s, "
            f"TPOT p50 {pct(run['tpot_ms'], 'p50')} ms, acceptance {share(run['acceptance_rate'])}, "
            f"spec steps {share(run['spec_step_share'])}")  # fmt: skip


def plot(runs: list[dict], title: str, path: Path) -> bool:
    """Output tok/s and p50 TPOT vs load, one line per mode; one row per load kind. False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    kinds = [k for k in ("concurrency", "rate") if any(r["load_kind"] == k for r in runs)]
    fig, axes = plt.subplots(len(kinds), 2, figsize=(11, 4 * len(kinds)), squeeze=False)
    for row, kind in zip(axes, kinds):
        for mode in MODES:
            points = [r for r in runs if r["load_kind"] == kind and r["mode"] == mode and r["load"] != "inf"]
            if not points:
                continue
            xs = [r["load"] for r in points]
            row[0].plot(xs, [r["output_throughput"] for r in points], marker="o", label=mode)
            tpots = [r["tpot_ms"]["p50"] if r["tpot_ms"] else float("nan") for r in points]
            row[1].plot(xs, tpots, marker="o", label=mode)
        levels = sorted({r["load"] for r in runs if r["load_kind"] == kind and r["load"] != "inf"})
        for ax, ylabel in zip(row, ("output tokens/s", "TPOT p50 (ms)")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(levels, [f"{x:g}" for x in levels])
            ax.minorticks_off()
            ax.set_xlabel("concurrent requests" if kind == "concurrency" else "request rate (req/s)")
            ax.set_ylabel(ylabel)
            ax.grid(True, alpha=0.3)
            ax.legend(title="speculation")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# -- command line ------------------------------------------------------------------


def numbers(text: str, kind=int) -> list:
    return [kind(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serve_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    g = p.add_argument_group("target")
    g.add_argument("--base-url", help="benchmark this running specd (loopback only) instead of starting one")
    g.add_argument("--api-key", help="bearer key for --base-url")
    g.add_argument("--ready-timeout", type=float, default=300, help="seconds to wait for /ready [300]")
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
    g.add_argument("--peer", choices=("transformers",),
                   help="also run every load against this server on the same model, dtype and device: "
                        "transformers = `transformers serve --continuous-batching` (plain decoding)")  # fmt: skip
    g = p.add_argument_group("load")
    g.add_argument(
        "--prompt-sets",
        type=lambda s: s.split(","),
        default=list(PROMPT_SETS),
        help=f"names under benchmarks/prompt_sets/ or .jsonl paths [{','.join(PROMPT_SETS)}]",
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
    if args.base_url and urlparse(args.base_url).hostname not in LOOPBACK_HOSTS:
        p.error("--base-url must be a loopback address (127.0.0.1, localhost, ::1)")
    return args


def write_report(out_dir: Path, meta: dict, runs: list[dict]) -> str:
    report = {"meta": meta, "runs": runs, "tradeoff": tradeoff(runs)}
    (out_dir / "serve_bench.json").write_text(json.dumps(report, indent=1))
    text = markdown(report)
    (out_dir / "serve_bench.md").write_text(text)
    return text


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
    try:
        if server:
            server.wait_ready(args.ready_timeout)
        runs = asyncio.run(benchmark(args.base_url or server.url, args, prompts, meta))
        if server:
            server.stop()
            server = None
        if args.peer:
            server = TransformersServeProcess(args, args.out_dir / "peer.log")
            meta["peer"] = f"transformers serve --continuous-batching ({server.dtype})"
            server.wait_ready(args.ready_timeout)
            runs += asyncio.run(benchmark_peer(server.url, args, prompts, meta))
    except (ServerError, httpx.HTTPError) as exc:
        print(f"serve_bench: error: {exc}", file=sys.stderr)
        return 2
    finally:
        if server:
            server.stop()
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
