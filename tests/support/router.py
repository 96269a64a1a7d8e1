"""specd replicas behind vllm-router: the processes the replica tests and `benchmarks.replica_bench` start.

vllm-router (PyPI `vllm-router`, a Rust binary) is an existing OpenAI-compatible router with
round-robin, cache-aware (a prefix tree per worker over the request text) and consistent-hash
policies; it health-checks every worker's /health and retries a request on another worker
when its first pick fails to answer. It is installed beside specd's environment
(`make router`, `.ci/run`), or found on PATH, or named by SPECD_ROUTER.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from tests.support import REPO
from tests.support.metrics import Metrics
from tests.support.server import SpecdServer, free_port

ROUTER_VENV = REPO / ".router-venv"


def router_binary() -> Path | None:
    """vllm-router's executable, None where it is not installed."""
    named = os.environ.get("SPECD_ROUTER")
    for candidate in (named, ROUTER_VENV / "bin" / "vllm-router", shutil.which("vllm-router")):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


class Replica(SpecdServer):
    """One specd replica, pinned to `cores` (taskset) with as many intra-op threads."""

    def __init__(self, args: Sequence[str], log_path: Path, cores: str | None = None, **kwargs):
        self.cores = cores
        env = dict(kwargs.pop("env", None) or {})
        if cores is not None:
            env.setdefault("OMP_NUM_THREADS", str(len(cores.split(","))))
        super().__init__(args, log_path, env=env, **kwargs)

    def command(self, args: list[str]) -> list[str]:
        command = super().command(args)
        return (["taskset", "-c", self.cores] if self.cores is not None else []) + command


class Router(SpecdServer):
    """vllm-router on 127.0.0.1 in front of `workers` (base URLs without /v1)."""

    name = "vllm-router"
    ready_path = "/health"

    def __init__(self, workers: Sequence[str], policy: str, log_path: Path, binary: Path, *extra: str):
        self.workers, self.policy, self.binary, self.extra = list(workers), policy, binary, list(extra)
        self.metrics_port = free_port()  # its own Prometheus endpoint
        super().__init__([], log_path)

    def command(self, args: list[str]) -> list[str]:
        return [str(self.binary), "--host", "127.0.0.1", "--port", str(self.port), "--worker-urls", *self.workers,
                "--policy", self.policy, "--prometheus-port", str(self.metrics_port),
                "--health-check-interval-secs", "1",
                "--health-failure-threshold", "1", "--cb-failure-threshold", "3", "--log-level", "warning",
                *self.extra]  # fmt: skip


def completed_requests(metrics: Metrics) -> float:
    """Requests a replica finished normally (stop or length), from its /metrics."""
    return sum(metrics.value("specd_requests_total", finish_reason=r, default=0) for r in ("stop", "length"))


def start_replicas(args: Sequence[str], log_dir: Path, cores: Sequence[str | None]) -> list[Replica]:
    """Ready replicas, one per entry of `cores`, started together."""
    replicas = [Replica(args, log_dir / f"replica-{i}.log", core) for i, core in enumerate(cores)]
    try:
        for replica in replicas:
            replica.wait_ready()
    except Exception:
        for replica in replicas:
            replica.kill()
        raise
    return replicas


def start_router(workers: Sequence[SpecdServer], policy: str, log_dir: Path, binary: Path) -> Router:
    router = Router([w.url for w in workers], policy, log_dir / f"router-{policy}.log", binary)
    router.wait_ready()
    return router
