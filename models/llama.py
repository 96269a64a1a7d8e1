"""Our own forward for Llama-family decoders (Llama, Mistral, Qwen2, SmolLM2), over the HF modules' weights.

transformers' forward costs about 290 tensor operations and a deep stack of
Python calls per decoder layer (keyword plumbing, a causal mask built per
call, the attention interface's dispatch); on a 2-core CPU that was a third
of a SmolLM2 decode step. This forward runs the same layers in about 30
operations each: the packed tokens `[T, H]` go through the HF model's own
embedding, weights (q, k and v fused into one GEMM, gate and up into another:
on 2 cores three small GEMMs cost twice one of their sum), norms and rotary
embedding, with the tuned GEMM layouts (`models.linear_kernels`), the rotation
is applied to queries and keys together, keys and values go straight into the paged pool, and attention reads
it through the step's layout (`models.kv_cache.attend`). Same arithmetic as
transformers' layers, op for op, so logits match to rounding.

`LlamaForward.build` returns None for any model it does not know exactly
(another architecture, a sliding window, per-head norms, an activation
other than SiLU); such models run transformers' forward (`models.forward`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from models import layer_ops
from models.kv_cache import KVCache, StepLayout, attend, text_config
from models.linear_kernels import (
    PACKED,
    STANDARD,
    KernelTable,
    ModelKernels,
    TunedLinear,
    check_dense_kept,
    dense_placeholder,
    drop_dense,
    linear,
    pack,
    reads_no_dense,
)
from models.quantized import QuantizedWeight, concatenate

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
LAYER_CHILDREN = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
ATTENTION_CHILDREN = {"q_proj", "k_proj", "v_proj", "o_proj"}
MLP_CHILDREN = {"gate_proj", "up_proj", "down_proj", "act_fn"}


class Projection:
    """Linear layers fused into one GEMM (q, k and v; gate and up) over one weight, with the
    GEMM layout the layers' kernel table picks per token count (`models.linear_kernels`).

    The fused weight is the layers' weights concatenated; the layers' own parameters become
    views of it, so nothing is stored twice and transformers' forward still runs on them.
    Where the table packs, the fused weight is packed once and the layers' packed copies go.
    Quantized layers (`models.quantized`) fuse their copies too (one product where they stack, one
    call each where they do not), and the members drop theirs: transformers' forward runs them
    dense, on the same values.
    """

    def __init__(self, layers: Sequence[nn.Linear]):
        weight = torch.cat([layer.weight.detach() for layer in layers])
        has_bias = [layer.bias is not None for layer in layers]
        bias = torch.cat([layer.bias.detach() for layer in layers]) if all(has_bias) else None
        if any(has_bias) and bias is None:
            raise ValueError("fusing linear layers where only some have a bias")
        table: KernelTable = getattr(layers[0], "kernel_table", STANDARD)
        self.sizes = [layer.out_features for layer in layers]
        offset = 0
        for layer, size in zip(layers, self.sizes):
            layer.weight.data = weight[offset : offset + size]
            if bias is not None:
                layer.bias.data = bias[offset : offset + size]
            offset += size
        self.members = list(layers)
        self.weight, self.bias = weight, bias
        self.packed: torch.Tensor | None = None
        copies = [getattr(layer, "quantized_weight", None) for layer in layers]
        self.quantized_weight = concatenate(copies) if all(c is not None for c in copies) else None  # type: ignore[arg-type]
        for layer in layers:
            if isinstance(layer, TunedLinear) and layer.quantized_weight is not None:
                # The copy is the fused product's now (or, where only some members had one, none
                # runs: the fused product is dense); transformers' forward runs the members dense.
                layer.quantized_weight, layer.kernel_table = None, STANDARD
        self.use_table(table)

    def use_table(self, table: KernelTable) -> None:
        check_dense_kept(self.weight, table)
        self.table = table
        self.packed = pack(self.weight) if table.uses(PACKED) else None
        for layer in self.members:
            if isinstance(layer, TunedLinear) and layer.packed_weight is not None:
                # The packed copy is the fused weight's now; transformers' forward (tests,
                # training) runs these layers on their plain views instead.
                layer.packed_weight, layer.kernel_table = None, STANDARD

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.table.layout(x.shape[0]), self.packed, self.quantized_weight)

    def drop_dense(self) -> bool:
        """Free the fused dense weight (and so the members' views of it) where the table runs the
        weight-only kernel at every step size (`linear_kernels.drop_dense`)."""
        if not reads_no_dense(self.quantized_weight, self.table):
            return False
        self.weight = dense_placeholder(self.weight)
        for layer in self.members:
            layer.weight = dense_placeholder(layer.weight)
        return True


@dataclass
class _Layer:
    qkv: Projection  # [T, H] -> [T, (heads + 2 kv_heads) * D]
    o_proj: nn.Module
    gate_up: Projection  # [T, H] -> [T, 2 I]
    down_proj: nn.Module
    input_norm: nn.Parameter  # [H] RMSNorm weights
    post_attention_norm: nn.Parameter
    input_eps: float
    post_attention_eps: float


class LlamaForward:
    """One packed forward of a Llama-family causal LM, reading and writing a `KVCache`."""

    def __init__(self, model: Any):
        decoder = model.get_decoder()
        config = text_config(model.config)
        attention = decoder.layers[0].self_attn
        self.embed = decoder.embed_tokens
        self.rotary = decoder.rotary_emb
        self.norm, self.norm_eps = decoder.norm.weight, decoder.norm.variance_epsilon
        self.lm_head = model.get_output_embeddings()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads or self.num_heads
        self.head_dim = attention.head_dim
        self.scaling = attention.scaling
        self.layers = [
            _Layer(
                Projection([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]),
                layer.self_attn.o_proj,
                Projection([layer.mlp.gate_proj, layer.mlp.up_proj]),
                layer.mlp.down_proj,
                layer.input_layernorm.weight,
                layer.post_attention_layernorm.weight,
                layer.input_layernorm.variance_epsilon,
                layer.post_attention_layernorm.variance_epsilon,
            )
            for layer in decoder.layers[: config.num_hidden_layers]
        ]

    def gemms(self) -> list[Any]:
        """The decoder's products as this forward runs them, for `models.kernel_tuning.tune_model`."""
        return [gemm for layer in self.layers for gemm in (layer.qkv, layer.o_proj, layer.gate_up, layer.down_proj)]

    def fused_copies(self) -> list[QuantizedWeight | None]:
        """The quantized copies of the fused products (which are not the model's modules)."""
        return [p.quantized_weight for layer in self.layers for p in (layer.qkv, layer.gate_up)]

    def fused_tensors(self) -> list[torch.Tensor | None]:
        """The fused products' dense and packed weights (outside the model's modules too)."""
        return [t for layer in self.layers for p in (layer.qkv, layer.gate_up) for t in (p.weight, p.packed)]

    def drop_dense(self) -> int:
        """Free the dense weights no step reads: those of the quantized products (the output
        projection's too) whose tables run the weight-only kernel at every step size. Serving
        needs nothing else; transformers' own forward and training can no longer run the model.
        Returns how many products dropped theirs."""
        dropped = [p.drop_dense() for layer in self.layers for p in (layer.qkv, layer.gate_up)]
        dropped += [drop_dense(m) for layer in self.layers for m in (layer.o_proj, layer.down_proj)]
        return sum(dropped) + drop_dense(self.lm_head)

    def use_kernels(self, kernels: ModelKernels) -> None:
        """The fused products follow their tuned tables (o_proj and down_proj are the model's own
        layers, which `install_model` already set)."""
        for layer in self.layers:
            layer.qkv.use_table(kernels.table_for(layer.qkv))
            layer.gate_up.use_table(kernels.table_for(layer.gate_up))

    @classmethod
    def build(cls, model: Any) -> LlamaForward | None:
        """This forward for `model`, or None where it would not compute what transformers does."""
        config = text_config(model.config)
        if getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
            return None
        if getattr(config, "hidden_act", None) != "silu" or not isinstance(model.get_output_embeddings(), nn.Linear):
            return None
        decoder = model.get_decoder()
        for layer in decoder.layers:
            if {name for name, _ in layer.named_children()} != LAYER_CHILDREN:
                return None
            if {name for name, _ in layer.self_attn.named_children()} != ATTENTION_CHILDREN:
                return None  # per-head norms (Qwen3) or anything else this forward does not apply
            if {name for name, _ in layer.mlp.named_children()} != MLP_CHILDREN:
                return None
        if uses_sliding_window(config):
            return None
        return cls(model)

    @torch.inference_mode()
    def __call__(
        self,
        cache: KVCache,
        layout: StepLayout,
        input_ids: torch.Tensor,
        keep: torch.Tensor | int,
        layers: Sequence[int] = (),
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits `[len(keep), V]` (the model's dtype; keep 0: every token) and the hidden states
        `[T, H * len(layers)]` of `layers` (decoder layer i's output; the last index is the
        final norm's output, as `models.forward.forward_with_hidden`), or `[T, H]` of the final
        norm's output when `layers` is empty."""
        if any(not 1 <= i <= len(self.layers) for i in layers):
            raise ValueError(f"layers {list(layers)} are not all among the model's 1..{len(self.layers)}")
        num_tokens = input_ids.shape[0]
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        x = self.embed(input_ids)  # [T, H]
        ops = layer_ops.for_step(x, cache.keys[0])
        cos, sin = self.rotary(x[None], layout.token_pos[None])  # [1, T, D] each: every head alike
        tables = ops.rotary_tables(cos[0], sin[0])
        wanted = {i for i in layers if i < len(self.layers)}  # the last index is the final norm's output
        kept: dict[int, torch.Tensor] = {}
        delta: torch.Tensor | None = None  # the last MLP's output, added to x by the next norm
        for index, (layer, k_pool, v_pool) in enumerate(zip(self.layers, cache.keys, cache.values), start=1):
            x, h = ops.add_norm(x, delta, layer.input_norm, layer.input_eps)
            q = ops.rotate_and_store(layer.qkv(h), tables, k_pool, v_pool, layout.token_dest, heads, kv_heads)
            out = attend(layout, q, k_pool, v_pool, self.scaling)  # [T, heads, D]
            attended = layer.o_proj(out.reshape(num_tokens, heads * head_dim))
            x, h = ops.add_norm(x, attended, layer.post_attention_norm, layer.post_attention_eps)
            delta = layer.down_proj(ops.silu_mul(layer.gate_up(h)))
            if index in wanted:
                x, delta = x + delta, None
                kept[index] = x
        x, last = ops.add_norm(x, delta, self.norm, self.norm_eps)
        rows = last if isinstance(keep, int) else last.index_select(0, keep)  # keep 0: every row
        logits = self.lm_head(rows)  # the model's dtype: callers convert where they need float32
        if not layers:
            return logits, last
        return logits, torch.cat([kept.get(i, last) for i in layers], dim=-1)


def uses_sliding_window(config) -> bool:
    """Whether any layer attends over a window rather than its whole context."""
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        return True
    if config.model_type == "qwen2":  # Qwen2 configs carry a window they do not use unless asked
        return bool(getattr(config, "use_sliding_window", False))
    return bool(getattr(config, "sliding_window", None))
