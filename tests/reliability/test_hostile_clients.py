"""Hostile clients beside honest ones: every bad or oversized request of the bad-input battery
(and more) is answered with a clean OpenAI error in under a second while 8 honest greedy
streams run; the streams keep their pace (an attacked round's median TPOT against the quiet
rounds on either side of it: the median of those ratios within 1.2x), end with
the text they get alone, and /health answers: 99% of probes in under 100 ms in both phases, every
probe in under a second (the liveness probe's timeout is 5 s). The slowest single probe is not
the measure: on a shared 2-core CI machine a quiet phase alone once saw 302 ms.

Timing-sensitive, so marked `slow` (make test runs it in its own step); figures are
printed in the suite's closing table and kept in docs/reliability.md.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest

from tests.reliability.rel_harness import INPUT_MAX_BODY_BYTES, INPUT_MAX_MODEL_LEN, INPUT_MODEL
from tests.reliability.test_bad_input import CASES, Case, chunked_oversize
from tests.support.server import finish_server, serve_args, start_server

pytestmark = pytest.mark.slow

HONEST_STREAMS = 8
HONEST_ROUNDS = 4  # attacked rounds, each between two quiet ones
HONEST_PROMPTS = [f"Story {i}: once upon a time" for i in range(HONEST_STREAMS)]
MAX_TPOT_RATIO = 1.2
MAX_ERROR_SECONDS = 1.0
MAX_HEALTH_P99_SECONDS = 0.1
MAX_HEALTH_SECONDS = 1.0
# One hostile client, one request at a time, 40 a second: malice, not a flood. A flood at full
# speed is a rate limit's job (the proxy in front; docs/security.md): unpaced, this client sent
# ~470 requests/s into a 2-core machine and the streams' TPOT rose 2.3x.
HOSTILE_GAP_S = 0.025


@pytest.fixture(scope="module")
def hostile_server(specd_cache_dir, tmp_path_factory):
    """The bundled SmolLM2 (steps that cost what a served model's cost) with the battery's limits. Dense
    float32 weights: "nothing changed" compares texts across batch compositions, and quantized layers'
    int8 rounding of their rows can flip a greedy near-tie between compositions (docs/determinism.md)."""
    args = serve_args(
        cache_dir=specd_cache_dir, served_model_name=INPUT_MODEL, dtype="float32", weights="bf16",
        max_num_seqs=HONEST_STREAMS, max_model_len=INPUT_MAX_MODEL_LEN, max_body_bytes=INPUT_MAX_BODY_BYTES,
    )  # fmt: skip
    server = start_server(args, tmp_path_factory.mktemp("hostile"), "hostile")
    yield server
    finish_server(server)


def encoded(case: Case) -> tuple[bytes, dict[str, str]]:
    """The case's request as bytes, made before the clock starts (the chunked one: the same bytes,
    sent with a length; the battery sends it chunked)."""
    if case.name == "body-over-limit-chunked":
        return b"".join(chunked_oversize()), case.headers
    return case.raw if case.raw is not None else json.dumps(case.json).encode(), case.headers


def honest_body(prompt: str) -> dict:
    return {"model": INPUT_MODEL, "prompt": prompt, "max_tokens": INPUT_MAX_MODEL_LEN - 16, "temperature": 0,
            "ignore_eos": True, "stream": True, "speculation": False}  # fmt: skip


async def honest_round(server) -> tuple[list[str], list[float]]:
    """8 streams at once: each one's text and its time per output token after the first."""

    async def one(http: httpx.AsyncClient, prompt: str) -> tuple[str, float]:
        stamps, text = [], ""
        async with http.stream("POST", "/v1/completions", json=honest_body(prompt)) as reply:
            assert reply.status_code == 200
            async for line in reply.aiter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line.removeprefix("data: "))["choices"][0]["text"]
                    stamps.append(time.perf_counter())
        return text, (stamps[-1] - stamps[0]) / (len(stamps) - 1)

    async with httpx.AsyncClient(base_url=server.url, timeout=120, trust_env=False) as http:
        results = await asyncio.gather(*(one(http, p) for p in HONEST_PROMPTS))
    return [t for t, _ in results], [s for _, s in results]


