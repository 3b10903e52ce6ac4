"""Weights copied once (spec.model.cache): the digest rules, and the fill script's lock and marker rules, run for
real with sh against a stand-in `aws` that counts its copies."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from tokenmill_operator.decide import cache, manifests
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
    for folder in ("models", "/", "/a/../b", "/mnt/./x", "/mnt//x", "/mnt/x\n"):
        with pytest.raises(ValidationError, match="hostPath"):
            spec({"mode": "nodeLocal", "hostPath": folder})
    for size in ("abc", "99999999999Pi", "0Gi", "700G"):
        with pytest.raises(ValidationError, match="size"):
            spec({"mode": "sharedVolume", "size": size})
    assert spec({"mode": "sharedVolume", "size": "700Gi"}).model.cache.size == "700Gi"


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
    assert check["securityContext"]["runAsNonRoot"] and check["securityContext"]["runAsUser"] == cache.SYNC_UID  # W8
    sglang = pod["containers"][0]
    assert sglang["args"][sglang["args"].index("--model-path") + 1] == f"/models/{digest}/model"
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in sglang["volumeMounts"]


def test_node_local_pods_fill_their_node_folder_then_read_it_only():
    pod = server_pod({"mode": "nodeLocal"})
    digest = cache.model_digest(spec({"mode": "nodeLocal"}), PLAN.weight_bytes)
    [models] = [v for v in pod["volumes"] if v["name"] == "models"]
    assert models["hostPath"] == {"path": cache.DEFAULT_NODE_ROOT, "type": "DirectoryOrCreate"}
    [fill] = pod["initContainers"]
    assert fill["name"] == "fill-node-cache" and "aws s3 sync" in fill["command"][2]
    assert f"/models/{digest}/model" in fill["command"][2]
    # security-f9665d2.md B1: the fill had the tenant's whole Secret as its environment (AWS_CONFIG_FILE named a
    # plugin the CLI loaded) and the whole node root mounted writable, as one uid for every namespace.
    assert "envFrom" not in fill
    assert {e["name"]: e.get("value") or e["valueFrom"]["secretKeyRef"] for e in fill["env"]} == {
        "HOME": "/tmp", "AWS_CONFIG_FILE": "/dev/null", "AWS_SHARED_CREDENTIALS_FILE": "/dev/null",
        "AWS_ACCESS_KEY_ID": {"name": "s3-creds", "key": "AWS_ACCESS_KEY_ID"},
        "AWS_SECRET_ACCESS_KEY": {"name": "s3-creds", "key": "AWS_SECRET_ACCESS_KEY"},
        "AWS_SESSION_TOKEN": {"name": "s3-creds", "key": "AWS_SESSION_TOKEN", "optional": True}}
    assert fill["volumeMounts"] == [{"name": "models", "mountPath": "/models", "subPath": "team-a"}]
    assert fill["securityContext"]["runAsUser"] == cache.namespace_uid("team-a") != cache.SYNC_UID
    # The tenant's image sees its own namespace's copy of its own digest, read-only, and nothing else of the node.
    sglang = pod["containers"][0]
    assert [m for m in sglang["volumeMounts"] if m["name"] == "models"] == [
        {"name": "models", "mountPath": "/models", "subPath": f"team-a/{digest}", "readOnly": True}]
    assert sglang["args"][sglang["args"].index("--model-path") + 1] == "/models/model"


def test_the_node_local_root_is_the_operators_setting_not_the_tenants():
    s = spec({"mode": "nodeLocal"})
    pod = manifests.server_statefulset("b5", "team-a", OWNER, s, PLAN, node_root="/local/nvme0")["spec"]["template"]
    [models] = [v for v in pod["spec"]["volumes"] if v["name"] == "models"]
    assert models["hostPath"]["path"] == "/local/nvme0"
    # A resource naming a folder of its own (the audit's /var/lib/kubelet) is refused, naming the operator's.
    naming = spec({"mode": "nodeLocal", "hostPath": "/var/lib/kubelet"})
    refusal = cache.host_path_refusal(naming.model.cache, "/local/nvme0")
    assert refusal is not None and "'/var/lib/kubelet'" in refusal and "/local/nvme0" in refusal
    assert "operator.nodeCacheRoot" in refusal
    # An older spec that spelled out the operator's own folder stays readable and is served.
    assert cache.host_path_refusal(spec({"mode": "nodeLocal", "hostPath": "/local/nvme0"}).model.cache,
                                   "/local/nvme0") is None
    for bad in ("relative", "/", "/a/../b", "/proc/./x"):
        with pytest.raises(ValueError, match=cache.NODE_ROOT_ENV):
            cache.node_root(bad)


def test_namespaces_never_share_a_node_local_copy():
    s = spec({"mode": "nodeLocal"})
    mounts, fills, uids = {}, {}, {}
    for namespace in ("team-a", "team-b"):
        pod = manifests.server_statefulset("b5", namespace, OWNER, s, PLAN)["spec"]["template"]["spec"]
        [mounts[namespace]] = [m["subPath"] for m in pod["containers"][0]["volumeMounts"] if m["name"] == "models"]
        [fill] = pod["initContainers"]
        [fills[namespace]] = [m["subPath"] for m in fill["volumeMounts"]]
        uids[namespace] = fill["securityContext"]["runAsUser"]
    assert mounts["team-a"].startswith("team-a/") and mounts["team-b"].startswith("team-b/")
    assert fills == {"team-a": "team-a", "team-b": "team-b"} and uids["team-a"] != uids["team-b"]


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
                   'echo weights > "$4/model.safetensors"\nexit "${FAKE_EXIT:-0}"\n')
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
    (tmp_path / DIGEST / cache.MARKER).write_text(DIGEST)  # a marker alone, with no recorded content, is not enough
    assert subprocess.run(["sh", "-c", script], capture_output=True).returncode == 1


def test_a_copy_changed_after_its_fill_is_refused_by_the_content_it_recorded(tmp_path, fake_aws):
    # security-f9665d2.md B1: another namespace's fill rewrote team-b's weights and planted files, and team-b's
    # check, which read only the marker, still passed.
    root = tmp_path / "nvme"
    assert fill(root, fake_aws).wait(timeout=30) == 0
    verify = cache.verify_script(str(root), DIGEST, cache.fill_job_name(DIGEST))
    assert subprocess.run(["sh", "-c", verify]).returncode == 0
    assert fill(root, fake_aws).wait(timeout=30) == 0 and copies(fake_aws) == 1  # the next pod checks, no copy
    weights = root / DIGEST / "model" / "model.safetensors"
    original = weights.read_bytes()
    for tamper, undo in ((lambda: weights.write_bytes(original.upper()), lambda: weights.write_bytes(original)),
                         (lambda: (root / DIGEST / "model" / "evil.py").write_text("import os\n"),
                          lambda: (root / DIGEST / "model" / "evil.py").unlink()),
                         (lambda: weights.unlink(), lambda: weights.write_bytes(original))):
        tamper()
        for script in (["sh", "-c", verify], None):
            done = (subprocess.run(script, capture_output=True, text=True) if script else
                    subprocess.CompletedProcess([], fill(root, fake_aws).wait(timeout=30), "", ""))
            assert done.returncode == 1, tamper
        undo()
    assert subprocess.run(["sh", "-c", verify]).returncode == 0


# --------------------------------------------------------------------------- the fill as the pod's user (uid 65532)


@pytest.fixture
def node_disk():
    """A scratch folder standing in for the node's disk, reachable by uid 65532 (pytest's own tmp is 0700 root),
    with an `aws` that records the copy and fails like S3's AccessDenied when FAKE_EXIT is set."""
    top = Path(tempfile.mkdtemp(prefix="tokenmill-node-", dir="/tmp"))
    top.chmod(0o755)
    bin_dir = top / "bin"
    bin_dir.mkdir()
    (bin_dir / "aws").write_text('#!/bin/sh\necho "$3" >> "$COPIES"\n[ "${FAKE_EXIT:-0}" = 0 ] || '
                                 '{ echo "fatal error: An error occurred (AccessDenied)" >&2; exit "$FAKE_EXIT"; }\n'
                                 'echo weights > "$4/model.safetensors"\n')  # aws s3 sync SOURCE TARGET
    (bin_dir / "aws").chmod(0o755)
    copies = top / "copies"
    copies.touch()
    copies.chmod(0o666)
    yield top, {"PATH": f"{bin_dir}:/usr/bin:/bin", "COPIES": str(copies), "HOME": "/tmp"}
    shutil.rmtree(top)


