"""Proposers that draft on the device: K batched forwards per step (a draft model, an EAGLE head).

For the speculating rows, the first forward catches the proposer up with
everything the target has accepted since its last step (its own stale
positions, e.g. rejected drafts, are simply overwritten), the next K - 1 feed
one drafted token each. Drafts are sampled from q, the proposer's distribution
after the same processing as the target's (temperature, top-k/p, min-p,
penalties, logit bias), so the rejection sampler stays lossless; a seeded
row's drafts are drawn with the plain path's uniforms (`draft_noise`).

Everything the K forwards need from the host is known before the first one
(`plan` adds it to the step's one upload); drafted tokens stay on the device
and feed the next forward and the target's verify directly. Subclasses say
what the catch-up feeds and run the forwards (`_first_logits`, `_next_logits`).

Where the device is the host's CPU, a row's draft ends early after a token the proposer
itself gave less than `stop_confidence` (the K is a cap): once every row has ended, the
remaining forwards are skipped, and the runner verifies only what was drafted. A draft's
length that depends on the draft alone keeps the verify lossless. On the prose of MT-Bench
the 0.5B Qwen drafting for the 1.5B is right on ~40% of positions, and its own probability
says which: a fixed K of 4 paid each of its four forwards (a third of a target step each)
for ~1.5 accepted tokens. Reading whether every row ended costs nothing on the CPU; on a GPU
it would be a sync per forward, so there every row drafts its K.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.forward import last_token_index
from models.kv_cache import LayoutPlan, PagedLimits, StepLayout
from models.sampling import (
    SamplingTensors,
    draft_noise,
    greedy_ids,
    plan_penalty_counts,
    process_logits,
    resolve_penalty_counts,
    sample_from_probs,
)
from models.transfer import DeviceArrays, HostBuffer
from scheduler.types import Request
from speculation.proposer import Proposer


@dataclass
class DraftPlan:
    """Host side of one step's K draft forwards. R rows, each drafting num_tokens[i] >= 1."""

    prefix: str
    requests: list[Request]
    num_tokens: list[int]
    active: list[list[int]]  # per draft position j: rows still drafting
    layouts: list[LayoutPlan]
    starts: list[int]  # per row: the first position its catch-up feeds
    feed_lengths: list[int]  # per row: the tokens its catch-up feeds
    any_sampled: bool
    penalties: bool
    num_fed: int = 0  # tokens the first forward feeds (every row's catch-up)
    # Per row, the tokens it drafted once the forwards ran (`DeviceProposer.run`): num_tokens,
    # or fewer where its draft ended early (`active` then lists only the forwards that ran).
    num_drafted: list[int] | None = None

    @property
    def num_computed(self) -> int:
        """Token rows the forwards compute: the catch-up feeds, then one per later position."""
        return self.num_fed + sum(len(rows) for rows in self.active[1:])

    @property
    def num_catch_up(self) -> int:
        """Tokens the first forward feeds past each row's last one: the rows' catch-up on what
        they emitted since the proposer last drafted for them (a prefill, the first time)."""
        return self.num_fed - len(self.requests)

    @property
    def k_max(self) -> int:
        return len(self.active)


