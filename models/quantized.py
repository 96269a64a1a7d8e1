"""Weight-only quantized copies of linear layers: int8, int6, int4 and int4k.

On a CPU a decode step is a read of every weight. A GGUF ships its weights at 4-6 bits; widened
to bfloat16 they cost 3-4x the bytes per step (Qwen2.5-Coder-1.5B Q4_K_M: 1.1 GB on disk, 3.1 GB
per step). A quantized layer multiplies with specd's own kernels (`csrc/quant_linear.cpp`), which
read each weight once for every token row of a step and multiply with integer dot products on
the rows quantized to int8 per group of `GROUP` inputs, as llama.cpp does:

- int8: codes in -127..127 and a float16 scale per row and group of `GROUP` inputs
  (w = code * scale), as GGUF's Q8_0.
- int6: codes in -32..31 and a float16 scale per row and block of `BLOCK` inputs
  (w = code * scale): 7 bits a weight. GGUF's Q6_K (an int8 scale per 16 under a float16 one
  per 256) and Q5_0 (a float16 scale per 32) are such grids: each block is requantized on the
  step its values sit on (`_symmetric_steps`), so it keeps the file's values, the scale rounded
  to float16 apart. In int8 they read 8.5 bits a weight.
- int4: codes in 0..15 and a float16 scale and minimum per row and group of `GROUP` inputs
  (w = code * scale + minimum). 32 is the sub-block of llama.cpp's Q4_K: a Q4_K tensor is
  requantized on its own groups, each on the grid its values sit on (`_grid_steps`), so it keeps
  the file's values; other weights on 15 steps from their minimum to their maximum.
- int4k: a Q4_K tensor read from the file's blocks: int4's codes, and per group an 8-bit scale
  and minimum under a float16 pair per 256 inputs (`Int4KWeight`): 4.625 bits a weight, the
  file's values to the bit.

torch's weight-only kernels (`aten._weight_int4pack_mm_for_cpu`, the ones gpt-fast uses) widen
every weight to a float lane and ran out of arithmetic before memory: on a 2-core AMX Xeon one
17920 x 1536 int4 product took 0.9 ms at 1 row and 3.3 ms at 8, where these take 0.46 and 0.94.
Their cost still grows with the rows (an integer dot product per row per weight), so a quantized
layer keeps its dense weight too, set to the values its codes stand for (rounded to the served
dtype), and the kernel table (`models.linear_kernels`, timed per row count at load by `models.kernel_tuning`) picks the
weight-only kernel or a dense layout per step. The two differ by the rows' int8 rounding (a
relative 0.5% of a product), as the dtype's rounding differs between step shapes; each row's sums
are its own, so a row gets the same bits from the kernel whatever shares its step. Resident
cost: the dense weight (and its packed copy where a dense layout packs) plus 1.0625 (int8),
0.875 (int6), 0.625 (int4) or 0.578 (int4k) bytes per weight.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import numpy as np
import torch
from torch import nn

INT8, INT6, INT4, INT4K = "int8", "int6", "int4", "int4k"
GROUP = 32  # inputs per int4 (scale, minimum) group, and per activation scale in the kernels
BLOCK = 16  # inputs per int6 scale
TILE = 16  # output rows per tile of the kernels' layout
# of the codes, scales and minimums as stored, and of which format `auto` gives a GGUF type: a
# change rebuilds packed caches (3: int6 for Q6_K and Q5_0; 4: int4k for Q4_K)
LAYOUT_VERSION = 4


class QuantizedWeight:
    """One weight [N, K] in a quantized format; `matmul` multiplies rows by its transpose."""

    fmt: str
    out_features: int
    in_features: int

    @property
    def padded(self) -> bool:
        """Whether the layout holds rows past `out_features` (it cannot stack before another)."""
        return False

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [M, K] @ W^T -> [M, N] in rows' dtype, through the weight-only kernel."""
        raise NotImplementedError

    def nbytes(self) -> int:
        raise NotImplementedError

    def head(self, rows: int) -> QuantizedWeight:
        """The first `rows` output rows or more (a view), for timing a sample of a large weight."""
        raise NotImplementedError

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [N, K] its codes stand for, in `dtype` (computed in float32, then rounded)."""
        raise NotImplementedError


def kernels_available() -> bool:
    """Whether specd's CPU kernels (`models/csrc/quant_linear.cpp`: x86 with AVX2) are registered."""
    return hasattr(torch.ops.specd, "int4_linear")


