"""One `specd serve` process on loopback, for the test suites and benchmarks/serve_bench.py.

    server = start_server(serve_args(model=model_dir, dtype="float32", device="cpu"), log_dir, "tiny")
    httpx.get(server.base_url + "/models", headers=server.headers)
    finish_server(server)  # SIGTERM: exit 0 and no traceback in the log, or the test fails

Nothing here needs pytest: a server that does not start raises `ServerError`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from tests.support import REPO
from tests.support.metrics import Metrics, wait_idle

API_KEY = "test-key"
START_TIMEOUT_S = 240
PROBE_MODULE = "tests.support.probe_serve"  # `specd serve` plus GET /_probe


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_args(**flags: object) -> list[str]:
    """`specd serve` flags from keyword arguments, in order: `max_num_seqs=8` -> `--max-num-seqs 8`.

    None and False leave a flag out, True makes it a bare switch
    (`enable_fault_injection=True`); any other value goes through str().
    """
    args: list[str] = []
    for name, value in flags.items():
        flag = "--" + name.replace("_", "-")
        if value is None or value is False:
            continue
        args += [flag] if value is True else [flag, str(value)]
    return args


class ServerError(RuntimeError):
    """The server exited or was not ready in time."""


class SpecdServer:
    """One server process on 127.0.0.1 and a free port; its output goes to `log_path`.

    It runs `python -m server.cli serve --host 127.0.0.1 --port PORT ARGS`
    from the repo root, without the caller's SPECD_* variables (the flags say it
    all) and offline. `probe=True` runs the same CLI through
    tests/support/probe_serve.py, which adds GET /_probe (`probe()`), with one
    intra-op thread. A subclass that runs another server overrides `command`.
    """

    name = "specd"
    ready_path = "/ready"

    def __init__(
        self,
        args: Sequence[str],
        log_path: Path,
        api_key: str | None = None,
        *,
        probe: bool = False,
        env: dict[str, str] | None = None,
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.base_url = self.url + "/v1"
        self.api_key = api_key
        self.probed = probe
        self.killed = False  # stop() had to SIGKILL it
        self.log_path = log_path
        command = self.command(list(args))
        self._log = log_path.open("wb")
        self.process = subprocess.Popen(
            command, cwd=REPO, env=self.environment(env), stdout=self._log, stderr=subprocess.STDOUT
        )

    def command(self, args: list[str]) -> list[str]:
        module = PROBE_MODULE if self.probed else "server.cli"
        command = [sys.executable, "-m", module, "serve", "--host", "127.0.0.1", "--port", str(self.port), *args]
        return command + (["--api-key", self.api_key] if self.api_key else [])

    def environment(self, extra: dict[str, str] | None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPECD_")}
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.update(TRANSFORMERS_VERBOSITY="error", TOKENIZERS_PARALLELISM="false")
        if self.probed:
            # Tiny models gain nothing from intra-op threads, and on a shared CPU a
            # spinning thread team can stall every step; one thread keeps timings sane.
            env.setdefault("OMP_NUM_THREADS", "1")
        env.update(extra or {})
        return env

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log()[-num_chars:]

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        """Until `ready_path` answers 200; ServerError (the process killed) if it exits or times out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerError(f"{self.name} exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=2, trust_env=False).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.kill()
        raise ServerError(f"{self.name} was not ready within {timeout:.0f}s:\n{self.log_tail()}")

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM, then the exit code; SIGKILL (and `killed`) if it has not exited after `timeout` s."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.killed = True
            self.kill()
            return self.process.returncode
        finally:
            self._log.close()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._log.close()

    # -- what it reports ---------------------------------------------------------------

    def metrics(self) -> Metrics:
        return Metrics.scrape(self.url, self.headers)

    def wait_idle(self, timeout: float = 120) -> Metrics:
        """`metrics.wait_idle` on this server (its probe in the message when it has one)."""
        return wait_idle(self.url, self.headers, timeout, detail=self.probe if self.probed else None)

    def probe(self) -> dict:
        """GET /_probe (probe=True only): live tasks, threads and the engine's per-request tables."""
        return httpx.get(self.url + "/_probe", timeout=30, trust_env=False).json()

    def proc_status(self) -> dict[str, int]:
        """RSS (bytes) and OS threads of the server process, from /proc."""
        fields = {}
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "Threads"):
                fields[key] = int(value.split()[0])
        return {"rss": fields["VmRSS"] * 1024, "threads": fields["Threads"]}


def start_server(
    args: Sequence[str], log_dir: Path, name: str, api_key: str | None = None, *, probe: bool = False
) -> SpecdServer:
    """A ready server logging to `log_dir`/`name`.log."""
    server = SpecdServer(args, log_dir / f"{name}.log", api_key, probe=probe)
    server.wait_ready()
    return server


def finish_server(server: SpecdServer) -> None:
    """Stop with SIGTERM; the server must exit 0 with no traceback in its log."""
    code = server.stop()
    killed = " (SIGKILL: it did not exit in time)" if server.killed else ""
    assert code == 0, f"{server.name} exited with {code} after SIGTERM{killed}:\n{server.log_tail()}"
    assert "Traceback" not in server.log(), server.log_tail()


def in_process(**settings: object) -> httpx.AsyncClient:
    """An HTTP client on a specd app in this process (no model loads: /v1 answers 503 past the
    middleware), for tests of what the middleware and the app's set-up decide."""
    from server.app import create_app
    from server.config import Settings

    app = create_app(Settings(model="unused", **settings))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1")
