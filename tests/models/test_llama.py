"""specd's own Llama-family forward: taken for the models it knows, refused for the rest,
and the same logits, KV and hidden states as transformers' forward in bf16 too."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen3Config

from models import forward, layer_ops
from models.forward import forward_with_hidden, hf_forward_with_hidden, lean_forward
from models.kv_cache import ATTN_IMPLEMENTATION, KVCache, LayoutPlan
from models.llama import LlamaForward
from models.transfer import HostBuffer
from tests.support.tensors import slot_table

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)  # fmt: skip


def test_the_llama_family_runs_its_own_forward(tiny_llama_dir, tiny_qwen2_dir):
    for path in (tiny_llama_dir, tiny_qwen2_dir):
        model = AutoModelForCausalLM.from_pretrained(path)
        assert isinstance(lean_forward(model), LlamaForward)
        assert lean_forward(model) is lean_forward(model)  # built once per model


@pytest.mark.parametrize(
    "config",
    [
        MistralConfig(**SMALL, sliding_window=16),  # a window the lean forward does not apply
        Qwen3Config(**SMALL, head_dim=8),  # per-head q/k norms
        LlamaConfig(**SMALL, hidden_act="gelu"),
    ],
    ids=["sliding-window", "qk-norm", "gelu"],
)
def test_models_it_does_not_know_exactly_run_transformers_forward(config):
    model = AutoModelForCausalLM.from_config(config)
    assert LlamaForward.build(model) is None


@pytest.mark.parametrize("fused", [False, True], ids=["torch-ops", "fused-ops"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_same_logits_kv_and_hidden_states_as_transformers_forward(tiny_llama_dir, dtype, fused, request, monkeypatch):
    if fused:
        request.getfixturevalue("built_kernels")
    monkeypatch.setattr(layer_ops, "_fused", layer_ops.enabled())  # restored after
    layer_ops.use(fused)
    assert layer_ops.enabled() is fused
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=dtype).eval()
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    lean = lean_forward(model)
    assert isinstance(lean, LlamaForward)
    attention = model.model.layers[0].self_attn  # its weights are views of the fused one: stored once
    assert attention.k_proj.weight.data_ptr() == lean.layers[0].qkv.weight.data_ptr() + attention.q_proj.weight.nbytes
    block = 8
    caches = [KVCache.for_model(model.config, 32, block, dtype, torch.device("cpu")) for _ in range(2)]
    tables = [slot_table(s, 4, 8) for s in range(3)]
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (12, 5, 21)]
    layers = [1, model.config.num_hidden_layers]  # a decoder layer's output and the final norm's

    def step(run, cache, starts, rows, keep):
        buf = HostBuffer()
        plan = LayoutPlan.build(tables, starts, [len(r) for r in rows], block)
        plan.add_to(buf, "layout")
        buf.ints("input_ids", [t for r in rows for t in r])
        buf.ints("keep", keep)
        arrays = buf.upload(torch.device("cpu"))
        return run(model, cache, plan.resolve(arrays, "layout"), arrays["input_ids"], arrays["keep"], layers)

    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for run, cache in zip((forward_with_hidden, hf_forward_with_hidden), caches):
        step(run, cache, [0, 0, 0], prompts, [11, 16, 37])  # three prefills
    # Then a decode row, a verify row and a decode row, on top of what each forward wrote.
    rows = [[7], [9, 10, 11, 12], [13]]
    starts = [12, 5, 21]
    (lean_logits, lean_hidden), (hf_logits, hf_hidden) = (
        step(run, cache, starts, rows, [0, 1, 2, 3, 4, 5])
        for run, cache in zip((forward_with_hidden, hf_forward_with_hidden), caches)
    )
    torch.testing.assert_close(lean_logits, hf_logits, atol=tol, rtol=tol)
    torch.testing.assert_close(lean_hidden.float(), hf_hidden.float(), atol=tol, rtol=tol)
    for layer in range(model.config.num_hidden_layers):
        torch.testing.assert_close(caches[0].keys[layer].float(), caches[1].keys[layer].float(), atol=tol, rtol=tol)
        torch.testing.assert_close(caches[0].values[layer].float(), caches[1].values[layer].float(), atol=tol, rtol=tol)


def test_switching_it_off_runs_transformers_forward(tiny_llama_dir, monkeypatch):
    monkeypatch.setattr(forward, "USE_LEAN_FORWARD", False)
    monkeypatch.setattr(forward, "_LEAN", type(forward._LEAN)())
    assert lean_forward(AutoModelForCausalLM.from_pretrained(tiny_llama_dir)) is None
