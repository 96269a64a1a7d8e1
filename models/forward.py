"""One packed forward of an HF causal LM over ragged rows, reading and writing a `KVCache`."""

from __future__ import annotations

import torch

from models.kv_cache import KVCache, StepLayout


@torch.inference_mode()
def packed_forward(
    model,
    cache: KVCache,
    slots: list[int],
    starts: list[int],
    token_lists: list[list[int]],
    keep: list[int],
) -> torch.Tensor:
    """Run rows' new tokens through `model` in one forward.

    Row b writes `token_lists[b]` at positions `starts[b]..` of slot `slots[b]`
    and attends to everything before them in that slot. `keep` are indices
    into the packed token order whose logits are wanted (the lm_head runs only
    on those). Returns float32 logits [len(keep), vocab].
    """
    device = cache.keys[0].device
    layout = StepLayout.build(slots, starts, [len(t) for t in token_lists], device)
    input_ids = torch.tensor([[t for tokens in token_lists for t in tokens]], dtype=torch.long, device=device)
    keep_index = torch.tensor(keep, dtype=torch.long, device=device)
    cache.layout = layout
    try:
        out = model(
            input_ids=input_ids,
            position_ids=layout.token_pos[None],
            cache=cache,
            use_cache=True,
            logits_to_keep=keep_index,
            specd_layout=layout,
        )
    finally:
        cache.layout = None
    return out.logits[0].float()  # [len(keep), vocab]


def last_token_index(token_lists: list[list[int]]) -> list[int]:
    """Packed index of each row's last token."""
    index, offset = [], 0
    for tokens in token_lists:
        offset += len(tokens)
        index.append(offset - 1)
    return index
