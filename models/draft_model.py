"""Draft-model proposer: a small HF model with its own KV cache.

For the speculating rows it runs K batched forwards: the first catches the
draft's KV up with everything the target has accepted (after a rollback,
the draft's own stale positions are simply overwritten), the next K - 1 feed
one drafted token each. Drafts are sampled from q, the draft's distribution
after the same processing as the target's (temperature, top-k/p, min-p,
penalties, logit bias), so the rejection sampler stays lossless.

Everything the K forwards need from the host is known before the first one
(`plan` adds it to the step's one upload); drafted tokens stay on the device
and feed the next forward and the target's verify directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.forward import forward_step, last_token_index
from models.kv_cache import ATTN_IMPLEMENTATION, KVCache, LayoutPlan
from models.loader import LoadedModel
from models.sampling import (
    STREAM_DRAFT,
    SamplingTensors,
    greedy_ids,
    plan_penalty_counts,
    process_logits,
    resolve_penalty_counts,
    sample_from_probs,
    uniform_noise,
)
from models.transfer import DeviceArrays, HostBuffer
from scheduler.types import Request


@dataclass
class DraftPlan:
    """Host side of one step's K draft forwards. R rows, each drafting num_tokens[i] >= 1."""

    prefix: str
    requests: list[Request]
    num_tokens: list[int]
    active: list[list[int]]  # per draft position j: rows still drafting
    layouts: list[LayoutPlan]
    fed_after: list[int]  # per row: positions in the draft's KV after the forwards
    any_sampled: bool
    penalties: bool

    @property
    def k_max(self) -> int:
        return len(self.active)


@dataclass
class DeviceDraft:
    token_ids: torch.Tensor  # [R, k_max] int64; positions >= num_tokens[i] are padding
    probs: torch.Tensor | None  # [R, k_max, V] q (zero past a row's k); None when every row is greedy


