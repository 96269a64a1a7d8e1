"""Every proposer by name: its class, what it can do, and what it needs.

The one place that knows the proposers. Config validation, the CLI's choices, the
runner's construction, the policy's reading of a row's proposer, and the metrics'
labels all derive from `REGISTRY`; adding a proposer is a module with its class and
one `ProposerSpec` line here (or a `register` call). Classes are named by import
path and imported when built, so reading the registry (the CLI's `--help`, the
server's settings) loads no model code.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from speculation.proposer import Proposer

NONE = "none"  # the `--draft` choice that serves without a proposer


@dataclass(frozen=True)
class Capabilities:
    """What a proposer can do, as the policy and the runner read it."""

    # Drafts with forwards on the device: each position drafted costs one more forward, a
    # draft for a row that runs plain is not free (it probes instead of shadowing), and
    # prompt lookup may draft beside it.
    on_device: bool = False
    # Its draft for a row is made on the host from the request alone, so before the step the
    # runner can say how long each row's is (`Drafting.available`), and makes it ahead.
    drafts_ahead: bool = False
    # Its drafts carry each token's probability, which the policy prices them by (`Drafting.preview`).
    priced: bool = False

    @property
    def can_shadow(self) -> bool:
        """A draft for a row that runs plain costs nothing, so its next tokens can grade one."""
        return not self.on_device


NO_CAPABILITIES = Capabilities()  # a row with no proposer: nothing drafts ahead, nothing on the device


@dataclass(frozen=True)
class ProposerSpec:
    name: str
    cls: str  # "module:Class", imported when built
    capabilities: Capabilities
    summary: str  # one line for `--help`
    default_k: int = 10  # draft tokens per verify step when the operator sets none
    needs: str | None = None  # the `ProposerConfig` field it cannot run without (and that implies it)
    # Chosen by the operator (`--draft`); else the server uses it on its own (a request's prediction).
    selectable: bool = True

    def load(self) -> type[Proposer]:
        module, _, name = self.cls.partition(":")
        return getattr(importlib.import_module(module), name)


REGISTRY: dict[str, ProposerSpec] = {}


def register(spec: ProposerSpec) -> ProposerSpec:
    if spec.name in REGISTRY or spec.name == NONE:
        raise ValueError(f"a proposer named {spec.name!r} is already registered")
    REGISTRY[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    REGISTRY.pop(name, None)


NGRAM = register(
    ProposerSpec("ngram", "speculation.ngram:NgramProposer", Capabilities(drafts_ahead=True),
                 "prompt lookup: what followed the longest n-gram match in the request")
)  # fmt: skip
PREDICTION = register(
    ProposerSpec("prediction", "speculation.prediction:PredictionProposer", Capabilities(drafts_ahead=True),
                 "OpenAI Predicted Outputs: the request's prediction", selectable=False)
)  # fmt: skip
GRAMMAR = register(
    ProposerSpec("grammar", "speculation.grammar:GrammarProposer", Capabilities(),
                 "structured outputs: the tokens a request's grammar forces", selectable=False)
)  # fmt: skip
register(
    ProposerSpec("suffix", "speculation.suffix:SuffixProposer", Capabilities(priced=True),
                 "suffix decoding: drafts from this request and earlier outputs of its tenant, priced by frequency")
)  # fmt: skip
register(
    ProposerSpec("draft_model", "speculation.draft_model:DraftModelProposer", Capabilities(on_device=True),
                 "a small model sharing the target's tokenizer, --draft-model", default_k=4, needs="draft_model")
)  # fmt: skip
register(
    ProposerSpec("eagle", "speculation.eagle:EagleProposer", Capabilities(on_device=True),
                 "a one-layer draft head over the target's own hidden states, --draft-head", default_k=5,
                 needs="draft_head")
)  # fmt: skip
# Beside a proposer that drafts on the device, rows may draft by prompt lookup instead.
LOOKUP = NGRAM


def get(name: str) -> ProposerSpec:
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown proposer {name!r}; known: {', '.join(choices())}") from None


def capabilities(name: str | None) -> Capabilities:
    """A proposer's capabilities by name; None or an unknown name (no proposer): none."""
    spec = REGISTRY.get(name or "")
    return NO_CAPABILITIES if spec is None else spec.capabilities


def choices() -> list[str]:
    """What `--draft` accepts."""
    return [name for name, spec in REGISTRY.items() if spec.selectable] + [NONE]


def methods() -> list[str]:
    """Every proposer that can draft for a row: the metrics' `method` labels."""
    return list(REGISTRY)


def probing_methods() -> list[str]:
    """Proposers whose rows that run plain probe (a forward each) instead of shadowing for free."""
    return [name for name, spec in REGISTRY.items() if not spec.capabilities.can_shadow]


def default_method(option: Callable[[str], object]) -> str:
    """The proposer the options imply: the first whose `needs` option is set (`option(name)` is its
    value), else n-gram."""
    return next((spec.name for spec in REGISTRY.values() if spec.needs and option(spec.needs)), NGRAM.name)


def needs(name: str) -> str | None:
    """The option a proposer cannot run without (None for "none" and for proposers that need none)."""
    return None if name == NONE else get(name).needs


def default_k(name: str) -> int:
    spec = REGISTRY.get(name)
    return NGRAM.default_k if spec is None else spec.default_k


def help_text() -> str:
    """`--draft`'s choices, one clause each."""
    return "; ".join(f"{spec.name} ({spec.summary})" for spec in REGISTRY.values() if spec.selectable)
