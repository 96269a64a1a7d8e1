"""Training data from the target itself: its answers to prompts, and its features along them.

1. `generate_answers`: the target answers every prompt through specd's own engine
   (continuous batching, no speculation), greedy unless told otherwise.
2. `record_features`: one padded, batched forward per group of sequences keeps, at
   every position p, the target's states the head reads (its last hidden state h_p,
   post final norm: what its lm_head reads; or the fused layers' states side by side)
   and its own next token a_p = argmax logits(h_p), with its `TOP_K` likeliest tokens
   and their probabilities (the soft targets EAGLE trains on).
3. `build_draft_vocab`: the most frequent tokens of the training sequences.

Everything stays in memory (float32 features: SmolLM2-135M's 576 floats are 2.3 KB
a token, three fused layers 6.9 KB, so 50k tokens take 115 or 346 MB; the top-k
targets add 32 x 10 bytes: int64 ids, float16 probabilities).
"""

from __future__ import annotations

import logging
import random
import time
from collections import Counter
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from models.forward import captured_layers, side_by_side
from models.loader import LoadedModel
from scheduler.offline import Completion, run_offline
from scheduler.scheduler import SchedulerConfig
from scheduler.types import FinishReason, Request, SamplingParams
from speculation.config import ProposerConfig, SpecConfig
from training.prompts import TrainingPrompt
from worker.builder import build_runner
from worker.runner import RunnerConfig

logger = logging.getLogger("specd.training")

# The target's distribution is kept as its TOP_K likeliest tokens: the rest of the mass is
# spread thin over tens of thousands of tokens (SmolLM2's 32 likeliest hold 0.95 of it along
# its own answers, mean over positions) and costs 32 x 10 bytes a position instead of 100 KB.
TOP_K = 32


@dataclass
class DataConfig:
    max_tokens: int = 256  # answer length cap per prompt
    temperature: float = 0.0  # 0: the target's greedy answers (what greedy serving drafts against)
    # Answers generated at once (the KV pool holds this many full sequences): on a 2-core CPU in bf16,
    # 64 answer twice as fast as 16 (415 against 201 tok/s; 128: 473).
    max_num_seqs: int = 64
    record_batch_tokens: int = 2048  # padded tokens per feature-recording forward
    seed: int = 0


@dataclass
class Sequence:
    """One prompt and the target's answer, with what the target computed along it."""

    token_ids: torch.Tensor  # [L] prompt + answer
    prompt_len: int
    features: torch.Tensor  # [L, F] float32: h_p (F = H), or the fused layers' states (F = layers x H)
    target_next: torch.Tensor  # [L] the target's argmax at p: its token for position p + 1
    # [L, TOP_K] the target's likeliest tokens at p and their probabilities (float16), or None
    target_top_ids: torch.Tensor | None = None
    target_top_probs: torch.Tensor | None = None

    @property
    def num_answer_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len


def build_sequences(
    loaded: LoadedModel,
    prompts: list[TrainingPrompt],
    config: DataConfig,
    seconds: dict[str, float] | None = None,
    layers: list[int] | None = None,
    deadline: float | None = None,
) -> list[Sequence]:
    """Answer, then record (`layers`: as `record_features`): the whole data pipeline for one
    prompt set (`seconds` adds up each phase's time). Answering stops at `deadline`
    (`time.monotonic()`): answers cut short are kept as far as they got (a prefix of the
    target's answer is still its answer), prompts never reached are left out."""
    prompt_ids = [p.render(loaded.tokenizer) for p in prompts]
    limit = loaded.max_position_embeddings - config.max_tokens
    kept = [ids for ids in prompt_ids if 0 < len(ids) <= limit]
    if len(kept) < len(prompt_ids):
        logger.warning("skipped %d prompts longer than %d tokens", len(prompt_ids) - len(kept), limit)
    timings: dict[str, float] = {} if seconds is None else seconds
    started = time.perf_counter()
    answers = generate_answers(loaded, kept, config, deadline)
    answered = [(ids, answer) for ids, answer in zip(kept, answers) if answer is not None]
    recording = time.perf_counter()
    sequences = record_features(
        loaded, [ids for ids, _ in answered], [a for _, a in answered], config.record_batch_tokens, layers
    )
    timings["generate"] = timings.get("generate", 0.0) + recording - started
    timings["record"] = timings.get("record", 0.0) + time.perf_counter() - recording
    return sequences


