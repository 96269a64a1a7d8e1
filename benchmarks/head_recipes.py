"""Training recipes for a draft head, compared on one set of recorded data.

    python -m benchmarks.head_recipes --minutes 6 --data /tmp/recipes.pt \\
        --recipe large-batches:batch_tokens=4096 --recipe default --recipe lr2e-3:lr=0.002 \\
        --extra-prompts more.jsonl --recipe more-data:extra=1

The data phase of `specd train-draft` runs once (the target answers the shipped
prompts, its features and top-k are recorded) and is cached in `--data`; every
recipe then trains a fresh head from the same init for the same `--minutes`, so
the table compares recipes, not machines or draws. A recipe is `NAME` or
`NAME:key=value,...` with keys of `training.train.TrainConfig` (`lr`,
`batch_tokens`, `weight_decay`, `unroll`, `soft_targets`, ...; booleans as
true/false) and `extra=true`, which adds the answers to `--extra-prompts`
files to the training set. The cache remembers the model, dtype, seed and
extra prompt files it was recorded with and is refused for others. Every recipe is scored on
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
from training.pipeline import TrainDraftConfig
from training.prompts import read_prompt_files, shipped_prompt_files
from training.train import TrainConfig, train_head

EVAL_SETS = ("chat", "code", "creative")
# Set by the run, not by a recipe: the budget and seed are the same for every recipe, autocast follows
# the target's dtype, no curve is evaluated, and a fused head has no feature-regression target.
FIXED_KEYS = ("minutes", "seed", "bf16_autocast", "eval_every_minutes", "feature_loss")
TRAIN_KEYS = [f.name for f in fields(TrainConfig) if f.name not in FIXED_KEYS]
TRUE, FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def parse_value(recipe: str, key: str, value: str, default: object) -> object:
    """`value` as the type of the field's `default` (bool, int or float)."""
    if not value:
        raise ValueError(f"recipe {recipe!r}: {key} has no value")
    if isinstance(default, bool):
        if value.lower() not in TRUE + FALSE:
            raise ValueError(f"recipe {recipe!r}: {key} must be true or false, not {value!r}")
        return value.lower() in TRUE
    try:
        return int(value) if isinstance(default, int) else float(value)
    except ValueError:
        raise ValueError(f"recipe {recipe!r}: {key}={value!r} is not a number") from None


def parse_recipe(spec: str) -> tuple[str, dict, bool]:
    """`NAME[:key=value,...]` -> (name, TrainConfig overrides, whether the extra answers train too)."""
    name, _, rest = spec.partition(":")
    overrides: dict = {}
    extra = False
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key == "extra":
            extra = bool(parse_value(name, key, value, False))
        elif key in TRAIN_KEYS:
            default = getattr(TrainConfig(), key)
            overrides[key] = parse_value(name, key, value, 0.0 if default is None else default)
        else:
            raise ValueError(f"recipe {name!r}: unknown key {key!r} (one of extra, {', '.join(TRAIN_KEYS)})")
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


def cache_key(loaded: LoadedModel, extra_files: list[Path], seed: int) -> dict:
    return {"model": loaded.model_id, "dtype": str(loaded.dtype), "seed": seed,
            "extra_prompts": sorted(str(p.resolve()) for p in extra_files)}  # fmt: skip


def run_recipe(
    loaded: LoadedModel, data: dict, held_out: list[Sequence], train: list[Sequence], name: str, overrides: dict,
    extra: bool, minutes: float, k: int, seed: int = 0,
) -> dict:  # fmt: skip
    sequences = train + (data["extra"] if extra else [])
    size = min(TrainDraftConfig.draft_vocab, loaded.vocab_size)  # train-draft's default vocabulary
    draft_vocab = build_draft_vocab(sequences, size, loaded.vocab_size)
    torch.manual_seed(seed)  # the same init for every recipe
    head = new_head(loaded.model, draft_vocab, data["layers"])
    head.requires_grad_(True)
    config = replace(TrainConfig(minutes=minutes, seed=seed, bf16_autocast=loaded.dtype == torch.bfloat16), **overrides)
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
    key = cache_key(loaded, args.extra_prompts, args.seed)
    if args.data is not None and args.data.exists():
        data = torch.load(args.data, weights_only=False)
        if data.get("key") != key:
            raise SystemExit(f"{args.data} was recorded for {data.get('key')}, not {key}: remove it or pick another")
    else:
        started = time.perf_counter()
        data = {**record(loaded, layers, args.extra_prompts, args.seed), "key": key}
        print(f"recorded the data in {time.perf_counter() - started:.0f}s")
        if args.data is not None:
            torch.save(data, args.data)
    if any(extra for *_, extra in recipes) and not data["extra"]:
        raise SystemExit("a recipe asks for extra=true, but no --extra-prompts were given")
    train, held_out = split_held_out(data["shipped"], TrainDraftConfig.held_out, args.seed)
    rows = [
        run_recipe(loaded, data, held_out, train, name, overrides, extra, args.minutes, args.k, args.seed)
        for name, overrides, extra in recipes
    ]
    headers = ["recipe", "answer tokens", "steps", "held out", *EVAL_SETS, "benchmark, all"]
    print(f"\ndrafts accepted per verify at K = {args.k}, {args.minutes:g} minutes of training each ({loaded.dtype})\n")
    scores = ["held_out", *EVAL_SETS, "benchmark_all"]  # three decimals: recipes differ in the second
    print(
        table(headers, [[r["recipe"], r["answer_tokens"], r["steps"], *(f"{r[s]:.3f}" for s in scores)] for r in rows])
    )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
