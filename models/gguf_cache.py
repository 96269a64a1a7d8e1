"""The cache of converted GGUF files under `<cache_dir>/models/`: dense (float32, a complete
transformers directory) or packed (a quantized `--weights`: its layers' codes beside the other
tensors). Dequantizing a GGUF takes ~16 s for SmolLM2 and minutes for a 1.5B model, so each
conversion is built once, atomically, keyed by the file's content, and reused.

transformers 5.x refuses `save_pretrained` on a GGUF-loaded model ("not serializable"), but its
tensors are plain: safetensors' `save_file` plus the config's, generation config's and
tokenizer's own `save_pretrained` reload with identical logits.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from models import weights
from models.gguf_tokenizer import restore_added_tokens
from models.quantized import LAYOUT_VERSION, QuantizedWeight

logger = logging.getLogger("specd.models")

MARKER = "specd-cache.json"
QUANTIZED_FILE = "quantized.safetensors"  # a packed cache's quantized layers (`weights.save_layers`)
# 2: config.json names `architectures`; 3: tied weights under the embedding's name;
# 4: every GGUF control and user-defined token an added token (`models.gguf_tokenizer`)
_CACHE_FORMAT = 4
_STALE_TMP_SECONDS = 3600
_HASHED_BYTES = 4 << 20


@dataclass(frozen=True)
class GGUFCache:
    """Where a GGUF's conversion is cached, and in which form: dense (float32, a complete
    transformers directory) or, where `--weights` quantizes, packed (`weights`: the quantized
    layers' codes in `quantized.safetensors`, the rest dense in `model.safetensors`)."""

    source: Path
    path: Path
    weights: str | None = None  # the --weights choice it is packed for; None: dense
    output: str | None = None  # the output projection's format where `weights` is uniform (None: int8)

    def build(self, out: Path) -> None:
        model, tokenizer = _gguf_to_hf(self.source)
        layers = None
        if self.weights is not None:
            plan = weights.plan_for(self.weights, model, self.source, torch.device("cpu"), self.output)
            layers = weights.quantize_layers(model, plan, self.source)
        _save_converted(model, tokenizer, out, layers)

    @property
    def complete(self) -> bool:
        return (self.path / MARKER).is_file()

    def ensure(self) -> Path:
        """The cache's directory, converted first if it is not complete."""
        if not self.complete:
            _build_atomically(self.path, self.build, source=self.source)
        return self.path

    def load_packed(self, dtype: torch.dtype, device: torch.device) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
        """The packed model: each quantized layer's dense weight is the values of its codes, as
        `weights.apply` sets it. A missing codes file raises (a broken cache, rebuilt)."""
        assert self.weights is not None
        layers = weights.load_layers(self.path / QUANTIZED_FILE)
        state = load_file(str(self.path / "model.safetensors"))
        for name, layer in layers.items():
            state[f"{name}.weight"] = layer.dense(dtype)
        config = AutoConfig.from_pretrained(self.path)
        tokenizer = AutoTokenizer.from_pretrained(self.path)
        model_class = getattr(transformers, config.architectures[0])  # the cache names it (_save_converted)
        model = model_class.from_pretrained(None, config=config, state_dict=state, dtype=dtype, device_map=str(device))
        model.generation_config = GenerationConfig.from_pretrained(self.path)
        weights.attach(model, layers)
        return model, tokenizer


def cache_path(path: Path, cache_dir: Path, packed_for: str | None = None) -> Path:
    """Keyed by content (size, head and tail bytes), transformers version and, when packed, the
    --weights choice and the codes' layout; not by path or mtime."""
    size = path.stat().st_size
    packing = f":{packed_for}:{LAYOUT_VERSION}" if packed_for else ""
    digest = hashlib.sha256(f"{_CACHE_FORMAT}:{transformers.__version__}:{size}{packing}".encode())
    with path.open("rb") as f:
        digest.update(f.read(_HASHED_BYTES))
        f.seek(max(0, size - _HASHED_BYTES))
        digest.update(f.read(_HASHED_BYTES))
    suffix = f"-{packed_for}" if packed_for else ""
    return cache_dir / "models" / f"{path.stem}-{digest.hexdigest()[:16]}{suffix}"


def _gguf_to_hf(path: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    logger.info("converting GGUF %s (once: the result is cached)", path)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    if restored := restore_added_tokens(tokenizer, path):
        logger.info("restored %d control/user-defined GGUF tokens the conversion left out", restored)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model, tokenizer


def _save_converted(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    out: Path,
    layers: dict[str, QuantizedWeight] | None = None,
) -> None:
    """The converted model in `out`; with `layers`, packed: their codes in `quantized.safetensors`
    and every other tensor in `model.safetensors`."""
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are dequantized: a reload must not look for a GGUF
    # A complete transformers directory: tools that pick the class from the config
    # (`transformers serve`, guidellm's tokenizer loading) can open it too.
    config.architectures = [type(model).__name__]
    config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    tensors = checkpoint_tensors(model)
    if layers is not None:
        for name in layers:
            del tensors[f"{name}.weight"]
        weights.save_layers(layers, out / QUANTIZED_FILE)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def checkpoint_tensors(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The model's tensors as a Hub checkpoint names them: one storage shared by several names
    (a tied output projection) is stored once, under the input embedding's name, as the original
    checkpoint has it. Other loaders, vLLM among them, re-tie `lm_head` from `model.embed_tokens`
    and ignore an `lm_head.weight`: stored under that name alone, the embedding read as missing
    and every logit came out equal."""
    names: dict[int, list[str]] = {}
    state = model.state_dict()
    for name, tensor in state.items():
        names.setdefault(tensor.data_ptr(), []).append(name)
    kept = [next((n for n in group if "embed" in n), group[0]) for group in names.values()]
    return {name: state[name].detach().contiguous() for name in kept}


def _build_atomically(cache: Path, build: Callable[[Path], None], source: Path) -> None:
    """Build into a temp dir beside `cache` and rename it into place, so a crash
    never leaves a half-written cache; a concurrent builder that won keeps its copy."""
    cache.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(cache.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".{cache.name}.", suffix=".tmp", dir=cache.parent))
    try:
        build(tmp)
        marker = {"format": _CACHE_FORMAT, "source": str(source), "transformers": transformers.__version__}
        (tmp / MARKER).write_text(json.dumps(marker, indent=2))
        if cache.exists() and not (cache / MARKER).is_file():
            shutil.rmtree(cache)
        try:
            os.rename(tmp, cache)
        except OSError:
            if not (cache / MARKER).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _remove_stale_temps(models_dir: Path) -> None:
    """Temp dirs left by crashed builds; recent ones may belong to a live builder."""
    cutoff = time.time() - _STALE_TMP_SECONDS
    for tmp in models_dir.glob(".*.tmp"):
        try:
            if tmp.is_dir() and tmp.stat().st_mtime < cutoff:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass
