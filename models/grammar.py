"""Token-level grammars: llguidance matchers over the served tokenizer.

A `Grammar` is a compiled, validated llguidance grammar (JSON schema, regex, choice or
Lark text) bound to a `GrammarTokenizer`; `Grammar.start()` gives each output sequence
its own `GrammarState`, the matcher the engine advances by emitted tokens only. The
state answers what speculation asks of it without committing anything: the tokens the
grammar forces next (`forced`), how much of a draft it accepts (`accepts`), and one
token bitmask per verify position (`fill_masks`, all rows at once). `apply_masks`
applies those bitmasks to the step's packed logits on the device.

llguidance, not our own: it builds no per-vocabulary automaton ahead of time (a
schema "compiles" in well under a millisecond), its lexer is lazy so a mask costs
~0.1 ms on a 152k vocabulary, and it rolls back, which a draft needs. docs/structured-outputs.md
has the comparison with xgrammar.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import llguidance
import llguidance.hf
import torch

from models import cpu_kernels

# A grammar's work per token is bounded by llguidance's fuel: past it the matcher errors
# (the request ends) instead of stalling the step. Its defaults, made explicit, except the
# grammar size, bounded here to what a 64 KiB schema needs.
STEP_LEXER_FUEL, INITIAL_LEXER_FUEL, MAX_GRAMMAR_SIZE = 200_000, 1_000_000, 500_000


class GrammarError(ValueError):
    """A grammar llguidance refuses (invalid, unsupported, over its limits)."""


class GrammarTokenizer:
    """The served tokenizer as llguidance reads it, built once (0.4-1.4 s on a 49k-152k vocabulary).

    `eos_ids` are the engine's end-of-sequence ids: the only tokens a finished grammar allows.
    """

    def __init__(self, tokenizer: Any, eos_ids: list[int], vocab_size: int):
        # The model's logits may be wider than the tokenizer (padded embeddings): llguidance is
        # told so, and the ids past the tokenizer's are never allowed.
        n_vocab = vocab_size if vocab_size >= len(tokenizer) else None
        self.ll = llguidance.hf.from_tokenizer(tokenizer, n_vocab=n_vocab, eos_token=list(eos_ids) or None)
        self.vocab_size = self.ll.vocab_size
        self.limits = llguidance.LLParserLimits(
            step_lexer_fuel=STEP_LEXER_FUEL, initial_lexer_fuel=INITIAL_LEXER_FUEL, max_grammar_size=MAX_GRAMMAR_SIZE
        )
        self.words = (self.vocab_size + 31) // 32  # int32 words per bitmask row

    @functools.cached_property
    def executor(self) -> Any:
        """llguidance's thread pool for `fill_masks(parallel=True)`, started on first use only."""
        return llguidance.LLExecutor()

    def compile(self, grammar: str) -> Grammar:
        """Validate llguidance grammar text (`grammar_from_*`); GrammarError says what is wrong."""
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.ll, limits=self.limits)
        if is_error:
            raise GrammarError(messages[0] if messages else "the grammar is invalid")
        return Grammar(self, grammar)


def json_schema_grammar(schema: dict | bool, *, any_whitespace: bool) -> str:
    """A JSON schema as llguidance grammar text. Compact by default: no whitespace between tokens."""
    options: dict[str, Any] = {"whitespace_flexible": any_whitespace}
    if not any_whitespace:
        options.update(item_separator=",", key_separator=":")
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)  # type: ignore[arg-type]


def regex_grammar(pattern: str) -> str:
    return llguidance.LLMatcher.grammar_from_regex(pattern)


@dataclass(frozen=True)
class Grammar:
    tokenizer: GrammarTokenizer
    text: str

    def start(self) -> GrammarState:
        matcher = llguidance.LLMatcher(self.tokenizer.ll, self.text, log_level=0, limits=self.tokenizer.limits)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return GrammarState(self.tokenizer, matcher)


