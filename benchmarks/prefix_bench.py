"""Paged KV and prefix caching, measured through the server: ratios in one run.

    python -m benchmarks.prefix_bench                    # bundled SmolLM2, specd's default dtype
    python -m benchmarks.prefix_bench --turns 10 --shared 32 --capacity 96 --repeats 2

Scenarios (a) and (b) run against two servers in turn, the same flags but for
`--no-prefix-caching` on the second, so every ratio compares runs of one
invocation on one machine:

(a) multi-turn chat: a conversation of `--turns` turns (user messages from the
    chat prompt set, greedy replies of up to 48 tokens), the whole history sent
    each turn, as chat clients do; TTFT per turn.
(b) shared system prompt: `--shared` requests at once, each a ~1k-token system
    prompt plus its own question; prompt tokens the server computed (the
    delta of specd_prompt_tokens_total) and TTFT.
(c) capacity, on the caching server at its default KV memory and
    --max-num-seqs: `--capacity` short chats at once (~150 prompt + 50 output
    tokens); the most requests running at once (specd_requests_running,
    sampled every 50 ms) against the 16 fixed slots the same memory held
    before the cache was paged.

Every conversation and system prompt starts with a fresh random line, so no
run hits what an earlier run left in the cache. Output: a markdown table
(stdout and OUT_DIR/prefix_bench.md) and OUT_DIR/prefix_bench.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import signal
import sys
import time
import uuid
from pathlib import Path
from statistics import mean

import httpx

from benchmarks.serve_client import Prompt, RequestResult, load_prompts, send
from tests.support.metrics import Metrics
from tests.support.server import ServerError, SpecdServer, serve_args

SLOTS_BEFORE_PAGING = 16  # --max-num-seqs' old default: one fixed max_model_len slot each
REPLY_TOKENS = 48


def chat_body(model: str, messages: list[dict], max_tokens: int, ignore_eos: bool = False) -> dict:
    return {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }


async def chat(client: httpx.AsyncClient, body: dict) -> tuple[RequestResult, str]:
    """One streamed chat completion: its timing and the reply's text."""
    result = RequestResult("chat", time.perf_counter())
    await send(client, body, result)
    if result.error:
        raise RuntimeError(result.error)
    return result, result.text


def ttft(result: RequestResult) -> float:
    return result.chunk_times[0] - result.start


async def counters(client: httpx.AsyncClient) -> dict[str, float]:
    metrics = Metrics((await client.get("/metrics")).text)
    names = ("specd_prompt_tokens_total", "specd_prefix_cache_hits_total", "specd_prefix_cache_queries_total")
    return {name: metrics.value(name, default=0.0) for name in names}


# -- scenarios ---------------------------------------------------------------------


async def multi_turn(client: httpx.AsyncClient, model: str, users: list[Prompt], turns: int) -> list[float]:
    """TTFT (s) of each turn of one conversation whose history grows every turn."""
    messages = [{"role": "system", "content": f"Conversation {uuid.uuid4().hex}. You are a helpful assistant."}]
    times = []
    for turn in range(turns):
        messages.append({"role": "user", "content": users[turn % len(users)].text})
        result, reply = await chat(client, chat_body(model, messages, REPLY_TOKENS))
        times.append(ttft(result))
        messages.append({"role": "assistant", "content": reply})
    return times


def system_prompt(documents: list[Prompt], num_chars: int) -> str:
    """~1k tokens of reference text (SmolLM2's tokenizer: ~4 characters a token)."""
    text = f"Session {uuid.uuid4().hex}. Answer from these notes only.\n"
    for doc in documents:
        if len(text) >= num_chars:
            break
        text += doc.text + "\n"
    return text[:num_chars]


