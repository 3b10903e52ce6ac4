"""Every exported metric is documented in docs/metrics.md with its type, and every documented one is exported."""

from __future__ import annotations

import re
from pathlib import Path

from tokenmill_operator import metrics as operator_metrics
from tokenmill_runner.metrics import RunnerMetrics

METRICS_DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def documented() -> dict[str, tuple[str, set[str]]]:
    """{name: (type, labels)} from the metric tables of docs/metrics.md."""
    out = {}
    for line in METRICS_DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and re.fullmatch(r"`tokenmill_[a-z0-9_]+`", cells[0]):
            labels = {label.strip() for label in cells[2].split(",") if label.strip() not in ("—", "")}
            out[cells[0].strip("`")] = (cells[1], labels)
    return out


def exported() -> dict[str, tuple[str, set[str]]]:
    registries = [RunnerMetrics.create("d", "n", 0).registry, operator_metrics.REGISTRY]
    out = {}
    for registry in registries:
        for collector in list(registry._collector_to_names):  # noqa: SLF001 - no public way to list collectors
            name = collector._name  # noqa: SLF001
            kind = collector._type  # noqa: SLF001
            out[name + ("_total" if kind == "counter" else "")] = (kind, set(collector._labelnames))  # noqa: SLF001
    return out


def test_exported_metrics_are_the_documented_ones():
    assert exported() == documented()
