"""Which format each weight is served in (`--weights`), and putting a model's weights in it.

- `bf16`: every weight dense, in the served dtype (`--dtype`: bfloat16, or float32 on CPUs
  without native bf16). What specd did before quantized layers existed.
- `int8` / `int6` / `int4`: every linear layer of the decoder quantized (`models.quantized`), the output
  projection in int8 (logits are where 4-bit error shows first: llama.cpp's Q4_K_M keeps its
  output at 6 bits for the same reason), unless it is the input embedding too. The embedding is
  a gather of a few rows, nothing to gain: it stays dense.
- `auto`: a GGUF's quantized linear layers stay quantized, each in the format that holds its
  values (Q4_K: int4k, its own blocks in the kernels' tiles; other 4-bit and smaller types: int4;
  Q6_K and Q5_0, symmetric grids of 64 levels or fewer: int6; Q5_1, Q5_K and 8-bit types: int8),
  the output projection in int8 where its type is 4-bit,
  and the rest stays dense: float tensors, the embedding, and an output projection that is the
  embedding (a tied model's); a float checkpoint (a Hub id or a directory) stays as it is.

A draft model has its own choice (`--draft-weights`, `draft_formats`): its weights only steer
acceptance, so by default it is int4 throughout, output projection included.

A GGUF's quantized layers are packed once into its converted cache (`models.gguf_cache`:
`save_layers`, read back by `load_layers`); other checkpoints are quantized at each load (`apply`).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from models.linear_kernels import TunedLinear
from models.quantized import (
    INT4,
    INT4K,
    INT6,
    INT8,
    Q4_K_BLOCK_BYTES,
    SUPER,
    Int4KWeight,
    QuantizedWeight,
    TiledWeight,
    kernels_available,
    quantize,
    restore,
)

logger = logging.getLogger("specd.models")

WEIGHTS = ("auto", "bf16", "int8", "int6", "int4")
QUANTIZED_FORMATS = (INT8, INT6, INT4)
BF16 = "bf16"  # every weight dense, in the served dtype

# GGUF tensor types by the format (`models.quantized`) nearest their bits per weight.
_GGUF_INT4 = {"Q4_0", "Q4_1", "Q4_K", "Q3_K", "Q2_K", "IQ4_NL", "IQ4_XS", "IQ3_S", "IQ3_XXS", "IQ2_XXS", "IQ2_XS",
              "IQ2_S", "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0"}  # fmt: skip
_GGUF_INT6 = {"Q6_K", "Q5_0"}  # codes times a scale: int6 holds their values (`Int6Weight`)
_GGUF_INT8 = {"Q5_1", "Q5_K", "Q8_0", "Q8_1", "Q8_K"}  # Q5_1 and Q5_K add a minimum: on int6's grid they would move
# GGUF tensor names of a Llama-family decoder -> the transformers module they load into.
_GGUF_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
_GGUF_MODULES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
OUTPUT = "output"  # the plan's key for the output projection

Plan = dict[str, str]  # module name (or OUTPUT) -> INT8 | INT6 | INT4 | INT4K; absent: dense


def gguf_format(kind: str, output: bool = False) -> str | None:
    """The format `auto` keeps a GGUF tensor of type `kind` in (None: a float type, kept dense);
    an `output` projection of a 4-bit type in int8."""
    if kind in _GGUF_INT4:
        return INT8 if output else INT4K if kind == "Q4_K" else INT4
    return INT6 if kind in _GGUF_INT6 else INT8 if kind in _GGUF_INT8 else None


def _gguf_tensors(path: Path) -> dict[str, Any]:
    """A GGUF's linear-layer tensors (gguf's `ReaderTensor`s, read lazily) by the plan's key:
    the transformers module they load into, or OUTPUT."""
    import gguf  # transformers' own GGUF reader dependency

    found: dict[str, Any] = {}
    for tensor in gguf.GGUFReader(path).tensors:
        if tensor.name == "output.weight":
            found[OUTPUT] = tensor
        elif (match := _GGUF_LAYER.fullmatch(tensor.name)) and match[2] in _GGUF_MODULES:
            found[f"model.layers.{match[1]}.{_GGUF_MODULES[match[2]]}"] = tensor
    return found


def gguf_plan(path: Path) -> Plan:
    """`auto` for a GGUF: each quantized tensor in the format that holds its values."""
    plan: Plan = {}
    for key, tensor in _gguf_tensors(path).items():
        if (fmt := gguf_format(tensor.tensor_type.name, key == OUTPUT)) is not None:
            plan[key] = fmt
    return plan


def uniform_plan(model: Any, fmt: str, output: str = INT8) -> Plan:
    """Every linear layer of the decoder in `fmt`, the output projection in `output` (dense where
    it is the input embedding's weight too: quantizing it would change the embedding, and a draft
    head made for the model checks that it has not changed)."""
    head = model.get_output_embeddings()
    plan: Plan = {name: fmt for name, m in model.named_modules() if isinstance(m, nn.Linear) and m is not head}
    if head.weight is not model.get_input_embeddings().weight:
        plan[OUTPUT] = output
    return plan


def quantizes(choice: str, from_gguf: bool, device: torch.device) -> bool:
    """Whether `--weights choice` quantizes layers of a model on `device` (warns where it cannot)."""
    if choice not in WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}; got {choice!r}")
    if choice == BF16 or (choice == "auto" and not from_gguf):
        return False
    if device.type != "cpu":
        logger.warning("--weights %s: the weight-only kernels are CPU-only here; serving dense weights", choice)
        return False
    if not kernels_available():
        logger.warning(
            "--weights %s: specd's weight-only kernels are not built here (they need x86 with AVX2 and a C++ "
            "compiler); serving dense weights",
            choice,
        )
        return False
    return True


def plan_for(choice: str, model: Any, gguf_path: Path | None, device: torch.device, output: str | None = None) -> Plan:
    """The plan `--weights choice` means for `model` (loaded from `gguf_path`, if from a GGUF);
    `output`: the output projection's format where `choice` quantizes uniformly (None: int8)."""
    if not quantizes(choice, gguf_path is not None, device):
        return {}
    if choice == "auto":
        assert gguf_path is not None
        try:
            return gguf_plan(gguf_path)
        except (ValueError, OSError) as exc:  # transformers read it; gguf's own reader did not
            logger.warning("--weights auto: cannot read %s's tensor types (%s); serving dense weights", gguf_path, exc)
            return {}
    return uniform_plan(model, choice, output or INT8)


