"""Preallocated per-slot KV cache and the ragged attention that reads it.

Layout: per layer, K and V of shape [num_slots, num_kv_heads, max_len, head_dim].
A running sequence owns one slot. The cache keeps no lengths of its own: each
step the runner says where every token goes (`StepLayout`), taken from the
scheduler's `num_computed_tokens`. Rolling back rejected drafts is therefore
O(1): the scheduler moves the length back and the next step overwrites.

The model runs one packed forward, `input_ids` of shape [1, T] holding every
row's tokens back to back. `KVCache.update` (called by each HF attention layer)
scatters the new keys/values into the slots and returns the rows' cached K/V;
`ragged_attention` (registered with transformers' `AttentionInterface` as
"specd") pads queries per row only inside attention, so the MLPs never compute
on padding.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTN_IMPLEMENTATION = "specd"


@dataclass
class StepLayout:
    """Where each packed token of one forward lives. T tokens, B rows."""

    token_slot: torch.Tensor  # [T] slot of each token
    token_pos: torch.Tensor  # [T] position of each token in its sequence
    row_slot: torch.Tensor  # [B]
    row_start: torch.Tensor  # [B] first new position of the row
    row_len: torch.Tensor  # [B] new tokens of the row
    pad_index: torch.Tensor  # [T] index of each token in the [B * max_q] padded grid
    max_q: int
    max_kv: int  # keys to attend over: max(row_start + row_len)
    contiguous_slots: bool  # row_slot == arange(B): cache views need no gather
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def build(cls, slots: list[int], starts: list[int], lens: list[int], device: torch.device) -> "StepLayout":
        max_q = max(lens)
        token_slot, token_pos, pad_index = [], [], []
        for b, (slot, start, n) in enumerate(zip(slots, starts, lens)):
            token_slot += [slot] * n
            token_pos += range(start, start + n)
            pad_index += range(b * max_q, b * max_q + n)

        def t(xs: list[int]) -> torch.Tensor:
            return torch.tensor(xs, dtype=torch.long, device=device)

        return cls(
            token_slot=t(token_slot),
            token_pos=t(token_pos),
            row_slot=t(slots),
            row_start=t(starts),
            row_len=t(lens),
            pad_index=t(pad_index),
            max_q=max_q,
            max_kv=max(s + n for s, n in zip(starts, lens)),
            contiguous_slots=slots == list(range(len(slots))),
        )

    @property
    def num_rows(self) -> int:
        return self.row_slot.shape[0]

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        """[B, 1, max_q, max_kv] bool: query i of row b sees keys 0..start_b + i.

        Padded query positions see the same causal range; their outputs are
        discarded, and key 0 is always visible so no row is all-masked (NaN).
        """
        if sliding_window not in self._masks:
            device = self.row_start.device
            q_pos = self.row_start[:, None] + torch.arange(self.max_q, device=device)  # [B, max_q]
            k_pos = torch.arange(self.max_kv, device=device)  # [max_kv]
            visible = k_pos[None, None, :] <= q_pos[:, :, None]
            if sliding_window:
                visible &= k_pos[None, None, :] > q_pos[:, :, None] - sliding_window
                visible[:, :, 0] |= ~visible.any(-1)
            self._masks[sliding_window] = visible[:, None]
        return self._masks[sliding_window]


class KVCache:
    """Static KV storage handed to an HF model as its `cache`."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        shape = (num_slots, num_kv_heads, max_len, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_slots = num_slots
        self.max_len = max_len
        self.layout: StepLayout | None = None

    @classmethod
    def for_model(cls, config, num_slots: int, max_len: int, dtype: torch.dtype, device: torch.device) -> "KVCache":
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        return cls(config.num_hidden_layers, num_slots, num_kv_heads, head_dim, max_len, dtype, device)

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    # -- the part of HF's Cache protocol the models call --
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        layout = self.layout
        assert layout is not None, "KVCache.update outside a runner step"
        k_store, v_store = self.keys[layer_idx], self.values[layer_idx]
        # key_states: [1, kv_heads, T, head_dim] -> [T, kv_heads, head_dim]
        k_store[layout.token_slot, :, layout.token_pos] = key_states[0].transpose(0, 1)
        v_store[layout.token_slot, :, layout.token_pos] = value_states[0].transpose(0, 1)
        if layout.contiguous_slots:
            rows = slice(0, layout.num_rows)
            return k_store[rows, :, : layout.max_kv], v_store[rows, :, : layout.max_kv]
        return (
            k_store.index_select(0, layout.row_slot)[:, :, : layout.max_kv],
            v_store.index_select(0, layout.row_slot)[:, :, : layout.max_kv],
        )

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self.layout is None else self.layout.max_kv


