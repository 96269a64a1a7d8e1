"""`--record-traffic FILE`: one JSON line per finished completion request, for `specd train-draft`.

A line holds what the client sent (chat `messages`, or the text `prompt`), what each
choice returned (`outputs`: text and finish reason), the tenant it came from, the
model id, the endpoint, the request id and the UTC time. It is user data: the file
is off by default, created readable by its owner only (0600), never written through
a symbolic link nor into a file another user created or others may read, and rotated
by size (`FILE` becomes `FILE.1` past `--record-traffic-max-bytes`; the one before is
gone), so it cannot fill the disk.

Lines are written in order by one worker thread, never on the event loop. Its queue
is bounded: a request whose line finds it full is not recorded (counted in
`dropped`, logged), so a slow disk never holds a request, the event loop or the
engine; nor does a write that fails (logged once until writes succeed again).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from server.choices import Generation

logger = logging.getLogger("specd.server")

QUEUE_LINES = 1024  # lines waiting for the writer before new ones are dropped
_STOP = object()


class TrafficLog:
    """Appends finished requests to `path` (JSON lines)."""

    def __init__(self, path: Path, model_id: str, max_bytes: int = 256 << 20):
        self.path = Path(path)
        self.model_id = model_id
        self.max_bytes = max_bytes
        self.dropped = 0  # lines not written because the queue was full
        self._queue: queue.Queue = queue.Queue(maxsize=QUEUE_LINES)
        self._failing = False
        self._closed = False
        self._writer = threading.Thread(target=self._run, name="specd-traffic", daemon=True)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            os.close(_open(self.path))
        except OSError as exc:  # warn now; each request still tries (the disk may come back)
            logger.warning("--record-traffic %s cannot be written: %s", self.path, exc)
        self._writer.start()
        logger.info("recording finished requests (prompts and outputs: user data) to %s", self.path)

    def recorder(
        self, endpoint: str, request_id: str, tenant: str, prompt: dict[str, Any]
    ) -> Callable[[Generation], None]:
        """What a `Generation` calls when it ends: queue its line (`prompt`: "messages" or "prompt")."""

        def record(gen: Generation) -> None:
            outputs = [{"text": c.text, "finish_reason": c.finish_reason or "abort"} for c in gen.choices]
            entry = {
                "time": datetime.now(UTC).isoformat(timespec="milliseconds"),
                "model": self.model_id,
                "endpoint": endpoint,
                "id": request_id,
                "tenant": tenant,
                **prompt,
                "outputs": outputs,
            }
            if self._closed:
                logger.warning("--record-traffic: request %s ended after shutdown; not recorded", request_id)
                return
            try:
                self._queue.put_nowait(entry)
            except queue.Full:
                self.dropped += 1
                if self.dropped == 1 or self.dropped % 100 == 0:
                    logger.warning("--record-traffic: the writer is behind; %d requests not recorded", self.dropped)

        return record

    def _run(self) -> None:
        while (entry := self._queue.get()) is not _STOP:
            self._append(entry)

    def _append(self, entry: dict[str, Any]) -> None:
        line = (json.dumps(entry, ensure_ascii=False) + "\n").encode("utf-8")
        try:
            self._rotate_for(len(line))
            fd = _open(self.path)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)
        except OSError as exc:
            if not self._failing:  # once per run of failures, not once per request
                logger.error(
                    "--record-traffic: cannot append to %s (%s); requests are served unrecorded", self.path, exc
                )
            self._failing = True
            return
        if self._failing:
            logger.info("--record-traffic: writing to %s again", self.path)
        self._failing = False

    def _rotate_for(self, num_bytes: int) -> None:
        try:
            size = os.lstat(self.path).st_size
        except FileNotFoundError:
            return
        if size and size + num_bytes > self.max_bytes:
            os.replace(self.path, self.path.with_name(self.path.name + ".1"))

    def close(self) -> None:
        """Write what is queued, then stop the writer."""
        self._closed = True
        self._queue.put(_STOP)
        self._writer.join()


def _open(path: Path) -> int:
    """Append-only, created 0600, refusing a symbolic link at `path` (ELOOP), and a file someone
    else created first or others may read: its owner and mode would be kept (PermissionError)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    info = os.fstat(fd)
    if info.st_uid != os.geteuid() or info.st_mode & 0o077:
        os.close(fd)
        raise PermissionError(
            f"{path} is owned by uid {info.st_uid} with mode {info.st_mode & 0o777:o}; "
            f"user data goes only into a file of this server's (uid {os.geteuid()}) with mode 600"
        )
    return fd
