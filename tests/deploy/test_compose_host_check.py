"""`docker compose up` on a fresh machine, without Docker: each service runs here with the
command and environment the rendered compose config gives it (no shell variables set, named
volumes as temporary directories, the image's ENTRYPOINT/CMD from deploy/Dockerfile), only the
model swapped for a tiny one and the port for a free one. A DNS-rebinding page's request (a
foreign `Host`) must get 421 or 401, directly and through the replicas' router."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from tests.deploy.artifact_support import DEPLOY, compose, env_map, merge_compose
from tests.support.router import Router, router_binary
from tests.support.server import SpecdServer

FOREIGN = {"Host": "rebound.example:8000"}


def image_command() -> list[str]:
    """ENTRYPOINT + CMD of deploy/Dockerfile: what the specd image runs with no `command`."""
    text = (DEPLOY / "Dockerfile").read_text()
    entry = re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M)
    cmd = re.search(r"^CMD (\[.*\])$", text, re.M)
    assert entry and cmd
    return json.loads(entry.group(1)) + json.loads(cmd.group(1))


def fresh_env(service: dict, volumes: dict[str, Path]) -> dict[str, str]:
    """The service's environment on a machine whose shell sets nothing: bare names pass nothing."""
    env = {k: v for k, v in env_map(service.get("environment", [])).items() if v is not None}
    return {k: mapped(v, service, volumes) for k, v in env.items()}


def mapped(value: str, service: dict, volumes: dict[str, Path]) -> str:
    """A container path under a named volume's mount, as the temporary directory standing for it."""
    for mount in service.get("volumes", []):
        name, target = mount.split(":")[:2]
        if name in volumes and value.startswith(target):
            return str(volumes[name]) + value[len(target) :]
    return value


class ComposeService(SpecdServer):
    """The specd image's command as compose runs it, from this checkout, on a free port."""

    def __init__(self, env: dict[str, str], log_path: Path, tiny_model: Path):
        env = env | {"SPECD_MODEL": str(tiny_model), "SPECD_DEVICE": "cpu", "SPECD_DTYPE": "float32"}
        super().__init__([], log_path, env=env)

    def command(self, args: list[str]) -> list[str]:
        program, *rest = image_command()
        assert program == "specd"
        return [sys.executable, "-m", "server.cli", *rest]

    def environment(self, extra: dict[str, str] | None) -> dict[str, str]:
        return super().environment((extra or {}) | {"SPECD_PORT": str(self.port)})


def test_the_compose_server_refuses_a_foreign_host(tiny_llama_dir, tmp_path):
    services = merge_compose(compose(), compose("docker-compose.cpu.yml"))["services"]
    server = ComposeService(fresh_env(services["specd"], {}), tmp_path / "specd.log", tiny_llama_dir)
    try:
        server.wait_ready()
        for path in ("/metrics", "/v1/models", "/v1/speculation", "/ready"):
            reply = httpx.get(server.url + path, headers=FOREIGN, timeout=10, trust_env=False)
            assert reply.status_code == 421, (path, reply.text[:200])
        # What compose itself sends still works: the published port's names and Prometheus' target.
        prometheus = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
        (job,) = [j for j in prometheus["scrape_configs"] if j["job_name"] == "specd"]
        for host in ("localhost:8000", "127.0.0.1:8000", *job["static_configs"][0]["targets"]):
            reply = httpx.get(server.url + "/metrics", headers={"Host": host}, timeout=10, trust_env=False)
            assert reply.status_code == 200, host
    finally:
        server.kill()


def test_the_replicas_overlay_generates_a_key_and_its_router_passes_no_foreign_host(tiny_llama_dir, tmp_path):
    merged = merge_compose(
        merge_compose(compose(), compose("docker-compose.cpu.yml")), compose("docker-compose.replicas.yml")
    )
    services = merged["services"]
    volumes = {name: tmp_path / name for name in merged["volumes"]}
    keygen = services["keygen"]
    command = [mapped(arg, keygen, volumes) for arg in keygen["entrypoint"][1:] + keygen["command"]]
    assert keygen["entrypoint"][0] == "python"
    subprocess.run([sys.executable, *command], check=True, capture_output=True, timeout=60)
    for name in ("specd", "specd-2"):
        assert services[name]["depends_on"]["keygen"]["condition"] == "service_completed_successfully"
    server = ComposeService(fresh_env(services["specd"], volumes), tmp_path / "specd.log", tiny_llama_dir)
    router = None
    try:
        server.wait_ready()
        for path in ("/metrics", "/v1/models", "/v1/speculation"):
            reply = httpx.get(server.url + path, headers=FOREIGN, timeout=10, trust_env=False)
            assert reply.status_code == 401, (path, reply.text[:200])
        # Prometheus' credentials file (in the same volume) opens /metrics.
        prometheus = services["prometheus"]
        config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.replicas.yml").read_text())
        (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "specd"]
        key = Path(mapped(job["authorization"]["credentials_file"], prometheus, volumes)).read_text().strip()
        reply = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {key}"}, trust_env=False)
        assert reply.status_code == 200
        binary = router_binary()
        if binary is None:
            pytest.skip("vllm-router is not installed (make router): the router half is not run")
        router = ComposeRouter(services["router"]["command"], server.url, tmp_path / "router.log", binary)
        router.wait_ready()
        for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions")):
            body = {"model": "x", "prompt": "hi", "max_tokens": 1} if method == "POST" else None
            reply = httpx.request(method, router.url + path, json=body, headers=FOREIGN, timeout=30, trust_env=False)
            assert reply.status_code in (401, 421), (path, reply.status_code, reply.text[:200])
    finally:
        if router is not None:
            router.kill()
        server.kill()


class ComposeRouter(Router):
    """The router service's compose command, its addresses swapped for this machine's."""

    def __init__(self, compose_command: list[str], worker: str, log_path: Path, binary: Path):
        self.compose_command = compose_command
        super().__init__([worker], "cache_aware", log_path, binary)

    def command(self, args: list[str]) -> list[str]:
        workers = self.compose_command.index("--worker-urls")
        out, skip = [str(self.binary)], False
        for i, arg in enumerate(self.compose_command):
            if skip and arg.startswith("http://"):
                continue
            skip = i == workers
            if arg.startswith("--host="):
                arg = "--host=127.0.0.1"
            elif arg.startswith("--port="):
                arg = f"--port={self.port}"
            elif arg.startswith("--prometheus-port="):
                arg = f"--prometheus-port={self.metrics_port}"
            out.append(arg)
            if i == workers:
                out += self.workers
        return out
