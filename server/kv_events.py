"""KV-cache events, published as vLLM publishes them, for routers that score replicas by the
exact blocks each one holds (llm-d's precise prefix scorer, vllm-router's `kv_aware`).

Off by default; `--kv-events-endpoint tcp://*:5557` turns it on. Each engine step that
changed the prefix cache sends one ZMQ PUB message of three frames:

    [topic (utf-8), sequence number (uint64, big-endian, from 0), payload (msgpack)]

The payload is vLLM's `KVEventBatch` as a positional array, `[timestamp, events,
data_parallel_rank]`, with each event a tagged positional array:

    ["BlockStored", [block_hash], parent_block_hash | None, token_ids, block_size, None, "GPU"]
    ["BlockRemoved", [block_hash], "GPU"]

(lora_id None; medium "GPU", the engine's own KV tier, whatever the device.) A block hash
is the first 8 bytes of specd's prefix-cache key as an unsigned 64-bit integer: an opaque
id, as those scorers treat the engine's hashes (they key blocks by the token ids and the
parent chain).

Events carry every tenant's token ids, prompts and generated outputs alike (an output's
full blocks are cached too). The socket binds or connects as `--kv-events-mode` says,
never guessed from the address, and beyond loopback it needs CURVE keys
(`server/zmq_curve.py`): only subscribers whose public keys the operator listed receive.

The socket lives on a thread of its own (ZMQ sockets are not thread-safe) behind a bounded
queue: a batch that finds it full is dropped and counted, never holding the engine.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import msgpack

from scheduler.kv_blocks import BlockEvent, BlockKey, BlockStored
from server.zmq_curve import CurveError, CurveKeys, Mode, is_local_endpoint

logger = logging.getLogger("specd.server")

QUEUE_BATCHES = 1024
MEDIUM = "GPU"
_STOP = object()


def block_hash(key: BlockKey) -> int:
    return int.from_bytes(key[:8], "big")


def encode_batch(events: list[BlockEvent], block_size: int, timestamp: float) -> bytes:
    """One `KVEventBatch` payload, msgpack, positional as vLLM's msgspec structs encode."""
    encoded: list[list] = []
    for event in events:
        if isinstance(event, BlockStored):
            parent = None if event.parent is None else block_hash(event.parent)
            encoded.append(["BlockStored", [block_hash(event.key)], parent, list(event.token_ids), block_size,
                            None, MEDIUM])  # fmt: skip
        else:
            encoded.append(["BlockRemoved", [block_hash(event.key)], MEDIUM])
    return msgpack.packb([timestamp, encoded, None])


class KVEventPublisher:
    """Publishes batches of block events on a ZMQ PUB socket, bound to `endpoint` or connected to
    a listener there (`mode`), with CURVE when `keys` are given (required beyond loopback)."""

    def __init__(self, endpoint: str, topic: str, block_size: int, mode: Mode = "bind", keys: CurveKeys | None = None):
        import zmq  # only where events are asked for

        if keys is None and not is_local_endpoint(endpoint):
            raise CurveError(f"KV events on {endpoint} reach beyond this machine: CURVE keys are required")
        if keys is not None:
            keys.check(mode)
        self.endpoint, self.topic, self.block_size = endpoint, topic, block_size
        self.dropped = 0
        self._queue: queue.Queue = queue.Queue(maxsize=QUEUE_BATCHES)
        self._context = zmq.Context()  # its own: the authenticator and the socket share it, and close with it
        self._socket: zmq.Socket = self._context.socket(zmq.PUB)
        self._authenticator = keys.apply(self._context, self._socket, mode) if keys is not None else None
        if mode == "bind":
            self._socket.bind(endpoint)
        else:
            self._socket.connect(endpoint)
        self._thread = threading.Thread(target=self._run, name="specd-kv-events", daemon=True)
        self._thread.start()
        curve = "CURVE" if keys is not None else "plaintext, local only"
        logger.info("publishing KV-cache events: %s %s (topic %r, %s)", mode, endpoint, topic, curve)

    def publish(self, events: list[BlockEvent]) -> None:
        """Queue one step's events (called on the engine loop; never blocks)."""
        if not events:
            return
        try:
            self._queue.put_nowait((time.time(), events))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 100 == 0:
                logger.warning("KV events: the publisher is behind; %d batches dropped", self.dropped)

    def _run(self) -> None:
        sequence = 0
        topic = self.topic.encode()
        while (item := self._queue.get()) is not _STOP:
            timestamp, events = item
            payload = encode_batch(events, self.block_size, timestamp)
            self._socket.send_multipart([topic, sequence.to_bytes(8, "big"), payload])
            sequence += 1
        self._socket.close(linger=500)

    def close(self) -> None:
        self._queue.put(_STOP)
        self._thread.join(5)
        if self._authenticator is not None:
            self._authenticator.stop()
        self._context.term()
