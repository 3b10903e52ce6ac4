"""Fixtures of the chart tests (no cluster): helm and promtool from hack/build-tools.sh's cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from .tools import helm_env, tool_env


@pytest.fixture(scope="session")
def tools() -> dict[str, str]:
    return tool_env()


@pytest.fixture(scope="session")
def helm(tools: dict[str, str]) -> str:
    return tools["HELM_BIN"]


@pytest.fixture(scope="session")
def promtool(tools: dict[str, str]) -> str:
    return tools["PROMTOOL_BIN"]


@pytest.fixture(scope="session")
def henv(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return helm_env(Path(tmp_path_factory.mktemp("helm")))
