"""The head run as it drafts at serving time: chained, each step fed its own last output.

For a sequence t_0..t_{L-1} with target features h_p and target next tokens a_p,
a chain that starts at position i runs S steps; step s sits at position i + s and
reads

    feature  f_i (s = 0: the head's `target_features` of what the target computed
             at i), else g^{s-1}_i (the previous step's own output)
    token    t_{i+s+1}   (under greedy, the draft the previous step made if it was right)

and is trained so that draft_logits(g^s_i) matches the target's distribution at
i + s + 1 (its top-k; or picks its argmax a_{i+s+1}), and, for a head over the last
hidden state with a feature loss, g^s_i ~ h_{i+s+1}.
Its attention sees what a serving-time chain sees: the head's entries for positions
0..i computed from the target's own features (step 0 of earlier chains), then only
its own chain's steps 1..s (EAGLE-3's "training-time test"). All chains of a batch of
padded sequences run at once, one layer call per step, keys accumulating in a
DynamicCache so gradients flow through every step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from models.eagle_head import EagleHead
from training.data import Sequence

IGNORE = -100  # cross-entropy's ignore index: targets outside the draft vocabulary


@dataclass
class ChainBatch:
    """Padded sequences (right padding) and where their chains may start."""

    features: torch.Tensor  # [B, T, F]: the recorded states (F = H, or H per fused layer)
    token_ids: torch.Tensor  # [B, T]
    target_next: torch.Tensor  # [B, T]
    lengths: torch.Tensor  # [B]
    first_start: torch.Tensor  # [B] first chain start scored (0, or the answer's first position)
    # [B, T, k] the target's top-k ids and probabilities at each position; None unless every
    # sequence has them
    top_ids: torch.Tensor | None = None
    top_probs: torch.Tensor | None = None

    @classmethod
    def of(cls, sequences: list[Sequence], answers_only: bool = False) -> ChainBatch:
        longest = max(len(s.token_ids) for s in sequences)
        hidden = sequences[0].features.shape[1]
        batch = cls(
            features=torch.zeros(len(sequences), longest, hidden),
            token_ids=torch.zeros(len(sequences), longest, dtype=torch.long),
            target_next=torch.zeros(len(sequences), longest, dtype=torch.long),
            lengths=torch.tensor([len(s.token_ids) for s in sequences]),
            # A serving chain first starts at the prompt's last position: it reads the first answer token.
            first_start=torch.tensor([max(s.prompt_len - 1, 0) if answers_only else 0 for s in sequences]),
        )
        top_ids = [s.target_top_ids for s in sequences if s.target_top_ids is not None]
        top_probs = [s.target_top_probs for s in sequences if s.target_top_probs is not None]
        if len(top_ids) == len(top_probs) == len(sequences):  # zero-padded like the rest
            batch.top_ids = torch.nn.utils.rnn.pad_sequence(top_ids, batch_first=True)
            batch.top_probs = torch.nn.utils.rnn.pad_sequence(top_probs, batch_first=True).float()
        for row, s in enumerate(sequences):
            n = len(s.token_ids)
            batch.features[row, :n] = s.features
            batch.token_ids[row, :n] = s.token_ids
            batch.target_next[row, :n] = s.target_next
        return batch

    def shifted(self, values: torch.Tensor, by: int) -> torch.Tensor:
        """values[:, i + by] at column i (zeros past the end)."""
        out = torch.zeros_like(values)
        out[:, : values.shape[1] - by] = values[:, by:]
        return out

    def valid(self, step: int, steps: int | None = None) -> torch.Tensor:
        """[B, T] chains whose step `step` has an input token and a target (all of `steps`, if given)."""
        last = step if steps is None else steps - 1
        i = torch.arange(self.token_ids.shape[1])[None]
        return (i >= self.first_start[:, None]) & (i + last + 1 <= self.lengths[:, None] - 1)


@dataclass
class ChainStep:
    g: torch.Tensor  # [B, T, H]: g^s_i at column i
    feature_target: torch.Tensor  # [B, T, F]: the recorded states at i + s + 1
    token_target: torch.Tensor  # [B, T]: a_{i+s+1}
    top_ids: torch.Tensor | None  # [B, T, k]: the target's top-k at i + s + 1 (None: not recorded)
    top_probs: torch.Tensor | None


def unrolled(head: EagleHead, batch: ChainBatch, steps: int) -> list[ChainStep]:
    """Every chain of `batch`, `steps` steps long (see the module docstring)."""
    num_rows, length = batch.token_ids.shape
    cache = DynamicCache()
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    diagonal = torch.eye(length, dtype=torch.bool)
    positions = torch.arange(length)[None].expand(num_rows, length)
    features = head.target_features(batch.features)
    outputs = []
    for s in range(steps):
        mask = torch.cat([causal] + [diagonal] * s, dim=1)[None, None]  # [1, 1, T, (s + 1) T]
        g = head(
            features,
            batch.shifted(batch.token_ids, s + 1),
            positions + s,
            attention_mask=mask,
            cache=cache,
        )
        outputs.append(
            ChainStep(
                g=g,
                feature_target=batch.shifted(batch.features, s + 1),
                token_target=batch.shifted(batch.target_next, s + 1),
                top_ids=None if batch.top_ids is None else batch.shifted(batch.top_ids, s + 1),
                top_probs=None if batch.top_probs is None else batch.shifted(batch.top_probs, s + 1),
            )
        )
        features = g
    return outputs


def draft_index(draft_vocab: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[vocab] -> position in the draft vocabulary, IGNORE outside it."""
    index = torch.full((vocab_size,), IGNORE, dtype=torch.long)
    index[draft_vocab] = torch.arange(len(draft_vocab))
    return index
