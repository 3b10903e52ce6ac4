"""The cluster's measured constants written: one key of the operator's ConfigMap (decide/constants.py builds it).

The chart grants the operator get and patch on that one ConfigMap by name, and create on ConfigMaps, in its own
namespace only (charts/tokenmill/templates/rbac.yaml)."""

from __future__ import annotations

from ..decide.constants import Measured, cluster_key, configmap, namespace_key
from ..decide.planner.verify import CONFIGMAP_NAME, constants_entry
from ..kube import Kube


def write_entry(kube: Kube, namespace: str, measured: Measured, tenant: str, cluster: bool = False) -> list[str]:
    """Set the measured key for the tenant's namespace (and for the cluster, when `cluster`: a trusted run,
    decide/constants.promotion_refusal); the other keys are left as they are. Returns the keys written."""
    entry = constants_entry(measured.result)
    keys = [namespace_key(tenant, measured.key), *([cluster_key(measured.key)] if cluster else [])]
    data = {key: entry for key in keys}
    if not kube.create_if_absent(configmap(namespace, data)):
        kube.patch("v1", "ConfigMap", CONFIGMAP_NAME, namespace, {"data": data})
    return keys
