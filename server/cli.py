"""`specd serve` (the HTTP server), `specd generate "prompt"` (one completion, no server) and
`specd train-draft` (train an EAGLE-style draft head for a model; the work is in `training/`).

Flags are generated from `server.config.Settings`, so every flag has an
environment variable (`SPECD_<NAME>`) and a YAML key, and its `--help` text
is the setting's description. Only flags given on the command line override
the environment and the config file.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import signal
import sys
import time
import types
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import SecretStr, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from scheduler.types import SpeculationMode
from server import IMPORTED_AT
from server.config import CONFIG_ENV, ENV_PREFIX, ChoicesFrom, Settings, is_hidden, load_settings
from server.http_protocol import protocol_class
from server.models_cli import add_models_parser, models_command

SPECULATION_CHOICES: dict[str, SpeculationMode] = {"auto": "auto", "true": True, "false": False}

logger = logging.getLogger("specd.server")

# Settings that `generate` shares with `serve`.
GENERATE_SETTINGS = (
    "model", "draft", "draft_model", "draft_head", "num_speculative_tokens", "dtype", "device", "cache_dir",
    "max_model_len", "revision", "trust_remote_code", "log_level", "weights", "draft_weights",
)  # fmt: skip
# Settings that `train-draft` shares with `serve`: which target, loaded how.
TRAIN_DRAFT_SETTINGS = (
    "model", "dtype", "device", "cache_dir", "revision", "trust_remote_code", "tune_kernels", "cpu_attention",
    "batch_invariant", "log_level", "weights",
)  # fmt: skip


def _flag_type(annotation: Any) -> dict[str, Any]:
    """argparse keywords for a settings field's type."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    if annotation is bool:
        return {"action": argparse.BooleanOptionalAction}
    if typing.get_origin(annotation) is Literal:
        return {"choices": typing.get_args(annotation), "metavar": "{" + ",".join(typing.get_args(annotation)) + "}"}
    if annotation in (int, float):
        return {"type": annotation}
    if typing.get_origin(annotation) is list:
        return {"type": str, "metavar": "A,B"}
    return {"type": str}  # str, Path, SecretStr: pydantic converts


def _default_text(name: str, field: FieldInfo) -> str:
    if field.annotation is SecretStr or name == "api_key":
        return "none"
    default = field.get_default(call_default_factory=True) if field.default is PydanticUndefined else field.default
    if default in (None, []):
        return "none"
    return str(default).lower() if isinstance(default, bool) else str(default)


def add_settings_flags(parser: argparse.ArgumentParser, names: typing.Iterable[str]) -> None:
    for name in names:
        field = Settings.model_fields[name]
        env = ENV_PREFIX + name.upper()
        default = "" if "default" in (field.description or "") else f"; default: {_default_text(name, field)}"
        help_text = argparse.SUPPRESS if is_hidden(field) else f"{field.description} [env {env}{default}]"
        parser.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            default=argparse.SUPPRESS,
            help=help_text,
            **_flag_type(field.annotation),
            **_choices(field),
        )


def _choices(field: FieldInfo) -> dict[str, Any]:
    """Choices computed when the parser is built (a `ChoicesFrom` field)."""
    for marker in field.metadata:
        if isinstance(marker, ChoicesFrom):
            values = marker.values()
            return {"choices": values, "metavar": "{" + ",".join(values) + "}"}
    return {}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specd", description="OpenAI-compatible LLM server with batched, lossless speculative decoding."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="{serve,generate,models,train-draft}")
    config_help = f"YAML file of settings, keys named as the flags ('-' or '_') [env {CONFIG_ENV}]"

    serve = commands.add_parser(
        "serve", help="run the HTTP server", description="Run the OpenAI-compatible HTTP server."
    )
    serve.add_argument("--config", default=None, help=config_help)
    add_settings_flags(serve, Settings.model_fields)

    generate = commands.add_parser(
        "generate", help="complete one prompt and print it (no server)", description="Complete one prompt and print it."
    )
    generate.add_argument("prompt", help="the prompt; chat models get it as one user message (see --raw)")
    generate.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate [default: 128]")
    generate.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy [default: 0]"
    )
    generate.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling probability mass [default: 1]")
    generate.add_argument("--seed", type=int, default=None, help="sampling seed [default: random]")
    generate.add_argument(
        "--speculation",
        choices=("auto", "true", "false"),
        default="auto",
        help="speculate for this prompt [default: auto]",
    )
    generate.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    generate.add_argument("--config", default=None, help=config_help)
    add_settings_flags(generate, GENERATE_SETTINGS)
    add_models_parser(commands)
    add_train_draft_parser(commands, config_help)
    return parser


