"""The Kubernetes objects a DatasetGeneration owns, as plain dicts. Pure functions: no client, no I/O.

The operator applies these idempotently (get-or-create / patch), so every builder is deterministic: the same spec
and plan always give the same object. Each child carries a controller owner reference (garbage collection deletes
it with the DatasetGeneration) and an explicit label set from `names.labels`, never a copy of the CR's labels.
"""

from __future__ import annotations

import base64
import json
import math
from dataclasses import dataclass
from typing import Any

import yaml

from tokenmill_runner.facts.hardware import GPU_RESOURCE as RESOURCE_BY_VENDOR
from tokenmill_runner.facts.hardware import PRODUCT_LABEL_KEY
from tokenmill_runner.facts.hidden_states import ServedKind
from tokenmill_runner.facts.hidden_states import launch_flags as hidden_state_launch_flags
from tokenmill_runner.facts.releases import HEALTH_CHECK_TIMEOUT_S, release, version_key
from tokenmill_runner.spec.config import API_KEY_ENV
from tokenmill_runner.spec.resource import API_VERSION, KIND, OPERATOR_ONLY, DatasetGenerationSpec, content_hash

from . import cache, names
from .planner import ServerPlan
from .planner.attention import given_backend
from .states_passes import passes_of

# aws-cli image used by the init container that copies s3:// weights into the pod. The spec has no field for it.
DEFAULT_MODEL_SYNC_IMAGE = cache.AWS_CLI_IMAGE

API_KEY_SECRET_KEY = "api-key"
SERVER_API_KEY_ENV = "SGLANG_API_KEY"
SERVER_CONTAINER = "sglang"
RUNNER_CONTAINER = "runner"
MODELS_MOUNT = "/models"
TOKENIZER_MOUNT = "/tokenizer"
S3_FOLDER = "model"  # s3:// weights are copied to <mount>/model, e.g. /models/model
CONFIG_MOUNT = "/etc/tokenmill"
SPEC_KEY = "spec.yaml"
RUNNER_METRICS_PORT = 9400
RUNNER_UID = 10001
GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"
GPU_TOLERATION = {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}
PROBE_PERIOD_S = 10
# A health probe waits for SGLang's own verdict: its handler answers 503 after HEALTH_CHECK_TIMEOUT_S without a
# scheduler answer, so the kubelet gives it that long plus a margin for the reply to arrive.
HEALTH_PROBE_TIMEOUT_S = HEALTH_CHECK_TIMEOUT_S + 5
DEFAULT_STARTUP_BUDGET_S = 3600  # a plan kept in status from before start-up was predicted
# `tokenmill run` exit codes (docs: README "Exit codes"). 2: a usage or spec error; the operator builds the same
# command line and spec for every index, so no retry and no other index can succeed either.
RUNNER_EXIT_USAGE = 2
# 3: the worker finished its share but gave samples up (retries exhausted, bad answers): a new pod would end the
# same way, so the index is failed at once; the operator reads the ledger and reports SamplesGivenUp.
RUNNER_EXIT_GAVE_UP = 3
# 4: no server was live for longer than the outage budget; nothing was written off, so a new pod continues.
RUNNER_EXIT_SERVERS_DOWN = 4
# 5: a dataset has no sample: its source is empty (every worker sees the same) or all its rows failed for their
# input (a single worker): no retry changes the input.
RUNNER_EXIT_NO_SAMPLES = 5
# Only the tokenizer of an s3:// tokenizer location is needed; skip weights if it points at a full model prefix.
_WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf", "*.msgpack", "*.h5", "*.ckpt")

Manifest = dict[str, Any]


# ---------------------------------------------------------------------------------------------------- metadata


