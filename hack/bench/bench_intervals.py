#!/usr/bin/env python3
"""Do the planner's intervals contain the published figure as often as they say? Leave-one-source-out coverage.

Every fitted record of docs/throughput-calibration.yaml is predicted with the constants refitted without its own
source (bench_planner.leave_one_source_out). Then each source is left out once more: the intervals are rebuilt from
the other sources' held-out ratios and the left-out source's published figures are checked against them. The share
contained, per hardware class, is the interval's measured coverage; it is printed beside the interval the plan shows.

Side by side in one run: the conformal interval at 80 % (facts/intervals.py) and the rule of f9665d2 (the class's
smallest to largest held-out ratio), and the point prediction's bias per class (the median published / predicted
ratio, held out): a class the model gets systematically wrong is fixed in the model, not the interval.

    .venv/bin/python hack/bench/bench_intervals.py [--coverage 0.8] [--baseline] [--write]

--write stores the held-out ratios and the measured coverage in runner/tokenmill_runner/facts/data/intervals.json.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_planner  # noqa: E402
from bench_planner import (  # noqa: E402
    RECORDS,
    fixture_models,
    leave_one_source_out,
    source_of,
)

from tokenmill_runner.facts.calibration import load_records  # noqa: E402
from tokenmill_runner.facts.intervals import (  # noqa: E402
    COVERAGE,
    HeldOut,
    class_table,
    hardware_class,
    layout_kind,
    loso_coverage,
    with_coverage,
)

INTERVALS = Path(__file__).resolve().parents[2] / "runner" / "tokenmill_runner" / "facts" / "data" / "intervals.json"


def held_out_rows(by: str = "document", gddr_term: bool = True) -> list[HeldOut]:
    """The held-out rows; without `gddr_term` the constants are fitted with Calibration.gddr_step_speed pinned at 1
    (the model of f9665d2's structure, for the side-by-side bias)."""
    records = load_records(yaml.safe_load(RECORDS.read_text()), fixture_models())
    if not gddr_term:
        bench_planner.CALIBRATION = replace(bench_planner.CALIBRATION, gddr_step_speed=1.0)
        bench_planner.BOUNDS.pop("gddr_step_speed", None)
        bench_planner.FITTED = tuple(bench_planner.BOUNDS)
    return [HeldOut(row.record.id, source_of(row.record, by), row.record.gpu, row.record.layout,
                    row.record.published / row.predicted)
            for _, rows in leave_one_source_out(records, by) for row in rows]


def minmax_coverage(rows: list[HeldOut]) -> dict[str, tuple[int, int]]:
    """The rule of f9665d2, for comparison: the class's smallest to largest held-out ratio (every class's when the
    class has none), widened by half the log-spread when no record of the class runs the layout's kind."""
    result: dict[str, list[int]] = {}
    for source in sorted({row.source for row in rows}):
        rest = [row for row in rows if row.source != source]
        for row in (r for r in rows if r.source == source):
            cls = hardware_class(row.gpu)
            own = [math.log(r.ratio) for r in rest if hardware_class(r.gpu) == cls]
            logs = own or [math.log(r.ratio) for r in rest]
            low, high = min(min(logs), 0.0), max(max(logs), 0.0)
            kinds = {layout_kind(r.layout) for r in rest if hardware_class(r.gpu) == cls}
            if not own or (layout_kind(row.layout) not in kinds and layout_kind(row.layout) != "single"):
                spread = (high - low) / 2
                low, high = low - spread, high + spread
            counts = result.setdefault(cls, [0, 0])
            counts[0] += low <= math.log(row.ratio) <= high
            counts[1] += 1
    return {cls: (inside, tested) for cls, (inside, tested) in result.items()}


def bias(rows: list[HeldOut], cls: str) -> float:
    return math.exp(statistics.median(math.log(r.ratio) for r in rows if hardware_class(r.gpu) == cls))


def report(rows: list[HeldOut], coverage: float, baseline: list[HeldOut] | None = None) -> str:
    new, old = loso_coverage(rows, coverage), minmax_coverage(rows)
    lines = [f"{'class':<12} {'records':>7} {'sources':>7} {'bias (median pub/pred)':>23} "
             f"{f'{coverage:.0%} conformal':>16} {'f9665d2 min-max':>16}"
             + (f" {'bias without the GDDR term':>27}" if baseline else "")]
    for cls in sorted(new):
        mine = [r for r in rows if hardware_class(r.gpu) == cls]
        (inside, tested), (old_inside, _) = new[cls], old[cls]
        lines.append(f"{cls:<12} {tested:>7} {len({r.source for r in mine}):>7} {bias(rows, cls):>22.2f}x "
                     f"{inside:>5}/{tested} {inside / tested:>5.0%} {old_inside:>7}/{tested} {old_inside / tested:>5.0%}"
                     + (f" {bias(baseline, cls):>26.2f}x" if baseline else ""))
    inside, tested = (sum(v[0] for v in new.values()), sum(v[1] for v in new.values()))
    old_inside = sum(v[0] for v in old.values())
    lines.append(f"{'all':<12} {tested:>7} {len({r.source for r in rows}):>7} {'':>23} "
                 f"{inside:>5}/{tested} {inside / tested:>5.0%} {old_inside:>7}/{tested} {old_inside / tested:>5.0%}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--coverage", type=float, default=COVERAGE, help="the share an interval is built to contain")
    parser.add_argument("--by", choices=("document", "publisher"), default="document", help="what a source is")
    parser.add_argument("--write", action="store_true", help="store the ratios and the coverage (intervals.json)")
    parser.add_argument("--baseline", action="store_true", help="also fit without the GDDR step term and show its "
                        "bias per class beside (twice the time)")
    args = parser.parse_args(argv)
    rows = held_out_rows(args.by)
    baseline = held_out_rows(args.by, gddr_term=False) if args.baseline else None
    print(report(rows, args.coverage, baseline))
    if args.write:
        table = with_coverage(class_table(rows, args.coverage), loso_coverage(rows, args.coverage))
        INTERVALS.write_text(json.dumps(table, indent=1) + "\n")
        print(f"wrote {INTERVALS.relative_to(INTERVALS.parents[4])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
