"""A real Prometheus evaluates every dashboard and rule expression against a MetricsObserver
fed synthetic steps: each parses, returns data, and every alert goes pending."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from scheduler.metrics import MetricsObserver
from tests.deploy.artifact_support import need, workload_steps
from tests.deploy.prom_server import PrometheusServer
from tests.deploy.promql import all_exprs
from tests.support.server import free_port

MODEL = "tiny-test-model"


class _MetricsHandler(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server API)
        body, content_type = self.server.observer.render(self.headers.get("Accept"))
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def scraped_observer():
    """A MetricsObserver served on loopback, fed steps from a thread."""
    need("prometheus")
    observer = MetricsObserver(MODEL, num_speculative_tokens=3)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _MetricsHandler)
    server.observer = observer
    stop = threading.Event()

    def feed():  # steps 0.13 s apart: 1 s scrapes see spec and plain steps last
        i = 0
        while not stop.is_set():
            for step in workload_steps(i):
                if stop.wait(0.13):
                    return
                observer.observe(step)
            i += 1

    threads = [threading.Thread(target=server.serve_forever, daemon=True),
               threading.Thread(target=feed, daemon=True)]  # fmt: skip
    for thread in threads:
        thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        stop.set()
        server.shutdown()
        server.server_close()
        for thread in threads:
            thread.join(timeout=5)


def test_real_prometheus_evaluates_every_dashboard_and_rule_expr(scraped_observer, tmp_path):
    dead_target = f"127.0.0.1:{free_port()}"  # nothing listens: SpecdDown has data
    with PrometheusServer(scraped_observer, extra_targets=[dead_target], workdir=tmp_path) as prom:
        prom.wait_until(
            lambda: prom.query('count_over_time(up{job="specd"}[1m]) >= 3'),
            timeout=30, what="three scrapes",
        )  # fmt: skip
        exprs = all_exprs()
        names = [e.name for e in exprs if e.kind == "record"]
        # Recording rules have run at least once over rates with 2+ samples.
        prom.wait_until(lambda: all(prom.query(n) for n in names), timeout=20, what="recorded series")

        def without_data() -> list[str]:  # prom.query raises on bad PromQL
            return [f"{item.where}: {item.expr}" for item in exprs
                    if not prom.query(item.substituted({"model": MODEL}))]  # fmt: skip

        # Alerts need their condition to hold (e.g. a scrape that saw a spec step).
        try:
            prom.wait_until(lambda: not without_data(), timeout=30, what="data")
        except TimeoutError:
            pytest.fail("no data:\n" + "\n".join(without_data()) + "\n" + prom.log())

        (variable,) = [e for e in exprs if e.kind == "variable"]
        assert {r["metric"]["model"] for r in prom.query(variable.substituted())} == {MODEL}
        # A value worth checking end to end: acceptance = 2 / 40 per spec step.
        (rate,) = prom.query(next(e for e in exprs if e.where.startswith("panel 1 ")).substituted())
        assert float(rate["value"][1]) == pytest.approx(0.05)

        groups = prom.rules()
        rules = [r for g in groups for r in g["rules"]]
        assert len(rules) == len([e for e in exprs if e.source == "rules"])
        for rule in rules:
            assert rule["health"] == "ok", (rule["name"], rule.get("lastError"))
        alerts = {"SpecdDown", "SpecdAcceptanceCollapsed", "SpecdQueueGrowing",
                  "SpecdHighTimeToFirstToken"}  # fmt: skip
        # Pending (their `for` is minutes): the rule manager evaluates them as queried.
        prom.wait_until(
            lambda: {a["labels"]["alertname"] for a in prom.alerts()} == alerts,
            timeout=10, what=f"alerts {alerts} pending",
        )  # fmt: skip
        assert prom.targets_health()[scraped_observer] == "up"
    assert prom.pid is None
