"""Prediction intervals from the throughput model's held-out errors per hardware class (data/intervals.json,
written by hack/bench/bench_intervals.py --write from docs/throughput-calibration.yaml): split-conformal at a stated
coverage, and the coverage measured by leaving each source out in turn."""

from __future__ import annotations

import math
from pathlib import Path

import yaml

from tokenmill_runner.facts.hardware import find
from tokenmill_runner.facts.intervals import (
    COVERAGE,
    HeldOut,
    _table,
    conformal_bounds,
    hardware_class,
    interval,
    loso_coverage,
)
from tokenmill_runner.facts.throughput import Layout

REPO = Path(__file__).resolve().parents[2]


def gpus():
    rtx, h200, b200 = find("RTX-PRO-6000"), find("NVIDIA-H200"), find("NVIDIA-B200")
    assert rtx is not None and h200 is not None and b200 is not None
    return rtx, h200, b200


def test_the_table_covers_every_fit_record_of_the_calibration_set_and_carries_its_measured_coverage():
    records = yaml.safe_load((REPO / "docs" / "throughput-calibration.yaml").read_text())["records"]
    fitted = sorted(r["id"] for r in records if r["fit"])
    table = _table()
    stored = sorted(i for entry in table["classes"].values() for i in entry["records"])
    assert stored == fitted, "run: .venv/bin/python hack/bench/bench_intervals.py --write"
    assert table["coverage"] == COVERAGE
    for entry in table["classes"].values():
        assert entry["coverage"]["tested"] == len(entry["records"])


def test_the_conformal_ranks_need_enough_records_for_the_coverage():
    logs = [float(i) for i in range(9)]
    assert conformal_bounds(logs, 0.8) == (0.0, 8.0)  # n = 9: ranks 1 and 9, the extremes
    assert conformal_bounds(logs[:8], 0.8) is None  # n = 8 cannot promise 80 % on each side
    wide = [float(i) for i in range(99)]
    assert conformal_bounds(wide, 0.8) == (9.0, 89.0)  # ranks 10 and 90 of 99


def test_an_interval_says_its_coverage_and_how_often_it_held_when_sources_were_left_out():
    _, h200, _ = gpus()
    found = interval(h200, Layout(8, 8))
    assert found.coverage == COVERAGE and found.tested and found.contained is not None
    assert "unmeasured" not in found.basis and found.low <= 1.0 <= found.high
    assert found.measured.startswith(f"contained {found.contained} of {found.tested} held-out figures")


def test_a_class_with_too_few_records_takes_every_class_widened_and_says_so():
    rtx, _, _ = gpus()
    assert hardware_class(rtx) == "gddr-pcie"
    tp = interval(rtx, Layout(8))
    assert "too few for a 80% interval" in tp.basis
    assert tp.low < 1.0 < tp.high


def test_a_layout_no_record_measures_on_that_link_is_widened_and_says_so():
    rtx, h200, _ = gpus()
    tp, dp = interval(rtx, Layout(8)), interval(rtx, Layout(8, 4))
    assert "DP attention over PCIe: unmeasured" in dp.basis
    assert dp.low <= tp.low and dp.high >= tp.high


def test_loso_coverage_counts_what_the_other_sources_intervals_contain():
    _, h200, _ = gpus()
    # Ten sources agreeing within 10 % and one 3x off: the ten are contained when each is left out, the odd one not.
    rows = [HeldOut(f"r{i}", f"source {i}", h200, Layout(8), math.exp((i - 5) / 50)) for i in range(10)]
    rows.append(HeldOut("odd", "source odd", h200, Layout(8), 3.0))
    contained, tested = loso_coverage(rows, 0.8)["hbm-nvlink"]
    assert tested == 11
    assert contained == 9  # the odd one out, and the most extreme of the ten once the others bound it
