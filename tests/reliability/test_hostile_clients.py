"""Hostile clients beside honest ones: every bad or oversized request of the bad-input battery
(and more) is answered with a clean OpenAI error in under a second while 8 honest greedy
streams run; the streams keep their pace (an attacked round's median TPOT against the quiet
rounds on either side of it: the median of those ratios within 1.2x), end with
the text they get alone, and /health answers: 99% of probes in under 100 ms in both phases, every
probe in under a second (the liveness probe's timeout is 5 s). The slowest single probe is not
the measure: on a shared 2-core CI machine a quiet phase alone once saw 302 ms.

The server runs at the shipped limits (4 MiB bodies, a 2,048-token context, a preparation queue
of 64), with two tenants: the honest streams hold one key, the hostile client another. Besides
the battery (every size-bound case scaled to those limits: ~1.4M-prompt renders, ~2M-id
prompts, bodies of a million lists), the hostile tenant floods the preparation queue once an
attacked round with more renders than it holds; each gets its tokens or a 503 with
Retry-After, while an honest tenant's render sent in the middle of the flood is served in its
turn, in under a second (the hostile tenant's own battery requests may meet its flood: 503
`queue_full`, counted).

The hostile client and the /health prober each run in a process of their own, as they would on
other machines: in this process, encoding the battery's 4 MiB bodies and sending them held its
GIL, and the probes and the honest streams' clocks read the client's stalls as the server's.

Timing-sensitive, so marked `slow` (make test runs it in its own step); figures are
printed in the suite's closing table and kept in docs/reliability.md.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import queue
import statistics
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from server.config import DEFAULT_MAX_MODEL_LEN, Settings
from tests.reliability.rel_harness import INPUT_MODEL
from tests.reliability.test_bad_input import FIXED_CASES, Case, chunked_oversize, sized_cases
from tests.reliability.test_bad_input import encoded as encoded_json
from tests.support.server import finish_server, serve_args, start_server

pytestmark = pytest.mark.slow

MAX_BODY_BYTES = Settings.model_fields["max_body_bytes"].default
MAX_PREP_QUEUE = Settings.model_fields["max_prep_queue"].default
CASES = [*FIXED_CASES, *sized_cases(DEFAULT_MAX_MODEL_LEN, MAX_BODY_BYTES)]
HONEST_KEY, HOSTILE_KEY = "honest-tenant-key", "hostile-tenant-key"
HOSTILE = {"Authorization": f"Bearer {HOSTILE_KEY}"}
# The flood: more renders at once than the preparation queue holds, each a short prompt (~3 ms of
# the preparation thread: renders of 128 long prompts each kept it busy for a minute a flood, and
# the honest streams with it, since the thread holds the GIL; a flood at full cost is a rate
# limit's job, docs/security.md).
FLOOD_REQUESTS = MAX_PREP_QUEUE + 16
FLOOD_BODY = {"model": INPUT_MODEL, "prompt": "flood " + "word " * 40}
HONEST_RENDER = {"model": INPUT_MODEL, "prompt": "an honest tenant's render"}
HONEST_TOKENS = 64
HONEST_STREAMS = 8
HONEST_ROUNDS = 5  # attacked rounds, each between two quiet ones: an odd count has a middle pair
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
    """The bundled SmolLM2 (steps that cost what a served model's cost) at the shipped limits, with
    two tenants: the honest one (`server.headers`) and the hostile one (`HOSTILE`). Dense float32
    weights: "nothing changed" compares texts across batch compositions, and quantized layers' int8
    rounding of their rows can flip a greedy near-tie between compositions (docs/determinism.md)."""
    logs = tmp_path_factory.mktemp("hostile")
    keys = logs / "keys"
    keys.write_text(f"hostile {HOSTILE_KEY}\n")
    keys.chmod(0o600)  # the server refuses a keys file others may read
    args = serve_args(
        cache_dir=specd_cache_dir, served_model_name=INPUT_MODEL, dtype="float32", weights="bf16",
        max_num_seqs=HONEST_STREAMS, api_keys=keys,
    )  # fmt: skip
    server = start_server(args, logs, "hostile", api_key=HONEST_KEY)
    yield server
    finish_server(server)


def encoded(case: Case) -> tuple[bytes, dict[str, str]]:
    """The case's request as bytes, made before the clock starts (the chunked one: the same bytes,
    sent with a length; the battery sends it chunked), under the hostile tenant's key."""
    if case.name == "body-over-limit-chunked":
        return b"".join(chunked_oversize(MAX_BODY_BYTES)), case.headers | HOSTILE
    return encoded_json(case), case.headers | HOSTILE


