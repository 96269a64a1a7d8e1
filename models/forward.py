"""One packed forward of an HF causal LM over ragged rows, reading and writing a `KVCache`."""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from models.kv_cache import KVCache, StepLayout, text_config
from models.llama import LlamaForward

# Config fields of models whose logits are not plain `lm_head(h)` (Gemma's softcap, Cohere's and
# Granite's scales): `forward_with_hidden` would get them wrong, so a head cannot serve them.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def cache_kwargs(module, cache) -> dict:
    """`{name: cache}` for `module(...)`, under the name its forward takes the KV cache by.

    Recent transformers call it `cache` and only warn on `past_key_values`; earlier 5.x
    releases (5.17, on the GPU image) know only `past_key_values`, and there a `cache=` falls
    into `**kwargs` unread, so attention sees the step's own keys instead of the pool."""
    return {_cache_keyword(type(module)): cache}


_CACHE_KEYWORDS: dict[type, str] = {}


def _cache_keyword(cls: type[torch.nn.Module]) -> str:
    if cls not in _CACHE_KEYWORDS:
        parameters = inspect.signature(cls.forward).parameters
        names = [name for name in ("cache", "past_key_values") if name in parameters]
        if not names:
            raise TypeError(f"{cls.__name__}.forward takes no KV cache argument (`cache` or `past_key_values`)")
        _CACHE_KEYWORDS[cls] = names[0]
    return _CACHE_KEYWORDS[cls]


def lean_forward(model) -> LlamaForward | None:
    """specd's own forward for `model` (built once), or None where transformers' must run."""
    if model not in _LEAN:
        # Outside inference mode: the fused weights become the model's own parameters (views).
        with torch.inference_mode(False), torch.no_grad():
            _LEAN[model] = LlamaForward.build(model) if USE_LEAN_FORWARD else None
    return _LEAN[model]


# Whether models specd knows run its own forward (`models.llama`); False runs transformers' everywhere.
USE_LEAN_FORWARD = True
_LEAN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@torch.inference_mode()
def forward_step(
    model,
    cache: KVCache,
    layout: StepLayout,
    input_ids: torch.Tensor,
    keep: torch.Tensor | int,
    float_logits: bool = True,
) -> torch.Tensor:
    """Run a step's packed tokens `input_ids` `[T]` (already on the device) through `model`.

    `layout` says where each token lives (pool row, position) and how rows are
    grouped for attention. `keep` are indices into the packed order whose
    logits are wanted (the lm_head runs only on those; 0 = all). Returns
    logits `[len(keep), vocab]`, float32 unless `float_logits` is False (then the model's
    dtype: greedy decoding needs only their argmax, and converting 176 x 49k bf16 logits
    to float32 cost a 176-token verify step 11 ms on 2 cores).
    """
    lean = lean_forward(model)
    logits = lean(cache, layout, input_ids, keep)[0] if lean is not None else None
    if logits is None:
        logits = hf_forward_step(model, cache, layout, input_ids, keep)
    return logits.float() if float_logits else logits


def refuse_transformers_forward(model) -> None:
    """Make transformers' own forward of `model` (and of its decoder) raise: the loader freed dense
    weights it would read (`ModelConfig.keep_dense_weights`). A meta weight would not stop it: a
    CPU product with one returned a tensor of unset values instead of failing."""

    def refuse(module, args) -> None:
        raise RuntimeError(
            f"{type(module).__name__}'s dense weights were freed for serving (keep_dense_weights=False): "
            "only specd's own forward runs it"
        )

    model.register_forward_pre_hook(refuse)
    model.get_decoder().register_forward_pre_hook(refuse)


@torch.inference_mode()
def hf_forward_step(
    model, cache: KVCache, layout: StepLayout, input_ids: torch.Tensor, keep: torch.Tensor | int
) -> torch.Tensor:
    """`forward_step` through transformers' own forward (any decoder that uses the attention interface)."""
    with laid_out(cache, layout):
        out = model(
            input_ids=input_ids[None],
            position_ids=layout.token_pos[None],
            **cache_kwargs(model, cache),
            use_cache=True,
            logits_to_keep=keep,
            specd_layout=layout,
        )
    return out.logits[0]


