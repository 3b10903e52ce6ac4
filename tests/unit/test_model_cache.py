"""Weights copied once (spec.model.cache): the digest rules, and the fill script's lock and marker rules, run for
real with sh against a stand-in `aws` that counts its copies."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from tokenmill_operator import cache, manifests
from tokenmill_runner.spec.resource import DatasetGenerationSpec

from .test_lifecycle import PLAN

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "b5-openthoughts.yaml"
OWNER = {"apiVersion": "tokenmill.io/v1alpha1", "kind": "DatasetGeneration", "name": "b5", "uid": "u-1",
         "controller": True, "blockOwnerDeletion": True}
DIGEST = "0123456789abcdef"


def spec(model_cache: dict | None = None, **model) -> DatasetGenerationSpec:
    document = yaml.safe_load(EXAMPLE.read_text())["spec"]
    document["model"] = {**document["model"], **model, **({"cache": model_cache} if model_cache else {})}
    return DatasetGenerationSpec.model_validate(document)


# ------------------------------------------------------------------------------------------------ the digest


def test_the_digest_names_the_weights_not_the_resource():
    base = spec({"mode": "sharedVolume"})
    path = base.model.path
    slashed = spec({"mode": "sharedVolume"}, path=path.rstrip("/") + "/")
    assert cache.model_digest(base, 594 * 10**9) == cache.model_digest(slashed, 594 * 10**9)
    assert cache.model_digest(base, 594 * 10**9) != cache.model_digest(base, 595 * 10**9)
    other = spec({"mode": "sharedVolume"}, path="s3://models/other/")
    assert cache.model_digest(base, 594 * 10**9) != cache.model_digest(other, 594 * 10**9)
    elsewhere = base.model_copy(update={"output": base.output.model_copy(update={"endpoint": "http://minio:9000"})})
    assert cache.model_digest(base, 594 * 10**9) != cache.model_digest(elsewhere, 594 * 10**9)


def test_only_s3_weights_are_cached():
    with pytest.raises(ValidationError, match="cache: only s3:// weights are copied"):
        spec({"mode": "nodeLocal"}, path="pvc://weights/kimi")
    with pytest.raises(ValidationError, match="absolute folder"):
        spec({"mode": "nodeLocal", "hostPath": "models"})


# ---------------------------------------------------------------------------------------- server pods' files


def server_pod(model_cache: dict) -> dict:
    statefulset = manifests.server_statefulset("b5", "team-a", OWNER, spec(model_cache), PLAN)
    return statefulset["spec"]["template"]["spec"]


def test_shared_volume_pods_mount_the_filled_claim_read_only_and_check_its_marker():
    pod = server_pod({"mode": "sharedVolume", "storageClass": "nfs"})
    digest = cache.model_digest(spec({"mode": "sharedVolume"}), PLAN.weight_bytes)
    [models] = [v for v in pod["volumes"] if v["name"] == "models"]
    assert models == {"name": "models", "persistentVolumeClaim": {"claimName": f"tokenmill-model-{digest}",
                                                                  "readOnly": True}}
    [check] = pod["initContainers"]
    assert check["name"] == "verify-model-cache" and digest in check["command"][2]
    sglang = pod["containers"][0]
    assert sglang["args"][sglang["args"].index("--model-path") + 1] == f"/models/{digest}/model"
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in sglang["volumeMounts"]


def test_node_local_pods_fill_their_node_folder_then_read_it_only():
    pod = server_pod({"mode": "nodeLocal", "hostPath": "/mnt/nvme/models"})
    [models] = [v for v in pod["volumes"] if v["name"] == "models"]
    assert models["hostPath"] == {"path": "/mnt/nvme/models", "type": "DirectoryOrCreate"}
    [fill] = pod["initContainers"]
    assert fill["name"] == "fill-node-cache" and "aws s3 sync" in fill["command"][2]
    assert fill["envFrom"] == [{"secretRef": {"name": "s3-creds"}}]
    assert all(m.get("readOnly") for m in pod["containers"][0]["volumeMounts"] if m["name"] == "models")


def test_one_claim_and_one_fill_job_per_digest_without_owner():
    s = spec({"mode": "sharedVolume", "storageClass": "nfs", "accessMode": "ReadWriteMany"})
    claim = cache.shared_claim("team-a", s.model.cache, DIGEST, 594 * 10**9)
    assert claim["metadata"]["name"] == f"tokenmill-model-{DIGEST}" and "ownerReferences" not in claim["metadata"]
    assert claim["spec"] == {"accessModes": ["ReadWriteMany"], "storageClassName": "nfs",
                             "resources": {"requests": {"storage": "609Gi"}}}  # 594 GB + 10 %, whole GiB
    job = cache.fill_job("team-a", s, DIGEST)
    assert job["metadata"]["name"] == f"tokenmill-fill-{DIGEST}" and "ownerReferences" not in job["metadata"]
    assert job["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] == claim[
        "metadata"]["name"]


# ------------------------------------------------------------------------------------- the fill script, for real


@pytest.fixture
def fake_aws(tmp_path: Path) -> dict[str, str]:
    """An `aws` that records each copy, takes FAKE_SLEEP seconds, writes a file and exits FAKE_EXIT."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    aws = bin_dir / "aws"
    aws.write_text('#!/bin/sh\necho "$4" >> "$COPIES"\nsleep "${FAKE_SLEEP:-0.3}"\n'
                   'echo weights > "$5/model.safetensors"\nexit "${FAKE_EXIT:-0}"\n')
    aws.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "COPIES": str(tmp_path / "copies")}


