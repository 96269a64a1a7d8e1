"""Structured outputs: the request fields that ask for a grammar, and its compilation.

A request asks for one grammar, by one of:

- `response_format` (OpenAI): `json_object`, or `json_schema` with its `schema` (`strict` is
  accepted; the schema is always enforced);
- `structured_outputs` (vLLM's extension, chat and text completions): exactly one of `json`
  (a schema), `regex`, `choice` (a list of strings), `grammar` (Lark or GBNF) or `json_object`;
  `disable_any_whitespace` (default true here: JSON comes compact);
- `tools` with `tool_choice` `required` or a named function (`server.tool_calls` builds it).

`GrammarSource` is the request's grammar as text, refused (400, naming the field) when it is
too large, malformed or unsupported, all before any tokenizing. `GrammarCompiler` turns it into
one `models.grammar.GrammarState` per choice on the preparation thread, caching compiled
grammars by content; the llguidance tokenizer it needs is built once, the first time.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import jsonschema
import llguidance

from models.grammar import (
    Grammar,
    GrammarError,
    GrammarState,
    GrammarTokenizer,
    json_schema_grammar,
    regex_grammar,
)
from server.errors import BadRequestError

logger = logging.getLogger("specd.server")

MAX_GRAMMAR_CHARS = 64 * 1024  # a schema (as JSON), regex, grammar or the choices together
MAX_CACHED_GRAMMARS = 256
GrammarKind = Literal["json", "regex", "choice", "grammar"]
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class GrammarSource:
    """A request's grammar before compilation: what `GrammarCompiler` caches by."""

    kind: GrammarKind
    text: str  # a schema or the choices as canonical JSON; a regex; Lark/GBNF text (a tools grammar: Lark)
    param: str  # the request field it came from, for errors
    any_whitespace: bool = False  # JSON: free whitespace between tokens (default: compact)

    def grammar_text(self) -> str:
        """The llguidance grammar (raises ValueError for malformed input)."""
        if self.kind == "json":
            return json_schema_grammar(json.loads(self.text), any_whitespace=self.any_whitespace)
        if self.kind == "regex":
            return regex_grammar(self.text)
        if self.kind == "choice":
            return llguidance.grammar_from("choice", self.text)
        # Lark or GBNF, told apart by llguidance's own converter (a Lark string literal may hold "::=").
        return llguidance.grammar_from("grammar", self.text)


def json_source(schema: Any, param: str, any_whitespace: bool = False) -> GrammarSource:
    """A JSON schema, checked against its metaschema (400 naming `param` when it is not one)."""
    if isinstance(schema, str):  # vLLM accepts the schema as JSON text too
        try:
            schema = json.loads(schema)
        except ValueError:
            raise BadRequestError("the JSON schema is not valid JSON", param=param) from None
    if not isinstance(schema, (dict, bool)):
        raise BadRequestError("a JSON schema must be an object", param=param)
    text = json.dumps(schema, sort_keys=True, separators=(",", ":"))
    _check_size(len(text), param)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise BadRequestError(f"invalid JSON schema: {exc.message}", param=param) from None
    return GrammarSource("json", text, param, any_whitespace)


def _check_size(num_chars: int, param: str) -> None:
    if num_chars > MAX_GRAMMAR_CHARS:
        raise BadRequestError(
            f"the grammar is {num_chars} characters; at most {MAX_GRAMMAR_CHARS} are allowed", param=param
        )


def from_response_format(response_format: dict[str, Any] | None) -> GrammarSource | None:
    """OpenAI's `response_format`: None for text."""
    if not response_format:
        return None
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_source({"type": "object"}, "response_format")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise BadRequestError(
                "'response_format' of type 'json_schema' needs 'json_schema': {name, schema}",
                param="response_format.json_schema",
            )
        return json_source(spec["schema"], "response_format.json_schema.schema")
    raise BadRequestError(
        f"response_format type {kind!r} is not supported; use 'text', 'json_object' or 'json_schema'",
        param="response_format.type",
    )


