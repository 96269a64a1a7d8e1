"""Server settings: command line > `SPECD_*` environment > YAML config file > defaults.

Every field is a `specd serve` flag (`max_num_seqs` -> `--max-num-seqs`) and an
environment variable (`SPECD_MAX_NUM_SEQS`); the field's description is the
flag's `--help` text. A YAML file (`--config FILE` or `SPECD_CONFIG`) holds
the same names, with `-` or `_`. List fields take comma-separated values.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import ByteSize, Field, SecretStr, TypeAdapter, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict

from models.heads import BUNDLED_HEAD_DIR
from scheduler.types import MAX_SPEC_TOKENS
from server.config_file import ConfigFileSource, file_values, read_config_file
from server.zmq_curve import CurveKeys, is_local_endpoint
from speculation import registry

ENV_PREFIX = "SPECD_"
CONFIG_ENV = "SPECD_CONFIG"
DEFAULT_MAX_MODEL_LEN = 2048
DEFAULT_MAX_NUM_BATCHED_TOKENS = 512
# Default KV memory: what 16 sequences of max_model_len held when each had a fixed slot.
DEFAULT_KV_SEQUENCES = 16

CommaList = Annotated[list[str], NoDecode]
_BYTES = TypeAdapter(ByteSize)


# Proposer options with a default for the bundled model: its trained EAGLE head.
BUNDLED_OPTIONS = {"draft_head": BUNDLED_HEAD_DIR}


@dataclass(frozen=True)
class ChoicesFrom:
    """Marks a settings field whose allowed values are computed when asked (`--draft`: the
    proposers registered at that moment); the CLI offers them as choices."""

    values: Callable[[], list[str]]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", validate_default=True)

    # -- network --
    host: str = Field("127.0.0.1", description="Address to bind. Use 0.0.0.0 to listen on every interface.")
    port: int = Field(8000, ge=0, le=65535, description="TCP port to listen on.")
    api_key: SecretStr | None = Field(
        None,
        description="Require 'Authorization: Bearer KEY' on /v1/* (and on /metrics, see --metrics-auth); the key's "
        "requests form one tenant, 'default'. 8+ characters. Prefer SPECD_API_KEY or --api-keys: a flag shows in the "
        "process list (a warning says so).",
    )
    api_keys: Path | None = Field(
        None,
        description="File of API keys, one 'TENANT KEY' pair per line ('#' comments): each key opens /v1/* for its "
        "tenant, and requests share cached prefixes and cross-request drafts only within their tenant (cache_salt "
        "narrows that further; 'user' isolates nothing). With no key at all, every client is one tenant. Refused if "
        "group or others may read it (chmod 600); re-read within a second of a change, so keys are added and revoked "
        "without a restart (a changed file that cannot be used is logged and the old keys stay).",
    )
    metrics_auth: bool | None = Field(
        None,
        description="Require an API key on GET /metrics too (default: yes whenever keys are configured; "
        "--no-metrics-auth leaves it open for a scraper that holds no key).",
    )
    metrics_tenants: CommaList = Field(
        default_factory=list,
        description="Tenants whose keys may read GET /v1/speculation and GET /metrics (server-wide counts and "
        "acceptance: every tenant's load together, never content), comma-separated; other keys get 403. Default: "
        "every tenant.",
    )
    allow_unauthenticated: bool = Field(
        False,
        description="Serve without any API key on a non-loopback --host (refused otherwise: anyone who can reach "
        "the port could use the server and read what its single tenant cached).",
    )
    trusted_hosts: CommaList = Field(
        default_factory=list,
        description="Without an API key the server answers only requests whose Host is localhost, 127.0.0.1, "
        "[::1] or one of these names, comma-separated, whatever --host binds (DNS-rebinding protection; 421 "
        "otherwise); '*' answers any name (only where nothing but trusted clients can reach the port).",
    )
    allowed_origins: CommaList = Field(
        default_factory=list, description="CORS origins allowed to call the API, comma-separated ('*' for any)."
    )
    max_body_bytes: int = Field(
        4 * 1024 * 1024, ge=1024, description="Largest request body accepted; larger ones get 413."
    )
    limit_concurrency: int = Field(
        1024,
        ge=1,
        description="Open connections (idle ones included) plus running requests beyond which new requests get "
        "503 at once: bounds what slow or idle clients hold. Keep it above --max-num-seqs + --max-queue.",
    )
    timeout_keep_alive: int = Field(
        5, ge=1, description="Seconds an idle keep-alive connection stays open before the server closes it."
    )
    header_timeout: float = Field(
        20.0,
        gt=0,
        description="Seconds a connection has to send a request's headers (on connecting, and between keep-alive "
        "requests) before the server closes it: a client that trickles headers cannot hold a connection.",
    )
    playground: bool = Field(
        True, description="Serve the chat playground page at / and /playground (--no-playground: 404 there)."
    )
    access_log: bool = Field(False, description="Log every HTTP request (uvicorn access log).")
    record_traffic: Path | None = Field(
        None,
        description="Append one JSON line per finished completion request to this file: the prompt (chat "
        "messages or text) and the output text, with model id and time. It holds USER DATA: protect and delete "
        "it as such. `specd train-draft --prompts FILE` trains a draft head on it. Off by default.",
    )
    record_traffic_max_bytes: ByteSize = Field(
        ByteSize(256 << 20),
        description="--record-traffic: past this size the file becomes FILE.1 (replacing the one before) and a "
        "new one starts (256MiB, 1GB, ...).",
    )
    kv_events_endpoint: str | None = Field(
        None,
        description="Publish KV-cache events (blocks stored and evicted, with their token ids) on this ZMQ "
        "PUB endpoint, in vLLM's format, for routers that route by the blocks each replica holds, e.g. "
        "tcp://127.0.0.1:5557. They carry every tenant's token ids, prompts AND generated outputs: beyond "
        "loopback (tcp://*:5557, a routable address) CURVE keys are required (--kv-events-secret-key, "
        "--kv-events-peer-keys). Off by default.",
    )
    kv_events_mode: Literal["bind", "connect"] = Field(
        "bind",
        description="--kv-events-endpoint: bind it (subscribers connect, as vLLM does) or connect to a listener there.",
    )
    kv_events_secret_key: Path | None = Field(
        None,
        description="--kv-events-endpoint: this server's CURVE key pair, a pyzmq certificate NAME.key_secret "
        "(python -c \"import zmq.auth; zmq.auth.create_certificates('DIR', 'NAME')\"); mode 600. Required beyond "
        "loopback; the stream is then encrypted and only the peers below may receive it.",
    )
    kv_events_peer_keys: Path | None = Field(
        None,
        description="With --kv-events-secret-key: bind mode, a directory of the subscribers' public .key files "
        "(only they are admitted); connect mode, the listener's public .key file.",
    )
    kv_events_topic: str = Field("kv@specd", description="--kv-events-endpoint: the topic frame of every message.")
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field(
        "info", description="Logging verbosity."
    )
    shutdown_timeout: float = Field(
        30.0, ge=0, description="Seconds running requests may take to finish after SIGTERM before they are aborted."
    )

    # -- model --
    model: str | None = Field(
        None,
        description="The target model: a catalogue name (`specd models list`; pulled with `specd models pull`), "
        "a Hub id, a local directory or a .gguf file (default: bundled SmolLM2-135M-Instruct).",
    )
    served_model_name: CommaList = Field(
        default_factory=list,
        description="Name(s) clients put in the 'model' field, comma-separated (default: the model id).",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Weights and activations dtype; auto: bfloat16 on GPUs and on CPUs with native bf16 "
        "(avx512_bf16/amx), else float32.",
    )
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$", description="auto, cpu, cuda or cuda:N.")
    cache_dir: Path | None = Field(
        None,
        description="Where converted GGUF weights and the CPU kernels built for this machine are cached "
        "(default ~/.cache/specd).",
    )
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit) of --model.")
    trust_remote_code: bool = Field(False, description="Allow model code from the Hub repository to run.")
    cpu_attention: Literal["paged", "gather"] = Field(
        "paged",
        description="On CPU, how decode rows read the paged KV cache: paged (a C++ kernel reads each row's blocks "
        "in place, and verify rows' up to the queries a row where it beat the gather when timed at load; built "
        "with specd's CPU kernels for this CPU on first start, ~15 s, cached under --cache-dir; "
        "needs a C++ compiler, else gather with a warning) or gather (each row's blocks copied out for SDPA "
        "every layer).",
    )
    weights: Literal["auto", "bf16", "int8", "int6", "int4"] = Field(
        "auto",
        description="Weight format (CPU): auto keeps a GGUF's quantized tensors quantized (Q4_K as its own blocks, "
        "other 4-bit and smaller types int4, Q6_K and Q5_0 int6, other 5-8 bit types and a 4-bit output projection "
        "int8) and a float checkpoint dense; bf16 serves "
        "every weight dense in --dtype; int8 / int6 / int4 quantize every linear layer (the output projection "
        "int8). Quantized layers keep their dense values too; the timing at load picks, per step size, specd's "
        "weight-only kernel (up to ~16 rows) or the dense one; in float32 the weight-only kernel runs every step "
        "size, so a token's bits do not depend on its step (docs/determinism.md).",
    )
    batch_invariant: bool = Field(
        False,
        description="Give every token the same bits whatever shares its step (CPU, docs/determinism.md): dense "
        "linear layers in fixed 16-row calls (no tuned layouts), quantized ones through their weight-only kernel, "
        "attention for every row in the paged kernel. Output then does not change with the batch or with "
        "speculation, in bf16 too; refused at start where this CPU's BLAS cannot hold it.",
    )
    tune_kernels: bool = Field(
        True,
        description="On CPU, time the two GEMM layouts of the linear layers at load (~9 s for SmolLM2: the decoder "
        "layers and the output projection each get a table) and use the faster per step size; on some CPUs verify "
        "steps of 2-16 tokens run in half the time.",
    )

    # -- speculation --
    draft: Annotated[str | None, ChoicesFrom(registry.choices)] = Field(
        None,
        description=f"Proposer: {registry.help_text()}; or none "
        "(default: the proposer --draft-model or --draft-head implies, else ngram).",
    )
    draft_model: str | None = Field(
        None,
        description="A draft model sharing the target's tokenizer: a catalogue name, Hub id, directory or .gguf file.",
    )
    draft_weights: Literal["auto", "bf16", "int8", "int6", "int4"] = Field(
        "auto",
        description="--draft-model's weight format (CPU). A draft's weights decide only how many of its tokens the "
        "target accepts, never the served text, so auto reads the fewest bytes: int4 for every linear layer, output "
        "projection included (dense where the weight-only kernels do not run); int8 / int6 / int4 likewise; bf16 "
        "dense.",
    )
    draft_head: Path | None = Field(
        None,
        description="--draft eagle: directory of a draft head trained for this target (`specd train-draft`); "
        "a head made for another model is refused at start-up. Default: the bundled head "
        "(models/heads/smollm2-135m-instruct/) when serving the bundled model and it exists.",
    )
    num_speculative_tokens: int | None = Field(
        None,
        ge=0,
        le=MAX_SPEC_TOKENS,
        description="Draft tokens per verify step (K): exact for speculation=true requests, the ceiling of adaptive K "
        "for auto ones (default: the proposer's own, "
        + ", ".join(f"{spec.name} {spec.default_k}" for spec in registry.REGISTRY.values() if spec.selectable)
        + "; prompt-lookup drafts beside a draft model or head, --draft-lookup, 10).",
    )

    spec_disable_batch_size: int | None = Field(
        None,
        ge=0,
        description="Operator's hard cap: requests with speculation 'auto' stop drafting while more than N run; "
        "0 disables auto speculation. Default: no cap, the cost model decides per request and step.",
    )
    suffix_cache_requests: int = Field(
        256,
        ge=0,
        description="--draft suffix: finished outputs kept to draft from, all tenants together; over it the oldest "
        "output of the tenant holding the most goes. Memory: see specd_proposer_cache_nodes (~100 B each).",
    )
    suffix_global: Literal["on", "off"] = Field(
        "on",
        description="--draft suffix: also draft from earlier outputs of the same tenant (the API key's, narrowed "
        "by cache_salt; one tenant's outputs never reach another's drafts); off: each request's own tokens only.",
    )
    draft_lookup: Literal["on", "off"] = Field(
        "on",
        description="--draft draft_model or eagle: a row may draft by prompt lookup (n-gram) instead, in a step "
        "where its lookup draft is expected to accept at least as many tokens (learned per request from free "
        "shadow drafts), so quoting and copying draft long at no draft-forward cost; off: the model or head only.",
    )
    draft_stop_confidence: float = Field(
        0.5,
        ge=0.0,
        lt=1.0,
        description="--draft draft_model or eagle, on a CPU: a row's draft ends after a token the model itself gave "
        "less than this probability (the draft length K is then a cap), and the target verifies only what was "
        "drafted; lossless whatever the value; 0: every row drafts its K.",
    )
    spec_adaptive: bool = Field(True, description="Adapt each request's draft length to its own acceptance history.")
    max_request_speculative_tokens: int = Field(
        MAX_SPEC_TOKENS,
        ge=0,
        le=MAX_SPEC_TOKENS,
        description="Most draft tokens a request may ask for with num_speculative_tokens (more is a 400): a "
        "speculation=true request verifies that many tokens every step whatever the batch.",
    )
    forced_speculation: bool = Field(
        True,
        description="Honour speculation=true (draft every step, whatever the batch); --no-forced-speculation "
        "treats it as auto, so the cost model decides for every request.",
    )

    # -- scheduling --
    max_num_seqs: int = Field(
        64, ge=1, description="Most requests running at once (a concurrency cap; KV memory is set apart, below)."
    )
    max_model_len: int | None = Field(
        None,
        ge=2,
        description=f"Longest prompt + completion in tokens (default: the model's, at most {DEFAULT_MAX_MODEL_LEN}).",
    )
    max_num_batched_tokens: int | None = Field(
        None,
        ge=1,
        description=f"Tokens one engine step may process "
        f"(default: max({DEFAULT_MAX_NUM_BATCHED_TOKENS}, --max-num-seqs)).",
    )
    max_queue: int = Field(256, ge=0, description="Waiting requests beyond which new ones get 503 + Retry-After.")
    max_prep_queue: int = Field(
        64,
        ge=1,
        description="Requests waiting for the preparation thread (tokenizing, chat templates, grammar compiles; "
        "render endpoints included) beyond which new ones get 503 + Retry-After. Tenants take turns on it, and "
        "when it is full the tenant holding the most waiting requests loses its newest first.",
    )

    # -- KV cache --
    block_size: int = Field(16, ge=1, le=1024, description="Token positions per KV cache block.")
    num_kv_blocks: int | None = Field(
        None,
        ge=1,
        description="KV cache blocks to preallocate (default: from --kv-cache-memory, else room for "
        f"{DEFAULT_KV_SEQUENCES} sequences of --max-model-len, or --max-num-seqs if fewer).",
    )
    kv_cache_memory: float | None = Field(
        None,
        gt=0,
        description="KV cache size: bytes (2GiB, 512MB, 1e9) or, at most 1, a fraction of the device's free memory.",
    )
    prefix_caching: bool = Field(
        True,
        description="Reuse the KV of prompt prefixes seen before (automatic prefix caching); "
        "shared only among requests with the same cache_salt (else user).",
    )

    # Test only (absent from --help): honour a request's `fault` field ("raise" | "nan").
    enable_fault_injection: bool = Field(
        False, description="Test only: honour a request's 'fault' field.", json_schema_extra={"hidden": True}
    )

    @field_validator("kv_cache_memory", mode="before")
    @classmethod
    def _parse_bytes(cls, value: Any) -> Any:
        """'2GiB', '512MB', '1e9' or '0.5' (a fraction of free memory)."""
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                return float(_BYTES.validate_python(value))
        return value

    @field_validator("allowed_origins", "served_model_name", "trusted_hosts", "metrics_tenants", mode="before")
    @classmethod
    def _split_commas(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("draft")
    @classmethod
    def _known_proposer(cls, value: str | None) -> str | None:
        if value is not None and value not in registry.choices():
            raise ValueError(f"must be one of {', '.join(registry.choices())}, got {value!r}")
        return value

    @model_validator(mode="after")
    def _check(self) -> Settings:
        needs = self.resolved_proposer_needs
        if needs is not None and not getattr(self, needs):
            flag, bundled = "--" + needs.replace("_", "-"), BUNDLED_OPTIONS.get(needs)
            if bundled is None:
                raise ValueError(f"--draft {self.resolved_draft} needs {flag}")
            if self.model is not None:
                raise ValueError(f"--draft {self.resolved_draft} needs {flag} DIR (one made for --model)")
            if not bundled.is_dir():
                raise ValueError(
                    f"--draft {self.resolved_draft} needs {flag} DIR: the bundled model's default ({bundled}) "
                    "does not exist (`specd train-draft` makes one)"
                )
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("--max-num-batched-tokens must be >= --max-num-seqs")
        if self.metrics_auth and not self.has_keys:
            raise ValueError("--metrics-auth needs an API key (--api-key or --api-keys)")
        if self.metrics_tenants and not self.has_keys:
            raise ValueError("--metrics-tenants needs API keys (--api-keys)")
        self._check_kv_events()
        return self

    def _check_kv_events(self) -> None:
        """KV events leave the machine only encrypted, to listed peers."""
        if (self.kv_events_secret_key is None) != (self.kv_events_peer_keys is None):
            raise ValueError("--kv-events-secret-key and --kv-events-peer-keys go together")
        endpoint = self.kv_events_endpoint
        if endpoint and self.kv_events_secret_key is None and not is_local_endpoint(endpoint):
            raise ValueError(
                f"--kv-events-endpoint {endpoint} reaches beyond this machine, and the events carry every "
                "tenant's prompt and output token ids: give CURVE keys (--kv-events-secret-key, "
                "--kv-events-peer-keys) or publish on a loopback or ipc:// endpoint"
            )

    @property
    def kv_events_keys(self) -> CurveKeys | None:
        if self.kv_events_secret_key is None or self.kv_events_peer_keys is None:
            return None
        return CurveKeys(self.kv_events_secret_key, self.kv_events_peer_keys)

    def check_exposure(self) -> None:
        """Refuse to serve keyless on an address others can reach, unless told to."""
        if not self.has_keys and not self.binds_loopback and not self.allow_unauthenticated:
            raise ValueError(
                f"--host {self.host} is reachable from other machines and no API key is set: set --api-key or "
                "--api-keys, or pass --allow-unauthenticated if every client that can reach it may use it"
            )

    # -- resolved values: `resolved_<field>` is <field> with its default filled in --
    @property
    def resolved_draft(self) -> str:
        """The proposer: --draft, else what --draft-model or --draft-head imply, else ngram."""
        return self.draft or registry.default_method(lambda option: getattr(self, option))

    @property
    def resolved_proposer_needs(self) -> str | None:
        """The option the proposer cannot run without (`registry.ProposerSpec.needs`)."""
        return registry.needs(self.resolved_draft)

    @property
    def resolved_draft_head(self) -> Path | None:
        """A head for the proposer that drafts with one: --draft-head, else the bundled model's."""
        if self.resolved_proposer_needs != "draft_head":
            return None
        return self.draft_head or BUNDLED_OPTIONS["draft_head"]

    @property
    def resolved_num_speculative_tokens(self) -> int:
        """K: the proposer's own default (prompt lookup drafts are free to propose, a draft model's
        cost a forward each, a head's a forward of one layer), unless the operator sets one."""
        if self.num_speculative_tokens is not None:
            return self.num_speculative_tokens
        return registry.default_k(self.resolved_draft)

    @property
    def resolved_max_num_batched_tokens(self) -> int:
        return self.max_num_batched_tokens or max(DEFAULT_MAX_NUM_BATCHED_TOKENS, self.max_num_seqs)

    @property
    def api_key_value(self) -> str | None:
        return self.api_key.get_secret_value() if self.api_key else None

    @property
    def has_keys(self) -> bool:
        return bool(self.api_key_value or self.api_keys)

    @property
    def resolved_metrics_auth(self) -> bool:
        return self.has_keys if self.metrics_auth is None else self.metrics_auth and self.has_keys

    @property
    def binds_loopback(self) -> bool:
        return is_loopback(self.host)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, env_settings, ConfigFileSource(settings_cls)


def load_settings(overrides: dict[str, Any] | None = None, config_file: str | Path | None = None) -> Settings:
    """Settings from `overrides` (the command line), then the environment, then the config file."""
    path = config_file or os.environ.get(CONFIG_ENV)
    with file_values(read_config_file(path) if path else {}):
        return Settings(**(overrides or {}))


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def is_hidden(field: FieldInfo) -> bool:
    extra = field.json_schema_extra
    return isinstance(extra, dict) and bool(extra.get("hidden"))
