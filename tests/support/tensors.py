"""Host-list conveniences over the models package's plan -> upload -> resolve
steps, for tests that call one piece of a step on its own."""

from __future__ import annotations

import torch
from torch import nn

from models.forward import forward_step
from models.kv_cache import KVCache, LayoutPlan
from models.linear_kernels import TunedLinear
from models.quantized import quantize
from models.sampling import SamplingTensors, plan_token_counts, resolve_token_counts
from models.transfer import HostBuffer
from scheduler.types import SamplingParams


def sampling_tensors(params: list[SamplingParams], vocab_size: int, device: str = "cpu") -> SamplingTensors:
    """Plan, upload and resolve a batch's sampling tensors in one go."""
    buf = HostBuffer()
    SamplingTensors.plan(params, vocab_size, buf, "s")
    return SamplingTensors.resolve(params, vocab_size, buf.upload(torch.device(device)), "s")


def token_counts(histories: list[list[int]], vocab_size: int, device: str = "cpu") -> torch.Tensor:
    """Per-row token counts `[R, V]` int32 from token lists."""
    buf = HostBuffer()
    plan_token_counts(histories, buf, "c")
    return resolve_token_counts(len(histories), vocab_size, buf.upload(torch.device(device)), "c")


def packed_forward(
    model,
    cache: KVCache,
    tables: list[list[int]],
    starts: list[int],
    token_lists: list[list[int]],
    keep: list[int],
) -> torch.Tensor:
    """`forward_step` from host lists: row b writes `token_lists[b]` at positions
    `starts[b]..` of the blocks `tables[b]`; one upload for everything."""
    buf = HostBuffer()
    plan = LayoutPlan.build(tables, starts, [len(t) for t in token_lists], cache.block_size)
    plan.add_to(buf, "layout")
    buf.ints("input_ids", [t for tokens in token_lists for t in tokens])
    buf.ints("keep", keep)
    arrays = buf.upload(cache.keys[0].device)
    return forward_step(model, cache, plan.resolve(arrays, "layout"), arrays["input_ids"], arrays["keep"])


def slot_table(slot: int, num_slots: int, num_blocks: int) -> list[int]:
    """A block table as if the pool were cut into `num_slots` sequences, interleaved:
    row `slot` gets blocks slot, slot + num_slots, ..., never two adjacent ones, so
    attention reads it through the gather path."""
    return [slot + num_slots * j for j in range(num_blocks)]


def read_kv(cache: KVCache, layer: int, table: list[int], num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values `[KVH, num_tokens, D]` of positions 0..num_tokens-1 through a block table."""
    size = cache.block_size
    rows = torch.tensor([table[p // size] * size + p % size for p in range(num_tokens)])
    return cache.keys[layer][:, rows], cache.values[layer][:, rows]


def quantized_layer(fmt: str, n: int = 64, k: int = 128) -> TunedLinear:
    """An n x k linear layer with a weight-only copy in `fmt`, its dense weight set to the copy's values."""
    layer = nn.Linear(k, n)
    copy = quantize(layer.weight, fmt)
    assert copy is not None
    with torch.no_grad():
        layer.weight.copy_(copy.dense(torch.float32))
    layer.__class__ = TunedLinear
    layer.quantized_weight = copy
    return layer
