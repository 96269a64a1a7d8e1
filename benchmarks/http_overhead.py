"""HTTP overhead benchmark (not a test): tokens/s of one streamed chat request
through `specd serve` vs the same request on the engine called directly, in
the same run, alternating. Goal: HTTP >= 0.95x direct. Both record Prometheus
metrics, as the server does, so the ratio isolates the HTTP path.

    .venv/bin/python -m benchmarks.http_overhead                  # bundled SmolLM2, from the repo root
    .venv/bin/python -m benchmarks.http_overhead --model DIR --max-tokens 300
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import httpx

from scheduler.engine import AsyncEngine
from scheduler.metrics import MetricsObserver
from scheduler.types import Request, SamplingParams
from server.app import build_components, served_names
from server.config import Settings
from tests.support.server import SpecdServer, serve_args

MESSAGES = [{"role": "user", "content": "Write a long story about a dragon who learns to fly."}]


async def direct_tokens_per_second(components, prompt_ids: list[int], args, tag: str) -> float:
    metrics = MetricsObserver("direct")
    engine = AsyncEngine(components.runner, components.scheduler_config, observer=metrics.observe)
    await engine.start()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True, speculation=args.speculation)
    started, num_tokens = time.perf_counter(), 0
    async with engine.submit(Request(tag, prompt_ids, params)) as stream:
        async for out in stream:
            num_tokens += len(out.new_token_ids)
    seconds = time.perf_counter() - started
    await engine.stop(timeout=0)
    return num_tokens / seconds


def http_tokens_per_second(server: SpecdServer, model: str, args) -> float:
    body = {
        "model": model,
        "messages": MESSAGES,
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "speculation": args.speculation,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started, usage = time.perf_counter(), None
    with httpx.stream("POST", server.base_url + "/chat/completions", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage") or usage
    return usage["completion_tokens"] / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model directory or Hub id (default: bundled SmolLM2)")
    parser.add_argument("--max-tokens", type=int, default=100, help="tokens per request")
    parser.add_argument("--runs", type=int, default=3, help="measured runs of each")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="auto")
    parser.add_argument(
        "--speculation", type=lambda s: {"true": True, "false": False}.get(s, s), default="auto", help="auto|true|false"
    )
    args = parser.parse_args()
    flags = {"dtype": args.dtype, "device": args.device, "max_num_seqs": 4, "max_model_len": 1024}
    settings = Settings(model=args.model, **flags)
    components = build_components(settings)
    tokenizer = components.loaded.tokenizer
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer.encode(text, add_special_tokens=False)

    cli = serve_args(model=args.model, **flags, log_level="warning")
    server = SpecdServer(cli, Path(tempfile.mkdtemp()) / "specd.log")
    try:
        server.wait_ready()
        model = served_names(settings)[0]
        http_tokens_per_second(server, model, args)  # warm-up
        asyncio.run(direct_tokens_per_second(components, prompt_ids, args, "warm-up"))
        print(f"{'run':>4} {'direct tok/s':>13} {'http tok/s':>11} {'ratio':>6}")
        ratios = []
        for run in range(args.runs):
            direct = asyncio.run(direct_tokens_per_second(components, prompt_ids, args, f"run-{run}"))
            http = http_tokens_per_second(server, model, args)
            ratios.append(http / direct)
            print(f"{run:>4} {direct:>13.1f} {http:>11.1f} {http / direct:>6.3f}")
        print(f"mean ratio {sum(ratios) / len(ratios):.3f} (goal >= 0.95)")
    finally:
        print(f"specd exited with {server.stop()}")


if __name__ == "__main__":
    main()
