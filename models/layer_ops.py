"""A decoder layer's small operations for `models.llama`'s forward: torch's, or the fused CPU
kernels (`csrc/layer_ops.cpp`, built by `models.cpu_kernels`).

Between its four GEMMs and attention a Llama layer runs ~25 small torch operations (two
RMSNorms of five each, the residual adds, the rotation, the KV writes, SiLU and the gating
product). At a few tokens a step each costs its dispatch more than its arithmetic. The fused
kernels make one pass per group: residual add + RMSNorm, rotation + KV write, SiLU * up.
Each rounds where the torch expression rounds, so both paths compute the same values to
float32 rounding; `TorchOps` serves on CUDA, for other dtypes, and where the kernels are not
built.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models import cpu_kernels

_fused = False  # CPU float32/bfloat16 layers run the fused kernels (`use`)


def use(wanted: bool) -> None:
    """Whether CPU layers run the fused kernels (only where they are loaded)."""
    global _fused
    _fused = wanted and cpu_kernels.available()


def enabled() -> bool:
    return _fused


class TorchOps:
    """The operations as torch expressions (transformers' arithmetic, op for op)."""

    def rotary_tables(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, D] -> the forms `rotate_and_store` takes: [T, 1, D], every head alike."""
        return cos[:, None], _roll_sin(sin)[:, None]

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """transformers' LlamaRMSNorm: in float32, then scaled in the input's dtype."""
        return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)

    def add_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add (none: x as it is) and the norm of its result."""
        if delta is not None:
            x = x + delta
        return x, self.norm(x, weight, eps)

    def rotate_and_store(
        self,
        qkv: torch.Tensor,
        tables: tuple[torch.Tensor, torch.Tensor],
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        dest: torch.Tensor,
        heads: int,
        kv_heads: int,
    ) -> torch.Tensor:
        """qkv [T, (H + 2 KVH) D]: rotate queries and keys, write keys and values to pool rows
        `dest`; the queries [T, H, D]."""
        cos, sin = tables
        tokens, head_dim = qkv.shape[0], k_pool.shape[-1]
        rotated = (heads + kv_heads) * head_dim
        qk = qkv[:, :rotated].view(tokens, heads + kv_heads, head_dim)
        qk = qk * cos + qk.roll(head_dim // 2, -1) * sin
        k = qk[:, heads:]
        v = qkv[:, rotated:].view(tokens, kv_heads, head_dim)
        k_pool.index_copy_(1, dest, k.transpose(0, 1).to(k_pool.dtype))
        v_pool.index_copy_(1, dest, v.transpose(0, 1).to(v_pool.dtype))
        return qk[:, :heads]

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, -1)
        return F.silu(gate) * up


class FusedOps(TorchOps):
    """The same operations, each one pass of `torch.ops.specd`'s kernels."""

    def rotary_tables(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return cos.contiguous(), _roll_sin(sin)

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return torch.ops.specd.rms_norm(x, weight, eps)

    def add_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if delta is None:
            return x, self.norm(x, weight, eps)
        return torch.ops.specd.add_rms_norm(x, delta, weight, eps)

    def rotate_and_store(self, qkv, tables, k_pool, v_pool, dest, heads, kv_heads) -> torch.Tensor:
        cos, sin = tables
        return torch.ops.specd.rotary_kv(qkv, cos, sin, k_pool, v_pool, dest, heads, kv_heads)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return torch.ops.specd.silu_mul(gate_up)


def _roll_sin(sin: torch.Tensor) -> torch.Tensor:
    """rotate_half(x) * sin equals roll(x, D / 2) * sin with sin's first half negated: one roll,
    exact. [T, D] -> that sin, contiguous."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


TORCH_OPS = TorchOps()
FUSED_OPS = FusedOps()


def for_step(x: torch.Tensor, pool: torch.Tensor) -> TorchOps:
    """The operations for a step whose activations are `x` and whose KV pool is `pool`."""
    fused = _fused and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and pool.dtype == x.dtype
    return FUSED_OPS if fused else TORCH_OPS