async def shared_prefix(
    client: httpx.AsyncClient, model: str, documents: list[Prompt], questions: list[Prompt], n: int, num_chars: int
) -> dict:
    system = system_prompt(documents, num_chars)
    before = await counters(client)
    bodies = [
        chat_body(
            model,
            [{"role": "system", "content": system}, {"role": "user", "content": questions[i % len(questions)].text}],
            16,
            ignore_eos=True,
        )
        for i in range(n)
    ]
    start = time.perf_counter()
    results = await asyncio.gather(*(chat(client, body) for body in bodies))
    seconds = time.perf_counter() - start
    after = await counters(client)
    ttfts = sorted(ttft(r) for r, _ in results)
    return {
        "prompt_tokens_sent": sum(r.num_prompt_tokens for r, _ in results),
        "prompt_tokens_computed": after["specd_prompt_tokens_total"] - before["specd_prompt_tokens_total"],
        "cache_hit_tokens": after["specd_prefix_cache_hits_total"] - before["specd_prefix_cache_hits_total"],
        "ttft_p50_s": ttfts[len(ttfts) // 2],
        "seconds": seconds,
    }


async def capacity(client: httpx.AsyncClient, model: str, prompts: list[Prompt], n: int, num_chars: int) -> dict:
    """The most requests running and KV blocks held at once while `n` short chats run together."""
    peak = {"running": 0.0, "blocks_used": 0.0, "blocks": 0.0}
    done = asyncio.Event()

    async def sample() -> None:
        while not done.is_set():
            metrics = Metrics((await client.get("/metrics")).text)
            peak["running"] = max(peak["running"], metrics.value("specd_requests_running", default=0.0))
            peak["blocks_used"] = max(peak["blocks_used"], metrics.value("specd_kv_blocks_used", default=0.0))
            peak["blocks"] = metrics.value("specd_kv_blocks_capacity", default=0.0)
            await asyncio.sleep(0.05)

    def text(i: int) -> str:  # `num_chars` of the set's prompts, one after another
        parts = [prompts[(i + j) % len(prompts)].text for j in range(len(prompts))]
        return f"[{i}] " + " ".join(parts)[:num_chars]

    bodies = [chat_body(model, [{"role": "user", "content": text(i)}], 50, True) for i in range(n)]
    sampler = asyncio.create_task(sample())
    results = await asyncio.gather(*(chat(client, body) for body in bodies))
    done.set()
    await sampler
    tokens = [r.num_prompt_tokens + r.num_output_tokens for r, _ in results]
    return {**peak, "mean_tokens_per_request": sum(tokens) / len(tokens), "requests": n}


# -- the run -----------------------------------------------------------------------


async def run_server(url: str, args: argparse.Namespace, caching: bool) -> dict:
    chat_prompts = load_prompts(["chat"])
    documents = load_prompts(["extraction"])
    timeout = httpx.Timeout(args.max_seconds, connect=10)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, trust_env=False) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        await chat(client, chat_body(model, [{"role": "user", "content": "Hello"}], 4))  # warm-up
        out: dict = {"turn_ttft_s": [], "shared": []}
        for _ in range(args.repeats):
            if args.turns:
                out["turn_ttft_s"].append(await multi_turn(client, model, chat_prompts, args.turns))
            if args.shared:
                shared = await shared_prefix(client, model, documents, chat_prompts, args.shared, args.system_chars)
                out["shared"].append(shared)
        if caching and args.capacity:
            out["capacity"] = await capacity(client, model, chat_prompts, args.capacity, args.capacity_chars)
        return out


