"""The FastAPI app: the one place where model, runner, engine and metrics are wired.

The HTTP server comes up at once; the model loads in a worker thread behind
it, so `/health` answers 200 while `/ready` (and every /v1 generation call)
answers 503 until the engine runs. SIGTERM sets `draining` (new requests get
503), uvicorn lets running requests finish for `--shutdown-timeout`, and the
lifespan's exit stops the engine.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from scheduler.engine import AsyncEngine, new_step_thread
from scheduler.metrics import MetricsObserver
from scheduler.scheduler import SchedulerConfig
from server.auth import KeyRing
from server.config import DEFAULT_KV_SEQUENCES, DEFAULT_MAX_MODEL_LEN, Settings
from server.errors import install_error_handlers
from server.kv_events import KVEventPublisher
from server.middleware import (
    ANY_HOST,
    MAX_OTHER_JSON_VALUES,
    AuthMiddleware,
    BodyLimitMiddleware,
    HostCheckMiddleware,
    RequestLogMiddleware,
)
from server.playground import playground_router
from server.protocol import MAX_CHOICES
from server.routes import router
from server.serving import ServingContext
from server.traffic import TrafficLog
from speculation.config import SpecConfig

if TYPE_CHECKING:
    from models.loader import LoadedModel, ModelConfig
    from worker.runner import ModelRunner

logger = logging.getLogger("specd.server")

VERSION = "0.1.0"


@dataclass
class Components:
    """What `build_components` loads (blocking): the runner and the engine's configuration."""

    loaded: LoadedModel
    runner: ModelRunner
    scheduler_config: SchedulerConfig


def model_config(settings: Settings) -> ModelConfig:
    """The target's loading settings, as `serve`, `generate` and `train-draft` all take them."""
    from models.loader import ModelConfig

    return ModelConfig(
        model=settings.model,
        dtype=settings.dtype,
        device=settings.device,
        cache_dir=settings.cache_dir,
        revision=settings.revision,
        trust_remote_code=settings.trust_remote_code,
        tune_kernels=settings.tune_kernels,
        cpu_attention=settings.cpu_attention,
        weights=settings.weights,
        batch_invariant=settings.batch_invariant,
    )


def build_components(settings: Settings) -> Components:
    """Load the target (and draft) and build the runner. Slow; run it off the event loop."""
    from models.chat_escape import plain_encoder
    from models.loader import load_model
    from speculation.config import ProposerConfig
    from worker.builder import build_runner
    from worker.runner import RunnerConfig

    # Serving never runs transformers' own forward: dense weights no step reads are freed.
    loaded = load_model(replace(model_config(settings), keep_dense_weights=False))
    plain_encoder(loaded.tokenizer)  # built here, not on the preparation thread by the first escaped chat
    max_model_len = settings.max_model_len or min(DEFAULT_MAX_MODEL_LEN, loaded.max_position_embeddings)
    runner = build_runner(
        loaded,
        RunnerConfig(
            max_num_seqs=min(settings.max_num_seqs, DEFAULT_KV_SEQUENCES),  # the default pool's size
            max_model_len=max_model_len,
            block_size=settings.block_size,
            num_kv_blocks=settings.num_kv_blocks,
            kv_cache_memory=settings.kv_cache_memory,
            enable_fault_injection=settings.enable_fault_injection,
        ),
        ProposerConfig(
            method=settings.resolved_draft,
            draft_model=settings.draft_model,
            draft_weights=settings.draft_weights,
            draft_head=str(head) if (head := settings.resolved_draft_head) else None,
            suffix_cache_requests=settings.suffix_cache_requests if settings.suffix_global == "on" else 0,
            lookup=settings.draft_lookup == "on",
            stop_confidence=settings.draft_stop_confidence,
        ),
    )
    config = runner.config
    assert config.num_kv_blocks is not None
    pool_tokens = config.num_kv_blocks * config.block_size
    if pool_tokens < config.max_model_len:
        logger.warning("the KV cache holds %d tokens, fewer than max_model_len %d", pool_tokens, config.max_model_len)
    scheduler_config = SchedulerConfig(
        max_num_seqs=settings.max_num_seqs,
        max_model_len=config.max_model_len,
        max_num_batched_tokens=settings.resolved_max_num_batched_tokens,
        max_queue=settings.max_queue,
        eos_token_ids=loaded.eos_token_ids,
        num_kv_blocks=config.num_kv_blocks,
        block_size=config.block_size,
        prefix_caching=settings.prefix_caching,
        cache_identity=f"{served_names(settings)[0]}:{loaded.dtype}",
        spec=SpecConfig(
            num_speculative_tokens=settings.resolved_num_speculative_tokens,
            # Set by the operator, K bounds every draft; else lookup drafts keep prompt lookup's own K.
            lookup_tokens=(
                SpecConfig.lookup_tokens if settings.num_speculative_tokens is None else settings.num_speculative_tokens
            ),
            spec_disable_batch_size=settings.spec_disable_batch_size,
            adaptive=settings.spec_adaptive,
        ),
    )
    return Components(loaded, runner, scheduler_config)