def owner_reference(body: dict[str, Any]) -> dict[str, Any]:
    """Controller owner reference to a DatasetGeneration object (as kopf passes `body`)."""
    metadata = body["metadata"]
    return {
        "apiVersion": body.get("apiVersion", API_VERSION),
        "kind": body.get("kind", KIND),
        "name": metadata["name"],
        "uid": metadata["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(object_name: str, namespace: str, owner: dict[str, Any], labels: dict[str, str]) -> dict[str, Any]:
    return {"name": object_name, "namespace": namespace, "labels": dict(labels), "ownerReferences": [dict(owner)]}


# ---------------------------------------------------------------------------------------------- model location


@dataclass(frozen=True)
class PodFiles:
    """Where a model or tokenizer location appears inside a pod, and what the pod needs to put it there."""

    path: str
    volumes: tuple[Manifest, ...] = ()
    mounts: tuple[Manifest, ...] = ()
    init_containers: tuple[Manifest, ...] = ()


def _pvc_parts(location: str) -> tuple[str, str]:
    claim, _, sub = location.removeprefix("pvc://").partition("/")
    if not claim:
        raise ValueError(f"{location!r}: expected pvc://claim/path/in/volume")
    return claim, sub.strip("/")


def _pvc_files(location: str, volume: str, root: str) -> PodFiles:
    claim, sub = _pvc_parts(location)
    return PodFiles(
        path=f"{root}/{sub}" if sub else root,
        volumes=({"name": volume, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}},),
        mounts=({"name": volume, "mountPath": root, "readOnly": True},),
    )


def _s3_files(location: str, volume: str, root: str, spec: DatasetGenerationSpec,
              excludes: tuple[str, ...] = ()) -> PodFiles:
    target = f"{root}/{S3_FOLDER}"
    # No sizeLimit: the weights land on the node's ephemeral disk, which must hold the whole model (Kimi-K2.5:
    # ~600 GB). Each server pod copies them again; a pre-filled ReadOnlyMany PVC avoids that (pvc://).
    return PodFiles(
        path=target,
        volumes=({"name": volume, "emptyDir": {}},),
        mounts=({"name": volume, "mountPath": root, "readOnly": True},),
        init_containers=(_sync_container(location, volume, root, target, spec, excludes),),
    )


def _sync_container(location: str, volume: str, root: str, target: str, spec: DatasetGenerationSpec,
                    excludes: tuple[str, ...]) -> Manifest:
    return cache.aws_container(f"sync-{volume}", cache.s3_sync_command(location, target, spec, excludes),
                               [{"name": volume, "mountPath": root}], spec)


def _place(location: str, volume: str, root: str, spec: DatasetGenerationSpec,
           excludes: tuple[str, ...] = ()) -> PodFiles:
    if location.startswith("pvc://"):
        return _pvc_files(location, volume, root)
    if location.startswith("s3://"):
        return _s3_files(location, volume, root, spec, excludes)
    # A Hugging Face id (or a path baked into the image): SGLang downloads it itself, which needs internet access
    # from the GPU nodes and repeats the download in every pod on every start.
    return PodFiles(path=location)


def _cached_model(spec: DatasetGenerationSpec, plan: ServerPlan, namespace: str, node_root: str) -> PodFiles:
    copy_s = plan.startup.copy_seconds if plan.startup else 0
    node = cache.NodeCache(node_root, namespace, max(cache.LOCK_WAIT_FLOOR_S, cache.LOCK_WAIT_COPIES * copy_s))
    path, volumes, mounts, init_containers = cache.server_files(spec, plan.weight_bytes, MODELS_MOUNT, "models",
                                                                node)
    return PodFiles(path=path, volumes=tuple(volumes), mounts=tuple(mounts), init_containers=tuple(init_containers))


def server_model_files(spec: DatasetGenerationSpec, plan: ServerPlan | None = None, namespace: str = "default",
                       node_root: str = cache.DEFAULT_NODE_ROOT) -> tuple[PodFiles, PodFiles | None]:
    """(model, tokenizer or None) as the server pod sees them; with spec.model.cache (and a plan, which knows the
    weights' size), the model comes from the cache (cache.py): a node-local copy under the operator's `node_root`."""
    if spec.model.cache is not None and plan is not None:
        model = _cached_model(spec, plan, namespace, node_root)
    else:
        model = _place(spec.model.path, "models", MODELS_MOUNT, spec)
    tokenizer = spec.model.tokenizer
    if tokenizer is None or tokenizer == spec.model.path:
        return model, None
    if tokenizer.startswith("pvc://") and spec.model.path.startswith("pvc://"):
        claim, sub = _pvc_parts(tokenizer)
        if claim == _pvc_parts(spec.model.path)[0]:  # one claim mounted once, not as two volumes
            return model, PodFiles(path=f"{MODELS_MOUNT}/{sub}" if sub else MODELS_MOUNT)
    return model, _place(tokenizer, "tokenizer", TOKENIZER_MOUNT, spec, _WEIGHT_PATTERNS)


def runner_tokenizer_files(spec: DatasetGenerationSpec) -> PodFiles:
    """The tokenizer as a runner pod sees it. The runner fetches s3:// tokenizer files itself, but it cannot reach
    a PVC: a pvc:// location is mounted read-only (the claim must allow several pods, e.g. ReadOnlyMany)."""
    location = spec.model.tokenizer or spec.model.path
    if location.startswith("pvc://"):
        return _pvc_files(location, "models", MODELS_MOUNT)
    return PodFiles(path=location)


# -------------------------------------------------------------------------------------------------------- secret


def api_key_secret(name: str, namespace: str, owner: dict[str, Any], api_key: str) -> Manifest:
    """The server API key. Generated once by the caller and kept: a new key would lock out running workers."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(names.api_key_secret_name(name), namespace, owner,
                              names.labels(name, names.SERVER_COMPONENT)),
        "type": "Opaque",
        # `data`, not `stringData`: what is written is what reads back, so an apply compares equal.
        "data": {API_KEY_SECRET_KEY: base64.b64encode(api_key.encode()).decode()},
    }


# -------------------------------------------------------------------------------------------------------- server


def server_service(name: str, namespace: str, owner: dict[str, Any], spec: DatasetGenerationSpec) -> Manifest:
    """Headless Service giving every server pod a stable DNS name (the runner talks to rank-0 pods directly)."""
    port = spec.server.port
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(names.server_name(name), namespace, owner, names.labels(name, names.SERVER_COMPONENT)),
        "spec": {
            "clusterIP": "None",
            # Ranks of a multi-node replica must resolve each other while loading weights, long before any is
            # ready; and the runner waits for /health itself.
            "publishNotReadyAddresses": True,
            "selector": names.selector_labels(name, names.SERVER_COMPONENT),
            "ports": [
                {"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"},
                {"name": "dist", "port": names.dist_port(port), "targetPort": "dist", "protocol": "TCP"},
            ],
        },
    }


def sglang_args(name: str, spec: DatasetGenerationSpec, plan: ServerPlan, model_path: str,
                tokenizer_path: str | None = None, states_kind: ServedKind = "aux") -> list[str]:
    """launch_server flags, extraArgs last so a user's flag wins (argparse keeps the last value).

    No --reasoning-parser and no --tool-call-parser: the runner sends input_ids to /generate and keeps the raw
    output_ids, so parsers would only risk rewriting text; the seeds' data loss came from exactly that layer.
    """
    server = spec.server
    args = ["--model-path", model_path]
    if tokenizer_path:
        args += ["--tokenizer-path", tokenizer_path]
    args += [
        "--host", "0.0.0.0",  # SGLang's default 127.0.0.1 is unreachable from other pods
        "--port", str(server.port),
        "--tp-size", str(plan.tensor_parallel),
        "--mem-fraction-static", plan.mem_fraction_static,
        "--context-length", str(plan.context_length),
        "--max-running-requests", str(plan.max_running_requests),
    ]
    if plan.kv_cache_dtype != "auto":
        args += ["--kv-cache-dtype", plan.kv_cache_dtype]
    if plan.chunked_prefill_size:  # the chunk the plan's memory split assumes (docs/planning.md §4)
        args += ["--chunked-prefill-size", str(plan.chunked_prefill_size)]
    args += _parallel_args(plan)
    if spec.model.trust_remote_code:
        args += ["--trust-remote-code"]
    if server.deterministic_inference:
        # Only on request: SGLang then builds a per-request seed tensor (sampling_batch_info.py:157 in 0.5.23), so
        # sampling_seed takes effect, at the price of batch-invariant kernels and the pytorch sampler.
        args += ["--enable-deterministic-inference"]
    if spec.hidden_states is not None:
        # The capture the runner's hidden-state pass asks for (facts/hidden_states.py has the 0.5.23 source): the
        # aux layers, or the final state in the second pass of layouts that need it (states_passes.py).
        args += hidden_state_launch_flags(spec.hidden_states.layer_ids, states_kind)
    if plan.attention_backend and given_backend(server.extra_args) is None:
        # Chosen by the planner for deterministic inference (planner/attention.py says why SGLang's own pick fails).
        args += ["--attention-backend", plan.attention_backend]
    args += [
        "--enable-metrics",
        # Expanded by the kubelet from the env var (itself from the Secret): the key never appears in the spec.
        "--api-key", f"$({SERVER_API_KEY_ENV})",
        "--served-model-name", name,
    ]
    return args + list(server.extra_args)


def _parallel_args(plan: ServerPlan) -> list[str]:
    """DP attention and the decode CUDA-graph batch, spelled as the plan's SGLang release spells them: DP attention
    is `--dp-size N --enable-dp-attention` until 0.5.21 and `--attn-dp-size N` from 0.5.22 (arg_groups/fields/
    parallel.py:81); the graph batch `--cuda-graph-max-bs` until 0.5.13.post1 and `--cuda-graph-max-bs-decode`
    from 0.5.14 (where the old name became an alias, removed in 0.5.20)."""
    args: list[str] = []
    facts = release(plan.sglang_version) if plan.sglang_version else None
    if plan.attention_data_parallel > 1:
        groups = str(plan.attention_data_parallel)
        if facts is not None and facts.dp_attention_flag == "--attn-dp-size":
            args += ["--attn-dp-size", groups]
        else:
            args += ["--dp-size", groups, "--enable-dp-attention"]
        if plan.load_balance_method:  # a choice in every supported release (planner/dp_attention.py)
            args += ["--load-balance-method", plan.load_balance_method]
    if plan.cuda_graph_max_bs:
        new_name = facts is None or version_key(facts.version) >= version_key("0.5.14")
        args += ["--cuda-graph-max-bs-decode" if new_name else "--cuda-graph-max-bs", str(plan.cuda_graph_max_bs)]
    return args


def multi_node_script(name: str, namespace: str, nodes: int, port: int) -> str:
    """bash that turns the StatefulSet pod index into --nnodes/--node-rank/--dist-init-addr, then execs SGLang.

    Pods [k·nodes, (k+1)·nodes) form replica k; its rank-0 pod hosts the torch.distributed store. The script
    avoids `$(`: the kubelet would try to expand it as a variable reference.
    """
    sts = names.server_name(name)
    return "\n".join([
        "set -eu",
        'index="${POD_INDEX:-${HOSTNAME##*-}}"',  # the label-based env needs Kubernetes >= 1.28; else the hostname
        'case "$index" in ""|*[!0-9]*) echo "tokenmill: cannot tell the pod index from \'$index\'" >&2; exit 1;; esac',
        f"declare -i nodes={nodes}",
        'declare -i rank="index % nodes"',
        'declare -i leader="index - rank"',
        'echo "tokenmill: pod $index is node rank $rank of $nodes; replica leader is pod $leader" >&2',
        'exec python3 -m sglang.launch_server --nnodes "$nodes" --node-rank "$rank" '
        f'--dist-init-addr "{sts}-${{leader}}.{sts}.{namespace}.svc:{port}" "$@"',
    ])


def _server_env(name: str, multi_node: bool) -> list[Manifest]:
    env: list[Manifest] = [{
        "name": SERVER_API_KEY_ENV,
        "valueFrom": {"secretKeyRef": {"name": names.api_key_secret_name(name), "key": API_KEY_SECRET_KEY}},
    }]
    if multi_node:
        env.append({"name": "POD_INDEX",
                    "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{POD_INDEX_LABEL}']"}}})
    return env


def _server_resources(spec: DatasetGenerationSpec, plan: ServerPlan) -> Manifest:
    # The plan's GPU count wins over spec.server.resources: --tp-size was computed from it.
    extra = spec.server.resources
    gpus = str(plan.gpus_per_node)
    resource = _gpu_resource(plan)
    # Without cpu and memory requests the most expensive pod of the run is BestEffort, the first evicted under node
    # pressure. The /dev/shm tmpfs is charged to the pod's memory, so at least that much is requested; a CPU per GPU
    # for its scheduler process (plus tokenizer and detokenizer). spec.server.resources.requests wins.
    requests = {"cpu": gpus, "memory": spec.server.shm_size}
    return {
        **extra,
        "limits": {**extra.get("limits", {}), resource: gpus},
        "requests": {**requests, **extra.get("requests", {}), resource: gpus},
    }


def _gpu_resource(plan: ServerPlan) -> str:
    """nvidia.com/gpu, or amd.com/gpu on AMD products (ROCm k8s-device-plugin)."""
    return RESOURCE_BY_VENDOR.get(plan.gpu_vendor, GPU_RESOURCE)


def _server_probes(port_name: str, startup_timeout_s: int) -> dict[str, Manifest]:
    # /health and /health_generate both run a one-token generation (up to SGLANG_HEALTH_CHECK_TIMEOUT = 20 s on a
    # stuck scheduler), so a 1 s probe timeout flaps under load. Liveness and readiness start only after the
    # startup probe passed, so weight loading and CUDA-graph capture are budgeted by the startup probe alone.
    # Ranks >= 1 of a multi-node replica answer these paths from SGLang's dummy health server.
    def http(path: str) -> Manifest:
        return {"path": path, "port": port_name}

    return {
        "startupProbe": {"httpGet": http("/health"), "periodSeconds": PROBE_PERIOD_S, "timeoutSeconds": 10,
                         "failureThreshold": max(1, math.ceil(startup_timeout_s / PROBE_PERIOD_S))},
        "readinessProbe": {"httpGet": http("/health_generate"), "periodSeconds": 30,
                           "timeoutSeconds": HEALTH_PROBE_TIMEOUT_S, "failureThreshold": 3},
        "livenessProbe": {"httpGet": http("/health"), "periodSeconds": 30, "timeoutSeconds": HEALTH_PROBE_TIMEOUT_S,
                          "failureThreshold": 5},
    }


def _startup_budget(spec: DatasetGenerationSpec, plan: ServerPlan) -> int:
    """spec.server.startupTimeoutSeconds when set, else the plan's budget from the predicted load."""
    if spec.server.startup_timeout_seconds is not None:
        return spec.server.startup_timeout_seconds
    return plan.startup.probe_seconds if plan.startup else DEFAULT_STARTUP_BUDGET_S


def _server_container(name: str, namespace: str, spec: DatasetGenerationSpec, plan: ServerPlan,
                      model: PodFiles, tokenizer: PodFiles | None, states_kind: ServedKind) -> Manifest:
    server = spec.server
    multi_node = plan.nodes_per_replica > 1
    args = sglang_args(name, spec, plan, model.path, tokenizer.path if tokenizer else None, states_kind)
    if multi_node:
        script = multi_node_script(name, namespace, plan.nodes_per_replica, names.dist_port(server.port))
        command = ["bash", "-c", script, "sglang-launch"]  # "$@" in the script = args below
    else:
        command = ["python3", "-m", "sglang.launch_server"]
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}, *model.mounts, *(tokenizer.mounts if tokenizer else ())]
    return {
        "name": SERVER_CONTAINER,
        "image": plan.image or server.image,  # the plan may swap in the -cu129 tag the nodes' driver runs
        "command": command,
        "args": args,
        "env": _server_env(name, multi_node),
        "ports": [
            {"name": "http", "containerPort": server.port, "protocol": "TCP"},
            {"name": "dist", "containerPort": names.dist_port(server.port), "protocol": "TCP"},
        ],
        "resources": _server_resources(spec, plan),
        "volumeMounts": mounts,
        **_server_probes("http", _startup_budget(spec, plan)),
        # SGLang images run as root (and their caches belong to root), so no runAsNonRoot and no read-only root
        # filesystem here. Over TCP and NVLink, NCCL needs no capability (CUDA IPC handles travel over Unix
        # sockets): drop them all. InfiniBand/RoCE would need IPC_LOCK, device mounts and host networking, which
        # the spec does not express yet. Never privileged.
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def _tolerations(extra: list[dict[str, Any]], resource: str = GPU_RESOURCE) -> list[dict[str, Any]]:
    # Set explicitly: the ExtendedResourceToleration admission plugin that would add it is not enabled everywhere.
    toleration = {**GPU_TOLERATION, "key": resource}
    return [toleration] + [dict(item) for item in extra if item != toleration]


def _node_selector(spec: DatasetGenerationSpec, plan: ServerPlan) -> dict[str, str]:
    product = plan.gpu_product or spec.server.gpu_product
    key = PRODUCT_LABEL_KEY.get(plan.gpu_vendor, GPU_PRODUCT_LABEL)  # type: ignore[call-overload]
    selector = {key: product} if product else {}
    return {**selector, **spec.server.node_selector}


def _server_pod(name: str, namespace: str, spec: DatasetGenerationSpec, plan: ServerPlan,
                node_root: str, states_kind: ServedKind) -> Manifest:
    model, tokenizer = server_model_files(spec, plan, namespace, node_root)
    files = [model] + ([tokenizer] if tokenizer else [])
    pod_spec: Manifest = {
        # Service links would inject <SERVICE>_PORT variables; one named like an SGLANG_* setting would change it.
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,  # SGLang never talks to the Kubernetes API
        # The container runtime's default seccomp profile: SGLang, NCCL over TCP/NVLink and CUDA need none of the
        # syscalls it blocks. Not runAsNonRoot: SGLang images run as root (see the container's securityContext).
        "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
        "terminationGracePeriodSeconds": 60,
        "tolerations": _tolerations(spec.server.tolerations, _gpu_resource(plan)),
        "containers": [_server_container(name, namespace, spec, plan, model, tokenizer, states_kind)],
        "volumes": [
            # NCCL and PyTorch need far more than the 64 MiB default /dev/shm; tmpfs counts as pod memory.
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.server.shm_size}},
            *(volume for item in files for volume in item.volumes),
        ],
    }
    init_containers = [container for item in files for container in item.init_containers]
    if init_containers:
        pod_spec["initContainers"] = init_containers
    node_selector = _node_selector(spec, plan)
    if node_selector:
        pod_spec["nodeSelector"] = node_selector
    return {"metadata": {"labels": names.labels(name, names.SERVER_COMPONENT)}, "spec": pod_spec}