def report(runs: dict[str, dict], args: argparse.Namespace) -> str:
    on, off = runs["caching"], runs["no caching"]
    lines = [f"# Prefix caching and paged KV ({time.strftime('%Y-%m-%d')})", ""]
    lines += [f"`python -m benchmarks.prefix_bench {' '.join(args.argv)}`".replace(" `", "`")]
    if args.turns:
        lines += [
            "",
            "## (a) multi-turn chat: TTFT per turn (ms, mean of repeats)",
            "",
            "| turn | caching | no caching | ratio |",
            "| --- | --- | --- | --- |",
        ]
    for turn in range(args.turns):
        a = mean([run[turn] for run in on["turn_ttft_s"]]) * 1e3
        b = mean([run[turn] for run in off["turn_ttft_s"]]) * 1e3
        lines.append(f"| {turn + 1} | {a:.0f} | {b:.0f} | {a / b:.2f} |")
    if args.shared:
        lines += ["", f"## (b) {args.shared} requests sharing a ~1k-token system prompt", ""]
        lines += ["| | caching | no caching | ratio |", "| --- | --- | --- | --- |"]
        for key, label in (
            ("prompt_tokens_computed", "prompt tokens computed"),
            ("ttft_p50_s", "TTFT p50 (s)"),
            ("seconds", "wall time (s)"),
        ):
            a, b = mean([s[key] for s in on["shared"]]), mean([s[key] for s in off["shared"]])
            lines.append(f"| {label} | {a:.4g} | {b:.4g} | {a / b:.3f} |")
        sent = [mean([s["prompt_tokens_sent"] for s in run["shared"]]) for run in (on, off)]
        lines.append(f"| prompt tokens sent | {sent[0]:.0f} | {sent[1]:.0f} | |")
    if "capacity" in on:
        c = on["capacity"]
        lines += [
            "",
            f"## (c) {c['requests']} short chats at once, default KV memory",
            "",
            f"- ~{c['mean_tokens_per_request']:.0f} tokens per request (prompt + output)",
            f"- most running at once: {c['running']:.0f} = {c['running'] / SLOTS_BEFORE_PAGING:.1f}x the "
            f"{SLOTS_BEFORE_PAGING} slots this memory held before paging",
            f"- most KV blocks held: {c['blocks_used']:.0f} of {c['blocks']:.0f}",
        ]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.prefix_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", help="target model (default: specd's, the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), help="[specd's default]")
    p.add_argument("--device", help="cpu, cuda or cuda:N [specd's default]")
    p.add_argument("--turns", type=int, default=10, help="turns of the multi-turn chat; 0 skips (a) [10]")
    p.add_argument("--shared", type=int, default=32, help="requests sharing one system prompt; 0 skips (b) [32]")
    p.add_argument("--system-chars", type=int, default=4200, help="length of (b)'s system prompt [4200, ~1k tokens]")
    p.add_argument("--capacity-chars", type=int, default=600, help="prompt length in (c) [600, ~150 tokens]")
    p.add_argument("--capacity", type=int, default=96, help="short chats sent at once for (c); 0 skips it [96]")
    p.add_argument("--repeats", type=int, default=2, help="conversations and shared-prompt rounds per server [2]")
    p.add_argument("--max-seconds", type=float, default=600, help="HTTP timeout per request [600]")
    p.add_argument("--server-args", default="", help="more `specd serve` flags for both servers, one quoted string")
    p.add_argument(
        "--out-dir", type=Path, default=Path("benchmarks/results/prefix"), help="[benchmarks/results/prefix]"
    )
    args = p.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    base = serve_args(model=args.model, dtype=args.dtype, device=args.device, log_level="warning")
    base += shlex.split(args.server_args)
    runs: dict[str, dict] = {}
    for name, extra in (("caching", []), ("no caching", ["--no-prefix-caching"])):
        server = SpecdServer(base + extra, args.out_dir / f"server-{name.replace(' ', '-')}.log")
        try:
            server.wait_ready(300)
            runs[name] = asyncio.run(run_server(server.url, args, caching=not extra))
        except (ServerError, httpx.HTTPError, RuntimeError) as exc:
            print(f"prefix_bench: error: {exc}", file=sys.stderr)
            return 2
        finally:
            server.stop()
        print(f"{name}: done", file=sys.stderr, flush=True)
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "server_args": base,
        "argv": args.argv,
    }
    (args.out_dir / "prefix_bench.json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))
    text = report(runs, args)
    (args.out_dir / "prefix_bench.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so `finally` stops the server
    sys.exit(main())
