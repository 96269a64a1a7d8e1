"""HTTP test fixtures: real `specd serve` processes on 127.0.0.1 (session-scoped,
each stopped by SIGTERM and required to exit 0)."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.support.server import API_KEY, finish_server, serve_args, start_server


@pytest.fixture(scope="session")
def tiny_server(tiny_llama_dir, tmp_path_factory):
    """The tiny random Llama: batching, every field and error, fault injection."""
    args = serve_args(
        model=tiny_llama_dir, dtype="float32", device="cpu",
        max_num_seqs=8, max_body_bytes=65536, enable_fault_injection=True,
    )  # fmt: skip
    server = start_server(args, tmp_path_factory.mktemp("logs"), "tiny")
    yield server
    finish_server(server)


@pytest.fixture(scope="session")
def cycle_server(cycle_model_dir, tmp_path_factory):
    """The cycle model behind an API key, one request at a time, queue of one."""
    args = serve_args(
        model=cycle_model_dir, dtype="float32", device="cpu",
        served_model_name="cycle,cycle-alias", max_num_seqs=1, max_queue=1,
    )  # fmt: skip
    server = start_server(args, tmp_path_factory.mktemp("logs"), "cycle", api_key=API_KEY)
    yield server
    finish_server(server)


@pytest.fixture(scope="module")
def model(tiny_server) -> str:
    """The tiny server's model id, as /v1/models names it."""
    return httpx.get(tiny_server.base_url + "/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def client(tiny_server) -> openai.OpenAI:
    """The OpenAI SDK against the tiny server (a module may override it for another server)."""
    return openai.OpenAI(base_url=tiny_server.base_url, api_key="unused", max_retries=0, timeout=120)
