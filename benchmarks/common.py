"""Shared benchmark plumbing: model loading, chat prompts, engine runs, tables."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from models.loader import LoadedModel, ModelConfig, load_model
from scheduler.offline import run_offline
from scheduler.scheduler import SchedulerConfig
from scheduler.types import Request, SamplingParams
from speculation.config import ProposerConfig, SpecConfig
from worker.builder import build_runner
from worker.runner import RunnerConfig


@dataclass
class RunResult:
    name: str
    num_tokens: int
    seconds: float
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_steps: int = 0

    @property
    def tokens_per_second(self) -> float:
        return self.num_tokens / self.seconds

    @property
    def acceptance(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None


def chat_ids(target: LoadedModel, prompt: str) -> list[int]:
    ids = target.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    return ids if isinstance(ids, list) else ids["input_ids"]


def load(dtype: str, model: str | None = None, device: str = "cpu") -> LoadedModel:
    return load_model(ModelConfig(model, dtype=dtype, device=device))


def engine_run(
    target: LoadedModel,
    prompts: list[list[int]],
    max_tokens: int,
    method: str = "none",
    draft: str | None = None,
    draft_head: str | None = None,
    speculation="auto",
    k: int = 4,
    threshold: int | None = None,
    name: str = "",
    runner=None,
) -> RunResult:
    """Greedy, ignore_eos: every request emits exactly max_tokens."""
    max_len = max(len(p) for p in prompts) + max_tokens + 8
    slots = max(len(prompts), 1)
    if runner is None:
        runner = build_runner(
            target,
            RunnerConfig(max_num_seqs=slots, max_model_len=max_len),
            ProposerConfig(method, draft, draft_head=draft_head),
        )
    config = SchedulerConfig(
        max_num_seqs=slots,
        max_model_len=max_len,
        max_num_batched_tokens=max(2048, slots * 32),
        eos_token_ids=target.eos_token_ids,
        spec=SpecConfig(num_speculative_tokens=k, spec_disable_batch_size=threshold),
    )
    requests = [
        Request(
            f"b{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, speculation=speculation)
        )
        for i, p in enumerate(prompts)
    ]
    start = time.perf_counter()
    done = run_offline(runner, config, requests)
    seconds = time.perf_counter() - start
    return RunResult(
        name,
        sum(len(c.token_ids) for c in done),
        seconds,
        sum(c.num_draft_tokens for c in done),
        sum(c.num_accepted_tokens for c in done),
        sum(c.num_chunks for c in done),
    )


@torch.inference_mode()
def hf_run(reference: LoadedModel, prompts: list[list[int]], max_tokens: int, name: str, **generate) -> RunResult:
    """HF generate() on a batch (left-padded), greedy, no early stop."""
    tok = reference.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else reference.eos_token_ids[0]
    width = max(len(p) for p in prompts)
    device = reference.device
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    _sync(device)
    start = time.perf_counter()
    out = reference.model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        do_sample=False,
        pad_token_id=pad,
        **generate,
    )
    _sync(device)
    seconds = time.perf_counter() - start
    return RunResult(name, (out.shape[1] - width) * len(prompts), seconds)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def table(headers: list[str], rows: list[list]) -> str:
    def fmt(v):
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.2f}"
        return str(v)

    cells = [[fmt(v) for v in row] for row in rows]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    return "\n".join(lines)
