"""Run a real Prometheus on loopback for tests, and query it.

    with PrometheusServer("127.0.0.1:8123", workdir=tmp_path) as prom:
        prom.wait_until(lambda: prom.query('up{job="specd"} == 1'))
        prom.query("specd_requests_running")

The config is generated from deploy/prometheus/prometheus.yml: its `specd`
job (path, labels) pointed at the given targets, 1 s scrape and rule
intervals, and deploy/prometheus/rules.yml loaded. Storage lives in a temp
dir; `stop()` ends the process it started, by PID.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import httpx
import yaml

from tests.support import REPO
from tests.support.server import free_port

PROMETHEUS_CONFIG = REPO / "deploy" / "prometheus" / "prometheus.yml"
RULES = REPO / "deploy" / "prometheus" / "rules.yml"
SPECD_JOB = "specd"

T = TypeVar("T")


class PrometheusError(RuntimeError):
    """Prometheus answered a query with an error (bad PromQL, timeout, ...)."""


def prometheus_binary() -> str | None:
    return shutil.which("prometheus")


def generate_config(
    targets: Sequence[str],
    *,
    scrape_interval: str = "1s",
    evaluation_interval: str = "1s",
    rules_path: Path = RULES,
    base_config: Path = PROMETHEUS_CONFIG,
) -> dict[str, Any]:
    """The deployed config, with only the specd job, aimed at `targets`."""
    config = yaml.safe_load(base_config.read_text())
    job = next(j for j in config["scrape_configs"] if j["job_name"] == SPECD_JOB)
    job["static_configs"] = [{"targets": list(targets)}]
    job.pop("authorization", None)
    config["global"] = {
        **config.get("global", {}),
        "scrape_interval": scrape_interval,
        "scrape_timeout": scrape_interval,
        "evaluation_interval": evaluation_interval,
    }
    config["rule_files"] = [str(rules_path)]
    config["scrape_configs"] = [job]
    return config


class PrometheusServer:
    def __init__(
        self,
        target: str,
        *,
        extra_targets: Sequence[str] = (),
        workdir: Path | None = None,
        port: int | None = None,
        binary: str | None = None,
        scrape_interval: str = "1s",
    ) -> None:
        self.targets = [target, *extra_targets]
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.binary = binary or prometheus_binary() or "prometheus"
        self.scrape_interval = scrape_interval
        self._own_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="specd-prom-"))
        self.log_path = self.workdir / "prometheus.log"
        self._process: subprocess.Popen | None = None
        self._client = httpx.Client(base_url=self.url, timeout=10.0)

    # -- lifecycle --

    def start(self, timeout: float = 30.0) -> PrometheusServer:
        config = generate_config(self.targets, scrape_interval=self.scrape_interval)
        config_path = self.workdir / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        storage = self.workdir / "data"
        storage.mkdir(exist_ok=True)
        with self.log_path.open("wb") as log:
            self._process = subprocess.Popen(
                [
                    self.binary,
                    f"--config.file={config_path}",
                    f"--storage.tsdb.path={storage}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--storage.tsdb.retention.time=1h",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        try:
            self.wait_until(self._is_ready, timeout=timeout, what="Prometheus /-/ready")
        except BaseException:
            self.stop()
            raise
        return self

    def _is_ready(self) -> bool:
        if self._process is not None and self._process.poll() is not None:
            raise RuntimeError(f"prometheus exited with {self._process.returncode}:\n{self.log()}")
        try:
            return self._client.get("/-/ready").status_code == 200
        except httpx.TransportError:
            return False

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.terminate()  # SIGTERM to our own PID only
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
        self._client.close()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> PrometheusServer:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    # -- HTTP API --

    def _api(self, path: str, **params: Any) -> Any:
        response = self._client.post(f"/api/v1/{path}", data=params)
        body = response.json()
        if body.get("status") != "success":
            raise PrometheusError(f"{body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        """Instant query; the result list (vector) or [scalar/string] otherwise."""
        params = {"query": expr}
        if at is not None:
            params["time"] = at
        data = self._api("query", **params)
        return data["result"] if data["resultType"] in ("vector", "matrix") else [data["result"]]

    def query_range(self, expr: str, start: float, end: float, step: str = "1s") -> list[dict]:
        return self._api("query_range", query=expr, start=start, end=end, step=step)["result"]

    def rules(self) -> list[dict]:
        return self._client.get("/api/v1/rules").json()["data"]["groups"]

    def alerts(self) -> list[dict]:
        return self._client.get("/api/v1/alerts").json()["data"]["alerts"]

    def targets_health(self) -> dict[str, str]:
        active = self._client.get("/api/v1/targets").json()["data"]["activeTargets"]
        return {t["labels"]["instance"]: t["health"] for t in active}

    def wait_until(
        self,
        check: Callable[[], T],
        *,
        timeout: float = 30.0,
        interval: float = 0.25,
        what: str = "",
    ) -> T:
        """Poll `check` until it returns something truthy; TimeoutError otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            result = check()
            if result:
                return result
            if time.monotonic() > deadline:
                what = what or repr(check)
                raise TimeoutError(f"timed out after {timeout}s waiting for {what}\n{self.log()}")
            time.sleep(interval)
