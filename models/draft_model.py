"""Draft-model proposer: a small HF model with its own KV cache.

For the speculating rows it runs K batched forwards: the first catches the
draft's KV up with everything the target has accepted (after a rollback,
the draft's own stale positions are simply overwritten), the next K - 1 feed
one drafted token each. Drafts are sampled from q, the draft's distribution
after the same processing as the target's (temperature, top-k/p, min-p,
penalties, logit bias), so the rejection sampler stays lossless.
"""

from __future__ import annotations

import torch

from models.forward import last_token_index, packed_forward
from models.kv_cache import ATTN_IMPLEMENTATION, KVCache
from models.loader import LoadedModel
from models.proposers import Draft
from models.sampling import (
    STREAM_DRAFT,
    SamplingTensors,
    build_token_counts,
    greedy_ids,
    process_logits,
    sample_from_probs,
    uniform_noise,
)
from scheduler.types import Request


class DraftModelProposer:
    method = "draft_model"

    def __init__(self, draft: LoadedModel, num_slots: int, max_len: int, vocab_size: int):
        self.draft = draft
        self.vocab_size = vocab_size  # the target's: q must live in p's vocabulary
        draft.model.set_attn_implementation(ATTN_IMPLEMENTATION)
        self.cache = KVCache.for_model(draft.model.config, num_slots, max_len, draft.dtype, draft.device)
        self._computed: dict[str, int] = {}

    def free(self, request_id: str) -> None:
        self._computed.pop(request_id, None)

    @torch.inference_mode()
    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[Draft]:
        device = self.draft.device
        vocab = self.vocab_size
        drafted: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        # Catch-up feed: every accepted token the draft has not seen yet.
        starts = [min(self._computed.get(r.request_id, 0), r.num_computed_tokens) for r in requests]
        feeds = [r.all_token_ids[s:] for r, s in zip(requests, starts)]
        active = [i for i, k in enumerate(num_tokens) if k > 0]
        for j in range(max(num_tokens, default=0)):
            active = [i for i in active if num_tokens[i] > j]
            if not active:
                break
            subset = [requests[i] for i in active]
            logits = packed_forward(
                self.draft.model,
                self.cache,
                [r.slot for r in subset],
                [starts[i] for i in active],
                [feeds[i] for i in active],
                last_token_index([feeds[i] for i in active]),
            )  # [rows, draft_vocab]
            logits = _to_vocab(logits, vocab)
            st = SamplingTensors.from_params([r.params for r in subset], vocab, device)
            output_counts = prompt_mask = None
            if not st.no_penalties:
                output_counts = build_token_counts([r.output_ids + drafted[i] for r, i in zip(subset, active)], vocab, device)
                prompt_mask = build_token_counts([r.prompt_ids for r in subset], vocab, device) > 0
            if st.all_greedy:  # q is one-hot on the argmax: the draft token says it all
                q = None
                tokens = greedy_ids(logits[:, None], st, output_counts, prompt_mask)[:, 0].tolist()
            else:
                q = process_logits(logits[:, None], st, output_counts, prompt_mask, None)  # [rows, 1, vocab]
                positions = torch.tensor([len(r.output_ids) + j for r in subset], device=device)[:, None]
                u = uniform_noise(st.seeds, positions, STREAM_DRAFT)
                tokens = sample_from_probs(q, u)[:, 0].tolist()
            for row, i in enumerate(active):
                drafted[i].append(tokens[row])
                if q is not None:
                    probs[i].append(q[row, 0])
                starts[i] += len(feeds[i])
                feeds[i] = [tokens[row]]
        for i, request in enumerate(requests):
            if drafted[i]:
                self._computed[request.request_id] = starts[i]
        # q is kept only for sampled rows; greedy rows' q is one-hot on the draft (probs None).
        return [Draft(ids, self.method, torch.stack(p) if p else None) for ids, p in zip(drafted, probs)]


def _to_vocab(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Trim or -inf-pad the draft's logits to the target's vocabulary size."""
    width = logits.shape[-1]
    if width == vocab:
        return logits
    if width > vocab:
        return logits[:, :vocab]
    pad = logits.new_full((logits.shape[0], vocab - width), float("-inf"))
    return torch.cat([logits, pad], dim=-1)