def from_structured_outputs(fields: dict[str, Any] | None) -> GrammarSource | None:
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar, json_object."""
    if not fields:
        return None
    given = [k for k in STRUCTURED_KINDS if fields.get(k) not in (None, False)]
    if len(given) != 1:
        raise BadRequestError(
            f"'structured_outputs' takes exactly one of {', '.join(STRUCTURED_KINDS)}; got "
            f"{', '.join(given) or 'none'}",
            param="structured_outputs",
        )
    kind, value = given[0], fields[given[0]]
    param = f"structured_outputs.{kind}"
    any_whitespace = fields.get("disable_any_whitespace", True) is False
    if kind == "json_object":
        return json_source({"type": "object"}, param, any_whitespace)
    if kind == "json":
        return json_source(value, param, any_whitespace)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise BadRequestError("'choice' must be a non-empty list of strings", param=param)
        text = json.dumps(value)
        _check_size(len(text), param)
        return GrammarSource("choice", text, param)
    if not isinstance(value, str) or not value:
        raise BadRequestError(f"'{kind}' must be a non-empty string", param=param)
    _check_size(len(value), param)
    return GrammarSource(kind, value, param)  # type: ignore[arg-type]


class GrammarCompiler:
    """Grammars for one served tokenizer: compiled once per content, started once per choice.

    Runs on the preparation thread; a grammar compiles in well under a millisecond. The llguidance
    tokenizer takes 0.4-1.5 s to build, holding the GIL, so the server builds it before it is ready
    (`prepare`): built by the first structured request, it stalled every tenant's streams and
    `/health` for that long."""

    def __init__(
        self,
        tokenizer: Any,
        eos_ids: list[int],
        vocab_size: int,
        on_compiled: Callable[[float], None] | None = None,
    ):
        self._hf_tokenizer = tokenizer
        self._eos_ids = eos_ids
        self._vocab_size = vocab_size
        self._tokenizer: GrammarTokenizer | None = None
        self._unavailable: str | None = None  # why the tokenizer could not be built (never retried)
        self._lock = threading.Lock()
        self._cache: OrderedDict[GrammarSource, Grammar] = OrderedDict()
        self._on_compiled = on_compiled

    @property
    def tokenizer(self) -> GrammarTokenizer:
        with self._lock:
            if self._unavailable is not None:
                raise BadRequestError(
                    f"structured outputs are unavailable on this server: {self._unavailable}",
                    code="structured_outputs_unavailable",
                )
            if self._tokenizer is None:
                start = time.perf_counter()
                self._tokenizer = GrammarTokenizer(self._hf_tokenizer, self._eos_ids, self._vocab_size)
                logger.info("grammar tokenizer ready in %.2f s", time.perf_counter() - start)
            return self._tokenizer

    def prepare(self) -> None:
        """Build the llguidance tokenizer now. A tokenizer llguidance cannot read (an exception, or
        a Rust panic, which Python sees as a BaseException) is logged, not fatal, and not retried:
        plain requests are served, structured ones get the reason at once."""
        try:
            _ = self.tokenizer
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001 - structured outputs only; the server still serves
            with self._lock:
                self._unavailable = _first_line(exc)
            logger.warning("structured outputs are unavailable: the grammar tokenizer cannot be built: %s", exc)

    def special_token(self, text: str) -> bool:
        """`text` is one added token of the vocabulary (a grammar names it as `<text>`, not as text)."""
        return text in self._hf_tokenizer.get_added_vocab()

    def compile(self, source: GrammarSource) -> Grammar:
        """The grammar, from the cache or compiled now; 400 naming the field when llguidance refuses it."""
        with self._lock:
            cached = self._cache.get(source)
            if cached is not None:
                self._cache.move_to_end(source)
                return cached
        tokenizer = self.tokenizer
        start = time.perf_counter()
        try:
            grammar = tokenizer.compile(source.grammar_text())
        except (GrammarError, ValueError) as exc:
            raise BadRequestError(f"the grammar cannot be used: {_first_line(exc)}", param=source.param) from None
        if self._on_compiled is not None:
            self._on_compiled(time.perf_counter() - start)
        with self._lock:
            self._cache[source] = grammar
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return grammar

    def states(self, source: GrammarSource, n: int) -> list[GrammarState]:
        """One fresh matcher per choice."""
        grammar = self.compile(source)
        try:
            return [grammar.start() for _ in range(n)]
        except GrammarError as exc:
            raise BadRequestError(f"the grammar cannot be used: {_first_line(exc)}", param=source.param) from None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or ["invalid"])[0][:500]
