"""specd replicas behind vllm-router (real processes): cache-aware routing keeps a conversation on
the replica that holds its prefix, every replica speaks the model-server protocol routers scrape,
and a replica killed mid-run costs only its own streams.

Runs wherever vllm-router is installed (`make router`, as `make test` and CI do).
"""

from __future__ import annotations

import json
import threading
import time
import uuid

import httpx
import pytest

from tests.support.router import completed_requests, router_binary, start_replicas, start_router
from tests.support.server import serve_args

ROUTER = router_binary()
pytestmark = pytest.mark.skipif(ROUTER is None, reason="vllm-router is not installed (make router)")


@pytest.fixture
def replicas(tiny_llama_dir, tmp_path):
    args = serve_args(model=tiny_llama_dir, served_model_name="m", dtype="float32", device="cpu", max_num_seqs=4)
    started = start_replicas(args, tmp_path, [None, None])
    yield started
    for replica in started:
        replica.kill()


def completion(url: str, prompt: str, **fields) -> httpx.Response:
    body = {"model": "m", "prompt": prompt, "max_tokens": 4, "temperature": 0, **fields}
    return httpx.post(url + "/v1/completions", json=body, timeout=30, trust_env=False)


def served(replica) -> float:
    return completed_requests(replica.metrics())


def test_cache_aware_routing_keeps_a_prefix_on_one_replica(replicas, tmp_path):
    assert ROUTER is not None
    router = start_router(replicas, "cache_aware", tmp_path, ROUTER)
    try:
        system = f"Conversation {uuid.uuid4().hex}. " + "Answer briefly and keep to the facts. " * 8
        cached = [completion(router.url, system + f"Question {i}?").json()["usage"] for i in range(6)]
    finally:
        router.stop()
    # One replica served all six, and from the second on the shared prefix was in its cache.
    assert sorted(served(r) for r in replicas) == [0, 6]
    assert cached[0]["prompt_tokens_details"]["cached_tokens"] == 0
    assert all(u["prompt_tokens_details"]["cached_tokens"] > 0 for u in cached[1:])


def test_every_replica_exposes_the_protocol_gauges(replicas):
    for replica in replicas:
        metrics = replica.metrics()
        assert metrics.value("vllm:num_requests_waiting", model_name="m") == 0
        assert metrics.value("vllm:num_requests_running", model_name="m") == 0
        assert metrics.value("vllm:kv_cache_usage_perc", model_name="m") == 0


def test_a_killed_replica_cuts_only_its_streams_and_new_requests_go_to_the_other(replicas, tmp_path):
    assert ROUTER is not None
    router = start_router(replicas, "round_robin", tmp_path, ROUTER)
    streams: list[dict] = [{"events": [], "done": False, "finish": None, "error": None} for _ in range(2)]
    started = [threading.Event() for _ in streams]

    def stream(i: int) -> None:
        body = {"model": "m", "prompt": f"Stream {i}", "max_tokens": 480, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=30) as reply:
                for line in reply.iter_lines():
                    if line == "data: [DONE]":
                        streams[i]["done"] = True
                    elif line.startswith("data: {"):
                        event = json.loads(line.removeprefix("data: "))
                        if "error" in event:
                            streams[i]["error"] = event["error"]
                        else:
                            for choice in event["choices"]:
                                streams[i]["finish"] = choice.get("finish_reason") or streams[i]["finish"]
                        started[i].set()
        except httpx.HTTPError as exc:  # the connection cut: also a clean end for the client
            streams[i]["error"] = repr(exc)
        finally:
            started[i].set()

    try:
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        assert all(event.wait(30) for event in started)
        victim, survivor = replicas[1], replicas[0]
        victim.kill()  # SIGKILL mid-stream
        for thread in threads:
            thread.join(30)
            assert not thread.is_alive(), "a stream hung after its replica died"
        finished = [s for s in streams if s["done"] and s["finish"] == "length"]
        cut = [s for s in streams if not s["done"]]
        # The survivor's stream ended whole; the victim's ended without [DONE] and without a
        # finish_reason (the router closes it), which is how a client tells a cut stream.
        assert len(finished) == 1 and len(cut) == 1 and cut[0]["finish"] is None, streams
        # New requests all reach the survivor, none hangs.
        before = served(survivor)
        for i in range(6):
            start = time.monotonic()
            reply = completion(router.url, f"after the kill {i}")
            assert reply.status_code == 200, reply.text
            assert time.monotonic() - start < 10
        assert served(survivor) == before + 6
    finally:
        router.stop()
