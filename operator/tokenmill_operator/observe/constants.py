"""The cluster's measured step constants read: the ConfigMap the operator keeps in its own namespace
(planner/verify.py CONFIGMAP_NAME; one key per GPU product, interconnect, SGLang release and model architecture), and a
run's verification window refitted against the model's files read again, so later plans on that cluster start from
measurements. The refit arithmetic is facts/refit.py and verify.py (pure); the entry is written by act/constants.py.

Without TOKENMILL_OPERATOR_NAMESPACE (the chart sets it from the pod's namespace) nothing is read or written: plans
use the published fit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from kubernetes.client.exceptions import ApiException

from tokenmill_runner.facts.refit import StepSample, refit
from tokenmill_runner.facts.throughput import CALIBRATION
from tokenmill_runner.spec.resource import DatasetGenerationSpec
from tokenmill_runner.store.storage import StorageRetry

from ..decide.constants import Measured
from ..decide.planner import ModelFacts, ServerPlan, plan_step_model
from ..decide.planner.verify import (
    CONFIGMAP_NAME,
    combined,
    pinned_spec,
    plan_constants_key,
    read_constants,
    running_layout,
)
from ..kube import Kube, KubeUnavailable
from .model_files import read_model_facts

logger = logging.getLogger(__name__)


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
