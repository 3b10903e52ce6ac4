"""The cluster's measured step constants, as plans use them: a refit (facts/refit.py) kept under its key
(planner/verify.py), the plan made again from it, and the ConfigMap that keeps the entries (read in
observe/constants.py, written in act/constants.py).

Nothing shared is keyed by what a tenant claims (security-f9665d2.md B2: one tenant's fake /metrics, under a GPU
product its nodeSelector contradicted, moved another tenant's plan to a 32 % slower layout). Every refit is kept for
its namespace (`ns.<namespace>.<key>`), read by that namespace's later plans only. An entry every namespace starts
from (`cluster.<key>`) is written only from a run an administrator trusts (`promotion_refusal`): a listed image, on
nodes whose own GPU label is the plan's product, over a full window, and within a band around the published fit.
Entries of the old form (the bare key) are never read: any tenant could have written them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenmill_runner.facts.refit import Refit
from tokenmill_runner.facts.throughput import CALIBRATION
from tokenmill_runner.facts.workload import Workload
from tokenmill_runner.spec.resource import DatasetGenerationSpec

from . import names
from .planner import ModelFacts, ServerPlan, plan_server
from .planner.verify import CONFIGMAP_NAME, LayoutKey, pinned_spec, plan_constants_key, read_constants
from .policy import image_allowed

# The operator's own namespace (the chart sets it from the pod's): where the ConfigMap is kept; unset, nothing is
# read or written and plans use the published fit.
NAMESPACE_ENV = "TOKENMILL_OPERATOR_NAMESPACE"

# The cluster's measured constants by their key (verify.constants_key), or None where there are none.
Constants = Callable[[str], Refit | None]

NAMESPACE_PREFIX = "ns."
CLUSTER_PREFIX = "cluster."
# Image prefixes whose runs may write the entry every namespace starts from (policy.image_allowed's matching); none
# by default: then each namespace learns only from its own runs.
TRUSTED_IMAGES_ENV = "TOKENMILL_TRUSTED_IMAGES"
# A cluster-wide entry needs this long a window (the default spec.server.verifyWindowSeconds) and this many samples:
# a window of one second (the spec allows it) measures nothing a whole cluster should plan from.
MIN_TRUSTED_WINDOW_S = 600.0
MIN_TRUSTED_SAMPLES = 20
# ... and each multiplier within this factor of the published fit either way (the poisoned entry of B2 had
# collectives x20; honest refits on the measured clusters stay within x1.5).
TRUSTED_BAND = 2.0
MAX_KEY = 253


def namespace_key(namespace: str, key: str) -> str:
    return f"{NAMESPACE_PREFIX}{namespace}.{key}"[:MAX_KEY]


def cluster_key(key: str) -> str:
    return f"{CLUSTER_PREFIX}{key}"[:MAX_KEY]


def stored(data: dict[str, str] | None, namespace: str, key: str) -> Refit | None:
    """The constants a plan of `namespace` starts from: its own namespace's entry, else the trusted cluster-wide one."""
    return read_constants(data, namespace_key(namespace, key)) or read_constants(data, cluster_key(key))


@dataclass(frozen=True)
class Evidence:
    """What a refit's run was, as the operator saw it (not as the spec claims): for `promotion_refusal`."""

    image: str  # the image the server ran
    planned_product: str | None  # the GPU product the plan (and the key) names
    node_products: tuple[str | None, ...]  # the GPU product label of each node the server pods ran on
    window_s: float
    samples: int