def honest_body(prompt: str) -> dict:
    return {"model": INPUT_MODEL, "prompt": prompt, "max_tokens": HONEST_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True, "speculation": False}  # fmt: skip


async def honest_round(server) -> tuple[list[str], list[float]]:
    """8 streams at once: each one's text and its time per output token after the first."""

    async def one(http: httpx.AsyncClient, prompt: str) -> tuple[str, float]:
        stamps, text = [], ""
        async with http.stream("POST", "/v1/completions", json=honest_body(prompt), headers=server.headers) as reply:
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
    """The hostile tenant (its battery, and a preparation flood once an attacked round) and a
    health prober, each in its own process, sending while `attacking` is set until `stop`; every
    measure is filed under the phase it was taken in."""

    url: str
    honest_headers: dict[str, str]
    context = multiprocessing.get_context("spawn")  # no forked copy of this process's threads
    attacking: Any = field(default_factory=context.Event)
    stop: Any = field(default_factory=context.Event)
    results: Any = field(default_factory=context.Queue)
    passes: Any = field(default_factory=lambda: Hostility.context.Value("i", 0))  # whole battery passes
    processes: list[Any] = field(default_factory=list)

    def start(self) -> None:
        """Both processes, once each is ready (the battery encoded; the prober's first probe sent)."""
        events = (self.attacking, self.stop, self.results)
        ready = [self.context.Event(), self.context.Event()]
        self.processes = [
            self.context.Process(target=attack, args=(self.url, self.honest_headers, ready[0], self.passes, *events),
                                 daemon=True),
            self.context.Process(target=probe, args=(self.url, ready[1], *events), daemon=True),
        ]  # fmt: skip
        for process in self.processes:
            process.start()
        started = time.monotonic()
        for event, process in zip(ready, self.processes):
            while not event.wait(0.5):
                assert process.is_alive() and time.monotonic() < started + 120, f"{process.name} did not start"

    def alive(self) -> bool:
        return all(process.is_alive() for process in self.processes)

    def finish(self) -> tuple[dict, dict]:
        """Stop both; (the hostile client's results, the prober's). A process that failed sends
        its traceback instead, which fails the test with it."""
        self.stop.set()
        found: dict[str, Any] = {}
        deadline = time.monotonic() + 120
        while len(found) < len(self.processes) and time.monotonic() < deadline:
            try:
                name, value = self.results.get(timeout=1)
            except queue.Empty:
                if not any(p.is_alive() for p in self.processes) and self.results.empty():
                    break
                continue
            found[name] = value
        for process in self.processes:
            process.join(10)
            if process.is_alive():
                process.terminate()
        for name, value in found.items():
            assert not isinstance(value, str), f"the {name} process failed:\n{value}"
        assert set(found) == {"attack", "probe"}, f"results from {sorted(found)} only"
        return found["attack"], found["probe"]


def reporting(name: str, results, body) -> None:
    """`body()`'s result to `results` under `name`, or its traceback where it raised."""
    try:
        value = body()
    except BaseException:
        results.put((name, traceback.format_exc()))
        raise
    results.put((name, value))


def attack(url: str, honest_headers: dict, ready, passes, attacking, stop, results) -> None:
    reporting("attack", results, lambda: _attack(url, honest_headers, ready, passes, attacking, stop))


