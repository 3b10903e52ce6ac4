"""The planning docs stay in step with their data: every GPU product and every calibration record is shown."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def test_hardware_page_lists_every_product_with_its_memory():
    page = (REPO / "docs" / "hardware.md").read_text()
    products = json.loads((REPO / "runner" / "tokenmill_runner" / "facts" / "data" / "gpus.json").read_text())["products"]
    for label, entry in products.items():
        assert f"| `{label}` | {entry['vendor']} | {entry['memory_mib']:,} |" in page, label


def test_throughput_page_shows_every_calibration_record():
    page = (REPO / "docs" / "throughput.md").read_text()
    records = yaml.safe_load((REPO / "docs" / "throughput-calibration.yaml").read_text())["records"]
    missing = [r["id"] for r in records if f"`{r['id']}`" not in page]
    assert missing == []