def server_statefulset(name: str, namespace: str, owner: dict[str, Any], spec: DatasetGenerationSpec,
                       plan: ServerPlan, replicas: int | None = None,
                       node_root: str = cache.DEFAULT_NODE_ROOT, states_kind: ServedKind = "aux") -> Manifest:
    """SGLang pods: plan.replicas × plan.nodes_per_replica of them, or `replicas` (0 to free the GPUs); a node-local
    model cache lives under the operator's `node_root`; `states_kind` the hidden-state pass they serve."""
    count = plan.replicas * plan.nodes_per_replica if replicas is None else replicas
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _metadata(names.server_name(name), namespace, owner, names.labels(name, names.SERVER_COMPONENT)),
        "spec": {
            "replicas": count,
            "serviceName": names.server_name(name),
            # All ranks of a replica must start together: OrderedReady would wait for rank 0 to be ready, which it
            # never is until the other ranks joined.
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": names.selector_labels(name, names.SERVER_COMPONENT)},
            "template": _server_pod(name, namespace, spec, plan, node_root, states_kind),
        },
    }


def _scraper(namespace: str | None, ports: list[Manifest]) -> list[Manifest]:
    """The metrics scraper's ingress rule: pods labelled prometheus in the operator setting's namespace
    (TOKENMILL_SCRAPER_NAMESPACE), never by label alone (anyone who can create a pod can set a label); none unset."""
    if not namespace:
        return []
    return [{"from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
                       "podSelector": {"matchLabels": {names.LABEL_NAME: "prometheus"}}}], "ports": ports}]


