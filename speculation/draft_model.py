"""Draft-model proposer: a small HF model with its own KV cache.

Its catch-up forward feeds every token the target accepted since the model's
last step, from the first position its KV lacks; its KV length then follows
what the target kept (`verified`), so rejected drafts never stay in its
context. The plan and the K-forward loop are `speculation.device_draft`'s.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from models.forward import forward_step
from models.kv_cache import ATTN_IMPLEMENTATION, KVCache, StepLayout
from models.loader import LoadedModel
from scheduler.types import Request
from speculation.device_draft import DeviceDraft, DeviceProposer, DraftPlan
from speculation.proposers import CAPABILITIES, Capabilities

__all__ = ["DeviceDraft", "DraftModelProposer", "DraftPlan"]


class DraftModelProposer(DeviceProposer):
    method = "draft_model"
    capabilities: ClassVar[Capabilities] = CAPABILITIES[method]

    def __init__(self, draft: LoadedModel, num_blocks: int, block_size: int, vocab_size: int):
        super().__init__(vocab_size, block_size)
        self.draft = draft
        draft.model.set_attn_implementation(ATTN_IMPLEMENTATION)
        # The same block ids as the target's pool: a request's block table serves both.
        # (A block shared through the prefix cache is rewritten by each request's
        # catch-up feed with the same tokens; only draft quality could differ.)
        self.cache = KVCache.for_model(draft.model.config, num_blocks, block_size, draft.dtype, draft.device)

    def _catch_up(self, request: Request) -> tuple[int, list[int]]:
        # Every accepted token the draft has not seen yet, through the last one (not yet in anyone's KV).
        start = min(self._computed.get(request.request_id, 0), request.num_computed_tokens)
        return start, request.token_slice(start, request.num_tokens)

    def _fed_after(self, request: Request, start: int, feed: list[int], k: int) -> int:
        return start + len(feed) + k - 1  # the drafts fed back too; `verified` trims the rejected ones

    def _first_logits(self, layout: StepLayout, input_ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return _to_vocab(forward_step(self.draft.model, self.cache, layout, input_ids, keep), self.vocab_size)

    def _next_logits(self, layout: StepLayout, rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
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
