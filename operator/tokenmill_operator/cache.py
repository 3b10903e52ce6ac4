"""Weights copied once (spec.model.cache): the model's digest, the fill script and its lock, the shared volume and its
fill Job, and what a server pod mounts. Pure: manifests as dicts, the script as text.

Without a cache every server pod copies the whole s3:// prefix into an emptyDir on every start (Kimi-K2.5: ~595 GB
per pod, per restart, per replica). With one, a copy is made once per model digest:

* sharedVolume: one PersistentVolumeClaim and one fill Job per digest in the namespace, shared by every resource
  and replica that serves that model. The operator starts no server pod before the Job has succeeded, and each
  server pod checks the digest marker in an init container, so a half-filled volume is never served.
* nodeLocal: a host folder per digest on each node, filled by the first server pod that lands there while the
  others wait on a lock, and checked against the marker before SGLang starts.

The marker (`<digest>/.tokenmill-digest`) is written, by rename, only after `aws s3 sync` exited 0, and removed
before a copy starts: a folder without it is incomplete whatever it holds. `aws s3 sync` skips the files already
copied, so a failed fill is retried (the Job's next pod, or the next server pod) without starting over.
"""

from __future__ import annotations

import hashlib
import json
import math
import shlex
from typing import Any

from tokenmill_runner.spec.resource import DatasetGenerationSpec, ModelCacheSpec

from . import names

# aws-cli image of the copy; pinned (not `latest`) so a restarted pod runs the same copier. Its entrypoint is `aws`.
AWS_CLI_IMAGE = "amazon/aws-cli:2.27.0"
MARKER = ".tokenmill-digest"
MODEL_FOLDER = "model"
CACHE_MOUNT = "/cache"
DIGEST_LABEL = "tokenmill.io/model-digest"
COMPONENT = "model-cache"
NODE_FILL_CONTAINER = "fill-node-cache"
# A lock whose holder stopped refreshing it for this long is taken as abandoned (its pod was killed).
LOCK_STALE_S = 120
LOCK_HEARTBEAT_S = 20
LOCK_POLL_S = 5

Manifest = dict[str, Any]


def model_digest(spec: DatasetGenerationSpec, weight_bytes: int) -> str:
    """What identifies a copy: the prefix (with its endpoint) and the weights' total size from the index the planner
    read. A model replaced in place by one of the same size is not told apart: give each revision its own prefix."""
    prefix = spec.model.path if spec.model.path.endswith("/") else spec.model.path + "/"
    identity = json.dumps([prefix, spec.output.endpoint or "", weight_bytes])
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


def claim_name(digest: str) -> str:
    return f"tokenmill-model-{digest}"


def fill_job_name(digest: str) -> str:
    return f"tokenmill-fill-{digest}"


def labels(digest: str) -> dict[str, str]:
    return {names.LABEL_NAME: names.APP_NAME, names.LABEL_COMPONENT: COMPONENT, names.LABEL_MANAGED_BY: names.MANAGER,
            DIGEST_LABEL: digest}


# ---------------------------------------------------------------------------------------------- the S3 copy


def s3_sync_command(location: str, target: str, spec: DatasetGenerationSpec,
                    excludes: tuple[str, ...] = ()) -> list[str]:
    source = location if location.endswith("/") else location + "/"  # a prefix, never a sibling like prefix-v2
    command = ["aws", "s3", "sync", source, target, "--no-progress"]
    if spec.output.endpoint:
        command += ["--endpoint-url", spec.output.endpoint]
    for pattern in excludes:
        command += ["--exclude", pattern]
    return command


SYNC_UID = 65532  # the conventional "nonroot" user: the model copy runs as no user the image knows