def add_train_draft_parser(commands, config_help: str) -> None:
    train = commands.add_parser(
        "train-draft",
        help="train an EAGLE-style draft head for a model on this machine",
        description="Train an EAGLE-style draft head: the target answers a prompt set (the shipped one, plus "
        "--prompts), its features along the answers are recorded, and a one-layer head learns to predict "
        "its next features and tokens. Held-out acceptance is reported and stored with the head.",
    )
    train.add_argument("--out", required=True, type=Path, help="directory to write the head to (created)")
    train.add_argument(
        "--prompts",
        action="append",
        type=Path,
        default=[],
        metavar="FILE.jsonl",
        help='your own prompts, besides the shipped set (repeatable): JSON lines of {"prompt": ...}, '
        '{"messages": [...]} or `specd serve --record-traffic` records',
    )
    train.add_argument(
        "--shipped-prompts",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also train on the prompt set shipped with specd [default: true]",
    )
    train.add_argument(
        "--eval-prompts",
        action="append",
        type=Path,
        default=[],
        metavar="FILE.jsonl",
        help="prompt files to report acceptance on, never trained on (repeatable), "
        "e.g. benchmarks/prompt_sets/chat.jsonl",
    )
    train.add_argument(
        "--total-minutes",
        type=float,
        default=20.0,
        help="the whole run's time budget, from the command's start to the saved head: answering the prompts "
        "stops at half of it (answers cut short are kept as far as they got), and training gets what loading, "
        "answering and recording leave, its final evaluation included [default: 20]",
    )
    train.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="training time budget, evaluations included, instead of what --total-minutes leaves "
        "[default: what it leaves]",
    )
    train.add_argument(
        "--epochs",
        type=float,
        default=None,
        help="stop after this many passes over the data, if sooner; makes the run deterministic with --seed "
        "[default: none]",
    )
    train.add_argument("--max-tokens", type=int, default=256, help="answer length cap per prompt [default: 256]")
    train.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature of the answers; 0 is greedy [default: 0]"
    )
    train.add_argument(
        "--draft-vocab", type=int, default=8192, help="tokens the head can draft (the most frequent) [default: 8192]"
    )
    train.add_argument(
        "--features",
        choices=("fused", "last"),
        default="fused",
        help="what the head reads of the target: fused = a low, a middle and a high layer's states (EAGLE-3); "
        "last = the last hidden state (EAGLE-1) [default: fused]",
    )
    train.add_argument(
        "--feature-loss",
        type=float,
        default=0.0,
        help="weight of EAGLE-1's regression of the next hidden state besides the token loss "
        "(--features last only) [default: 0]",
    )
    train.add_argument(
        "--targets",
        choices=("soft", "argmax"),
        default="soft",
        help="what the head learns to predict: soft = the target's distribution (its 32 likeliest tokens, "
        "as EAGLE trains); argmax = its greedy token alone [default: soft]",
    )
    train.add_argument(
        "--held-out", type=float, default=0.1, help="share of the answers kept out of training [default: 0.1]"
    )
    train.add_argument(
        "--unroll", type=int, default=2, help="chained steps trained per position; 1 is a single step [default: 2]"
    )
    train.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (AdamW) [default: 0.001]")
    train.add_argument(
        "--batch-tokens", type=int, default=2048, help="padded tokens per training minibatch [default: 2048]"
    )
    train.add_argument("--max-num-seqs", type=int, default=64, help="answers generated at once [default: 64]")
    train.add_argument("--threads", type=int, default=None, help="torch CPU threads [default: torch's]")
    train.add_argument("--seed", type=int, default=0, help="seeds answers, the split, init and order [default: 0]")
    train.add_argument("--config", default=None, help=config_help)
    add_settings_flags(train, TRAIN_DRAFT_SETTINGS)


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )


def _settings(args: argparse.Namespace, names: typing.Iterable[str], **defaults: Any) -> Settings | None:
    overrides = {**defaults, **{name: getattr(args, name) for name in names if hasattr(args, name)}}
    try:
        return load_settings(overrides, args.config)
    except ValidationError as exc:
        for error in exc.errors():
            flag = "--" + "-".join(str(p) for p in error["loc"]).replace("_", "-") if error["loc"] else "settings"
            print(f"specd: error: {flag}: {error['msg']}", file=sys.stderr)
    except ValueError as exc:
        print(f"specd: error: {exc}", file=sys.stderr)
    return None


# -- serve -------------------------------------------------------------------------


