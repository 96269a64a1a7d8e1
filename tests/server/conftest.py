"""HTTP test fixtures: real `specd serve` processes on 127.0.0.1 (session-scoped,
each stopped by SIGTERM and required to exit 0) and the cycle model."""

from __future__ import annotations

from pathlib import Path

import pytest
from specd_http import API_KEY, cycle_ids, finish_server, start_server


@pytest.fixture(scope="session")
def cycle_model_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    ids = cycle_ids(tokenizer)
    assert len(ids) <= model.config.hidden_size
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight  # [vocab, hidden]
        head.zero_()
        for i, token_id in enumerate(ids):
            embed[token_id].zero_()
            embed[token_id, i] = 1.0
            head[ids[(i + 1) % len(ids)], i] = 5.0  # after RMSNorm the unit vector is 8 e_i: logit 40
    path = tmp_path_factory.mktemp("models") / "cycle"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


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
