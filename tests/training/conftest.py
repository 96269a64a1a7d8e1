"""The tiny Llama's own answers and features, built once: what the training tests train on."""

from __future__ import annotations

import pytest

from models.loader import ModelConfig, load_model
from training.data import DataConfig, build_sequences
from training.prompts import read_prompt_files, shipped_prompt_files


@pytest.fixture(scope="session")
def tiny_loaded(tiny_llama_dir):
    return load_model(ModelConfig(model=str(tiny_llama_dir), dtype="float32", device="cpu"))


@pytest.fixture(scope="session")
def tiny_sequences(tiny_loaded):
    """Answers of up to 24 tokens to every ninth shipped prompt (about 130)."""
    prompts = read_prompt_files(shipped_prompt_files())[::9]
    return build_sequences(tiny_loaded, prompts, DataConfig(max_tokens=24, max_num_seqs=16))


@pytest.fixture(scope="session")
def cycle_sequences(cycle_model_dir):
    """The cycle model's answers (its cycle, over and over): a target whose next feature is learnable exactly."""
    loaded = load_model(ModelConfig(model=str(cycle_model_dir), dtype="float32", device="cpu"))
    prompts = read_prompt_files(shipped_prompt_files())[::14]
    return loaded, build_sequences(loaded, prompts, DataConfig(max_tokens=24, max_num_seqs=16))
