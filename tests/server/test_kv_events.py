"""KV-cache events (`--kv-events-endpoint`): vLLM's wire format, what the pool reports, and a
live server publishing the blocks a prompt filled."""

from __future__ import annotations

import httpx
import msgpack
import pytest
import zmq

from scheduler.kv_blocks import BlockPool, BlockRemoved, BlockStored, block_key
from server.kv_events import block_hash, encode_batch
from tests.support.server import finish_server, free_port, serve_args, start_server


def test_a_batch_is_vllms_positional_kv_event_batch():
    a, b = block_key(b"root", [1, 2]), block_key(b"x", [3, 4])
    payload = msgpack.unpackb(encode_batch([BlockStored(a, None, (1, 2)), BlockStored(b, a, (3, 4)),
                                            BlockRemoved(a)], 2, 12.5))  # fmt: skip
    timestamp, events, rank = payload
    assert (timestamp, rank) == (12.5, None)
    assert events == [
        ["BlockStored", [block_hash(a)], None, [1, 2], 2, None, "GPU"],
        ["BlockStored", [block_hash(b)], block_hash(a), [3, 4], 2, None, "GPU"],
        ["BlockRemoved", [block_hash(a)], "GPU"],
    ]
    assert 0 <= block_hash(a) < 2**64


def test_the_pool_reports_blocks_stored_and_evicted_only_when_listened_to():
    pool = BlockPool(num_blocks=2, block_size=2)
    (x,) = pool.allocate(1)
    pool.cache(x, b"k1", None, [1, 2])
    assert pool.drain_events() == []  # nobody listens: nothing kept
    pool.events = []
    (y,) = pool.allocate(1)
    pool.cache(y, b"k2", b"k1", [3, 4])
    pool.release([x, y])
    pool.allocate(2)  # both cached blocks are evicted
    # release queues a sequence's tail first, so its later block is evicted first
    assert pool.drain_events() == [BlockStored(b"k2", b"k1", (3, 4)), BlockRemoved(b"k2"), BlockRemoved(b"k1")]
    assert pool.drain_events() == []


@pytest.fixture(scope="module")
def publishing(tiny_llama_dir, tmp_path_factory):
    port = free_port()
    args = serve_args(model=tiny_llama_dir, served_model_name="m", dtype="float32", device="cpu", block_size=16,
                      kv_events_endpoint=f"tcp://127.0.0.1:{port}", kv_events_topic="kv@test")  # fmt: skip
    server = start_server(args, tmp_path_factory.mktemp("kv-events"), "kv-events")
    yield server, port
    finish_server(server)


def test_a_served_prompt_publishes_its_full_blocks_chained(publishing):
    server, port = publishing
    socket = zmq.Context.instance().socket(zmq.SUB)
    socket.connect(f"tcp://127.0.0.1:{port}")
    socket.setsockopt(zmq.SUBSCRIBE, b"kv@")
    socket.setsockopt(zmq.RCVTIMEO, 10_000)
    try:
        prompt = "one two three four five six seven eight nine ten " * 6
        ids = httpx.post(server.base_url + "/completions/render", json={"model": "m", "prompt": prompt}).json()
        ids = ids[0]["token_ids"]
        stored = []
        for _attempt in range(20):  # a slow joiner may miss the first requests' events: send until seen
            httpx.post(server.base_url + "/completions", json={"model": "m", "prompt": prompt, "max_tokens": 2,
                                                              "cache_salt": f"try-{_attempt}"}, timeout=30)  # fmt: skip
            try:
                topic, sequence, payload = socket.recv_multipart()
            except zmq.Again:
                continue
            _, events, _ = msgpack.unpackb(payload)
            stored = [e for e in events if e[0] == "BlockStored"]
            if stored:
                break
        assert topic == b"kv@test" and len(sequence) == 8
        assert len(stored) == len(ids) // 16  # every full prompt block, the partial one not
        assert [e[3] for e in stored] == [ids[i * 16 : (i + 1) * 16] for i in range(len(stored))]
        assert stored[0][2] is None and all(e[2] == p[1][0] for p, e in zip(stored, stored[1:]))
        assert all(e[4] == 16 for e in stored)
    finally:
        socket.close(linger=0)
