"""Assemble a `ModelRunner` (target, proposer) from configs."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from models.draft_model import DraftModelProposer
from models.loader import LoadedModel, ModelConfig, check_draft_compatible, load_model
from models.proposers import NgramProposer, Proposer
from models.runner import ModelRunner, RunnerConfig
from models.suffix import SuffixConfig, SuffixProposer

logger = logging.getLogger("specd.models")

PROPOSERS = ("ngram", "suffix", "draft_model", "none")


@dataclass
class ProposerConfig:
    """`method` "ngram" (default without a draft model), "suffix", "draft_model", or "none"."""

    method: str | None = None  # None: draft_model if `draft_model` is set, else ngram
    draft_model: str | None = None
    ngram_min: int = 1
    ngram_max: int = 4
    suffix_cache_requests: int = SuffixConfig.cache_requests  # 0: per-request trees only

    def __post_init__(self) -> None:
        if self.method is None:
            self.method = "draft_model" if self.draft_model else "ngram"
        if self.method not in PROPOSERS:
            raise ValueError(f"--draft must be one of {', '.join(PROPOSERS)}, got {self.method!r}")
        if self.method == "draft_model" and not self.draft_model:
            raise ValueError("--draft draft_model needs --draft-model ID|PATH")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("ngram sizes must satisfy 1 <= min <= max")


def build_runner(
    model: ModelConfig | LoadedModel,
    runner: RunnerConfig,
    proposer: ProposerConfig,
) -> ModelRunner:
    target = model if isinstance(model, LoadedModel) else load_model(model)
    max_len = min(runner.max_model_len, target.max_position_embeddings)
    if max_len != runner.max_model_len:
        logger.info("max_model_len capped to the model's %d positions", max_len)
        runner.max_model_len = max_len
    draft: Proposer | DraftModelProposer | None = None
    if proposer.method == "ngram":
        draft = NgramProposer(proposer.ngram_min, proposer.ngram_max)
    elif proposer.method == "suffix":
        draft = SuffixProposer(SuffixConfig(cache_requests=proposer.suffix_cache_requests))
    elif proposer.method == "draft_model":
        draft_cfg = ModelConfig(
            model=str(proposer.draft_model),
            dtype=str(target.dtype).removeprefix("torch."),
            device=target.device.type,
            cache_dir=model.cache_dir if isinstance(model, ModelConfig) else None,
        )
        loaded = load_model(draft_cfg)
        check_draft_compatible(target, loaded)
        draft = DraftModelProposer(loaded, runner.max_num_seqs, runner.max_model_len, target.vocab_size)
    return ModelRunner(target, runner, draft)