def generate_answers(
    loaded: LoadedModel, prompt_ids: list[list[int]], config: DataConfig, deadline: float | None = None
) -> list[list[int] | None]:
    """The target's answer to each prompt, all submitted at once to specd's engine (those
    running at `deadline` cut where they are; None for those it never reached)."""
    if not prompt_ids:
        return []
    max_len = min(max(map(len, prompt_ids)) + config.max_tokens, loaded.max_position_embeddings)
    max_num_seqs = min(config.max_num_seqs, len(prompt_ids))
    runner = build_runner(
        loaded, RunnerConfig(max_num_seqs=max_num_seqs, max_model_len=max_len), ProposerConfig(method="none")
    )
    assert runner.config.num_kv_blocks is not None
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_model_len=runner.config.max_model_len,
        max_num_batched_tokens=max(512, max_num_seqs),
        eos_token_ids=loaded.eos_token_ids,
        num_kv_blocks=runner.config.num_kv_blocks,
        block_size=runner.config.block_size,
        spec=SpecConfig(num_speculative_tokens=0),
    )
    requests = [
        Request(
            f"train-{i}",
            ids,
            SamplingParams(
                max_tokens=config.max_tokens,
                temperature=config.temperature,
                seed=config.seed + i,
                speculation=False,
            ),
        )
        for i, ids in enumerate(prompt_ids)
    ]
    started = time.perf_counter()
    with tqdm(total=len(requests), desc="generate", unit="answer") as bar:

        def done(completion: Completion) -> None:
            bar.update(1)
            if completion.error:
                logger.warning("answer %s failed: %s", completion.request_id, completion.error)

        completions = run_offline(runner, scheduler_config, requests, on_finished=done, deadline=deadline)
    del runner  # its KV pool
    num_tokens = sum(len(c.token_ids) for c in completions)
    seconds = time.perf_counter() - started
    logger.info("generated %d answer tokens in %.0fs (%.0f tok/s)", num_tokens, seconds, num_tokens / seconds)
    cut = [c for c in completions if c.finish_reason == FinishReason.ABORT]
    if cut:
        logger.warning(
            "answering stopped at its time budget: %d of %d answers cut short (kept as far as they got), "
            "%d prompts not reached",
            sum(1 for c in cut if c.token_ids),
            len(completions),
            sum(1 for c in cut if not c.token_ids),
        )
    return [None if c.finish_reason == FinishReason.ABORT and not c.token_ids else c.token_ids for c in completions]


@torch.inference_mode()
def record_features(
    loaded: LoadedModel,
    prompt_ids: list[list[int]],
    answers: list[list[int]],
    batch_tokens: int = 2048,
    layers: list[int] | None = None,
) -> list[Sequence]:
    """The features, a_p and the target's top-k at every position of every prompt + answer (answers
    may be empty): h_p, or with `layers` (indices into the model's `hidden_states`) those states
    side by side."""
    model = loaded.model
    # The runner switched the model to specd's paged attention; a plain padded batch needs SDPA.
    model.set_attn_implementation("sdpa")
    base, lm_head = model.get_decoder(), model.get_output_embeddings()
    token_ids = [torch.tensor(p + a, dtype=torch.long) for p, a in zip(prompt_ids, answers)]
    sequences: list[Sequence | None] = [None] * len(token_ids)
    started = time.perf_counter()
    with tqdm(total=sum(map(len, token_ids)), desc="record", unit="tok") as bar:
        for group in length_groups([len(t) for t in token_ids], batch_tokens):
            longest = max(len(token_ids[i]) for i in group)
            ids = torch.full((len(group), longest), loaded.tokenizer.pad_token_id or 0, dtype=torch.long)
            mask = torch.zeros((len(group), longest), dtype=torch.long)
            for row, i in enumerate(group):
                ids[row, : len(token_ids[i])] = token_ids[i]
                mask[row, : len(token_ids[i])] = 1
            with captured_layers(base, layers or ()) as captured:
                hidden = base(input_ids=ids.to(loaded.device), attention_mask=mask.to(loaded.device)).last_hidden_state
            states = side_by_side(captured, hidden, layers) if layers else hidden
            for row, i in enumerate(group):
                length = len(token_ids[i])
                top_ids, top_probs = top_k_next(lm_head, hidden[row, :length])
                sequences[i] = Sequence(
                    token_ids=token_ids[i],
                    prompt_len=len(prompt_ids[i]),
                    features=states[row, :length].float().cpu(),
                    target_next=top_ids[:, 0].cpu(),  # the argmax
                    target_top_ids=top_ids.cpu(),
                    target_top_probs=top_probs.half().cpu(),
                )
                bar.update(length)
    logger.info("recorded features of %d tokens in %.0fs", sum(map(len, token_ids)), time.perf_counter() - started)
    return [s for s in sequences if s is not None]


