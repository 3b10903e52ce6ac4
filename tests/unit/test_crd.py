"""The CRD in crds/ is generated from the pydantic models and must not go stale."""

from __future__ import annotations

from typing import Any

import yaml

from tokenmill_operator.crd import CRD_FILE, crd, render


def test_committed_crd_is_up_to_date():
    assert CRD_FILE.read_text() == render(), "run: .venv/bin/python -m tokenmill_operator.crd"


def walk(node: dict[str, Any], path: str = ""):
    yield path, node
    for name, child in node.get("properties", {}).items():
        yield from walk(child, f"{path}.{name}")
    if "items" in node:
        yield from walk(node["items"], f"{path}[]")


def test_every_spec_field_is_described_for_kubectl_explain():
    schema = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    missing = [path for path, node in walk(schema) if path and not path.endswith("[]") and not node.get("description")]
    assert missing == []


def test_schema_is_structural():
    schema = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in walk(schema):
        assert "anyOf" not in node and "$ref" not in node, path
        assert node.get("type") or node.get("x-kubernetes-int-or-string"), path


def test_printer_columns_and_short_name():
    version = yaml.safe_load(render())["spec"]["versions"][0]
    names = [c["name"] for c in version["additionalPrinterColumns"]]
    assert names[:4] == ["Phase", "Progress", "Tokens/s", "ETA"] and names[-1] == "Age"
    assert version["subresources"] == {"status": {}}
    assert crd()["spec"]["names"]["shortNames"] == ["dsgen"]
