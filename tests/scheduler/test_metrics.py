"""MetricsObserver: hand-made StepStats in, parsed /metrics text out."""

from __future__ import annotations

import math
import re

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics

from scheduler.metrics import LATENCY_BUCKETS, METRICS, PROTOCOL_METRICS, MetricsObserver
from scheduler.types import FinishedRequestStats, FinishReason, QueueState, SpecCounts, StepPlan, StepStats
from tests.support.metrics import Metrics

MODEL = "tiny-llama"


def spec_step() -> StepStats:
    """Two rows speculating with K=3 (ngram) and one with K=2 (draft model)."""
    return StepStats(
        step_seconds=0.05,
        batch_size=3,
        mode="spec",
        queue=QueueState(num_running=3, num_waiting=2, kv_blocks_used=4, kv_blocks_total=16),
        num_prompt_tokens=0,
        num_generation_tokens=7,
        spec={
            "ngram": SpecCounts(num_drafts=2, num_draft_tokens=6, num_accepted_tokens=3),
            "draft_model": SpecCounts(num_drafts=1, num_draft_tokens=2, num_accepted_tokens=1),
        },
        accepted_per_position=[3, 1, 0],
        probes={"draft_model": (2, 1.5)},
        phase_seconds={"draft": 0.01, "verify": 0.04},
        token_gaps=[(3, 0.3), (1, 0.05), (3, 0.06)],
        finished=[
            FinishedRequestStats(FinishReason.STOP, e2e_seconds=2.0, ttft_seconds=0.5,
                                 num_prompt_tokens=5, num_output_tokens=4),
        ],
    )  # fmt: skip


def plain_step() -> StepStats:
    """A prefill of two new requests (first tokens) beside one decode row."""
    return StepStats(
        step_seconds=0.2,
        batch_size=3,
        mode="plain",
        queue=QueueState(num_running=3, num_waiting=1, num_preempted=1, kv_blocks_used=8, kv_blocks_total=16),
        prefix_cache_queries=40,
        prefix_cache_hits=32,
        num_preemptions=1,
        num_prompt_tokens=11,
        num_generation_tokens=3,
        phase_seconds={"prefill": 0.15, "decode": 0.05},
        plan=StepPlan(expected_tokens=0.0, predicted_seconds=None, plain_reason="margin"),
        token_gaps=[(1, 0.2)],
        first_token_latencies=[0.2, 0.3],
        queue_seconds=[0.01, 0.02],
        finished=[
            FinishedRequestStats(FinishReason.LENGTH, e2e_seconds=1.0, ttft_seconds=1.0,
                                 num_prompt_tokens=3, num_output_tokens=1),
        ],
    )  # fmt: skip


def families(observer: MetricsObserver) -> Metrics:
    body, content_type = observer.render()
    assert content_type.startswith("text/plain")
    return Metrics(body.decode())


@pytest.fixture
def observer() -> MetricsObserver:
    return MetricsObserver(MODEL, num_speculative_tokens=3)


def test_every_design_metric_is_exposed_with_its_type_and_labels(observer):
    observer.observe(spec_step())
    observer.observe(plain_step())
    fams = families(observer)
    for name, (kind, labels) in METRICS.items():  # exposed name -> (type, labels besides `model`)
        family = fams.families.get(name.removesuffix("_total") if kind == "counter" else name)
        assert family is not None, f"{name} missing"
        assert family.type == kind, name
        assert family.samples, name
        for sample in family.samples:
            if kind == "counter":
                assert sample.name == name  # exposed exactly as METRICS names it
            assert sample.labels["model"] == MODEL
            extra = set(sample.labels) - {"model", "le"}
            assert extra == set(labels), (name, sample.labels)


def test_the_model_server_protocol_reads_vllms_names_beside_ours(observer):
    """What a router built for vLLM scrapes (queue, running, KV usage, the pool's shape) is there
    under vLLM's names and label, and agrees with specd's own series."""
    observer.set_cache_config(16, 640)
    observer.observe(spec_step())
    fams = families(observer)
    for name, (kind, labels) in PROTOCOL_METRICS.items():
        family = fams.families[name]
        assert family.type == kind and family.samples, name
        for sample in family.samples:
            assert sample.labels["model_name"] == MODEL
            assert set(sample.labels) - {"model_name"} == set(labels), name
    assert fams.one("vllm:num_requests_waiting", model_name=MODEL) == fams.one("specd_requests_waiting", model=MODEL)
    assert fams.one("vllm:num_requests_running", model_name=MODEL) == fams.one("specd_requests_running", model=MODEL)
    assert fams.one("vllm:kv_cache_usage_perc", model_name=MODEL) == fams.one("specd_kv_cache_usage_ratio", model=MODEL)
    (lora,) = fams.families["vllm:lora_requests_info"].samples
    assert (lora.labels["max_lora"], lora.labels["running_lora_adapters"], lora.value > 0) == ("0", "", True)
    info = fams.families["vllm:cache_config_info"].samples
    assert [(s.labels["block_size"], s.labels["num_gpu_blocks"], s.value) for s in info] == [("16", "640", 1.0)]


