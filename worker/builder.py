"""Assemble a `ModelRunner`: the target, its proposer (by `speculation.registry` name), the KV pool."""

from __future__ import annotations

import logging
import os

import torch

from models import paged_attention
from models.kv_cache import KVCache
from models.loader import LoadedModel, ModelConfig, load_model
from scheduler.kv_blocks import blocks_for
from speculation import registry
from speculation.config import ProposerConfig
from speculation.proposer import BuildContext, Proposer
from worker.runner import ModelRunner, RunnerConfig

logger = logging.getLogger("specd.worker")


def loaded_as(model: ModelConfig | LoadedModel) -> ModelConfig:
    """How the target was loaded, for a draft model to load alike: its config, or for a model
    loaded elsewhere, what the loaded model says (its CPU attention: how the process reads KV now)."""
    if isinstance(model, ModelConfig):
        return model
    return ModelConfig(
        model=model.model_id,
        dtype=str(model.dtype).removeprefix("torch."),
        device=model.device.type,
        tune_kernels=model.kernels.is_tuned,
        cpu_attention="paged" if paged_attention.enabled() else "gather",
        weights=model.weights,
        batch_invariant=model.batch_invariant,
        keep_dense_weights=model.keep_dense_weights,
    )


def build_runner(model: ModelConfig | LoadedModel, runner: RunnerConfig, proposer: ProposerConfig) -> ModelRunner:
    target = model if isinstance(model, LoadedModel) else load_model(model)
    max_len = min(runner.max_model_len, target.max_position_embeddings)
    if max_len != runner.max_model_len:
        logger.info("max_model_len capped to the model's %d positions", max_len)
        runner.max_model_len = max_len
    assert proposer.method is not None  # resolved by ProposerConfig
    draft: Proposer | None = None
    lookup: Proposer | None = None
    if proposer.method != registry.NONE:
        context = BuildContext(target, loaded_as(model), proposer)
        draft = registry.get(proposer.method).load().build(context)
        if proposer.lookup and draft.capabilities.on_device:
            lookup = registry.LOOKUP.load().build(context)
    # A proposer's per-block state (a draft model's KV; a head's KV and features) shares the pool's budget.
    extra_per_block = draft.bytes_per_block(runner.block_size) if draft is not None else 0
    runner.num_kv_blocks = num_kv_blocks(runner, target, extra_per_block)
    if draft is not None:
        draft.allocate(runner.num_kv_blocks, runner.block_size)
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
