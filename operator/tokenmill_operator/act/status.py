"""The pass's status written: a JSON merge patch of the status subresource against what the pass read (only what
changed is sent; the operator never writes spec)."""

from __future__ import annotations

from typing import Any

from tokenmill_runner.spec.resource import API_VERSION, KIND

from ..decide.status import DatasetGenerationStatus, merge_patch
from ..kube import Kube


def write_status(kube: Kube, body: dict[str, Any], status: DatasetGenerationStatus) -> None:
    new = status.model_dump(mode="json", by_alias=True, exclude_none=True)
    patch = merge_patch(dict(body.get("status") or {}), new)
    if patch:
        meta = body["metadata"]
        kube.patch_status(API_VERSION, KIND, meta["name"], meta["namespace"], patch)
