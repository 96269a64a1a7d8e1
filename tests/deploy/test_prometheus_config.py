"""Prometheus config and rules: the scrape config, recording and alerting rules, and what
`promtool` checks offline (config, rules, the exposition, alert unit tests, the replicas
config). The promtool tests skip where the Debian package `prometheus` is not installed."""

from __future__ import annotations

import re

import yaml

from scheduler.metrics import METRICS, PROTOCOL_METRICS, MetricsObserver
from tests.deploy.artifact_support import (
    DEPLOY,
    METRIC_REF,
    PROM_CONFIG,
    base_metric,
    load_yaml,
    need,
    run,
    workload_steps,
)
from tests.deploy.promql import RULES, rule_exprs


def test_prometheus_config_scrapes_specd_and_loads_rules():
    config = load_yaml(PROM_CONFIG)
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert jobs["specd"]["static_configs"] == [{"targets": ["specd:8000"]}]
    assert jobs["specd"]["metrics_path"] == "/metrics"
    assert config["rule_files"] == ["rules.yml"]
    assert (PROM_CONFIG.parent / "rules.yml").exists()


def test_rules_are_named_and_documented():
    rules = rule_exprs()
    records = {r.name for r in rules if r.kind == "record"}
    assert "specd:spec_decode_acceptance_rate:rate1m" in records
    assert all(re.fullmatch(r"specd:[a-z0-9_]+:[a-z0-9_]+", name) for name in records)
    alerts = {r.name for r in rules if r.kind == "alert"}
    assert alerts == {"SpecdDown", "SpecdAcceptanceCollapsed", "SpecdQueueGrowing",
                      "SpecdHighTimeToFirstToken"}  # fmt: skip
    for group in load_yaml(RULES)["groups"]:
        for rule in group["rules"]:
            if "alert" in rule:
                assert rule["for"] and rule["labels"]["severity"] in ("warning", "critical")
                assert rule["annotations"]["summary"] and rule["annotations"]["description"]
    used = {base_metric(m) for r in rules for m in METRIC_REF.findall(r.expr)}
    assert used <= METRICS.keys(), used - METRICS.keys()


def test_promtool_check_config_and_rules():
    promtool = need("promtool")
    result = run([promtool, "check", "config", str(PROM_CONFIG)])
    assert result.returncode == 0, result.stdout + result.stderr
    result = run([promtool, "check", "rules", str(RULES)])
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_lints_the_exposition():
    promtool = need("promtool")
    observer = MetricsObserver("m", num_speculative_tokens=2)
    for step in workload_steps(0):
        observer.observe(step)
    body, _ = observer.render()
    result = run([promtool, "check", "metrics"], input=body.decode())
    # vLLM's names for the model-server protocol keep their colons: routers look them up so.
    problems = [
        line
        for line in (result.stdout + result.stderr).splitlines()
        if line.strip() and not (line.split()[0] in PROTOCOL_METRICS and "should not contain ':'" in line)
    ]
    assert not problems, problems


