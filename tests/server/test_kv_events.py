"""KV-cache events (`--kv-events-endpoint`): vLLM's wire format, what the pool reports, and a
live server publishing the blocks a prompt filled."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import msgpack
import pytest
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from scheduler.kv_blocks import BlockPool, BlockRemoved, BlockStored, block_key
from server.config import Settings
from server.kv_events import KVEventPublisher, block_hash, encode_batch
from server.zmq_curve import CurveError, CurveKeys
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


# -- who receives them ----------------------------------------------------------------------


def receive(socket, publisher: KVEventPublisher, tries: int = 30) -> list[bytes] | None:
    """Publish until `socket` gets a message (a PUB drops what it sends before a peer joins)."""
    for _ in range(tries):
        publisher.publish([BlockStored(b"k" * 8, None, (1, 2))])
        try:
            return socket.recv_multipart()
        except zmq.Again:
            continue
    return None


def subscriber(context, endpoint: str, keys: tuple[bytes, bytes] | None = None, server_key: bytes | None = None):
    socket = context.socket(zmq.SUB)
    if keys is not None:
        socket.curve_publickey, socket.curve_secretkey = keys
        socket.curve_serverkey = server_key
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    socket.setsockopt(zmq.RCVTIMEO, 100)
    socket.connect(endpoint)
    return socket


@pytest.fixture
def certificates(tmp_path):
    """specd's key pair, one authorized subscriber's, and a stranger's."""
    authorized = tmp_path / "authorized"
    authorized.mkdir()
    public, secret = zmq.auth.create_certificates(str(tmp_path), "specd")
    os.chmod(secret, 0o600)
    sub_public, sub_secret = zmq.auth.create_certificates(str(tmp_path), "router")
    shutil.copy(sub_public, authorized)
    zmq.auth.create_certificates(str(tmp_path), "stranger")
    load = zmq.auth.load_certificate
    return {"secret": Path(secret), "authorized": authorized, "specd": load(public)[0], "router": load(sub_secret),
            "stranger": load(str(tmp_path / "stranger.key_secret"))}  # fmt: skip


def test_the_mode_is_explicit_not_guessed_from_the_address():
    """`localhost` used to mean connect (to whatever listened there): bind is what was asked for."""
    endpoint = f"tcp://localhost:{free_port()}"
    publisher = KVEventPublisher(endpoint, "kv", 2, mode="bind")
    context = zmq.Context()
    socket = subscriber(context, endpoint.replace("localhost", "127.0.0.1"))
    try:
        assert receive(socket, publisher) is not None
    finally:
        socket.close(linger=0)
        publisher.close()
        context.term()


@pytest.mark.parametrize("endpoint", ["tcp://*:5557", "tcp://0.0.0.0:5557", "tcp://10.0.0.7:5557", "tcp://router:5557"])
def test_events_beyond_loopback_need_curve_keys(endpoint):
    with pytest.raises(ValueError, match="CURVE keys"):
        Settings(model="unused", kv_events_endpoint=endpoint)
    with pytest.raises(CurveError):
        KVEventPublisher(endpoint, "kv", 2)
    for local in ("tcp://127.0.0.1:5557", "tcp://localhost:5557", "tcp://[::1]:5557", "ipc:///run/kv.sock"):
        Settings(model="unused", kv_events_endpoint=local)


def test_curve_admits_only_the_listed_subscribers(certificates):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    keys = CurveKeys(certificates["secret"], certificates["authorized"])
    publisher = KVEventPublisher(endpoint, "kv", 2, mode="bind", keys=keys)
    context = zmq.Context()
    listed = subscriber(context, endpoint, certificates["router"], certificates["specd"])
    stranger = subscriber(context, endpoint, certificates["stranger"], certificates["specd"])
    plain = subscriber(context, endpoint)
    try:
        assert receive(listed, publisher) is not None
        for socket in (stranger, plain):
            assert receive(socket, publisher, tries=10) is None
    finally:
        for socket in (listed, stranger, plain):
            socket.close(linger=0)
        publisher.close()
        context.term()


def test_curve_in_connect_mode_reaches_only_the_named_listener(certificates, tmp_path):
    """connect: specd is the CURVE client of a listener whose public key it was given."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    context = zmq.Context()
    authenticator = ThreadAuthenticator(context)
    authenticator.start()
    specd_public = tmp_path / "authorized-specd"
    specd_public.mkdir()
    shutil.copy(tmp_path / "specd.key", specd_public)
    authenticator.configure_curve(domain="*", location=str(specd_public))
    listener = context.socket(zmq.SUB)
    listener.curve_publickey, listener.curve_secretkey = certificates["router"]
    listener.curve_server = True
    listener.setsockopt(zmq.SUBSCRIBE, b"")
    listener.setsockopt(zmq.RCVTIMEO, 100)
    listener.bind(endpoint)
    publisher = KVEventPublisher(
        endpoint, "kv", 2, mode="connect", keys=CurveKeys(certificates["secret"], tmp_path / "router.key")
    )
    try:
        assert receive(listener, publisher) is not None
    finally:
        listener.close(linger=0)
        publisher.close()
        authenticator.stop()
        context.term()


def test_a_secret_key_others_can_read_is_refused(certificates):
    os.chmod(certificates["secret"], 0o644)
    with pytest.raises(CurveError, match="readable or writable by group or others"):
        CurveKeys(certificates["secret"], certificates["authorized"]).check("bind")
