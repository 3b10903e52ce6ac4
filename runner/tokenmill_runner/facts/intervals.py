"""The range a prediction is expected in, built to contain the published figure at a stated coverage. Pure.

The evidence is the throughput model's held-out errors: each fitted record of docs/throughput-calibration.yaml
predicted with the constants refitted without its own source (leave one source out), as published / predicted,
grouped by hardware class: the memory (HBM, or GDDR at under 2 TB/s) and the link tensor parallelism runs over
(data/intervals.json, written by hack/bench/bench_intervals.py --write).

The interval is a split-conformal one: for a stated coverage c (COVERAGE, 80 %) and n held-out ratios of the class,
it runs from the k-th smallest to the m-th smallest, k = floor((n + 1)(1 - c) / 2) and m = ceil((n + 1)(1 + c) / 2),
the ranks at which a new figure exchangeable with those n falls inside with probability at least c. A class with too
few records for those ranks (k < 1 or m > n) takes every class's ratios instead, widened by half their log-spread on
each side, and says so; so does a layout whose kind (DP attention, or plain TP) no record of the class measures
over that link ("DP attention over PCIe: unmeasured").

Whether the construction holds is measured, not assumed (`loso_coverage`): each public source is left out in turn,
the intervals are rebuilt from the other sources' ratios, and the left-out source's ratios are checked against
them. The share contained per class is stored beside the ratios and printed beside every interval.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from .hardware import Gpu
from .throughput import Layout

COVERAGE = 0.8  # the share of published figures an interval is built to contain
UNMEASURED_WIDEN = 0.5  # of the log-spread, added on each side
KIND_NAMES = {"dp-attention": "DP attention", "tp": "TP", "single": "one GPU"}


def hardware_class(gpu: Gpu) -> str:
    return f"{gpu.memory_kind}-{gpu.scale_up.kind}"


def layout_kind(layout: Layout) -> str:
    if layout.tp == 1:
        return "single"
    return "dp-attention" if layout.attention_dp > 1 else "tp"


@dataclass(frozen=True)
class Interval:
    low: float  # multiplier on the predicted rate
    high: float
    basis: str
    coverage: float = COVERAGE  # what the interval is built to contain
    contained: int | None = None  # held-out figures of the class it contained when their source was left out
    tested: int | None = None  # of how many

    @property
    def measured(self) -> str:
        """'contained 23 of 27 held-out figures (85 %)', or '' when the table carries no measurement."""
        if not self.tested or self.contained is None:
            return ""
        return (f"contained {self.contained} of {self.tested} held-out figures "
                f"({self.contained / self.tested:.0%})")


@dataclass(frozen=True)
class HeldOut:
    """One fitted record predicted without its own source: its published / predicted ratio."""

    record: str
    source: str
    gpu: Gpu
    layout: Layout
    ratio: float


@cache
def _table() -> dict[str, Any]:
    table: dict[str, Any] = json.loads(resources.files(__package__).joinpath("data/intervals.json").read_text())
    return table


def conformal_bounds(logs: Sequence[float], coverage: float) -> tuple[float, float] | None:
    """The split-conformal ranks of `logs` for a two-sided interval at `coverage`, or None when there are too
    few values for them."""
    n = len(logs)
    # The ranks are whole numbers computed in floats: 10 x 0.9 is 9.000000000000002, whose ceiling is not 9.
    low_rank = math.floor((n + 1) * (1 - coverage) / 2 + 1e-9)
    high_rank = math.ceil((n + 1) * (1 + coverage) / 2 - 1e-9)
    if low_rank < 1 or high_rank > n:
        return None
    ordered = sorted(logs)
    return ordered[low_rank - 1], ordered[high_rank - 1]


def interval(gpu: Gpu, layout: Layout, table: dict[str, Any] | None = None,
             coverage: float | None = None) -> Interval:
    """The range of the published/predicted ratio for a layout on this GPU."""
    data = table if table is not None else _table()
    target = coverage if coverage is not None else data.get("coverage", COVERAGE)
    cls = hardware_class(gpu)
    kind = layout_kind(layout)
    entry = data["classes"].get(cls)
    every = [math.log(r) for e in data["classes"].values() for r in e["ratios"]]
    own = [math.log(r) for r in entry["ratios"]] if entry else []
    bounds = conformal_bounds(own, target)
    link = "PCIe" if gpu.scale_up.kind == "pcie" else gpu.scale_up.kind
    widen = False
    if bounds is not None:
        basis = (f"{len(own)} held-out records of {cls} from {len(entry['sources'])} sources, each predicted "
                 "with the constants refitted without its source")
    else:
        widen = True
        pooled = conformal_bounds(every, target) or (min(every), max(every))
        bounds = pooled
        basis = (f"{len(own)} held-out records of {cls}, too few for a {target:.0%} interval: the {len(every)} of "
                 "every class, widened by half their spread on each side")
    low, high = min(bounds[0], 0.0), max(bounds[1], 0.0)  # the interval always holds the point itself
    if entry is None or (kind not in entry["kinds"] and kind != "single"):
        widen = True
        basis += f"; {KIND_NAMES[kind]} over {link}: unmeasured, widened by half the spread on each side"
    if widen:
        spread = (high - low) * UNMEASURED_WIDEN
        low, high = low - spread, high + spread
    measured = (entry or {}).get("coverage") or {}
    return Interval(math.exp(low), math.exp(high), basis, target, measured.get("contained"), measured.get("tested"))


def class_table(rows: Sequence[HeldOut], coverage: float = COVERAGE) -> dict[str, Any]:
    """data/intervals.json from held-out rows (without the coverage measurement: `with_coverage` adds it)."""
    classes: dict[str, dict[str, Any]] = {}
    for row in sorted(rows, key=lambda r: r.record):
        entry = classes.setdefault(hardware_class(row.gpu), {"records": [], "ratios": [], "kinds": [], "sources": []})
        entry["records"].append(row.record)
        entry["ratios"].append(round(row.ratio, 4))
        if layout_kind(row.layout) not in entry["kinds"]:
            entry["kinds"].append(layout_kind(row.layout))
        if row.source not in entry["sources"]:
            entry["sources"].append(row.source)
    return {"generated_by": "hack/bench/bench_intervals.py --write", "coverage": coverage, "classes": classes}


def loso_coverage(rows: Sequence[HeldOut], coverage: float = COVERAGE) -> dict[str, tuple[int, int]]:
    """Per hardware class, (contained, tested): each source left out in turn, its held-out ratios checked against
    the intervals the other sources' ratios give."""
    result: dict[str, list[int]] = {}
    for source in sorted({row.source for row in rows}):
        table = class_table([row for row in rows if row.source != source], coverage)
        for row in rows:
            if row.source != source:
                continue
            found = interval(row.gpu, row.layout, table, coverage)
            counts = result.setdefault(hardware_class(row.gpu), [0, 0])
            counts[0] += found.low <= row.ratio <= found.high
            counts[1] += 1
    return {cls: (inside, tested) for cls, (inside, tested) in result.items()}


def with_coverage(table: dict[str, Any], measured: dict[str, tuple[int, int]]) -> dict[str, Any]:
    """The table with each class's measured coverage beside its ratios."""
    classes = {cls: {**entry, "coverage": {"contained": measured[cls][0], "tested": measured[cls][1]}}
               if cls in measured else entry for cls, entry in table["classes"].items()}
    return {**table, "classes": classes}
