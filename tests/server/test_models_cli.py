"""`specd models pull`'s conversion: a draft model is converted for its use as a draft too."""

from __future__ import annotations

import torch

import models.loader
from models.catalogue import CATALOGUE
from models.weights import draft_formats
from server.models_cli import _converter


def test_a_pulled_draft_model_is_converted_as_target_and_as_draft(tmp_path, monkeypatch):
    prepared = []
    monkeypatch.setattr(models.loader, "prepare", prepared.append)
    path = tmp_path / "model.gguf"
    _converter(tmp_path, CATALOGUE["qwen2.5-coder-1.5b-instruct"])(path)
    assert [(c.model, c.weights, c.output_weights) for c in prepared] == [(str(path), "auto", None)]
    prepared.clear()
    _converter(tmp_path, CATALOGUE["qwen2.5-coder-0.5b-instruct"])(path)
    fmt, output = draft_formats("auto", torch.device("cpu"))
    assert [(c.weights, c.output_weights) for c in prepared] == [("auto", None), (fmt, output)]
    assert all(c.cache_dir == tmp_path for c in prepared)
