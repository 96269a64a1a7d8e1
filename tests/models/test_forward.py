"""The packed ragged forward reproduces HF's own logits, before and after rollback."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from models.kv_cache import ATTN_IMPLEMENTATION, KVCache
from tests.support.tensors import packed_forward

TOL = 1e-4


def _models(path):
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours.set_attn_implementation(ATTN_IMPLEMENTATION)
    cache = KVCache.for_model(ours.config, num_slots=4, max_len=64, dtype=torch.float32, device=torch.device("cpu"))
    return ref, ours, cache


def _all(token_lists):
    return list(range(sum(len(t) for t in token_lists)))


@torch.inference_mode()
def _hf_logits(ref, ids):
    return ref(torch.tensor([ids])).logits[0].float()


@pytest.fixture(params=["llama", "qwen2"])
def model_dir(request, tiny_llama_dir, tiny_qwen2_dir):
    return tiny_llama_dir if request.param == "llama" else tiny_qwen2_dir


def test_mixed_prefill_and_decode_rows_match_hf(model_dir):
    ref, ours, cache = _models(model_dir)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (11, 7, 14)]
    # Step 1: row A prefills its first 6 tokens (slot 0), row C all 13 (slot 3).
    step1 = [seqs[0][:6], seqs[2][:13]]
    logits1 = packed_forward(ours, cache, [0, 3], [0, 0], step1, _all(step1))
    # Step 2: A finishes its prompt (chunked prefill), B prefills in slot 1, C decodes one token.
    step2 = [seqs[0][6:], seqs[1], seqs[2][13:]]
    logits2 = packed_forward(ours, cache, [0, 1, 3], [6, 0, 13], step2, _all(step2))

    a, b, c = (_hf_logits(ref, s) for s in seqs)
    torch.testing.assert_close(logits1[:6], a[:6], atol=TOL, rtol=0)
    torch.testing.assert_close(logits1[6:], c[:13], atol=TOL, rtol=0)
    torch.testing.assert_close(logits2[:5], a[6:], atol=TOL, rtol=0)
    torch.testing.assert_close(logits2[5:12], b, atol=TOL, rtol=0)
    torch.testing.assert_close(logits2[12:], c[13:], atol=TOL, rtol=0)


def test_logits_to_keep_selects_rows(model_dir):
    ref, ours, cache = _models(model_dir)
    rows = [[5, 6, 7, 8], [9, 10]]
    kept = packed_forward(ours, cache, [0, 1], [0, 0], rows, [3, 5])
    torch.testing.assert_close(kept[0], _hf_logits(ref, rows[0])[-1], atol=TOL, rtol=0)
    torch.testing.assert_close(kept[1], _hf_logits(ref, rows[1])[-1], atol=TOL, rtol=0)


def test_rollback_by_moving_the_length_back(model_dir):
    """Many verify-like steps that write K+1 tokens and keep only some: the cache
    must equal a fresh prefill of the kept tokens."""
    ref, ours, cache = _models(model_dir)
    g = torch.Generator().manual_seed(1)
    kept = torch.randint(0, 300, (5,), generator=g).tolist()
    packed_forward(ours, cache, [2], [0], [kept], [len(kept) - 1])
    for step in range(12):
        speculative = torch.randint(0, 300, (4,), generator=g).tolist()
        logits = packed_forward(ours, cache, [2], [len(kept)], [speculative], [0, 1, 2, 3])
        torch.testing.assert_close(logits, _hf_logits(ref, kept + speculative)[len(kept) :], atol=TOL, rtol=0)
        num_accepted = step % 4  # 0..3 tokens survive; the rest are overwritten later
        kept += speculative[:num_accepted] + [int(torch.randint(0, 300, (1,), generator=g))]
        # The next write starts at len(kept) - 1: the last token is fed next step.
        kept_in_cache = kept[:-1]
        probe = packed_forward(ours, cache, [2], [len(kept_in_cache)], [[kept[-1]]], [0])
        torch.testing.assert_close(probe[0], _hf_logits(ref, kept)[-1], atol=TOL, rtol=0)
    fresh = KVCache.for_model(ours.config, 4, 64, torch.float32, torch.device("cpu"))
    a = packed_forward(ours, fresh, [0], [0], [kept], [len(kept) - 1])
    b = packed_forward(ours, cache, [2], [len(kept) - 1], [[kept[-1]]], [0])
    torch.testing.assert_close(a, b, atol=TOL, rtol=0)
    for layer in range(len(cache.keys)):
        torch.testing.assert_close(
            cache.keys[layer][2, :, : len(kept)], fresh.keys[layer][0, :, : len(kept)], atol=TOL, rtol=0
        )
        torch.testing.assert_close(
            cache.values[layer][2, :, : len(kept)], fresh.values[layer][0, :, : len(kept)], atol=TOL, rtol=0
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_attention_matches_sdpa(dtype):
    """The low-precision CPU path computes the same attention as SDPA (GQA, ragged causal mask)."""
    import torch.nn.functional as F

    from models.kv_cache import StepLayout, _grouped_attention

    g = torch.Generator().manual_seed(0)
    layout = StepLayout.build([0, 1, 2], [40, 7, 100], [2, 5, 3], torch.device("cpu"))
    (group,) = layout.groups  # three verify rows on consecutive slots: one call
    mask = group.mask(None)  # [3, 1, 5, 103]
    q = torch.randn(3, 8, group.plan.max_q, 16, generator=g).to(dtype)
    k = torch.randn(3, 2, group.plan.max_kv, 16, generator=g).to(dtype)
    v = torch.randn(3, 2, group.plan.max_kv, 16, generator=g).to(dtype)
    expected = F.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=mask, scale=0.25, enable_gqa=True
    )
    actual = _grouped_attention(q, k, v, mask, 0.25).float()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


def test_layout_groups_rows_by_slot_and_keeps_long_rows_alone():
    from models.kv_cache import SHORT_ROW_TOKENS, LayoutPlan

    long = SHORT_ROW_TOKENS + 40
    # Rows in scheduler order: decode rows on slots 5, 1, 2 and a prefill chunk on slot 3.
    plan = LayoutPlan.build([5, 1, 2, 3], [30, 12, 20, 0], [1, 1, 1, long])
    short, alone = plan.groups
    assert (short.slot_lo, short.num_slots, short.max_q) == (1, 5, 1)  # slots 1..5, holes 3 and 4 bridged
    assert short.grid_start == [12, 20, 0, 0, 30]
    assert short.token_index == [1, 2, 0] and short.pad_index == [0, 1, 4]
    assert (alone.slot_lo, alone.num_slots, alone.max_q, alone.max_kv) == (3, 1, long, long)
    assert alone.pad_index is None  # no query padding for the prefill chunk
    # Every row decoding one token on slots 0..B-1 in order: one call, no gather, no padding.
    (dense,) = LayoutPlan.build([0, 1, 2], [9, 4, 7], [1, 1, 1]).groups
    assert dense.token_index is None and dense.pad_index is None
    # A verify row among decode rows gets its own call: the decode rows' queries stay unpadded.
    decode, verify = LayoutPlan.build([0, 1, 2, 3], [40, 50, 60, 70], [1, 11, 1, 1]).groups
    assert decode.max_q == 1 and decode.grid_start == [40, 0, 60, 70]  # slot 1 is a bridged hole: one query
    assert decode.pad_index == [0, 2, 3]
    assert (verify.slot_lo, verify.num_slots, verify.max_q) == (1, 1, 11)
    # Far-apart rows with long contexts are not bridged (the holes would cost more than a call).
    assert len(LayoutPlan.build([0, 15], [1500, 1500], [1, 1]).groups) == 2


def test_long_prefill_among_scattered_decode_rows_matches_hf(model_dir):
    """A prefill chunk longer than a verify run, next to decode rows on non-adjacent slots."""
    ref, ours, cache = _models(model_dir)
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (9, 40, 12)]
    # Prefill rows A (slot 3) and C (slot 0) first, then: A and C decode, B prefills 40 tokens on slot 1.
    step1 = [seqs[0][:-1], seqs[2][:-1]]
    packed_forward(ours, cache, [3, 0], [0, 0], step1, _all(step1))
    step2 = [seqs[0][-1:], seqs[1], seqs[2][-1:]]
    logits = packed_forward(ours, cache, [3, 1, 0], [len(seqs[0]) - 1, 0, len(seqs[2]) - 1], step2, _all(step2))
    a, b, c = (_hf_logits(ref, s) for s in seqs)
    torch.testing.assert_close(logits[0], a[-1], atol=TOL, rtol=0)
    torch.testing.assert_close(logits[1:41], b, atol=TOL, rtol=0)
    torch.testing.assert_close(logits[41], c[-1], atol=TOL, rtol=0)
