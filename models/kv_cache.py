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

from models.transfer import DeviceArrays, HostBuffer

ATTN_IMPLEMENTATION = "specd"


# Rows whose queries are padded into one attention call: more new tokens than
# this and a row is attended on its own, so a prefill chunk never pads its
# decode neighbours' queries to its length (covers a verify of 1 + 16 drafts).
# Decode rows and verify rows are grouped separately for the same reason.
SHORT_ROW_TOKENS = 17
# Empty slots bridged to keep neighbouring short rows in one call: a hole costs
# reading its keys, a separate call costs fixed per-layer launches.
MAX_BRIDGED_KEYS = 4096


@dataclass
class GroupPlan:
    """Host side of one attention call over consecutive slots lo..lo + num_slots."""

    slot_lo: int
    num_slots: int
    max_q: int
    max_kv: int
    grid_start: list[int]  # [num_slots] first new position of each grid row (0 for holes)
    token_index: list[int] | None  # packed index of the group's tokens; None: all tokens, in order
    pad_index: list[int] | None  # each token's cell in the [num_slots * max_q] grid; None: no padding


@dataclass
class LayoutPlan:
    """Where each packed token of one forward lives, before upload. T tokens, B rows."""

    token_slot: list[int]
    token_pos: list[int]
    groups: list[GroupPlan]

    @classmethod
    def build(cls, slots: list[int], starts: list[int], lens: list[int]) -> LayoutPlan:
        token_slot: list[int] = []
        token_pos: list[int] = []
        offsets = []
        for slot, start, n in zip(slots, starts, lens):
            offsets.append(len(token_slot))
            token_slot += [slot] * n
            token_pos += range(start, start + n)
        rows = range(len(slots))
        # Decode rows (1 token) and verify rows (a few) are grouped apart: one
        # verify run in a group would pad every decode row's queries to its length.
        runs: list[list[int]] = []
        for kind in (lambda n: n == 1, lambda n: 1 < n <= SHORT_ROW_TOKENS):
            kind_runs: list[list[int]] = []
            for b in sorted((b for b in rows if kind(lens[b])), key=lambda b: slots[b]):
                if kind_runs:
                    prev = kind_runs[-1][-1]
                    holes = slots[b] - slots[prev] - 1
                    max_kv = max(starts[r] + lens[r] for r in kind_runs[-1] + [b])
                    if holes * max_kv <= MAX_BRIDGED_KEYS:
                        kind_runs[-1].append(b)
                        continue
                kind_runs.append([b])
            runs += kind_runs
        runs += [[b] for b in rows if lens[b] > SHORT_ROW_TOKENS]
        total = len(token_slot)
        groups = [cls._group(run, slots, starts, lens, offsets, total) for run in runs]
        return cls(token_slot, token_pos, groups)

    @staticmethod
    def _group(run, slots, starts, lens, offsets, total) -> GroupPlan:
        lo = slots[run[0]]
        num_slots = slots[run[-1]] - lo + 1
        max_q = max(lens[b] for b in run)
        grid_start = [0] * num_slots
        token_index: list[int] = []
        pad_index: list[int] = []
        for b in run:
            cell = slots[b] - lo
            grid_start[cell] = starts[b]
            token_index += range(offsets[b], offsets[b] + lens[b])
            pad_index += range(cell * max_q, cell * max_q + lens[b])
        in_order = token_index == list(range(total))
        return GroupPlan(
            slot_lo=lo,
            num_slots=num_slots,
            max_q=max_q,
            max_kv=max(starts[b] + lens[b] for b in run),
            grid_start=grid_start,
            token_index=None if in_order else token_index,
            pad_index=None if len(pad_index) == num_slots * max_q else pad_index,
        )

    def add_to(self, buf: HostBuffer, prefix: str) -> None:
        buf.ints(f"{prefix}.token_slot", self.token_slot)
        buf.ints(f"{prefix}.token_pos", self.token_pos)
        for i, g in enumerate(self.groups):
            buf.ints(f"{prefix}.{i}.grid_start", g.grid_start)
            if g.token_index is not None:
                buf.ints(f"{prefix}.{i}.token_index", g.token_index)
            if g.pad_index is not None:
                buf.ints(f"{prefix}.{i}.pad_index", g.pad_index)

    def resolve(self, arrays: DeviceArrays, prefix: str) -> StepLayout:
        groups = [
            AttentionGroup(
                plan=g,
                grid_start=arrays[f"{prefix}.{i}.grid_start"],
                token_index=None if g.token_index is None else arrays[f"{prefix}.{i}.token_index"],
                pad_index=None if g.pad_index is None else arrays[f"{prefix}.{i}.pad_index"],
            )
            for i, g in enumerate(self.groups)
        ]
        return StepLayout(arrays[f"{prefix}.token_slot"], arrays[f"{prefix}.token_pos"], groups)


