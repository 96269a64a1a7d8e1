"""HTTP test fixtures: real `specd serve` processes on 127.0.0.1 (session-scoped,
each stopped by SIGTERM and required to exit 0) and the cycle model."""

from __future__ import annotations

from pathlib import Path

import pytest
from specd_http import API_KEY, build_cycle_model, finish_server, start_server


@pytest.fixture(scope="session")
def cycle_model_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    return build_cycle_model(tiny_llama_dir, tmp_path_factory.mktemp("models") / "cycle")


@pytest.fixture(scope="session")
def tiny_server(tiny_llama_dir, tmp_path_factory):
    """The tiny random Llama: batching, every field and error, fault injection."""
    args = [
        "--model", str(tiny_llama_dir), "--dtype", "float32", "--device", "cpu",
        "--max-num-seqs", "8", "--max-body-bytes", "65536", "--enable-fault-injection",
    ]  # fmt: skip
    server = start_server(args, tmp_path_factory.mktemp("logs"), "tiny")
    yield server
    finish_server(server)


@pytest.fixture(scope="session")
def cycle_server(cycle_model_dir, tmp_path_factory):
    """The cycle model behind an API key, one request at a time, queue of one."""
    args = [
        "--model", str(cycle_model_dir), "--dtype", "float32", "--device", "cpu",
        "--served-model-name", "cycle,cycle-alias", "--max-num-seqs", "1", "--max-queue", "1",
    ]  # fmt: skip
    server = start_server(args, tmp_path_factory.mktemp("logs"), "cycle", api_key=API_KEY)
    yield server
    finish_server(server)