def round_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] with each group of GROUP inputs rounded to int8 as the kernels round a token row:
    a quantized layer's dense product on these rows is its weight-only product."""
    return torch.ops.specd.int8_round(x)


def _tiles(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] padded with zero rows to whole tiles of TILE outputs."""
    pad = -weight.shape[0] % TILE
    return torch.cat([weight, weight.new_zeros(pad, weight.shape[1])]) if pad else weight


def _tile_major(t: torch.Tensor) -> torch.Tensor:
    """Per (row, group) values [N, K/32] -> [N/16, K/32, 16], the kernels' order."""
    return t.view(-1, TILE, t.shape[1]).transpose(1, 2).contiguous()


def _grid_steps(w: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """Per group of w [G, GROUP], the steps k <= 15 of an evenly spaced grid from its minimum to
    its maximum that every value sits on; 15 where none does (float weights). A 4-bit GGUF
    tensor's groups already sit on a grid of 16 levels or fewer (Q4_K: d * sc * q - dmin * m, q in
    0..15), but its codes need not span 0..15: min-max requantization on 15 steps would move every
    value that falls between the new levels. On their own grid they keep their values (the scale
    and minimum rounded to float16 apart)."""
    span = high - low
    unit = (w - low[..., None]) / span.clamp(min=1e-30)[..., None]  # 0..1 within each group
    gaps = unit.sort(dim=-1).values.diff(dim=-1)
    gap = torch.where(gaps > 1e-3, gaps, 1.0).amin(dim=-1)  # between the closest distinct values: one step
    steps = torch.round(1.0 / gap).clamp(1, 15)
    scaled = unit * steps[..., None]
    on_grid = (scaled - scaled.round()).abs().amax(dim=-1) < 1e-3
    return torch.where(on_grid & (span > 0) & (gap > 1 / 15.5), steps, 15.0)


def _codes(values: torch.Tensor, scale: torch.Tensor, low: int, high: int) -> torch.Tensor:
    """round(values / scale) within [low, high]; 0 where the scale is 0 (a group of one value)."""
    nonzero = scale != 0
    return torch.where(nonzero, torch.round(values / torch.where(nonzero, scale, 1.0)), 0.0).clamp_(low, high)


class TiledWeight(QuantizedWeight):
    """Codes in tiles of TILE output rows (the kernels' layout; the last tile may be padded), and
    per-tile scales: every tensor of `tensors` is sliced and stacked by tile along its first axis."""

    kernel: ClassVar[str]  # its op in torch.ops.specd, called as kernel(rows, *tensors)
    inputs_per_column: ClassVar[int]  # inputs per column of a tile's codes (its second axis)

    def __init__(self, tensors: tuple[torch.Tensor, ...], out_features: int):
        self.tensors = tensors  # codes first
        self.out_features, self.in_features = out_features, tensors[0].shape[1] * self.inputs_per_column

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> TiledWeight:
        """`weight` [N, K] (whole groups of inputs: `fits`) in this format."""
        raise NotImplementedError

    @staticmethod
    def fits(weight: torch.Tensor) -> bool:
        """Whole groups of inputs, and values float16 scales can hold."""
        return (
            weight.shape[1] % GROUP == 0
            and weight.device.type == "cpu"
            and bool(weight.abs().max() < torch.finfo(torch.float16).max / 2)
        )

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        out = getattr(torch.ops.specd, self.kernel)(rows, *self.tensors)
        return out if out.shape[1] == self.out_features else out[:, : self.out_features].contiguous()

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def head(self, rows: int) -> TiledWeight:
        tiles = min(self.tensors[0].shape[0], -(-rows // TILE))
        return type(self)(tuple(t[:tiles] for t in self.tensors), min(self.out_features, tiles * TILE))

    @property
    def padded(self) -> bool:
        return self.out_features % TILE != 0

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        return self.values().view(-1, self.in_features)[: self.out_features].to(dtype)

    def values(self) -> torch.Tensor:
        """The tiles' weights in float32, [N/16, 16 rows, K/32 groups, 32]."""
        raise NotImplementedError

    def _group_values(self, tiled: torch.Tensor) -> torch.Tensor:
        """Per (tile, group, row) values [N/16, K/32, 16] -> [N/16, 16, K/32, 1], beside values()."""
        return tiled.float().transpose(1, 2)[..., None]


class Int8Weight(TiledWeight):
    """codes [N/16, K/4, 64] int8 (tile, input quad, 16 rows x 4 inputs); scales [N/16, K/32, 16]
    float16: w = code * scale."""

    fmt, kernel, inputs_per_column = INT8, "int8_linear", 4

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int8Weight:
        n, k = weight.shape
        w = _tiles(weight.detach().float()).view(-1, k // GROUP, GROUP)
        scales = (w.abs().amax(dim=-1) / 127.0).to(torch.float16)  # as the kernel reads it
        codes = _codes(w, scales.float()[..., None], -127, 127)
        tiled = codes.to(torch.int8).view(-1, TILE, k // 4, 4).permute(0, 2, 1, 3).reshape(-1, k // 4, 64)
        return cls((tiled.contiguous(), _tile_major(scales)), n)

    def values(self) -> torch.Tensor:
        codes, scales = self.tensors
        k = self.in_features
        rows = codes.view(-1, k // 4, TILE, 4).transpose(1, 2).reshape(-1, TILE, k // GROUP, GROUP)
        return rows.float() * self._group_values(scales)


class Int4Weight(TiledWeight):
    """codes [N/16, K/8, 64] uint8 (tile, input octet, 16 rows x 4 inputs, two codes a byte);
    scales, mins [N/16, K/32, 16] float16: w = code * scale + min."""

    fmt, kernel, inputs_per_column = INT4, "int4_linear", 8

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int4Weight:
        n, k = weight.shape
        w = _tiles(weight.detach().float()).view(-1, k // GROUP, GROUP)
        low, high = w.amin(dim=-1), w.amax(dim=-1)
        # Scale and minimum as the kernel reads them (float16), the codes chosen for those.
        scales = ((high - low) / _grid_steps(w, low, high)).to(torch.float16)
        mins = low.to(torch.float16)
        codes = _codes(w - mins.float()[..., None], scales.float()[..., None], 0, 15)
        return cls((_pack_nibbles(codes.to(torch.uint8).view(-1, k)), _tile_major(scales), _tile_major(mins)), n)

    def values(self) -> torch.Tensor:
        packed, scales, mins = self.tensors
        return _unpack_nibbles(packed) * self._group_values(scales) + self._group_values(mins)


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes [N, K] (whole tiles of rows) -> int4's layout [N/16, K/8, 64]."""
    k = codes.shape[1]
    nibbles = codes.view(-1, TILE, k // 8, 2, 4).permute(0, 2, 1, 4, 3)  # tile, octet, row, j, half
    return (nibbles[..., 0] | (nibbles[..., 1] << 4)).reshape(-1, k // 8, 64).contiguous()


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int4's layout [N/16, K/8, 64] -> the codes in float32, [N/16, 16 rows, K/32 groups, 32]."""
    k = packed.shape[1] * 8
    nibbles = torch.stack([packed & 15, packed >> 4], dim=-1).view(-1, k // 8, TILE, 4, 2)  # tile, octet, row, j, half
    return nibbles.permute(0, 2, 1, 4, 3).reshape(-1, TILE, k // GROUP, GROUP).float()


SUPER = 256  # inputs per Q4_K super-block
Q4_K_BLOCK_BYTES = 144  # d, dmin (float16), 12 bytes of 6-bit scales and minimums, 128 of codes


class Int4KWeight(TiledWeight):
    """GGUF's Q4_K as it is in the file, in int4's tiles: codes as int4's; scales, mins
    [N/16, K/256, 16] float16 per super-block (Q4_K's d and -dmin); steps, offsets [N/16, K/32,
    16] uint8 per group of 32 (its 6-bit sc and m): w = code * (scale * step) + min * offset,
    multiplied out in float32 as GGUF's readers do, so the values are the file's to the bit.
    4.625 bits a weight, against int4's 5 (a float16 scale and minimum per 32) and Q4_K's 4.5
    (its scales packed in 6 bits). Read from the file's blocks (`from_q4_k`): the float values
    alone do not say which scales made them."""

    fmt, kernel, inputs_per_column = INT4K, "int4k_linear", 8

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int4KWeight:
        raise ValueError("int4k is read from a GGUF's Q4_K blocks (Int4KWeight.from_q4_k), not from float weights")

    @classmethod
    def from_q4_k(cls, blocks: np.ndarray, out_features: int, in_features: int) -> Int4KWeight:
        """The weight [out_features, in_features] from its Q4_K blocks (the file's bytes, one row
        of in_features / 256 blocks per output)."""
        from gguf.quants import Q4_K  # transformers' own GGUF reader dependency

        k, supers = in_features, in_features // SUPER
        raw = torch.from_numpy(np.array(blocks, dtype=np.uint8))  # a copy: the reader's memmap is read-only
        raw = raw.view(out_features, supers, Q4_K_BLOCK_BYTES)
        raw = _tiles(raw.view(out_features, -1)).view(-1, supers, Q4_K_BLOCK_BYTES)  # zero rows: d = 0
        halves = raw[..., :4].contiguous().view(torch.float16)  # [N, supers, 2]: d, dmin
        steps, offsets = (
            torch.from_numpy(part).view(-1, supers * 8)
            for part in Q4_K.get_scale_min(raw[..., 4:16].reshape(-1, 12).numpy())
        )
        # codes: per 64 inputs, 32 bytes whose low nibbles are the first 32 and high nibbles the next
        quads = raw[..., 16:].reshape(-1, supers, 4, 1, 32)
        codes = torch.cat([quads & 15, quads >> 4], dim=3).reshape(-1, k)
        tensors = (_pack_nibbles(codes), _tile_major(halves[..., 0].contiguous()), _tile_major(-halves[..., 1]),
                   _tile_major(steps.contiguous()), _tile_major(offsets.contiguous()))  # fmt: skip
        return cls(tensors, out_features)

    @staticmethod
    def fits(weight: torch.Tensor) -> bool:
        return weight.shape[1] % SUPER == 0

    def values(self) -> torch.Tensor:
        packed, scales, mins, steps, offsets = self.tensors
        per_group = SUPER // GROUP

        def group_values(per_super: torch.Tensor, per_group_bytes: torch.Tensor) -> torch.Tensor:
            return self._group_values(per_super.float().repeat_interleave(per_group, dim=1) * per_group_bytes.float())

        return _unpack_nibbles(packed) * group_values(scales, steps) + group_values(mins, offsets)


def _symmetric_steps(w: torch.Tensor, peak: torch.Tensor) -> torch.Tensor:
    """Per block of w [B, BLOCK], the steps k <= 32 from 0 to its value of largest magnitude
    (`peak`) of a grid every value sits on, the largest that does; 31 where none does (float
    weights: the peak at -31 and its negation at 31 both fit). A Q6_K block's values are
    d * sc * q with q in -32..31 and Q5_0's d * q with q in -16..15, the peak at some q of
    magnitude k: on that grid they keep their values. In chunks of `_CHUNK` blocks, so the
    temporaries stay small; once a whole chunk sits on no grid, the weight is a float one and
    the rest is not searched."""
    steps = torch.full(peak.shape, 31.0)
    for start in range(0, w.shape[0], _CHUNK):
        chunk, chunk_peak = w[start : start + _CHUNK], peak[start : start + _CHUNK]
        open_ = torch.ones(chunk_peak.shape, dtype=torch.bool)
        for k in range(32, 0, -1):  # most Q6_K blocks settle within the first few
            rows = open_.nonzero().squeeze(1)
            if rows.numel() == 0:
                break
            codes = -chunk[rows] * (k / chunk_peak[rows])[:, None]  # the peak at -k
            on_grid = ((codes - codes.round()).abs().amax(dim=-1) < 1e-3) & (codes.round().amax(dim=-1) <= 31)
            found = rows[on_grid]
            steps[start + found] = float(k)
            open_[found] = False
        if bool(open_.all()) and chunk.shape[0] == _CHUNK:
            break
    return steps


_CHUNK = 1 << 16  # blocks of BLOCK weights per pass of `_symmetric_steps`


class Int6Weight(TiledWeight):
    """codes [N/16, K/16, 192] uint8 (tile, block of 16 inputs: two columns of low nibbles and
    one of top bits, as the kernel reads them); scales [N/16, K/16, 16] float16:
    w = (code - 32) * scale, code in 0..63."""

    fmt, kernel, inputs_per_column = INT6, "int6_linear", BLOCK

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int6Weight:
        n, k = weight.shape
        w = _tiles(weight.detach().float()).view(-1, BLOCK)
        peak = w.gather(1, w.abs().argmax(dim=1, keepdim=True)).squeeze(1)
        scales = torch.where(peak != 0, -peak / _symmetric_steps(w, peak), 0.0).to(torch.float16)
        codes = (_codes(w, scales.float()[:, None], -32, 31) + 32).to(torch.uint8)
        # [tile, block, quarter c, row, j]: the code of input 16 * block + 4c + j
        c = codes.view(-1, TILE, k // BLOCK, 4, 4).permute(0, 2, 3, 1, 4)
        low, high = c & 15, c >> 4
        columns = [low[:, :, 0] | low[:, :, 1] << 4, low[:, :, 2] | low[:, :, 3] << 4,
                   high[:, :, 0] | high[:, :, 1] << 2 | high[:, :, 2] << 4 | high[:, :, 3] << 6]  # fmt: skip
        packed = torch.stack(columns, dim=2).reshape(-1, k // BLOCK, 192).contiguous()
        return cls((packed, scales.view(-1, TILE, k // BLOCK).transpose(1, 2).contiguous()), n)

    def values(self) -> torch.Tensor:
        packed, scales = self.tensors
        k = self.in_features
        first, second, highs = packed.view(-1, k // BLOCK, 3, TILE, 4).unbind(dim=2)  # each [tile, block, row, j]
        low = torch.stack([first & 15, first >> 4, second & 15, second >> 4], dim=2)
        high = torch.stack([highs & 3, highs >> 2 & 3, highs >> 4 & 3, highs >> 6], dim=2)
        codes = (low | high << 4).permute(0, 3, 1, 2, 4).reshape(-1, TILE, k // BLOCK, BLOCK).float() - 32
        rows = codes * scales.float().transpose(1, 2)[..., None]
        return rows.reshape(-1, TILE, k // GROUP, GROUP)


FORMATS: dict[str, type[TiledWeight]] = {INT8: Int8Weight, INT6: Int6Weight, INT4: Int4Weight, INT4K: Int4KWeight}


def restore(fmt: str, tensors: Sequence[torch.Tensor], out_features: int) -> QuantizedWeight:
    """A weight from the `tensors` of a copy in `fmt` (as saved: `models.weights.save_layers`)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}")
    return FORMATS[fmt](tuple(tensors), out_features)


def quantize(weight: torch.Tensor, fmt: str) -> QuantizedWeight | None:
    """`weight` [N, K] in `fmt` (its `dense` values: the weight a model serves with it); None where
    it does not fit (inputs not in whole groups of GROUP, or values float16 scales cannot hold):
    the layer stays dense."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}")
    kind = FORMATS[fmt]
    return kind.quantize(weight) if kind.fits(weight) else None


class StackedWeight(QuantizedWeight):
    """Weights sharing their input that do not fuse into one (a Q4_K_M GGUF keeps some layers' v
    at 6 bits beside a 4-bit q and k): one kernel call each, outputs side by side."""

    def __init__(self, parts: Sequence[QuantizedWeight]):
        self.parts = list(parts)
        self.fmt = "+".join(sorted({p.fmt for p in parts}))
        self.out_features, self.in_features = sum(p.out_features for p in parts), parts[0].in_features

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.cat([part.matmul(rows) for part in self.parts], dim=-1)

    def nbytes(self) -> int:
        return sum(part.nbytes() for part in self.parts)

    def head(self, rows: int) -> QuantizedWeight:
        return self  # timed whole: the parts are a layer's q, k and v


def concatenate(weights: Sequence[QuantizedWeight]) -> QuantizedWeight:
    """Weights sharing their input (q, k and v) as one, stacked along the outputs: exact, as every
    output row is quantized on its own and tiles are independent. Where their formats differ, or
    a part other than the last ends in a padded tile, each run of one format that can stack is
    one call (a Q4_K_M file's int4k q and k, then an int6 v)."""
    runs: list[list[QuantizedWeight]] = []
    for weight in weights:
        last = runs[-1][-1] if runs else None
        stacks = isinstance(weight, TiledWeight) and isinstance(last, TiledWeight) and not last.padded
        if stacks and type(weight) is type(last):
            runs[-1].append(weight)
        else:
            runs.append([weight])
    parts = [run[0] if len(run) == 1 else _stack(run) for run in runs]
    return parts[0] if len(parts) == 1 else StackedWeight(parts)


def _stack(weights: list[QuantizedWeight]) -> TiledWeight:
    tiled = [w for w in weights if isinstance(w, TiledWeight)]
    stacked = tuple(torch.cat(parts) for parts in zip(*(w.tensors for w in tiled)))
    return tiled[0].__class__(stacked, sum(w.out_features for w in tiled))


def footprint(
    model: nn.Module, fused: Sequence[QuantizedWeight | None] = (), extra: Sequence[torch.Tensor | None] = ()
) -> tuple[int, int]:
    """(dense bytes, quantized bytes) of the weights `model` holds resident, with the `fused`
    copies and `extra` tensors (packed products) its forward keeps outside its modules."""
    seen: set[int] = set()
    dense = 0
    packed = [getattr(m, "packed_weight", None) for m in model.modules()]
    tensors = list(model.parameters()) + list(model.buffers()) + [t for t in (*packed, *extra) if t is not None]
    for tensor in tensors:
        if tensor.is_meta:  # a dense weight dropped where no step reads it (`linear_kernels.drop_dense`)
            continue
        try:
            key = tensor.data_ptr()
        except RuntimeError:  # oneDNN's packed weights are opaque: no storage to point at
            key = id(tensor)
        if key not in seen:
            seen.add(key)
            dense += tensor.numel() * tensor.element_size()
    found = {id(w): w for w in fused if w is not None}
    for module in model.modules():
        weight = getattr(module, "quantized_weight", None)
        if isinstance(weight, QuantizedWeight):
            found[id(weight)] = weight
    return dense, sum(w.nbytes() for w in found.values())
