"""The Grafana dashboard: every PromQL expression parses (promtool) and uses only exported metric names."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from .tools import (
    DASHBOARD,
    SGLANG_COUNTERS,
    documented_metrics,
    grafana_to_promql,
    known_metric,
    metric_names,
    promtool_check_exprs,
)

# What the dashboard must show (the list), as a metric each such panel needs.
REQUIRED_METRICS = {
    "progress per DatasetGeneration and dataset": {"tokenmill_dsgen_samples_completed", "tokenmill_dsgen_samples_total"},
    "ETA": {"tokenmill_dsgen_eta_seconds"},
    "tokens/s": {"tokenmill_dsgen_tokens_per_second", "tokenmill_runner_generated_tokens_total",
                 "sglang:gen_throughput"},
    "requests/s": {"tokenmill_runner_requests_total"},
    "in-flight and queued requests": {"tokenmill_runner_in_flight_requests", "sglang:num_running_reqs",
                                      "sglang:num_queue_reqs"},
    "KV-cache token usage": {"sglang:token_usage"},
    "errors by reason": {"tokenmill_runner_failed_samples_total"},
    "latency percentiles": {"tokenmill_runner_request_latency_seconds_bucket",
                            "sglang:e2e_request_latency_seconds_bucket"},
    "completion-length distribution": {"tokenmill_runner_completion_tokens_bucket"},
}


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))  # collapsed rows
    return out


def _expressions() -> dict[str, str]:
    """{id: expr} of every panel target and every query variable (label_values(<selector>, label) -> selector)."""
    dashboard = _dashboard()
    exprs: dict[str, str] = {}
    for panel in _panels(dashboard):
        for target in panel.get("targets", []):
            exprs[f"panel_{panel['id']}_{target['refId']}"] = target["expr"]
    for var in dashboard["templating"]["list"]:
        if var["type"] != "query":
            continue
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query)
        assert m, f"variable {var['name']}: unexpected query {query!r}"
        exprs[f"variable_{var['name']}"] = m.group(1)
    return exprs


def test_dashboard_structure() -> None:
    dashboard = _dashboard()
    assert dashboard["uid"] == "tokenmill" and dashboard["title"] == "tokenmill"
    assert "id" not in dashboard, "no database id in a provisioned dashboard"
    panels = _panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "namespace", "dsgen", "dataset"} <= variables
    for panel in panels:
        if panel["type"] == "row":
            continue
        assert panel["title"] and panel.get("description"), panel["id"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"], panel["title"]
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]


def test_dashboard_uses_only_exported_metrics() -> None:
    documented_metrics()  # fails clearly when docs/metrics.md has no table
    for key, expr in _expressions().items():
        names = metric_names(expr)
        assert names, f"{key}: no metric in {expr!r}"
        unknown = sorted(n for n in names if not known_metric(n))
        assert not unknown, f"{key}: {unknown} are neither in docs/metrics.md nor SGLang metrics: {expr}"


def test_dashboard_counters_and_histograms_are_rated() -> None:
    """Counters and histogram buckets only appear inside rate()/increase() (raw they mean nothing)."""
    def cumulative(name: str) -> bool:
        return (name.endswith("_bucket") or documented_metrics().get(name) == "counter"
                or name.removeprefix("sglang:") in SGLANG_COUNTERS)

    for key, expr in _expressions().items():
        for name in metric_names(expr):
            if cumulative(name):
                pattern = rf"(rate|increase)\(\s*{re.escape(name)}"
                assert len(re.findall(pattern, expr)) == len(re.findall(rf"{re.escape(name)}\b", expr)), (
                    f"{key}: {name} not inside rate()/increase(): {expr}")


def test_dashboard_covers_what_was_asked() -> None:
    used: set[str] = set()
    for expr in _expressions().values():
        used |= metric_names(expr)
    for what, names in REQUIRED_METRICS.items():
        assert names <= used, f"the dashboard lacks {what}: {sorted(names - used)}"


def test_dashboard_expressions_parse(promtool: str, tmp_path: Path) -> None:
    exprs = {f"dashboard:{key}": grafana_to_promql(expr) for key, expr in _expressions().items()}
    for expr in exprs.values():
        assert "$" not in expr, expr
    res = promtool_check_exprs(promtool, exprs, tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in res.stdout


def test_parse_check_catches_a_broken_expression(promtool: str, tmp_path: Path) -> None:
    """The parse check itself works: a broken expression fails it."""
    res = promtool_check_exprs(promtool, {"broken:expr": "sum by (le (rate(x[5m]))"}, tmp_path)
    assert res.returncode != 0


@pytest.mark.parametrize(("expr", "names"), [
    ('sum by (namespace, dsgen) (rate(tokenmill_runner_generated_tokens_total{dsgen=~"$dsgen"}[$__rate_interval]))',
     {"tokenmill_runner_generated_tokens_total"}),
    ('histogram_quantile(0.99, sum by (le) (rate(sglang:e2e_request_latency_seconds_bucket{model_name="a"}[5m])))',
     {"sglang:e2e_request_latency_seconds_bucket"}),
    ("time() - max by (dsgen) (tokenmill_dsgen_last_commit_timestamp_seconds) > 1e3 and on (dsgen) up offset 5m",
     {"tokenmill_dsgen_last_commit_timestamp_seconds", "up"}),
    ('a > on (x) group_left b unless c{l="and or"}', {"a", "b", "c"}),
])
def test_metric_name_extraction(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


# Labels every supported SGLang release puts on the series the dashboard reads: model_name on scheduler and tokenizer
# metrics alike (engine_type is on tokenizer metrics only from 0.5.11, is_streaming from 0.5.17: see
# tokenmill_sim/metrics.py), plus Prometheus' own target labels and histogram buckets.
SGLANG_LABELS_EVERYWHERE = {"model_name", "le", "namespace", "pod", "instance", "job", "service", "container"}


def test_sglang_series_are_selected_by_labels_every_supported_release_sets() -> None:
    checked = 0
    for key, expr in _expressions().items():
        names = metric_names(grafana_to_promql(expr))
        if not names or not all(name.startswith("sglang:") for name in names):
            continue
        checked += 1
        labels = set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)\s*\"", expr))
        for grouping in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
            labels |= {label.strip() for label in grouping.split(",") if label.strip()}
        assert labels <= SGLANG_LABELS_EVERYWHERE, f"{key}: {labels - SGLANG_LABELS_EVERYWHERE} in {expr}"
    assert checked >= 5, "the dashboard's SGLang panels were found"