def pod_user(namespace: str) -> list[str]:
    """setpriv as the fill container of `namespace` runs: its namespace's uid, gid SYNC_UID, no capability."""
    return ["setpriv", f"--reuid={cache.namespace_uid(namespace)}", f"--regid={cache.SYNC_UID}", "--clear-groups"]


def as_pod_user(script: str, env: dict[str, str], namespace: str = "team-a",
                timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*pod_user(namespace), "sh", "-c", script], env=env, capture_output=True, text=True,
                          timeout=timeout)


def node_fill(root: Path, namespace: str, wait_s: int = cache.LOCK_WAIT_FLOOR_S) -> str:
    """The script a server pod of `namespace` runs, rendered by the operator, with the node's root at `root`: its
    subPath mount is `root/namespace`, which the kubelet makes (root's, with the root's mode) when it is missing."""
    node = cache.NodeCache(str(root), namespace, wait_s)
    folder = root / namespace
    if not folder.exists():
        folder.mkdir()
        folder.chmod(root.stat().st_mode & 0o7777)
    _, _, _, [fill] = cache.node_local_server_files(spec({"mode": "nodeLocal"}), node, DIGEST, str(folder), "models")
    # Shorter poll and heartbeat: a killed heartbeat's `sleep` keeps the test's pipe open until it ends (in a pod the
    # container's end takes it down).
    return fill["command"][2].replace(f"sleep {cache.LOCK_POLL_S}", "sleep 1").replace(
        f"while sleep {cache.LOCK_HEARTBEAT_S};", "while sleep 1;")


