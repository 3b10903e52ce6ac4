"""The cluster's measured step constants, as plans use them: a refit (facts/refit.py) kept under its key
(planner/verify.py), the plan made again from it, and the ConfigMap that keeps the entries (read in
observe/constants.py, written in act/constants.py)."""

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
from .planner.verify import CONFIGMAP_NAME, LayoutKey, pinned_spec, plan_constants_key

# The operator's own namespace (the chart sets it from the pod's): where the ConfigMap is kept; unset, nothing is
# read or written and plans use the published fit.
NAMESPACE_ENV = "TOKENMILL_OPERATOR_NAMESPACE"

# The cluster's measured constants by their key (verify.constants_key), or None where there are none.
Constants = Callable[[str], Refit | None]


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
