"""kopf wiring: which events run a reconcile pass, and how its result becomes status and Events."""

from __future__ import annotations

import logging
import os
from typing import Any

import kopf
from pydantic import ValidationError

from tokenmill_runner.spec import DatasetGenerationSpec

from . import metrics
from .crd import GROUP, PLURAL, VERSION
from .kube import default_kube
from .reconcile import Context, MarkerCache, OperatorSettings, reconcile
from .status import DatasetGenerationStatus

logger = logging.getLogger(__name__)

RESYNC_SECONDS = float(os.environ.get("TOKENMILL_RESYNC_SECONDS", "15"))
SETTINGS = OperatorSettings()
CACHES: dict[str, MarkerCache] = {}


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.persistence.finalizer = "tokenmill.io/operator"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="tokenmill.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="tokenmill.io")
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 60
    default_kube()
    metrics.serve(int(os.environ.get("TOKENMILL_METRICS_PORT", "8081")))


def _previous(status: dict[str, Any]) -> DatasetGenerationStatus:
    try:
        return DatasetGenerationStatus.model_validate(status or {})
    except ValidationError:
        logger.warning("status does not match this operator's schema; starting from an empty one")
        return DatasetGenerationStatus()


def _run(body: kopf.Body, patch: kopf.Patch, uid: str) -> None:
    meta, status = body["metadata"], dict(body.get("status") or {})
    try:
        spec = DatasetGenerationSpec.model_validate(dict(body["spec"]))
    except ValidationError as error:
        message = "; ".join(f"spec.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
        patch.status["phase"] = "Failed"
        patch.status["message"] = message
        raise kopf.PermanentError(message) from None
    context = Context(body=dict(body), name=meta["name"], namespace=meta["namespace"],
                      generation=meta.get("generation", 0), spec=spec, previous=_previous(status))
    try:
        decision = reconcile(default_kube(), context, CACHES.setdefault(uid, MarkerCache()), SETTINGS)
    except Exception:
        metrics.RECONCILE_ERRORS.inc()
        raise
    metrics.publish(context.name, context.namespace, decision.status, spec.validation.model_dump(), spec.model.path)
    for event in decision.events:
        kopf.event(body, type=event.type, reason=event.reason, message=event.message)
    new_status = decision.status.model_dump(mode="json", by_alias=True, exclude_none=True)
    if new_status != status:
        patch.status.update(new_status)


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
def on_change(body: kopf.Body, patch: kopf.Patch, uid: str, **_: Any) -> None:
    _run(body, patch, uid)


@kopf.timer(GROUP, VERSION, PLURAL, interval=RESYNC_SECONDS, initial_delay=RESYNC_SECONDS)
def on_timer(body: kopf.Body, patch: kopf.Patch, uid: str, **_: Any) -> None:
    if (body.get("status") or {}).get("phase") in ("Succeeded", "Failed") and not body["spec"].get("suspend"):
        return  # terminal: nothing left to watch
    _run(body, patch, uid)


@kopf.on.delete(GROUP, VERSION, PLURAL, optional=True)
def on_delete(uid: str, name: str, namespace: str, **_: Any) -> None:
    # Children go with their owner (garbage collection); the data in storage is kept on purpose.
    CACHES.pop(uid, None)
    metrics.forget(name, namespace)
