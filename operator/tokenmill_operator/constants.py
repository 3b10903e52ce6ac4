"""The cluster's measured step constants: refitted from a run's verification window and kept in one ConfigMap the
operator owns in its own namespace (planner/verify.py CONFIGMAP_NAME; one key per GPU product, interconnect, SGLang
release and model architecture), so later plans on that cluster start from measurements. The edge: the refit
arithmetic is facts/refit.py and verify.py (pure), this module reads and writes the ConfigMap and the model files.

The chart grants the operator get and patch on that one ConfigMap by name, and create on ConfigMaps, in its own
namespace only (charts/tokenmill/templates/rbac.yaml). Without TOKENMILL_OPERATOR_NAMESPACE (the chart sets it from
the pod's namespace) nothing is read or written: plans use the published fit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kubernetes.client.exceptions import ApiException

from tokenmill_runner.facts.refit import Refit, StepSample, refit
from tokenmill_runner.facts.throughput import CALIBRATION
from tokenmill_runner.spec.resource import DatasetGenerationSpec
from tokenmill_runner.store.storage import StorageRetry

from . import names
from .kube import Kube, KubeUnavailable
from .model_files import plan_with_constants, read_model_facts
from .planner import ModelFacts, ServerPlan, plan_server, plan_step_model
from .planner.verify import (
    CONFIGMAP_NAME,
    LayoutKey,
    combined,
    constants_entry,
    pinned_spec,
    plan_constants_key,
    read_constants,
    running_layout,
)

logger = logging.getLogger(__name__)

NAMESPACE_ENV = "TOKENMILL_OPERATOR_NAMESPACE"


def read_data(kube: Kube, namespace: str | None) -> dict[str, str]:
    """The ConfigMap's entries; empty when there is none, no namespace is set, or it cannot be read."""
    if not namespace:
        return {}
    try:
        found = kube.get("v1", "ConfigMap", CONFIGMAP_NAME, namespace)
    except (KubeUnavailable, ApiException) as error:  # a trimmed Role (403), an API server away: the published fit
        logger.warning("cannot read ConfigMap %s/%s of measured constants: %s", namespace, CONFIGMAP_NAME, error)
        return {}
    return dict((found or {}).get("data") or {})


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


def write_entry(kube: Kube, namespace: str, measured: Measured) -> None:
    """Set the measured key; the other keys (other hardware, other models) are left as they are."""
    entry = constants_entry(measured.result)
    if not kube.create_if_absent(configmap(namespace, {measured.key: entry})):
        kube.patch("v1", "ConfigMap", CONFIGMAP_NAME, namespace, {"data": {measured.key: entry}})


def measure(spec: DatasetGenerationSpec, credentials: dict[str, str] | None, plan: ServerPlan,
            samples: Sequence[StepSample], stored: dict[str, str], retry: StorageRetry | None = None,
            read: Callable[..., ModelFacts] = read_model_facts) -> Measured | None:
    """Refit the plan's step model on the window's samples (the model's facts read again: `read`); None when the
    samples cannot move any constant (too few distinct batches)."""
    facts = read(spec, credentials, retry=retry, local=False)
    key = plan_constants_key(plan, facts.architecture)
    before = read_constants(stored, key) if plan.measured_constants == key else None
    base = before.calibration(CALIBRATION) if before is not None else CALIBRATION
    # The layout running is the plan's, which after a switch (replan auto, a trial) is not the spec's own choice.
    step = plan_step_model(pinned_spec(spec, running_layout(plan)), facts, plan.cuda_driver_major, base)
    if step is None:
        return None
    result = refit(step, samples)
    if not result.fitted:
        return None
    return Measured(key, combined(before, result), facts)


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