def _attack(url: str, honest_headers: dict, ready, passes, attacking, stop) -> dict:
    """The battery, one request at a time, and one preparation flood per attacked round."""
    bad = [c for c in CASES if c.status >= 400]
    requests = [(case, *encoded(case)) for case in bad]
    errors: list[tuple[str, int, float, dict]] = []  # (case, status, seconds, body)
    floods: list[Flood] = []
    flood_errors: list[str] = []

    def flooder() -> None:
        flooded = False
        while not stop.wait(0.05):
            if not attacking.is_set():
                flooded = False
            elif not flooded:
                try:
                    floods.append(asyncio.run(flood(url, honest_headers)))
                except Exception:  # noqa: BLE001 - reported with the results: the test fails on it
                    flood_errors.append(traceback.format_exc())
                flooded = True

    thread = threading.Thread(target=flooder)
    thread.start()
    ready.set()
    with httpx.Client(base_url=url, timeout=30, trust_env=False) as http:
        while not stop.is_set():
            for case, content, headers in requests:
                while not attacking.wait(0.05):
                    if stop.is_set():
                        break
                if stop.is_set():
                    break
                start = time.perf_counter()
                reply = http.post(case.path, content=content, headers=headers)
                errors.append((case.name, reply.status_code, time.perf_counter() - start, _json(reply)))
                time.sleep(HOSTILE_GAP_S)
            else:
                passes.value += 1
    thread.join(60)
    return {"errors": errors, "floods": floods, "flood_errors": flood_errors, "kinds": len(bad)}


def probe(url: str, ready, attacking, stop, results) -> None:
    reporting("probe", results, lambda: _probe(url, ready, attacking, stop))


def _probe(url: str, ready, attacking, stop) -> dict[bool, list[float]]:
    """GET /health every 20 ms: each probe's seconds, by phase (attacked or quiet); a probe that
    fails (an error status, no answer in 30 s) counts as infinitely slow."""
    health: dict[bool, list[float]] = {False: [], True: []}
    with httpx.Client(base_url=url, timeout=30, trust_env=False) as http:
        while not stop.is_set():
            phase = attacking.is_set()
            start = time.perf_counter()
            try:
                ok = http.get("/health").status_code == 200
            except httpx.HTTPError:
                ok = False
            health[phase and attacking.is_set()].append(time.perf_counter() - start if ok else float("inf"))
            ready.set()
            time.sleep(0.02)
    return health


@dataclass
class Flood:
    statuses: list[int]  # the hostile renders': 200 or 503
    bad_sheds: list[str]  # a 503 without Retry-After or code queue_full
    honest_status: int
    honest_seconds: float


async def flood(url: str, honest_headers: dict[str, str]) -> Flood:
    body = json.dumps(FLOOD_BODY).encode()
    headers = {"content-type": "application/json"} | HOSTILE
    limits = httpx.Limits(max_connections=FLOOD_REQUESTS + 1)
    async with httpx.AsyncClient(base_url=url, timeout=60, trust_env=False, limits=limits) as http:

        async def hostile() -> httpx.Response:
            return await http.post("/v1/completions/render", content=body, headers=headers)

        async def honest() -> tuple[int, float]:
            await asyncio.sleep(0.05)  # once the flood has filled the queue
            start = time.perf_counter()
            reply = await http.post("/v1/completions/render", json=HONEST_RENDER, headers=honest_headers)
            return reply.status_code, time.perf_counter() - start

        *replies, (status, seconds) = await asyncio.gather(*(hostile() for _ in range(FLOOD_REQUESTS)), honest())
    bad = [
        r.text[:200]
        for r in replies
        if r.status_code == 503 and (r.headers.get("retry-after") != "1" or r.json()["error"]["code"] != "queue_full")
    ]
    return Flood([r.status_code for r in replies], bad, status, seconds)


def _json(reply: httpx.Response) -> dict:
    try:
        return reply.json()
    except ValueError:
        return {}


