"""Paged KV cache and the ragged attention that reads it.

Layout: per layer, K and V pools of shape [num_kv_heads, num_blocks * block_size,
head_dim]: a pool of fixed-size blocks, position p of a sequence at row
`block_ids[p // block_size] * block_size + p % block_size`. The scheduler owns
the block tables (`scheduler.kv_blocks`); the cache keeps no lengths of its own:
each step the runner says where every token goes (`StepLayout`), from the
scheduler's `num_computed_tokens`. Rolling back rejected drafts is O(1): the
scheduler moves the length back and the next step overwrites those positions.

The model runs one packed forward, `input_ids` of shape [1, T] holding every
row's tokens back to back. `KVCache.update` (called by each HF attention layer)
writes the new keys/values into their blocks and returns the pools;
`ragged_attention` (registered with transformers' `AttentionInterface` as
"specd") reads each row's keys through its block table and pads queries per
row only inside attention, so the MLPs never compute on padding.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from models import host_memory, paged_attention
from models.transfer import DeviceArrays, HostBuffer
from scheduler.kv_blocks import blocks_for

ATTN_IMPLEMENTATION = "specd"
logger = logging.getLogger("specd.models")


# Rows whose queries are padded into one attention call: more new tokens than
# this and a row is attended on its own, so a prefill chunk never pads its
# decode neighbours' queries to its length (covers a verify of 1 + 16 drafts).
# Decode rows and verify rows are grouped separately for the same reason.
SHORT_ROW_TOKENS = 17


@dataclass
class GroupPlan:
    """Host side of one attention call over `num_rows` rows, keys read through their block tables."""

    num_rows: int
    max_q: int
    max_kv: int
    num_blocks: int  # blocks read per row: the longest row's
    grid_start: list[int]  # [num_rows] first new position of each row
    query_start: list[int]  # [num_rows + 1] each row's first token in the group's packed queries, then their count
    block_index: list[int]  # [num_rows * num_blocks] block ids, short rows padded with their own first block
    token_index: list[int] | None  # packed index of the group's tokens; None: all tokens, in order
    pad_index: list[int] | None  # each token's cell in the [num_rows * max_q] grid; None: no padding
    # One row whose blocks are consecutive: its keys are a view of the pool from this block (no gather).
    view_block: int | None = None
    paged: bool = False  # a decode group the CPU kernel may read in place: its block table goes up too

    @property
    def uploads_blocks(self) -> bool:
        return self.view_block is None or self.paged


@dataclass
class LayoutPlan:
    """Where each packed token of one forward lives, before upload. T tokens, B rows."""

    token_dest: list[int]  # [T] row of the pool each token's K/V is written to
    token_pos: list[int]  # [T] position in its sequence
    groups: list[GroupPlan]
    block_size: int

    @classmethod
    def build(
        cls,
        block_tables: list[list[int]],
        starts: list[int],
        lens: list[int],
        block_size: int,
        paged_limits: PagedLimits = (),
    ) -> LayoutPlan:
        """`paged_limits`: the queries a row up to which a group reads the pool in place where the
        paged kernel is enabled, by its rows (the model's `LoadedModel.paged_limits`); decode
        groups always do, others gather."""
        token_dest: list[int] = []
        token_pos: list[int] = []
        offsets = []
        for table, start, n in zip(block_tables, starts, lens):
            offsets.append(len(token_dest))
            token_pos += range(start, start + n)
            token_dest += (table[p // block_size] * block_size + p % block_size for p in range(start, start + n))
        rows = range(len(block_tables))
        # Decode rows (1 token) and verify rows (a few) are grouped apart: one
        # verify row in a group would pad every decode row's queries to its length.
        runs = [
            [b for b in rows if lens[b] == 1],
            [b for b in rows if 1 < lens[b] <= SHORT_ROW_TOKENS],
            *([b] for b in rows if lens[b] > SHORT_ROW_TOKENS),
        ]
        total = len(token_dest)
        groups = [
            cls._group(run, block_tables, starts, lens, offsets, total, block_size, paged_limits) for run in runs if run
        ]
        return cls(token_dest, token_pos, groups, block_size)

    @staticmethod
    def _group(run, block_tables, starts, lens, offsets, total, block_size, paged_limits) -> GroupPlan:
        max_q = max(lens[b] for b in run)
        max_kv = max(starts[b] + lens[b] for b in run)
        num_blocks = blocks_for(max_kv, block_size)
        token_index: list[int] = []
        pad_index: list[int] = []
        block_index: list[int] = []
        for cell, b in enumerate(run):
            token_index += range(offsets[b], offsets[b] + lens[b])
            pad_index += range(cell * max_q, cell * max_q + lens[b])
            table = block_tables[b][: blocks_for(starts[b] + lens[b], block_size)]  # the blocks the row uses
            block_index += table + [table[0]] * (num_blocks - len(table))
        view_block = None
        if len(run) == 1 and block_index == list(range(block_index[0], block_index[0] + num_blocks)):
            view_block = block_index[0]
        return GroupPlan(
            num_rows=len(run),
            max_q=max_q,
            max_kv=max_kv,
            num_blocks=num_blocks,
            grid_start=[starts[b] for b in run],
            query_start=[0, *itertools.accumulate(lens[b] for b in run)],
            block_index=block_index,
            token_index=None if token_index == list(range(total)) else token_index,
            pad_index=None if len(pad_index) == len(run) * max_q else pad_index,
            view_block=view_block,
            paged=(max_q <= paged_limit(paged_limits, len(run)) or paged_attention.everywhere())
            and paged_attention.enabled(),
        )

    def add_to(self, buf: HostBuffer, prefix: str) -> None:
        buf.ints(f"{prefix}.token_dest", self.token_dest)
        buf.ints(f"{prefix}.token_pos", self.token_pos)
        for i, g in enumerate(self.groups):
            buf.ints(f"{prefix}.{i}.grid_start", g.grid_start)
            if g.uploads_blocks:
                buf.ints(f"{prefix}.{i}.block_index", g.block_index)
            if g.paged:
                buf.ints(f"{prefix}.{i}.query_start", g.query_start)
            if g.token_index is not None:
                buf.ints(f"{prefix}.{i}.token_index", g.token_index)
            if g.pad_index is not None:
                buf.ints(f"{prefix}.{i}.pad_index", g.pad_index)

    def resolve(self, arrays: DeviceArrays, prefix: str) -> StepLayout:
        def get(name: str, present: bool) -> torch.Tensor | None:
            return arrays[name] if present else None

        groups = [
            AttentionGroup(
                plan=g,
                block_size=self.block_size,
                grid_start=arrays[f"{prefix}.{i}.grid_start"],
                block_index=get(f"{prefix}.{i}.block_index", g.uploads_blocks),
                query_start=get(f"{prefix}.{i}.query_start", g.paged),
                token_index=get(f"{prefix}.{i}.token_index", g.token_index is not None),
                pad_index=get(f"{prefix}.{i}.pad_index", g.pad_index is not None),
            )
            for i, g in enumerate(self.groups)
        ]
        return StepLayout(arrays[f"{prefix}.token_dest"], arrays[f"{prefix}.token_pos"], groups)


@dataclass
class AttentionGroup:
    """One attention call: the rows' queries padded into a grid, their keys read through their block tables."""

    plan: GroupPlan
    block_size: int
    grid_start: torch.Tensor  # [num_rows]
    block_index: torch.Tensor | None  # [num_rows * num_blocks]; None: a view (`plan.view_block`)
    query_start: torch.Tensor | None  # [num_rows + 1]; only for a group the kernel may read (`plan.paged`)
    token_index: torch.Tensor | None
    pad_index: torch.Tensor | None
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict)
    _additive: dict[tuple[int | None, int, torch.dtype], torch.Tensor] = field(default_factory=dict)
    _gather: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)

    @property
    def num_keys(self) -> int:
        """Keys per row as read: exactly max_kv from a view, whole blocks from a gather."""
        plan = self.plan
        return plan.max_kv if plan.view_block is not None else plan.num_blocks * self.block_size

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        """[num_rows, 1, max_q, num_keys] bool: query i of a row sees keys 0..start + i.

        Padded queries see the same causal range (key 0 at least, so no row is
        all-masked); their outputs are discarded.
        """
        if sliding_window not in self._masks:
            device = self.grid_start.device
            q_pos = self.grid_start[:, None] + torch.arange(self.plan.max_q, device=device)  # [S, max_q]
            k_pos = torch.arange(self.num_keys, device=device)
            visible = k_pos[None, None, :] <= q_pos[:, :, None]
            if sliding_window:
                visible &= k_pos[None, None, :] > q_pos[:, :, None] - sliding_window
                visible[:, :, 0] |= ~visible.any(-1)
            self._masks[sliding_window] = visible[:, None]
        return self._masks[sliding_window]

    def additive_mask(self, sliding_window: int | None, groups: int, dtype: torch.dtype) -> torch.Tensor:
        """`mask` as SDPA adds it (0 or -inf, in `dtype`), for queries folded `groups` heads deep:
        [num_rows, 1, groups * max_q, num_keys], row g * max_q + i query i's. Built once per
        step and reused by every layer, where SDPA would convert a boolean mask per call
        (0.15 ms a layer for 16 verify rows over 320 keys on 2 cores)."""
        key = (sliding_window, groups, dtype)
        if key not in self._additive:
            visible = self.mask(sliding_window).repeat(1, 1, groups, 1)
            zeros = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
            self._additive[key] = zeros.masked_fill_(~visible, float("-inf"))
        return self._additive[key]

    def keys_values(self, k_pool: torch.Tensor, v_pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' keys and values, [KVH, num_rows, num_keys, D]: a view of the pool
        for one row on consecutive blocks, else gathered block by block."""
        kv_heads, _, head_dim = k_pool.shape
        plan = self.plan
        if plan.view_block is not None:
            lo = plan.view_block * self.block_size
            return k_pool[:, None, lo : lo + plan.max_kv], v_pool[:, None, lo : lo + plan.max_kv]
        assert self.block_index is not None
        # Rows of the pool seen as [kv_heads * pool_blocks, block]: a gather along dim 0 copies
        # whole blocks (measured 4x faster than along dim 1 for 16 rows of 19 blocks, bf16).
        pool_blocks = k_pool.shape[1] // self.block_size
        index = self._head_block_index(kv_heads, pool_blocks)
        shape = (kv_heads, plan.num_rows, plan.num_blocks * self.block_size, head_dim)
        blocks = (kv_heads * pool_blocks, self.block_size * head_dim)
        key = k_pool.view(blocks).index_select(0, index).view(shape)
        value = v_pool.view(blocks).index_select(0, index).view(shape)
        return key, value

    def _head_block_index(self, kv_heads: int, pool_blocks: int) -> torch.Tensor:
        """Every head's copy of the group's blocks: head h, block b -> row h * pool_blocks + b."""
        key = (kv_heads, pool_blocks)
        if key not in self._gather:
            assert self.block_index is not None
            heads = torch.arange(kv_heads, device=self.block_index.device)[:, None] * pool_blocks
            self._gather[key] = (heads + self.block_index[None]).flatten()
        return self._gather[key]


@dataclass
class StepLayout:
    """A resolved `LayoutPlan`: device tensors the cache and attention read each layer."""

    token_dest: torch.Tensor  # [T]
    token_pos: torch.Tensor  # [T]
    groups: list[AttentionGroup]

    @classmethod
    def build(
        cls,
        block_tables: list[list[int]],
        starts: list[int],
        lens: list[int],
        block_size: int,
        device: torch.device,
        paged_limits: PagedLimits = (),
    ) -> StepLayout:
        """Plan and upload in one go (for callers outside a runner step)."""
        plan = LayoutPlan.build(block_tables, starts, lens, block_size, paged_limits)
        buf = HostBuffer()
        plan.add_to(buf, "layout")
        return plan.resolve(buf.upload(device), "layout")


class KVCache:
    """Paged KV storage handed to an HF model as its `cache`."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        shape = (num_kv_heads, num_blocks * block_size, head_dim)
        # One allocation for every layer's keys and values: on CPU it is advised onto huge pages.
        pools = host_memory.zeros((2, num_layers, *shape), dtype, device)
        self.keys = list(pools[0].unbind(0))
        self.values = list(pools[1].unbind(0))
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.layout: StepLayout | None = None

    @staticmethod
    def dims(config) -> tuple[int, int, int]:
        """(layers, kv heads, head dim) of an HF model config."""
        config = text_config(config)
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        return config.num_hidden_layers, num_kv_heads, head_dim

    @staticmethod
    def heads(config) -> tuple[int, int, int]:
        """(attention heads, kv heads, head dim) of an HF model config."""
        _, num_kv_heads, head_dim = KVCache.dims(config)
        return text_config(config).num_attention_heads, num_kv_heads, head_dim

    @classmethod
    def bytes_per_block(cls, config, block_size: int, dtype: torch.dtype) -> int:
        layers, kv_heads, head_dim = cls.dims(config)
        return 2 * layers * kv_heads * head_dim * block_size * dtype.itemsize

    @classmethod
    def for_model(cls, config, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device) -> KVCache:
        layers, kv_heads, head_dim = cls.dims(config)
        return cls(layers, num_blocks, block_size, kv_heads, head_dim, dtype, device)

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    # -- the part of HF's Cache protocol the models call --
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Write the step's new keys/values into their blocks; return the pools,
        which `ragged_attention` reads group by group."""
        layout = self.layout
        assert layout is not None, "KVCache.update outside a runner step"
        k_pool, v_pool = self.keys[layer_idx], self.values[layer_idx]
        # key_states: [1, kv_heads, T, head_dim]
        k_pool.index_copy_(1, layout.token_dest, key_states[0].to(k_pool.dtype))
        v_pool.index_copy_(1, layout.token_dest, value_states[0].to(v_pool.dtype))
        return k_pool, v_pool

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self.layout is None else max(g.plan.max_kv for g in self.layout.groups)


def text_config(config):
    """The language model's part of an HF config (a multimodal config nests it)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def ragged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention over a packed batch: query [1, H, T, D]; key/value the layer's
    pools [KVH, blocks * block_size, D] from `KVCache.update`. Each group reads
    its rows' keys through their block tables. Returns ([1, T, H, D], None) as
    HF attention functions do."""
    layout: StepLayout = kwargs["specd_layout"]
    q = query[0].transpose(0, 1)  # [T, H, D]
    out = attend(layout, q, key, value, scaling, getattr(module, "sliding_window", None))
    return out.unsqueeze(0), None


def attend(
    layout: StepLayout, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, scaling, sliding_window=None
) -> torch.Tensor:
    """q [T, H, D] (the step's packed queries) over the pools [KVH, rows, D] -> [T, H, D],
    each attention group's keys read through its rows' block tables."""
    key, value = k_pool, v_pool
    num_tokens, num_heads, head_dim = q.shape
    if len(layout.groups) == 1 and layout.groups[0].token_index is None:
        return _attend_group(layout.groups[0], q, key, value, scaling, sliding_window)
    out = q.new_empty(num_tokens, num_heads, head_dim)
    for group in layout.groups:
        q_group = q if group.token_index is None else q.index_select(0, group.token_index)
        out_group = _attend_group(group, q_group, key, value, scaling, sliding_window)
        if group.token_index is None:
            out = out_group
        else:
            out.index_copy_(0, group.token_index, out_group)
    return out


def _attend_group(group: AttentionGroup, q, k_pool, v_pool, scaling, sliding_window) -> torch.Tensor:
    """q [n, H, D] (the group's tokens) -> [n, H, D]."""
    plan = group.plan
    if paged_attention.reads(group, q, sliding_window):
        return paged_attention.attend_group(group, q, k_pool, v_pool, scaling)
    num_heads, head_dim = q.shape[1], q.shape[2]
    s, max_q = plan.num_rows, plan.max_q
    if group.pad_index is None:
        grid = q.reshape(s, max_q, num_heads, head_dim)
    else:
        grid = q.new_zeros(s * max_q, num_heads, head_dim)
        grid[group.pad_index] = q
        grid = grid.view(s, max_q, num_heads, head_dim)
    grid = grid.transpose(1, 2)  # [S, H, max_q, D]
    key, value = group.keys_values(k_pool, v_pool)  # [KVH, S, num_keys, D]
    if _prefers_grouped(q, s, max_q, group.num_keys):
        out = grouped_attention(grid, key, value, group.mask(sliding_window), scaling)
    else:
        key, value = key.transpose(0, 1), value.transpose(0, 1)  # [S, KVH, num_keys, D]
        gqa = key.shape[1] != num_heads
        if s == 1 and plan.grid_start == [0] and not sliding_window:
            # A whole prompt on its own: plain causal attention (top-left aligned, so keys
            # past the prompt in its last block are never seen), flash-eligible on CUDA.
            out = F.scaled_dot_product_attention(grid, key, value, is_causal=True, scale=scaling, enable_gqa=gqa)
        elif gqa and q.device.type == "cpu":
            # GQA folded into the query axis, [S, KVH, groups * max_q, D]: on CPU one SDPA over
            # the folded queries ran verify groups in 0.5-0.7 of `enable_gqa`'s time (bf16,
            # 16 rows of 5-11 queries over 320 keys), decode groups in 0.85.
            kv_heads = key.shape[1]
            folded = grid.reshape(s, kv_heads, num_heads // kv_heads * max_q, head_dim)
            mask = group.additive_mask(sliding_window, num_heads // kv_heads, q.dtype)
            out = F.scaled_dot_product_attention(folded, key, value, attn_mask=mask, scale=scaling)
            out = out.view(s, num_heads, max_q, head_dim)
        else:
            mask = (
                group.additive_mask(sliding_window, 1, q.dtype)
                if q.device.type == "cpu"
                else group.mask(sliding_window)
            )
            out = F.scaled_dot_product_attention(
                grid, key, value, attn_mask=mask, scale=scaling, enable_gqa=gqa
            )  # [S, H, max_q, D]
    out = out.transpose(1, 2).reshape(s * max_q, num_heads, head_dim)
    return out if group.pad_index is None else out[group.pad_index]


def _prefers_grouped(query, num_rows: int, max_q: int, max_kv: int) -> bool:
    """Two plain matmuls instead of SDPA, for decode- and verify-shaped work in bf16/fp16 on a
    CPU where `attention_timing.tune_attention` found them faster. SDPA's reduced-precision CPU
    kernels vary with the machine and the torch build: on a 2-core AMX Xeon with torch 2.13, SDPA
    ran batch-1 decode over 300 keys in 26 us against 97, where an earlier machine had measured
    219 us against 69."""
    if query.device.type != "cpu" or query.dtype == torch.float32 or not GROUPED.get(query.dtype, False):
        return False
    return max_q < 32 and num_rows * max_kv > 160


# Per dtype: whether the grouped matmuls beat SDPA on this CPU (`attention_timing.tune_attention`);
# absent: SDPA.
GROUPED: dict[torch.dtype, bool] = {}


# Queries a row up to which a group reads the pool in place (the paged kernel), per number of
# rows: limits[i] for groups of up to PAGED_ROWS[i] rows (`models.attention_timing`). Empty:
# decode rows only.
PagedLimits = tuple[int, ...]
PAGED_ROWS = (1, 4, 16)  # more rows than the last: its limit


def paged_limit(limits: PagedLimits, rows: int) -> int:
    """The most queries a row for which a group of `rows` rows reads the pool in place."""
    for bound, limit in zip(PAGED_ROWS, limits):
        if rows <= bound:
            return limit
    return limits[-1] if limits else 1


def grouped_attention(q, key, value, mask, scaling):
    """Plain attention with GQA folded into the query axis, softmax in float32.
    q [S, H, max_q, D]; key/value [KVH, S, L, D] as read from the pool."""
    num_rows, num_heads, max_q, head_dim = q.shape
    kv_heads = key.shape[0]
    groups = num_heads // kv_heads
    q = q.reshape(num_rows, kv_heads, groups * max_q, head_dim).transpose(0, 1)  # [KVH, S, groups * max_q, D]
    scores = torch.matmul(q, key.transpose(-1, -2)).float()  # [KVH, S, groups * max_q, L]
    scores *= scaling if scaling is not None else head_dim**-0.5
    grouped = scores.view(kv_heads, num_rows, groups, max_q, -1)
    grouped.masked_fill_(~mask[None], float("-inf"))  # mask [S, 1, max_q, L] broadcasts over heads
    probs = scores.softmax(-1).to(value.dtype)
    out = torch.matmul(probs, value)  # [KVH, S, groups * max_q, D]
    return out.transpose(0, 1).reshape(num_rows, num_heads, max_q, head_dim)


AttentionInterface.register(ATTN_IMPLEMENTATION, ragged_attention)
