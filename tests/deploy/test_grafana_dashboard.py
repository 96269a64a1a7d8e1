"""Grafana: the dashboard's panels, layout, variables and expressions, the PromQL helper that
reads them, and the provisioning files that wire the dashboard and datasource in compose."""

from __future__ import annotations

import json
import re

import pytest

from scheduler.metrics import METRICS
from tests.deploy.artifact_support import DEPLOY, METRIC_REF, PROM_CONFIG, base_metric, compose, load_yaml
from tests.deploy.promql import DASHBOARD, all_exprs, dashboard_exprs

DATASOURCE_UID = "specd-prometheus"
SELECTOR = re.compile(r"\b(specd_\w+)(\{[^}]*\})?(\[[^\]]*\])?")


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_dashboard_panels_have_unique_ids_datasource_and_targets(dashboard):
    panels = dashboard["panels"]
    assert len(panels) >= 15
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], f"panel {panel['title']!r} has no target"
        for target in panel["targets"]:
            assert target["expr"].strip() and target["refId"]
            assert target["datasource"]["uid"] == "${datasource}"
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs))


def test_dashboard_layout_does_not_overlap(dashboard):
    cells = set()
    for panel in dashboard["panels"]:
        g = panel["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, panel["title"]
        xs, ys = range(g["x"], g["x"] + g["w"]), range(g["y"], g["y"] + g["h"])
        mine = {(x, y) for x in xs for y in ys}
        assert not cells & mine, f"panel {panel['title']!r} overlaps another"
        cells |= mine


def test_dashboard_variables(dashboard):
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    datasource = variables["datasource"]
    assert datasource["type"] == "datasource" and datasource["query"] == "prometheus"
    assert datasource["current"]["value"] == DATASOURCE_UID
    model = variables["model"]
    assert model["type"] == "query"
    assert model["definition"] == "label_values(specd_requests_running, model)"
    assert model["query"]["query"] == model["definition"]
    assert model["includeAll"] and model["multi"] and model["allValue"] == ".*"
    assert dashboard["uid"] == "specd" and dashboard["schemaVersion"] >= 38  # Grafana 10+


def test_dashboard_exprs_filter_by_model_and_use_rate_interval():
    for item in dashboard_exprs():
        if item.kind != "panel":
            continue
        selectors = SELECTOR.findall(item.expr)
        assert selectors, item.where
        for metric, labels, window in selectors:
            assert 'model=~"$model"' in labels, f"{item.where}: {metric} not filtered by $model"
            if window:
                assert window == "[$__rate_interval]", f"{item.where}: window {window}"
        assert "rate(" not in item.expr or "$__rate_interval" in item.expr


def test_dashboard_covers_every_design_metric():
    used = {base_metric(m) for item in dashboard_exprs() for m in METRIC_REF.findall(item.expr)}
    assert used <= METRICS.keys(), used - METRICS.keys()
    assert METRICS.keys() <= used, f"not on the dashboard: {METRICS.keys() - used}"


def test_dashboard_has_the_issue_panels(dashboard):
    titles = " | ".join(p["title"].lower() for p in dashboard["panels"])
    for words in ["acceptance rate", "acceptance length", "position", "speculation on/off",
                  "share of speculative", "batch size", "time to first token",
                  "time per output token", "inter-token", "inter-chunk", "end-to-end",
                  "throughput", "running / waiting", "queue time", "kv cache", "phase",
                  "finish reasons"]:  # fmt: skip
        assert words in titles, words
    exprs = " ".join(item.expr for item in dashboard_exprs())
    for q in ("0.5", "0.95", "0.99"):
        assert f"histogram_quantile({q}, sum by (le) (rate(specd_time_to_first_token" in exprs


def test_promql_helper_substitutes_every_variable():
    exprs = all_exprs()
    assert {e.kind for e in exprs} == {"panel", "variable", "record", "alert"}
    for item in exprs:
        text = item.substituted({"model": "m"})
        assert "$" not in text.replace("$labels", "").replace("$value", ""), item.where
        assert "[[" not in text


def test_grafana_provisioning_matches_compose_and_dashboard():
    datasources = load_yaml(DEPLOY / "grafana/provisioning/datasources/prometheus.yml")
    assert datasources["apiVersion"] == 1
    (source,) = datasources["datasources"]
    assert source["type"] == "prometheus" and source["uid"] == DATASOURCE_UID
    assert source["url"] == "http://prometheus:9090"
    scrape = load_yaml(PROM_CONFIG)["global"]["scrape_interval"]
    assert source["jsonData"]["timeInterval"] == scrape

    providers = load_yaml(DEPLOY / "grafana/provisioning/dashboards/specd.yml")
    assert providers["apiVersion"] == 1
    (provider,) = providers["providers"]
    assert provider["type"] == "file"
    mounts = compose()["services"]["grafana"]["volumes"]
    assert f"./deploy/grafana/dashboards:{provider['options']['path']}:ro" in mounts
    assert "./deploy/grafana/provisioning:/etc/grafana/provisioning:ro" in mounts
