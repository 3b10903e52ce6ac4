"""What the administrator set for the whole operator (the chart's values, through its environment): the runner
image, stall and queue rules, the tenant policy, the node-local cache root, the operator's own namespace. Read once
at start-up; plain data every pass decides with."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import orjson

from . import cache, policy
from .constants import NAMESPACE_ENV

REQUIRE_QUEUE_ENV = "TOKENMILL_REQUIRE_QUEUE"


@dataclass(frozen=True)
class OperatorSettings:
    runner_image: str = os.environ.get("TOKENMILL_RUNNER_IMAGE", "ghcr.io/tokenmill/tokenmill-runner:0.1.0")
    stall_after_s: float = float(os.environ.get("TOKENMILL_STALL_SECONDS", "900"))
    # Extra labels on the pods of the Jobs it creates, the runner's and the model cache's fill (JSON object); the
    # e2e tests use it to hold Job pods running under kwok.
    runner_pod_labels: dict[str, str] = field(
        default_factory=lambda: orjson.loads(os.environ.get("TOKENMILL_RUNNER_POD_LABELS", "{}")))
    # Where Prometheus runs: the only namespace whose scraper the NetworkPolicies admit (none when unset).
    scraper_namespace: str | None = os.environ.get("TOKENMILL_SCRAPER_NAMESPACE") or None
    tenant_policy: policy.TenantPolicy = field(default_factory=lambda: policy.TenantPolicy.from_env(os.environ))
    # Every resource must name a Kueue LocalQueue (the label); one without it is refused (QueueRequired).
    require_queue: bool = os.environ.get(REQUIRE_QUEUE_ENV, "").strip().lower() == "true"
    # The node-local model cache's folder on every node: the administrator's, never a resource's (cache.py).
    node_cache_root: str = field(default_factory=lambda: cache.node_root(
        os.environ.get(cache.NODE_ROOT_ENV) or cache.DEFAULT_NODE_ROOT))
    # Where every server replica's /metrics is read instead of its rank-0 pod (the e2e tests under kwok, where no
    # server container runs, point it at the simulator); unset in a cluster.
    server_metrics_url: str | None = os.environ.get("TOKENMILL_SERVER_METRICS_URL") or None
    # The operator's own namespace (the chart sets it from the pod's): where the cluster's measured constants are
    # kept (observe/constants.py); unset, plans use the published fit and nothing is recorded.
    operator_namespace: str | None = os.environ.get(NAMESPACE_ENV) or None
    # Trial seconds per wall second for the measured trial's rules (server_metrics.TrialScrapes): 1 in a cluster.
    trial_clock_scale: float = float(os.environ.get("TOKENMILL_TRIAL_CLOCK_SCALE", "1"))