def draft_formats(choice: str, device: torch.device) -> tuple[str, str | None]:
    """(weights, output) a draft model loads with for `--draft-weights choice`. A draft's weights
    decide how many of its tokens the target accepts, never what is served, so `auto` reads the
    fewest bytes: int4 throughout, output projection included, where the weight-only kernels run
    (dense elsewhere, without a warning); int8 / int6 / int4 quantize its output projection alike."""
    if choice == "auto":
        choice = INT4 if device.type == "cpu" and kernels_available() else BF16
    return choice, (choice if choice in QUANTIZED_FORMATS else None)


def packing_name(choice: str, output: str | None) -> str:
    """The name a packed cache is kept under for `choice` (and an output format other than int8)."""
    return choice if output in (None, INT8) or choice not in QUANTIZED_FORMATS else f"{choice}-{output}-output"


@torch.no_grad()
def quantize_layers(model: Any, plan: Plan, gguf_path: Path | None = None) -> dict[str, QuantizedWeight]:
    """Copies of `model`'s planned linear layers in their formats, from their weights as they are;
    keyed by module name. An int4k layer is read from `gguf_path`'s Q4_K blocks, where its values
    are the layer's (else it is requantized in int4). A layer whose inputs are not in whole groups
    stays dense (absent), as does an output projection that is the input embedding too."""
    output = model.get_output_embeddings()
    tied = output.weight is model.get_input_embeddings().weight
    modules = dict(model.named_modules())
    output_name = next(name for name, module in modules.items() if module is output)
    tensors = _gguf_tensors(gguf_path) if gguf_path is not None and INT4K in plan.values() else {}
    layers: dict[str, QuantizedWeight] = {}
    for key, fmt in plan.items():
        name = output_name if key == OUTPUT else key
        layer = modules.get(name)
        if not isinstance(layer, nn.Linear) or (layer is output and tied):
            continue
        copy: QuantizedWeight | None = _from_q4_k(tensors.get(key), layer.weight) if fmt == INT4K else None
        if copy is None:
            copy = quantize(layer.weight, INT4 if fmt == INT4K else fmt)
        if copy is not None:
            layers[name] = copy
    return layers


