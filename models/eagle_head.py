"""An EAGLE-style draft head: one decoder layer over the target's own features.

At position p the head reads the target's feature f_p and the embedding of the
token that follows, x_{p+1}:

    g_p = layer(fc([embed(x_{p+1}) ; f_p]))
    logits over the draft vocabulary = W_draft g_p  (W_draft: rows of the target's lm_head)

so g_p predicts x_{p+2}, and a chain feeds g_p back as the next feature. f_p is
either the target's last hidden state h_p (post final norm: what its lm_head
reads; EAGLE-1, where g_p is also trained to regress h_{p+1}), or, for a head
with `feature_layers`, a low, a middle and a high layer's states, each
RMS-normalised and fused to the hidden size by a linear layer (EAGLE-3's
features, trained on tokens alone: they accept more here, docs/training.md). The
embeddings and the output rows are the target's own, frozen and never saved: a
head directory holds the fuse, fc and decoder-layer weights, the draft
vocabulary (most frequent target tokens) and the identity of the target it was
trained for, which `load_head` checks.

Logits come back over the target's full vocabulary with -inf outside the
draft vocabulary, so q is exactly 0 there and the rejection sampler stays
lossless.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from models.forward import cache_kwargs
from models.kv_cache import text_config
from models.linear_kernels import (
    PACKED,
    QUANTIZED,
    STANDARD_LAYOUT,
    UNTUNED,
    ModelKernels,
    install,
    linear,
    linear_layers,
    pack,
)

HEAD_FORMAT = 1
CONFIG_FILE = "eagle_head.json"
WEIGHTS_FILE = "eagle_head.safetensors"
TRAINED = ("fuse.", "fc.", "layer.")  # the weights a head directory holds


def fused_feature_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low, middle and high layers for a target of `num_layers` layers, as indices
    into its `hidden_states` (i: the output of decoder layer i, counting from 1; the last
    one is the final norm's output): 3, 15 and 27 of SmolLM2's 30. Fewer on tiny models."""
    return sorted({min(3, num_layers), max(1, num_layers // 2), max(1, num_layers - 3)})


class HeadMismatch(ValueError):
    """A head directory that cannot serve this target; the message says why."""


@dataclass
class TargetIdentity:
    """What a head was trained against: a head for another model must be refused."""

    architecture: str
    hidden_size: int
    vocab_size: int
    num_hidden_layers: int
    weights_sha256: str  # of the input embeddings rounded to bfloat16, so float32 and bf16 loads agree

    @classmethod
    def of(cls, model) -> TargetIdentity:
        config = text_config(model.config)
        embed = model.get_input_embeddings().weight.detach()
        digest = hashlib.sha256(embed.to(torch.bfloat16).view(torch.int16).cpu().numpy().tobytes())
        return cls(
            architecture=(getattr(config, "architectures", None) or [type(model).__name__])[0],
            hidden_size=config.hidden_size,
            vocab_size=embed.shape[0],
            num_hidden_layers=config.num_hidden_layers,
            weights_sha256=digest.hexdigest(),
        )

    def mismatch(self, other: TargetIdentity) -> str | None:
        """Why a head made for `self` cannot serve `other`, or None."""
        for name in ("architecture", "hidden_size", "vocab_size", "num_hidden_layers", "weights_sha256"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                return f"{name} is {theirs!r} here but the head was trained for {mine!r}"
        return None


@dataclass
class HeadConfig:
    """Shape of a head and what it was trained for (the JSON beside its weights)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    target: TargetIdentity
    draft_vocab_size: int
    # hidden_states indices the head's features fuse (`fused_feature_layers`); None: the last hidden state.
    feature_layers: list[int] | None = None
    # What training recorded (data, minutes, held-out acceptance per position): for people.
    training: dict = field(default_factory=dict)
    format: int = HEAD_FORMAT

    @classmethod
    def for_target(cls, model, draft_vocab_size: int, feature_layers: list[int] | None = None) -> HeadConfig:
        """A head shaped like one of the target's own layers."""
        config = text_config(model.config)
        heads = config.num_attention_heads
        rope = getattr(config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0
        return cls(
            hidden_size=config.hidden_size,
            intermediate_size=getattr(config, "intermediate_size", None) or 4 * config.hidden_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            rms_norm_eps=getattr(config, "rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position_embeddings=getattr(config, "max_position_embeddings", 2048),
            target=TargetIdentity.of(model),
            draft_vocab_size=draft_vocab_size,
            feature_layers=list(feature_layers) if feature_layers else None,
        )

    def llama_config(self, attn_implementation: str) -> LlamaConfig:
        config = LlamaConfig(
            vocab_size=self.target.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=1,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
        )
        config._attn_implementation = attn_implementation
        return config

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> HeadConfig:
        data = json.loads(text)
        if data.get("format") != HEAD_FORMAT:
            raise HeadMismatch(f"head format {data.get('format')!r}; this specd reads format {HEAD_FORMAT}")
        data["target"] = TargetIdentity(**data["target"])
        return cls(**data)


class EagleHead(nn.Module):
    """The head's trainable part (fc, one decoder layer) over the target's frozen embeddings and output rows.

    `forward` takes packed tokens: `features` [T, H] (the target's h_p, or the
    head's own g from the previous chained step), `input_ids` [T] (x_{p+1}) and
    `position_ids` [T] (p). With a `cache` (a one-layer `models.kv_cache.KVCache`)
    and `specd_layout`, attention reads and writes the paged cache as the target's
    does; without, the tokens are one causal sequence (training).
    """

    embed: nn.Embedding  # the target's (see __init__)
    draft_vocab: torch.Tensor  # [draft_vocab_size] target token ids
    lm_head: torch.Tensor  # [draft_vocab_size, H] the target's output rows for them
    kernels: ModelKernels = UNTUNED  # GEMM layout per row count (`use_kernels`)
    _packed_lm_head: torch.Tensor | None = None  # `lm_head` reordered, where the output table packs

    def __init__(self, config: HeadConfig, embed: nn.Embedding, lm_head_weight: torch.Tensor, draft_vocab: torch.Tensor,
                 attn_implementation: str = "sdpa"):  # fmt: skip
        super().__init__()
        self.config = config
        llama = config.llama_config(attn_implementation)
        hidden = config.hidden_size
        layers = config.feature_layers
        self.fuse = nn.Linear(len(layers) * hidden, hidden, bias=False) if layers else None
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layer = LlamaDecoderLayer(llama, layer_idx=0)
        self.rotary = LlamaRotaryEmbedding(llama)
        # Frozen and not ours: the target's embeddings (kept out of the module tree, so `.to()`
        # and `state_dict()` never touch the target) and its output rows for the draft vocabulary.
        object.__setattr__(self, "embed", embed)
        self.register_buffer("draft_vocab", draft_vocab.long(), persistent=False)
        self.register_buffer("lm_head", lm_head_weight[draft_vocab].detach().clone(), persistent=False)

    @property
    def vocab_size(self) -> int:
        return self.config.target.vocab_size

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """What a head directory stores besides the draft vocabulary."""
        return {k: v for k, v in self.state_dict().items() if k.startswith(TRAINED)}

    def target_features(self, states: torch.Tensor) -> torch.Tensor:
        """What the target computed, as the head reads it at a chain's first step: [..., H] (the
        last hidden state) as is; [..., n H] (`feature_layers`' states side by side) RMS-normalised
        layer by layer, so no layer's scale dominates, then fused to [..., H]."""
        if self.fuse is None:
            return states
        parts = states.float().unflatten(-1, (-1, self.config.hidden_size))
        parts = parts * torch.rsqrt(parts.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return self.fuse(parts.flatten(-2).to(self.fuse.weight.dtype))

    def forward(self, features: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor, cache=None,
                **attention_kwargs) -> torch.Tensor:  # fmt: skip
        """[T, H] features (`target_features`' or a previous g), [T] ids and positions -> g [T, H]; or
        batched, [B, T, H] and [B, T] -> [B, T, H] (training: then pass an `attention_mask`, a
        [B or 1, 1, T, T] bool, True where a query may attend)."""
        batched = features.dim() == 3
        x = torch.cat([self.embed(input_ids), features.to(self.fc.weight.dtype)], dim=-1)
        x = self.fc(x)
        positions = position_ids
        if not batched:
            x, positions = x[None], position_ids[None]  # [1, T, H]
        cos_sin = self.rotary(x, positions)
        out = self.layer(x, position_ids=positions, **cache_kwargs(self.layer, cache), use_cache=cache is not None,
                         position_embeddings=cos_sin, **attention_kwargs)  # fmt: skip
        out = out[0] if isinstance(out, tuple) else out
        return out if batched else out[0]

    def use_kernels(self, kernels: ModelKernels) -> None:
        """Compute as the target does (`models.linear_kernels`): the head's layer has the target's
        layer shapes and its draft logits are rows of the target's output projection, so the
        target's timed tables hold for them. A step drafting for n rows sends n rows through
        each, where on a CPU the standard GEMM layout can cost twice the transposed one."""
        install(linear_layers(self), kernels.layers)
        self.kernels = kernels

    def draft_logits(self, g: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, draft_vocab_size] logits over the draft vocabulary (float32)."""
        g = g.to(self.lm_head.dtype)
        layout = self.kernels.output.layout(g.shape[0])
        if layout == QUANTIZED:  # the target's quantized copy is not the head's: its rows run dense
            layout = STANDARD_LAYOUT
        if layout == PACKED and self._packed_lm_head is None:
            self._packed_lm_head = pack(self.lm_head)
        return linear(g, self.lm_head, None, layout, self._packed_lm_head).float()

    def full_logits(self, g: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, vocab] float32, -inf outside the draft vocabulary (q = 0 there)."""
        logits = g.new_full((g.shape[0], self.vocab_size), float("-inf"), dtype=torch.float32)
        logits[:, self.draft_vocab] = self.draft_logits(g)
        return logits


def new_head(target_model, draft_vocab: torch.Tensor, feature_layers: list[int] | None = None) -> EagleHead:
    """A freshly initialised head for `target_model` (training starts here)."""
    config = HeadConfig.for_target(target_model, len(draft_vocab), feature_layers)
    head = EagleHead(config, target_model.get_input_embeddings(), _output_weight(target_model), draft_vocab)
    # Start near "pass the target's feature through" (fc copies f_p, the layer adds little):
    # training then learns the step from f_p onwards rather than a feature from scratch.
    with torch.no_grad():
        hidden = config.hidden_size
        head.fc.weight.zero_()
        head.fc.weight[:, hidden:].copy_(torch.eye(hidden))
        head.layer.self_attn.o_proj.weight.mul_(0.1)
        head.layer.mlp.down_proj.weight.mul_(0.1)
    return head.float()


def save_head(head: EagleHead, out_dir: Path, dtype: torch.dtype = torch.bfloat16) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(dtype).contiguous().cpu() for k, v in head.trainable_state().items()}
    tensors["draft_vocab"] = head.draft_vocab.cpu()
    save_file(tensors, str(out_dir / WEIGHTS_FILE), metadata={"format": str(HEAD_FORMAT)})
    (out_dir / CONFIG_FILE).write_text(head.config.to_json() + "\n")


def read_head_config(head_dir: Path) -> HeadConfig:
    path = Path(head_dir) / CONFIG_FILE
    if not path.is_file():
        raise HeadMismatch(
            f"{head_dir} is not a draft head directory (no {CONFIG_FILE}; `specd train-draft` writes it)"
        )
    return HeadConfig.from_json(path.read_text())


def load_head(head_dir: Path, target_model, attn_implementation: str = "specd") -> EagleHead:
    """The head in `head_dir`, on the target's device and dtype; `HeadMismatch` if it was made for another model."""
    config = read_head_config(head_dir)
    problem = config.target.mismatch(TargetIdentity.of(target_model))
    if problem:
        raise HeadMismatch(f"the draft head in {head_dir} was trained for another model: {problem}")
    tensors = load_file(str(Path(head_dir) / WEIGHTS_FILE))
    draft_vocab = tensors.pop("draft_vocab")
    head = EagleHead(config, target_model.get_input_embeddings(), _output_weight(target_model), draft_vocab,
                     attn_implementation)  # fmt: skip
    missing, unexpected = head.load_state_dict(tensors, strict=False)
    missing = [k for k in missing if k.startswith(TRAINED)]
    if missing or unexpected:
        raise HeadMismatch(f"the draft head in {head_dir} has missing {missing} / unexpected {unexpected} weights")
    weight = target_model.get_input_embeddings().weight
    head.to(device=weight.device, dtype=weight.dtype)
    head.eval().requires_grad_(False)
    return head


def held_out_rates(training: dict | None) -> tuple[float, ...]:
    """P(draft j accepted | drafts before it accepted), j = 0, 1, ..., from the held-out
    evaluation `specd train-draft` recorded (its per-position rates are cumulative); empty
    when there is none. The serving policy starts a head's rows from these, not a constant."""
    cumulative = ((training or {}).get("held_out") or {}).get("per_position") or []
    rates: list[float] = []
    before = 1.0
    for reached in cumulative:
        if before <= 0.0:
            break
        rates.append(min(max(reached / before, 0.0), 1.0))
        before = reached
    return tuple(rates)


def _output_weight(model) -> torch.Tensor:
    """The target's output projection, dense: from its quantized copy where serving freed the
    dense weight (`ModelConfig.keep_dense_weights`)."""
    output = model.get_output_embeddings()
    if output.weight.is_meta:
        return output.quantized_weight.dense(output.weight.dtype)
    return output.weight.detach()
