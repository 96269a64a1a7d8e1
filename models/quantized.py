"""Weight-only quantized copies of linear layers: int8 per output channel, int4 in groups of 32 inputs.

On a CPU a decode step is a read of every weight. A GGUF ships its weights at 4-6 bits; widened
to bfloat16 they cost 3-4x the bytes per step (Qwen2.5-Coder-1.5B Q4_K_M: 1.1 GB on disk, 3.1 GB
per step). A quantized layer multiplies with torch's own weight-only CPU kernels, the ones
gpt-fast and torchao use:

- int8: `aten._weight_int8pack_mm`, codes [N, K] int8 and one scale per output row
  (w = code * scale, symmetric).
- int4: `aten._weight_int4pack_mm_for_cpu`, codes packed by `aten._convert_weight_to_int4pack_for_cpu`
  and a (scale, zero) pair per row and group of `GROUP` inputs (w = (code - 8) * scale + zero,
  asymmetric). 32 is the sub-block of llama.cpp's Q4_K: a Q4_K tensor is requantized on its own
  groups (from their min and max, scale and zero rounded to the served dtype).

Those kernels win where a step is a weights read, and lose where it is compute: their cost grows
with the rows in a step (on a 2-core AMX Xeon, one 17920 x 1536 product, warm in cache: 1 row
0.9 ms int4 against 2.1 ms bfloat16, 8 rows 3.3 ms against 2.0, 256 rows 105 ms against 9). So a
quantized layer keeps its dense weight too, set to the values its codes stand for (rounded to
the served dtype): the model served is the quantized one at every step size, and the kernel
table (`models.linear_kernels`, timed per row count at load) picks the weight-only kernel or a
dense layout per step. Resident cost: the dense weight (and its packed copy where a dense layout
packs) plus 1 (int8) or 0.5 (int4) bytes per weight.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

INT8, INT4 = "int8", "int4"
GROUP = 32  # inputs per int4 (scale, zero) group


class QuantizedWeight:
    """One weight [N, K] in a quantized format; `matmul` multiplies rows by its transpose."""

    fmt: str
    out_features: int
    in_features: int

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [M, K] @ W^T -> [M, N] in rows' dtype, through the weight-only kernel."""
        raise NotImplementedError

    def nbytes(self) -> int:
        raise NotImplementedError

    def head(self, rows: int) -> QuantizedWeight:
        """The first `rows` output rows or more (a view), for timing a sample of a large weight."""
        raise NotImplementedError


class Int8Weight(QuantizedWeight):
    fmt = INT8

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor):
        self.codes, self.scales = codes, scales  # [N, K] int8; [N] in the activations' dtype
        self.out_features, self.in_features = codes.shape

    @classmethod
    def quantize(cls, weight: torch.Tensor, dtype: torch.dtype) -> tuple[Int8Weight, torch.Tensor]:
        w = weight.detach().float()
        scales = (w.abs().amax(dim=1) / 127.0).clamp(min=torch.finfo(torch.float32).tiny).to(dtype)
        codes = torch.round(w / scales.float()[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls(codes.contiguous(), scales), (codes.float() * scales.float()[:, None]).to(dtype)

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        scales = self.scales if self.scales.dtype == rows.dtype else self.scales.to(rows.dtype)
        return torch.ops.aten._weight_int8pack_mm(rows, self.codes, scales)

    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes

    def head(self, rows: int) -> Int8Weight:
        return Int8Weight(self.codes[:rows], self.scales[:rows])


class Int4Weight(QuantizedWeight):
    fmt = INT4

    def __init__(self, packed: torch.Tensor, scales_zeros: torch.Tensor, out_features: int, in_features: int):
        # packed: torch's kernel layout (private to it: AVX2 and AVX-512 builds differ);
        # scales_zeros [K / GROUP, N, 2] in the activations' dtype.
        self.packed, self.scales_zeros = packed, scales_zeros
        self.out_features, self.in_features = out_features, in_features

    @staticmethod
    def fits(weight: torch.Tensor) -> bool:
        """Whole groups of inputs, and outputs in the multiples of 16 torch's packing takes."""
        return weight.shape[1] % GROUP == 0 and weight.shape[0] % 16 == 0 and weight.device.type == "cpu"

    @classmethod
    def quantize(cls, weight: torch.Tensor, dtype: torch.dtype) -> tuple[Int4Weight, torch.Tensor]:
        n, k = weight.shape
        w = weight.detach().float().view(n, k // GROUP, GROUP)
        low, high = w.amin(dim=-1), w.amax(dim=-1)
        scales = ((high - low) / 15.0).clamp(min=torch.finfo(torch.float32).tiny)
        codes = torch.round((w - low[..., None]) / scales[..., None]).clamp_(0, 15)
        # What the kernel computes with: (code - 8) * scale + zero, scale and zero in `dtype`.
        scales_zeros = torch.stack((scales, low + 8.0 * scales), dim=-1).to(dtype)  # [N, K / GROUP, 2]
        scale, zero = scales_zeros.float().unbind(-1)
        dense = ((codes - 8.0) * scale[..., None] + zero[..., None]).view(n, k).to(dtype)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.view(n, k).to(torch.int32), 1)
        return cls(packed, scales_zeros.transpose(0, 1).contiguous(), n, k), dense

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        sz = self.scales_zeros if self.scales_zeros.dtype == rows.dtype else self.scales_zeros.to(rows.dtype)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, GROUP, sz)

    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_zeros.nbytes

    def head(self, rows: int) -> Int4Weight:
        # torch's layout blocks 64 output rows at most (AVX-512; 32 on AVX2): whole blocks slice.
        rows = min(self.out_features, -(-rows // 64) * 64)
        return Int4Weight(self.packed[:rows], self.scales_zeros[:, :rows].contiguous(), rows, self.in_features)


def quantize(weight: torch.Tensor, fmt: str, dtype: torch.dtype) -> tuple[QuantizedWeight, torch.Tensor]:
    """`weight` [N, K] in `fmt`, and the dense weight [N, K] in `dtype` its codes stand for (int4
    falls back to int8 where the shape does not fit its packing, `Int4Weight.fits`)."""
    if fmt == INT4 and Int4Weight.fits(weight):
        return Int4Weight.quantize(weight, dtype)
    if fmt in (INT4, INT8):
        return Int8Weight.quantize(weight, dtype)
    raise ValueError(f"unknown weight format {fmt!r}")


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
    output row is quantized on its own. Where their formats differ, or where torch's int4 layout
    does not stack (checked on a probe row: that layout is the kernel's own), one call each."""
    if len({type(w) for w in weights}) != 1:
        return StackedWeight(weights)
    if isinstance(weights[0], Int8Weight):
        return Int8Weight(
            torch.cat([w.codes for w in weights]),  # type: ignore[attr-defined]
            torch.cat([w.scales for w in weights]),  # type: ignore[attr-defined]
        )
    fused = Int4Weight(
        torch.cat([w.packed for w in weights]),  # type: ignore[attr-defined]
        torch.cat([w.scales_zeros for w in weights], dim=1),  # type: ignore[attr-defined]
        sum(w.out_features for w in weights),
        weights[0].in_features,
    )
    probe = torch.randn(1, fused.in_features, dtype=fused.scales_zeros.dtype)
    if not torch.equal(fused.matmul(probe), torch.cat([w.matmul(probe) for w in weights], dim=-1)):
        return StackedWeight(weights)
    return fused


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