def _from_q4_k(tensor: Any, weight: torch.Tensor) -> Int4KWeight | None:
    """`weight`'s Q4_K blocks as an int4k copy; None where the file's tensor is not its Q4_K
    form (absent, another type or shape, or rows transformers reordered: a Llama GGUF's q and k)."""
    if tensor is None or tensor.tensor_type.name != "Q4_K" or not Int4KWeight.fits(weight):
        return None
    n, k = weight.shape
    blocks = n * k // SUPER * Q4_K_BLOCK_BYTES
    copy = Int4KWeight.from_q4_k(tensor.data, n, k) if tensor.data.size == blocks else None
    if copy is None or not torch.equal(copy.dense(torch.float32), weight.float()):
        logger.debug("%s: its Q4_K blocks do not hold its values; requantized in int4", tensor.name)
        return None
    return copy


def attach(model: Any, layers: dict[str, QuantizedWeight]) -> None:
    """Give each named layer its weight-only copy. Its dense weight must already hold the values
    the codes stand for (`QuantizedWeight.dense`): the model served is the quantized one whichever
    kernel a step runs."""
    modules = dict(model.named_modules())
    for name, copy in layers.items():
        layer = modules[name]
        if type(layer) is nn.Linear:
            layer.__class__ = TunedLinear
        layer.quantized_weight = copy


@torch.no_grad()
def apply(model: Any, plan: Plan, dtype: torch.dtype) -> None:
    """Quantize `model`'s planned linear layers in place: each keeps a weight-only copy and its
    dense weight becomes the values those codes stand for, rounded to `dtype` (in bfloat16 the two
    kernels differ by that rounding, as step shapes do)."""
    layers = quantize_layers(model, plan)
    modules = dict(model.named_modules())
    for name, copy in layers.items():
        modules[name].weight.data.copy_(copy.dense(dtype))
    attach(model, layers)


# --- the packed form on disk (`models.loader`'s cache of a quantized GGUF) --------------------


def save_layers(layers: dict[str, QuantizedWeight], path: Path) -> None:
    """Each copy's tensors as `<module>.<i>`, its format and rows in the file's metadata."""
    tensors: dict[str, torch.Tensor] = {}
    index: dict[str, tuple[str, int, int]] = {}
    for name, copy in layers.items():
        if not isinstance(copy, TiledWeight):
            raise TypeError(f"{name}: only single-format copies are saved, not {type(copy).__name__}")
        for i, tensor in enumerate(copy.tensors):
            tensors[f"{name}.{i}"] = tensor.contiguous()
        index[name] = (copy.fmt, copy.out_features, len(copy.tensors))
    save_file(tensors, str(path), metadata={"format": "specd-quantized", "layers": json.dumps(index)})


def load_layers(path: Path) -> dict[str, QuantizedWeight]:
    """What `save_layers` wrote."""
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
        if metadata.get("format") != "specd-quantized":
            raise ValueError(f"{path} does not hold specd's quantized layers")
        index = json.loads(metadata["layers"])
        return {
            name: restore(fmt, [f.get_tensor(f"{name}.{i}") for i in range(parts)], rows)
            for name, (fmt, rows, parts) in index.items()
        }
