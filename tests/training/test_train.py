"""Training lowers the loss, beats the untrained head on held-out answers, and is deterministic by epochs."""

from __future__ import annotations

import torch

from models.eagle_head import new_head
from training.data import build_draft_vocab, split_held_out
from training.evaluate import chain_acceptance
from training.train import TrainConfig, chain_loss, minibatches, train_head
from training.unroll import draft_index


def mean_loss(head, sequences, config: TrainConfig) -> float:
    index = draft_index(head.draft_vocab, head.vocab_size)
    with torch.no_grad():
        losses = [chain_loss(head, b, index, config)[0].item() for b in minibatches(sequences, config.batch_tokens)]
    return sum(losses) / len(losses)


def test_training_lowers_the_loss_and_fits_the_answers(tiny_loaded, tiny_sequences):
    train_set, held_out = split_held_out(tiny_sequences, 0.2, seed=0)
    head = new_head(tiny_loaded.model, build_draft_vocab(train_set, 128, tiny_loaded.vocab_size))
    head.requires_grad_(True)
    config = TrainConfig(minutes=2, epochs=30, batch_tokens=1024, lr=3e-3, warmup_steps=5, seed=0)
    loss_before, fit_before = mean_loss(head, train_set, config), chain_acceptance(head, train_set).top1
    untrained = chain_acceptance(head, held_out)
    result = train_head(head, train_set, config, lambda: chain_acceptance(head, held_out).as_record())
    assert result.epochs == 30 and result.curve[-1]["step"] == result.steps
    assert result.curve[0]["top1"] == round(untrained.top1, 4)  # the curve starts from the untrained head
    assert mean_loss(head, train_set, config) < 0.7 * loss_before
    assert chain_acceptance(head, train_set).top1 > fit_before + 0.15
    # A random model's answers barely generalise from 40 of them; the next token still does a little.
    assert chain_acceptance(head, held_out).top1 > untrained.top1


def test_a_learnable_target_is_drafted_almost_perfectly_on_held_out_answers(cycle_sequences):
    loaded, sequences = cycle_sequences
    train_set, held_out = split_held_out(sequences, 0.25, seed=0)
    head = new_head(loaded.model, build_draft_vocab(train_set, 64, loaded.vocab_size))
    head.requires_grad_(True)
    untrained = chain_acceptance(head, held_out)
    train_head(head, train_set, TrainConfig(minutes=2, epochs=60, batch_tokens=1024, lr=3e-3, warmup_steps=5))
    trained = chain_acceptance(head, held_out)
    assert untrained.accepted_per_verify < 0.5
    assert min(trained.per_position) > 0.9, trained  # the chained steps too, fed the head's own features
    assert trained.per_position == sorted(trained.per_position, reverse=True)  # a chain only shortens


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
