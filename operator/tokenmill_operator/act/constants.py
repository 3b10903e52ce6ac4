"""The cluster's measured constants written: one key of the operator's ConfigMap (decide/constants.py builds it).

The chart grants the operator get and patch on that one ConfigMap by name, and create on ConfigMaps, in its own
namespace only (charts/tokenmill/templates/rbac.yaml)."""

from __future__ import annotations

from ..decide.constants import Measured, configmap
from ..decide.planner.verify import CONFIGMAP_NAME, constants_entry
from ..kube import Kube


def write_entry(kube: Kube, namespace: str, measured: Measured) -> None:
    """Set the measured key; the other keys (other hardware, other models) are left as they are."""
    entry = constants_entry(measured.result)
    if not kube.create_if_absent(configmap(namespace, {measured.key: entry})):
        kube.patch("v1", "ConfigMap", CONFIGMAP_NAME, namespace, {"data": {measured.key: entry}})