def aws_container(name: str, command: list[str], mounts: list[Manifest], spec: DatasetGenerationSpec) -> Manifest:
    """A container of the aws-cli image with the output's region and credentials (from the Secret, never inline)."""
    env = [{"name": "HOME", "value": "/tmp"}]
    if spec.output.region:
        env += [{"name": "AWS_DEFAULT_REGION", "value": spec.output.region}]
    container: Manifest = {
        "name": name,
        "image": AWS_CLI_IMAGE,
        "command": command,
        "env": env,
        "volumeMounts": mounts,
        "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "4Gi"}},
        # The aws-cli image defaults to root, which copying files into a volume does not need (a node-local cache
        # folder must be writable by SYNC_UID: docs/cluster.md).
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                            "runAsNonRoot": True, "runAsUser": SYNC_UID, "runAsGroup": SYNC_UID},
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if spec.output.credentials_secret:
        container["envFrom"] = [{"secretRef": {"name": spec.output.credentials_secret}}]
    return container


def cached_model_path(root: str, digest: str) -> str:
    return f"{root}/{digest}/{MODEL_FOLDER}"


def fill_script(root: str, digest: str, copy: list[str], stale_s: int = LOCK_STALE_S,
                heartbeat_s: int = LOCK_HEARTBEAT_S, poll_s: int = LOCK_POLL_S) -> str:
    """sh that fills `root/<digest>` once with `copy` (into cached_model_path): wait for the lock (a directory, created atomically by mkdir, refreshed
    while held; one left by a killed holder is broken after `stale_s`), copy unless the marker is already there,
    write the marker last, and exit 0 only when the marker names this digest."""
    folder = f"{root}/{digest}"
    return "\n".join([
        "set -eu",
        f"folder={shlex.quote(folder)}; lock=\"$folder.lock\"; marker=\"$folder/{MARKER}\"",
        f"ready() {{ [ \"$(cat \"$marker\" 2>/dev/null)\" = {digest} ]; }}",
        f"mkdir -p {shlex.quote(root)}",
        "held=",
        "until ready || { mkdir \"$lock\" 2>/dev/null && held=1; }; do",
        "  age=$(( $(date +%s) - $(stat -c %Y \"$lock\" 2>/dev/null || date +%s) ))",
        f"  if [ \"$age\" -gt {stale_s} ]; then",
        "    echo \"tokenmill: $lock was last refreshed ${age}s ago: its holder is gone, breaking it\" >&2",
        "    rm -rf \"$lock\"",
        "  fi",
        f"  sleep {poll_s}",
        "done",
        "if [ -n \"$held\" ]; then trap 'rm -rf \"$lock\"' EXIT; fi",
        "if [ -n \"$held\" ] && ! ready; then",
        f"  ( while sleep {heartbeat_s}; do touch \"$lock\"; done ) & beat=$!",
        "  trap 'kill $beat 2>/dev/null; rm -rf \"$lock\"' EXIT",
        "  rm -f \"$marker\"",
        f"  mkdir -p {shlex.quote(cached_model_path(root, digest))}",
        f"  echo \"tokenmill: copying the weights of digest {digest} into $folder\" >&2",
        "  " + " ".join(shlex.quote(part) for part in copy),
        f"  printf %s {digest} > \"$marker.tmp\" && mv \"$marker.tmp\" \"$marker\"",
        "fi",
        f"ready || {{ echo \"tokenmill: $marker does not name digest {digest}: refusing a half-filled copy\" >&2; "
        "exit 1; }",
    ])


def verify_script(root: str, digest: str, fill_job: str) -> str:
    marker = f"{root}/{digest}/{MARKER}"
    return (f"[ \"$(cat {marker} 2>/dev/null)\" = {digest} ] || {{ echo \"tokenmill: {marker} does not name digest "
            f"{digest}: the volume is not filled (Job {fill_job}); refusing to serve a half-filled copy\" >&2; "
            "exit 1; }")


# ------------------------------------------------------------------------------------------- shared volume


def claim_size(cache: ModelCacheSpec, weight_bytes: int) -> str:
    return cache.size or f"{math.ceil(weight_bytes * 1.1 / 2**30)}Gi"


