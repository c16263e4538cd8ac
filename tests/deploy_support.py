"""Helpers shared by the deploy/ tests: where the files are, and which metric names they use."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
PROMETHEUS_DIR = DEPLOY / "prometheus"
RULES = PROMETHEUS_DIR / "llmdiag.rules.yml"
RULE_TESTS = PROMETHEUS_DIR / "llmdiag.rules.test.yml"
SCRAPE_CONFIG = PROMETHEUS_DIR / "prometheus.yml"
DASHBOARD = DEPLOY / "grafana" / "llmdiag-fleet.json"

# A PromQL identifier; label names inside {...}, by (...) and the like are never llmdiag_/process_ names.
_IDENT = re.compile(r"(?<![A-Za-z0-9_:\"$])([A-Za-z_:][A-Za-z0-9_:]*)")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def metric_names(expr: str) -> set[str]:
    """The agent's metric names (``llmdiag_*``, ``process_*``) an expression reads; recording rules excluded."""
    without_strings = _STRING.sub('""', expr)
    return {name for name in _IDENT.findall(without_strings) if name.startswith(("llmdiag_", "process_"))}


def rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def dashboard_exprs() -> list[str]:
    out = []
    for panel in dashboard()["panels"]:
        out.extend(t["expr"] for t in panel.get("targets", []))
    for var in dashboard()["templating"]["list"]:
        if var["type"] == "query":
            out.append(var["definition"])
    return out


def used_metric_names() -> dict[str, set[str]]:
    """metric name -> where it is used (``rules``, ``dashboard``)."""
    used: dict[str, set[str]] = {}
    for rule in rules():
        for name in metric_names(rule["expr"]):
            used.setdefault(name, set()).add(f"rule {rule.get('record') or rule.get('alert')}")
    for expr in dashboard_exprs():
        inner = re.sub(r"label_values\(([^,)]+).*\)", r"\1", expr)
        for name in metric_names(inner):
            used.setdefault(name, set()).add("dashboard")
    return used


def promql_for_api(expr: str) -> str:
    """A dashboard expression with Grafana's variables replaced, as Prometheus's query API takes it."""
    return expr.replace("$__rate_interval", "1m").replace('"$node"', '".*"').replace('"$backend"', '".*"')
