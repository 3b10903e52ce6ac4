"""Names, labels and in-cluster addresses of a DatasetGeneration's children. Pure functions.

Every name is derived from the DatasetGeneration's name alone, so a restarted operator finds the objects it made
before (idempotent get-or-create / apply) without keeping any state of its own.
"""

from __future__ import annotations

import hashlib
import re

# Label values, Service names and pod hostnames are DNS-1123/1035 labels: at most 63 characters.
MAX_LABEL = 63
# The StatefulSet controller labels every pod `controller-revision-hash: <statefulset>-<10-char hash>`, and a Job's
# Indexed pods get the hostname `<job>-<index>`: both must fit 63, so these two names keep 11 characters spare.
MAX_WORKLOAD_NAME = 52

SERVER_COMPONENT = "server"
RUNNER_COMPONENT = "runner"
DIST_PORT = 5000  # --dist-init-addr port on the rank-0 pod of a multi-node replica (torch.distributed TCP store)

LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_DATASET_GENERATION = "tokenmill.io/dataset-generation"
APP_NAME = "tokenmill"
MANAGER = "tokenmill-operator"

# Set by users (any new value asks for one retry of what was given up); the operator records the last value handled.
RETRY_ANNOTATION = "tokenmill.io/retry-failed"
# On the runner Job: the hash of what it depends on, and what the run was started with (JSON).
JOB_HASH_ANNOTATION = "tokenmill.io/job-hash"
RUN_ANNOTATION = "tokenmill.io/run"

_NOT_DNS = re.compile(r"[^a-z0-9-]+")


def _short_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def bounded(base: str, suffix: str = "", limit: int = MAX_LABEL) -> str:
    """`base-suffix` as a DNS-1035 label of at most `limit` characters.

    A base that had to be shortened or cleaned up (dots, upper case, a leading digit) gets a hash of the original
    appended, so two different DatasetGenerations never map to one child name.
    """
    clean = _NOT_DNS.sub("-", base.lower()).strip("-") or "x"
    if not clean[0].isalpha():
        clean = "t" + clean  # Service names must start with a letter
    tail = f"-{suffix}" if suffix else ""
    if clean == base and len(clean) + len(tail) <= limit:
        return clean + tail
    digest = _short_hash(base)
    keep = limit - len(tail) - len(digest) - 1
    return f"{clean[:keep].rstrip('-')}-{digest}{tail}"


def label_value(value: str) -> str:
    """A label value (the CR name may be a 253-character DNS subdomain; label values stop at 63)."""
    if len(value) <= MAX_LABEL:
        return value
    digest = _short_hash(value)
    return f"{value[:MAX_LABEL - len(digest) - 1].rstrip('-.')}-{digest}"


def server_name(name: str) -> str:
    """StatefulSet, headless Service and NetworkPolicy of the SGLang servers."""
    return bounded(name, "server", MAX_WORKLOAD_NAME)


def network_policy_name(name: str) -> str:
    return server_name(name)


def api_key_secret_name(name: str) -> str:
    return bounded(name, "server-key")


def runner_name(name: str) -> str:
    """Runner Job and its ConfigMap."""
    return bounded(name, "runner", MAX_WORKLOAD_NAME)


def runner_configmap_name(name: str) -> str:
    return runner_name(name)


def runner_network_policy_name(name: str) -> str:
    return runner_name(name)


def labels(name: str, component: str) -> dict[str, str]:
    """The explicit label set of every child. Never the CR's own labels: under Argo CD's label tracking a copied
    `app.kubernetes.io/instance` would make the children look like resources of the Application."""
    instance = label_value(name)
    return {
        LABEL_NAME: APP_NAME,
        LABEL_INSTANCE: instance,
        LABEL_COMPONENT: component,
        LABEL_MANAGED_BY: MANAGER,
        LABEL_DATASET_GENERATION: instance,
    }


def selector_labels(name: str, component: str) -> dict[str, str]:
    """The immutable subset used in selectors (StatefulSet selector, Service, NetworkPolicy peers)."""
    full = labels(name, component)
    return {key: full[key] for key in (LABEL_NAME, LABEL_INSTANCE, LABEL_COMPONENT)}


def server_pod_host(name: str, namespace: str, index: int) -> str:
    """Stable DNS name of server pod `index` through the headless Service."""
    sts = server_name(name)
    return f"{sts}-{index}.{sts}.{namespace}.svc"


def dist_port(http_port: int) -> int:
    """The torch.distributed port; moved aside in the odd case that SGLang's HTTP port is 5000 itself."""
    return DIST_PORT if http_port != DIST_PORT else DIST_PORT + 1


def leader_indexes(replicas: int, nodes_per_replica: int) -> list[int]:
    """Pod indexes of node rank 0 in each replica: pods [k·nodes, (k+1)·nodes) form replica k."""
    return [replica * nodes_per_replica for replica in range(replicas)]


def server_urls(name: str, namespace: str, port: int, replicas: int, nodes_per_replica: int = 1) -> list[str]:
    """Base URLs the runner sends /generate to: one per replica, its rank-0 pod (other ranks serve no API)."""
    return [
        f"http://{server_pod_host(name, namespace, index)}:{port}"
        for index in leader_indexes(replicas, nodes_per_replica)
    ]


def reporting_node_ranks(tensor_parallel: int, nodes_per_replica: int, attention_data_parallel: int = 1) -> list[int]:
    """Node ranks of a replica whose pods host a scheduler that writes the scheduler gauges: one per DP attention
    group, its attention-TP rank 0 (SGLang 0.5.23 observability/metrics_collector.py:1361-1363).

    Node k runs TP ranks [k·T/N, (k+1)·T/N) (entrypoints/engine.py:2045-2077, _calculate_rank_ranges without
    pipeline parallelism; managers/data_parallel_controller.py:702-712 for the DP attention launch); TP rank r is in
    group r // (T/D) at attention-TP rank r % (T/D) (runtime_context.py:73-92). So group g reports from TP rank
    g·T/D, on node g·T/D // (T/N). Every node's schedulers write to that node's own Prometheus multiprocess
    directory (utils/common.py:2825-2840, set on every node: entrypoints/engine.py:1155, 1940-1942), and a node of
    rank >= 1 serves them on the HTTP port from its health server (entrypoints/engine.py:1234, 1279-1285;
    utils/common.py:3624-3653; the same in 0.5.9: engine.py:1040-1054, utils/common.py:2656-2681): the rank-0 pod's
    /metrics has node 0's groups only."""
    nodes = max(1, nodes_per_replica)
    groups = max(1, attention_data_parallel)
    attn_tp = max(1, tensor_parallel // groups)
    per_node = max(1, tensor_parallel // nodes)
    return sorted({min(nodes - 1, group * attn_tp // per_node) for group in range(groups)})


def metrics_urls(name: str, namespace: str, port: int, replicas: int, nodes_per_replica: int = 1,
                 tensor_parallel: int = 1, attention_data_parallel: int = 1) -> list[list[str]]:
    """Per replica, the base URLs whose /metrics together hold all its DP attention groups' scheduler gauges: its
    pods of `reporting_node_ranks` (the rank-0 pod alone for a replica without DP attention or on one node)."""
    ranks = reporting_node_ranks(tensor_parallel, nodes_per_replica, attention_data_parallel)
    return [
        [f"http://{server_pod_host(name, namespace, leader + rank)}:{port}" for rank in ranks]
        for leader in leader_indexes(replicas, nodes_per_replica)
    ]