@torch.inference_mode()
def forward_with_hidden(
    model,
    cache: KVCache,
    layout: StepLayout,
    input_ids: torch.Tensor,
    keep: torch.Tensor,
    layers: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`forward_step`'s logits `[len(keep), vocab]` (float32) and, from the same forward, every packed
    token's hidden state: the last one `[T, H]` (after the final norm: what the lm_head reads),
    or with `layers` (indices into the model's `hidden_states`) those layers' side by side
    `[T, len(layers) H]`. The base model runs once and the output layer only on the `keep` rows."""
    lean = lean_forward(model)
    if lean is not None:
        logits, hidden = lean(cache, layout, input_ids, keep, layers or ())
        return logits.float(), hidden
    return hf_forward_with_hidden(model, cache, layout, input_ids, keep, layers)


@torch.inference_mode()
def hf_forward_with_hidden(
    model,
    cache: KVCache,
    layout: StepLayout,
    input_ids: torch.Tensor,
    keep: torch.Tensor,
    layers: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`forward_with_hidden` through transformers' own forward."""
    decoder = model.get_decoder()
    with laid_out(cache, layout), captured_layers(decoder, layers or ()) as states:
        out = decoder(
            input_ids=input_ids[None],
            position_ids=layout.token_pos[None],
            **cache_kwargs(decoder, cache),
            use_cache=True,
            specd_layout=layout,
        )
    last = out.last_hidden_state[0]
    hidden = side_by_side(states, out.last_hidden_state, layers)[0] if layers else last
    logits = model.get_output_embeddings()(last.index_select(0, keep))
    return logits.float(), hidden


@contextmanager
def captured_layers(decoder, layers: Sequence[int]) -> Iterator[dict[int, torch.Tensor]]:
    """{i: [B, T, H] output of decoder layer i (counting from 1)} for the forward run inside, for
    each i in `layers` below the last (index L is the final norm's output, `last_hidden_state`:
    see `side_by_side`). Hooks keep only these layers' states, where `output_hidden_states`
    would keep all L + 1."""
    states: dict[int, torch.Tensor] = {}
    hooks = []
    for i in layers:
        if not 1 <= i <= len(decoder.layers):
            raise ValueError(f"layer {i} is not one of the model's 1..{len(decoder.layers)}")
        if i < len(decoder.layers):

            def keep_output(module, args, output, i=i) -> None:
                states[i] = output[0] if isinstance(output, tuple) else output

            hooks.append(decoder.layers[i - 1].register_forward_hook(keep_output))
    try:
        yield states
    finally:
        for hook in hooks:
            hook.remove()


def side_by_side(states: dict[int, torch.Tensor], last: torch.Tensor, layers: Sequence[int]) -> torch.Tensor:
    """`captured_layers`' states of `layers` concatenated on the last dim, `last` (the
    decoder's `last_hidden_state`) standing for the last layer's index."""
    return torch.cat([states.get(i, last) for i in layers], dim=-1)


def check_plain_logits(model) -> None:
    """Raise ValueError for a model `forward_with_hidden` cannot reproduce (see LOGIT_TRANSFORMS)."""
    config = text_config(model.config)
    for name in LOGIT_TRANSFORMS:
        if getattr(config, name, None) not in (None, 1, 1.0):
            raise ValueError(f"{type(model).__name__} transforms its logits ({name}); a draft head cannot serve it")


@contextmanager
def laid_out(cache: KVCache, layout: StepLayout) -> Iterator[None]:
    """The cache writes and attention reads where `layout` says, for one forward."""
    cache.layout = layout
    try:
        yield
    finally:
        cache.layout = None


def last_token_index(token_lists: list[list[int]]) -> list[int]:
    """Packed index of each row's last token."""
    index, offset = [], 0
    for tokens in token_lists:
        offset += len(tokens)
        index.append(offset - 1)
    return index