def _ingress_policy(policy_name: str, name: str, namespace: str, owner: dict[str, Any], component: str,
                    ingress: list[Manifest]) -> Manifest:
    """A NetworkPolicy admitting only `ingress` to the pods of one component. Kubelet probes are node traffic,
    which common network plugins always allow."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(policy_name, namespace, owner, names.labels(name, component)),
        "spec": {
            "podSelector": {"matchLabels": names.selector_labels(name, component)},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


# The operator's pods, as the chart labels them (charts/tokenmill/templates/_helpers.tpl tokenmill.labels).
OPERATOR_POD_LABELS = {names.LABEL_COMPONENT: "operator", "app.kubernetes.io/part-of": "tokenmill"}


def _operator(namespace: str | None, ports: list[Manifest]) -> list[Manifest]:
    """The operator's ingress rule: it reads each replica's /metrics to check the plan (sglang_metrics.py); from
    its own namespace only (TOKENMILL_OPERATOR_NAMESPACE), none unset."""
    if not namespace:
        return []
    return [{"from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
                       "podSelector": {"matchLabels": dict(OPERATOR_POD_LABELS)}}], "ports": ports}]


def network_policy(name: str, namespace: str, owner: dict[str, Any], spec: DatasetGenerationSpec,
                   scraper_namespace: str | None = None, operator_namespace: str | None = None) -> Manifest:
    """Only this instance's runner may call the servers' API (the scraper and the operator read /metrics)."""
    http = [{"protocol": "TCP", "port": spec.server.port}]
    return _ingress_policy(names.network_policy_name(name), name, namespace, owner, names.SERVER_COMPONENT, [
        {"from": [{"podSelector": {"matchLabels": names.selector_labels(name, names.RUNNER_COMPONENT)}}],
         "ports": http},
        # Ranks of a multi-node replica: torch.distributed store plus NCCL's dynamically chosen ports.
        {"from": [{"podSelector": {"matchLabels": names.selector_labels(name, names.SERVER_COMPONENT)}}]},
        # The scraper reads /metrics on the HTTP port: SGLang serves it there (no separate metrics port in HTTP
        # mode) and exempts /metrics and /health* from the API key (0.5.23 utils/auth.py:101-106), so the scraper
        # can also call /health_generate: it is admitted from one namespace only.
        *_scraper(scraper_namespace, http),
        *_operator(operator_namespace, http),
    ])


def runner_network_policy(name: str, namespace: str, owner: dict[str, Any],
                          scraper_namespace: str | None = None) -> Manifest:
    """Runner pods serve only unauthenticated metrics: admitted from the scraper's namespace, on that port."""
    ports = [{"protocol": "TCP", "port": RUNNER_METRICS_PORT}]
    return _ingress_policy(names.runner_network_policy_name(name), name, namespace, owner, names.RUNNER_COMPONENT,
                           _scraper(scraper_namespace, ports))


