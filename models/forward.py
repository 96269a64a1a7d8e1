"""One packed forward of an HF causal LM over ragged rows, reading and writing a `KVCache`."""

from __future__ import annotations

import torch

from models.kv_cache import KVCache, StepLayout


@torch.inference_mode()
def forward_step(
    model, cache: KVCache, layout: StepLayout, input_ids: torch.Tensor, keep: torch.Tensor | int
) -> torch.Tensor:
    """Run a step's packed tokens `input_ids` `[T]` (already on the device) through `model`.

    `layout` says where each token lives (pool row, position) and how rows are
    grouped for attention. `keep` are indices into the packed order whose
    logits are wanted (the lm_head runs only on those; 0 = all). Returns
    float32 logits `[len(keep), vocab]`.
    """
    cache.layout = layout
    try:
        out = model(
            input_ids=input_ids[None],
            position_ids=layout.token_pos[None],
            cache=cache,
            use_cache=True,
            logits_to_keep=keep,
            specd_layout=layout,
        )
    finally:
        cache.layout = None
    return out.logits[0].float()


def last_token_index(token_lists: list[list[int]]) -> list[int]:
    """Packed index of each row's last token."""
    index, offset = [], 0
    for tokens in token_lists:
        offset += len(tokens)
        index.append(offset - 1)
    return index
