"""Reliability suite fixtures: real `specd serve` processes (with the test-only
GET /_probe) on the tiny and cycle models, and the tally that the closing table prints.

Servers are session-scoped and stopped by SIGTERM at the end; each must then
exit 0 with no traceback in its log (`finish_server`), so an unhandled error
anywhere in the suite fails it.
"""

from __future__ import annotations

import pytest

from tests.reliability.rel_harness import (
    API_KEY,
    CYCLE_NAME,
    INPUT_MAX_BODY_BYTES,
    INPUT_MAX_MODEL_LEN,
    INPUT_MODEL,
    OVERLOAD_MAX_NUM_SEQS,
    OVERLOAD_MAX_QUEUE,
    Tally,
    chaos_args,
    results_table,
)
from tests.support.server import finish_server, serve_args, start_server

TALLY = Tally()


@pytest.fixture(scope="session")
def tally() -> Tally:
    return TALLY


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if TALLY == Tally():
        return
    terminalreporter.write_sep("=", "specd reliability results")
    terminalreporter.write_line(results_table(TALLY))


@pytest.fixture(scope="session")
def input_server(tiny_llama_dir, tmp_path_factory):
    """The tiny random Llama for bad input and fuzzing: short context, 256 KiB bodies."""
    args = serve_args(
        model=tiny_llama_dir, served_model_name=INPUT_MODEL, dtype="float32", device="cpu",
        max_num_seqs=8, max_model_len=INPUT_MAX_MODEL_LEN, max_body_bytes=INPUT_MAX_BODY_BYTES,
    )  # fmt: skip
    server = start_server(args, tmp_path_factory.mktemp("logs"), "input", probe=True)
    yield server
    finish_server(server)


@pytest.fixture(scope="session")
def chaos_server(cycle_model_dir, tmp_path_factory):
    """The cycle model behind an API key, with fault injection: storms, faults, security, soak."""
    server = start_server(chaos_args(cycle_model_dir), tmp_path_factory.mktemp("logs"), "chaos", API_KEY, probe=True)
    yield server
    finish_server(server)


@pytest.fixture(scope="session")
def overload_server(cycle_model_dir, tmp_path_factory):
    """The cycle model with two slots and a queue of four: easy to flood."""
    args = serve_args(
        model=cycle_model_dir, served_model_name=CYCLE_NAME, dtype="float32", device="cpu",
        max_num_seqs=OVERLOAD_MAX_NUM_SEQS, max_queue=OVERLOAD_MAX_QUEUE,
    )  # fmt: skip
    server = start_server(args, tmp_path_factory.mktemp("logs"), "overload", probe=True)
    yield server
    finish_server(server)