def fill(root: Path, env: dict[str, str], **changes: str) -> subprocess.Popen:
    copy = cache.s3_sync_command("s3://models/kimi/", cache.cached_model_path(str(root), DIGEST), spec())
    script = cache.fill_script(str(root), DIGEST, copy, stale_s=2, heartbeat_s=1, poll_s=1)
    return subprocess.Popen(["sh", "-c", script], env={**env, **changes}, stderr=subprocess.PIPE, text=True)


def copies(env: dict[str, str]) -> int:
    path = Path(env["COPIES"])
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_pods_on_one_node_copy_once_under_the_lock(tmp_path, fake_aws):
    root = tmp_path / "nvme"
    pods = [fill(root, fake_aws, FAKE_SLEEP="1.5") for _ in range(3)]
    assert [p.wait(timeout=30) for p in pods] == [0, 0, 0], [p.stderr.read() for p in pods]
    assert copies(fake_aws) == 1
    assert (root / DIGEST / cache.MARKER).read_text() == DIGEST
    assert not (root / f"{DIGEST}.lock").exists()
    assert fill(root, fake_aws).wait(timeout=30) == 0 and copies(fake_aws) == 1  # a later pod: no copy at all


def test_a_failed_copy_leaves_no_marker_and_the_next_pod_copies_again(tmp_path, fake_aws):
    root = tmp_path / "nvme"
    failed = fill(root, fake_aws, FAKE_EXIT="1")
    assert failed.wait(timeout=30) != 0
    assert not (root / DIGEST / cache.MARKER).exists() and not (root / f"{DIGEST}.lock").exists()
    assert fill(root, fake_aws).wait(timeout=30) == 0
    assert copies(fake_aws) == 2 and (root / DIGEST / cache.MARKER).read_text() == DIGEST


def test_a_half_filled_folder_is_never_taken_for_a_copy(tmp_path, fake_aws):
    root = tmp_path / "nvme"
    (root / DIGEST / "model").mkdir(parents=True)
    (root / DIGEST / "model" / "model-00001.safetensors").write_text("half")
    (root / DIGEST / cache.MARKER).write_text("another-digest")
    assert fill(root, fake_aws).wait(timeout=30) == 0
    assert copies(fake_aws) == 1 and (root / DIGEST / cache.MARKER).read_text() == DIGEST


def test_a_lock_left_by_a_killed_pod_is_broken_once_stale(tmp_path, fake_aws):
    root = tmp_path / "nvme"
    lock = root / f"{DIGEST}.lock"
    lock.mkdir(parents=True)
    old = time.time() - 60
    os.utime(lock, (old, old))
    process = fill(root, fake_aws)
    assert process.wait(timeout=30) == 0, process.stderr.read()
    assert "its holder is gone" in process.stderr.read() and copies(fake_aws) == 1


def test_a_live_holder_keeps_its_lock_past_the_stale_age(tmp_path, fake_aws):
    root = tmp_path / "nvme"
    holder = fill(root, fake_aws, FAKE_SLEEP="4")  # longer than stale_s=2: its heartbeat keeps the lock fresh
    time.sleep(0.5)
    waiter = fill(root, fake_aws)
    assert holder.wait(timeout=30) == 0 and waiter.wait(timeout=30) == 0
    assert copies(fake_aws) == 1


def test_the_server_refuses_a_volume_without_the_marker(tmp_path):
    script = cache.verify_script(str(tmp_path), DIGEST, cache.fill_job_name(DIGEST))
    refused = subprocess.run(["sh", "-c", script], capture_output=True, text=True)
    assert refused.returncode == 1 and "refusing to serve a half-filled copy" in refused.stderr
    (tmp_path / DIGEST).mkdir()
    (tmp_path / DIGEST / cache.MARKER).write_text(DIGEST)
    assert subprocess.run(["sh", "-c", script]).returncode == 0
