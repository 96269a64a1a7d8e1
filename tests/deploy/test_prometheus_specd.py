"""A real Prometheus scraping a real specd under a workload with speculation on
and off: /metrics is complete and consistent, and every PromQL expression of the
dashboard and the rules parses and returns data."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from scheduler.metrics import METRICS
from tests.deploy.prom_server import PrometheusServer, prometheus_binary
from tests.deploy.promql import all_exprs
from tests.support.server import finish_server, serve_args, start_server

MODEL = "tiny-spec"
PROMPT = "A B C D E F G A B C D E F G A B C D"


class Workload:
    """Requests in a background thread (spec on, off and auto; streamed and not) until stopped."""

    def __init__(self, base_url: str):
        self.base_url = base_url
        self.completion_tokens = 0
        self.num_requests = 0
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._guarded, daemon=True)

    def _guarded(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            self.error = exc

    def _run(self) -> None:
        modes = [True, False, "auto"]
        with httpx.Client(base_url=self.base_url, timeout=60) as client:
            for i in range(2000):  # bounded
                if self.stop.is_set():
                    return
                body = {
                    "model": MODEL,
                    "prompt": PROMPT,
                    "max_tokens": 12,
                    "temperature": 0 if i % 2 else 0.8,
                    "ignore_eos": True,
                    "speculation": modes[i % 3],
                }
                response = client.post("/v1/completions", json=body)
                response.raise_for_status()
                self.completion_tokens += response.json()["usage"]["completion_tokens"]
                self.num_requests += 1

    def __enter__(self) -> Workload:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=60)
        if self.error is not None:
            raise self.error


@pytest.fixture(scope="module")
def specd(tiny_llama_dir, tmp_path_factory):
    args = serve_args(
        model=tiny_llama_dir, served_model_name=MODEL, dtype="float32",
        device="cpu", draft="ngram", max_num_seqs=4, spec_disable_batch_size=4,
    )  # fmt: skip
    server = start_server(args, tmp_path_factory.mktemp("logs"), "specd-prom")
    yield server
    finish_server(server)


def test_metrics_are_complete_and_consistent(specd):
    before = specd.metrics()
    with Workload(specd.url) as work:
        while work.num_requests < 12 and work.thread.is_alive():
            time.sleep(0.1)
    after = specd.metrics()
    for name, (kind, _) in METRICS.items():  # the parser names counter families without _total
        family = name.removesuffix("_total") if kind == "counter" else name
        assert family in after, f"{name} missing from /metrics"
        assert after[family].type == kind, (name, after[family].type)
        for sample in after[family].samples:
            assert sample.labels.get("model") == MODEL, sample
    delta = {
        name: after.value(name, default=0.0) - before.value(name, default=0.0)
        for name, (kind, _) in METRICS.items()
        if kind == "counter"
    }
    assert delta["specd_generation_tokens_total"] == work.completion_tokens
    assert delta["specd_requests_total"] == work.num_requests
    accepted = delta["specd_spec_decode_num_accepted_tokens_total"]
    drafted = delta["specd_spec_decode_num_draft_tokens_total"]
    assert 0 < accepted <= drafted
    assert delta["specd_spec_decode_num_drafts_total"] <= drafted
    assert after.value("specd_engine_steps_total", mode="spec") > 0
    assert after.value("specd_engine_steps_total", mode="plain") > 0
    per_pos = after.value("specd_spec_decode_num_accepted_tokens_per_pos_total")
    assert per_pos == after.value("specd_spec_decode_num_accepted_tokens_total")
    for gauge in ("specd_requests_running", "specd_requests_waiting", "specd_kv_cache_usage_ratio"):
        assert after[gauge].samples[0].value == 0  # idle again


@pytest.mark.skipif(prometheus_binary() is None, reason="Debian's prometheus is not installed (.ci/run installs it)")
def test_real_prometheus_evaluates_every_dashboard_and_rule_expression(specd, tmp_path):
    target = specd.url.removeprefix("http://")
    exprs = all_exprs()
    with PrometheusServer(target, workdir=tmp_path) as prom, Workload(specd.url):
        prom.wait_until(lambda: prom.query('count_over_time(up{job="specd"}[1m]) >= 4'), timeout=60, what="scrapes")

        def without_data() -> list[str]:  # prom.query raises on invalid PromQL
            return [
                f"{e.where}: {e.expr}"
                for e in exprs
                if e.kind != "alert" and not prom.query(e.substituted({"model": MODEL}))
            ]

        try:
            prom.wait_until(lambda: not without_data(), timeout=90, what="data for every expression")
        except TimeoutError:
            pytest.fail("no data:\n" + "\n".join(without_data()))
        for e in exprs:
            if e.kind == "alert":
                prom.query(e.substituted({"model": MODEL}))  # parses; fires only when its condition holds
        rules = [r for g in prom.rules() for r in g["rules"]]
        assert rules and all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
        assert prom.targets_health()[target] == "up"
