"""The chained training forward equals what the head computes as it drafts, chain by chain."""

from __future__ import annotations

import torch

from models.eagle_head import new_head
from training.data import build_draft_vocab
from training.unroll import ChainBatch, unrolled


def perturbed_head(loaded, sequences):
    head = new_head(loaded.model, build_draft_vocab(sequences, 64, loaded.vocab_size))
    torch.manual_seed(0)
    with torch.no_grad():  # away from the near-identity init, so attention matters
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return head.eval()


@torch.inference_mode()
def test_chains_match_one_sequence_at_a_time(tiny_loaded, tiny_sequences):
    sequences = tiny_sequences[:2] + tiny_sequences[-1:]  # unequal lengths: padding must not leak
    head = perturbed_head(tiny_loaded, sequences)
    steps = unrolled(head, ChainBatch.of(sequences), 3)
    for row, s in enumerate(sequences):
        h, t = s.features, s.token_ids
        n = len(t)
        # Step 0 over the whole sequence is the head's plain causal forward.
        g0 = head(h[: n - 1], t[1:], torch.arange(n - 1))
        torch.testing.assert_close(steps[0].g[row, : n - 1], g0, rtol=1e-4, atol=1e-4)
        for i in (0, n // 2, n - 4):  # chains starting at i, as serving drafts them
            # Step 1 at position i + 1: the target-fed entries 0..i, then g0_i with token t_{i+2}.
            g1 = head(torch.cat([h[: i + 1], g0[i : i + 1]]), torch.cat([t[1 : i + 2], t[i + 2 : i + 3]]),
                      torch.arange(i + 2))[-1]  # fmt: skip
            torch.testing.assert_close(steps[1].g[row, i], g1, rtol=1e-4, atol=1e-4)
            # Step 2 at position i + 2 sees entries 0..i, its chain's step 1, and itself.
            g2 = head(torch.cat([h[: i + 1], g0[i : i + 1], g1[None]]),
                      torch.cat([t[1 : i + 2], t[i + 2 : i + 4]]), torch.arange(i + 3))[-1]  # fmt: skip
            torch.testing.assert_close(steps[2].g[row, i], g2, rtol=1e-4, atol=1e-4)
            assert steps[2].token_target[row, i] == s.target_next[i + 3]
            torch.testing.assert_close(steps[2].feature_target[row, i], h[i + 3])