def promotion_refusal(measured: Measured, evidence: Evidence, trusted_images: tuple[str, ...]) -> str | None:
    """Why this refit may not become the entry every namespace starts from, or None."""
    if not trusted_images:
        return (f"no server image is trusted for cluster-wide constants ({TRUSTED_IMAGES_ENV}, chart value "
                "operator.measuredConstants.trustedImages)")
    if not any(image_allowed(evidence.image, prefix) for prefix in trusted_images):
        return f"the server image {evidence.image} is not among the trusted ones ({', '.join(trusted_images)})"
    if not evidence.node_products or any(product != evidence.planned_product for product in evidence.node_products):
        seen = ", ".join(sorted({str(product) for product in evidence.node_products})) or "none"
        return (f"the server pods ran on nodes labelled {seen}, not all {evidence.planned_product} as the plan's key "
                "says")
    if evidence.window_s < MIN_TRUSTED_WINDOW_S or evidence.samples < MIN_TRUSTED_SAMPLES:
        return (f"the window was {evidence.window_s:.0f} s with {evidence.samples} samples, under the "
                f"{MIN_TRUSTED_WINDOW_S:.0f} s and {MIN_TRUSTED_SAMPLES} samples a cluster-wide entry needs")
    r = measured.result
    for name, value in (("expert speed", r.expert_speed), ("collective scale", r.collective_scale),
                        ("DP attention overhead", r.dp_scale)):
        if not 1 / TRUSTED_BAND <= value <= TRUSTED_BAND:
            return (f"its {name} is x{value:.2f} of the published fit, outside the x{1 / TRUSTED_BAND:.2f}-"
                    f"x{TRUSTED_BAND:.2f} band a cluster-wide entry must lie in")
    return None


def configmap(namespace: str, data: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": CONFIGMAP_NAME, "namespace": namespace,
                         "labels": {names.LABEL_NAME: names.APP_NAME, names.LABEL_COMPONENT: "measured-constants",
                                    names.LABEL_MANAGED_BY: names.MANAGER}},
            "data": data}


@dataclass(frozen=True)
class Measured:
    key: str
    result: Refit  # multipliers on the published fit
    facts: ModelFacts | None = None  # the model's, as read for the refit (the re-plan uses them again)

    def describe(self) -> str:
        r = self.result
        return (f"experts read x{r.expert_speed:.2f} as fast, collectives x{r.collective_scale:.2f}, DP attention "
                f"overhead x{r.dp_scale:.2f} of the published fit ({r.samples} samples; the plan's step was off "
                f"{r.error_before:.0%} on them, the refitted one {r.error_after:.0%})")


def plan_with_constants(spec: DatasetGenerationSpec, facts: ModelFacts, work: Workload | None = None,
                        node_driver_major: int | None = None, constants: Constants | None = None) -> ServerPlan:
    """The plan, started from the cluster's measured constants for its hardware and software when there are some
    (planned once with the published fit to know which GPU, link and release it runs on, then again)."""
    plan = plan_server(spec, facts, work=work, node_driver_major=node_driver_major)
    if constants is None:
        return plan
    key = plan_constants_key(plan, facts.architecture)
    stored = constants(key)
    if stored is None:
        return plan
    measured = plan_server(spec, facts, work=work, node_driver_major=node_driver_major,
                           calibration=stored.calibration(CALIBRATION))
    return measured.model_copy(update={"measured_constants": key})


def replan(spec: DatasetGenerationSpec, plan: ServerPlan, measured: Measured) -> ServerPlan | None:
    """The plan made again from the measured constants: every layout's ETA on the measured hardware."""
    if measured.facts is None:
        return None
    return plan_with_constants(spec, measured.facts, node_driver_major=plan.cuda_driver_major,
                               constants=lambda key: measured.result if key == measured.key else None)


def plan_layout(spec: DatasetGenerationSpec, plan: ServerPlan, measured: Measured,
                layout: LayoutKey) -> ServerPlan | None:
    """The plan of one layout (the re-plan's best, verify.pinned_spec) on the measured constants: what the server
    switches to under spec.server.replan auto. The constants are applied as measured, not looked up by the pinned
    plan's own key: a layout on fewer GPUs may have another link (one GPU: none), and the re-plan compared every
    layout on the same constants."""
    if measured.facts is None:
        return None
    pinned = plan_server(pinned_spec(spec, layout), measured.facts, node_driver_major=plan.cuda_driver_major,
                         calibration=measured.result.calibration(CALIBRATION))
    return pinned.model_copy(update={"measured_constants": measured.key})
