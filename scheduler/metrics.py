"""Prometheus metrics: the one observer that turns `StepStats` into samples.

The engine fills one `StepStats` per step and hands it to
`MetricsObserver.observe`; nothing else in specd calls prometheus_client.
Names are listed in `METRICS` below and in docs/design.md ("Metrics"): prefix
`specd_`, label `model` on every series, speculation counters named as vLLM's
so its PromQL carries over.
prometheus_client appends `_total` to counters, so they are declared without
it and exposed exactly as `specd_..._total`.

Useful PromQL (sum over pods and methods as needed):

    # acceptance rate: share of draft tokens the target accepted
    sum(rate(specd_spec_decode_num_accepted_tokens_total[5m]))
      / sum(rate(specd_spec_decode_num_draft_tokens_total[5m]))

    # cost-model calibration: predicted / measured step time (1 = exact), and
    # tokens per step the policy expected / got
    sum(rate(specd_cost_model_predicted_seconds_total[5m]))
      / sum(rate(specd_cost_model_observed_seconds_total[5m]))
    sum(rate(specd_spec_policy_emitted_tokens_total[5m]))
      / sum(rate(specd_spec_policy_expected_tokens_total[5m]))

    # mean acceptance length: tokens emitted per verify step that carried a
    # draft (accepted drafts + the one token the target always adds)
    1 + sum(rate(specd_spec_decode_num_accepted_tokens_total[5m]))
      / sum(rate(specd_spec_decode_num_drafts_total[5m]))

    # prefix cache hit rate: share of looked-up prompt tokens found cached
    sum(rate(specd_prefix_cache_hits_total[5m]))
      / sum(rate(specd_prefix_cache_queries_total[5m]))

    # how a draft model's or head's paused rows fare: share of probes accepted
    sum(rate(specd_spec_decode_num_accepted_probes_total[5m]))
      / sum(rate(specd_spec_decode_num_probes_total[5m]))

    # why speculation-auto rows ran plain, steps per second by reason (cap, no_draft,
    # budget, no_gain, margin, explore)
    sum by (reason) (rate(specd_spec_policy_plain_steps_total[5m]))

    # acceptance at draft position p (share of drafts whose token p survived)
    sum by (position) (rate(specd_spec_decode_num_accepted_tokens_per_pos_total[5m]))
      / ignoring(position) group_left sum(rate(specd_spec_decode_num_drafts_total[5m]))

Histogram buckets (`LATENCY_BUCKETS`) run from 1 ms to 10 min, about three
per decade, so the same dashboards read a GPU (per-token gaps of a few ms)
and a CPU (seconds per token, minutes per request).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder

from scheduler.types import (
    PLAIN_REASONS,
    FinishedRequestStats,
    FinishReason,
    QueueState,
    SpecCounts,
    StepPlan,
    StepStats,
)
from speculation import registry as proposers

# Seconds: 1 ms .. 10 min, ~1-2-5 per decade plus a few midpoints.
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0,
    20.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 512)
# predicted / measured step time: 1.0 is a perfect cost model.
RATIO_BUCKETS = (0.5, 0.67, 0.8, 0.9, 0.95, 1.0, 1.05, 1.1, 1.25, 1.5, 2.0)

# Every series specd exposes: name as scraped -> (type, labels besides `model`).
# The same table is in docs/design.md ("Metrics"); tests check that the
# registry, that table and the dashboard agree with this one.
METRICS: dict[str, tuple[str, tuple[str, ...]]] = {
    "specd_requests_total": ("counter", ("finish_reason",)),
    "specd_prompt_tokens_total": ("counter", ()),
    "specd_generation_tokens_total": ("counter", ()),
    "specd_spec_decode_num_drafts_total": ("counter", ("method",)),
    "specd_spec_decode_num_draft_tokens_total": ("counter", ("method",)),
    "specd_spec_decode_num_accepted_tokens_total": ("counter", ("method",)),
    "specd_spec_decode_num_accepted_tokens_per_pos_total": ("counter", ("position",)),
    "specd_spec_decode_num_probes_total": ("counter", ("method",)),
    "specd_spec_decode_num_accepted_probes_total": ("counter", ("method",)),
    "specd_engine_steps_total": ("counter", ("mode",)),
    "specd_cost_model_predicted_seconds_total": ("counter", ()),
    "specd_cost_model_observed_seconds_total": ("counter", ()),
    "specd_spec_policy_expected_tokens_total": ("counter", ()),
    "specd_spec_policy_emitted_tokens_total": ("counter", ()),
    "specd_spec_policy_plain_steps_total": ("counter", ("reason",)),
    "specd_time_to_first_token_seconds": ("histogram", ()),
    "specd_inter_token_latency_seconds": ("histogram", ()),
    "specd_inter_chunk_latency_seconds": ("histogram", ()),
    "specd_time_per_output_token_seconds": ("histogram", ()),
    "specd_e2e_request_latency_seconds": ("histogram", ()),
    "specd_request_queue_seconds": ("histogram", ()),
    "specd_step_seconds": ("histogram", ("phase",)),
    "specd_batch_size": ("histogram", ()),
    "specd_cost_model_prediction_ratio": ("histogram", ()),
    "specd_prefix_cache_queries_total": ("counter", ()),
    "specd_prefix_cache_hits_total": ("counter", ()),
    "specd_num_preemptions_total": ("counter", ()),
    "specd_requests_running": ("gauge", ()),
    "specd_requests_waiting": ("gauge", ()),
    "specd_requests_preempted": ("gauge", ()),
    "specd_kv_cache_usage_ratio": ("gauge", ()),
    "specd_kv_blocks_used": ("gauge", ()),
    "specd_kv_blocks_capacity": ("gauge", ()),
    "specd_spec_enabled": ("gauge", ()),
    "specd_proposer_cache_nodes": ("gauge", ()),
    "specd_structured_requests_total": ("counter", ("finish_reason",)),
    "specd_grammar_compile_seconds": ("histogram", ()),
    "specd_grammar_mask_seconds": ("histogram", ()),
    "specd_grammar_cut_draft_tokens_total": ("counter", ()),
}

# The model-server protocol routers read (the Kubernetes Gateway API Inference Extension's
# endpoint picker, llm-d, vllm-router): vLLM's names and meaning, label `model_name`, beside
# ours, so a router built for vLLM scores specd replicas unchanged. Name -> (type, labels
# besides `model_name`).
PROTOCOL_METRICS: dict[str, tuple[str, tuple[str, ...]]] = {
    "vllm:num_requests_running": ("gauge", ()),
    "vllm:num_requests_waiting": ("gauge", ()),
    "vllm:kv_cache_usage_perc": ("gauge", ()),
    "vllm:cache_config_info": ("gauge", ("block_size", "num_gpu_blocks")),
    # No LoRA adapters here: one series with empty adapter lists, so a picker that reads it
    # finds it (its value: when it was set, as vLLM's).
    "vllm:lora_requests_info": ("gauge", ("max_lora", "running_lora_adapters", "waiting_lora_adapters")),
}

PHASES = ("prefill", "draft", "verify", "decode")
MODES = ("spec", "plain")


class MetricsObserver:
    """Records engine steps into a private `CollectorRegistry`.

    `spec_methods` and `num_speculative_tokens` only pre-create series at 0
    (so rates exist before the first draft); other methods and positions
    appear when first seen.
    """

    def __init__(
        self,
        model_name: str,
        registry: CollectorRegistry | None = None,
        *,
        spec_methods: Iterable[str] | None = None,
        num_speculative_tokens: int = 0,
    ) -> None:
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry()
        self._declare()
        self._init_series(proposers.methods() if spec_methods is None else spec_methods, num_speculative_tokens)

    def _declare(self) -> None:
        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(name, doc, ("model", *labels), registry=self.registry)

        def histogram(name: str, doc: str, *labels: str, buckets=LATENCY_BUCKETS) -> Histogram:
            return Histogram(name, doc, ("model", *labels), buckets=buckets, registry=self.registry)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, ("model",), registry=self.registry)

        self._requests = counter("specd_requests", "Finished requests.", "finish_reason")
        self._structured = counter(
            "specd_structured_requests",
            "Finished requests under a grammar (structured outputs, tools).",
            "finish_reason",
        )
        self._grammar_compile = histogram(
            "specd_grammar_compile_seconds", "Time to compile and check a request's grammar (cache misses)."
        )
        self._grammar_mask = histogram(
            "specd_grammar_mask_seconds", "Time a step spent computing its grammar rows' token masks."
        )
        self._grammar_cut = counter(
            "specd_grammar_cut_draft_tokens", "Draft tokens cut before verification because the grammar refused them."
        )
        self._prompt_tokens = counter("specd_prompt_tokens", "Prompt tokens prefilled.")
        self._generation_tokens = counter("specd_generation_tokens", "Tokens generated.")
        self._num_drafts = counter("specd_spec_decode_num_drafts", "Verify rows that carried a draft.", "method")
        self._num_draft_tokens = counter("specd_spec_decode_num_draft_tokens", "Draft tokens proposed.", "method")
        self._num_accepted_tokens = counter("specd_spec_decode_num_accepted_tokens", "Draft tokens accepted.", "method")
        self._accepted_per_pos = counter(
            "specd_spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by draft position (1..K).",
            "position",
        )
        self._num_probes = counter(
            "specd_spec_decode_num_probes",
            "Probes graded: one unverified token a draft model or head drafted for a row that ran plain.",
            "method",
        )
        self._num_accepted_probes = counter(
            "specd_spec_decode_num_accepted_probes",
            "Of those, the ones the row's own token confirmed (a sampled row's: its chance of acceptance).",
            "method",
        )
        self._steps = counter("specd_engine_steps", "Engine steps by mode.", "mode")
        self._predicted = counter(
            "specd_cost_model_predicted_seconds", "Step time the speculation policy's cost model predicted."
        )
        self._observed = counter(
            "specd_cost_model_observed_seconds", "Measured time of the same steps (those with a prediction)."
        )
        self._expected_tokens = counter(
            "specd_spec_policy_expected_tokens", "Tokens the policy expected the decode rows to emit."
        )
        self._emitted_tokens = counter("specd_spec_policy_emitted_tokens", "Tokens those decode rows emitted.")
        self._plain_steps = counter(
            "specd_spec_policy_plain_steps",
            "Steps with speculation-auto rows that ran plain, by reason: the operator's cap, no draft, "
            "no token budget left by prefill, no plan beat the plain step, one beat it within the "
            "required edge, or a plain step measured.",
            "reason",
        )
        self._cache_queries = counter(
            "specd_prefix_cache_queries", "Prompt tokens looked up in the prefix cache (at each admission)."
        )
        self._cache_hits = counter("specd_prefix_cache_hits", "Of those, tokens whose KV the cache held.")
        self._preemptions = counter(
            "specd_num_preemptions", "Running requests preempted for KV blocks (recomputed later)."
        )

        self._ttft = histogram("specd_time_to_first_token_seconds", "Time to first token.")
        self._itl_token = histogram(
            "specd_inter_token_latency_seconds",
            "Gap per token: a step emitting n tokens after a gap g records n samples of g/n.",
        )
        self._itl_chunk = histogram(
            "specd_inter_chunk_latency_seconds",
            "Gap between a request's successive emissions (what a streaming client sees).",
        )
        self._tpot = histogram(
            "specd_time_per_output_token_seconds",
            "Per request: (e2e - TTFT) / (output tokens - 1).",
        )
        self._e2e = histogram("specd_e2e_request_latency_seconds", "Request latency, arrival to finish.")
        self._queue = histogram("specd_request_queue_seconds", "Time waiting for admission.")
        self._step = histogram("specd_step_seconds", "Engine step time by phase.", "phase")
        self._batch_size = histogram(
            "specd_batch_size", "Running requests per engine step.", buckets=BATCH_SIZE_BUCKETS
        )
        self._prediction_ratio = histogram(
            "specd_cost_model_prediction_ratio", "Per step: predicted / measured step time.", buckets=RATIO_BUCKETS
        )

        self._running = gauge("specd_requests_running", "Requests in the running batch.")
        self._waiting = gauge("specd_requests_waiting", "Requests waiting for admission (preempted ones included).")
        self._preempted = gauge("specd_requests_preempted", "Waiting requests that were preempted.")
        self._kv_usage = gauge("specd_kv_cache_usage_ratio", "KV blocks held by requests / all blocks.")
        self._kv_blocks_used = gauge("specd_kv_blocks_used", "KV blocks held by requests.")
        self._kv_blocks_capacity = gauge("specd_kv_blocks_capacity", "KV blocks in the pool.")
        self._spec_enabled = gauge("specd_spec_enabled", "1 while the last engine step speculated.")
        self._cache_nodes = gauge(
            "specd_proposer_cache_nodes",
            "Entries the proposer keeps across requests (suffix decoding: nodes and leaves of its trees over "
            "finished outputs, ~100 B each); 0 for a proposer that keeps none.",
        )

        def protocol(name: str, doc: str, *labels: str) -> Gauge:
            return Gauge(name, doc, ("model_name", *labels), registry=self.registry)

        self._vllm_running = protocol("vllm:num_requests_running", "Requests in the running batch (vLLM's name).")
        self._vllm_waiting = protocol("vllm:num_requests_waiting", "Requests waiting for admission (vLLM's name).")
        self._vllm_kv_usage = protocol(
            "vllm:kv_cache_usage_perc", "KV-cache usage, 1 = full (vLLM's name; specd_kv_cache_usage_ratio)."
        )
        self._vllm_cache_info = protocol(
            "vllm:cache_config_info", "KV-cache configuration in labels; value 1 (vLLM's name).",
            "block_size", "num_gpu_blocks",
        )  # fmt: skip
        self._vllm_lora_info = protocol(
            "vllm:lora_requests_info", "LoRA adapters running and waiting (none: specd serves no adapters).",
            "max_lora", "running_lora_adapters", "waiting_lora_adapters",
        )  # fmt: skip
        self._vllm_lora_info.labels(self.model_name, "0", "", "").set(time.time())

    def _init_series(self, spec_methods: Iterable[str], num_speculative_tokens: int) -> None:
        model = self.model_name
        for reason in FinishReason:
            self._requests.labels(model, reason.value)
            self._structured.labels(model, reason.value)
        for counter in (self._prompt_tokens, self._generation_tokens, self._predicted, self._observed,
                        self._expected_tokens, self._emitted_tokens, self._cache_queries, self._cache_hits,
                        self._preemptions, self._grammar_cut):  # fmt: skip
            counter.labels(model)
        self._grammar_compile.labels(model)
        self._grammar_mask.labels(model)
        for method in spec_methods:
            for counter in (self._num_drafts, self._num_draft_tokens, self._num_accepted_tokens):
                counter.labels(model, method)
            if method in proposers.probing_methods():  # their paused rows probe (the others shadow for free)
                self._num_probes.labels(model, method)
                self._num_accepted_probes.labels(model, method)
        for position in range(1, num_speculative_tokens + 1):
            self._accepted_per_pos.labels(model, str(position))
        for mode in MODES:
            self._steps.labels(model, mode)
        for plain_reason in PLAIN_REASONS:
            self._plain_steps.labels(model, plain_reason)
        for phase in PHASES:
            self._step.labels(model, phase)
        for hist in (self._ttft, self._itl_token, self._itl_chunk, self._tpot, self._e2e,
                     self._queue, self._batch_size, self._prediction_ratio):  # fmt: skip
            hist.labels(model)
        for gauge in (self._running, self._waiting, self._preempted, self._kv_usage, self._kv_blocks_used,
                      self._kv_blocks_capacity, self._spec_enabled, self._cache_nodes,
                      self._vllm_running, self._vllm_waiting, self._vllm_kv_usage):  # fmt: skip
            gauge.labels(model).set(0)

    def _observe_plan(self, plan: StepPlan, step_seconds: float) -> None:
        """The policy's plan against what the step did."""
        model = self.model_name
        if plan.predicted_seconds is not None and step_seconds > 0:
            self._predicted.labels(model).inc(plan.predicted_seconds)
            self._observed.labels(model).inc(step_seconds)
            self._prediction_ratio.labels(model).observe(plan.predicted_seconds / step_seconds)
        if plan.expected_tokens:
            self._expected_tokens.labels(model).inc(plan.expected_tokens)
            self._emitted_tokens.labels(model).inc(plan.emitted_tokens)
        if plan.plain_reason is not None:
            self._plain_steps.labels(model, plan.plain_reason).inc()

    def set_cache_config(self, block_size: int, num_blocks: int) -> None:
        """The KV pool's shape, for routers that score prefix-cache affinity by blocks."""
        self._vllm_cache_info.clear()
        self._vllm_cache_info.labels(self.model_name, str(block_size), str(num_blocks)).set(1)

    # -- recording --

    def observe(self, stats: StepStats) -> None:
        """Record one engine step."""
        model = self.model_name
        self._steps.labels(model, stats.mode).inc()
        self._spec_enabled.labels(model).set(1 if stats.mode == "spec" else 0)
        if stats.proposer_cache_nodes is not None:
            self._cache_nodes.labels(model).set(stats.proposer_cache_nodes)
        if stats.grammar_mask_seconds is not None:
            self._grammar_mask.labels(model).observe(stats.grammar_mask_seconds)
        self._grammar_cut.labels(model).inc(stats.grammar_cut_tokens)
        self.set_queue_state(stats.queue)
        self._cache_queries.labels(model).inc(stats.prefix_cache_queries)
        self._cache_hits.labels(model).inc(stats.prefix_cache_hits)
        self._preemptions.labels(model).inc(stats.num_preemptions)
        if stats.batch_size > 0:
            self._batch_size.labels(model).observe(stats.batch_size)
        self._prompt_tokens.labels(model).inc(stats.num_prompt_tokens)
        self._generation_tokens.labels(model).inc(stats.num_generation_tokens)
        if (plan := stats.plan) is not None:
            self._observe_plan(plan, stats.step_seconds)

        for method, counts in stats.spec.items():
            self._observe_spec(method, counts)
        for method, (graded, accepted) in stats.probes.items():
            self._num_probes.labels(model, method).inc(graded)
            self._num_accepted_probes.labels(model, method).inc(accepted)
        for index, num_accepted in enumerate(stats.accepted_per_position):
            self._accepted_per_pos.labels(model, str(index + 1)).inc(num_accepted)
        for phase, seconds in stats.phase_seconds.items():
            self._step.labels(model, phase).observe(seconds)

        itl_token = self._itl_token.labels(model)
        itl_chunk = self._itl_chunk.labels(model)
        for num_tokens, gap in stats.token_gaps:
            if num_tokens <= 0:
                continue
            itl_chunk.observe(gap)
            per_token = gap / num_tokens
            for _ in range(num_tokens):
                itl_token.observe(per_token)

        for seconds in stats.first_token_latencies:
            self._ttft.labels(model).observe(seconds)
        for seconds in stats.queue_seconds:
            self._queue.labels(model).observe(seconds)
        for finished in stats.finished:
            self.record_finished(finished)

    def _observe_spec(self, method: str, counts: SpecCounts) -> None:
        model = self.model_name
        self._num_drafts.labels(model, method).inc(counts.num_drafts)
        self._num_draft_tokens.labels(model, method).inc(counts.num_draft_tokens)
        self._num_accepted_tokens.labels(model, method).inc(counts.num_accepted_tokens)

    def record_finished(self, finished: FinishedRequestStats) -> None:
        """Record a finished request: its finish reason, e2e latency and TPOT."""
        model = self.model_name
        self._requests.labels(model, FinishReason(finished.finish_reason).value).inc()
        if finished.structured:
            self._structured.labels(model, FinishReason(finished.finish_reason).value).inc()
        self._e2e.labels(model).observe(finished.e2e_seconds)
        ttft = finished.ttft_seconds
        if ttft is not None and finished.num_output_tokens > 1:
            tpot = (finished.e2e_seconds - ttft) / (finished.num_output_tokens - 1)
            self._tpot.labels(model).observe(max(tpot, 0.0))

    def observe_grammar_compile(self, seconds: float) -> None:
        self._grammar_compile.labels(self.model_name).observe(seconds)

    def set_queue_state(self, queue: QueueState) -> None:
        """Scheduler gauges; also callable between steps (e.g. when idle)."""
        model = self.model_name
        self._running.labels(model).set(queue.num_running)
        self._waiting.labels(model).set(queue.num_waiting)
        self._preempted.labels(model).set(queue.num_preempted)
        self._kv_usage.labels(model).set(queue.kv_usage)
        self._kv_blocks_used.labels(model).set(queue.kv_blocks_used)
        self._kv_blocks_capacity.labels(model).set(queue.kv_blocks_total)
        self._vllm_running.labels(model).set(queue.num_running)
        self._vllm_waiting.labels(model).set(queue.num_waiting)
        self._vllm_kv_usage.labels(model).set(queue.kv_usage)

    # -- exposition --

    def render(self, accept: str | None = None) -> tuple[bytes, str]:
        """Body and content type for GET /metrics.

        Without `accept` (or for any text/plain Accept) this is the classic
        Prometheus text format 0.0.4; pass the request's Accept header to let
        a scraper that asks for OpenMetrics get it.
        """
        encoder, content_type = choose_encoder(accept or "")
        return encoder(_WithoutCreated(self.registry)), content_type


class _WithoutCreated:
    """A registry view without `*_created` samples.

    The text format would expose them as extra gauge families, and
    `specd_requests_created` reads like a request counter.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self):
        for family in self._registry.collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family
