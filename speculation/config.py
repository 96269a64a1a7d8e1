"""The speculation settings of one engine: which proposer drafts (`ProposerConfig`), and the
operator's caps and the policy's knobs (`SpecConfig`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from scheduler.types import MAX_SPEC_TOKENS
from speculation import registry

if TYPE_CHECKING:
    from speculation.proposer import Drafting


@dataclass
class ProposerConfig:
    """Which proposer drafts (`method`: a `registry` name, or "none") and each proposer's options."""

    method: str | None = None  # None: the proposer the options imply (`registry.default_method`), else ngram
    draft_model: str | None = None  # a draft model's hub id or directory
    draft_weights: str = "auto"  # its weight format (`models.weights.draft_formats`)
    draft_head: str | None = None  # an EAGLE head directory (`specd train-draft` makes one)
    ngram_min: int = 1
    ngram_max: int = 4
    suffix_cache_requests: int = 256  # finished outputs suffix decoding keeps (0: per-request trees only)
    # Beside a proposer that drafts on the device: prompt lookup as a second source, per row.
    lookup: bool = True
    # A device proposer on a CPU ends a row's draft after a token it gave less than this probability.
    stop_confidence: float = 0.5

    def __post_init__(self) -> None:
        if self.method is None:
            self.method = registry.default_method(lambda option: getattr(self, option))
        if self.method not in registry.choices():
            raise ValueError(f"--draft must be one of {', '.join(registry.choices())}, got {self.method!r}")
        needs = registry.needs(self.method)
        if needs is not None and not getattr(self, needs):
            raise ValueError(f"--draft {self.method} needs --{needs.replace('_', '-')}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("ngram sizes must satisfy 1 <= min <= max")
        if not 0.0 <= self.stop_confidence < 1.0:
            raise ValueError("stop_confidence must be in [0, 1)")


@dataclass
class SpecConfig:
    num_speculative_tokens: int = 10
    # More than this many running requests: `auto` rows stop speculating. None: no cap; 0: never.
    spec_disable_batch_size: int | None = None
    adaptive: bool = True  # False: auto rows draft their K like `true` rows
    prior_acceptance: float = 0.6
    prior_rates: tuple[float, ...] = ()  # per position, where the engine's proposer starts (a head's record)
    decay: float = 0.8  # weight of a request's history in its estimate, per graded draft
    probe_interval: int = 8  # plain steps before a row that cannot shadow probes (at least)
    probe_budget: float = 0.01  # share of step time a round of probes may cost (the wait grows to fit)
    # Most tokens of a prompt-lookup draft beside a device proposer, unless the request sets
    # num_speculative_tokens (a copy is cheap to draft long, unlike a head's).
    lookup_tokens: int = 10

    def __post_init__(self) -> None:
        if not 0 <= self.num_speculative_tokens <= MAX_SPEC_TOKENS:
            raise ValueError(f"num_speculative_tokens must be in [0, {MAX_SPEC_TOKENS}]")
        if self.spec_disable_batch_size is not None and self.spec_disable_batch_size < 0:
            raise ValueError("spec_disable_batch_size must be >= 0")

    def auto_allowed(self, num_running: int) -> bool:
        cap = self.spec_disable_batch_size
        return cap is None or 0 < cap and num_running <= cap

    def describe(self, drafting: Drafting) -> str:
        """One line for the startup log."""
        cap = self.spec_disable_batch_size
        if cap == 0:
            auto = "never speculate (cap 0)"
        else:
            limit = f", while at most {cap} requests run" if cap is not None else " (no batch-size cap)"
            auto = "decide per request from acceptance and the step's learned cost" + limit
        lookup = f" (+ prompt lookup, up to {self.lookup_tokens} tokens)" if drafting.lookup else ""
        return (
            f"proposer={drafting.method}{lookup} num_speculative_tokens={self.num_speculative_tokens} "
            f"adaptive={self.adaptive}; auto rows {auto}"
        )
