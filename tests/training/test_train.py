"""Training lowers the loss, beats the untrained head on held-out answers, and is deterministic by epochs."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from models.eagle_head import fused_feature_layers, new_head
from training.data import build_draft_vocab, record_features, split_held_out
from training.evaluate import chain_acceptance
from training.train import TrainConfig, chain_loss, minibatches, soft_cross_entropy, train_head
from training.unroll import IGNORE, draft_index


def mean_loss(head, sequences, config: TrainConfig) -> float:
    """Cross-entropy against the target's argmax (a soft target's has the target's entropy as its floor)."""
    config = replace(config, soft_targets=False)
    index = draft_index(head.draft_vocab, head.vocab_size)
    with torch.no_grad():
        losses = [chain_loss(head, b, index, config)[0].item() for b in minibatches(sequences, config.batch_tokens)]
    return sum(losses) / len(losses)


def test_training_lowers_the_loss_and_fits_the_answers(tiny_loaded, tiny_sequences):
    train_set, held_out = split_held_out(tiny_sequences, 0.2, seed=0)
    head = new_head(tiny_loaded.model, build_draft_vocab(train_set, 128, tiny_loaded.vocab_size))
    head.requires_grad_(True)
    # The argmax: a random model's distributions are nearly flat, so its soft targets say little.
    config = TrainConfig(minutes=2, epochs=30, batch_tokens=1024, lr=3e-3, warmup_steps=5, seed=0, soft_targets=False)
    loss_before, fit_before = mean_loss(head, train_set, config), chain_acceptance(head, train_set).top1
    untrained = chain_acceptance(head, held_out)
    result = train_head(head, train_set, config, lambda: chain_acceptance(head, held_out).as_record())
    assert result.epochs == 30 and result.curve[-1]["step"] == result.steps
    assert result.curve[0]["top1"] == round(untrained.top1, 4)  # the curve starts from the untrained head
    assert mean_loss(head, train_set, config) < 0.7 * loss_before
    assert chain_acceptance(head, train_set).top1 > fit_before + 0.15
    # A random model's answers barely generalise from 40 of them; the next token still does a little.
    assert chain_acceptance(head, held_out).top1 > untrained.top1


@pytest.mark.parametrize(
    "features, unroll, feature_loss",
    # Tokens alone: the chain is trained as long as it is evaluated. EAGLE-1's regression keeps g
    # in the target's feature space, so its chain also drafts past the steps it was trained on.
    [("fused", 4, 0.0), ("last", 2, 1.0)],
    ids=["fused-tokens", "last-regression"],
)
def test_a_learnable_target_is_drafted_almost_perfectly_on_held_out_answers(
    features, unroll, feature_loss, cycle_sequences
):
    loaded, sequences = cycle_sequences
    layers = fused_feature_layers(loaded.model.config.num_hidden_layers) if features == "fused" else None
    if layers:
        prompt_ids = [s.token_ids[: s.prompt_len].tolist() for s in sequences]
        answers = [s.token_ids[s.prompt_len :].tolist() for s in sequences]
        sequences = record_features(loaded, prompt_ids, answers, layers=layers)
    train_set, held_out = split_held_out(sequences, 0.25, seed=0)
    head = new_head(loaded.model, build_draft_vocab(train_set, 64, loaded.vocab_size), layers)
    head.requires_grad_(True)
    untrained = chain_acceptance(head, held_out)
    config = TrainConfig(minutes=2, epochs=60, batch_tokens=1024, lr=3e-3, warmup_steps=5, unroll=unroll,
                         feature_loss=feature_loss)  # fmt: skip
    train_head(head, train_set, config)
    trained = chain_acceptance(head, held_out)
    assert untrained.accepted_per_verify < 0.5
    assert min(trained.per_position) > 0.9, trained  # the chained steps too, fed the head's own features
    assert trained.per_position == sorted(trained.per_position, reverse=True)  # a chain only shortens


def test_soft_targets_renormalise_inside_the_draft_vocabulary():
    logits = torch.randn(3, 5)
    log_q = logits.log_softmax(-1)
    ids = torch.tensor([[2, IGNORE, 4], [1, 0, IGNORE], [IGNORE, IGNORE, IGNORE]])
    probs = torch.tensor([[0.5, 0.3, 0.1], [1.0, 0.0, 0.0], [0.9, 0.05, 0.05]])
    # Row 0: 0.5 and 0.1 inside, renormalised to 5/6 and 1/6; row 1 is one-hot (hard cross-entropy);
    # row 2 has nothing inside the draft vocabulary and adds nothing.
    expected = (-(5 / 6 * log_q[0, 2] + 1 / 6 * log_q[0, 4]) - log_q[1, 1]) / 2
    torch.testing.assert_close(soft_cross_entropy(logits, ids, probs), expected)
    one_hot = soft_cross_entropy(logits[1:2], ids[1:2], probs[1:2])
    torch.testing.assert_close(one_hot, torch.nn.functional.cross_entropy(logits[1:2], torch.tensor([1])))


