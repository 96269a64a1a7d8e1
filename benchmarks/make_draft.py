"""Make a draft model from a target by keeping its first N layers (same tokenizer).

An untrained truncation is a weak draft; it is what can be built offline from
the bundled model. Cached under ~/.cache/specd/drafts.
"""

from __future__ import annotations

from pathlib import Path

import safetensors.torch
import torch

from models.loader import ModelConfig, default_cache_dir, load_model


def make_layer_draft(model: str | None, num_layers: int, cache_dir: Path | None = None) -> Path:
    name = (model or "smollm2-135m-instruct").replace("/", "--")
    out = (cache_dir or default_cache_dir()) / "drafts" / f"{name}-{num_layers}L"
    if (out / "model.safetensors").exists():
        return out
    loaded = load_model(ModelConfig(model, dtype="float32", device="cpu", cache_dir=cache_dir))
    m = loaded.model
    m.model.layers = m.model.layers[:num_layers]
    m.config.num_hidden_layers = num_layers
    if getattr(m.config, "layer_types", None):
        m.config.layer_types = m.config.layer_types[:num_layers]
    out.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        safetensors.torch.save_model(m, str(out / "model.safetensors"))
    m.config.save_pretrained(out)
    m.generation_config.save_pretrained(out)
    loaded.tokenizer.save_pretrained(out)
    return out


if __name__ == "__main__":
    import sys

    print(make_layer_draft(None, int(sys.argv[1]) if len(sys.argv) > 1 else 8))
