"""The two lossless verifiers of speculative decoding.

`rejection_sample` is the speculative-sampling rule: the most drafts accepted a
step for a drafter that samples from its own q, and the default for sampled
requests. `coupled_verify` keeps a row to the plain path instead: it accepts a
draft token iff it equals the token plain decoding would emit at that position
(the argmax for greedy rows, the (seed, position)-keyed draw for seeded rows),
and emits that token at the first mismatch, so a seeded request's text does not
depend on whether, or how, it speculated.
"""

from __future__ import annotations

import torch
from torch import Tensor

from models.sampling import sample_from_probs


def rejection_sample(
    draft_ids: Tensor,
    num_draft: Tensor,
    draft_probs: Tensor | None,
    target_probs: Tensor,
    u_accept: Tensor,
    u_sample: Tensor,
) -> tuple[Tensor, Tensor]:
    """Verify a batch of drafts so the output is distributed exactly as the target's.

    Speculative sampling (Leviathan et al. 2023, Chen et al. 2023), for each
    row independently and with no host sync:

    - draft token x_i is **accepted** iff `u_accept[i] * q_i(x) <= p_i(x)`, that
      is with probability min(1, p_i(x) / q_i(x)); the row keeps the longest
      accepted prefix;
    - at the first rejected position i a **recovered** token is drawn from
      norm(max(0, p_i - q_i)) (from p_i if that residual is all zero);
    - if all of the row's drafts were accepted, a **bonus** token is drawn from
      p at position num_draft.

    Both draws use `sample_from_probs` with `u_sample` at that position. p and q
    must have been processed identically (temperature, filters, penalties):
    for greedy rows both are one-hot, so this reduces to "accept while the
    argmax matches" and the recovered token is the target's argmax. A draft
    with p(x) == 0 is never accepted.

    Args:
        draft_ids: `[R, k]` int64; positions >= num_draft[r] are padding.
        num_draft: `[R]` int64, each row's own k in 0..k.
        draft_probs: `[R, k, V]` q, or None for a model-free proposer (q is
            one-hot on the draft token).
        target_probs: `[R, k + 1, V]` p.
        u_accept: `[R, k]` float64 uniforms for the accept test.
        u_sample: `[R, k + 1]` float64 uniforms for the recovered/bonus draw.

    Returns:
        num_accepted `[R]` int64 and output_ids `[R, k + 1]` int64:
        `output_ids[r, :num_accepted[r]]` are the accepted drafts,
        `output_ids[r, num_accepted[r]]` the recovered or bonus token, the rest -1.
    """
    num_rows, k = draft_ids.shape
    vocab_size = target_probs.shape[-1]
    device = target_probs.device
    rows = torch.arange(num_rows, device=device)
    positions = torch.arange(k + 1, device=device)  # [k + 1]
    is_draft = positions[:k] < num_draft[:, None]  # [R, k]
    safe_ids = torch.where(is_draft, draft_ids, 0).clamp(0, vocab_size - 1)  # [R, k]

    # Accept test on every position at once; the accepted prefix ends at the first failure.
    p_draft = target_probs[:, :k].gather(-1, safe_ids[..., None]).squeeze(-1)  # [R, k]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(-1, safe_ids[..., None]).squeeze(-1).to(p_draft.dtype)
    is_accepted = is_draft & (p_draft > 0) & (u_accept * q_draft <= p_draft)  # [R, k]
    num_accepted = is_accepted.long().cumprod(dim=1).sum(dim=1)  # [R]

    # One more token per row, at position num_accepted: bonus if every draft passed, else recovered.
    is_bonus = num_accepted == num_draft  # [R]
    p_next = target_probs[rows, num_accepted].to(torch.float64)  # [R, V]
    if k == 0:
        next_probs = p_next
    else:
        q_pos = num_accepted.clamp(max=k - 1)  # [R], only meaningful where not is_bonus
        if draft_probs is None:
            # q one-hot: the residual is p with the rejected draft token removed.
            residual = p_next.scatter(-1, safe_ids[rows, q_pos][:, None], 0.0)
        else:
            residual = (p_next - draft_probs[rows, q_pos].to(torch.float64)).clamp(min=0.0)  # [R, V]
        use_p = is_bonus | (residual.sum(dim=-1) <= 0)  # [R]
        next_probs = torch.where(use_p[:, None], p_next, residual)
    next_ids = sample_from_probs(next_probs, u_sample[rows, num_accepted])  # [R]

    output_ids = torch.full((num_rows, k + 1), -1, dtype=torch.int64, device=device)
    output_ids[:, :k] = torch.where(positions[:k] < num_accepted[:, None], draft_ids, -1)
    output_ids[rows, num_accepted] = next_ids
    return num_accepted, output_ids


def coupled_verify(draft_ids: Tensor, num_draft: Tensor, target_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Accept drafts while they equal `target_ids` `[R, k + 1]`, the tokens plain decoding
    draws at each position from the target; the next token is the plain token at the first
    mismatch (or the bonus position). Same returns as `rejection_sample`.

    The output is the plain path's token for token, so it is distributed as the target
    whatever drafted. A model-free draft token x is accepted with chance p(x), as
    `rejection_sample` accepts a one-hot q. A draft model draws its token from q by the
    same uniform as the plain draw from p (inverse CDF over token ids), so it is accepted
    with chance sum_x |I_p(x) & I_q(x)|, the overlap of the two distributions' intervals:
    at most `rejection_sample`'s sum_x min(p(x), q(x)). For greedy rows both rules are
    argmax equality.
    """
    num_rows, k = draft_ids.shape
    positions = torch.arange(k + 1, device=draft_ids.device)
    is_accepted = (positions[:k] < num_draft[:, None]) & (draft_ids == target_ids[:, :k])  # [R, k]
    num_accepted = is_accepted.long().cumprod(dim=1).sum(dim=1)  # [R]
    output_ids = torch.where(positions < num_accepted[:, None], target_ids, -1)  # accepted drafts == argmax
    rows = torch.arange(num_rows, device=draft_ids.device)
    output_ids[rows, num_accepted] = target_ids[rows, num_accepted]
    return num_accepted, output_ids
