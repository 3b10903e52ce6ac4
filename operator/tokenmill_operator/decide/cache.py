"""Weights copied once (spec.model.cache): the model's digest, the fill script and its lock, the shared volume and its
fill Job, and what a server pod mounts. Pure: manifests as dicts, the script as text.

Without a cache every server pod copies the whole s3:// prefix into an emptyDir on every start (Kimi-K2.5: ~595 GB
per pod, per restart, per replica). With one, a copy is made once per model digest:

* sharedVolume: one PersistentVolumeClaim and one fill Job per digest in the namespace, shared by every resource
  and replica that serves that model. The operator starts no server pod before the Job has succeeded, and each
  server pod checks the digest marker in an init container, so a half-filled volume is never served.
* nodeLocal: a host folder per namespace and digest on each node (`<root>/<namespace>/<digest>`, the root being the
  administrator's operator setting, never the tenant's), filled by the first server pod of that namespace that lands
  there while the others wait on a lock, and checked against the marker before SGLang starts. The fill container
  (the operator's aws-cli image and script) mounts the root; SGLang's container, which runs the tenant's image as
  root, mounts only its own digest's folder (a subPath), so it never sees another namespace's weights. A namespace
  never reuses another's copy: each fills its own with its own Secret, so S3 checks every tenant's credentials.

The marker (`<digest>/.tokenmill-digest`) is written, by rename, only after `aws s3 sync` exited 0, and removed
before a copy starts: a folder without it is incomplete whatever it holds. `aws s3 sync` skips the files already
copied, so a failed fill is retried (the Job's next pod, or the next server pod) without starting over.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import shlex
from dataclasses import dataclass
from typing import Any

from tokenmill_runner.spec.resource import HOST_PATH_PATTERN, DatasetGenerationSpec, ModelCacheSpec

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
# A pod waits for another's copy at most this long (or LOCK_WAIT_COPIES predicted copies, if longer), then fails.
LOCK_WAIT_FLOOR_S = 1800
LOCK_WAIT_COPIES = 3
# The fill's exit status when it cannot take the lock (EX_CANTCREAT): the operator ends the run with the reason
# (ModelCacheLockFailed) instead of letting the pod hold its GPUs in an init container that never finishes.
LOCK_FAILED_EXIT = 73
# The node-local root: an operator setting (chart value operator.nodeCacheRoot), the same on every node.
NODE_ROOT_ENV = "TOKENMILL_NODE_CACHE_ROOT"
DEFAULT_NODE_ROOT = "/mnt/nvme/tokenmill-models"

Manifest = dict[str, Any]


def node_root(value: str) -> str:
    """The administrator's node-local root, checked as the spec's old hostPath field is (HOST_PATH_PATTERN)."""
    root = value.rstrip("/")
    if not re.fullmatch(HOST_PATH_PATTERN, root):
        raise ValueError(f"{NODE_ROOT_ENV}={value!r}: an absolute folder on the node other than /, without . or .. "
                         "segments (letters, digits, '.', '_', '-'), e.g. /mnt/nvme/tokenmill-models")
    return root


def host_path_refusal(cache: ModelCacheSpec | None, root: str) -> str | None:
    """Why a resource naming its own node-local folder is refused: the folder is the administrator's setting now.
    One naming the operator's own root (old specs that spelled out the default) is served."""
    if cache is None or cache.mode != "nodeLocal" or cache.host_path is None or cache.host_path == root:
        return None
    return (f"spec.model.cache.hostPath {cache.host_path!r}: the node-local cache folder is this operator's setting "
            f"({root}; {NODE_ROOT_ENV}, chart value operator.nodeCacheRoot), not the resource's; remove hostPath")


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
                heartbeat_s: int = LOCK_HEARTBEAT_S, poll_s: int = LOCK_POLL_S, wait_s: int = LOCK_WAIT_FLOOR_S) -> str:
    """sh that fills `root/<digest>` once with `copy` (into cached_model_path): wait for the lock (a directory,
    created atomically by mkdir, refreshed while held; one left by a killed holder is broken after `stale_s`), copy
    unless the marker is already there, write the marker last, and exit 0 only when the marker names this digest.
    A lock that cannot be taken (the folder is not writable by this user, a stale lock that cannot be removed, or
    another pod's copy still running after `wait_s`) exits LOCK_FAILED_EXIT with the reason on stderr."""
    folder = f"{root}/{digest}"
    return "\n".join([
        "set -eu",
        f"folder={shlex.quote(folder)}; root={shlex.quote(root)}; lock=\"$folder.lock\"; marker=\"$folder/{MARKER}\"",
        f"ready() {{ [ \"$(cat \"$marker\" 2>/dev/null)\" = {digest} ]; }}",
        "cannot() { echo \"tokenmill: cannot take the model cache lock $lock as uid $(id -u): $1\" >&2; "
        f"exit {LOCK_FAILED_EXIT}; }}",
        "mkdir -p \"$root\" 2>/dev/null || cannot \"cannot create $root ($(stat -c '%U:%G %a' \"$(dirname "
        "\"$root\")\" 2>/dev/null)): the node's cache folder must be writable by this user (docs/cluster.md)\"",
        "[ -w \"$root\" ] || ready || cannot \"$root is not writable ($(stat -c '%U:%G %a' \"$root\")): the "
        "node's cache folder must be writable by this user (docs/cluster.md)\"",
        "held=; start=$(date +%s)",
        "until ready || { mkdir \"$lock\" 2>/dev/null && held=1; }; do",
        "  [ -d \"$lock\" ] || cannot \"mkdir failed and no other pod holds it\"",
        "  age=$(( $(date +%s) - $(stat -c %Y \"$lock\" 2>/dev/null || date +%s) ))",
        f"  if [ \"$age\" -gt {stale_s} ]; then",
        "    echo \"tokenmill: $lock was last refreshed ${age}s ago: its holder is gone, breaking it\" >&2",
        "    rm -rf \"$lock\" 2>/dev/null || cannot \"the stale lock cannot be removed\"",
        "  fi",
        f"  waited=$(( $(date +%s) - start )); [ \"$waited\" -le {wait_s} ] || cannot \"another pod has held it "
        f"for ${{waited}}s, over the {wait_s}s a pod waits for another's copy\"",
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


@dataclass(frozen=True)
class NodeCache:
    """Where a node-local copy goes: the administrator's root and the namespace whose folder it is, and how long a
    pod waits for another pod's copy of it."""

    root: str = DEFAULT_NODE_ROOT
    namespace: str = "default"
    wait_s: int = LOCK_WAIT_FLOOR_S


def server_files(spec: DatasetGenerationSpec, weight_bytes: int, mount: str, volume: str,
                 node: NodeCache | None = None) -> ServerFiles:
    """(model path, volumes, mounts, init containers) of a server pod with spec.model.cache set."""
    cache = spec.model.cache
    assert cache is not None
    digest = model_digest(spec, weight_bytes)
    if cache.mode == "nodeLocal":
        return node_local_server_files(spec, node or NodeCache(), digest, mount, volume)
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


def node_folder(namespace: str, digest: str) -> str:
    """The copy's folder under the node-local root: one per namespace, then per digest."""
    return f"{namespace}/{digest}"


def node_local_server_files(spec: DatasetGenerationSpec, node: NodeCache, digest: str, mount: str,
                            volume: str) -> ServerFiles:
    """(model path, volumes, mounts, init containers) of a server pod that fills its node's folder if needed. The
    fill mounts the root (it makes the namespace's folder and the lock beside the copy); SGLang mounts only the
    copy (subPath), read-only."""
    fill_root = f"{mount}/{node.namespace}"
    sync = s3_sync_command(spec.model.path, cached_model_path(fill_root, digest), spec)
    script = fill_script(fill_root, digest, sync, wait_s=node.wait_s)
    fill = aws_container(NODE_FILL_CONTAINER, ["sh", "-c", script], [{"name": volume, "mountPath": mount}], spec)
    volumes = [{"name": volume, "hostPath": {"path": node.root, "type": "DirectoryOrCreate"}}]
    mounts = [{"name": volume, "mountPath": mount, "subPath": node_folder(node.namespace, digest), "readOnly": True}]
    return f"{mount}/{MODEL_FOLDER}", volumes, mounts, [fill]