@dataclass
class GrammarState:
    """One output sequence's matcher (`scheduler.types.TokenConstraint`). The scheduler advances
    it on the event loop and the runner reads it on the step thread, which the engine loop
    awaits: never both at once."""

    tokenizer: GrammarTokenizer
    matcher: Any  # llguidance.LLMatcher
    num_tokens: int = 0  # tokens consumed
    _forced: tuple[int, list[int]] | None = field(default=None, repr=False)  # (num_tokens, ids)

    @property
    def is_done(self) -> bool:
        """Nothing but end-of-sequence can follow: the output is complete."""
        return self.matcher.is_stopped() and not self.matcher.is_error()

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() or None if self.matcher.is_error() else None

    def advance(self, token_ids: list[int]) -> bool:
        """Commit emitted tokens; False when the grammar refuses one (the matcher is then in error)."""
        ok = self.matcher.consume_tokens(token_ids)
        self.num_tokens += len(token_ids)
        return bool(ok)

    def forced(self) -> list[int]:
        """The tokens the grammar allows as the only continuation from here (computed once per state)."""
        if self._forced is None or self._forced[0] != self.num_tokens:
            ids = [] if self.matcher.is_error() else list(self.matcher.compute_ff_tokens())
            self._forced = (self.num_tokens, ids)
        return self._forced[1]

    def accepts(self, token_ids: list[int]) -> int:
        """How many of `token_ids`, in order, the grammar allows from here (nothing committed)."""
        if not token_ids:
            return 0
        return int(self.matcher.validate_tokens(token_ids))


def fill_masks(
    items: list[tuple[GrammarState, int, list[int]]], num_rows: int, *, parallel: bool = False
) -> torch.Tensor:
    """Bitmasks `[num_rows, words]` int32: for each (state, row, draft), the mask of the state at
    `row`, and after each draft token at `row + 1 ..` (the draft must be one the state accepts).
    Rows of other states stay all-allowed.

    Serial on the calling thread by default: on a CPU the forward that follows needs every core,
    and llguidance's pool (`parallel`) left its threads contending with it. On a 2-core EPYC, 16
    JSON rows on SmolLM2: the pool's masks took 1.2 ms a step and the next forward ran ~9%
    slower; serial, 1.1 ms and no slower forward. The pool is for a device step, where the host's
    cores are otherwise idle."""
    assert items
    words = items[0][0].tokenizer.words
    bitmask = torch.full((num_rows, words), -1, dtype=torch.int32)
    if parallel:
        executor = items[0][0].tokenizer.executor
        plain = [(state.matcher, row) for state, row, draft in items if not draft]
        drafted = [(state.matcher, row, draft) for state, row, draft in items if draft]
        if plain:
            executor.unsafe_compute_mask_ptr(plain, bitmask.data_ptr(), words * 4, num_rows)
        if drafted:  # (llguidance refuses an empty draft here)
            executor.unsafe_compute_mask_ptr_with_draft_token(drafted, bitmask.data_ptr(), words * 4, num_rows)
        return bitmask
    base, row_bytes = bitmask.data_ptr(), words * 4
    for state, row, draft in items:
        matcher = state.matcher
        matcher.unsafe_compute_mask_ptr(base + row * row_bytes, row_bytes)  # drops the GIL
        # Past a token the grammar refuses (never, for a draft `accepts` cut) rows stay all-allowed.
        accepted = draft[: state.accepts(draft)]
        for j, token in enumerate(accepted, start=1):
            matcher.consume_token(token)
            matcher.unsafe_compute_mask_ptr(base + (row + j) * row_bytes, row_bytes)
        if accepted:
            matcher.rollback(len(accepted))
    return bitmask


def allowed_tokens(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """Bitmasks `[n, words]` (int32 values, any integer dtype) as `[n, vocab]` bools; ids past the
    mask's words are never allowed."""
    bits = torch.arange(32, device=bitmask.device, dtype=torch.int64)
    allowed = ((bitmask.to(torch.int64)[:, :, None] >> bits) & 1).flatten(1)[:, :vocab].bool()
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    return allowed


def apply_masks(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set the disallowed logits of `logits[rows]` `[n, V]` to -inf, in place, from their bitmasks
    `[n, words]` (int32 values, any integer dtype). On CPU the kernel (`csrc/token_mask.cpp`)
    makes one pass per row; torch's expression widens the mask to a bool per token and costs
    ~0.3 ms a row on a 49k vocabulary (5 ms of a 16-row step)."""
    if logits.device.type == "cpu" and logits.dim() == 2 and logits.stride(-1) == 1 and cpu_kernels.available():
        torch.ops.specd.apply_token_bitmask(logits, rows.cpu().long(), bitmask.cpu().to(torch.int32).contiguous())
        return
    allowed = allowed_tokens(bitmask.to(logits.device), logits.shape[-1])
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