# Synthetic series at 1m resolution: the alerts fire when they should and
# stay quiet when they should not.
ALERT_UNIT_TESTS = """
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'up{job="specd", instance="a:8000"}'
        values: '1 1 0x30'
      # Mixed load: speculation on for some steps and off for others.
      - series: 'specd_spec_enabled{model="m", instance="a:8000"}'
        values: '1 0 0 1 0 0 1 0 0 1 0 0 1 0 0 1 0 0 1 0 0 1 0 0 1 0 0 1 0 0 1'
      - series: 'specd_spec_decode_num_accepted_tokens_total{model="m", method="ngram", instance="a:8000"}'
        values: '0+3x30'
      - series: 'specd_spec_decode_num_draft_tokens_total{model="m", method="ngram", instance="a:8000"}'
        values: '0+600x30'
      - series: 'specd_spec_decode_num_drafts_total{model="m", method="ngram", instance="a:8000"}'
        values: '0+150x30'
      - series: 'specd_requests_waiting{model="m", instance="a:8000"}'
        values: '10+1x30'
      - series: 'specd_time_to_first_token_seconds_bucket{model="m", instance="a:8000", le="1"}'
        values: '0x30'
      - series: 'specd_time_to_first_token_seconds_bucket{model="m", instance="a:8000", le="5"}'
        values: '0+60x30'
      - series: 'specd_time_to_first_token_seconds_bucket{model="m", instance="a:8000", le="+Inf"}'
        values: '0+60x30'
    promql_expr_test:
      - expr: specd:spec_decode_acceptance_rate:rate5m
        eval_time: 10m
        exp_samples:
          - labels: 'specd:spec_decode_acceptance_rate:rate5m{model="m", method="ngram"}'
            value: 0.005
      - expr: specd:spec_decode_mean_acceptance_length:rate1m
        eval_time: 10m
        exp_samples:
          - labels: 'specd:spec_decode_mean_acceptance_length:rate1m{model="m", method="ngram"}'
            value: 1.02
    alert_rule_test:
      - eval_time: 20m
        alertname: SpecdDown
        exp_alerts:
          - exp_labels: {severity: critical, job: specd, instance: "a:8000"}
            exp_annotations:
              summary: "specd target a:8000 is down"
              description: "Prometheus has failed to scrape a:8000 for 1 minute."
      - eval_time: 20m
        alertname: SpecdAcceptanceCollapsed
        exp_alerts:
          - exp_labels: {severity: warning, model: m, method: ngram}
            exp_annotations:
              summary: "Speculation on for m but acceptance is 0.5%"
              description: "Method ngram accepted under 10% of draft tokens for 10 minutes while speculation stayed on."
      - eval_time: 20m
        alertname: SpecdQueueGrowing
        exp_alerts:
          - exp_labels: {severity: warning, model: m}
            exp_annotations:
              summary: "specd queue for m keeps growing"
              description: "More than 8 requests waiting and still rising for 10 minutes."
      - eval_time: 20m
        alertname: SpecdHighTimeToFirstToken
        exp_alerts:
          - exp_labels: {severity: warning, model: m}
            exp_annotations:
              summary: "p95 TTFT for m is 4.8s"
              description: "95th percentile time to first token has been above 2s for 10 minutes."
  - interval: 1m
    input_series:
      - series: 'up{job="specd", instance="a:8000"}'
        values: '1x30'
      - series: 'specd_spec_enabled{model="m", instance="a:8000"}'
        values: '0x30'
      - series: 'specd_spec_decode_num_accepted_tokens_total{model="m", method="ngram", instance="a:8000"}'
        values: '0+3x30'
      - series: 'specd_spec_decode_num_draft_tokens_total{model="m", method="ngram", instance="a:8000"}'
        values: '0+600x30'
      - series: 'specd_requests_waiting{model="m", instance="a:8000"}'
        values: '20-1x30'
      - series: 'specd_time_to_first_token_seconds_bucket{model="m", instance="a:8000", le="0.1"}'
        values: '0+60x30'
      - series: 'specd_time_to_first_token_seconds_bucket{model="m", instance="a:8000", le="+Inf"}'
        values: '0+60x30'
    alert_rule_test:
      - {eval_time: 20m, alertname: SpecdDown, exp_alerts: []}
      # Low acceptance while speculation is off is not an alert.
      - {eval_time: 20m, alertname: SpecdAcceptanceCollapsed, exp_alerts: []}
      - {eval_time: 20m, alertname: SpecdQueueGrowing, exp_alerts: []}
      - {eval_time: 20m, alertname: SpecdHighTimeToFirstToken, exp_alerts: []}
"""


def test_promtool_alert_unit_tests(tmp_path):
    promtool = need("promtool")
    tests = yaml.safe_load(ALERT_UNIT_TESTS)
    tests["rule_files"] = [str(RULES)]
    path = tmp_path / "rules_test.yml"
    path.write_text(yaml.safe_dump(tests, sort_keys=False))
    result = run([promtool, "test", "rules", str(path)])
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_checks_the_replicas_config(tmp_path):
    """With the credentials file compose's keygen writes, here in a temporary directory."""
    promtool = need("promtool")
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.replicas.yml").read_text())
    (specd_job,) = [job for job in config["scrape_configs"] if job["job_name"] == "specd"]
    assert specd_job["authorization"]["credentials_file"] == "/run/specd-keys/api-key"
    specd_job["authorization"]["credentials_file"] = str(tmp_path / "api-key")
    (tmp_path / "api-key").write_text("k" * 32 + "\n")
    config["rule_files"] = [str(RULES)]
    path = tmp_path / "prometheus.replicas.yml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    result = run([promtool, "check", "config", str(path)])
    assert result.returncode == 0, result.stdout + result.stderr