def test_a_fill_never_skips_its_own_namespaces_credential_check(node_disk):
    top, env = node_disk
    root = top / "nvme"
    root.mkdir()
    root.chmod(0o1777)  # as docs/cluster.md tells the administrator: every namespace's fill may make its folder
    # Tenant B fills the digest with B's Secret; tenant A names the same weights with A's own Secret, which S3 refuses.
    assert as_pod_user(node_fill(root, "team-b"), env, "team-b").returncode == 0
    assert (root / "team-b" / DIGEST / cache.MARKER).read_text() == DIGEST
    tenant_a = as_pod_user(node_fill(root, "team-a"), {**env, "FAKE_EXIT": "1"})
    assert tenant_a.returncode == 1 and "AccessDenied" in tenant_a.stderr  # main found B's marker and exited 0
    assert not (root / "team-a" / DIGEST / cache.MARKER).exists()
    assert len((top / "copies").read_text().splitlines()) == 2  # each namespace copied (or tried) itself


def test_a_fill_that_cannot_take_its_lock_fails_at_once_saying_why(node_disk):
    top, env = node_disk
    root = top / "nvme"
    root.mkdir(mode=0o755)  # what hostPath DirectoryOrCreate makes: root's, 0755
    refused = as_pod_user(node_fill(root, "team-a"), env, timeout=30)  # main waited here for ever, silently
    assert refused.returncode == cache.LOCK_FAILED_EXIT
    uid = cache.namespace_uid("team-a")
    assert f"cannot take the model cache lock {root}/team-a/{DIGEST}.lock as uid {uid}" in refused.stderr
    assert "root:root 755" in refused.stderr and "writable by this user" in refused.stderr


def test_a_fill_waits_for_another_pods_copy_only_within_its_bound(node_disk):
    top, env = node_disk
    root = top / "nvme"
    (root / "team-a" / f"{DIGEST}.lock").mkdir(parents=True)  # another pod's, refreshed below as its heartbeat does
    for folder in (root, root / "team-a", root / "team-a" / f"{DIGEST}.lock"):
        os.chown(folder, cache.namespace_uid("team-a"), cache.SYNC_UID)
    waiter = subprocess.Popen([*pod_user("team-a"), "sh", "-c", node_fill(root, "team-a", wait_s=2)], env=env,
                              stderr=subprocess.PIPE, text=True)
    while waiter.poll() is None:
        os.utime(root / "team-a" / f"{DIGEST}.lock")
        time.sleep(0.2)
    assert waiter.returncode == cache.LOCK_FAILED_EXIT
    assert "another pod has held it" in waiter.stderr.read() and (top / "copies").read_text() == ""


# ------------------------------------------------------------------- the operator ends a run whose fill failed