# -------------------------------------------------------------------------------------------------------- runner


def runner_document(name: str, namespace: str, spec: DatasetGenerationSpec) -> dict[str, Any]:
    """The DatasetGeneration document `tokenmill run` reads in the runner pod. The one change: a pvc:// tokenizer
    becomes the folder where the runner pod mounts it (the runner cannot open pvc:// locations itself)."""
    dumped = spec.model_dump(mode="json", by_alias=True, exclude_none=True)
    for operator_only in OPERATOR_ONLY:  # the runner never reads them (and an older runner does not know them)
        dumped["server"].pop(operator_only, None)
    tokenizer = runner_tokenizer_files(spec)
    if tokenizer.volumes:
        dumped["model"]["tokenizer"] = tokenizer.path
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name, "namespace": namespace},
            "spec": dumped}


def runner_configmap(name: str, namespace: str, owner: dict[str, Any], spec: DatasetGenerationSpec) -> Manifest:
    document = runner_document(name, namespace, spec)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(names.runner_configmap_name(name), namespace, owner,
                              names.labels(name, names.RUNNER_COMPONENT)),
        "data": {SPEC_KEY: yaml.safe_dump(document, sort_keys=False, allow_unicode=True)},
    }


@dataclass(frozen=True)
class RunnerIdentity:
    """Who the runner writes for: the resource's uid (its Jobs share the output's lease) and its Job's hash (recorded
    in run.json, so the operator can tell this Job's layout from an earlier one's)."""

    owner_uid: str
    job_hash: str


