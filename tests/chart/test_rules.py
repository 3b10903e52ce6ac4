"""The alerting rules: promtool checks and unit tests, coverage of every alert, annotations, metric names."""

from __future__ import annotations

import re
from typing import Any

import yaml

from .tools import (
    CHART,
    RULE_TESTS,
    RULES,
    documented_metrics,
    known_metric,
    metric_names,
    run,
)

REQUIRED_ALERTS = {"TokenmillThroughputStalled", "TokenmillMetricsAbsent", "TokenmillServerNotReady",
                   "TokenmillErrorRateHigh", "TokenmillTruncationAboveThreshold"}


def _alerts() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def test_promtool_check_rules(promtool: str) -> None:
    res = run([promtool, "check", "rules", str(RULES)])
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"SUCCESS: {len(_alerts())} rules found" in res.stdout


def test_promtool_test_rules(promtool: str) -> None:
    assert RULE_TESTS, "no rule tests in charts/tokenmill/rules/tests/"
    res = run([promtool, "test", "rules", *map(str, RULE_TESTS)])
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("SUCCESS") == len(RULE_TESTS), res.stdout


def test_the_alerts_asked_for_exist() -> None:
    names = [a["alert"] for a in _alerts()]
    assert len(names) == len(set(names)), "duplicate alert names"
    assert REQUIRED_ALERTS <= set(names)


def test_every_alert_has_a_firing_and_a_silent_test() -> None:
    """Each alert is tested firing (with labels) and silent; the tests use the chart's rules file itself."""
    firing: dict[str, int] = {}
    silent: dict[str, int] = {}
    for path in RULE_TESTS:
        doc = yaml.safe_load(path.read_text())
        assert doc["rule_files"] == ["../tokenmill.rules.yaml"], path
        for test in doc["tests"]:
            for case in test.get("alert_rule_test", []):
                target = firing if case.get("exp_alerts") else silent
                target[case["alertname"]] = target.get(case["alertname"], 0) + 1
                for alert in case.get("exp_alerts") or []:
                    assert alert["exp_labels"].get("severity"), f"{path.name}: exp_labels without severity"
    for alert in _alerts():
        assert firing.get(alert["alert"]), f"{alert['alert']} is never tested firing"
        assert silent.get(alert["alert"]), f"{alert['alert']} is never tested silent"


def test_alert_labels_and_runbooks() -> None:
    readme = (CHART / "README.md").read_text()
    anchors = {re.sub(r"[^a-z0-9-]", "", h.strip().lower().replace(" ", "-"))
               for h in re.findall(r"^#+ (.+)$", readme, flags=re.MULTILINE)}
    for alert in _alerts():
        name = alert["alert"]
        assert alert["labels"]["severity"] in ("critical", "warning", "info"), name
        annotations = alert["annotations"]
        assert {"summary", "description", "runbook", "runbook_url"} <= set(annotations), name
        assert annotations["runbook"].strip(), name
        url = annotations["runbook_url"]
        assert url.startswith("https://github.com/tokenmill/tokenmill/blob/main/charts/tokenmill/README.md#"), url
        anchor = url.rsplit("#", 1)[1]
        assert anchor == name.lower(), url
        assert anchor in anchors, f"charts/tokenmill/README.md has no section for {name} (#{anchor})"
        assert re.fullmatch(r"\d+m", alert["for"]), f"{name}: every alert needs a `for` window"


def test_per_resource_alerts_keep_only_resource_labels() -> None:
    """Aggregations strip scrape labels (pod, instance) so an operator restart does not reset a pending alert."""
    for alert in _alerts():
        if alert["alert"] == "TokenmillOperatorMetricsAbsent":
            continue
        expr = alert["expr"]
        assert "on (namespace, dsgen)" in expr, alert["alert"]
        for selector in re.findall(r"tokenmill_\w+", expr):
            assert selector in documented_metrics(), selector


def test_rules_use_only_exported_metrics() -> None:
    for alert in _alerts():
        names = metric_names(alert["expr"])
        assert names, alert["alert"]
        unknown = sorted(n for n in names if not known_metric(n))
        assert not unknown, f"{alert['alert']} uses metrics nobody exports: {unknown} (docs/metrics.md)"
        assert all(n.startswith("tokenmill_") for n in names), "alerts read tokenmill's own series only"
