"""The Argo CD health check of DatasetGeneration (deploy/argocd/health.lua) on its fixtures, under Lua 5.1.

Argo CD runs health checks in gopher-lua (Lua 5.1) with only the base, table and package libraries unless
`useOpenLibs` is set; the sandbox below removes the others (string methods included), so a check that would fail
in Argo CD fails here too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from lupa import lua51

from .tools import ARGOCD, CHART, REPO

HEALTH_LUA = ARGOCD / "health.lua"
CM_KEY = "resource.customizations.health.tokenmill.io_DatasetGeneration"
CASES = yaml.safe_load((ARGOCD / "health_test.yaml").read_text())["tests"]

SANDBOX = """
local mt = getmetatable("")
if mt ~= nil then mt.__index = nil end
string = nil; math = nil; os = nil; io = nil; debug = nil; coroutine = nil
load = nil; loadstring = nil; dofile = nil; loadfile = nil
"""


def run_health(obj: dict[str, Any], script: str | None = None) -> dict[str, str]:
    """Run the health script on `obj` (a global Lua table, as in Argo CD); returns {status, message}."""
    lua = lua51.LuaRuntime(register_eval=False, register_builtins=False)
    lua.execute(SANDBOX)
    lua.globals().obj = lua.table_from(obj, recursive=True)
    result = lua.execute(script if script is not None else HEALTH_LUA.read_text())
    assert result is not None, "the health script returned nothing"
    out = {key: result[key] for key in ("status", "message")}
    assert set(dict(result.items())) <= {"status", "message"}, dict(result.items())
    return out


@pytest.mark.parametrize("case", CASES, ids=[Path(c["inputPath"]).stem for c in CASES])
def test_health_fixture(case: dict[str, Any]) -> None:
    obj = yaml.safe_load((ARGOCD / case["inputPath"]).read_text())
    assert obj["apiVersion"] == "tokenmill.io/v1alpha1" and obj["kind"] == "DatasetGeneration"
    assert run_health(obj) == case["healthStatus"]


def test_fixtures_cover_every_health_status() -> None:
    statuses = {c["healthStatus"]["status"] for c in CASES}
    assert statuses == {"Healthy", "Progressing", "Degraded", "Suspended"}
    fixtures = {p.name for p in (ARGOCD / "fixtures").glob("*.yaml")}
    assert fixtures == {Path(c["inputPath"]).name for c in CASES}, "every fixture needs an expected health"


def test_fixture_statuses_match_the_crd_schema() -> None:
    """The fixtures' status fields exist in the CRD (a renamed field would make the Lua read nil)."""
    crd = yaml.safe_load((REPO / "crds" / "datasetgenerations.tokenmill.io.yaml").read_text())
    status_schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    phases = set(status_schema["phase"].get("enum", []))
    for case in CASES:
        obj = yaml.safe_load((ARGOCD / case["inputPath"]).read_text())
        status = obj.get("status") or {}
        assert set(status) <= set(status_schema), f"{case['inputPath']}: {set(status) - set(status_schema)}"
        if phases and "phase" in status:
            assert status["phase"] in phases, case["inputPath"]
        cond_schema = status_schema["conditions"]["items"]["properties"]
        for condition in status.get("conditions", []):
            assert set(condition) <= set(cond_schema), case["inputPath"]
        for key in ("progress", "report"):
            if key in status:
                assert set(status[key]) <= set(status_schema[key]["properties"]), f"{case['inputPath']}: {key}"


def test_argocd_cm_carries_the_same_lua() -> None:
    cm = yaml.safe_load((ARGOCD / "argocd-cm.yaml").read_text())
    assert cm["kind"] == "ConfigMap" and cm["metadata"]["name"] == "argocd-cm"
    assert cm["data"][CM_KEY] == HEALTH_LUA.read_text(), "deploy/argocd/argocd-cm.yaml and health.lua differ"


def test_sandbox_rejects_optional_libraries() -> None:
    """The sandbox is as strict as Argo CD: string methods and the string library are not there."""
    with pytest.raises(lua51.LuaError):
        run_health({"metadata": {}}, 'local hs = {}; hs.status = ("x"):upper(); return hs')
    with pytest.raises(lua51.LuaError):
        run_health({"metadata": {}}, 'local hs = {}; hs.status = string.format("%s", "x"); return hs')


def test_deleting_object_still_gets_a_status() -> None:
    """Argo CD answers for objects being deleted itself; the script must still cope with any metadata."""
    obj = {"metadata": {"name": "x", "generation": 1, "deletionTimestamp": "2026-11-20T10:00:00Z"}, "spec": {}}
    assert run_health(obj)["status"] == "Progressing"


def test_example_application_sync_waves() -> None:
    apps = {a["metadata"]["name"]: a for a in yaml.safe_load_all((ARGOCD / "application.yaml").read_text())}
    operator, datasets = apps["tokenmill"], apps["tokenmill-datasets"]

    def wave(app: dict[str, Any]) -> int:
        return int(app["metadata"]["annotations"]["argocd.argoproj.io/sync-wave"])

    assert wave(operator) < wave(datasets), "the operator chart must sync before the DatasetGenerations"
    assert operator["spec"]["source"]["path"] == "charts/tokenmill"
    assert (REPO / operator["spec"]["source"]["path"] / "Chart.yaml").is_file()
    source = datasets["spec"]["source"]
    assert (REPO / source["path"] / source["directory"]["include"]).is_file()
    assert "SkipDryRunOnMissingResource=true" in datasets["spec"]["syncPolicy"]["syncOptions"]
    # The chart's Helm values in the example are valid values of the chart.
    values = operator["spec"]["source"]["helm"]["valuesObject"]
    chart_values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert set(values) <= set(chart_values)