def serve(args: argparse.Namespace) -> int:
    settings = _settings(args, Settings.model_fields)
    if settings is None:
        return 2
    try:
        settings.check_exposure()
    except ValueError as exc:
        print(f"specd: error: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level)
    if getattr(args, "api_key", None) is not None:
        logger.warning(
            "--api-key on the command line shows in the process list (ps, /proc); "
            "prefer SPECD_API_KEY or an --api-keys file (mode 600)"
        )
    import uvicorn

    from server.app import create_app
    from server.auth import CredentialsError
    from server.zmq_curve import CurveError

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            app.state.specd.draining = True  # new requests get 503 while running ones finish
            super().handle_exit(sig, frame)

    try:
        app = create_app(settings, on_fatal=lambda: setattr(server, "should_exit", True))
    except (CredentialsError, CurveError) as exc:
        print(f"specd: error: {exc}", file=sys.stderr)
        return 2
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,
        log_level=settings.log_level,
        access_log=settings.access_log,
        timeout_graceful_shutdown=math.ceil(settings.shutdown_timeout),
        limit_concurrency=settings.limit_concurrency,
        timeout_keep_alive=settings.timeout_keep_alive,
        http=protocol_class(settings.header_timeout),
        lifespan="on",
    )
    server = Server(config)
    # uvicorn re-raises SIGTERM/SIGINT once it has shut down gracefully, to let
    # the previous handler act on it; with this one the process then exits 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run()
    state = app.state.specd
    return 1 if state.load_error or state.engine_error or not server.started else 0


# -- generate ----------------------------------------------------------------------


def generate(args: argparse.Namespace) -> int:
    settings = _settings(args, GENERATE_SETTINGS, max_num_seqs=1)
    if settings is None:
        return 2
    configure_logging(settings.log_level)
    from server.app import build_components

    try:
        components = build_components(settings)
    except (OSError, ValueError) as exc:
        print(f"specd: error: {exc}", file=sys.stderr)
        return 1
    return asyncio.run(_generate(components, args))


async def _generate(components, args: argparse.Namespace) -> int:
    from models.chat_template import chat_text
    from scheduler.engine import AsyncEngine
    from scheduler.types import InvalidRequestError, Request, SamplingParams
    from server.detokenizer import IncrementalDetokenizer

    tokenizer = components.loaded.tokenizer
    if args.raw or not tokenizer.chat_template:
        prompt_ids = tokenizer.encode(args.prompt)
    else:
        prompt_ids = tokenizer.encode(chat_text(tokenizer, [{"role": "user", "content": args.prompt}]),
                                      add_special_tokens=False)  # fmt: skip
    engine = AsyncEngine(components.runner, components.scheduler_config, inline=True)  # loaded on this thread
    await engine.start()
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            speculation=SPECULATION_CHOICES[args.speculation],
        )
        request = Request("generate-0", prompt_ids, params)
        detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
        started = time.perf_counter()
        last = None
        async with engine.submit(request) as stream:
            async for out in stream:
                sys.stdout.write(detokenizer.push(out.new_token_ids) + (detokenizer.flush() if out.finished else ""))
                sys.stdout.flush()
                last = out
    except InvalidRequestError as exc:
        print(f"specd: error: {exc.message}", file=sys.stderr)
        return 1
    finally:
        await engine.stop(timeout=0)
    sys.stdout.write("\n")
    seconds = time.perf_counter() - started
    if last is not None:
        if last.error:
            print(f"specd: error: {last.error}", file=sys.stderr)
            return 1
        print(
            f"[{last.num_output_tokens} tokens in {seconds:.2f}s, "
            f"{last.num_output_tokens / max(seconds, 1e-9):.1f} tok/s; finish_reason={last.finish_reason}; "
            f"drafts accepted {last.num_accepted_tokens}/{last.num_draft_tokens}]",
            file=sys.stderr,
        )
    return 0


# -- train-draft -------------------------------------------------------------------


def train_draft(args: argparse.Namespace) -> int:
    settings = _settings(args, TRAIN_DRAFT_SETTINGS)
    if settings is None:
        return 2
    configure_logging(settings.log_level)
    from server.app import model_config
    from training.data import DataConfig
    from training.pipeline import TrainDraftConfig
    from training.pipeline import train_draft as run_training
    from training.train import TrainConfig

    try:
        config = TrainDraftConfig(
            model=model_config(settings),
            out=args.out,
            prompt_files=args.prompts,
            shipped_prompts=args.shipped_prompts,
            eval_prompt_files=args.eval_prompts,
            draft_vocab=args.draft_vocab,
            features=args.features,
            held_out=args.held_out,
            threads=args.threads,
            total_minutes=args.total_minutes,
            data=DataConfig(
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                max_num_seqs=args.max_num_seqs,
                seed=args.seed,
            ),
            train=TrainConfig(
                minutes=args.minutes,
                epochs=args.epochs,
                batch_tokens=args.batch_tokens,
                lr=args.lr,
                unroll=args.unroll,
                feature_loss=args.feature_loss,
                soft_targets=args.targets == "soft",
                seed=args.seed,
            ),
        )
        run_training(config, started=args.started)
    except (OSError, ValueError) as exc:
        print(f"specd: error: {exc}", file=sys.stderr)
        return 1
    return 0


COMMANDS = {"serve": serve, "generate": generate, "models": models_command, "train-draft": train_draft}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # When this process is the command, its budgets (train-draft's --total-minutes) count its imports
    # too; a caller that runs a command in-process counts from the call.
    args.started = IMPORTED_AT if argv is None else time.monotonic()
    return COMMANDS[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
