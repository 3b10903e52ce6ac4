"""What a run says it is, and who may write its output: the run manifest (run.json), the layout-change check and the
output lease (tests/unit/test_lease.py), as the runner applies them before it commits anything."""

from __future__ import annotations

from datetime import UTC, datetime

import orjson
import pytest

from tokenmill_runner.prepare import check_output
from tokenmill_runner.spec.resource import SpecError, parse_document
from tokenmill_runner.store.manifest import (
    DatasetLayout,
    Owner,
    RunManifest,
    SourceIdentity,
    layout_changes,
    read_manifest,
    write_manifest,
)
from tokenmill_runner.store.storage import LocalStorage

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
RESOURCE = Owner(kind="DatasetGeneration", name="b5", namespace="ml", uid="uid-1")
CLI = Owner(kind="cli", name="b5")


def spec(model: str, tokenizer: str | None = None):
    document = {"apiVersion": "tokenmill.io/v1alpha1", "kind": "DatasetGeneration", "metadata": {"name": "r"},
                "spec": {"model": {"path": model, **({"tokenizer": tokenizer} if tokenizer else {})},
                         "datasets": [{"name": "a", "source": "a.jsonl"}], "output": {"uri": "out/"}}}
    return parse_document(document).spec


def recorded(model: str) -> RunManifest:
    return RunManifest(spec=spec(model).model_dump(mode="json", by_alias=True))


def test_an_empty_output_and_the_same_model_are_accepted(tmp_path):
    storage = LocalStorage(tmp_path)
    check_output(read_manifest(storage), spec("s3://models/kimi/"))
    write_manifest(storage, recorded("s3://models/kimi/"))
    check_output(read_manifest(storage), spec("s3://models/kimi/", tokenizer="s3://models/kimi/"))


@pytest.mark.parametrize(("model", "tokenizer", "field"), [("s3://models/other/", None, "model.path"),
                                                          ("s3://models/kimi/", "s3://tok/", "model.tokenizer")])
def test_another_model_or_tokenizer_is_refused_with_both_names(tmp_path, model, tokenizer, field):
    storage = LocalStorage(tmp_path)
    write_manifest(storage, recorded("s3://models/kimi/"))
    with pytest.raises(SpecError) as error:
        check_output(read_manifest(storage), spec(model, tokenizer))
    message = str(error.value)
    assert field in message and "s3://models/kimi/" in message and "another output URI" in message


def test_a_version_1_run_json_still_reads_without_owner_or_hash(tmp_path):
    storage = LocalStorage(tmp_path)
    storage.put("run.json", orjson.dumps({"version": 1, "name": "old", "datasets": {"a": {"rows": 7, "samples": 2}},
                                          "spec": {"datasets": [{"name": "a"}]}}))
    manifest = read_manifest(storage)
    assert manifest is not None and manifest.owner is None and manifest.spec_hash is None
    assert manifest.datasets["a"].slots == 14 and manifest.dataset_names == ["a"]


def layout(size: int, head: str, fields: dict | None = None) -> DatasetLayout:
    return DatasetLayout(rows=10, source=SourceIdentity(uri="a.jsonl", size=size, version="v", head_hash=head),
                         input={"format": "auto", **(fields or {})})


def test_a_replaced_source_or_a_new_input_mapping_is_refused_only_once_something_was_committed():
    before = RunManifest(datasets={"a": layout(100, "h1")})
    assert layout_changes(before, {"a": layout(100, "h1")}, {"a": 5}) == []
    [replaced] = layout_changes(before, {"a": layout(100, "h2")}, {"a": 5})
    assert "datasets[a].source" in replaced and "content changed" in replaced and "5 slots" in replaced
    [grown] = layout_changes(before, {"a": layout(120, "h1")}, {"a": 5})
    assert "size changed from 100 to 120" in grown
    [remapped] = layout_changes(before, {"a": layout(100, "h1", {"fields": {"id": "uid"}})}, {"a": 5})
    assert "datasets[a].input changed" in remapped
    # Nothing committed yet: the source may be anything.
    assert layout_changes(before, {"a": layout(100, "h2")}, {"a": 0}) == []
