"""Reliability suite fixtures: real `specd serve` processes (through probe_serve.py)
on the tiny and cycle models, and the tally that the closing table prints.

Servers are session-scoped and stopped by SIGTERM at the end; each must then
exit 0 with no traceback in its log (`finish_server`), so an unhandled error
anywhere in the suite fails it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rel_harness import (  # noqa: E402
    API_KEY,
    CHAOS_MAX_NUM_SEQS,
    CYCLE_NAME,
    INPUT_MAX_BODY_BYTES,
    INPUT_MAX_MODEL_LEN,
    INPUT_MODEL,
    OVERLOAD_MAX_NUM_SEQS,
    OVERLOAD_MAX_QUEUE,
    CycleText,
    Tally,
    build_cycle_model,
    results_table,
    start_probed,
)
from specd_http import finish_server  # noqa: E402

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
def cycle_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    return build_cycle_model(tiny_llama_dir, tmp_path_factory.mktemp("models") / "cycle")


@pytest.fixture(scope="session")
def cycle_text(cycle_dir) -> CycleText:
    return CycleText(cycle_dir)


@pytest.fixture(scope="session")
def input_server(tiny_llama_dir, tmp_path_factory):
    """The tiny random Llama for bad input and fuzzing: short context, 256 KiB bodies."""
    args = [
        "--model", str(tiny_llama_dir), "--served-model-name", INPUT_MODEL, "--dtype", "float32",
        "--device", "cpu", "--max-num-seqs", "8", "--max-model-len", str(INPUT_MAX_MODEL_LEN),
        "--max-body-bytes", str(INPUT_MAX_BODY_BYTES),
    ]  # fmt: skip
    server = start_probed(args, tmp_path_factory.mktemp("logs"), "input")
    yield server
    finish_server(server)


@pytest.fixture(scope="session")
def chaos_server(cycle_dir, tmp_path_factory):
    """The cycle model behind an API key, with fault injection: storms, faults, security, soak."""
    args = [
        "--model", str(cycle_dir), "--served-model-name", CYCLE_NAME, "--dtype", "float32", "--device", "cpu",
        "--max-num-seqs", str(CHAOS_MAX_NUM_SEQS), "--enable-fault-injection",
    ]  # fmt: skip
    server = start_probed(args, tmp_path_factory.mktemp("logs"), "chaos", api_key=API_KEY)
    yield server
    finish_server(server)


@pytest.fixture(scope="session")
def overload_server(cycle_dir, tmp_path_factory):
    """The cycle model with two slots and a queue of four: easy to flood."""
    args = [
        "--model", str(cycle_dir), "--served-model-name", CYCLE_NAME, "--dtype", "float32", "--device", "cpu",
        "--max-num-seqs", str(OVERLOAD_MAX_NUM_SEQS), "--max-queue", str(OVERLOAD_MAX_QUEUE),
    ]  # fmt: skip
    server = start_probed(args, tmp_path_factory.mktemp("logs"), "overload")
    yield server
    finish_server(server)
