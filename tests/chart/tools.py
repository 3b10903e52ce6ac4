"""Helpers of the chart tests: the cached helm and promtool, rendering, PromQL metric names, README.md#metrics."""

from __future__ import annotations

import os
import re
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "tokenmill"
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
RULES = CHART / "rules" / "tokenmill.rules.yaml"
RULE_TESTS = sorted((CHART / "rules" / "tests").glob("*.yaml"))
DASHBOARD = CHART / "dashboards" / "tokenmill.json"
METRICS_DOC = REPO / "README.md"
ARGOCD = REPO / "deploy" / "argocd"
BUILD_TOOLS = REPO / "hack" / "build-tools.sh"

# SGLang's /metrics names (reference/sglang.md §4: scheduler and tokenizer collectors, v0.5.6 and HEAD).
SGLANG_GAUGES = {
    "num_running_reqs", "num_queue_reqs", "num_grammar_queue_reqs", "gen_throughput", "cache_hit_rate", "token_usage",
    "full_token_usage", "swa_token_usage", "mamba_usage", "num_used_tokens", "kv_available_tokens",
    "kv_evictable_tokens", "kv_used_tokens", "decode_sum_seq_lens", "utilization", "fwd_occupancy", "new_token_ratio",
    "is_cuda_graph", "num_retracted_reqs", "num_paused_reqs", "spec_accept_length", "spec_accept_rate",
    "max_total_num_tokens", "max_running_requests_under_SLO", "engine_startup_time", "engine_load_weights_time",
    "page_size", "num_pages", "context_len", "startup_available_gpu_memory_gb", "http_requests_active",
}
SGLANG_COUNTERS = {
    "prompt_tokens_total", "generation_tokens_total", "cached_tokens_total", "num_requests_total",
    "num_aborted_requests_total", "num_so_requests_total", "spec_verify_calls_total", "num_retracted_requests_total",
    "num_retracted_input_tokens_total", "num_retracted_output_tokens_total", "cuda_graph_passes_total",
    "realtime_tokens_total", "forward_execution_seconds_total", "http_requests_total", "http_responses_total",
}
SGLANG_HISTOGRAMS = {
    "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
    "prompt_tokens_histogram", "uncached_prompt_tokens_histogram", "generation_tokens_histogram",
    "queue_time_seconds", "per_stage_req_latency_seconds", "get_loads_duration_seconds", "func_latency_seconds",
}
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
    """{metric name: type} from the tables of README.md#metrics (the contract the exporters follow)."""
    out: dict[str, str] = {}
    for line in METRICS_DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and re.fullmatch(r"`tokenmill_[a-z0-9_]+`", cells[0]):
            out[cells[0].strip("`")] = cells[1]
    assert out, f"no metric table found in {METRICS_DOC}"
    return out


def known_metric(name: str) -> bool:
    """A name the code exports (README.md#metrics) or SGLang exports, histogram series included."""
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
