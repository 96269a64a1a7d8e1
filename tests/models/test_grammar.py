"""llguidance matchers as the engine uses them: forced tokens, draft checks that commit nothing,
masks per verify position, and masks applied to packed logits."""

from __future__ import annotations

import pytest
import torch

from models import cpu_kernels
from models.grammar import GrammarTokenizer, apply_masks, fill_masks, regex_grammar
from tests.support.tiny_models import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def grammar_tokenizer(tokenizer):
    return GrammarTokenizer(tokenizer, [tokenizer.eos_token_id], len(tokenizer) + 5)  # logits wider than the vocab


def allowed(bitmask_row: torch.Tensor, vocab: int) -> set[int]:
    return {i for i in range(vocab) if (int(bitmask_row[i // 32]) >> (i % 32)) & 1}


def test_forced_accepts_and_advance(tokenizer, grammar_tokenizer):
    state = grammar_tokenizer.compile(regex_grammar("hello (world|there)")).start()
    forced = state.forced()
    # The grammar leaves no other way to begin (llguidance keeps back a token that could merge with what follows).
    assert forced and "hello ".startswith(tokenizer.decode(forced))
    good = tokenizer.encode("hello world", add_special_tokens=False)
    help_ids = tokenizer.encode("help", add_special_tokens=False)
    assert state.accepts(good) == len(good) and state.accepts(help_ids) == len(help_ids) - 1  # "he", "l"; not "p"
    assert state.num_tokens == 0  # nothing committed by asking
    assert state.advance(good) and state.is_done and state.error is None
    assert not state.advance([good[0]]) and state.error


def test_masks_follow_the_draft_and_apply_to_packed_rows(tokenizer, grammar_tokenizer):
    vocab = grammar_tokenizer.vocab_size
    a, b = (grammar_tokenizer.compile(regex_grammar(r)).start() for r in ("ab", "[0-9]+"))
    draft = tokenizer.encode("a", add_special_tokens=False)
    bitmask = fill_masks([(a, 0, draft), (b, 2, [])], 4)
    after_a = allowed(bitmask[1], vocab)
    assert all(tokenizer.decode([t]) in ("b",) for t in after_a)  # "a" drafted: only "b" may follow
    assert allowed(bitmask[3], vocab) == set(range(vocab))  # a row of no state: all allowed
    assert all(tokenizer.decode([t]).isdigit() for t in allowed(bitmask[2], vocab))
    assert a.num_tokens == 0 and a.accepts(draft) == 1  # the masks committed nothing

    logits = torch.zeros(5, vocab, dtype=torch.bfloat16)
    apply_masks(logits, torch.tensor([1, 3]), bitmask[1:3].to(torch.int64))
    assert torch.isfinite(logits[[0, 2, 4]]).all()
    assert set(torch.isfinite(logits[1]).nonzero().flatten().tolist()) == after_a
    assert not torch.isfinite(logits[3, len(tokenizer) :]).any()  # past the tokenizer's ids: never


def test_serial_masks_are_the_pools_masks_and_commit_nothing(tokenizer, grammar_tokenizer):
    def encode(text):
        return tokenizer.encode(text, add_special_tokens=False)

    states = [grammar_tokenizer.compile(regex_grammar(r)).start() for r in ("ab", "[0-9]+", "(yes|no) sir", "ab")]
    states[3].advance(encode("a"))  # a state part-way through
    drafts = [encode("a"), encode("123"), encode("yes"), encode("b")]  # the last completes its grammar
    items = [(state, row, draft) for state, row, draft in zip(states, (0, 2, 6, 10), drafts)]
    serial = fill_masks(items, 12)
    assert torch.equal(serial, fill_masks(items, 12, parallel=True))
    assert allowed(serial[11], grammar_tokenizer.vocab_size) == {tokenizer.eos_token_id}  # done: only the end
    assert [s.num_tokens for s in states] == [0, 0, 0, 1]
    assert all(s.accepts(d) == len(d) for s, d in zip(states, drafts))  # the masks committed nothing

    # A draft the grammar refuses part-way: masks up to the refusal, all-allowed after, the state intact.
    state = grammar_tokenizer.compile(regex_grammar("ab")).start()
    bitmask = fill_masks([(state, 0, encode("ax"))], 3)
    assert allowed(bitmask[1], grammar_tokenizer.vocab_size) == {
        t for t in range(len(tokenizer)) if tokenizer.decode([t]) == "b"
    }
    assert bitmask[2].eq(-1).all() and state.error is None and state.accepts(encode("ab")) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [128, 100, 200])  # whole words, a part of the last one, wider than the mask
def test_the_mask_kernel_sets_what_torchs_expression_sets(built_kernels, monkeypatch, dtype, vocab):
    generator = torch.Generator().manual_seed(vocab)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 4), generator=generator, dtype=torch.int64).to(torch.int32)
    bitmask[0, 1], bitmask[1, 2] = -1, 0  # a word of allowed tokens only, one of refused tokens only
    wide = torch.randn(5, vocab + 7, generator=generator).to(dtype)
    rows = torch.tensor([4, 0, 2])
    assert cpu_kernels.available()
    fast_wide = wide.clone()
    fast = fast_wide[:, :vocab]  # rows apart in memory: the kernel must stay inside each row's view
    apply_masks(fast, rows, bitmask)
    assert torch.equal(fast_wide[:, vocab:], wide[:, vocab:])
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    slow = wide[:, :vocab].clone()
    apply_masks(slow, rows, bitmask)
    assert torch.equal(fast, slow) and torch.equal(fast[[1, 3]], wide[[1, 3], :vocab])  # unmasked rows kept
    refused = [t for t in range(vocab) if t >= 128 or not (int(bitmask[0, t // 32]) >> (t % 32)) & 1]
    assert torch.isinf(fast[4]).nonzero().flatten().tolist() == refused