class DraftModelProposer:
    method = "draft_model"

    def __init__(self, draft: LoadedModel, num_blocks: int, block_size: int, vocab_size: int):
        self.draft = draft
        self.vocab_size = vocab_size  # the target's: q must live in p's vocabulary
        draft.model.set_attn_implementation(ATTN_IMPLEMENTATION)
        # The same block ids as the target's pool: a request's block table serves both.
        # (A block shared through the prefix cache is rewritten by each request's
        # catch-up feed with the same tokens; only draft quality could differ.)
        self.cache = KVCache.for_model(draft.model.config, num_blocks, block_size, draft.dtype, draft.device)
        # Positions of each request whose draft KV holds accepted tokens.
        self._computed: dict[str, int] = {}

    def free(self, request_id: str) -> None:
        self._computed.pop(request_id, None)

    def verified(self, request_id: str, num_valid: int) -> None:
        """The target kept positions < num_valid: later draft KV holds rejected drafts."""
        if request_id in self._computed:
            self._computed[request_id] = min(self._computed[request_id], num_valid)

    def plan(self, requests: list[Request], num_tokens: list[int], buf: HostBuffer, prefix: str = "draft") -> DraftPlan:
        assert requests and all(k > 0 for k in num_tokens)
        # Catch-up feed: every accepted token the draft has not seen yet.
        starts = [min(self._computed.get(r.request_id, 0), r.num_computed_tokens) for r in requests]
        feeds = [r.token_slice(s, r.num_tokens) for r, s in zip(requests, starts)]
        tables = [r.block_ids for r in requests]
        size = self.cache.block_size
        active, layouts = [], []
        for j in range(max(num_tokens)):
            rows = [i for i, k in enumerate(num_tokens) if k > j]
            if j == 0:
                layout = LayoutPlan.build(tables, starts, [len(f) for f in feeds], size)
            else:
                positions = [starts[i] + len(feeds[i]) + j - 1 for i in rows]
                layout = LayoutPlan.build([tables[i] for i in rows], positions, [1] * len(rows), size)
            layout.add_to(buf, f"{prefix}.{j}")
            buf.ints(f"{prefix}.{j}.active", rows)
            active.append(rows)
            layouts.append(layout)
        buf.ints(f"{prefix}.input", [t for feed in feeds for t in feed])
        buf.ints(f"{prefix}.keep", last_token_index(feeds))
        buf.ints(f"{prefix}.out_len", [len(r.output_ids) for r in requests])
        params = [r.params for r in requests]
        SamplingTensors.plan(params, self.vocab_size, buf, f"{prefix}.s")
        penalties = plan_penalty_counts(requests, buf, prefix)
        return DraftPlan(
            prefix=prefix,
            requests=requests,
            num_tokens=num_tokens,
            active=active,
            layouts=layouts,
            fed_after=[s + len(f) + k - 1 for s, f, k in zip(starts, feeds, num_tokens)],
            any_sampled=not all(p.is_greedy for p in params),
            penalties=penalties,
        )

    @torch.inference_mode()
    def run(self, plan: DraftPlan, arrays: DeviceArrays) -> DeviceDraft:
        """The K draft forwards, on the device, with no host transfer."""
        p, vocab, device = plan.prefix, self.vocab_size, self.draft.device
        num_rows = len(plan.requests)
        params = [r.params for r in plan.requests]
        st = SamplingTensors.resolve(params, vocab, arrays, f"{p}.s")
        counts = prompt_mask = None
        if plan.penalties:
            counts, prompt_mask = resolve_penalty_counts(num_rows, vocab, arrays, p)
        out_len = arrays[f"{p}.out_len"]
        drafted = torch.zeros(num_rows, plan.k_max, dtype=torch.long, device=device)
        q = torch.zeros(num_rows, plan.k_max, vocab, device=device) if plan.any_sampled else None
        for j, rows in enumerate(plan.active):
            index = arrays[f"{p}.{j}.active"]
            layout = plan.layouts[j].resolve(arrays, f"{p}.{j}")
            if j == 0:
                logits = forward_step(self.draft.model, self.cache, layout, arrays[f"{p}.input"], arrays[f"{p}.keep"])
            else:
                logits = forward_step(self.draft.model, self.cache, layout, drafted[index, j - 1], 0)
            logits = _to_vocab(logits, vocab)[:, None]  # [rows, 1, V]
            st_j = st if len(rows) == num_rows else st.take(index, [params[i] for i in rows])
            counts_j = None if counts is None else counts[index]
            mask_j = None if prompt_mask is None else prompt_mask[index]
            if st_j.all_greedy:  # q is one-hot on the argmax: the draft token says it all
                tokens = greedy_ids(logits, st_j, counts_j, mask_j)[:, 0]
                if q is not None:
                    q[index, j] = torch.nn.functional.one_hot(tokens, vocab).to(q.dtype)
            else:
                probs = process_logits(logits, st_j, counts_j, mask_j, None)  # [rows, 1, V]
                u = uniform_noise(st_j.seeds, (out_len[index] + j)[:, None], STREAM_DRAFT)
                tokens = sample_from_probs(probs, u)[:, 0]
                assert q is not None  # allocated whenever a row samples
                q[index, j] = probs[:, 0]
            drafted[index, j] = tokens
            if counts is not None:
                counts.index_put_((index, tokens), torch.ones_like(tokens, dtype=counts.dtype), accumulate=True)
        for request, fed in zip(plan.requests, plan.fed_after):
            self._computed[request.request_id] = fed
        return DeviceDraft(drafted, q)


def _to_vocab(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Trim or -inf-pad the draft's logits to the target's vocabulary size."""
    width = logits.shape[-1]
    if width == vocab:
        return logits
    if width > vocab:
        return logits[:, :vocab]
    pad = logits.new_full((logits.shape[0], vocab - width), float("-inf"))
    return torch.cat([logits, pad], dim=-1)
