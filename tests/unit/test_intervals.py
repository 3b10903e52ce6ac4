"""Prediction intervals from the throughput model's held-out errors per hardware class (data/intervals.json,
written by hack/bench/bench_planner.py --intervals from docs/throughput-calibration.yaml)."""

from __future__ import annotations

from pathlib import Path

import yaml

from tokenmill_runner.facts.hardware import find
from tokenmill_runner.facts.intervals import _table, hardware_class, interval
from tokenmill_runner.facts.throughput import Layout

REPO = Path(__file__).resolve().parents[2]


def test_the_table_covers_every_fit_record_of_the_calibration_set():
    records = yaml.safe_load((REPO / "docs" / "throughput-calibration.yaml").read_text())["records"]
    fitted = sorted(r["id"] for r in records if r["fit"])
    stored = sorted(i for entry in _table()["classes"].values() for i in entry["records"])
    assert stored == fitted, "run: .venv/bin/python hack/bench/bench_planner.py --intervals"


def test_classes_follow_memory_and_link_and_the_rtx_pro_records_say_it_is_under_predicted():
    rtx, h200 = find("RTX-PRO-6000"), find("NVIDIA-H200")
    assert rtx is not None and h200 is not None
    assert hardware_class(rtx) == "gddr-pcie" and hardware_class(h200) == "hbm-nvlink"
    tp = interval(rtx, Layout(8))
    assert tp.low == 1.0 < tp.high  # every held-out RTX PRO 6000 record ran faster than predicted
    assert "unmeasured" not in tp.basis


def test_a_layout_no_record_measures_on_that_link_is_widened_and_says_so():
    rtx, h200 = find("RTX-PRO-6000"), find("NVIDIA-H200")
    assert rtx is not None and h200 is not None
    tp, dp = interval(rtx, Layout(8)), interval(rtx, Layout(8, 4))
    assert "DP attention over PCIe: unmeasured" in dp.basis
    assert dp.low < tp.low and dp.high > tp.high
    nvlink_dp = interval(h200, Layout(8, 8))  # DP attention is measured on NVLink
    assert "unmeasured" not in nvlink_dp.basis and nvlink_dp.low <= 1.0 <= nvlink_dp.high