def test_soft_and_argmax_targets_both_train(tiny_loaded, tiny_sequences):
    """Soft targets by default; `soft_targets=False` (or data without a recorded top-k) trains on the argmax."""
    vocab = build_draft_vocab(tiny_sequences, 128, tiny_loaded.vocab_size)
    argmax = TrainConfig(minutes=1, epochs=10, batch_tokens=1024, lr=3e-3, warmup_steps=5, soft_targets=False)
    for config in (argmax, replace(argmax, soft_targets=True)):
        torch.manual_seed(0)
        head = new_head(tiny_loaded.model, vocab)
        head.requires_grad_(True)
        fit_before = chain_acceptance(head, tiny_sequences).top1
        train_head(head, tiny_sequences, config)
        assert chain_acceptance(head, tiny_sequences).top1 > fit_before + 0.1
    # A soft loss weighs the runners-up too, so on the same head the two losses differ.
    index = draft_index(vocab, tiny_loaded.vocab_size)
    batch = minibatches(tiny_sequences, 1024)[0]
    with torch.no_grad():
        assert chain_loss(head, batch, index, argmax)[0] != chain_loss(head, batch, index, config)[0]


def test_the_same_seed_and_epochs_give_the_same_head(tiny_loaded, tiny_sequences):
    sequences = tiny_sequences[:12]
    vocab = build_draft_vocab(sequences, 64, tiny_loaded.vocab_size)
    heads = []
    for _ in range(2):
        torch.manual_seed(7)  # the head's initial weights, as train-draft seeds them
        head = new_head(tiny_loaded.model, vocab)
        head.requires_grad_(True)
        train_head(head, sequences, TrainConfig(minutes=1, epochs=2, batch_tokens=512, seed=7))
        heads.append(head.trainable_state())
    assert all(torch.equal(heads[0][k], heads[1][k]) for k in heads[0])


def test_a_feature_loss_needs_a_head_over_the_last_hidden_state(tiny_loaded, tiny_sequences):
    layers = fused_feature_layers(tiny_loaded.model.config.num_hidden_layers)
    head = new_head(tiny_loaded.model, build_draft_vocab(tiny_sequences, 64, tiny_loaded.vocab_size), layers)
    with pytest.raises(ValueError, match="last hidden state"):
        train_head(head, tiny_sequences, TrainConfig(minutes=1, epochs=1, feature_loss=1.0))


def test_bf16_autocast_trains_float32_weights(tiny_loaded, tiny_sequences):
    """Where the target runs in bf16, train-draft computes in bf16: the weights stay float32 and learn."""
    head = new_head(tiny_loaded.model, build_draft_vocab(tiny_sequences, 128, tiny_loaded.vocab_size))
    head.requires_grad_(True)
    config = TrainConfig(minutes=1, epochs=10, batch_tokens=1024, lr=3e-3, warmup_steps=5, bf16_autocast=True)
    before = mean_loss(head, tiny_sequences, config)
    train_head(head, tiny_sequences, config)
    assert all(p.dtype == torch.float32 for p in head.parameters())
    assert mean_loss(head, tiny_sequences, config) < 0.8 * before


def test_the_budget_keeps_room_for_the_last_step_and_the_final_evaluation(tiny_loaded, tiny_sequences, monkeypatch):
    """On a fake clock (every reading 0.1 s, every evaluation 5 s): training stops while one more
    step and the final evaluation fit, so the call, that evaluation included, ends within `minutes`."""
    import training.train as train_module

    clock = {"now": 0.0}

    def perf_counter() -> float:
        clock["now"] += 0.1
        return clock["now"]

    def evaluate() -> dict:
        clock["now"] += 5.0
        return {"top1": 0.0}

    monkeypatch.setattr(train_module.time, "perf_counter", perf_counter)
    head = new_head(tiny_loaded.model, build_draft_vocab(tiny_sequences, 64, tiny_loaded.vocab_size))
    head.requires_grad_(True)
    start = clock["now"]
    result = train_head(
        head, tiny_sequences[:8], TrainConfig(minutes=0.5, batch_tokens=512, eval_every_minutes=10), evaluate
    )
    assert clock["now"] - start < 30.0 + 0.6  # + the few readings after the loop, 0.1 s each on this clock
    assert result.steps > 10 and result.curve[-1]["step"] == result.steps  # it trained, then evaluated
    # The final evaluation began with its 5 s and about a step left (the curve rounds to 0.01 minute).
    assert 23.5 < result.curve[-1]["minutes"] * 60 < 25.5