def runner_args(spec: DatasetGenerationSpec, server_urls: list[str], retry_failed: bool = False,
                identity: RunnerIdentity | None = None, states_pass: str = "", trial_sample: str = "") -> list[str]:
    args = ["run", f"{CONFIG_MOUNT}/{SPEC_KEY}", "--out", spec.output.uri,
            "--workers", str(spec.runner.parallelism), "--metrics-port", str(RUNNER_METRICS_PORT),
            "--metrics-address", "0.0.0.0"]  # the pod's network; runner_network_policy admits only the scraper
    if identity is not None:
        args += ["--owner-uid", identity.owner_uid, "--job-hash", identity.job_hash]
    for url in server_urls:
        args += ["--server", url]
    if spec.output.endpoint:
        args += ["--s3-endpoint", spec.output.endpoint]
    if retry_failed or spec.runner.retry_failed:
        args += ["--retry-failed"]
    if states_pass:
        # Layouts captured in two passes: this Job captures one kind, waiting for the server to serve it, and
        # exits 0 when done; the operator then starts the next pass (states_passes.py).
        args += ["--states-pass", states_pass]
    if trial_sample:
        # The measured trial's candidate: its stratified sample of every dataset is sent first (trialling.sample_of).
        args += ["--trial-sample", trial_sample]
    return args