def shared_claim(namespace: str, cache: ModelCacheSpec, digest: str, weight_bytes: int) -> Manifest:
    """One claim per model digest in the namespace, shared by every resource serving the model: each is added to
    its owners (reconcile._share), so it goes with the last of them."""
    spec: Manifest = {"accessModes": [cache.access_mode],
                      "resources": {"requests": {"storage": claim_size(cache, weight_bytes)}}}
    if cache.storage_class:
        spec["storageClassName"] = cache.storage_class
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": claim_name(digest), "namespace": namespace, "labels": labels(digest)}, "spec": spec}


def fill_job(namespace: str, spec: DatasetGenerationSpec, digest: str) -> Manifest:
    """The one Job that fills the claim. A failed pod is replaced (the copy resumes) until backoffLimit."""
    sync = s3_sync_command(spec.model.path, cached_model_path(CACHE_MOUNT, digest), spec)
    script = fill_script(CACHE_MOUNT, digest, sync)
    container = aws_container("fill", ["sh", "-c", script], [{"name": "cache", "mountPath": CACHE_MOUNT}], spec)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": fill_job_name(digest), "namespace": namespace, "labels": labels(digest)},
        "spec": {
            "backoffLimit": 6,
            "podReplacementPolicy": "Failed",  # one copier at a time, even while a failed one is stopping
            "template": {
                "metadata": {"labels": labels(digest)},
                "spec": {
                    "restartPolicy": "Never",
                    "enableServiceLinks": False,
                    "automountServiceAccountToken": False,
                    "containers": [container],
                    "volumes": [{"name": "cache", "persistentVolumeClaim": {"claimName": claim_name(digest)}}],
                },
            },
        },
    }


ServerFiles = tuple[str, list[Manifest], list[Manifest], list[Manifest]]


def server_files(spec: DatasetGenerationSpec, weight_bytes: int, mount: str, volume: str) -> ServerFiles:
    """(model path, volumes, mounts, init containers) of a server pod with spec.model.cache set."""
    cache = spec.model.cache
    assert cache is not None
    digest = model_digest(spec, weight_bytes)
    if cache.mode == "nodeLocal":
        return node_local_server_files(spec, cache, digest, mount, volume)
    return shared_server_files(digest, mount, volume)


def shared_server_files(digest: str, mount: str, volume: str) -> ServerFiles:
    """(model path, volumes, mounts, init containers) of a server pod reading the filled claim."""
    script = verify_script(mount, digest, fill_job_name(digest))
    check = {"name": "verify-model-cache", "image": AWS_CLI_IMAGE, "command": ["sh", "-c", script],
             "volumeMounts": [{"name": volume, "mountPath": mount, "readOnly": True}],
             "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}, "limits": {"memory": "128Mi"}},
             "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
             "terminationMessagePolicy": "FallbackToLogsOnError"}
    volumes = [{"name": volume, "persistentVolumeClaim": {"claimName": claim_name(digest), "readOnly": True}}]
    mounts = [{"name": volume, "mountPath": mount, "readOnly": True}]
    return cached_model_path(mount, digest), volumes, mounts, [check]


# ---------------------------------------------------------------------------------------------- node-local


def node_local_server_files(spec: DatasetGenerationSpec, cache: ModelCacheSpec, digest: str, mount: str,
                            volume: str) -> ServerFiles:
    """(model path, volumes, mounts, init containers) of a server pod that fills its node's folder if needed."""
    sync = s3_sync_command(spec.model.path, cached_model_path(mount, digest), spec)
    fill = aws_container(NODE_FILL_CONTAINER, ["sh", "-c", fill_script(mount, digest, sync)],
                         [{"name": volume, "mountPath": mount}], spec)
    volumes = [{"name": volume, "hostPath": {"path": cache.host_path, "type": "DirectoryOrCreate"}}]
    mounts = [{"name": volume, "mountPath": mount, "readOnly": True}]
    return cached_model_path(mount, digest), volumes, mounts, [fill]
