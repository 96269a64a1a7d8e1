"""Training recipes for a draft head, compared on one set of recorded data.

    python -m benchmarks.head_recipes --minutes 6 --data /tmp/recipes.pt \\
        --recipe base --recipe lr2e-3:lr=0.002 --recipe small-batches:batch_tokens=2048 \\
        --extra-prompts more.jsonl --recipe more-data:batch_tokens=2048,extra=1

The data phase of `specd train-draft` runs once (the target answers the shipped
prompts, its features and top-k are recorded) and is cached in `--data`; every
recipe then trains a fresh head from the same init for the same `--minutes`, so
the table compares recipes, not machines or draws. A recipe is `NAME` or
`NAME:key=value,...` with keys of `training.train.TrainConfig` (`lr`,
`batch_tokens`, `weight_decay`, `unroll`, ...) and `extra=1`, which adds the
answers to `--extra-prompts` files to the training set. Every recipe is scored on
the same held-out tenth of the shipped prompts' answers and on the target's
answers to the benchmark's chat, code and creative prompts (never trained on):
drafts accepted per verify at K = `--k`, greedy chains as `training.evaluate`
simulates them.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import fields, replace
from pathlib import Path

import torch

from benchmarks.common import table
from benchmarks.draft_bench import PROMPT_SET_DIR
from models.eagle_head import fused_feature_layers, new_head
from models.kv_cache import text_config
from models.loader import LoadedModel, ModelConfig, load_model
from training.data import DataConfig, Sequence, build_draft_vocab, build_sequences, split_held_out
from training.evaluate import chain_acceptance
from training.prompts import read_prompt_files, shipped_prompt_files
from training.train import TrainConfig, train_head

EVAL_SETS = ("chat", "code", "creative")
TRAIN_KEYS = {f.name: f.type for f in fields(TrainConfig)}


def parse_recipe(spec: str) -> tuple[str, dict, bool]:
    """`NAME[:key=value,...]` -> (name, TrainConfig overrides, whether the extra answers train too)."""
    name, _, rest = spec.partition(":")
    overrides: dict = {}
    extra = False
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key == "extra":
            extra = value not in ("0", "false", "")
        elif key in TRAIN_KEYS and key not in ("minutes", "seed", "bf16_autocast"):
            current = getattr(TrainConfig(), key)
            overrides[key] = type(current)(value) if current is not None else float(value)
        else:
            raise ValueError(f"recipe {name!r}: unknown key {key!r}")
    return name, overrides, extra


def record(loaded: LoadedModel, layers: list[int], extra_files: list[Path], seed: int) -> dict:
    """The data every recipe trains and is scored on (as `specd train-draft` builds it, without a deadline)."""
    config = DataConfig(seed=seed)
    prompts = read_prompt_files(shipped_prompt_files())
    shipped = build_sequences(loaded, random.Random(seed).sample(prompts, len(prompts)), config, None, layers)
    extra = build_sequences(loaded, read_prompt_files(extra_files), config, None, layers) if extra_files else []
    evals = {
        name: build_sequences(loaded, read_prompt_files([PROMPT_SET_DIR / f"{name}.jsonl"]), config, None, layers)
        for name in EVAL_SETS
    }
    return {"shipped": shipped, "extra": extra, "eval": evals, "layers": layers}


def run_recipe(
    loaded: LoadedModel, data: dict, held_out: list[Sequence], train: list[Sequence], name: str, overrides: dict,
    extra: bool, minutes: float, k: int,
) -> dict:  # fmt: skip
    sequences = train + (data["extra"] if extra else [])
    draft_vocab = build_draft_vocab(sequences, min(8192, loaded.vocab_size), loaded.vocab_size)
    torch.manual_seed(0)
    head = new_head(loaded.model, draft_vocab, data["layers"])
    head.requires_grad_(True)
    config = replace(TrainConfig(minutes=minutes, bf16_autocast=loaded.dtype == torch.bfloat16), **overrides)
    result = train_head(head, sequences, config)
    row = {
        "recipe": name,
        "settings": {**overrides, "extra": extra},
        "answer_tokens": sum(s.num_answer_tokens for s in sequences),
        "steps": result.steps,
        "held_out": chain_acceptance(head, held_out, k).accepted_per_verify,
    }
    chains = accepted = 0.0
    for set_name, seqs in data["eval"].items():
        acc = chain_acceptance(head, seqs, k)
        row[set_name] = acc.accepted_per_verify
        chains += acc.num_chains
        accepted += acc.accepted_per_verify * acc.num_chains
    row["benchmark_all"] = accepted / chains if chains else 0.0
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", action="append", required=True, help="NAME[:key=value,...] (repeatable)")
    parser.add_argument("--minutes", type=float, default=6.0, help="training minutes per recipe")
    parser.add_argument("--data", type=Path, default=None, help="cache of the recorded data (made if missing)")
    parser.add_argument("--extra-prompts", type=Path, action="append", default=[], help="prompts for extra=1")
    parser.add_argument("--model", default=None, help="target (default: the bundled SmolLM2)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--k", type=int, default=4, help="chain length scored")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    recipes = [parse_recipe(spec) for spec in args.recipe]
    loaded = load_model(ModelConfig(model=args.model, dtype=args.dtype))
    layers = fused_feature_layers(text_config(loaded.model.config).num_hidden_layers)
    if args.data is not None and args.data.exists():
        data = torch.load(args.data, weights_only=False)
    else:
        started = time.perf_counter()
        data = record(loaded, layers, args.extra_prompts, args.seed)
        print(f"recorded the data in {time.perf_counter() - started:.0f}s")
        if args.data is not None:
            torch.save(data, args.data)
    if any(extra for *_, extra in recipes) and not data["extra"]:
        raise SystemExit("a recipe asks for extra=1, but the data holds no --extra-prompts answers")
    train, held_out = split_held_out(data["shipped"], 0.1, args.seed)
    rows = [
        run_recipe(loaded, data, held_out, train, name, overrides, extra, args.minutes, args.k)
        for name, overrides, extra in recipes
    ]
    headers = ["recipe", "answer tokens", "steps", "held out", *EVAL_SETS, "benchmark, all"]
    print(f"\ndrafts accepted per verify at K = {args.k}, {args.minutes:g} minutes of training each ({loaded.dtype})\n")
    cells = [[r["recipe"], r["answer_tokens"], r["steps"], r["held_out"], *(r[s] for s in EVAL_SETS)] for r in rows]
    print(table(headers, [row + [r["benchmark_all"]] for row, r in zip(cells, rows)]))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
