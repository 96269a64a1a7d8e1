"""Held-out acceptance of a head, simulated as greedy chained drafting would see it.

From every answer position i (the first one is the prompt's last position: the head
reads the first answer token) the head drafts K tokens in a chain, each step fed its
own feature and the token before it. Draft j is accepted when drafts 1..j all equal
the target's greedy tokens a_{i+1}..a_{i+j}, as a greedy verify would accept them;
chains that would run past the sequence's end are not counted.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from models.eagle_head import EagleHead
from training.data import Sequence, length_groups
from training.unroll import ChainBatch, unrolled


@dataclass
class Acceptance:
    """Per draft position j (0-based): the share of chains whose drafts 0..j were all accepted."""

    num_chains: int
    per_position: list[float]
    top1: float  # step 0 alone: the head's next-next-token accuracy

    @property
    def accepted_per_verify(self) -> float:
        """Mean drafts accepted per verify step (each verify also adds the target's own token)."""
        return sum(self.per_position)

    def as_record(self) -> dict:
        record = asdict(self)
        record["per_position"] = [round(p, 4) for p in self.per_position]
        record["top1"] = round(self.top1, 4)
        record["accepted_per_verify"] = round(self.accepted_per_verify, 4)
        record["tokens_per_verify"] = round(self.accepted_per_verify + 1, 4)
        return record


@torch.inference_mode()
def chain_acceptance(head: EagleHead, sequences: list[Sequence], k: int = 4, batch_tokens: int = 8192) -> Acceptance:
    """Greedy acceptance per draft position at chain length `k` over the answers of `sequences`."""
    was_training = head.training
    head.eval()
    accepted = torch.zeros(k)
    top1_hits = chains = 0
    try:
        for group in length_groups([len(s.token_ids) for s in sequences], batch_tokens):
            batch = ChainBatch.of([sequences[i] for i in group], answers_only=True)
            valid = batch.valid(0, steps=k)
            matches = []
            for step in unrolled(head, batch, k):
                drafted = head.draft_vocab[head.draft_logits(step.g[valid]).argmax(-1)]
                matches.append(drafted == step.token_target[valid])
            hits = torch.stack(matches, dim=1).long().cumprod(dim=1)  # [chains, k]: all drafts so far right
            accepted += hits.sum(0).float()
            top1_hits += int(matches[0].sum())
            chains += len(hits)
    finally:
        head.train(was_training)
    if chains == 0:
        return Acceptance(0, [0.0] * k, 0.0)
    return Acceptance(chains, (accepted / chains).tolist(), top1_hits / chains)
