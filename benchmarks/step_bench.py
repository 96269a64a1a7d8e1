"""Engine step micro-benchmark: the cost of one `ModelRunner.execute` by batch shape.

    python -m benchmarks.engine_bench --section step --dtypes float32,bfloat16

Rows are built by hand (no scheduler), so each case is exactly the shape it
names; KV content is whatever the cache holds, which does not change the cost.
Every ratio is against a case measured in the same run:

- decode on each row's own run of blocks vs on blocks scattered over the pool
  (batch 1: a view of the pool vs a gather; batch 8: a gather either way);
- one 512-token prefill chunk + 7 decode rows vs the two parts run alone;
- a verify of 1 + 10 tokens vs transformers' own forward of 11 tokens over the
  same context (a `DynamicCache`, as `generate()` uses).

"Host transfers" counts host->device and device->host copies per step, as
`models.transfer` sees them (the only sanctioned crossing points). On CUDA,
"device syncs" counts what `torch.cuda.set_sync_debug_mode` reports during
one step: every operation that made the host wait for the GPU.
"""

from __future__ import annotations

import statistics
import time
import warnings
from dataclasses import dataclass

import torch

from benchmarks.common import table
from models.forward import cache_kwargs
from models.linear_kernels import STANDARD_ONLY, ModelKernels, install_model
from models.loader import LoadedModel
from models.transfer import TransferCounter
from scheduler.types import Batch, Request, RequestStatus, SamplingParams, ScheduledRow
from speculation.config import ProposerConfig
from tests.support.tensors import slot_table
from worker.builder import build_runner
from worker.runner import ModelRunner, RunnerConfig

NUM_SLOTS = 16
MAX_LEN = 2048
BLOCK_SIZE = 16


@dataclass
class StepCase:
    name: str
    rows: list[ScheduledRow]


def _request(rid: str, context: int, slot: int, vocab: int, prediction: int = 0, consecutive: bool = False) -> Request:
    g = torch.Generator().manual_seed(hash(rid) % 2**31)
    ids = torch.randint(10, vocab - 10, (context + 1 + prediction,), generator=g).tolist()
    request = Request(
        rid,
        ids[:context],
        SamplingParams(max_tokens=64, temperature=0, ignore_eos=True, speculation=True),
        prediction_ids=ids[context : context + 1 + prediction] if prediction else None,
    )
    # Sequence `slot` of the pool cut into NUM_SLOTS: its own run of blocks, or every NUM_SLOTS-th block.
    per_slot = MAX_LEN // BLOCK_SIZE
    table = (
        list(range(slot * per_slot, (slot + 1) * per_slot)) if consecutive else slot_table(slot, NUM_SLOTS, per_slot)
    )
    request.status, request.block_ids = RequestStatus.RUNNING, table
    return request


def decode_row(
    rid: str, context: int, slot: int, vocab: int, drafts: int = 0, consecutive: bool = False
) -> ScheduledRow:
    """A row past its prompt: one new token at position `context`, plus `drafts` verify tokens.
    Its blocks are scattered over the pool unless `consecutive`."""
    request = _request(rid, context, slot, vocab, prediction=drafts, consecutive=consecutive)
    last = request.prediction_ids[0] if drafts else 11
    request.output_ids = [last]
    request.num_computed_tokens = context
    return ScheduledRow(request, [last], context, sample=True, num_spec_tokens=drafts)


def prefill_row(rid: str, length: int, slot: int, vocab: int) -> ScheduledRow:
    request = _request(rid, length, slot, vocab)
    return ScheduledRow(request, request.prompt_ids, 0, sample=True)


