"""What a run says it is, and who may write its output: the run manifest (run.json), the layout-change check and the
output lease, as the runner applies them before it commits anything."""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta

import orjson
import pytest

from tokenmill_runner.prepare import check_output
from tokenmill_runner.spec.resource import SpecError, parse_document
from tokenmill_runner.store.lease import LEASE, STALE_AFTER_S, Lease, LeaseHeld, LeaseKeeper, acquire, refusal
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


def test_a_second_owner_is_refused_naming_the_holder_until_the_lease_is_stale():
    lease = Lease(RESOURCE, "pod-0", NOW - timedelta(hours=2), NOW - timedelta(seconds=10))
    why = refusal(lease, CLI, "laptop:1", NOW, take_over=False)
    assert why and "DatasetGeneration ml/b5 (uid uid-1)" in why and "--take-over" in why
    assert refusal(lease, CLI, "laptop:1", NOW, take_over=True) is None
    stale = NOW + timedelta(seconds=STALE_AFTER_S + 1)
    assert refusal(lease, CLI, "laptop:1", stale, take_over=False) is None


def test_a_resource_s_jobs_share_the_lease_and_two_processes_of_one_spec_do_not():
    resource = Lease(RESOURCE, "pod-0", NOW, NOW)
    assert refusal(resource, RESOURCE, "pod-7 of the next Job", NOW, take_over=False) is None
    recreated = RESOURCE.model_copy(update={"uid": "uid-2"})  # the same name, re-created: another owner
    assert refusal(resource, recreated, "pod-0", NOW, take_over=False)
    process = Lease(CLI, "laptop:1", NOW, NOW)
    assert refusal(process, CLI, "laptop:1", NOW, take_over=False) is None
    assert refusal(process, CLI, "laptop:2", NOW, take_over=False)


def test_acquire_writes_the_lease_and_a_process_releases_it_when_it_ends(tmp_path):
    storage = LocalStorage(tmp_path)
    lease = acquire(storage, CLI, "laptop:1", settle_s=0)
    assert orjson.loads(storage.get(LEASE))["holder"] == "laptop:1"
    with pytest.raises(LeaseHeld, match="tokenmill run 'b5'"):
        acquire(storage, CLI, "laptop:2", settle_s=0)
    with LeaseKeeper(storage, lease, every_s=0.05):
        pass
    assert not storage.exists(LEASE)
    acquire(storage, CLI, "laptop:2", settle_s=0)


def test_a_keeper_that_finds_the_output_taken_over_stops_and_says_so(tmp_path):
    storage = LocalStorage(tmp_path)
    keeper = LeaseKeeper(storage, acquire(storage, CLI, "laptop:1", settle_s=0), every_s=60)
    acquire(storage, Owner(kind="cli", name="other"), "laptop:9", take_over=True, settle_s=0)
    keeper.renew()
    assert keeper.lost.is_set()
    keeper.close()
    assert orjson.loads(storage.get(LEASE))["holder"] == "laptop:9"  # the new holder's lease stays


def test_the_lease_of_a_killed_process_of_this_machine_is_free_at_once(tmp_path):
    import socket
    import subprocess
    import sys

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    storage = LocalStorage(tmp_path)
    dead = Lease(CLI, f"{socket.gethostname()}:{gone.stdout.strip()}:abcd", NOW, datetime.now(UTC))
    storage.put(LEASE, dead.encode())
    assert acquire(storage, CLI, "this-run", settle_s=0).holder == "this-run"
    alive = Lease(CLI, f"{socket.gethostname()}:{os.getpid()}:abcd", NOW, datetime.now(UTC))
    storage.put(LEASE, alive.encode())
    with pytest.raises(LeaseHeld):
        acquire(storage, CLI, "this-run", settle_s=0)
