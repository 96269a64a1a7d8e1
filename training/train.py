"""The training loop: AdamW over minibatches of whole sequences, within a time budget.

Loss per chained step s (training/unroll.py), averaged over the steps:

    cross_entropy(p_next, softmax(draft_logits(g^s)))  [+ feature_loss * smooth_l1(g^s, h_{next})]

p_next is the target's own distribution at the next position, as EAGLE trains:
its recorded top-k restricted to the draft vocabulary and renormalised (with
`soft_targets` off, or data recorded without it, one-hot on its argmax a_{next}).
The soft targets carry what the target thought of the runners-up, which a few
hundred answers cannot show one token at a time. Tokens alone by default, as
EAGLE-3 trains: the feature regression (EAGLE-1's, which weights tokens 0.1
against it) only exists for a head over the last hidden state, and it lowered
held-out acceptance here (docs/training.md). Targets outside the draft
vocabulary add no token term. With `unroll` >= 2 the head also learns from its
own outputs fed back, as it drafts at serving time.

The learning rate warms up, then follows a cosine to zero over the run: over the
steps of `epochs` when given (the run is then deterministic with `seed`), else over
the `minutes` budget (the order of batches and the init are still seeded, but where
the budget ends depends on the machine's speed).
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from models.eagle_head import EagleHead
from training.data import Sequence, length_groups
from training.unroll import IGNORE, ChainBatch, draft_index, unrolled

logger = logging.getLogger("specd.training")


@dataclass
class TrainConfig:
    # Time budget for the optimisation, evaluations included. None only on its way to train-draft,
    # which fills it in from what its whole-run budget leaves; train_head needs a number.
    minutes: float | None = 15.0
    epochs: float | None = None  # stop after this many passes over the data, if sooner
    # Padded tokens per minibatch (rows x longest sequence). The head sees the same tokens a minute
    # at any size; 2048 takes twice the steps of 4096, which held out accepted 7% more after 6 minutes
    # on SmolLM2 (docs/training.md, "Smaller minibatches, more prompts").
    batch_tokens: int = 2048
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup_steps: int = 20
    unroll: int = 2  # chained steps trained per position (1: EAGLE-1's single step)
    feature_loss: float = 0.0  # weight of EAGLE-1's regression of h_{next} (last-hidden-state heads only)
    soft_targets: bool = True  # the target's top-k distribution (where recorded), else its argmax
    # Forward and backward under bf16 autocast (weights and optimiser stay float32): train-draft
    # turns it on where the target itself runs in bf16, i.e. the machine computes bf16 natively.
    bf16_autocast: bool = False
    eval_every_minutes: float | None = None  # default: five points over the budget
    seed: int = 0


@dataclass
class TrainResult:
    steps: int
    epochs: float
    minutes: float
    final_loss: float
    final_top1: float
    curve: list[dict] = field(default_factory=list)  # what `evaluate` returned along the run


def train_head(
    head: EagleHead,
    sequences: list[Sequence],
    config: TrainConfig,
    evaluate: Callable[[], dict] | None = None,
) -> TrainResult:
    """Optimise `head` in place; `evaluate()` (held-out numbers) runs at the start, every
    `eval_every_minutes` and at the end, and its results make the curve. `minutes` bounds the
    whole call: training stops while one more step and the final evaluation still fit."""
    started = time.perf_counter()  # the budget covers building the minibatches too
    if config.feature_loss and head.fuse is not None:
        raise ValueError("a feature loss needs a head over the last hidden state (fused features have no target)")
    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    # Every sequence then has a position that every unrolled step can score (no empty loss terms).
    batches = minibatches([s for s in sequences if len(s.token_ids) > config.unroll], config.batch_tokens)
    if not batches:
        raise ValueError("no training sequences")
    total_steps = math.ceil(config.epochs * len(batches)) if config.epochs else None
    if config.minutes is None:
        raise ValueError("train_head needs a time budget (TrainConfig.minutes)")
    budget = config.minutes * 60
    eval_every = 60 * (config.eval_every_minutes or config.minutes / 5)
    index = draft_index(head.draft_vocab, head.vocab_size)
    device = head.fc.weight.device.type
    optimizer = torch.optim.AdamW(
        [p for p in head.parameters() if p.requires_grad], lr=config.lr, weight_decay=config.weight_decay
    )
    curve: list[dict] = []

    def elapsed() -> float:
        return time.perf_counter() - started

    # The longest step and evaluation so far: the budget keeps room for one more of each.
    step_seconds = eval_seconds = 0.0

    def checkpoint(step: int) -> None:
        nonlocal eval_seconds
        if evaluate is not None:
            begun = elapsed()
            point = {"minutes": round(begun / 60, 2), "step": step, **evaluate()}
            eval_seconds = max(eval_seconds, elapsed() - begun)
            curve.append(point)
            logger.info("eval at %.1f min, step %d: %s", point["minutes"], step, point)

    checkpoint(0)
    next_eval = eval_every
    head.train()
    step, loss_avg, top1_avg = 0, float("nan"), float("nan")
    order: list[int] = []
    bar = tqdm(total=total_steps, desc="train", unit="step")
    while elapsed() + step_seconds + eval_seconds < budget and (total_steps is None or step < total_steps):
        begun = elapsed()
        if not order:
            order = list(range(len(batches)))
            rng.shuffle(order)
        batch = batches[order.pop()]
        progress = step / total_steps if total_steps else elapsed() / budget
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(config, step, progress)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=config.bf16_autocast):
            loss, top1 = chain_loss(head, batch, index, config)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optimizer.step()
        step += 1
        loss_avg = loss.item() if math.isnan(loss_avg) else 0.95 * loss_avg + 0.05 * loss.item()
        top1_avg = top1 if math.isnan(top1_avg) else 0.95 * top1_avg + 0.05 * top1
        bar.update(1)
        bar.set_postfix(loss=f"{loss_avg:.3f}", top1=f"{top1_avg:.3f}", min=f"{elapsed() / 60:.1f}")
        step_seconds = max(step_seconds, elapsed() - begun)
        if evaluate is not None and elapsed() >= next_eval and elapsed() + 2 * eval_seconds < budget:
            checkpoint(step)
            next_eval += eval_every
            head.train()
    bar.close()
    minutes = elapsed() / 60
    checkpoint(step)
    head.eval()
    return TrainResult(
        steps=step,
        epochs=round(step / len(batches), 2),
        minutes=round(minutes, 2),
        final_loss=round(loss_avg, 4),
        final_top1=round(top1_avg, 4),
        curve=curve,
    )


def learning_rate(config: TrainConfig, step: int, progress: float) -> float:
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    return config.lr * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def chain_loss(
    head: EagleHead, batch: ChainBatch, index: torch.Tensor, config: TrainConfig
) -> tuple[torch.Tensor, float]:
    """(loss, step-0 top-1 accuracy over the draft vocabulary) of one minibatch."""
    losses = []
    top1 = 0.0
    for s, step in enumerate(unrolled(head, batch, config.unroll)):
        valid = batch.valid(s)
        g = step.g[valid]
        targets = index[step.token_target[valid]]
        logits = head.draft_logits(g)
        if config.soft_targets and step.top_ids is not None and step.top_probs is not None:
            loss = soft_cross_entropy(logits, index[step.top_ids[valid]], step.top_probs[valid])
        elif (targets != IGNORE).any():
            loss = F.cross_entropy(logits, targets, ignore_index=IGNORE)
        else:
            loss = logits.sum() * 0
        if config.feature_loss:
            loss = loss + config.feature_loss * F.smooth_l1_loss(g, step.feature_target[valid])
        losses.append(loss)
        if s == 0:
            top1 = (logits.argmax(-1) == targets).float().mean().item() if len(targets) else 0.0
    return torch.stack(losses).mean(), top1


def soft_cross_entropy(logits: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Mean over rows of -sum_i p_i log q(ids_i): `ids` [N, k] are draft-vocabulary positions
    (IGNORE outside it), `probs` [N, k] the target's probabilities, renormalised over the ids
    inside (a row with none adds nothing), q = softmax(logits)."""
    inside = ids != IGNORE
    p = torch.where(inside, probs.float(), 0.0)
    mass = p.sum(-1, keepdim=True)
    rows = mass[:, 0] > 0
    if not rows.any():
        return logits.sum() * 0
    log_q = logits.float().log_softmax(-1).gather(-1, ids.clamp_min(0))
    return -((p / mass.clamp_min(1e-12)) * log_q).sum(-1)[rows].mean()


def minibatches(sequences: list[Sequence], batch_tokens: int) -> list[ChainBatch]:
    """Padded minibatches of sequences of similar length, built once (their order is shuffled per epoch)."""
    groups = length_groups([len(s.token_ids) for s in sequences], batch_tokens)
    return [ChainBatch.of([sequences[i] for i in group]) for group in groups]
