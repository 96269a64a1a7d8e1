"""models.layer_ops: each fused CPU kernel against the torch expression it replaces, and which
of the two a step runs."""

from __future__ import annotations

import pytest
import torch

from models import layer_ops
from models.layer_ops import FUSED_OPS, TORCH_OPS

# Equal to float32 rounding; in bf16 a sum taken in another order may round one way where
# torch rounds the other: one bf16 step (2^-8 relative) either side.
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=2**-7)}
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def kernels(built_kernels):
    return built_kernels


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, **TOLERANCE[want.dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [576, 20, 7])  # whole vectors, a tail, less than one vector
@pytest.mark.parametrize("rows", [1, 33])
def test_norms_match_torch(dtype, dim, rows):
    torch.manual_seed(dim + rows)
    x, delta = torch.randn(rows, dim, dtype=dtype) * 3, torch.randn(rows, dim, dtype=dtype)
    weight = torch.rand(dim, dtype=dtype) + 0.5
    close(FUSED_OPS.norm(x, weight, 1e-5), TORCH_OPS.norm(x, weight, 1e-5))
    (fused_sum, fused_norm), (torch_sum, torch_norm) = (
        ops.add_norm(x, delta, weight, 1e-5) for ops in (FUSED_OPS, TORCH_OPS)
    )
    assert torch.equal(fused_sum, torch_sum)  # one rounded add per element, as torch's
    close(fused_norm, torch_norm)
    same, normed = FUSED_OPS.add_norm(x, None, weight, 1e-5)
    assert same is x
    close(normed, TORCH_OPS.norm(x, weight, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [1536, 20])
def test_silu_mul_matches_torch(dtype, dim):
    torch.manual_seed(dim)
    gate_up = torch.randn(5, 2 * dim, dtype=dtype) * 4
    # e^-g past both clamps, zero, e^-g overflowing float32, and infinities
    extremes = [-100.0, 100.0, 0.0, -1e30, -3e38, 3e38, float("-inf"), float("inf")]
    gate_up[0, : len(extremes)] = torch.tensor(extremes)
    got, want = FUSED_OPS.silu_mul(gate_up), TORCH_OPS.silu_mul(gate_up)
    torch.testing.assert_close(got, want, equal_nan=True, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 12])  # half a lane multiple or not
def test_rotation_and_kv_write_match_torch(dtype, head_dim):
    torch.manual_seed(head_dim)
    heads, kv_heads, tokens, slots = 6, 2, 5, 40
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    angles = torch.rand(tokens, head_dim // 2) * 10
    cos = torch.cat([angles.cos()] * 2, -1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, -1).to(dtype)
    dest = torch.tensor([3, 17, 0, 39, 8])
    pools = {}
    for name, ops in (("fused", FUSED_OPS), ("torch", TORCH_OPS)):
        k_pool = torch.zeros(kv_heads, slots, head_dim, dtype=dtype)
        v_pool = torch.zeros_like(k_pool)
        q = ops.rotate_and_store(qkv, ops.rotary_tables(cos, sin), k_pool, v_pool, dest, heads, kv_heads)
        pools[name] = (q.reshape(tokens, heads, head_dim), k_pool, v_pool)
    (fq, fk, fv), (tq, tk, tv) = pools["fused"], pools["torch"]
    if dtype == torch.bfloat16:  # a bf16 rounding after each product and after the sum, as torch's
        assert torch.equal(fq, tq) and torch.equal(fk, tk)
    close(fq, tq)
    close(fk, tk)
    assert torch.equal(fv, tv)
    assert fk[:, [1, 2, 4]].abs().sum() == 0  # only the rows in dest were written


def test_rotation_refuses_a_pool_row_outside_the_pool():
    qkv = torch.randn(1, 4 * 8)
    k_pool, v_pool = torch.zeros(1, 4, 8), torch.zeros(1, 4, 8)
    tables = FUSED_OPS.rotary_tables(torch.ones(1, 8), torch.zeros(1, 8))
    with pytest.raises(RuntimeError, match="out of range"):
        FUSED_OPS.rotate_and_store(qkv, tables, k_pool, v_pool, torch.tensor([4]), 2, 1)


def test_a_step_runs_the_fused_kernels_only_where_they_apply(monkeypatch):
    monkeypatch.setattr(layer_ops, "_fused", False)
    x = torch.zeros(2, 8)
    assert layer_ops.for_step(x, x) is TORCH_OPS
    layer_ops.use(True)
    assert layer_ops.for_step(x, x) is FUSED_OPS
    assert layer_ops.for_step(x.bfloat16(), x.bfloat16()) is FUSED_OPS
    assert layer_ops.for_step(x.half(), x.half()) is TORCH_OPS  # no float16 kernels
    assert layer_ops.for_step(x.bfloat16(), x) is TORCH_OPS  # a pool in another dtype
