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


def _pydantic_fields(node: dict[str, Any], defs: dict[str, Any], path: str = ""):
    """(path, node) of every field of the pydantic schema, refs resolved, the way `walk` goes through the CRD."""
    if "$ref" in node:
        node = defs[node["$ref"].rsplit("/", 1)[-1]]
    objects = [o for o in node.get("anyOf", []) if "$ref" in o or "properties" in o]
    if objects:
        node = defs[objects[0]["$ref"].rsplit("/", 1)[-1]] if "$ref" in objects[0] else objects[0]
    yield path, node
    for name, child in node.get("properties", {}).items():
        yield from _pydantic_fields(child, defs, f"{path}.{name}")
    arrays = [o for o in node.get("anyOf", [node]) if "items" in o]
    if arrays:
        yield from _pydantic_fields(arrays[0]["items"], defs, f"{path}[]")


def _integer_bounds(node: dict[str, Any]) -> tuple[int | None, int | None] | None:
    numbers = [o for o in node.get("anyOf", [node]) if o.get("type") == "integer"]
    if not numbers:
        return None
    number = numbers[0]
    low = number.get("minimum", number["exclusiveMinimum"] + 1 if "exclusiveMinimum" in number else None)
    high = number.get("maximum", number["exclusiveMaximum"] - 1 if "exclusiveMaximum" in number else None)
    return low, high


def test_crd_and_pydantic_bound_every_integer_field_alike():
    """What pydantic refuses the API server refuses too, and the other way round: `server.replicas: -1` used to pass
    kubectl apply (int-or-"auto" fields had no minimum in the CRD) and fail only in the operator."""
    from tokenmill_runner.spec.resource import DatasetGenerationSpec

    schema = DatasetGenerationSpec.model_json_schema(by_alias=True)
    ours = {path: bounds for path, node in _pydantic_fields(schema, schema.get("$defs", {}))
            if (bounds := _integer_bounds(node)) is not None}
    crd_spec = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    theirs = {path: (node.get("minimum"), node.get("maximum")) for path, node in walk(crd_spec)
              if node.get("type") == "integer" or node.get("x-kubernetes-int-or-string")}
    assert {".server.replicas", ".server.nodes", ".runner.concurrency", ".runner.shardMaxSamples",
            ".runner.shardMaxSeconds", ".sampling.maxNewTokens", ".datasets[].sampling.topK"} <= set(ours)
    assert ours == theirs
    # No integer the spec accepts is past what Kubernetes (int64) and SGLang (int32 ids, int64 counts) hold.
    unbounded = [path for path, (_, high) in ours.items() if high is None or high >= 2**63]
    assert unbounded == []


def _options(node: dict[str, Any]) -> list[dict[str, Any]]:
    return [o for o in node.get("anyOf", [node]) if o.get("type") != "null"]


def test_crd_and_pydantic_agree_on_every_field():
    """The same fields, and every pattern, length and enum pydantic checks is the CRD's too; `"auto"`, which a
    structural schema cannot put in an int-or-string enum, is a CEL rule there."""
    from tokenmill_runner.spec.resource import DatasetGenerationSpec

    schema = DatasetGenerationSpec.model_json_schema(by_alias=True)
    ours = dict(_pydantic_fields(schema, schema.get("$defs", {})))
    theirs = dict(walk(crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]))
    assert set(ours) == set(theirs)
    for path, node in ours.items():
        for key in ("pattern", "minLength", "maxLength", "minItems", "maxItems"):
            value = next((o[key] for o in _options(node) if key in o), None)
            if value is not None:
                assert theirs[path].get(key) == value, (path, key)
        enum = sorted(str(v) for o in _options(node) for v in (o.get("enum") or ([o["const"]] if "const" in o else [])))
        if enum == ["auto"] and len(_options(node)) > 1:
            rules = " ".join(rule["rule"] for rule in theirs[path].get("x-kubernetes-validations", []))
            assert "'auto'" in rules, path
        elif enum:
            assert sorted(map(str, theirs[path]["enum"])) == enum, path


def test_an_object_that_is_off_when_unset_gets_no_default():
    # The API server applies a default of {} to an absent object, and {} parses as the feature switched on with its
    # defaults: hiddenStates (off unless set) must have none, while validation (defaults inside) keeps its {}.
    spec = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert "default" not in spec["hiddenStates"]
    assert spec["validation"]["default"] == {}