async def test_hostile_clients_get_clean_errors_while_honest_streams_keep_pace(hostile_server, tally):
    assert sum(c.status >= 400 for c in CASES) >= 60
    render = await asyncio.to_thread(
        httpx.post, hostile_server.url + "/v1/completions/render", json=FLOOD_BODY, headers=HOSTILE, timeout=60
    )
    assert render.status_code == 200 and len(render.json()) == 1  # the flood's renders succeed when served
    (alone, _) = await honest_round(hostile_server)  # also the warm-up
    hostility = Hostility(hostile_server.url, hostile_server.headers)
    # Quiet and attacked rounds alternate, quiet first and last (Q A Q A ... Q): each attacked
    # round is set against the mean of the quiet rounds on either side of it, so the machine's
    # own drift (±12% between quiet rounds on a shared 2-core machine) cancels within a pair.
    rounds: list[tuple[bool, float]] = []  # (attacked, the round's median TPOT)
    try:
        hostility.start()
        under_attack = False
        while True:
            assert hostility.alive(), "a hostile-client process exited"
            assert len(rounds) <= 4 * HONEST_ROUNDS, "the battery never finished a pass"
            if under_attack:
                hostility.attacking.set()
            texts, seconds = await honest_round(hostile_server)
            hostility.attacking.clear()
            assert texts == alone  # nothing lost, nothing changed
            rounds.append((under_attack, statistics.median(seconds)))
            done = sum(a for a, _ in rounds) >= HONEST_ROUNDS and hostility.passes.value > 0
            if done and not under_attack:
                break
            under_attack = not under_attack
    finally:
        attacker, health = hostility.finish()

    expected = {c.name: c for c in CASES}
    errors, floods = attacker["errors"], attacker["floods"]
    shed_own = 0  # the hostile tenant's own requests shed while its flood filled the preparation queue
    for name, status, seconds, body in errors:
        case = expected[name]
        if status == 503 and body.get("error", {}).get("code") == "queue_full":
            shed_own += 1
        else:
            assert status == case.status, (name, status, body)
        assert set(body) == {"error"} and body["error"]["message"], (name, body)
        assert seconds < MAX_ERROR_SECONDS, (name, seconds)
    ratios = [rounds[i][1] / statistics.mean((rounds[i - 1][1], rounds[i + 1][1])) for i in range(1, len(rounds), 2)]
    quiet = statistics.median(t for a, t in rounds if not a)
    attacked = statistics.median(t for a, t in rounds if a)
    slowest_error = max(seconds for _, _, seconds, _ in errors)
    tally.cases_tried += len(errors)
    tally.notes["hostile: bad requests (kinds)"] = f"{len(errors)} ({attacker['kinds']})"
    tally.notes["hostile: slowest error"] = f"{slowest_error * 1000:.0f} ms"
    tally.notes["hostile: battery requests shed by the hostile tenant's own flood"] = str(shed_own)
    filling = {}
    for name, _, seconds, _ in errors:
        if name.endswith("filling-the-body"):
            filling[name] = max(seconds, filling.get(name, 0.0))
    tally.notes["hostile: slowest body of a million values"] = ", ".join(
        f"{name.removesuffix('-filling-the-body')} {seconds * 1000:.0f} ms" for name, seconds in sorted(filling.items())
    )
    tally.notes["hostile: median TPOT, attacked / quiet"] = (
        f"{attacked * 1000:.1f} / {quiet * 1000:.1f} ms (paired: {statistics.median(ratios):.2f}x; "
        f"{min(ratios):.2f}-{max(ratios):.2f}x over {len(ratios)} pairs)"
    )
    p99 = {phase: statistics.quantiles(times, n=100)[98] for phase, times in health.items()}
    tally.notes["hostile: /health p99, attacked / quiet"] = (
        f"{p99[True] * 1000:.0f} / {p99[False] * 1000:.0f} ms ({sum(map(len, health.values()))} probes)"
    )
    slowest_health = max(max(health[True]), max(health[False]))
    tally.notes["hostile: slowest /health"] = f"{slowest_health * 1000:.0f} ms"
    shed = sum(f.statuses.count(503) for f in floods)
    tally.requests_shed += shed
    tally.notes["hostile: preparation floods, renders served / shed"] = (
        f"{sum(f.statuses.count(200) for f in floods)} / {shed} ({len(floods)} floods of {FLOOD_REQUESTS}); "
        f"honest render in the flood: slowest {max(f.honest_seconds for f in floods) * 1000:.0f} ms"
    )
    assert not attacker["flood_errors"], attacker["flood_errors"][0]
    assert len(floods) >= HONEST_ROUNDS  # one an attacked round
    for f in floods:
        assert set(f.statuses) <= {200, 503} and not f.bad_sheds, (f.statuses, f.bad_sheds)
        assert f.honest_status == 200 and f.honest_seconds < MAX_ERROR_SECONDS, f
    assert statistics.median(ratios) <= MAX_TPOT_RATIO, ratios
    assert max(p99.values()) < MAX_HEALTH_P99_SECONDS
    assert slowest_health < MAX_HEALTH_SECONDS