def ragged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention over a packed batch: query [1, H, T, D]; key/value [B, KVH, max_kv, D]
    from `KVCache.update`. Returns ([1, T, H, D], None) as HF attention functions do."""
    layout: StepLayout = kwargs["specd_layout"]
    _, num_heads, num_tokens, head_dim = query.shape
    b, max_q = layout.num_rows, layout.max_q
    q = query[0].transpose(0, 1)  # [T, H, D]
    if num_tokens == b * max_q:  # no padding (e.g. every row decodes one token)
        q_pad = q.reshape(b, max_q, num_heads, head_dim)
    else:
        q_pad = q.new_zeros(b * max_q, num_heads, head_dim)
        q_pad[layout.pad_index] = q
        q_pad = q_pad.view(b, max_q, num_heads, head_dim)
    mask = layout.mask(getattr(module, "sliding_window", None))
    q_pad = q_pad.transpose(1, 2)  # [B, H, max_q, D]
    if _prefers_grouped(query, b, max_q, layout.max_kv):
        out = _grouped_attention(q_pad, key, value, mask, scaling)
    else:
        out = F.scaled_dot_product_attention(
            q_pad, key, value, attn_mask=mask, scale=scaling, enable_gqa=key.shape[1] != num_heads
        )  # [B, H, max_q, D]
    out = out.transpose(1, 2).reshape(b * max_q, num_heads, head_dim)
    if num_tokens != b * max_q:
        out = out[layout.pad_index]
    return out.unsqueeze(0), None


def _prefers_grouped(query, num_rows: int, max_q: int, max_kv: int) -> bool:
    """On CPU, SDPA's bf16/fp16 kernels are several times slower than two plain
    matmuls for decode-shaped work (measured, bf16, 500 keys: 219 vs 69 us at
    batch 1, 738 vs 94 us at batch 4), but faster for very short contexts and
    for long prefills (256 x 256: 0.97 vs 2.5 ms). float32 and GPUs use SDPA."""
    if query.device.type != "cpu" or query.dtype == torch.float32:
        return False
    return max_q < 32 and num_rows * max_kv > 160


def _grouped_attention(q, key, value, mask, scaling):
    """Plain attention with GQA folded into the query axis, softmax in float32."""
    b, num_heads, max_q, head_dim = q.shape
    kv_heads = key.shape[1]
    groups = num_heads // kv_heads
    q = q.reshape(b, kv_heads, groups * max_q, head_dim)
    scores = torch.matmul(q, key.transpose(-1, -2)).float()  # [B, KVH, groups * max_q, max_kv]
    scores *= scaling if scaling is not None else head_dim**-0.5
    grouped = scores.view(b, kv_heads, groups, max_q, -1)
    grouped.masked_fill_(~mask[:, :, None], float("-inf"))  # mask [B, 1, max_q, max_kv] broadcasts over heads
    probs = scores.softmax(-1).to(value.dtype)
    return torch.matmul(probs, value).reshape(b, num_heads, max_q, head_dim)


AttentionInterface.register(ATTN_IMPLEMENTATION, ragged_attention)