def test_series_exist_at_zero_before_the_first_step(observer):
    fams = families(observer)
    assert METRICS.keys() <= {f.name + "_total" if f.type == "counter" else f.name for f in fams.families.values()}
    for reason in ("stop", "length", "abort", "error"):
        assert fams.one("specd_requests_total", finish_reason=reason) == 0
    for position in ("1", "2", "3"):
        per_pos = "specd_spec_decode_num_accepted_tokens_per_pos_total"
        assert fams.one(per_pos, position=position) == 0
    for phase in ("prefill", "draft", "verify", "decode"):
        assert fams.one("specd_step_seconds_count", phase=phase) == 0
    assert fams.one("specd_spec_decode_num_draft_tokens_total", method="ngram") == 0
    assert fams.one("specd_spec_decode_num_probes_total", method="eagle") == 0
    assert fams.one("specd_spec_decode_num_accepted_probes_total", method="draft_model") == 0
    for reason in ("cap", "no_draft", "budget", "no_gain", "margin", "explore"):
        assert fams.one("specd_spec_policy_plain_steps_total", reason=reason) == 0
    assert not any(s.name.endswith("_created") for s in fams.samples)


def test_counters_move_by_the_step_amounts(observer):
    observer.observe(spec_step())
    observer.observe(plain_step())
    fams = families(observer)
    assert fams.one("specd_prompt_tokens_total") == 11
    assert fams.one("specd_generation_tokens_total") == 10
    assert fams.one("specd_engine_steps_total", mode="spec") == 1
    assert fams.one("specd_engine_steps_total", mode="plain") == 1
    assert fams.one("specd_requests_total", finish_reason="stop") == 1
    assert fams.one("specd_requests_total", finish_reason="length") == 1
    assert fams.one("specd_requests_total", finish_reason="abort") == 0
    assert fams.one("specd_prefix_cache_queries_total") == 40
    assert fams.one("specd_prefix_cache_hits_total") == 32
    assert fams.one("specd_num_preemptions_total") == 1
    assert fams.one("specd_spec_policy_plain_steps_total", reason="margin") == 1
    assert fams.one("specd_spec_policy_plain_steps_total", reason="no_gain") == 0

    spec = {"method": "ngram"}
    assert fams.one("specd_spec_decode_num_drafts_total", **spec) == 2
    assert fams.one("specd_spec_decode_num_draft_tokens_total", **spec) == 6
    assert fams.one("specd_spec_decode_num_accepted_tokens_total", **spec) == 3
    spec = {"method": "draft_model"}
    assert fams.one("specd_spec_decode_num_drafts_total", **spec) == 1
    assert fams.one("specd_spec_decode_num_draft_tokens_total", **spec) == 2
    assert fams.one("specd_spec_decode_num_accepted_tokens_total", **spec) == 1
    assert fams.one("specd_spec_decode_num_draft_tokens_total", method="prediction") == 0
    assert fams.one("specd_spec_decode_num_probes_total", **spec) == 2
    assert fams.one("specd_spec_decode_num_accepted_probes_total", **spec) == 1.5
    per_pos = [fams.one("specd_spec_decode_num_accepted_tokens_per_pos_total", position=str(p)) for p in (1, 2, 3)]
    assert per_pos == [3, 1, 0]
    # Per-position counts add up to the accepted tokens of all methods.
    assert sum(per_pos) == 3 + 1


def test_latency_histograms(observer):
    observer.observe(spec_step())
    observer.observe(plain_step())
    fams = families(observer)

    # Per token: (3, 0.3) -> 3 x 0.1, (1, 0.05), (3, 0.06) -> 3 x 0.02, (1, 0.2).
    assert fams.one("specd_inter_token_latency_seconds_count") == 8
    assert fams.one("specd_inter_token_latency_seconds_sum") == pytest.approx(0.61)
    assert fams.one("specd_inter_token_latency_seconds_bucket", le="0.02") == 3
    assert fams.one("specd_inter_token_latency_seconds_bucket", le="0.05") == 4
    # Per chunk: one sample per emission, the whole gap.
    assert fams.one("specd_inter_chunk_latency_seconds_count") == 4
    assert fams.one("specd_inter_chunk_latency_seconds_sum") == pytest.approx(0.61)
    assert fams.one("specd_inter_chunk_latency_seconds_bucket", le="0.05") == 1

    assert fams.one("specd_time_to_first_token_seconds_count") == 2
    assert fams.one("specd_time_to_first_token_seconds_sum") == pytest.approx(0.5)
    assert fams.one("specd_request_queue_seconds_count") == 2
    assert fams.one("specd_e2e_request_latency_seconds_count") == 2
    assert fams.one("specd_e2e_request_latency_seconds_sum") == pytest.approx(3.0)
    # TPOT only for the request with > 1 token: (2.0 - 0.5) / (4 - 1).
    assert fams.one("specd_time_per_output_token_seconds_count") == 1
    assert fams.one("specd_time_per_output_token_seconds_sum") == pytest.approx(0.5)

    assert fams.one("specd_step_seconds_count", phase="prefill") == 1
    assert fams.one("specd_step_seconds_count", phase="decode") == 1
    assert fams.one("specd_step_seconds_sum", phase="verify") == pytest.approx(0.04)
    assert fams.one("specd_batch_size_count") == 2
    assert fams.one("specd_batch_size_sum") == 6