def test_the_operator_ends_the_run_when_a_fill_cannot_take_its_lock_and_gives_the_gpus_back():
    from tokenmill_operator.decide.lifecycle import ServerState, decide
    from tokenmill_operator.observe.gather import pod_problem

    from .test_lifecycle import observed

    why = (f"tokenmill: cannot take the model cache lock /models/team-a/{DIGEST}.lock as uid 65532: "
           "/models/team-a is not writable (root:root 755)")
    pod = {"metadata": {"name": "b5-server-0"}, "spec": {"nodeName": "gpu-7"},
           "status": {"conditions": [{"type": "PodScheduled", "status": "True"}],
                      "initContainerStatuses": [{"name": cache.NODE_FILL_CONTAINER,
                                                 "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                                                 "lastState": {"terminated": {"exitCode": cache.LOCK_FAILED_EXIT,
                                                                              "message": why}}}]}}
    reason, message = pod_problem(pod)
    assert reason == "ModelCacheLockFailed" and "gpu-7" in message and why in message
    decision = decide(observed(server=ServerState(1, 0, reason, message)))
    assert decision.status.phase == "Failed" and decision.server_replicas == 0 and decision.delete_server
    failed = next(c for c in decision.status.conditions if c.type == "Failed")
    assert failed.reason == "ModelCacheLockFailed" and why in failed.message and "uid 65532" in failed.message
    # The server is gone, so no pod says so any more: the run stays ended until its spec changes.
    again = decide(observed(server=None, previous=decision.status.model_copy(update={"observed_generation": 3})))
    assert again.status.phase == "Failed" and again.server_replicas == 0
    # Another exit (an S3 error the next try may not meet) is not the lock's verdict: the kubelet retries it.
    pod["status"]["initContainerStatuses"][0]["lastState"]["terminated"]["exitCode"] = 1
    assert pod_problem(pod) is None


def kubelet_env(container: dict, secret: dict[str, str]) -> dict[str, str]:
    """The environment the kubelet gives `container` from the tenant's Secret: envFrom takes every key, an env entry
    (a value, or one key by secretKeyRef; an optional one the Secret lacks is left out) sets or overrides one."""
    env = {}
    for source in container.get("envFrom", []):
        if "secretRef" in source:
            env.update(secret)
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        elif (ref := var["valueFrom"]["secretKeyRef"])["key"] in secret:
            env[var["name"]] = secret[ref["key"]]
        else:
            assert ref.get("optional"), f"{var['name']}: a required key the Secret lacks"
    return env


# aws-cli's start-up as it concerns plugins (v2 awscli/clidriver.py create_clidriver -> awscli/plugin.py
# load_plugins; v1 the same without cli_legacy_plugin_path): the [plugins] of $AWS_CONFIG_FILE are imported, from
# cli_legacy_plugin_path or PYTHONPATH. Then the copy, as the fake aws above does it.
AWS_STAND_IN = '''#!/usr/bin/env python3
import configparser, importlib, os, sys
config = configparser.ConfigParser()
config.read(os.environ.get("AWS_CONFIG_FILE") or os.path.expanduser("~/.aws/config"))
if config.has_section("plugins"):
    plugins = dict(config.items("plugins"))
    if "cli_legacy_plugin_path" in plugins:
        sys.path.append(plugins.pop("cli_legacy_plugin_path"))
    for module in plugins.values():
        importlib.import_module(module)
open(os.path.join(sys.argv[4], "model.safetensors"), "w").write("weights")
'''


def test_the_fill_runs_no_code_the_tenants_secret_or_copy_names(tmp_path):
    # security-f9665d2.md B1: a Secret holding AWS_CONFIG_FILE pointed at a config file of the tenant's own earlier
    # copy, whose [plugins] made aws-cli import the tenant's module inside the fill.
    evil = tmp_path / "team-a-copy"
    evil.mkdir()
    (evil / "evil.py").write_text(f"open({str(tmp_path / 'PWNED')!r}, 'w').write('tenant code ran in the fill')\n")
    (evil / "evil.cfg").write_text(f"[plugins]\ncli_legacy_plugin_path = {evil}\nevil = evil\n")
    secret = {"AWS_ACCESS_KEY_ID": "AKIATENANT", "AWS_SECRET_ACCESS_KEY": "secret",
              "AWS_CONFIG_FILE": str(evil / "evil.cfg"), "PYTHONPATH": str(evil)}
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "aws").write_text(AWS_STAND_IN)
    (bin_dir / "aws").chmod(0o755)
    root = tmp_path / "nvme"
    root.mkdir()
    node = cache.NodeCache(str(root), "team-a")
    _, _, _, [fill_container] = cache.node_local_server_files(spec({"mode": "nodeLocal"}), node, DIGEST, str(root),
                                                              "models")
    env = {**kubelet_env(fill_container, secret), "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    assert env["AWS_CONFIG_FILE"] == "/dev/null" and "PYTHONPATH" not in env
    with (tmp_path / "stderr").open("w") as stderr:  # a file: the heartbeat's sleep would hold a pipe open
        done = subprocess.run(fill_container["command"], env=env, stdout=subprocess.DEVNULL, stderr=stderr, timeout=60)
    assert done.returncode == 0, (tmp_path / "stderr").read_text()
    assert not (tmp_path / "PWNED").exists(), "the tenant's plugin ran inside the fill"
    assert (root / DIGEST / cache.MARKER).read_text() == DIGEST