def runner_job_hash(spec: DatasetGenerationSpec, server_urls: list[str], retry_token: str = "",
                    layout: str = "", states_pass: str = "", trial_sample: str = "") -> str:
    """The identity of a runner Job: a hash of everything its pods depend on (the spec document they read, their
    command line, their image). `suspend` is left out: suspending keeps the Job. When the hash changes, the operator
    replaces the Job; the new one resumes from what is committed. `layout` is the operator's layout switch
    (status.layoutOverride.token): its workers size their concurrency from the servers at start, so a switch that
    keeps the servers' count (TP 8 to TP 8 + DP attention) still needs a new Job. Left out when empty, so the Jobs
    of runs without a switch keep their hash; so is `states_pass` (the hidden-state pass of layouts that need two:
    each pass is its own Job) and `trial_sample` (each trial candidate's Job sends its own sample first)."""
    return content_hash({"spec": spec.identity_document(), "servers": server_urls, "retry": retry_token,
                         **({"layout": layout} if layout else {}),
                         **({"statesPass": states_pass} if states_pass else {}),
                         **({"trialSample": trial_sample} if trial_sample else {})})


def _runner_env(name: str, spec: DatasetGenerationSpec) -> list[Manifest]:
    env: list[Manifest] = [
        {"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": names.api_key_secret_name(name),
                                                             "key": API_KEY_SECRET_KEY}}},
        # The root filesystem is read-only: every cache and home goes to the /tmp emptyDir.
        {"name": "HOME", "value": "/tmp"},
        {"name": "HF_HOME", "value": "/tmp/hf"},
        {"name": "TOKENMILL_CACHE", "value": "/tmp/tokenmill"},
    ]
    if spec.output.region:
        env.append({"name": "AWS_DEFAULT_REGION", "value": spec.output.region})
    return env


def _exit_codes(action: str, code: int) -> Manifest:
    return {"action": action, "onExitCodes": {"containerName": RUNNER_CONTAINER, "operator": "In", "values": [code]}}


def _pod_failure_policy() -> Manifest:
    # Rules are evaluated in order; unmatched failures count against backoffLimitPerIndex (exit 1 covers both
    # transient trouble, e.g. S3 or a server that was not up in time, and spec errors: retrying is the safe side).
    return {"rules": [
        # Eviction, preemption, node drain: not the worker's fault, and it resumes from what is committed.
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]},
        _exit_codes("FailJob", RUNNER_EXIT_USAGE),
        _exit_codes("FailJob", RUNNER_EXIT_NO_SAMPLES),
        _exit_codes("FailIndex", RUNNER_EXIT_GAVE_UP),
        # Said explicitly: a servers' outage is retried, within backoffLimitPerIndex (the default action).
        _exit_codes("Count", RUNNER_EXIT_SERVERS_DOWN),
    ]}


