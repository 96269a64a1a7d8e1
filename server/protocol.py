"""OpenAI request and response schemas (pydantic v2).

Requests accept unknown fields and ignore them, as OpenAI does, so clients
that send newer fields keep working. Value ranges are checked where the value
is used (`SamplingParams` validates decoding parameters); here only shapes,
types and the limits that protect the server.

Limits beyond OpenAI's: `stop` holds at most `MAX_STOP_STRINGS` strings of at
most `MAX_STOP_STRING_CHARS` characters each (OpenAI allows 4); `n` is at most
`MAX_N`, and a completion request asks for at most `MAX_CHOICES` sequences
(prompts x n); every list and name has a bound below (`MAX_*`), so no field can
make the server do more than the body limit's worth of work before it is refused.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import asdict, dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)

from scheduler.types import MAX_SPEC_TOKENS, MAX_STOP_TOKEN_IDS, MAX_TOP_LOGPROBS

MAX_N = 16
MAX_CHOICES = 128
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_MESSAGES = 1024
MAX_CONTENT_PARTS = 256  # text parts of one message (a str content is bounded by the body)
MAX_TOOLS = 128
MAX_TEMPLATE_KWARGS = 32
MAX_ID_CHARS = 256  # model, user, name, cache_salt


class InvalidTextError(ValueError):
    """A string in the body that is not Unicode text (a lone UTF-16 surrogate from a JSON escape)."""

    def __init__(self, param: str | None):
        where = f"'{param}'" if param else "a key of the request body"
        super().__init__(f"{where} is not valid Unicode text (it holds a lone surrogate)")
        self.param = param


def find_invalid_text(data: Any) -> tuple[bool, str | None]:
    """(found, param) for the first string, key or value, that UTF-8 cannot encode.

    JSON's `\\ud800` escapes decode to lone surrogates, which the tokenizer and the
    response encoder refuse; they are rejected here, with the field's path.
    Iterative, so any nesting that the JSON parser accepted is fine. It runs on the event
    loop before any length check: a list's numbers (a prompt of token ids, ~2M in a 4 MiB
    body) are skipped at C speed, and a path is spelled out only for the value that fails.
    """
    stack: list[tuple[Any, _Path]] = [(data, None)]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if not _is_text(value):
                return True, _spell(path)
        elif isinstance(value, dict):
            for key, item in value.items():
                if isinstance(key, str) and not _is_text(key):
                    return True, _spell(path)
                stack.append((item, (path, key)))
        elif isinstance(value, list):
            kinds = set(map(type, value))
            if kinds <= _SCALARS or (kinds <= _TEXTS and _is_text("".join(value))):
                continue  # numbers, or strings whose text is sound (a million prompts: one join)
            stack.extend((item, (path, i)) for i, item in enumerate(value) if type(item) not in _SCALARS)
    return False, None


# A value's place in the body: None for the body itself, else (its container's place, key or index).
_Path = tuple[Any, str | int] | None
_SCALARS = frozenset((int, float, bool, type(None)))
_TEXTS = frozenset((str,))


def _spell(path: _Path) -> str | None:
    """`messages[0].content` for (((None, "messages"), 0), "content")."""
    parts: list[str | int] = []
    while path is not None:
        path, key = path
        parts.append(key)
    text = ""
    for key in reversed(parts):
        text += f"[{key}]" if isinstance(key, int) else (f".{key}" if text else key)
    return text or None


def _is_text(value: str) -> bool:
    if value.isascii():
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class OpenAIRequest(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(OpenAIRequest):
    include_usage: bool = False
    # vLLM extension: usage on every chunk (load generators such as guidellm read it).
    continuous_usage_stats: bool = False
    # specd extension: each chunk says what speculation did for its tokens (`ChunkSpeculation`).
    include_speculation: bool = False


class SamplingFields(OpenAIRequest):
    """Fields shared by completions and chat completions."""

    model: str = Field(max_length=MAX_ID_CHARS)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = Field(None, max_length=MAX_ID_CHARS)  # logged at most; it isolates nothing
    # -- extensions (`extra_body` in the OpenAI SDKs) --
    # Narrows the caches this request shares within its tenant (vLLM's field; `server.auth`).
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_ID_CHARS)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    speculation: Literal["auto"] | StrictBool = "auto"
    num_speculative_tokens: int | None = Field(None, ge=0, le=MAX_SPEC_TOKENS)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Structured outputs (`server.structured_outputs`): OpenAI's field, and vLLM's.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _check_text(cls, data: Any) -> Any:
        found, param = find_invalid_text(data)
        if found:
            raise InvalidTextError(param)
        return data

    @field_validator("stop")
    @classmethod
    def _bound_stop(cls, value: str | list[str] | None) -> list[str]:
        """Normalised to a list of non-empty strings."""
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}")
        for stop in stops:
            if len(stop) > MAX_STOP_STRING_CHARS:
                raise ValueError(f"a stop string may have at most {MAX_STOP_STRING_CHARS} characters")
        return [s for s in stops if s]


class ContentPart(OpenAIRequest):
    type: str
    text: str | None = None


ContentParts = Annotated[list[ContentPart], Field(max_length=MAX_CONTENT_PARTS)]


class FunctionCall(OpenAIRequest):
    name: str = Field(max_length=MAX_ID_CHARS)
    arguments: str | dict[str, Any] = "{}"  # JSON text, as OpenAI sends it (an object: as some clients do)


class MessageToolCall(OpenAIRequest):
    id: str | None = Field(None, max_length=MAX_ID_CHARS)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIRequest):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | ContentParts | None = None
    name: str | None = Field(None, max_length=MAX_ID_CHARS)
    tool_calls: list[MessageToolCall] | None = Field(None, max_length=MAX_TOOLS)  # an assistant's
    tool_call_id: str | None = Field(None, max_length=MAX_ID_CHARS)  # a tool's reply to it


class FunctionDefinition(OpenAIRequest):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: any object
    strict: bool | None = None  # accepted; `required` and named calls are always enforced


class ToolDefinition(OpenAIRequest):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(OpenAIRequest):
    name: str = Field(max_length=MAX_ID_CHARS)


class NamedToolChoice(OpenAIRequest):
    type: Literal["function"]
    function: NamedFunction


class Prediction(OpenAIRequest):
    """OpenAI Predicted Outputs: the expected completion, used as the draft (at most the served
    context length in tokens: `serving_chat`)."""

    type: Literal["content"]
    content: str | ContentParts


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    prediction: Prediction | None = None
    tools: list[ToolDefinition] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # -- extensions --
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = Field(None, max_length=MAX_TEMPLATE_KWARGS)


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None
    # -- extensions --
    add_special_tokens: bool = True

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt_shape(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Prompt:
        """A list's size is judged before its elements: a list of prompts holds at most
        `MAX_CHOICES` (a million empty ones must cost nothing), and token ids (all ints, seen at C
        speed) skip the union's element-wise tries; the context bounds them where they are used."""
        if isinstance(value, list) and value:
            kinds = set(map(type, value))
            if kinds == {int}:
                return value
            if len(value) > MAX_CHOICES and int not in kinds:
                raise ValueError(f"at most {MAX_CHOICES} prompts per request, got {len(value)}")
        return handler(value)