class DeviceProposer(Proposer):
    """The plan and the K-forward loop; a subclass supplies the catch-up feed and the forwards.

    Its own KV uses the same block ids as the target's pool, so a request's
    block table serves both, and a preemption (which frees the blocks) reaches
    it through `free`.
    """

    def __init__(self, vocab_size: int, stop_confidence: float = 0.0):
        self.vocab_size = vocab_size  # the target's: q must live in p's vocabulary
        # A row's draft ends after a token drafted with less probability than this (CPU; 0: never).
        self.stop_confidence = stop_confidence
        self.block_size = 0  # the target's KV block, set by `allocate`
        self.paged_limits: PagedLimits = ()  # where its catch-up reads in place (`LoadedModel.paged_limits`)
        # Positions of each request the proposer's KV holds for accepted tokens.
        self._computed: dict[str, int] = {}

    def allocate(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size

    def ends_drafts_early(self, device: torch.device) -> bool:
        # Whether every row has ended is read on the host each forward: free on the CPU, a sync on a GPU.
        return self.stop_confidence > 0 and device.type == "cpu"

    def free(self, request_id: str) -> None:
        self._computed.pop(request_id, None)

    def verified(self, request_id: str, num_valid: int) -> None:
        if request_id in self._computed:
            self._computed[request_id] = min(self._computed[request_id], num_valid)

    # -- what a subclass decides --
    def _feed(self, request: Request) -> tuple[int, int, int]:
        """The first forward's feed for `request` (at least one token): its first position, and
        the request's tokens [lo, hi) it feeds."""
        raise NotImplementedError

    def _fed_after(self, request: Request, start: int, num_fed: int, k: int) -> int:
        """Positions whose KV is right once the forwards ran, if the k drafts are accepted."""
        raise NotImplementedError

    def _first_logits(self, layout: StepLayout, input_ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """The catch-up forward: packed feeds -> logits `[R, V]` at each row's last token."""
        raise NotImplementedError

    def _next_logits(self, layout: StepLayout, rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """One drafted token for each of `rows` (indices of the plan's rows) -> logits `[len(rows), V]`."""
        raise NotImplementedError

    def feed_lengths(self, requests: list[Request], num_tokens: list[int]) -> list[int]:
        """Tokens each request's first draft forward would feed now: its catch-up on what the
        target accepted since the proposer last drafted for it (the whole sequence, the first time)."""
        return [hi - lo for _, lo, hi in map(self._feed, requests)]

    # -- the plan and the loop --
    def plan(self, requests: list[Request], num_tokens: list[int], buf: HostBuffer, prefix: str = "draft") -> DraftPlan:
        assert self.block_size, "allocate() first"
        assert requests and all(k > 0 for k in num_tokens)
        spans = [self._feed(r) for r in requests]
        starts = [start for start, _, _ in spans]
        feeds = [r.token_slice(lo, hi) for r, (_, lo, hi) in zip(requests, spans)]
        tables = [r.block_ids for r in requests]
        active, layouts = [], []
        for j in range(max(num_tokens)):
            rows = [i for i, k in enumerate(num_tokens) if k > j]
            if j == 0:
                lens = [len(f) for f in feeds]
                layout = LayoutPlan.build(tables, starts, lens, self.block_size, self.paged_limits)
            else:
                positions = [starts[i] + len(feeds[i]) + j - 1 for i in rows]
                layout = LayoutPlan.build([tables[i] for i in rows], positions, [1] * len(rows), self.block_size)
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
            starts=starts,
            feed_lengths=[len(feed) for feed in feeds],
            any_sampled=not all(p.is_greedy for p in params),
            penalties=penalties,
            num_fed=sum(len(feed) for feed in feeds),
        )

    @torch.inference_mode()
    def run(self, plan: DraftPlan, arrays: DeviceArrays) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The K draft forwards, on the device, with no host transfer: drafted ids `[R, k_max]`
        (positions >= a row's k are padding) and q `[R, k_max, V]` (zero past a row's k; None
        when every row is greedy). Where drafts end early, a row's length is `plan.num_drafted`:
        past it its ids and q are padding, or what later forwards computed for rows still
        drafting beside it, and are never verified."""
        p, vocab = plan.prefix, self.vocab_size
        num_rows = len(plan.requests)
        params = [r.params for r in plan.requests]
        st = SamplingTensors.resolve(params, vocab, arrays, f"{p}.s")
        counts = prompt_mask = None
        if plan.penalties:
            counts, prompt_mask = resolve_penalty_counts(num_rows, vocab, arrays, p)
        out_len = arrays[f"{p}.out_len"]
        device = out_len.device
        drafted = torch.zeros(num_rows, plan.k_max, dtype=torch.long, device=device)
        q = torch.zeros(num_rows, plan.k_max, vocab, device=device) if plan.any_sampled else None
        num_drafted = list(plan.num_tokens)
        may_stop = self.ends_drafts_early(device)
        forwards = len(plan.active)
        for j, rows in enumerate(plan.active):
            if j and may_stop and all(num_drafted[i] <= j for i in rows):
                forwards = j  # every row still planned here has ended its draft
                break
            index = arrays[f"{p}.{j}.active"]
            layout = plan.layouts[j].resolve(arrays, f"{p}.{j}")
            if j == 0:
                logits = self._first_logits(layout, arrays[f"{p}.input"], arrays[f"{p}.keep"])
            else:
                logits = self._next_logits(layout, index, drafted[index, j - 1])
            logits = logits[:, None]  # [rows, 1, V]
            st_j = st if len(rows) == num_rows else st.take(index, [params[i] for i in rows])
            counts_j = None if counts is None else counts[index]
            mask_j = None if prompt_mask is None else prompt_mask[index]
            if st_j.all_greedy:  # q is one-hot on the argmax: the draft token says it all
                tokens = greedy_ids(logits, st_j, counts_j, mask_j)[:, 0]
                if q is not None:
                    q[index, j] = torch.nn.functional.one_hot(tokens, vocab).to(q.dtype)
                probs = None
            else:
                probs = process_logits(logits, st_j, counts_j, mask_j, None)  # [rows, 1, V]
                u = draft_noise(st_j, (out_len[index] + j)[:, None])
                tokens = sample_from_probs(probs, u)[:, 0]
                assert q is not None  # allocated whenever a row samples
                q[index, j] = probs[:, 0]
            drafted[index, j] = tokens
            if may_stop:
                sure = (_confidence(logits[:, 0], probs, tokens, st_j.is_greedy) >= self.stop_confidence).tolist()
                for i, row_sure in zip(rows, sure):
                    if not row_sure and num_drafted[i] > j + 1:
                        num_drafted[i] = j + 1
            if counts is not None:
                counts.index_put_((index, tokens), torch.ones_like(tokens, dtype=counts.dtype), accumulate=True)
        del plan.active[forwards:]
        del plan.layouts[forwards:]
        plan.num_drafted = num_drafted
        for i, request in enumerate(plan.requests):
            fed = self._fed_after(request, plan.starts[i], plan.feed_lengths[i], num_drafted[i])
            self._computed[request.request_id] = fed
        return drafted, q


def _confidence(
    logits: torch.Tensor, probs: torch.Tensor | None, tokens: torch.Tensor, is_greedy: torch.Tensor
) -> torch.Tensor:
    """[rows] how sure the proposer was of each drafted token: q at a sampled row's token, and at
    a greedy row's its softmax before processing made q one-hot."""
    chosen = logits.gather(1, tokens[:, None])[:, 0].float()
    confidence = (chosen - logits.float().logsumexp(-1)).exp()
    if probs is None:
        return confidence
    return torch.where(is_greedy, confidence, probs[:, 0].gather(1, tokens[:, None])[:, 0])