def top_k_next(lm_head: torch.nn.Module, hidden: torch.Tensor, rows: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """[L, H] -> the target's `TOP_K` likeliest next tokens at each position, [L, k] ids (best first)
    and their probabilities. Computed `rows` positions at a time and without a softmax over the
    vocabulary: p = exp(logit - logsumexp), so only [rows, vocab] float32 logits exist at once
    (cache-sized; a whole sequence's float copy cost more than the lm_head itself on a CPU)."""
    ids, probs = [], []
    for start in range(0, hidden.shape[0], rows):
        logits = lm_head(hidden[start : start + rows]).float()
        values, top = logits.topk(min(TOP_K, logits.shape[-1]), dim=-1)
        probs.append((values - logits.logsumexp(-1, keepdim=True)).exp())
        ids.append(top)
    return torch.cat(ids), torch.cat(probs)


def length_groups(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Indices in order of length, cut into groups whose padded size (rows x longest) stays within
    `batch_tokens` (a longer sequence is a group of its own): similar lengths pad little."""
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if groups and lengths[i] * (len(groups[-1]) + 1) <= batch_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def split_held_out(sequences: list[Sequence], fraction: float, seed: int) -> tuple[list[Sequence], list[Sequence]]:
    """(train, held out): a seeded `fraction` of whole sequences is never trained on."""
    shuffled = list(sequences)
    random.Random(seed).shuffle(shuffled)
    num_held = round(len(shuffled) * fraction) if len(shuffled) > 1 else 0
    if fraction > 0 and len(shuffled) > 1:
        num_held = max(1, num_held)
    return shuffled[num_held:], shuffled[:num_held]


def build_draft_vocab(sequences: list[Sequence], size: int, vocab_size: int) -> torch.Tensor:
    """The `size` most frequent tokens of the sequences and of the target's next tokens along them
    (ties and any room left go by id, so it is deterministic), at most the whole vocabulary."""
    counts: Counter[int] = Counter()
    for s in sequences:
        counts.update(s.token_ids.tolist())
        counts.update(s.target_next.tolist())
    ranked = sorted(counts, key=lambda t: (-counts[t], t))[:size]
    if len(ranked) < size:  # fewer distinct tokens than asked: fill with unseen ids
        seen = set(ranked)
        ranked += [t for t in range(vocab_size) if t not in seen][: size - len(ranked)]
    return torch.tensor(ranked, dtype=torch.long)


def coverage(sequences: list[Sequence], draft_vocab: torch.Tensor, vocab_size: int) -> float:
    """Share of the target's next tokens (the ones a head is trained on) inside the draft vocabulary:
    a ceiling on the head's top-1 accuracy."""
    inside = torch.zeros(vocab_size, dtype=torch.bool)
    inside[draft_vocab] = True
    hits = total = 0
    for s in sequences:
        targets = s.target_next[1:]  # position 0 has no head input before it
        hits += int(inside[targets].sum())
        total += len(targets)
    return hits / total if total else 0.0
