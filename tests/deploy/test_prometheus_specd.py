"""A real Prometheus scraping a real specd under a workload with speculation on
and off: /metrics is complete and consistent, and every PromQL expression of the
dashboard and the rules parses and returns data."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from scheduler.metrics import METRICS

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from prom_server import PrometheusServer, prometheus_binary  # noqa: E402
from promql import all_exprs  # noqa: E402
from specd_http import finish_server, start_server  # noqa: E402

MODEL = "tiny-spec"

# name -> type as the parser names families (counters without the _total suffix).
DESIGN_METRICS = {name.removesuffix("_total"): kind for name, (kind, _) in METRICS.items()}
PROMPT = "A B C D E F G A B C D E F G A B C D"


def scrape(url: str) -> dict:
    families = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        families[family.name] = family
    return families


def total(families: dict, name: str, **labels) -> float:
    family = families[name]
    return sum(
        s.value
        for s in family.samples
        if s.name == f"{name}_total" and all(s.labels.get(k) == v for k, v in labels.items())
    )


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
    args = [
        "--model", str(tiny_llama_dir), "--served-model-name", MODEL, "--dtype", "float32",
        "--device", "cpu", "--draft", "ngram", "--max-num-seqs", "4", "--spec-disable-batch-size", "4",
    ]  # fmt: skip
    server = start_server(args, tmp_path_factory.mktemp("logs"), "specd-prom")
    yield server
    finish_server(server)


def test_metrics_are_complete_and_consistent(specd):
    before = scrape(specd.url)
    with Workload(specd.url) as work:
        while work.num_requests < 12 and work.thread.is_alive():
            time.sleep(0.1)
    after = scrape(specd.url)
    for name, kind in DESIGN_METRICS.items():
        assert name in after, f"{name} missing from /metrics"
        assert after[name].type == kind, (name, after[name].type)
        for sample in after[name].samples:
            assert sample.labels.get("model") == MODEL, sample
    delta = {
        n: total(after, n) - (total(before, n) if n in before else 0)
        for n in DESIGN_METRICS
        if DESIGN_METRICS[n] == "counter"
    }
    assert delta["specd_generation_tokens"] == work.completion_tokens
    assert delta["specd_requests"] == work.num_requests
    assert 0 < delta["specd_spec_decode_num_accepted_tokens"] <= delta["specd_spec_decode_num_draft_tokens"]
    assert delta["specd_spec_decode_num_drafts"] <= delta["specd_spec_decode_num_draft_tokens"]
    assert total(after, "specd_engine_steps", mode="spec") > 0 and total(after, "specd_engine_steps", mode="plain") > 0
    per_pos = sum(
        s.value for s in after["specd_spec_decode_num_accepted_tokens_per_pos"].samples if s.name.endswith("_total")
    )
    assert per_pos == total(after, "specd_spec_decode_num_accepted_tokens")
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
