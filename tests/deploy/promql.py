"""Every PromQL expression the deploy artifacts ask Prometheus to run.

`all_exprs()` gathers the dashboard's panel targets and variable queries and
the rules' recording and alerting expressions; `PromQLExpr.substituted()`
replaces Grafana variables so the text can go to Prometheus' HTTP API as is.
Alert expressions return data only while their condition holds: callers
should check those parse (and evaluate) rather than expect samples.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

from tests.support import REPO

DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "specd.json"
RULES = REPO / "deploy" / "prometheus" / "rules.yml"

# What Grafana would put in for each variable (`$__rate_interval` assumes a
# 1-15 s scrape interval, which always gives >= 4 samples per window).
DEFAULT_VARIABLES: Mapping[str, str] = {
    "model": ".*",
    "datasource": "specd-prometheus",
    "__rate_interval": "1m",
    "__interval": "15s",
    "__interval_ms": "15000",
    "__range": "5m",
    "__range_s": "300",
    "__range_ms": "300000",
}

_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\[\[(\w+)(?::\w+)?\]\]|\$(\w+)")
_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(?:(.+?)\s*,\s*)?(\w+)\s*\)\s*$")
_QUERY_RESULT = re.compile(r"^\s*query_result\((.*)\)\s*$", re.S)


@dataclass(frozen=True)
class PromQLExpr:
    source: str  # "dashboard" or "rules"
    kind: str  # "panel", "variable", "record" or "alert"
    where: str  # human-readable location, for failure messages
    expr: str  # as written, Grafana variables included
    name: str | None = None  # the recorded series or alert name, for rules

    def substituted(self, variables: Mapping[str, str] | None = None) -> str:
        return substitute(self.expr, variables)


def substitute(expr: str, variables: Mapping[str, str] | None = None) -> str:
    """Replace `$var`, `${var}`, `${var:fmt}` and `[[var]]`; unknown names raise KeyError."""
    values = {**DEFAULT_VARIABLES, **(variables or {})}

    def replace(match: re.Match) -> str:
        name = next(g for g in match.groups() if g)
        if name not in values:
            raise KeyError(f"no value for Grafana variable ${name} in {expr!r}")
        return values[name]

    return _VARIABLE.sub(replace, expr)


def variable_query_to_promql(query: str) -> str | None:
    """Grafana's Prometheus variable functions as a PromQL query, or None."""
    if match := _LABEL_VALUES.match(query):
        selector, label = match.groups()
        selector = selector or f'{{{label}=~".+"}}'
        return f"count by ({label}) ({selector})"
    if match := _QUERY_RESULT.match(query):
        return match.group(1)
    return None


def _panels(panels: list[dict]):
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))  # collapsed rows


def dashboard_exprs(path: Path = DASHBOARD) -> list[PromQLExpr]:
    dashboard = json.loads(path.read_text())
    found = []
    for panel in _panels(dashboard.get("panels", [])):
        for target in panel.get("targets", []):
            if target.get("expr"):
                title, ref = panel.get("title"), target.get("refId")
                where = f"panel {panel.get('id')} {title!r} target {ref}"
                found.append(PromQLExpr("dashboard", "panel", where, target["expr"]))
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") != "query":
            continue
        query = variable.get("query")
        if isinstance(query, dict):
            query = query.get("query")
        promql = variable_query_to_promql(query or variable.get("definition", ""))
        if promql:
            where = f"variable ${variable['name']} ({query})"
            found.append(PromQLExpr("dashboard", "variable", where, promql, variable["name"]))
    return found


def rule_exprs(path: Path = RULES) -> list[PromQLExpr]:
    found = []
    for group in yaml.safe_load(path.read_text())["groups"]:
        for rule in group["rules"]:
            kind = "record" if "record" in rule else "alert"
            name = rule[kind]
            where = f"rules group {group['name']!r} {kind} {name}"
            found.append(PromQLExpr("rules", kind, where, rule["expr"].strip(), name))
    return found


def all_exprs() -> list[PromQLExpr]:
    return dashboard_exprs() + rule_exprs()


if __name__ == "__main__":
    for item in all_exprs():
        print(f"# {item.where}\n{item.substituted()}\n")
