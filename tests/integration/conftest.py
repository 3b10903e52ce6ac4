"""The SGLang simulator on loopback for integration tests (the S3 server fixture is in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture
def simulator(demo_model: Path) -> Iterator[Any]:
    from tokenmill_sim.config import SimConfig
    from tokenmill_sim.server import SimServer

    with SimServer(SimConfig(model_path=str(demo_model), time_scale=2000.0, max_running_requests=64)) as server:
        yield server


@pytest.fixture(scope="module")
def lifecycle_sim(demo_model):
    """A fast simulator for the lifecycle model's many short runs."""
    from tokenmill_sim.config import SimConfig
    from tokenmill_sim.server import SimServer

    with SimServer(SimConfig(model_path=str(demo_model), time_scale=5000.0, max_running_requests=32)) as server:
        yield server


@pytest.fixture(params=["local", "s3"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    """A store of each kind: a folder, and a prefix of the test S3 server (moto's) in a bucket of the test's own."""
    from tokenmill_runner.store.storage import LocalStorage, S3Storage

    if request.param == "local":
        return LocalStorage(tmp_path)
    bucket = request.getfixturevalue("s3_bucket")
    return S3Storage(f"s3://{bucket}/run/", endpoint=request.getfixturevalue("s3_endpoint"))
