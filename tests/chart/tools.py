"""Helpers of the chart tests: the cached helm and promtool, rendering, PromQL metric names, docs/metrics.md."""

from __future__ import annotations

import os
import re
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from tokenmill_runner.facts.releases import metrics_in_every_supported_release

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "tokenmill"
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
RULES = CHART / "rules" / "tokenmill.rules.yaml"
RULE_TESTS = sorted((CHART / "rules" / "tests").glob("*.yaml"))
DASHBOARD = CHART / "dashboards" / "tokenmill.json"
METRICS_DOC = REPO / "docs" / "metrics.md"
ARGOCD = REPO / "deploy" / "argocd"
BUILD_TOOLS = REPO / "hack" / "build-tools.sh"

# SGLang's /metrics names that every supported release exports (the releases' metric collectors, scanned per
# release: tokenmill_runner/data/sglang_metrics.json). A name only some releases have (sglang:context_len is 0.5.11+)
# must not be on a dashboard or in an alert that has to work on any of them.
_EVERYWHERE = metrics_in_every_supported_release()
SGLANG_GAUGES = {m.name.removeprefix("sglang:") for m in _EVERYWHERE.values() if m.kind == "gauge"}
SGLANG_COUNTERS = {m.name.removeprefix("sglang:") for m in _EVERYWHERE.values() if m.kind == "counter"}
SGLANG_HISTOGRAMS = {m.name.removeprefix("sglang:") for m in _EVERYWHERE.values() if m.kind == "histogram"}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def tool_env() -> dict[str, str]:
    """Paths of the cached tools; a test failure (never a skip) saying `run make tools` when they are missing."""
    check = subprocess.run(["bash", str(BUILD_TOOLS), "--check"], check=False, capture_output=True, text=True)
    if check.returncode != 0:
        pytest.fail("helm/promtool are not built: run make tools (hack/build-tools.sh)\n" + check.stderr.strip(),
                    pytrace=False)
    out = subprocess.run(["bash", str(BUILD_TOOLS), "--print-env"], check=True, capture_output=True, text=True)
    return dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)


def run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120, **kwargs)


def helm_env(tmp: Path) -> dict[str, str]:
    """Keep helm's cache, config and data out of the home directory."""
    return {**os.environ, "HELM_CACHE_HOME": str(tmp / "cache"), "HELM_CONFIG_HOME": str(tmp / "config"),
            "HELM_DATA_HOME": str(tmp / "data")}


def template(helm: str, *args: str, release: str = "tm", namespace: str = "tokenmill-system",
             env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """`helm template` parsed into a list of objects (None documents dropped)."""
    res = run([helm, "template", release, str(CHART), "--namespace", namespace, *args], env=env)
    assert res.returncode == 0, f"helm template {' '.join(args)} failed:\n{res.stderr}"
    return [d for d in yaml.safe_load_all(res.stdout) if d]


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(objects, kind)
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


# -- PromQL ---------------------------------------------------------------------------------------------------
_KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
             "inf", "nan", "atan2"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (string literals, matchers, ranges and groupings removed)."""
    s = re.sub(r'"(?:\\.|[^"\\])*"', '""', expr)
    s = re.sub(r"'(?:\\.|[^'\\])*'", "''", s)
    s = re.sub(r"`[^`]*`", "``", s)
    s = re.sub(r"\{[^}]*\}", " ", s)
    s = re.sub(r"\[[^\]]*\]", " ", s)
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    s = re.sub(r"\boffset\s+-?[\w$]+", " ", s)
    names = set()
    for m in re.finditer(r"(?<![\w:.$])([A-Za-z_:][A-Za-z0-9_:]*)(\s*\()?", s):
        name, call = m.group(1), m.group(2)
        if call or name.lower() in _KEYWORDS:
            continue
        names.add(name)
    return names


def grafana_to_promql(expr: str) -> str:
    """Replace Grafana's variables with values PromQL accepts ($__rate_interval -> 5m, $dsgen -> x, ...)."""
    expr = re.sub(r"\$\{?__(rate_)?interval\}?", "5m", expr)
    expr = re.sub(r"\$\{?__range\}?", "1h", expr)
    return re.sub(r"\$\{?(\w+)(:\w+)?\}?", "x", expr)


@cache
def documented_metrics() -> dict[str, str]:
    """{metric name: type} from the tables of docs/metrics.md (the contract the exporters follow)."""
    out: dict[str, str] = {}
    for line in METRICS_DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and re.fullmatch(r"`tokenmill_[a-z0-9_]+`", cells[0]):
            out[cells[0].strip("`")] = cells[1]
    assert out, f"no metric table found in {METRICS_DOC}"
    return out


def known_metric(name: str) -> bool:
    """A name the code exports (docs/metrics.md) or SGLang exports, histogram series included."""
    doc = documented_metrics()
    if doc.get(name) in ("counter", "gauge"):
        return True
    for suffix in HISTOGRAM_SUFFIXES:
        if name.endswith(suffix) and doc.get(name.removesuffix(suffix)) == "histogram":
            return True
    if name.startswith("sglang:"):
        base = name.removeprefix("sglang:")
        if base in SGLANG_GAUGES or base in SGLANG_COUNTERS:
            return True
        return any(base.endswith(s) and base.removesuffix(s) in SGLANG_HISTOGRAMS for s in HISTOGRAM_SUFFIXES)
    return False


def promtool_check_exprs(promtool: str, exprs: dict[str, str], tmp: Path) -> subprocess.CompletedProcess[str]:
    """Parse expressions with promtool: one recording rule each in a rules file, `promtool check rules`."""
    groups = {"groups": [{"name": "parse", "rules": [{"record": name, "expr": expr} for name, expr in exprs.items()]}]}
    path = tmp / "exprs.rules.yaml"
    path.write_text(yaml.safe_dump(groups, sort_keys=False, width=10_000))
    return run([promtool, "check", "rules", str(path)])
