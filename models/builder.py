"""Assemble a `ModelRunner` (target, proposer) from configs."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from models import paged_attention
from models.eagle_head import EagleHead, load_head
from models.forward import check_plain_logits
from models.kv_cache import KVCache
from models.loader import LoadedModel, ModelConfig, check_draft_compatible, load_model
from models.runner import ModelRunner, RunnerConfig
from scheduler.kv_blocks import blocks_for
from speculation.device_draft import DeviceProposer
from speculation.draft_model import DraftModelProposer
from speculation.eagle import EagleProposer
from speculation.proposers import NgramProposer, Proposer
from speculation.suffix import SuffixConfig, SuffixProposer

logger = logging.getLogger("specd.models")

PROPOSERS = ("ngram", "suffix", "draft_model", "eagle", "none")


@dataclass
class ProposerConfig:
    """`method` "ngram" (default without a draft model or head), "suffix", "draft_model", "eagle", or "none"."""

    method: str | None = None  # None: draft_model if `draft_model` is set, eagle if `draft_head`, else ngram
    draft_model: str | None = None
    ngram_min: int = 1
    ngram_max: int = 4
    suffix_cache_requests: int = SuffixConfig.cache_requests  # 0: per-request trees only
    draft_head: str | None = None  # an EAGLE head directory (`specd train-draft` makes one)
    # Beside a draft model or head: prompt lookup (n-gram) as a second source, per row.
    lookup: bool = True

    def __post_init__(self) -> None:
        if self.method is None:
            self.method = "draft_model" if self.draft_model else "eagle" if self.draft_head else "ngram"
        if self.method not in PROPOSERS:
            raise ValueError(f"--draft must be one of {', '.join(PROPOSERS)}, got {self.method!r}")
        if self.method == "draft_model" and not self.draft_model:
            raise ValueError("--draft draft_model needs --draft-model ID|PATH")
        if self.method == "eagle" and not self.draft_head:
            raise ValueError("--draft eagle needs --draft-head DIR")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("ngram sizes must satisfy 1 <= min <= max")


def _cpu_attention_in_use() -> str:
    """How the target, loaded before us, reads its KV on CPU; a draft model reads alike."""
    return "paged" if paged_attention.enabled() else "gather"


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
    draft: Proposer | DeviceProposer | None = None
    loaded_draft: LoadedModel | None = None
    extra_per_block = 0  # bytes a KV block costs a device proposer
    if proposer.method == "draft_model":
        draft_cfg = ModelConfig(
            model=str(proposer.draft_model),
            dtype=str(target.dtype).removeprefix("torch."),
            device=target.device.type,
            cache_dir=model.cache_dir if isinstance(model, ModelConfig) else None,
            tune_kernels=target.kernels.is_tuned,  # as the target was
            cpu_attention=model.cpu_attention if isinstance(model, ModelConfig) else _cpu_attention_in_use(),
        )
        loaded_draft = load_model(draft_cfg)
        check_draft_compatible(target, loaded_draft)
        extra_per_block = KVCache.bytes_per_block(loaded_draft.model.config, runner.block_size, loaded_draft.dtype)
    head: EagleHead | None = None
    if proposer.method == "eagle":
        check_plain_logits(target.model)
        head = load_head(Path(str(proposer.draft_head)), target.model)  # HeadMismatch: made for another model
        head.use_kernels(target.kernels)  # as the target computes
        extra_per_block = EagleProposer.bytes_per_block(head.config, runner.block_size, target.dtype)
    runner.num_kv_blocks = num_kv_blocks(runner, target, extra_per_block)
    if proposer.method == "ngram":
        draft = NgramProposer(proposer.ngram_min, proposer.ngram_max)
    elif proposer.method == "suffix":
        draft = SuffixProposer(SuffixConfig(cache_requests=proposer.suffix_cache_requests))
    elif loaded_draft is not None:
        draft = DraftModelProposer(loaded_draft, runner.num_kv_blocks, runner.block_size, target.vocab_size)
    elif head is not None:
        draft = EagleProposer(
            head, Path(str(proposer.draft_head)), runner.num_kv_blocks, runner.block_size, target.vocab_size
        )
        layers = head.config.feature_layers
        logger.info(
            "EAGLE head %s (draft vocabulary %d, features: %s)",
            proposer.draft_head,
            head.config.draft_vocab_size,
            f"layers {layers} fused" if layers else "last hidden state",
        )
    lookup = None
    if proposer.lookup and isinstance(draft, DeviceProposer):
        lookup = NgramProposer(proposer.ngram_min, proposer.ngram_max)
    return ModelRunner(target, runner, draft, lookup)


def num_kv_blocks(config: RunnerConfig, target: LoadedModel, extra_per_block: int = 0) -> int:
    """The KV pool's size in blocks, from `config` (see `RunnerConfig`). A device
    proposer keeps its own per-block state (a draft model's KV; a head's KV and
    features) in the same block layout: `extra_per_block` bytes more a block."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if config.kv_cache_memory is None:
        return blocks_for(config.max_num_seqs * config.max_model_len, config.block_size)
    per_block = KVCache.bytes_per_block(target.model.config, config.block_size, target.dtype) + extra_per_block
    budget = config.kv_cache_memory
    if budget <= 1:
        budget *= free_memory(target.device)
    blocks = int(budget // per_block)
    if blocks < 1:
        raise ValueError(f"--kv-cache-memory {config.kv_cache_memory:g} holds no KV block ({per_block} bytes each)")
    return blocks


def free_memory(device: torch.device) -> int:
    """Bytes the device can still give: CUDA's free memory, else the host's available RAM
    (MemAvailable: free plus what the page cache would give back)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