# -- responses ------------------------------------------------------------------


class OpenAIResponse(BaseModel):
    model_config = ConfigDict(extra="forbid")


@dataclass(frozen=True)
class ResponseHead:
    """What a completion and every stream chunk of it repeat: id, created, model, fingerprint.

    The `object` kind is not here: each response class fixes its own
    (`chat.completion` vs `chat.completion.chunk`, `text_completion`).
    """

    id: str
    created: int
    model: str
    system_fingerprint: str

    @classmethod
    def new(cls, id_prefix: str, model: str, system_fingerprint: str) -> ResponseHead:
        """A fresh head: a random id with `id_prefix` (`chatcmpl`, `cmpl`), created now."""
        return cls(f"{id_prefix}-{uuid.uuid4().hex}", int(time.time()), model, system_fingerprint)

    def fields(self) -> dict[str, Any]:
        """The head as keyword arguments of a response model."""
        return asdict(self)


class CompletionTokensDetails(OpenAIResponse):
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    reasoning_tokens: int = 0


class PromptTokensDetails(OpenAIResponse):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class Usage(OpenAIResponse):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    completion_tokens_details: CompletionTokensDetails = Field(default_factory=CompletionTokensDetails)


class TopLogprob(OpenAIResponse):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(OpenAIResponse):
    content: list[TokenLogprob]


class ResponseFunction(OpenAIResponse):
    name: str
    arguments: str  # JSON text


class ResponseToolCall(OpenAIResponse):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunction


class AssistantMessage(OpenAIResponse):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ResponseToolCall] = Field(default_factory=list)


class ChatChoice(OpenAIResponse):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None


class ChatCompletionResponse(OpenAIResponse):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage


class ChunkSpeculation(OpenAIResponse):
    """What the engine steps behind one streamed chunk did for its choice (`include_speculation`).

    Each count covers the steps since the choice's previous chunk. Summed over a
    choice's chunks, `tokens`, `accepted_tokens` and `rejected_tokens` equal its
    usage's `completion_tokens` and `completion_tokens_details` accepted /
    rejected prediction tokens (with a `prediction`, counted as usage counts them).
    """

    tokens: int  # completion tokens
    accepted_tokens: int  # of them, from accepted drafts
    draft_tokens: int  # drafts verified: accepted + rejected
    rejected_tokens: int
    steps: int  # engine steps that sampled for this choice
    speculative_steps: int  # of them, steps that verified drafts


class DeltaFunction(OpenAIResponse):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OpenAIResponse):
    """A streamed tool call: its first delta has id, type and name, the next its arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction


class DeltaMessage(OpenAIResponse):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(OpenAIResponse):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    speculation: ChunkSpeculation | None = None


class ChatCompletionChunk(OpenAIResponse):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(OpenAIResponse):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(OpenAIResponse):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionChunkChoice(CompletionChoice):
    """A streamed choice: only chunks carry `speculation`."""

    speculation: ChunkSpeculation | None = None


class CompletionResponse(OpenAIResponse):
    """A completion, or (with `usage` only on the last one) a streamed chunk of one."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice] | list[CompletionChunkChoice]
    usage: Usage | None = None


class ModelCard(OpenAIResponse):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "specd"
    root: str
    max_model_len: int


class ModelList(OpenAIResponse):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class SpeculationInfo(OpenAIResponse):
    """GET /v1/speculation: the live speculation configuration and acceptance."""

    proposer: str
    draft_head: dict | None = None  # --draft eagle: {name, draft_vocab_size, feature_layers, training}
    num_speculative_tokens: int
    spec_disable_batch_size: int | None  # the operator's cap; None: none
    adaptive: bool
    spec_enabled: bool  # the last engine step carried drafts
    acceptance_rate: float | None  # accepted / draft tokens, since start
    mean_acceptance_length: float | None  # 1 + accepted tokens / drafts
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    requests_running: int
    requests_waiting: int
    kv_cache_usage: float
    # The policy at work: the learned step-cost model (with its calibration:
    # predicted vs measured step time), tokens per step it expected vs got,
    # and the recent first-draft acceptance by proposer.
    policy: dict