@dataclass
class AttentionGroup:
    """One attention call: queries of rows on slots lo.. padded into a grid,
    keys read in place from those slots (a view: no copy)."""

    plan: GroupPlan
    grid_start: torch.Tensor  # [num_slots]
    token_index: torch.Tensor | None
    pad_index: torch.Tensor | None
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        """[num_slots, 1, max_q, max_kv] bool: query i of a row sees keys 0..start + i.

        Padded queries and empty slots see the same causal range (key 0 at
        least, so no row is all-masked); their outputs are discarded.
        """
        if sliding_window not in self._masks:
            device = self.grid_start.device
            q_pos = self.grid_start[:, None] + torch.arange(self.plan.max_q, device=device)  # [S, max_q]
            k_pos = torch.arange(self.plan.max_kv, device=device)
            visible = k_pos[None, None, :] <= q_pos[:, :, None]
            if sliding_window:
                visible &= k_pos[None, None, :] > q_pos[:, :, None] - sliding_window
                visible[:, :, 0] |= ~visible.any(-1)
            self._masks[sliding_window] = visible[:, None]
        return self._masks[sliding_window]


@dataclass
class StepLayout:
    """A resolved `LayoutPlan`: device tensors the cache and attention read each layer."""

    token_slot: torch.Tensor  # [T]
    token_pos: torch.Tensor  # [T]
    groups: list[AttentionGroup]

    @classmethod
    def build(cls, slots: list[int], starts: list[int], lens: list[int], device: torch.device) -> StepLayout:
        """Plan and upload in one go (for callers outside a runner step)."""
        plan = LayoutPlan.build(slots, starts, lens)
        buf = HostBuffer()
        plan.add_to(buf, "layout")
        return plan.resolve(buf.upload(device), "layout")


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
    def for_model(cls, config, num_slots: int, max_len: int, dtype: torch.dtype, device: torch.device) -> KVCache:
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
        """Write the step's new keys/values into their slots; return the whole
        storage, which `ragged_attention` reads in place, group by group."""
        layout = self.layout
        assert layout is not None, "KVCache.update outside a runner step"
        k_store, v_store = self.keys[layer_idx], self.values[layer_idx]
        # key_states: [1, kv_heads, T, head_dim] -> [T, kv_heads, head_dim]
        k_store[layout.token_slot, :, layout.token_pos] = key_states[0].transpose(0, 1)
        v_store[layout.token_slot, :, layout.token_pos] = value_states[0].transpose(0, 1)
        return k_store, v_store

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self.layout is None else max(g.plan.max_kv for g in self.layout.groups)


def ragged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention over a packed batch: query [1, H, T, D]; key/value the whole
    cache storage [slots, KVH, max_len, D] from `KVCache.update`. Each group
    reads its rows' keys as a slice of that storage. Returns ([1, T, H, D], None)
    as HF attention functions do."""
    layout: StepLayout = kwargs["specd_layout"]
    q = query[0].transpose(0, 1)  # [T, H, D]
    num_tokens, num_heads, head_dim = q.shape
    sliding_window = getattr(module, "sliding_window", None)
    if len(layout.groups) == 1 and layout.groups[0].token_index is None:
        return _attend_group(layout.groups[0], q, key, value, scaling, sliding_window).unsqueeze(0), None
    out = q.new_empty(num_tokens, num_heads, head_dim)
    for group in layout.groups:
        q_group = q if group.token_index is None else q.index_select(0, group.token_index)
        out_group = _attend_group(group, q_group, key, value, scaling, sliding_window)
        if group.token_index is None:
            out = out_group
        else:
            out.index_copy_(0, group.token_index, out_group)
    return out.unsqueeze(0), None


def _attend_group(group: AttentionGroup, q, k_store, v_store, scaling, sliding_window) -> torch.Tensor:
    """q [n, H, D] (the group's tokens) -> [n, H, D]."""
    plan = group.plan
    num_heads, head_dim = q.shape[1], q.shape[2]
    s, max_q = plan.num_slots, plan.max_q
    if group.pad_index is None:
        grid = q.reshape(s, max_q, num_heads, head_dim)
    else:
        grid = q.new_zeros(s * max_q, num_heads, head_dim)
        grid[group.pad_index] = q
        grid = grid.view(s, max_q, num_heads, head_dim)
    grid = grid.transpose(1, 2)  # [S, H, max_q, D]
    lo = plan.slot_lo
    key = k_store[lo : lo + s, :, : plan.max_kv]  # a view: keys are read where they are
    value = v_store[lo : lo + s, :, : plan.max_kv]
    gqa = key.shape[1] != num_heads
    if s == 1 and plan.grid_start == [0] and not sliding_window:
        # A whole prompt on its own: plain causal attention, flash-eligible on CUDA.
        out = F.scaled_dot_product_attention(grid, key, value, is_causal=True, scale=scaling, enable_gqa=gqa)
    elif _prefers_grouped(q, s, max_q, plan.max_kv):
        out = _grouped_attention(grid, key, value, group.mask(sliding_window), scaling)
    else:
        out = F.scaled_dot_product_attention(
            grid, key, value, attn_mask=group.mask(sliding_window), scale=scaling, enable_gqa=gqa
        )  # [S, H, max_q, D]
    out = out.transpose(1, 2).reshape(s * max_q, num_heads, head_dim)
    return out if group.pad_index is None else out[group.pad_index]


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
