"""The range a prediction is expected in: the throughput model's errors on published records of the same hardware
class, each record predicted with the constants refitted without its own source (leave one source out,
hack/bench/bench_planner.py --intervals writes data/intervals.json). Pure.

A hardware class is the memory (HBM, or GDDR at under 2 TB/s) and the link tensor parallelism runs over, because
the fit's errors are skewed by it: every RTX PRO 6000 record is under-predicted while large-batch decode on
HBM/NVLink GPUs is over-predicted. The interval is the class's held-out ratios (published / predicted) from the
smallest to the largest (few records: the extremes, not quantiles), around the point prediction. When no record
of the class runs the layout's kind (DP attention, or plain TP) over that link, the interval is widened
by half its log-spread on each side and says so: "DP attention over PCIe: unmeasured". With no record of the class at
all, the whole set's errors stand in, widened the same way.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from .hardware import Gpu
from .throughput import Layout

HBM_BANDWIDTH = 2e12  # bytes/s: every HBM product the facts list is above, every GDDR one below
UNMEASURED_WIDEN = 0.5  # of the log-spread, added on each side
KIND_NAMES = {"dp-attention": "DP attention", "tp": "TP", "single": "one GPU"}


def hardware_class(gpu: Gpu) -> str:
    return f"{'hbm' if gpu.memory_bandwidth >= HBM_BANDWIDTH else 'gddr'}-{gpu.scale_up.kind}"


def layout_kind(layout: Layout) -> str:
    if layout.tp == 1:
        return "single"
    return "dp-attention" if layout.attention_dp > 1 else "tp"


@dataclass(frozen=True)
class Interval:
    low: float  # multiplier on the predicted rate
    high: float
    basis: str


@cache
def _table() -> dict[str, Any]:
    table: dict[str, Any] = json.loads(resources.files(__package__).joinpath("data/intervals.json").read_text())
    return table


def interval(gpu: Gpu, layout: Layout, table: dict[str, Any] | None = None) -> Interval:
    """The range of the published/predicted ratio for a layout on this GPU."""
    data = table if table is not None else _table()
    cls = hardware_class(gpu)
    kind = layout_kind(layout)
    entry = data["classes"].get(cls)
    ratios = entry["ratios"] if entry else [r for e in data["classes"].values() for r in e["ratios"]]
    logs = [math.log(r) for r in ratios]
    low, high = min(logs), max(logs)
    # The interval always holds the point itself: a class all under-predicted still may not be.
    low, high = min(low, 0.0), max(high, 0.0)
    measured = bool(entry) and kind in entry["kinds"]
    link = "PCIe" if gpu.scale_up.kind == "pcie" else gpu.scale_up.kind
    basis = (f"{len(ratios)} held-out records of {cls if entry else 'every class'} "
             f"({', '.join(sorted(entry['sources'])) if entry else 'no record of ' + cls}), each predicted with the "
             f"constants refitted without its source")
    if not measured and kind != "single":
        spread = (high - low) * UNMEASURED_WIDEN
        low, high = low - spread, high + spread
        basis += f"; {KIND_NAMES[kind]} over {link}: unmeasured, widened by half the spread on each side"
    return Interval(math.exp(low), math.exp(high), basis)


def class_table(rows: list[tuple[str, str, Gpu, Layout, float]]) -> dict[str, Any]:
    """data/intervals.json from held-out rows (record id, source, GPU, layout, published / predicted)."""
    classes: dict[str, dict[str, Any]] = {}
    for ident, source, gpu, layout, ratio in sorted(rows, key=lambda r: r[0]):
        entry = classes.setdefault(hardware_class(gpu), {"records": [], "ratios": [], "kinds": [], "sources": []})
        entry["records"].append(ident)
        entry["ratios"].append(round(ratio, 4))
        if layout_kind(layout) not in entry["kinds"]:
            entry["kinds"].append(layout_kind(layout))
        if source not in entry["sources"]:
            entry["sources"].append(source)
    return {"generated_by": "hack/bench/bench_planner.py --intervals", "classes": classes}