def test_buckets_resolve_milliseconds_to_minutes(observer):
    assert LATENCY_BUCKETS[0] <= 0.001 and LATENCY_BUCKETS[-1] >= 300
    assert list(LATENCY_BUCKETS) == sorted(set(LATENCY_BUCKETS))
    # No gap wider than 2.5x between neighbours: quantiles stay within a bucket's width.
    assert max(b / a for a, b in zip(LATENCY_BUCKETS, LATENCY_BUCKETS[1:])) <= 2.5
    fams = families(observer)
    les = [s.labels["le"] for s in fams["specd_time_to_first_token_seconds"].samples
           if s.name.endswith("_bucket")]  # fmt: skip
    assert les[0] == "0.001" and les[-1] == "+Inf"


def test_gauges_follow_the_last_step_and_queue_state(observer):
    observer.observe(spec_step())
    fams = families(observer)
    assert fams.one("specd_spec_enabled") == 1
    assert fams.one("specd_requests_waiting") == 2
    observer.observe(plain_step())
    fams = families(observer)
    assert fams.one("specd_spec_enabled") == 0
    assert fams.one("specd_requests_running") == 3
    assert fams.one("specd_requests_waiting") == 1
    assert fams.one("specd_requests_preempted") == 1
    assert fams.one("specd_kv_cache_usage_ratio") == 0.5
    assert (fams.one("specd_kv_blocks_used"), fams.one("specd_kv_blocks_capacity")) == (8, 16)
    observer.set_queue_state(QueueState(num_running=0, num_waiting=4, kv_blocks_total=16))
    fams = families(observer)
    assert fams.one("specd_requests_running") == 0
    assert fams.one("specd_requests_waiting") == 4


def test_abort_before_start_and_zero_token_rows(observer):
    aborted = FinishedRequestStats(
        FinishReason.ABORT, e2e_seconds=0.7, ttft_seconds=None, num_prompt_tokens=0, num_output_tokens=0
    )
    observer.observe(
        StepStats(step_seconds=0.01, batch_size=0, mode="plain", token_gaps=[(0, 0.5)], finished=[aborted])
    )  # fmt: skip
    fams = families(observer)
    assert fams.one("specd_requests_total", finish_reason="abort") == 1
    assert fams.one("specd_e2e_request_latency_seconds_sum") == pytest.approx(0.7)
    assert fams.one("specd_time_per_output_token_seconds_count") == 0
    assert fams.one("specd_inter_chunk_latency_seconds_count") == 0
    assert fams.one("specd_batch_size_count") == 0  # an idle step is not a batch


def test_new_positions_and_methods_appear_when_first_seen():
    observer = MetricsObserver(MODEL, spec_methods=(), num_speculative_tokens=0)
    step = spec_step()
    step.spec = {"prediction": SpecCounts(1, 5, 5)}
    step.accepted_per_position = [1, 1, 1, 1, 1]
    observer.observe(step)
    fams = families(observer)
    assert fams.one("specd_spec_decode_num_accepted_tokens_total", method="prediction") == 5
    assert fams.one("specd_spec_decode_num_accepted_tokens_per_pos_total", position="5") == 1
    methods = {s.labels["method"] for s in fams["specd_spec_decode_num_drafts"].samples}
    assert methods == {"prediction"}


def test_observers_have_separate_registries_and_openmetrics():
    first, second = MetricsObserver("a"), MetricsObserver("b")
    first.observe(spec_step())
    assert families(first).one("specd_generation_tokens_total", model="a") == 7
    assert families(second).one("specd_generation_tokens_total", model="b") == 0
    body, content_type = first.render("application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text")
    fams = {f.name: f for f in parse_openmetrics(body.decode())}
    assert fams["specd_spec_decode_num_draft_tokens"].type == "counter"
    assert not math.isnan(fams["specd_spec_enabled"].samples[0].value)


def test_the_metric_table_in_the_docs_is_the_one_in_code():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "design.md").read_text()
    rows = re.findall(r"^\| `(specd_\w+)` \| (\w+) \|([\w, ]*)\|", doc, re.M)
    documented = {name: (kind, tuple(x.strip() for x in labels.split(",") if x.strip())) for name, kind, labels in rows}
    assert documented == METRICS
