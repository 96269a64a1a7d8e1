"""`specd train-draft`, end to end: prompts -> the target's answers and features -> a trained head.

load the target -> generate its answers (specd's engine) -> record its features and a along them
-> hold out a share of the sequences -> draft vocabulary from the rest -> train
-> held-out (and --eval-prompts) acceptance -> save_head, with the record in its config
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from models.eagle_head import fused_feature_layers, new_head, save_head
from models.kv_cache import text_config
from models.loader import ModelConfig, load_model
from training.data import DataConfig, Sequence, build_draft_vocab, build_sequences, coverage, split_held_out
from training.evaluate import chain_acceptance
from training.prompts import SHIPPED_DIR, TrainingPrompt, read_prompt_files, shipped_prompt_files
from training.train import TrainConfig, train_head

logger = logging.getLogger("specd.training")


FEATURES = ("fused", "last")
# Answers (the target decoding) may take this share of the whole-run budget. Recording features
# costs about a third of answering (one forward per sequence instead of one per token, at 2.8x the
# tokens per second here) and training gets the rest, so a slow machine answers fewer prompts
# instead of running over; a fast one answers them all and trains longer.
ANSWER_SHARE = 0.5
# Training gets at least this share of the budget, whatever the data phases took.
MIN_TRAIN_SHARE = 0.2


@dataclass
class TrainDraftConfig:
    model: ModelConfig
    out: Path
    prompt_files: list[Path] = field(default_factory=list)  # the user's own, besides the shipped set
    shipped_prompts: bool = True
    eval_prompt_files: list[Path] = field(default_factory=list)  # evaluated on, never trained on
    draft_vocab: int = 8192
    features: str = "fused"  # fused: a low, a middle and a high layer (EAGLE-3); last: the last hidden state
    held_out: float = 0.1  # share of sequences kept out of training, for the held-out numbers
    eval_k: int = 4  # chain length the acceptance is simulated at
    # The whole run's budget: answering stops at ANSWER_SHARE of it, and training (unless
    # `train.minutes` is set) gets what the data phases leave.
    total_minutes: float = 20.0
    threads: int | None = None  # torch intra-op threads; None: torch's default (the physical cores)
    data: DataConfig = field(default_factory=DataConfig)
    # minutes=None: training gets what `total_minutes` leaves, as `specd train-draft` does by default
    train: TrainConfig = field(default_factory=lambda: TrainConfig(minutes=None))

    def __post_init__(self) -> None:
        if not self.shipped_prompts and not self.prompt_files:
            raise ValueError("no training prompts: give --prompts FILE or keep the shipped set")
        if self.features not in FEATURES:
            raise ValueError(f"--features must be one of {', '.join(FEATURES)}; got {self.features!r}")
        if self.train.feature_loss and self.features != "last":
            raise ValueError("--feature-loss needs --features last (fused features have no regression target)")
        if self.draft_vocab < 1:
            raise ValueError("--draft-vocab must be >= 1")
        if not 0 <= self.held_out < 1:
            raise ValueError("--held-out must be in [0, 1)")
        if self.train.unroll < 1 or self.eval_k < 1:
            raise ValueError("--unroll and the evaluated chain length must be >= 1")
        if self.total_minutes <= 0:
            raise ValueError("--total-minutes must be > 0")
        if self.train.minutes is not None and self.train.minutes <= 0:
            raise ValueError("--minutes must be > 0")


def train_draft(config: TrainDraftConfig, started: float | None = None) -> dict:
    """Run everything; returns the training record also stored in the head's config.
    `total_minutes` counts from `started` (a `time.monotonic()` value; default: now), so a
    caller that starts the clock before importing torch keeps the whole command in budget."""
    if config.threads:
        torch.set_num_threads(config.threads)
    phases: dict[str, float] = {}
    clock = time.perf_counter()
    end_of_budget = (time.monotonic() if started is None else started) + config.total_minutes * 60

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        phases[name] = round((now - clock) / 60, 2)
        clock = now

    files = (shipped_prompt_files() if config.shipped_prompts else []) + list(config.prompt_files)
    prompts = read_prompt_files(files)  # before the model loads: a bad file fails at once
    eval_prompts = {prompt_file_label(path): read_prompt_files([path]) for path in config.eval_prompt_files}
    logger.info("%d training prompts from %d files", len(prompts), len(files))
    loaded = load_model(config.model)
    lap("load")
    num_layers = text_config(loaded.model.config).num_hidden_layers
    layers = fused_feature_layers(num_layers) if config.features == "fused" else None
    seconds: dict[str, float] = {}  # generate / record, over every prompt set
    # In a seeded random order: answers cut at the deadline leave a sample of every prompt file.
    shuffled = random.Random(config.data.seed).sample(prompts, len(prompts))
    deadline = end_of_budget - (1 - ANSWER_SHARE) * config.total_minutes * 60
    sequences = build_sequences(loaded, shuffled, config.data, seconds, layers, deadline)
    eval_sets = {name: build_sequences(loaded, ps, config.data, seconds, layers) for name, ps in eval_prompts.items()}
    phases.update({name: round(value / 60, 2) for name, value in seconds.items()})
    clock = time.perf_counter()
    train_set, held_out = split_held_out(sequences, config.held_out, config.data.seed)
    vocab_size = loaded.vocab_size
    draft_vocab = build_draft_vocab(train_set, min(config.draft_vocab, vocab_size), vocab_size)
    torch.manual_seed(config.train.seed)  # the head's initial weights
    head = new_head(loaded.model, draft_vocab, layers)
    head.requires_grad_(True)
    logger.info(
        "draft vocabulary: %d tokens, covering %.1f%% of the target's next tokens (held out: %.1f%%)",
        len(draft_vocab),
        100 * coverage(train_set, draft_vocab, vocab_size),
        100 * coverage(held_out, draft_vocab, vocab_size),
    )

    def evaluate() -> dict:
        return chain_acceptance(head, held_out, config.eval_k).as_record() if held_out else {}

    # bf16 matmuls where the target runs in bf16 (`--dtype auto` picks it only where the machine
    # has them natively): 1.5x the steps in the same minutes on an avx512_bf16 CPU.
    minutes = _training_minutes(config, end_of_budget - time.monotonic())
    train_config = replace(config.train, minutes=minutes, bf16_autocast=loaded.dtype == torch.bfloat16)
    result = train_head(head, train_set, train_config, evaluate)
    lap("train")
    record = {
        "target_model": loaded.model_id,
        "data": _data_record(files, prompts, train_set, held_out, config),
        "draft_vocab": {
            "size": len(draft_vocab),
            "coverage_train": round(coverage(train_set, draft_vocab, vocab_size), 4),
            "coverage_held_out": round(coverage(held_out, draft_vocab, vocab_size), 4),
        },
        "training": {
            **asdict(train_config),
            "steps": result.steps,
            "epochs_done": result.epochs,
            "minutes": result.minutes,
            "final_loss": result.final_loss,
            "final_top1": result.final_top1,
            "threads": torch.get_num_threads(),
            "budget_minutes": round(minutes, 2),
            "total_minutes": config.total_minutes,
        },
        "held_out": result.curve[-1] if result.curve else {},
        "held_out_curve": result.curve,
        "eval_prompts": {
            name: chain_acceptance(head, seqs, config.eval_k).as_record() for name, seqs in eval_sets.items()
        },
        "eval_k": config.eval_k,
    }
    lap("evaluate")
    record["phase_minutes"] = phases
    head.config.training = record
    save_head(head, config.out)  # bfloat16 weights; load_head casts them to the target's dtype
    logger.info("saved the head to %s: %s", config.out, _summary(record))
    return record


def _training_minutes(config: TrainDraftConfig, seconds_left: float) -> float:
    """`--minutes` if given, else what the whole-run budget has left (at least its MIN_TRAIN_SHARE)."""
    if config.train.minutes is not None:
        return config.train.minutes
    floor = MIN_TRAIN_SHARE * config.total_minutes
    minutes = max(seconds_left / 60, floor)
    if seconds_left / 60 < floor:
        logger.warning(
            "the data phases left %.1f of the %g-minute budget; training takes %.1f minutes anyway "
            "(fewer prompts or a lower --max-tokens keep a run within it)",
            max(seconds_left / 60, 0.0),
            config.total_minutes,
            minutes,
        )
    else:
        logger.info("training for %.1f minutes: what the %g-minute budget leaves", minutes, config.total_minutes)
    return minutes


def prompt_file_label(path: Path) -> str:
    """How a head's record names a prompt file: the shipped set by its place in specd, any other by
    its base name. A head gets shared, and an absolute path tells others about this machine
    (user names, directory layout)."""
    path = Path(path)
    return f"specd:training/prompts/{path.name}" if path.parent == SHIPPED_DIR else path.name


def _data_record(
    files: list[Path],
    prompts: list[TrainingPrompt],
    train_set: list[Sequence],
    held_out: list[Sequence],
    config: TrainDraftConfig,
) -> dict:
    return {
        "prompt_files": [prompt_file_label(f) for f in files],
        "prompts": len(prompts),
        "prompts_answered": len(train_set) + len(held_out),  # within the answering budget
        "sequences_train": len(train_set),
        "sequences_held_out": len(held_out),
        "tokens_train": sum(len(s.token_ids) for s in train_set),
        "answer_tokens_train": sum(s.num_answer_tokens for s in train_set),
        "answer_tokens_held_out": sum(s.num_answer_tokens for s in held_out),
        "max_tokens": config.data.max_tokens,
        "temperature": config.data.temperature,
        "seed": config.data.seed,
    }


def _summary(record: dict) -> str:
    held = record.get("held_out") or {}
    per_position = ", ".join(f"{p:.2f}" for p in held.get("per_position", []))
    return (
        f"held-out acceptance per draft position [{per_position}], "
        f"{held.get('accepted_per_verify', 0):.2f} drafts accepted per verify at K={record['eval_k']}"
    )
