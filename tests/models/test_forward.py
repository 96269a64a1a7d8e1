"""The packed ragged forward over the paged KV cache reproduces HF's own logits:
scattered and consecutive block tables, shared prefix blocks, and rollback. Every
test runs both forwards: specd's own for the Llama family (`models.llama`) and
transformers' with specd's cache and attention."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from models.forward import cache_kwargs
from models.kv_cache import ATTN_IMPLEMENTATION, KVCache
from tests.support.tensors import packed_forward, read_kv, slot_table

TOL = 1e-4
SLOTS, BLOCK, BLOCKS_PER_SLOT = 4, 8, 8  # 4 sequences of 64 positions, in blocks of 8


def table(slot: int) -> list[int]:
    return slot_table(slot, SLOTS, BLOCKS_PER_SLOT)


def tables(*slots: int) -> list[list[int]]:
    return [table(s) for s in slots]


def new_cache(model) -> KVCache:
    return KVCache.for_model(model.config, SLOTS * BLOCKS_PER_SLOT, BLOCK, torch.float32, torch.device("cpu"))


def _models(path):
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours.set_attn_implementation(ATTN_IMPLEMENTATION)
    return ref, ours, new_cache(ours)


def _all(token_lists):
    return list(range(sum(len(t) for t in token_lists)))


@torch.inference_mode()
def _hf_logits(ref, ids):
    return ref(torch.tensor([ids])).logits[0].float()


@pytest.fixture(autouse=True, params=["lean", "transformers"])
def forward_path(request, monkeypatch):
    from models import forward

    monkeypatch.setattr(forward, "USE_LEAN_FORWARD", request.param == "lean")
    monkeypatch.setattr(forward, "_LEAN", type(forward._LEAN)())
    return request.param


@pytest.fixture(params=["llama", "qwen2"])
def model_dir(request, tiny_llama_dir, tiny_qwen2_dir):
    return tiny_llama_dir if request.param == "llama" else tiny_qwen2_dir


def test_mixed_prefill_and_decode_rows_match_hf(model_dir):
    ref, ours, cache = _models(model_dir)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (11, 7, 14)]
    # Step 1: row A prefills its first 6 tokens, row C all 13 (scattered blocks: the gather path).
    step1 = [seqs[0][:6], seqs[2][:13]]
    logits1 = packed_forward(ours, cache, tables(0, 3), [0, 0], step1, _all(step1))
    # Step 2: A finishes its prompt (chunked prefill), B prefills, C decodes one token.
    step2 = [seqs[0][6:], seqs[1], seqs[2][13:]]
    logits2 = packed_forward(ours, cache, tables(0, 1, 3), [6, 0, 13], step2, _all(step2))

    a, b, c = (_hf_logits(ref, s) for s in seqs)
    torch.testing.assert_close(logits1[:6], a[:6], atol=TOL, rtol=0)
    torch.testing.assert_close(logits1[6:], c[:13], atol=TOL, rtol=0)
    torch.testing.assert_close(logits2[:5], a[6:], atol=TOL, rtol=0)
    torch.testing.assert_close(logits2[5:12], b, atol=TOL, rtol=0)
    torch.testing.assert_close(logits2[12:], c[13:], atol=TOL, rtol=0)


def test_logits_to_keep_selects_rows(model_dir):
    ref, ours, cache = _models(model_dir)
    rows = [[5, 6, 7, 8], [9, 10]]
    kept = packed_forward(ours, cache, tables(0, 1), [0, 0], rows, [3, 5])
    torch.testing.assert_close(kept[0], _hf_logits(ref, rows[0])[-1], atol=TOL, rtol=0)
    torch.testing.assert_close(kept[1], _hf_logits(ref, rows[1])[-1], atol=TOL, rtol=0)


def test_rollback_by_moving_the_length_back(model_dir):
    """Many verify-like steps that write K+1 tokens and keep only some: the cache
    must equal a fresh prefill of the kept tokens."""
    ref, ours, cache = _models(model_dir)
    g = torch.Generator().manual_seed(1)
    kept = torch.randint(0, 300, (5,), generator=g).tolist()
    packed_forward(ours, cache, tables(2), [0], [kept], [len(kept) - 1])
    for step in range(12):
        speculative = torch.randint(0, 300, (4,), generator=g).tolist()
        logits = packed_forward(ours, cache, tables(2), [len(kept)], [speculative], [0, 1, 2, 3])
        torch.testing.assert_close(logits, _hf_logits(ref, kept + speculative)[len(kept) :], atol=TOL, rtol=0)
        num_accepted = step % 4  # 0..3 tokens survive; the rest are overwritten later
        kept += speculative[:num_accepted] + [int(torch.randint(0, 300, (1,), generator=g))]
        # The next write starts at len(kept) - 1: the last token is fed next step.
        kept_in_cache = kept[:-1]
        probe = packed_forward(ours, cache, tables(2), [len(kept_in_cache)], [[kept[-1]]], [0])
        torch.testing.assert_close(probe[0], _hf_logits(ref, kept)[-1], atol=TOL, rtol=0)
    fresh = new_cache(ours)
    consecutive = list(range(BLOCKS_PER_SLOT))  # one row on consecutive blocks: the view path
    a = packed_forward(ours, fresh, [consecutive], [0], [kept], [len(kept) - 1])
    b = packed_forward(ours, cache, tables(2), [len(kept) - 1], [[kept[-1]]], [0])
    torch.testing.assert_close(a, b, atol=TOL, rtol=0)
    for layer in range(len(cache.keys)):
        for ours_kv, fresh_kv in zip(
            read_kv(cache, layer, table(2), len(kept)), read_kv(fresh, layer, consecutive, len(kept))
        ):
            torch.testing.assert_close(ours_kv, fresh_kv, atol=TOL, rtol=0)


def test_shared_prefix_blocks_match_a_fresh_prefill(model_dir):
    """Prefix caching at the KV level: B reuses A's first two full blocks and computes
    only its own tail, beside a decode row; its logits equal HF's over B's whole text,
    and the shared blocks are left as they were."""
    ref, ours, cache = _models(model_dir)
    g = torch.Generator().manual_seed(4)
    prefix = torch.randint(0, 300, (2 * BLOCK,), generator=g).tolist()
    a = prefix + torch.randint(0, 300, (5,), generator=g).tolist()
    b = prefix + torch.randint(0, 300, (9,), generator=g).tolist()
    a_table, b_table = [5, 1, 9], [5, 1, 20, 13]  # shared blocks 5 and 1, then B's own
    packed_forward(ours, cache, [a_table], [0], [a], _all([a]))
    before = [read_kv(cache, layer, a_table, len(prefix)) for layer in range(len(cache.keys))]
    tail = b[len(prefix) :]
    rows = [tail, a[-1:]]  # B's uncached tail, and A decoding its last token again
    logits = packed_forward(ours, cache, [b_table, a_table], [len(prefix), len(a) - 1], rows, _all(rows))
    torch.testing.assert_close(logits[: len(tail)], _hf_logits(ref, b)[len(prefix) :], atol=TOL, rtol=0)
    torch.testing.assert_close(logits[len(tail)], _hf_logits(ref, a)[-1], atol=TOL, rtol=0)
    for layer, (k, v) in enumerate(before):
        k_now, v_now = read_kv(cache, layer, a_table, len(prefix))
        assert torch.equal(k, k_now) and torch.equal(v, v_now)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_attention_matches_sdpa(dtype):
    """The low-precision CPU path computes the same attention as SDPA (GQA, ragged causal mask)."""
    import torch.nn.functional as F

    from models.kv_cache import StepLayout, grouped_attention

    g = torch.Generator().manual_seed(0)
    layout = StepLayout.build(tables(0, 1, 2), [40, 7, 50], [2, 5, 3], BLOCK, torch.device("cpu"))
    (group,) = layout.groups  # three verify rows: one call
    mask = group.mask(None)  # [3, 1, 5, 56]: whole blocks read
    q = torch.randn(3, 8, group.plan.max_q, 16, generator=g).to(dtype)
    k = torch.randn(2, 3, group.num_keys, 16, generator=g).to(dtype)  # [KVH, rows, keys, D] as read from the pool
    v = torch.randn(2, 3, group.num_keys, 16, generator=g).to(dtype)
    expected = F.scaled_dot_product_attention(
        q.float(), k.float().transpose(0, 1), v.float().transpose(0, 1), attn_mask=mask, scale=0.25, enable_gqa=True
    )
    actual = grouped_attention(q, k, v, mask, 0.25).float()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


def test_layout_groups_decode_and_verify_rows_and_keeps_long_rows_alone():
    from models.kv_cache import SHORT_ROW_TOKENS, LayoutPlan

    long = SHORT_ROW_TOKENS + 40
    # Rows in scheduler order: decode rows at 30, 12 and 20, a prefill chunk, a verify row.
    plan = LayoutPlan.build(tables(0, 1, 2, 3, 1), [30, 12, 20, 0, 40], [1, 1, 1, long, 5], BLOCK)
    decode, verify, alone = plan.groups
    assert (decode.num_rows, decode.max_q, decode.max_kv, decode.num_blocks) == (3, 1, 31, 4)
    assert decode.grid_start == [30, 12, 20] and decode.token_index == [0, 1, 2] and decode.pad_index is None
    # Every row reads the longest row's number of blocks; short rows pad with their first block.
    assert decode.block_index == table(0)[:4] + table(1)[:2] + [table(1)[0]] * 2 + table(2)[:3] + [table(2)[0]]
    assert (verify.num_rows, verify.max_q, verify.token_index) == (1, 5, [3 + long + i for i in range(5)])
    assert (alone.num_rows, alone.max_q, alone.max_kv) == (1, long, long)
    assert alone.pad_index is None  # no query padding for the prefill chunk
    assert plan.token_dest[:3] == [table(0)[3] * BLOCK + 6, table(1)[1] * BLOCK + 4, table(2)[2] * BLOCK + 4]
    # One row on consecutive blocks reads its keys as a view of the pool; scattered ones gather.
    (view,) = LayoutPlan.build([[6, 7, 8]], [0], [20], BLOCK).groups
    assert view.view_block == 6
    (gather,) = LayoutPlan.build([[6, 2, 8]], [0], [20], BLOCK).groups
    assert gather.view_block is None


def test_long_prefill_among_scattered_decode_rows_matches_hf(model_dir):
    """A prefill chunk longer than a verify run, next to decode rows."""
    ref, ours, cache = _models(model_dir)
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (9, 40, 12)]
    # Prefill rows A and C first, then: A and C decode, B prefills 40 tokens.
    step1 = [seqs[0][:-1], seqs[2][:-1]]
    packed_forward(ours, cache, tables(3, 0), [0, 0], step1, _all(step1))
    step2 = [seqs[0][-1:], seqs[1], seqs[2][-1:]]
    logits = packed_forward(ours, cache, tables(3, 1, 0), [len(seqs[0]) - 1, 0, len(seqs[2]) - 1], step2, _all(step2))
    a, b, c = (_hf_logits(ref, s) for s in seqs)
    torch.testing.assert_close(logits[0], a[-1], atol=TOL, rtol=0)
    torch.testing.assert_close(logits[1:41], b, atol=TOL, rtol=0)
    torch.testing.assert_close(logits[41], c[-1], atol=TOL, rtol=0)


@pytest.mark.parametrize("fused", [False, True], ids=["last", "fused"])
def test_forward_with_hidden_gives_the_same_logits_and_the_final_hidden_states(model_dir, fused):
    """The EAGLE path: the base model once, the lm_head on the kept rows only. Its logits
    equal `forward_step`'s, it writes the same KV, and its hidden states are HF's last
    (post-norm) hidden states of every packed token, or the asked layers' side by side."""
    from models.eagle_head import fused_feature_layers
    from models.forward import forward_with_hidden
    from models.kv_cache import LayoutPlan
    from models.transfer import HostBuffer

    ref, ours, cache = _models(model_dir)
    other = new_cache(ours)
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (9, 30, 4)]
    step1 = [s[:-1] for s in seqs]
    packed_forward(ours, cache, tables(3, 0, 1), [0, 0, 0], step1, [0])
    packed_forward(ours, other, tables(3, 0, 1), [0, 0, 0], step1, [0])
    # A decode row, a verify-like row and a prefill row from position 0 (a row of its own).
    rows = [seqs[0][-1:], seqs[1][-1:] + [7, 8, 9], seqs[2]]
    starts = [len(seqs[0]) - 1, len(seqs[1]) - 1, 0]
    keep = [0, 2, 4, 5, 8]
    expected = packed_forward(ours, cache, tables(3, 0, 2), starts, rows, keep)
    buf = HostBuffer()
    plan = LayoutPlan.build(tables(3, 0, 2), starts, [len(r) for r in rows], BLOCK)
    plan.add_to(buf, "layout")
    buf.ints("input_ids", [t for r in rows for t in r])
    buf.ints("keep", keep)
    arrays = buf.upload(torch.device("cpu"))
    layout = plan.resolve(arrays, "layout")
    layers = fused_feature_layers(ours.config.num_hidden_layers) if fused else None
    logits, hidden = forward_with_hidden(ours, other, layout, arrays["input_ids"], arrays["keep"], layers)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)
    assert hidden.shape == (sum(len(r) for r in rows), ours.config.hidden_size * len(layers or [0]))

    def states(ids: list[int]) -> torch.Tensor:
        out = ref.model(torch.tensor([ids]), output_hidden_states=True)
        return torch.cat([out.hidden_states[i][0] for i in layers], -1) if layers else out.last_hidden_state[0]

    with torch.inference_mode():
        full = [states(s) for s in (seqs[0], seqs[1][:-1] + rows[1], seqs[2])]
    torch.testing.assert_close(hidden[0], full[0][-1], atol=TOL, rtol=0)
    torch.testing.assert_close(hidden[1:5], full[1][-4:], atol=TOL, rtol=0)
    torch.testing.assert_close(hidden[5:], full[2], atol=TOL, rtol=0)
    for layer in range(len(cache.keys)):
        torch.testing.assert_close(cache.keys[layer], other.keys[layer], atol=1e-6, rtol=0)


class _NewNames(torch.nn.Module):
    def forward(self, input_ids, cache=None, use_cache=False, **kwargs): ...


class _OldNames(torch.nn.Module):
    def forward(self, input_ids, past_key_values=None, use_cache=False, **kwargs): ...


class _NoCache(torch.nn.Module):
    def forward(self, input_ids, **kwargs): ...


def test_cache_goes_under_the_name_the_forward_takes():
    # transformers 5.25 names it `cache`; 5.17 (the GPU image's) only `past_key_values`, and an
    # unknown `cache=` there would fall into **kwargs unread.
    pool = object()
    assert cache_kwargs(_NewNames(), pool) == {"cache": pool}
    assert cache_kwargs(_OldNames(), pool) == {"past_key_values": pool}
    with pytest.raises(TypeError, match="no KV cache argument"):
        cache_kwargs(_NoCache(), pool)
