"""Soak: thousands of mixed requests against one specd, then proof that nothing grew.

The mix (seeded): completions and chat, streamed and not, `n` = 2, speculation
on / off / auto, clients that hang up mid-stream, injected engine faults, and
invalid requests. Every reply is checked exactly against the cycle model's
known text; a request that ends any other way than its kind allows is *lost*.
After a warm-up quarter the server's RSS, OS threads, asyncio tasks and the
engine's per-request tables are recorded; at the end (idle) they must not have
grown (RSS < 5%), KV use must be 0, and p99 latency of the last quarter is set
against the first.

    python -m benchmarks.soak                   # 2,000 requests (make soak), from the repo root
    python -m benchmarks.soak --requests 200    # the CI size

`tests/reliability/test_soak.py` runs the short version inside the suite; this
module keeps using the reliability suite's harness (`tests.reliability.rel_harness`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.reliability.rel_harness import (
    API_KEY,
    CYCLE_NAME,
    Tally,
    chaos_args,
    cut_stream,
    leaked_bookkeeping,
    percentile,
    results_table,
    sse_events,
    stream_text,
)
from tests.support.cycle import CYCLE_TEXT, CycleText, build_cycle_model
from tests.support.server import SpecdServer, finish_server
from tests.support.tiny_models import build_tiny_model

KINDS = {  # kind -> weight in the mix
    "completion": 20,
    "completion_stream": 18,
    "chat": 14,
    "chat_stream": 14,
    "n2": 6,
    "cancel": 12,
    "fault": 8,
    "invalid": 8,
}
INVALID_BODIES = [
    {"prompt": "x", "temperature": -1},
    {"prompt": "x", "n": 99},
    {"prompt": [1, 10**9]},
    {"prompt": "x", "stop": ["s"] * 100},
    {"messages": []},
    {"messages": [{"role": "robot", "content": "x"}]},
]
MAX_RSS_GROWTH = 0.05


@dataclass
class Outcome:
    index: int
    kind: str
    ok: bool
    seconds: float
    detail: str = ""


@dataclass
class SoakReport:
    num_requests: int
    concurrency: int
    seconds: float = 0.0
    outcomes: list[Outcome] = field(default_factory=list)
    warm: dict = field(default_factory=dict)  # probe + /proc after the warm-up quarter, idle
    end: dict = field(default_factory=dict)  # the same at the end, idle
    peak_rss: int = 0
    kv_usage_end: float = -1.0
    max_p99_ratio: float = 3.0
    finished_counted: dict[str, float] = field(default_factory=dict)  # specd_requests_total deltas by reason

    @property
    def lost(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.ok]

    @property
    def counts(self) -> Counter:
        return Counter(o.kind for o in self.outcomes)

    @property
    def engine_requests_expected(self) -> int:
        """Engine requests the mix submitted: one per choice; invalid ones never reach the engine."""
        counts = self.counts
        return sum(counts[k] for k in KINDS if k not in ("n2", "invalid")) + 2 * counts["n2"]

    @property
    def rss_growth(self) -> float:
        return (self.end["rss"] - self.warm["rss"]) / self.warm["rss"]

    def latencies(self, quarter: int) -> list[float]:
        """e2e seconds of the requests of one quarter (by index) that ran to completion."""
        size = self.num_requests / 4
        return [
            o.seconds
            for o in self.outcomes
            if o.ok and o.kind not in ("cancel", "fault", "invalid") and int(o.index // size) == quarter
        ]

    def problems(self) -> list[str]:
        found = []
        if self.lost:
            found.append(f"{len(self.lost)} requests lost, e.g. {self.lost[:3]}")
        if self.rss_growth >= MAX_RSS_GROWTH:
            found.append(f"RSS grew {self.rss_growth * 100:.2f}% after warm-up")
        if sum(self.finished_counted.values()) != self.engine_requests_expected:
            found.append(f"/metrics counted {self.finished_counted} finished, expected {self.engine_requests_expected}")
        if self.finished_counted.get("error", 0) != self.counts["fault"]:
            found.append(
                f"{self.finished_counted.get('error', 0)} requests ended in error, "
                f"{self.counts['fault']} faults were injected"
            )
        if self.kv_usage_end != 0:
            found.append(f"KV usage {self.kv_usage_end} at the end")
        leaked = leaked_bookkeeping(self.end)
        if leaked:
            found.append(f"per-request state left behind: {leaked}")
        for key in ("tasks", "threads", "os_threads"):
            if self.end[key] > self.warm[key]:
                found.append(f"{key} grew from {self.warm[key]} to {self.end[key]}")
        first, last = percentile(self.latencies(0), 99), percentile(self.latencies(3), 99)
        if last > self.max_p99_ratio * first + 0.05:
            found.append(f"p99 latency went from {first:.3f}s (first quarter) to {last:.3f}s (last)")
        return found

    def table(self) -> str:
        mib = 2**20
        counts = self.counts
        first, last = self.latencies(0), self.latencies(3)
        rows = [
            ("requests", f"{self.num_requests} at concurrency {self.concurrency} in {self.seconds:.1f}s"),
            ("mix", ", ".join(f"{k} {counts[k]}" for k in KINDS)),
            ("requests lost", str(len(self.lost))),
            (
                "engine requests finished (/metrics)",
                f"{sum(self.finished_counted.values()):g} of {self.engine_requests_expected} submitted: "
                + ", ".join(f"{reason} {value:g}" for reason, value in sorted(self.finished_counted.items())),
            ),
            (
                "RSS after warm-up -> end",
                f"{self.warm['rss'] / mib:.1f} -> {self.end['rss'] / mib:.1f} MiB ({self.rss_growth * 100:+.2f}%)",
            ),
            ("peak RSS", f"{self.peak_rss / mib:.1f} MiB"),
            ("OS threads after warm-up -> end", f"{self.warm['os_threads']} -> {self.end['os_threads']}"),
            ("Python threads", f"{self.warm['threads']} -> {self.end['threads']}"),
            ("asyncio tasks (idle)", f"{self.warm['tasks']} -> {self.end['tasks']}"),
            ("gc objects", f"{self.warm['gc_objects']} -> {self.end['gc_objects']}"),
            ("KV usage at the end", f"{self.kv_usage_end:g}"),
            ("per-request state left", str(leaked_bookkeeping(self.end) or "none")),
            (
                "latency p50 / p99, first quarter",
                f"{percentile(first, 50) * 1000:.0f} / {percentile(first, 99) * 1000:.0f} ms",
            ),
            (
                "latency p50 / p99, last quarter",
                f"{percentile(last, 50) * 1000:.0f} / {percentile(last, 99) * 1000:.0f} ms",
            ),
        ]
        width = max(len(name) for name, _ in rows)
        lines = [f"| {'soak'.ljust(width)} | result |", f"| {'-' * width} | ------ |"]
        return "\n".join(lines + [f"| {name.ljust(width)} | {value} |" for name, value in rows])

    def add_to(self, tally: Tally) -> None:
        counts = self.counts
        tally.requests_cut += counts["cancel"]
        tally.faults_injected += counts["fault"]
        tally.cases_tried += counts["invalid"]
        tally.requests_lost += len(self.lost)
        tally.memory_growth = self.rss_growth


# -- one request ---------------------------------------------------------------------------


class Mix:
    """The seeded plan: what request `index` is."""

    def __init__(self, seed: int, cycle: CycleText):
        self.seed = seed
        self.cycle = cycle

    def plan(self, index: int) -> dict:
        rng = random.Random(self.seed * 1_000_003 + index)
        kind = rng.choices(list(KINDS), list(KINDS.values()))[0]
        speculation = rng.choice([True, False, "auto"])
        start = rng.randrange(len(CYCLE_TEXT))
        prompt = CYCLE_TEXT[: start + 1] * (3 if speculation is True else 1)
        if self.cycle.tokenizer.encode(prompt, add_special_tokens=False)[-1] not in self.cycle.ids:
            prompt = CYCLE_TEXT  # the prompt must end on a whole cycle token
        return {
            "kind": kind,
            "speculation": speculation,
            "prompt": prompt,
            "max_tokens": rng.randint(4, 48),
            "fault": rng.choice(["raise", "nan"]),
            "stream": rng.random() < 0.5,
            "cut_events": rng.randint(0, 6),
            "invalid": rng.choice(INVALID_BODIES),
            "chat": rng.random() < 0.4,
        }


async def run_one(http: httpx.AsyncClient, server: SpecdServer, mix: Mix, index: int) -> Outcome:
    p = mix.plan(index)
    kind = p["kind"]
    base = {"model": CYCLE_NAME, "max_tokens": p["max_tokens"], "speculation": p["speculation"]}
    started = time.perf_counter()
    try:
        ok, detail = await _run_kind(http, server, mix, p, kind, base)
    except (httpx.HTTPError, OSError, ValueError, KeyError) as exc:
        ok, detail = False, f"{type(exc).__name__}: {exc}"
    return Outcome(index, kind, ok, time.perf_counter() - started, detail)


async def _run_kind(http, server, mix: Mix, p: dict, kind: str, base: dict) -> tuple[bool, str]:
    cycle = mix.cycle
    if kind in ("completion", "completion_stream", "n2"):
        n = 2 if kind == "n2" else 1
        body = {**base, "prompt": p["prompt"], "stream": kind == "completion_stream", "n": n}
        response = await http.post("/completions", json=body)
        expected = cycle.expected(p["prompt"], p["max_tokens"])
        return _check_text(response, body, [expected] * n, chat=False)
    if kind in ("chat", "chat_stream"):
        body = {**base, "messages": [{"role": "user", "content": "go"}], "stream": kind == "chat_stream"}
        response = await http.post("/chat/completions", json=body)
        return _check_text(response, body, [cycle.expected_chat(p["max_tokens"])], chat=True)
    if kind == "cancel":
        body = {**base, "prompt": p["prompt"], "max_tokens": 200, "stream": True}
        cut = "after_events" if p["cut_events"] else "after_headers"
        result = await cut_stream(server.port, "/v1/completions", body, cut, p["cut_events"], server.headers)
        return result.status in (None, 200), f"status {result.status}"
    if kind == "fault":
        body = {**base, "prompt": p["prompt"], "stream": p["stream"], "fault": p["fault"]}
        response = await http.post("/completions", json=body)
        if p["stream"]:
            events = sse_events(response.text)
            _, finishes, errors = stream_text(events)
            good = response.status_code == 200 and events[-1:] == ["[DONE]"] and len(errors) == 1 and not finishes
            return good, response.text[-300:]
        return response.status_code == 500 and response.json()["error"]["code"] == "engine_error", response.text[:300]
    path = "/chat/completions" if "messages" in p["invalid"] else "/completions"
    response = await http.post(path, json={"model": CYCLE_NAME, **p["invalid"]})
    error = response.json().get("error", {})
    return response.status_code == 400 and error.get("param") is not None, response.text[:300]


def _check_text(response: httpx.Response, body: dict, expected: list[str], chat: bool) -> tuple[bool, str]:
    if response.status_code != 200:
        return False, f"{response.status_code} {response.text[:300]}"
    if body["stream"]:
        texts: dict[int, str] = {}
        finishes: dict[int, str] = {}
        for event in sse_events(response.text):
            if event == "[DONE]":
                continue
            chunk = json.loads(event)
            if "error" in chunk:
                return False, event
            for choice in chunk["choices"]:
                piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                texts[choice["index"]] = texts.get(choice["index"], "") + (piece or "")
                if choice.get("finish_reason"):
                    finishes[choice["index"]] = choice["finish_reason"]
        got = [texts.get(i, "") for i in range(len(expected))]
        ended = [finishes.get(i) for i in range(len(expected))]
    else:
        choices = sorted(response.json()["choices"], key=lambda c: c["index"])
        got = [c["message"]["content"] if chat else c["text"] for c in choices]
        ended = [c["finish_reason"] for c in choices]
    good = got == expected and ended == ["length"] * len(expected)
    return good, "" if good else f"got {got!r} ended {ended} expected {expected!r}"


# -- the run -----------------------------------------------------------------------------------


def snapshot(server: SpecdServer) -> dict:
    metrics = server.wait_idle()
    probe = server.probe()
    status = server.proc_status()
    return {
        **probe,
        "rss": status["rss"],
        "os_threads": status["threads"],
        "kv_metric": metrics.value("specd_kv_cache_usage_ratio"),
    }


async def run_soak(
    server: SpecdServer, cycle: CycleText, num_requests: int, concurrency: int = 8, seed: int = 7
) -> SoakReport:
    report = SoakReport(num_requests=num_requests, concurrency=concurrency)
    mix = Mix(seed, cycle)
    warmup = num_requests // 4
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency * 2)
    before = server.wait_idle()
    started = time.perf_counter()
    async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers, timeout=300, limits=limits) as http:

        async def run_range(indices: range) -> None:
            pending = iter(indices)

            async def worker() -> None:
                for index in pending:
                    report.outcomes.append(await run_one(http, server, mix, index))
                    if index % 50 == 0:
                        report.peak_rss = max(report.peak_rss, server.proc_status()["rss"])

            await asyncio.gather(*(worker() for _ in range(concurrency)))

        await run_range(range(warmup))
        report.warm = await asyncio.to_thread(snapshot, server)
        await run_range(range(warmup, num_requests))
    report.seconds = time.perf_counter() - started
    report.end = await asyncio.to_thread(snapshot, server)
    report.kv_usage_end = report.end["kv_metric"]
    after = server.metrics()
    report.finished_counted = {
        reason: after.value("specd_requests_total", finish_reason=reason)
        - before.value("specd_requests_total", finish_reason=reason)
        for reason in ("stop", "length", "abort", "error")
    }
    report.peak_rss = max(report.peak_rss, report.warm["rss"], report.end["rss"])
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="requests in the soak [default: 2000]")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight [default: 8]")
    parser.add_argument("--seed", type=int, default=7, help="seed of the request mix [default: 7]")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="specd-soak-") as tmp:
        root = Path(tmp)
        cycle_dir = build_cycle_model(build_tiny_model(root / "tiny", "llama"), root / "cycle")
        server = SpecdServer(chaos_args(cycle_dir), root / "soak.log", api_key=API_KEY, probe=True)
        try:
            server.wait_ready()
            report = asyncio.run(run_soak(server, CycleText(cycle_dir), args.requests, args.concurrency, args.seed))
        finally:
            finish_server(server)
    tally = Tally()
    report.add_to(tally)
    print(report.table())
    print()
    print(results_table(tally))
    problems = report.problems()
    for problem in problems:
        print(f"FAIL: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
