"""Helpers shared by the deploy-artifact tests (tests/deploy/test_*.py beside it): paths,
YAML and Compose loading (with Compose's override merge), running external tools, and
synthetic engine steps for a MetricsObserver."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from scheduler.metrics import METRICS
from scheduler.types import FinishedRequestStats, FinishReason, QueueState, SpecCounts, StepStats
from tests.support import REPO

DEPLOY = REPO / "deploy"
PROM_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"

METRIC_REF = re.compile(r"\b(specd_\w+)")


def base_metric(name: str) -> str:
    for suffix in ("_bucket", "_sum", "_count"):
        if name.removesuffix(suffix) in METRICS:  # every metric as exposed: the one table
            return name.removesuffix(suffix)
    return name


def load_yaml(path: Path):
    return yaml.safe_load(path.read_text())


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, **kwargs)


def need(binary: str) -> str:
    path = shutil.which(binary)
    if path is None:
        pytest.skip(f"`{binary}` not installed (Debian package `{binary}`; CI installs it)")
    return path


class _ComposeLoader(yaml.SafeLoader):
    """Reads Compose's `!reset` tag as a marker (PyYAML does not know it)."""


RESET = object()


_ComposeLoader.add_constructor("!reset", lambda loader, node: RESET)


def compose(name: str = "docker-compose.yml") -> dict:
    return yaml.load((REPO / name).read_text(), Loader=_ComposeLoader)


def env_map(environment: list[str] | dict) -> dict[str, str | None]:
    if isinstance(environment, dict):
        return dict(environment)
    return {k: v for k, _, v in (item.partition("=") for item in environment)} | {
        item: None for item in environment if "=" not in item
    }


def merge_compose(base, override):
    """Compose's override merge, for the keys these files use."""
    if override is RESET:
        return None
    if isinstance(base, dict) and isinstance(override, dict):
        merged = dict(base)
        for key, value in override.items():
            if key == "environment":
                env = env_map(base.get(key, [])) | env_map(value)
                merged[key] = [k if v is None else f"{k}={v}" for k, v in env.items()]
            elif key == "volumes" and isinstance(value, list):  # service mounts: merged by target path
                mounts = {m.split(":")[1]: m for m in base.get(key) or []} | {m.split(":")[1]: m for m in value}
                merged[key] = list(mounts.values())
            else:
                merged[key] = merge_compose(base.get(key), value) if key in base else value
            if merged[key] is None or value is RESET:
                merged[key] = [] if isinstance(base.get(key), list) else {}
        return merged
    return override


def workload_steps(i: int) -> list[StepStats]:
    """One spec step and one plain step. Acceptance is low, the queue grows and
    TTFT is slow, so every alert expression has data too."""
    spec = StepStats(
        step_seconds=0.02, batch_size=2, mode="spec",
        queue=QueueState(num_running=2, num_waiting=10 + i, kv_blocks_used=3, kv_blocks_total=10),
        num_generation_tokens=4,
        spec={"ngram": SpecCounts(num_drafts=2, num_draft_tokens=40, num_accepted_tokens=2)},
        accepted_per_position=[2, 0, 0],
        phase_seconds={"draft": 0.002, "verify": 0.018}, token_gaps=[(2, 0.02), (2, 0.03)],
    )  # fmt: skip
    plain = StepStats(
        step_seconds=0.05, batch_size=3, mode="plain",
        queue=QueueState(num_running=3, num_waiting=11 + i, kv_blocks_used=4, kv_blocks_total=10),
        prefix_cache_queries=12, prefix_cache_hits=6, num_prompt_tokens=12, num_generation_tokens=3,
        phase_seconds={"prefill": 0.04, "decode": 0.01}, token_gaps=[(1, 0.05)],
        first_token_latencies=[5.0], queue_seconds=[0.2],
        finished=[FinishedRequestStats(FinishReason.STOP, 6.0, 5.0, 12, 9),
                  FinishedRequestStats(FinishReason.LENGTH, 7.0, 5.0, 12, 16)],
    )  # fmt: skip
    return [spec, plain]
