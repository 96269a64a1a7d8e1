"""EAGLE proposer: drafts with a one-layer head over the target's own features (`models.eagle_head`).

Head position p reads the target's feature f_p (its last hidden state, or a
few layers' states fused: `models.eagle_head`) and the token x_{p+1}; its
logits predict x_{p+2}.

Features come from the target's forward, never an extra one: after every
target forward the runner stores each packed token's f in the feature pool
(`features`, the KV pool's block layout: one row per KV row), so positions
< num_computed_tokens always hold accepted tokens' features. Rejected drafts'
rows are overwritten later, like their KV (O(1) rollback), and a prefix-cache
hit brings the features its blocks got when they were computed.

A step, per speculating row: the catch-up forward feeds every position the
head has not computed since its last step (features gathered from the pool,
tokens one ahead); its last g gives draft 1. Each of the K - 1 chained
forwards feeds the previous g back as the feature, with the previous draft.
Chained positions ran on predicted features, so the next step recomputes them
from the target's. q is -inf outside the head's draft vocabulary (exactly 0
there), so the rejection sampler stays lossless.

The head's one-layer KV uses the target's block ids. A block shared through
the prefix cache gets each sharer's catch-up writes; at its last position the
head also reads the token after the block, which sharers may differ in, so
only draft quality (never output) can differ.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from models.eagle_head import EagleHead, held_out_rates, load_head
from models.forward import check_plain_logits, laid_out
from models.kv_cache import ATTN_IMPLEMENTATION, KVCache, StepLayout
from models.linear_kernels import linear_params
from models.transfer import DeviceArrays
from scheduler.types import Request
from speculation.device_draft import DeviceProposer, DraftPlan
from speculation.proposer import BuildContext

logger = logging.getLogger("specd.speculation")


class EagleProposer(DeviceProposer):
    method = "eagle"
    uses_features = True

    def __init__(
        self,
        head: EagleHead,
        head_dir: Path,
        vocab_size: int,
        cost_ratio: float | None = None,
        stop_confidence: float = 0.0,
    ):
        super().__init__(vocab_size, stop_confidence)
        self.head = head
        self.cost_ratio = cost_ratio
        self.head_dir = Path(head_dir)
        self.feature_layers = head.config.feature_layers
        self.cache: KVCache | None = None
        # [pool rows, H]: the target's features of every position, in the KV pool's layout,
        # stored after each target forward (`store_features`).
        self.features: torch.Tensor | None = None
        self._g: torch.Tensor | None = None  # [R, H] each row's latest g, during `run`

    @classmethod
    def build(cls, context: BuildContext) -> EagleProposer:
        """Load the head made for this target (`HeadMismatch` if it was made for another)."""
        target, head_dir = context.target, Path(str(context.config.draft_head))
        check_plain_logits(target.model)
        head = load_head(head_dir, target.model)
        head.use_kernels(target.kernels)  # as the target computes
        layers = head.config.feature_layers
        logger.info(
            "EAGLE head %s (draft vocabulary %d, features: %s)",
            head_dir,
            head.config.draft_vocab_size,
            f"layers {layers} fused" if layers else "last hidden state",
        )
        # Its forward: the head's layers, then logits over its draft vocabulary.
        head_params = linear_params(head) + head.config.draft_vocab_size * head.config.hidden_size
        ratio = head_params / max(linear_params(target.model), 1)
        return cls(head, head_dir, target.vocab_size, ratio, context.config.stop_confidence)

    @property
    def forward_cost_ratio(self) -> float | None:
        return self.cost_ratio

    @property
    def prior_rates(self) -> tuple[float, ...]:
        """Its held-out acceptance per draft position, from its training record."""
        return held_out_rates(self.head.config.training)

    def bytes_per_block(self, block_size: int) -> int:
        """Its own KV and the features."""
        config, dtype = self.head.config, self.head.fc.weight.dtype
        kv = KVCache.bytes_per_block(config.llama_config(ATTN_IMPLEMENTATION), block_size, dtype)
        return kv + block_size * config.hidden_size * dtype.itemsize

    def allocate(self, num_blocks: int, block_size: int) -> None:
        super().allocate(num_blocks, block_size)
        weight = self.head.fc.weight
        llama = self.head.config.llama_config(ATTN_IMPLEMENTATION)
        self.cache = KVCache.for_model(llama, num_blocks, block_size, weight.dtype, weight.device)
        self.features = torch.zeros(
            num_blocks * block_size, self.head.config.hidden_size, dtype=weight.dtype, device=weight.device
        )

    def store_features(self, dest: torch.Tensor, states: torch.Tensor) -> None:
        # Fused once here, as they arrive: the pool holds H floats a position whatever the layers.
        assert self.features is not None, "allocate() first"
        self.features.index_copy_(0, dest, self.head.target_features(states).to(self.features.dtype))

    def info(self) -> dict:
        """The head as GET /v1/speculation shows it: its directory's name, not where it lies on disk."""
        config = self.head.config
        return {
            "name": self.head_dir.name,
            "draft_vocab_size": config.draft_vocab_size,
            "feature_layers": config.feature_layers,  # None: the target's last hidden state
            "training": config.training,
        }

    def run(self, plan: DraftPlan, arrays: DeviceArrays) -> tuple[torch.Tensor, torch.Tensor | None]:
        try:
            return super().run(plan, arrays)
        finally:
            self._g = None

    def _feed(self, request: Request) -> tuple[int, int, int]:
        # The last position, num_computed - 1, reads the token the target feeds this step. At least
        # one position is fed (a row re-run after a failed step has no new one; it is recomputed).
        computed = request.num_computed_tokens
        start = min(self._computed.get(request.request_id, 0), computed - 1)
        return start, start + 1, computed + 1

    def _fed_after(self, request: Request, start: int, num_fed: int, k: int) -> int:
        return request.num_computed_tokens  # chained positions read predicted features: redone next step

    def _first_logits(self, layout: StepLayout, input_ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        assert self.features is not None
        # The head's positions are the target's, through the same block tables: its
        # layout's destinations are the feature rows to read.
        g = self._forward(self.features.index_select(0, layout.token_dest), input_ids, layout)
        self._g = g.index_select(0, keep)
        return self.head.full_logits(self._g)

    def _next_logits(self, layout: StepLayout, rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        assert self._g is not None
        g = self._forward(self._g.index_select(0, rows), tokens, layout)
        self._g.index_copy_(0, rows, g)
        return self.head.full_logits(g)

    def _forward(self, features: torch.Tensor, input_ids: torch.Tensor, layout: StepLayout) -> torch.Tensor:
        assert self.cache is not None, "allocate() first"
        with laid_out(self.cache, layout):
            return self.head(features, input_ids, layout.token_pos, cache=self.cache, specd_layout=layout)
