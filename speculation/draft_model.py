"""Draft-model proposer: a small HF model with its own KV cache.

Its catch-up forward feeds every token the target accepted since the model's
last step, from the first position its KV lacks; its KV length then follows
what the target kept (`verified`), so rejected drafts never stay in its
context. The plan and the K-forward loop are `speculation.device_draft`'s.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from models.forward import forward_step
from models.kv_cache import ATTN_IMPLEMENTATION, KVCache, StepLayout
from models.linear_kernels import linear_params
from models.loader import LoadedModel, check_draft_compatible, load_model
from models.weights import draft_formats
from scheduler.types import Request
from speculation.device_draft import DeviceProposer
from speculation.proposer import BuildContext


class DraftModelProposer(DeviceProposer):
    method = "draft_model"

    def __init__(
        self, draft: LoadedModel, vocab_size: int, cost_ratio: float | None = None, stop_confidence: float = 0.0
    ):
        super().__init__(vocab_size, stop_confidence)
        self.draft = draft
        self.cost_ratio = cost_ratio
        self.paged_limits = draft.paged_limits  # its catch-up feeds read the pool as its verify rows would
        draft.model.set_attn_implementation(ATTN_IMPLEMENTATION)
        self.cache: KVCache | None = None

    @classmethod
    def build(cls, context: BuildContext) -> DraftModelProposer:
        """Load the draft model as the target was loaded (dtype, device, kernels, attention), in
        its own weight format (`--draft-weights`)."""
        target = context.target
        fmt, output = draft_formats(context.config.draft_weights, target.device)
        config = replace(
            context.loaded_as,
            model=str(context.config.draft_model),
            dtype=str(target.dtype).removeprefix("torch."),
            device=target.device.type,
            tune_kernels=target.kernels.is_tuned,
            weights=fmt,
            output_weights=output,
        )
        draft = load_model(config)
        check_draft_compatible(target, draft)
        ratio = linear_params(draft.model) / max(linear_params(target.model), 1)
        return cls(draft, target.vocab_size, ratio, context.config.stop_confidence)

    @property
    def forward_cost_ratio(self) -> float | None:
        return self.cost_ratio

    @property
    def recurring_feed(self) -> int | None:
        return 1  # its KV keeps its accepted drafts but the last (`_fed_after`): only that one recurs

    def bytes_per_block(self, block_size: int) -> int:
        return KVCache.bytes_per_block(self.draft.model.config, block_size, self.draft.dtype)

    def allocate(self, num_blocks: int, block_size: int) -> None:
        super().allocate(num_blocks, block_size)
        # The same block ids as the target's pool: a request's block table serves both.
        # (A block shared through the prefix cache is rewritten by each request's
        # catch-up feed with the same tokens; only draft quality could differ.)
        draft = self.draft
        self.cache = KVCache.for_model(draft.model.config, num_blocks, block_size, draft.dtype, draft.device)

    def _feed(self, request: Request) -> tuple[int, int, int]:
        # Every accepted token the draft has not seen yet, through the last one (not yet in anyone's KV).
        start = min(self._computed.get(request.request_id, 0), request.num_computed_tokens)
        return start, start, request.num_tokens

    def _fed_after(self, request: Request, start: int, num_fed: int, k: int) -> int:
        return start + num_fed + k - 1  # the drafts fed back too; `verified` trims the rejected ones

    def _first_logits(self, layout: StepLayout, input_ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        assert self.cache is not None, "allocate() first"
        return _to_vocab(forward_step(self.draft.model, self.cache, layout, input_ids, keep), self.vocab_size)

    def _next_logits(self, layout: StepLayout, rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        assert self.cache is not None, "allocate() first"
        return _to_vocab(forward_step(self.draft.model, self.cache, layout, tokens, 0), self.vocab_size)


def _to_vocab(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Trim or -inf-pad the draft's logits to the target's vocabulary size."""
    width = logits.shape[-1]
    if width == vocab:
        return logits
    if width > vocab:
        return logits[:, :vocab]
    pad = logits.new_full((logits.shape[0], vocab - width), float("-inf"))
    return torch.cat([logits, pad], dim=-1)
