"""Machinery of the reliability suite and `benchmarks/soak.py`, beside what every suite shares
(tests/support: the cycle model and its oracle `CycleText`, the server process,
started here with `probe=True` for its test-only `GET /_probe`, and /metrics):

- the servers' settings, which tests build their requests from;
- `leaked_bookkeeping`: per-request engine state left in a probe;
- `cut_stream`: a raw-socket streaming client that hangs up at a chosen point;
- `Tally` / `results_table`: the counts that the closing table reports.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.server import serve_args

CYCLE_NAME = "cycle"
API_KEY = "reliability-key"
# The servers of the suite (conftest.py); tests build their requests from these.
INPUT_MODEL = "tiny"
INPUT_MAX_MODEL_LEN = 96
INPUT_MAX_BODY_BYTES = 256 * 1024
CHAOS_MAX_NUM_SEQS = 8
OVERLOAD_MAX_QUEUE = 4
OVERLOAD_MAX_NUM_SEQS = 2


def chaos_args(cycle_model_dir: Path) -> list[str]:
    """The cycle model with fault injection (the API key comes on top): the chaos server and the soak."""
    return serve_args(
        model=cycle_model_dir, served_model_name=CYCLE_NAME, dtype="float32", device="cpu",
        max_num_seqs=CHAOS_MAX_NUM_SEQS, enable_fault_injection=True,
    )  # fmt: skip


# -- leaks ----------------------------------------------------------------------------------


def leaked_bookkeeping(probe: dict) -> dict[str, int]:
    """Per-request engine state that must be empty when nothing runs."""
    keys = (
        "streams", "timings", "requests", "waiting", "running", "aborted", "policy_states", "proposer_states",
        "blocks_in_use", "block_references", "kv_usage",
    )  # fmt: skip
    return {k: probe[k] for k in keys if probe.get(k)}


# -- a client that hangs up ---------------------------------------------------------------


@dataclass
class CutResult:
    events: int = 0  # SSE `data:` lines seen before hanging up
    done: bool = False  # `[DONE]` arrived before the cut point
    status: int | None = None


async def cut_stream(
    port: int,
    path: str,
    body: dict,
    cut: str,
    after_events: int = 0,
    headers: dict[str, str] | None = None,
    reset: bool = False,
) -> CutResult:
    """POST a streaming request over a raw socket and hang up at `cut`:

    "mid_body" (half the body sent), "after_request" (before any reply),
    "after_headers", or "after_events" (after `after_events` SSE events).
    `reset` closes with RST (SO_LINGER 0) instead of FIN.
    """
    payload = json.dumps(body).encode()
    head = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    head += [f"Content-Length: {len(payload)}", "", ""]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    result = CutResult()
    try:
        if cut == "mid_body":
            writer.write("\r\n".join(head).encode() + payload[: len(payload) // 2])
            await writer.drain()
            await asyncio.sleep(0.01)
            return result
        writer.write("\r\n".join(head).encode() + payload)
        await writer.drain()
        if cut == "after_request":
            return result
        status_line = await reader.readline()
        result.status = int(status_line.split()[1]) if status_line else None
        while await reader.readline() not in (b"\r\n", b""):
            pass
        if cut == "after_headers":
            return result
        buffer = b""
        while result.events < after_events:
            chunk = await reader.read(4096)
            if not chunk:
                break
            buffer += chunk
            result.events = buffer.count(b"data: ")
            if b"data: [DONE]" in buffer:
                result.done = True
                break
        return result
    finally:
        if reset:
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            writer.transport.abort()
        else:
            writer.close()
        try:
            await writer.wait_closed()
        except (ConnectionError, OSError):
            pass


def sse_events(text: str) -> list[str]:
    """The payloads of an SSE body's `data:` lines, in order."""
    return [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]


def stream_text(events: list[str]) -> tuple[str, list[str], list[dict]]:
    """(concatenated text, finish reasons, error objects) of a completions or chat stream."""
    text, finishes, errors = "", [], []
    for event in events:
        if event == "[DONE]":
            continue
        chunk = json.loads(event)
        if "error" in chunk:
            errors.append(chunk["error"])
            continue
        for choice in chunk.get("choices", []):
            text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            if choice.get("finish_reason"):
                finishes.append(choice["finish_reason"])
    return text, finishes, errors


# -- results ------------------------------------------------------------------------------


@dataclass
class Tally:
    """What the closing table reports; each test adds its share."""

    cases_tried: int = 0  # bad-input battery cases and property-based examples
    requests_cut: int = 0
    requests_shed: int = 0  # 503 + Retry-After under overload
    faults_injected: int = 0
    requests_lost: int = 0  # neither a correct reply, nor an expected error, nor cut by its client
    memory_growth: float | None = None  # soak RSS growth after warm-up, as a fraction
    notes: dict[str, str] = field(default_factory=dict)


def results_table(tally: Tally) -> str:
    growth = "-" if tally.memory_growth is None else f"{tally.memory_growth * 100:+.2f}%"
    rows = [
        ("cases tried", str(tally.cases_tried)),
        ("requests cut", str(tally.requests_cut)),
        ("requests shed (503)", str(tally.requests_shed)),
        ("faults injected", str(tally.faults_injected)),
        ("requests lost", str(tally.requests_lost)),
        ("memory growth (soak, after warm-up)", growth),
    ]
    rows += sorted(tally.notes.items())
    width = max(len(name) for name, _ in rows)
    lines = [f"| {'measure'.ljust(width)} | value |", f"| {'-' * width} | ----- |"]
    lines += [f"| {name.ljust(width)} | {value} |" for name, value in rows]
    return "\n".join(lines)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = min(len(ordered), max(1, math.ceil(q / 100 * len(ordered))))
    return ordered[rank - 1]