def _runner_container(name: str, spec: DatasetGenerationSpec, image: str, server_urls: list[str],
                      tokenizer: PodFiles, retry_failed: bool, identity: RunnerIdentity, states_pass: str,
                      trial_sample: str) -> Manifest:
    container: Manifest = {
        "name": RUNNER_CONTAINER,
        "image": image,
        "command": ["tokenmill"],
        "args": runner_args(spec, server_urls, retry_failed, identity, states_pass, trial_sample),
        "env": _runner_env(name, spec),
        "ports": [{"name": "metrics", "containerPort": RUNNER_METRICS_PORT, "protocol": "TCP"}],
        # The runner holds tokenized prompts of a bounded in-flight window plus one open shard per dataset:
        # 2Gi typical; the 8Gi ceiling leaves room for long-context prompts and a large tokenizer.
        "resources": {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "8Gi"}},
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
            *tokenizer.mounts,
        ],
        "securityContext": {
            "readOnlyRootFilesystem": True,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        },
        # Replaced pods are deleted before their successor starts, so keep the last words in the pod status.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if spec.output.credentials_secret:
        container["envFrom"] = [{"secretRef": {"name": spec.output.credentials_secret, "optional": False}}]
    return container


def _runner_pod(name: str, spec: DatasetGenerationSpec, image: str, server_urls: list[str],
                retry_failed: bool, identity: RunnerIdentity, states_pass: str, trial_sample: str) -> Manifest:
    tokenizer = runner_tokenizer_files(spec)
    return {
        "metadata": {"labels": names.labels(name, names.RUNNER_COMPONENT)},
        "spec": {
            "restartPolicy": "Never",  # required by podFailurePolicy; retries are new pods, counted per index
            "enableServiceLinks": False,
            "automountServiceAccountToken": False,  # the runner reads S3 and calls SGLang, never the API server
            # SIGTERM commits finished samples before exiting; in-flight requests are redone on resume.
            "terminationGracePeriodSeconds": 60,
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": RUNNER_UID,
                "runAsGroup": RUNNER_UID,
                "fsGroup": RUNNER_UID,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": [_runner_container(name, spec, image, server_urls, tokenizer, retry_failed, identity,
                                             states_pass, trial_sample)],
            "volumes": [
                {"name": "config", "configMap": {"name": names.runner_configmap_name(name)}},
                # No sizeLimit: S3 Parquet sources are spooled here whole (Parquet needs its footer first).
                {"name": "tmp", "emptyDir": {}},
                *tokenizer.volumes,
            ],
        },
    }


def runner_job(name: str, namespace: str, owner: dict[str, Any], spec: DatasetGenerationSpec, image: str,
               server_urls: list[str], retry_token: str = "", layout: str = "", states_pass: str | None = None,
               trial_sample: str = "") -> Manifest:
    """Indexed Job: worker i ($JOB_COMPLETION_INDEX) takes the samples whose id hashes to i. The servers' sizes
    reach the runner through the servers themselves (/server_info), not through the plan. A retry token (the
    handled tokenmill.io/retry-failed value) makes it run with --retry-failed; the Job carries its hash and what the
    run was started with as annotations."""
    workers = spec.runner.parallelism
    if states_pass is None:  # `tokenmill plan`, Kueue's pod sets: the first pass
        states_pass = next(iter(passes_of(spec)), "")
    job_hash = runner_job_hash(spec, server_urls, retry_token, layout, states_pass, trial_sample)
    metadata = _metadata(names.runner_name(name), namespace, owner, names.labels(name, names.RUNNER_COMPONENT))
    metadata["annotations"] = {
        names.JOB_HASH_ANNOTATION: job_hash,
        names.RUN_ANNOTATION: json.dumps(run_identity(spec), sort_keys=True),
        **({names.RETRY_ANNOTATION: retry_token} if retry_token else {}),
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": metadata,
        "spec": {
            "completionMode": "Indexed",
            "completions": workers,
            "parallelism": workers,
            "backoffLimitPerIndex": 3,
            # Let every index use its own retries: one failing worker must not stop the others' progress.
            "maxFailedIndexes": workers,
            # A replacement starts only once its predecessor is gone: the commit protocol assumes at most one live
            # worker per index (two would write the same shards).
            "podReplacementPolicy": "Failed",
            "podFailurePolicy": _pod_failure_policy(),
            "suspend": spec.suspend,
            # No ttlSecondsAfterFinished: the operator reads the finished Job's status.
            "template": _runner_pod(name, spec, image, server_urls, bool(retry_token),
                                    RunnerIdentity(owner["uid"], job_hash), states_pass, trial_sample),
        },
    }


def run_identity(spec: DatasetGenerationSpec) -> dict[str, str]:
    """What a run's outputs belong to; it cannot change once the run started (outputs of two models, or a run split
    over two output prefixes, would follow)."""
    return {"modelPath": spec.model.path, "tokenizer": spec.model.tokenizer or spec.model.path,
            "outputUri": spec.output.uri}