def count_device_syncs(runner: ModelRunner, batch: Batch) -> int | None:
    """Synchronizing CUDA operations in one step (None off CUDA)."""
    if runner.device.type != "cuda":
        return None
    redraft(runner, batch)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            runner.execute(batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def time_step(runner: ModelRunner, rows: list[ScheduledRow], repeats: int) -> tuple[float, float, int | None]:
    """Median seconds of one step over `repeats` runs, host transfers and device syncs per step."""
    batch = Batch(rows=rows)
    execute_seconds(runner, batch)  # warm-up (allocations, kernel selection)
    counter = TransferCounter()
    redraft(runner, batch)
    with counter:
        runner.execute(batch)
    syncs = count_device_syncs(runner, batch)
    times = [execute_seconds(runner, batch) for _ in range(repeats)]
    return statistics.median(times), float(counter.total), syncs


def redraft(runner: ModelRunner, batch: Batch) -> None:
    """Drop the rows' host proposer state before `batch` runs again: a verify row's prediction is
    random, so once its drafts were rejected the prediction proposer would draft nothing more,
    and every later "verify" would be a decode."""
    runner.free([row.request_id for row in batch.rows])


def execute_seconds(runner: ModelRunner, batch: Batch) -> float:
    """One `execute` of `batch`, timed (the device drained before and after); its verify rows
    verify (`redraft`)."""
    redraft(runner, batch)
    _sync(runner.device)
    start = time.perf_counter()
    runner.execute(batch)
    _sync(runner.device)
    return time.perf_counter() - start


def seconds_with(target: LoadedModel, runner: ModelRunner, kernels: ModelKernels, batch: Batch) -> float:
    """One timed `execute` with the target's linear layers on `kernels`' layouts."""
    install_model(target.model, kernels)
    return execute_seconds(runner, batch)


@torch.inference_mode()
def time_hf_forward(model: LoadedModel, context: int, new: int, repeats: int) -> float:
    """transformers' own forward of `new` tokens over a cached `context`."""
    from transformers import DynamicCache

    vocab = model.vocab_size
    ids = torch.randint(10, vocab - 10, (1, context + new), device=model.device)
    own = model.model.config._attn_implementation
    model.model.set_attn_implementation("sdpa")  # transformers' default path, not ours
    try:
        cache = DynamicCache(config=model.model.config)
        model.model(input_ids=ids[:, :context], **cache_kwargs(model.model, cache), use_cache=True)
        times = []
        for i in range(repeats + 1):
            if i:
                cache.crop(-new)  # drop the last forward's tokens
            _sync(model.device)
            start = time.perf_counter()
            model.model(
                input_ids=ids[:, context:], **cache_kwargs(model.model, cache), use_cache=True, logits_to_keep=new
            )
            _sync(model.device)
            times.append(time.perf_counter() - start)
    finally:
        model.model.set_attn_implementation(own)
    return statistics.median(times[1:])


def step_section(target: LoadedModel, dtype: str, repeats: int = 7) -> tuple[str, list[dict]]:
    runner = build_runner(target, RunnerConfig(max_num_seqs=NUM_SLOTS, max_model_len=MAX_LEN), ProposerConfig("ngram"))
    vocab = target.vocab_size
    ctx = 300
    decode8_consecutive = [decode_row(f"o{i}", ctx, i, vocab, consecutive=True) for i in range(8)]
    decode8_scattered = [decode_row(f"c{i}", ctx, s, vocab) for i, s in enumerate([13, 2, 9, 4, 15, 6, 11, 0])]
    prefill = prefill_row("p", 512, 8, vocab)
    decode7 = [decode_row(f"m{i}", ctx, i, vocab) for i in range(7)]
    cases = [
        ("batch 1 decode (300 ctx)", [decode_row("d", ctx, 0, vocab, consecutive=True)]),
        ("batch 1 decode, scattered blocks", [decode_row("s", ctx, 0, vocab)]),
        ("batch 1 verify 1+10 (300 ctx)", [decode_row("v", ctx, 0, vocab, drafts=10)]),
        ("batch 8 decode, consecutive blocks", decode8_consecutive),
        ("batch 8 decode, scattered blocks", decode8_scattered),
        ("512-token prefill chunk alone", [prefill]),
        ("7 decode rows alone", decode7),
        ("512 prefill + 7 decode rows", decode7 + [prefill]),
        ("batch 16 decode (1k ctx)", [decode_row(f"k{i}", 1024, i, vocab) for i in range(16)]),
        ("batch 16 verify 1+4 (1k ctx)", [decode_row(f"w{i}", 1024, i, vocab, drafts=4) for i in range(16)]),
    ]
    measured = {name: time_step(runner, rows, repeats) for name, rows in cases}
    hf11 = time_hf_forward(target, ctx, 11, repeats)
    hf1 = time_hf_forward(target, ctx, 1, repeats)

    rows, records = [], []
    for name, (seconds, transfers, syncs) in measured.items():
        rows.append([name, seconds * 1e3, transfers, syncs])
        records.append(
            {"dtype": dtype, "case": name, "ms": seconds * 1e3, "host_transfers": transfers, "device_syncs": syncs}
        )
    rows.append(["HF forward 1 token (300 ctx)", hf1 * 1e3, None, None])
    rows.append(["HF forward 11 tokens (300 ctx)", hf11 * 1e3, None, None])
    ms = {name: s for name, (s, _, _) in measured.items()}
    ratios = [
        [
            "scattered / consecutive blocks (batch 1: gather / view)",
            ms["batch 1 decode, scattered blocks"] / ms["batch 1 decode (300 ctx)"],
            "-",
        ],
        [
            "scattered / consecutive blocks (batch 8: both gather)",
            ms["batch 8 decode, scattered blocks"] / ms["batch 8 decode, consecutive blocks"],
            "<= 1.05",
        ],
        [
            "mixed / (prefill alone + decode alone)",
            ms["512 prefill + 7 decode rows"] / (ms["512-token prefill chunk alone"] + ms["7 decode rows alone"]),
            "<= 1.0",
        ],
        ["verify 1+10 / HF forward 11", ms["batch 1 verify 1+10 (300 ctx)"] / hf11, "<= 1.0"],
        ["verify 1+10 / decode 1", ms["batch 1 verify 1+10 (300 ctx)"] / ms["batch 1 decode (300 ctx)"], "-"],
        ["decode 1 / HF forward 1", ms["batch 1 decode (300 ctx)"] / hf1, "-"],
    ]
    for name, value, _goal in ratios:
        records.append({"dtype": dtype, "ratio": name, "value": value})
    text = (
        f"### Step time ({dtype}, a pool of {NUM_SLOTS} x {MAX_LEN} tokens, median of {repeats})\n\n"
        + table(["case", "ms / step", "host transfers", "device syncs (CUDA)"], rows)
        + "\n\n"
        + table(["ratio", "value", "goal"], ratios)
    )
    return text, records


def kernel_section(target: LoadedModel, dtype: str, repeats: int = 7) -> tuple[str, list[dict]]:
    """Step time with the linear layers' tuned GEMM layouts against the standard x @ W^T
    (models/linear_kernels.py), the two alternating on one runner, median of `repeats` each."""
    runner = build_runner(target, RunnerConfig(max_num_seqs=NUM_SLOTS, max_model_len=MAX_LEN), ProposerConfig("ngram"))
    vocab, ctx = target.vocab_size, 300
    cases = [
        ("batch 1 decode", [decode_row("d", ctx, 0, vocab, consecutive=True)]),
        ("batch 1 verify 1+1", [decode_row("a", ctx, 0, vocab, drafts=1, consecutive=True)]),
        ("batch 1 verify 1+4", [decode_row("b", ctx, 0, vocab, drafts=4, consecutive=True)]),
        ("batch 1 verify 1+10", [decode_row("c", ctx, 0, vocab, drafts=10, consecutive=True)]),
        ("batch 4 decode", [decode_row(f"e{i}", ctx, i, vocab) for i in range(4)]),
        ("batch 4 verify 1+4", [decode_row(f"f{i}", ctx, i, vocab, drafts=4) for i in range(4)]),
        ("batch 16 decode", [decode_row(f"g{i}", ctx, i, vocab) for i in range(16)]),
        ("batch 16, 4 rows verify 1+4", [decode_row(f"h{i}", ctx, i, vocab, drafts=4 * (i < 4)) for i in range(16)]),
        ("batch 16 verify 1+4", [decode_row(f"i{i}", ctx, i, vocab, drafts=4) for i in range(16)]),
    ]
    tuned = target.kernels
    rows, records = [], []
    for name, case in cases:
        batch = Batch(rows=case)
        for kernels in (STANDARD_ONLY, tuned):  # warm-up (allocations, kernel selection)
            seconds_with(target, runner, kernels, batch)
        standard, chosen = [], []
        for _ in range(repeats):  # alternating, so drift on the machine hits both alike
            standard.append(seconds_with(target, runner, STANDARD_ONLY, batch))
            chosen.append(seconds_with(target, runner, tuned, batch))
        num_tokens = sum(len(r.token_ids) + r.num_spec_tokens for r in case)
        a, b = statistics.median(standard), statistics.median(chosen)
        rows.append([name, num_tokens, a * 1e3, b * 1e3, b / a])
        records.append(
            {"dtype": dtype, "case": name, "tokens": num_tokens, "standard_ms": a * 1e3, "tuned_ms": b * 1e3}
        )
    install_model(target.model, tuned)
    text = f"### Linear layouts ({dtype}, median of {repeats}; tuned: {tuned.describe()})\n\n" + table(
        ["case", "tokens", "ms x @ W^T", "ms tuned", "tuned / standard"], rows
    )
    return text, records


def profile_section(target: LoadedModel, dtype: str, steps: int = 20, top: int = 25) -> tuple[str, list[dict]]:
    """Where a step's time goes: `torch.profiler` over `steps` steps of batch-1 and batch-16 decode,
    the operators by self CPU time (host: Python, dispatch, kernel launches, syncs) and, on a GPU,
    by device time. A step far above its bandwidth floor on a GPU is host-bound; this says on what."""
    from torch.profiler import ProfilerActivity, profile

    runner = build_runner(target, RunnerConfig(max_num_seqs=NUM_SLOTS, max_model_len=MAX_LEN), ProposerConfig("ngram"))
    vocab, ctx = target.vocab_size, 300
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if runner.device.type == "cuda" else [])
    texts, records = [], []
    cases = [
        ("batch 1 decode", [decode_row("d", ctx, 0, vocab, consecutive=True)]),
        ("batch 16 decode", [decode_row(f"k{i}", ctx, i, vocab) for i in range(16)]),
    ]
    for name, rows in cases:
        batch = Batch(rows=rows)
        for _ in range(3):  # warm-up (allocations, kernel selection)
            runner.execute(batch)
        wall = statistics.median(execute_seconds(runner, batch) for _ in range(steps))
        with profile(activities=activities) as prof:
            for _ in range(steps):
                runner.execute(batch)
            _sync(runner.device)
        averages = prof.key_averages()
        by_cpu = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
        op_ms = sum(e.self_cpu_time_total for e in averages) / 1e3 / steps  # the rest is Python
        lines = [
            f"#### {name}: {wall * 1e3:.2f} ms per step unprofiled (median of {steps}); "
            f"operators' own host time {op_ms:.2f} ms per step (profiled)",
            "",
        ]
        lines.append(averages.table(sort_by="self_cpu_time_total", row_limit=top))
        if runner.device.type == "cuda":
            lines.append(averages.table(sort_by="self_device_time_total", row_limit=top // 2))
        texts.append("\n".join(lines))
        records.append(
            {
                "dtype": dtype,
                "case": name,
                "ms_per_step": wall * 1e3,
                "host_op_ms_per_step": op_ms,
                "ops": [
                    {
                        "name": e.key,
                        "calls_per_step": e.count / steps,
                        "self_cpu_ms_per_step": e.self_cpu_time_total / 1e3 / steps,
                        "self_device_ms_per_step": getattr(e, "self_device_time_total", 0) / 1e3 / steps,
                    }
                    for e in by_cpu
                ],
            }
        )
    return f"### Step profile ({dtype}, {runner.device})\n\n" + "\n\n".join(texts), records


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
