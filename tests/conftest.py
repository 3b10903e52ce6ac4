"""Fixtures shared by every test layer."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]
DEMO_MODEL = REPO / "examples" / "demo-model"


@pytest.fixture(scope="session")
def demo_model() -> Path:
    return DEMO_MODEL


@pytest.fixture(scope="session")
def tokenizer(demo_model: Path):
    from tokenmill_runner.pretokenize import load_tokenizer

    return load_tokenizer(str(demo_model))
