"""What smg asks a worker when it registers one, answered by the simulator as each supported release's own
http_server.py routes it (read from the release's wheel): a route the release serves is served, one it lacks is a
404, so `smg launch --worker-urls <simulator>` registers the worker as it registers a real replica.

smg 1.13.0 (the PyPI wheel's binary, in front of a worker that logs what it is asked) asks, in order: GET /health,
/v1/models, /version, /server_info, /model_info, then polls /loads, /v1/loads and /metrics; tokenmill itself reads
/server_info or /get_server_info and /model_info or /get_model_info (facts/server_info.py). /v1/loads (a separate
router, entrypoints/v1_loads.py) is not simulated: smg falls back to /metrics (docs/simulator.md).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.contract.sglang_wheels import tree
from tokenmill_runner.facts.releases import SUPPORTED_RELEASES
from tokenmill_sim.config import SimConfig
from tokenmill_sim.server import SimServer

HTTP_SERVER = "sglang/srt/entrypoints/http_server.py"
PROBED = ("/health", "/v1/models", "/version", "/server_info", "/get_server_info", "/model_info", "/get_model_info",
          "/loads")


def release_get_routes(version: str) -> set[str]:
    """The paths of `@app.get(...)` / `@app.api_route(..., methods=[... "GET" ...])` in the release's http_server.py."""
    module = tree(version, HTTP_SERVER)
    assert module is not None, f"sglang {version} has no {HTTP_SERVER}"
    paths: set[str] = set()
    for node in ast.walk(module):
        if not isinstance(node, ast.AsyncFunctionDef | ast.FunctionDef):
            continue
        for decorator in node.decorator_list:
            if not (isinstance(decorator, ast.Call) and isinstance(decorator.func, ast.Attribute)
                    and isinstance(decorator.func.value, ast.Name) and decorator.func.value.id == "app"
                    and decorator.args and isinstance(decorator.args[0], ast.Constant)
                    and isinstance(decorator.args[0].value, str)):
                continue
            path = decorator.args[0].value
            if decorator.func.attr == "get":
                paths.add(path)
            elif decorator.func.attr == "api_route":
                methods = next((k.value for k in decorator.keywords if k.arg == "methods"), None)
                if methods is not None and "GET" in ast.literal_eval(methods):
                    paths.add(path)
    return paths


@pytest.fixture(scope="module", params=SUPPORTED_RELEASES)
def sim(request: pytest.FixtureRequest, demo_model: Path) -> Iterator[tuple[str, SimServer]]:
    config = SimConfig(model_path=str(demo_model), sglang_version=request.param, time_scale=5000.0)
    with SimServer(config) as server:
        yield request.param, server


def test_the_simulator_serves_the_probed_routes_the_release_serves(sim: tuple[str, SimServer]) -> None:
    version, server = sim
    served = release_get_routes(version)
    assert {"/health", "/v1/models", "/server_info", "/get_server_info", "/model_info"} <= served  # every release
    for path in PROBED:
        status = httpx.get(f"{server.url}{path}", timeout=30.0).status_code
        if path in served:
            assert status == 200, f"sglang {version} serves GET {path}; the simulator answered {status}"
        elif path not in served:
            assert status == 404, f"sglang {version} has no GET {path}; the simulator answered {status}"