def served_names(settings: Settings) -> list[str]:
    if settings.served_model_name:
        return settings.served_model_name
    if settings.model:
        return [settings.model]
    from models.loader import DEFAULT_MODEL_ID

    return [DEFAULT_MODEL_ID]


@dataclass
class AppState:
    settings: Settings
    metrics: MetricsObserver
    names: list[str]
    keys: KeyRing = field(default_factory=KeyRing)
    on_fatal: Callable[[], None] | None = None
    serving: ServingContext | None = None
    engine: AsyncEngine | None = None
    load_error: str | None = None
    engine_error: str | None = None  # why the engine loop stopped, if it did
    draining: bool = False
    started: float = field(default_factory=time.time)
    step_thread: ThreadPoolExecutor = field(default_factory=new_step_thread)
    kv_events: KVEventPublisher | None = None  # --kv-events-endpoint

    async def start_engine(self) -> None:
        settings = self.settings
        try:
            # Load on the thread that will run every step (see AsyncEngine).
            components = await asyncio.get_running_loop().run_in_executor(self.step_thread, build_components, settings)
        except Exception as exc:  # noqa: BLE001 - any load failure ends the process with a message
            self.load_error = str(exc)
            logger.error("cannot start: %s", exc)
            if self.on_fatal:
                self.on_fatal()
            return
        if settings.kv_events_endpoint:
            self.kv_events = KVEventPublisher(
                settings.kv_events_endpoint,
                settings.kv_events_topic,
                components.scheduler_config.block_size,
                mode=settings.kv_events_mode,
                keys=settings.kv_events_keys,
            )
        engine = AsyncEngine(
            components.runner,
            components.scheduler_config,
            observer=self.metrics.observe,
            step_thread=self.step_thread,
            on_dead=self._engine_died,
            kv_events=self.kv_events.publish if self.kv_events is not None else None,
        )
        await engine.start()
        self.engine = engine
        cfg = components.scheduler_config
        self.metrics.set_cache_config(cfg.block_size, cfg.num_kv_blocks or 0)
        loaded = components.loaded
        fingerprint = f"{VERSION}:{loaded.model_id}:{loaded.dtype}:{engine.scheduler.drafting.method}"
        serving = ServingContext(
            engine=engine,
            tokenizer=loaded.tokenizer,
            model_id=loaded.model_id,
            served_names=self.names,
            max_model_len=engine.scheduler.max_sequence_tokens,
            vocab_size=loaded.vocab_size,
            system_fingerprint="fp_" + hashlib.sha256(fingerprint.encode()).hexdigest()[:10],
            enable_fault_injection=settings.enable_fault_injection,
            shutdown_timeout=settings.shutdown_timeout,
            traffic=TrafficLog(settings.record_traffic, loaded.model_id, settings.record_traffic_max_bytes)
            if settings.record_traffic
            else None,
            max_request_spec_tokens=settings.max_request_speculative_tokens,
            forced_speculation=settings.forced_speculation,
            eos_token_ids=list(loaded.eos_token_ids),
            on_grammar_compiled=self.metrics.observe_grammar_compile,
            max_prep_queue=settings.max_prep_queue,
        )
        await asyncio.to_thread(serving.grammars.prepare)  # before any request can be served
        self.serving = serving
        logger.info(
            "ready: serving %s as %s (max_model_len=%d, max_num_seqs=%d)",
            loaded.model_id,
            ", ".join(self.names),
            engine.scheduler.max_sequence_tokens,
            settings.max_num_seqs,
        )

    def _engine_died(self, reason: str) -> None:
        # Its requests have their errors; /health now answers 503 and the process exits 1,
        # so a supervisor (Docker, Kubernetes, systemd) restarts a clean one.
        self.engine_error = reason
        if self.on_fatal:
            self.on_fatal()

    async def stop_engine(self) -> None:
        self.draining = True
        if self.engine is not None:
            # uvicorn has already waited --shutdown-timeout for open requests; abort what is left.
            await self.engine.stop(timeout=1.0)
            self.metrics.set_queue_state(self.engine.scheduler.queue_state())
        if self.serving is not None:
            self.serving.prep.shutdown()
        if self.serving is not None and self.serving.traffic is not None:
            self.serving.traffic.close()  # the last lines reach the file
        if self.kv_events is not None:
            self.kv_events.close()
        self.step_thread.shutdown(wait=False)


