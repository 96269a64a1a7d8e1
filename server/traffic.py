"""`--record-traffic FILE`: one JSON line per finished completion request, for `specd train-draft`.

A line holds what the client sent (chat `messages`, or the text `prompt`), what each
choice returned (`outputs`: text and finish reason), the model id, the endpoint, the
request id and the UTC time. It is user data: the file is off by default, and who
turns it on decides who may read it and when it is deleted.

Lines are written in order by one worker thread, never on the event loop, and a
request never fails because its line could not be written (the failure is logged).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from server.choices import Generation

logger = logging.getLogger("specd.server")


class TrafficLog:
    """Appends finished requests to `path` (JSON lines)."""

    def __init__(self, path: Path, model_id: str):
        self.path = Path(path)
        self.model_id = model_id
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specd-traffic")
        self._failing = False
        self._lock = threading.Lock()  # also serialises writers sharing one TrafficLog from other threads
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8"):
                pass
        except OSError as exc:  # warn now; each request still tries (the disk may come back)
            logger.warning("--record-traffic %s cannot be written: %s", self.path, exc)
        logger.info("recording finished requests (prompts and outputs: user data) to %s", self.path)

    def recorder(self, endpoint: str, request_id: str, prompt: dict[str, Any]) -> Callable[[Generation], None]:
        """What a `Generation` calls when it ends: queue its line (`prompt`: "messages" or "prompt")."""

        def record(gen: Generation) -> None:
            outputs = [{"text": c.text, "finish_reason": c.finish_reason or "abort"} for c in gen.choices]
            entry = {
                "time": datetime.now(UTC).isoformat(timespec="milliseconds"),
                "model": self.model_id,
                "endpoint": endpoint,
                "id": request_id,
                **prompt,
                "outputs": outputs,
            }
            try:
                self._writer.submit(self._append, entry)
            except RuntimeError:  # closed: a request that outlived the shutdown
                logger.warning("--record-traffic: request %s ended after shutdown; not recorded", request_id)

        return record

    def _append(self, entry: dict[str, Any]) -> None:
        line = json.dumps(entry, ensure_ascii=False) + "\n"
        try:
            with self._lock, open(self.path, "a", encoding="utf-8") as file:
                file.write(line)
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

    def close(self) -> None:
        """Write what is queued, then stop the writer."""
        self._writer.shutdown(wait=True)
