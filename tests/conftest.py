"""Shared fixtures: tiny local models and the cycle model (built once per session, no download)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Before anything imports huggingface_hub, which reads these once.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from tests.support.cycle import CycleText, build_cycle_model  # noqa: E402
from tests.support.tiny_models import build_draft_from, build_head, build_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama", "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2", "qwen2")


@pytest.fixture(scope="session")
def tiny_draft_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    """The tiny Llama with only its first layer: same tokenizer, a cheap, weak draft."""
    return build_draft_from(tiny_llama_dir, tmp_path_factory.mktemp("models") / "tiny-llama-draft")


@pytest.fixture(scope="session")
def tiny_llama_head_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    """An untrained, perturbed EAGLE head for the tiny Llama (`build_head`), drafting over every token."""
    return build_head(tiny_llama_dir, tmp_path_factory.mktemp("heads") / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_llama_fused_head_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    """As `tiny_llama_head_dir`, over the fused layers' states (EAGLE-3's features)."""
    return build_head(tiny_llama_dir, tmp_path_factory.mktemp("heads") / "tiny-llama-fused", fused=True)


@pytest.fixture(scope="session")
def cycle_model_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    """The tiny Llama rewired to write CYCLE_TEXT over and over (tests/support/cycle.py)."""
    return build_cycle_model(tiny_llama_dir, tmp_path_factory.mktemp("models") / "cycle")


@pytest.fixture(scope="session")
def cycle_text(cycle_model_dir) -> CycleText:
    """The exact text the cycle model writes."""
    return CycleText(cycle_model_dir)


@pytest.fixture(scope="session")
def specd_cache_dir(tmp_path_factory) -> Path:
    """Converted-GGUF cache shared by the tests that load the real SmolLM2."""
    return tmp_path_factory.mktemp("specd-cache")


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers", "smollm2: loads the real SmolLM2-135M (slower); `make test-fast` leaves these out"
    )
    config.addinivalue_line(
        "markers",
        "realpair: the pulled Qwen2.5-Coder 1.5B + 0.5B end to end (`make test-realpair`; not in `make test`)",
    )
    config.addinivalue_line(
        "markers", "slow: asserts on timings (latency ratios, deadlines); `make test` runs these in their own step"
    )


def pytest_collection_modifyitems(items) -> None:
    for item in items:  # every test that reaches the converted-GGUF cache loads SmolLM2
        if "specd_cache_dir" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.smollm2)
