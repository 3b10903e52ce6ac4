"""Fixtures shared by every test layer."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]
DEMO_MODEL = REPO / "examples" / "demo-model"


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """`make test` runs two workers (pytest-xdist, --dist loadscope) with this scope: every test on the real control
    plane (tests/e2e) in one worker, one after another, since they share the one cluster its session fixture starts
    and are timed against the cluster's clocks; every other test is a scope of its own, run beside them by whichever
    worker is free. (xdist's own `xdist_group` marker renames `item._nodeid`, which pytest 9.2 no longer reads.)"""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ClusterScope(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "tests/e2e" if nodeid.startswith("tests/e2e/") else nodeid

    return ClusterScope(config, log)


@pytest.fixture(scope="session")
def demo_model() -> Path:
    return DEMO_MODEL


@pytest.fixture(scope="session")
def tokenizer(demo_model: Path):
    from tokenmill_runner.render.pretokenize import load_tokenizer

    return load_tokenizer(str(demo_model))


S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    from tests import s3_server

    os.environ.update(S3_ENV)
    port = free_port()
    server = s3_server.start(port)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(s3_endpoint: str, request: pytest.FixtureRequest) -> str:
    from tokenmill_runner.store.storage import s3_client

    name = "t-" + request.node.name.lower().replace("_", "-").replace("[", "-").replace("]", "")[:50]
    s3_client(s3_endpoint).create_bucket(Bucket=name)
    return name


@pytest.fixture(scope="session")
def reference() -> dict:
    """Every fixture's prompt ids from the family's own code, run in the reference environment (built once and
    cached under ~/.cache/tokenmill/refenv-*; see tests/reference/env.py)."""
    from tests.reference.env import reference_ids
    from tests.reference.families import PROMPTS, VARIANTS

    return reference_ids(PROMPTS, {v.name: v.reference_request() for v in VARIANTS})