def _on_sighup(callback: Callable[[], None]) -> bool:
    """Run `callback` on the event loop at each SIGHUP (where the platform and thread allow it)."""
    if not hasattr(signal, "SIGHUP"):
        return False
    try:
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, callback)
    except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals here
        return False
    return True


def create_app(settings: Settings, on_fatal: Callable[[], None] | None = None) -> FastAPI:
    """`on_fatal` is called if the model cannot be loaded or the engine loop dies (the CLI then exits 1)."""
    names = served_names(settings)
    keys = KeyRing(settings.api_key_value, settings.api_keys)  # CredentialsError: a bad key or file
    credentials = keys.credentials
    if settings.kv_events_keys is not None:  # CurveError before the model loads, not after
        settings.kv_events_keys.check(settings.kv_events_mode)
    metrics = MetricsObserver(names[0], num_speculative_tokens=settings.resolved_num_speculative_tokens)
    state = AppState(settings=settings, metrics=metrics, names=names, keys=keys, on_fatal=on_fatal)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loading = asyncio.create_task(state.start_engine(), name="specd-load")
        reloads_keys = settings.api_keys is not None and _on_sighup(keys.reload)
        try:
            yield
        finally:
            if reloads_keys:
                asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
            state.draining = True
            if not loading.done():
                loading.cancel()  # a load thread cannot be interrupted: the process exits once it returns
            await asyncio.gather(loading, return_exceptions=True)
            await state.stop_engine()

    # No /docs, /redoc or /openapi.json: the API is OpenAI's, documented in docs/, and a
    # published schema only maps the server for whoever reaches it.
    app = FastAPI(title="specd", version=VERSION, lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.specd = state
    install_error_handlers(app)
    app.include_router(router)
    if settings.playground:
        app.include_router(playground_router())
    # Added innermost first: CORS sees requests first (preflights need no key), then the Host check.
    # A body's JSON values: every prompt's token ids at the longest context (the default's, which
    # bounds the model's own), and the rest.
    max_values = MAX_CHOICES * (settings.max_model_len or DEFAULT_MAX_MODEL_LEN) + MAX_OTHER_JSON_VALUES
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes, max_values=max_values)
    if credentials.required:
        app.add_middleware(
            AuthMiddleware,
            keys=state.keys,
            protect_metrics=settings.resolved_metrics_auth,
            observer_tenants=frozenset(settings.metrics_tenants),
        )
    app.add_middleware(RequestLogMiddleware)
    if settings.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.allowed_origins,
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["*"],
        )
    # Keyless, the Host check is the guard against DNS rebinding whatever the bind: a container
    # binds 0.0.0.0 while its port is published on 127.0.0.1. `*` is the operator opting out.
    if not credentials.required and ANY_HOST not in settings.trusted_hosts:
        app.add_middleware(HostCheckMiddleware, trusted_hosts=tuple(settings.trusted_hosts))
    return app