@dataclass
class Hostility:
    """A hostile client (sending while `attacking` is set) and a health prober, each on its
    own thread until `stop`; every measure is filed under the phase it was taken in."""

    server: object
    cases: list[Case]
    attacking: threading.Event = field(default_factory=threading.Event)
    stop: threading.Event = field(default_factory=threading.Event)
    errors: list[tuple[str, int, float, dict]] = field(default_factory=list)  # (case, status, seconds, body)
    health: dict[bool, list[float]] = field(default_factory=lambda: {False: [], True: []})
    passes: int = 0

    def attack(self) -> None:
        requests = [(case, *encoded(case)) for case in self.cases]
        with httpx.Client(base_url=self.server.url, timeout=30, trust_env=False) as http:
            while not self.stop.is_set():
                for case, content, headers in requests:
                    while not self.attacking.wait(0.05):
                        if self.stop.is_set():
                            return
                    start = time.perf_counter()
                    reply = http.post(case.path, content=content, headers=headers)
                    seconds = time.perf_counter() - start
                    self.errors.append((case.name, reply.status_code, seconds, _json(reply)))
                    time.sleep(HOSTILE_GAP_S)
                self.passes += 1

    def probe(self) -> None:
        with httpx.Client(base_url=self.server.url, timeout=30, trust_env=False) as http:
            while not self.stop.is_set():
                phase = self.attacking.is_set()
                start = time.perf_counter()
                assert http.get("/health").status_code == 200
                self.health[phase and self.attacking.is_set()].append(time.perf_counter() - start)
                time.sleep(0.02)


def _json(reply: httpx.Response) -> dict:
    try:
        return reply.json()
    except ValueError:
        return {}


async def test_hostile_clients_get_clean_errors_while_honest_streams_keep_pace(hostile_server, tally):
    bad = [c for c in CASES if c.status >= 400]
    assert len(bad) >= 60
    (alone, _) = await honest_round(hostile_server)  # also the warm-up
    hostility = Hostility(hostile_server, bad)
    threads = [threading.Thread(target=hostility.attack), threading.Thread(target=hostility.probe)]
    for thread in threads:
        thread.start()
    # Quiet and attacked rounds alternate, quiet first and last (Q A Q A ... Q): each attacked
    # round is set against the mean of the quiet rounds on either side of it, so the machine's
    # own drift (±12% between quiet rounds on a shared 2-core machine) cancels within a pair.
    rounds: list[tuple[bool, float]] = []  # (attacked, the round's median TPOT)
    try:
        under_attack = False
        while True:
            if under_attack:
                hostility.attacking.set()
            texts, seconds = await honest_round(hostile_server)
            hostility.attacking.clear()
            assert texts == alone  # nothing lost, nothing changed
            rounds.append((under_attack, statistics.median(seconds)))
            done = sum(a for a, _ in rounds) >= HONEST_ROUNDS and hostility.passes > 0
            if done and not under_attack:
                break
            under_attack = not under_attack
    finally:
        hostility.stop.set()
        for thread in threads:
            thread.join(60)

    expected = {c.name: c for c in bad}
    for name, status, seconds, body in hostility.errors:
        case = expected[name]
        assert status == case.status, (name, status, body)
        assert set(body) == {"error"} and body["error"]["message"], (name, body)
        assert seconds < MAX_ERROR_SECONDS, (name, seconds)
    ratios = [rounds[i][1] / statistics.mean((rounds[i - 1][1], rounds[i + 1][1])) for i in range(1, len(rounds), 2)]
    quiet = statistics.median(t for a, t in rounds if not a)
    attacked = statistics.median(t for a, t in rounds if a)
    slowest_error = max(seconds for _, _, seconds, _ in hostility.errors)
    tally.cases_tried += len(hostility.errors)
    tally.notes["hostile: bad requests (kinds)"] = f"{len(hostility.errors)} ({len(bad)})"
    tally.notes["hostile: slowest error"] = f"{slowest_error * 1000:.0f} ms"
    tally.notes["hostile: median TPOT, attacked / quiet"] = (
        f"{attacked * 1000:.1f} / {quiet * 1000:.1f} ms (paired: {statistics.median(ratios):.2f}x; "
        f"{min(ratios):.2f}-{max(ratios):.2f}x over {len(ratios)} pairs)"
    )
    p99 = {phase: statistics.quantiles(times, n=100)[98] for phase, times in hostility.health.items()}
    tally.notes["hostile: /health p99, attacked / quiet"] = (
        f"{p99[True] * 1000:.0f} / {p99[False] * 1000:.0f} ms ({sum(map(len, hostility.health.values()))} probes)"
    )
    slowest_health = max(max(hostility.health[True]), max(hostility.health[False]))
    tally.notes["hostile: slowest /health"] = f"{slowest_health * 1000:.0f} ms"
    assert statistics.median(ratios) <= MAX_TPOT_RATIO, ratios
    assert max(p99.values()) < MAX_HEALTH_P99_SECONDS
    assert slowest_health < MAX_HEALTH_SECONDS
