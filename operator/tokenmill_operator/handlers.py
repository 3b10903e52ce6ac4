"""kopf wiring: which events ask for a reconcile pass, and how a pass's result becomes Events and metrics.

The handlers return at once: passes run in threads (`passes.py`), read the resource afresh and write its status
themselves, so no handler ever holds kopf's per-resource queue, and a deletion is handled within seconds.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import kopf

from . import log_safety, metrics
from .act import events
from .act.children import release
from .crd import GROUP, PLURAL, VERSION
from .kube import default_kube
from .passes import Key, PassScheduler, Stopped
from .reconcile import OperatorSettings, OutputIndex, PassCancelled, PassResult, run_pass

logger = logging.getLogger(__name__)

RESYNC_SECONDS = float(os.environ.get("TOKENMILL_RESYNC_SECONDS", "15"))
# How often kopf looks again at a timer that has not exited yet when its resource is deleted (kopf's default: 60 s,
# `_cogs/configs/configuration.py:613`; used at `_core/engines/daemons.py:244,282`). Our timer never runs a pass
# itself, so it exits at once; this bounds the wait if it ever does not.
CANCELLATION_POLLING_SECONDS = 1.0
TIMER_ID = "on_timer"  # kopf's default id for it (the function's name), kept: its logs name it
SETTINGS = OperatorSettings()
# What each resource's passes know of its output (an index per dataset, bounded by its slots; gather.py).
OUTPUTS: dict[str, OutputIndex] = {}


def _pass(key: Key, stopped: Stopped) -> PassResult | None:
    namespace, name, uid = key
    try:
        return run_pass(default_kube(), name, namespace, uid, OUTPUTS.setdefault(uid, OutputIndex()), SETTINGS,
                        stopped)
    except PassCancelled:
        logger.info("%s/%s is being deleted: the pass in progress stopped", namespace, name)
    except Exception:
        metrics.RECONCILE_ERRORS.inc()
        logger.exception("reconcile pass of %s/%s failed; the next pass retries", namespace, name)
    return None


def _done(key: Key, result: PassResult | None) -> None:
    if result is None:
        return
    namespace, name, _ = key
    if result.spec is not None:
        metrics.publish(name, namespace, result.decision.status, result.spec.validation.model_dump(),
                        result.spec.model.path)
    events.post(result.body, result.decision.events)
    if result.behind:  # the pass read as many markers as one may: the next one goes on, in its turn for a thread
        SCHEDULER.request(key)


# Reconcile threads, and how many of them one namespace's passes may hold at once (passes.FairSlots).
SCHEDULER = PassScheduler(_pass, _done, int(os.environ.get("TOKENMILL_PASS_WORKERS", "8")),
                          int(os.environ.get("TOKENMILL_PASSES_PER_NAMESPACE", "2")))


def _namespaced(namespace: str | None, name: str) -> str:
    # kopf types every handler's namespace as optional (cluster-scoped kinds); a DatasetGeneration always has one.
    if namespace is None:
        raise kopf.PermanentError(f"DatasetGeneration {name} has no namespace; the CRD is namespaced")
    return namespace


def _key(namespace: str | None, name: str, uid: str) -> Key:
    return _namespaced(namespace, name), name, uid


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    log_safety.protect()  # after kopf set its handler and level (verbose/debug: DEBUG)
    settings.persistence.finalizer = "tokenmill.io/operator"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="tokenmill.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="tokenmill.io")
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 60
    settings.background.cancellation_polling = CANCELLATION_POLLING_SECONDS
    default_kube()
    metrics.serve(int(os.environ.get("TOKENMILL_METRICS_PORT", "8081")),
                  os.environ.get("TOKENMILL_METRICS_ADDRESS", "0.0.0.0"))


@kopf.on.cleanup()
async def stop(**_: Any) -> None:
    # On the loop, not in kopf's executor (where a sync handler runs): the scheduler cancels asyncio tasks.
    SCHEDULER.shutdown()
    # kopf stops the timers before the cleanup handlers run, but an event its workers still handle after that spawns
    # the resource's timer again (kopf 1.45.2 `_core/reactor/processing.py:415-423`: a timer stopped for the exit is
    # not "forever stopped", `_core/engines/daemons.py:474`), and kopf then waits 5 s for it as a hung task
    # (`_core/reactor/running.py:413`): the exit took 5.1 s instead of 0.03 (CI, stop 48). A timer cancelled from
    # outside is forever stopped, so it is not spawned again; with the passes shut down it has nothing to ask for.
    for task in asyncio.all_tasks():
        if task.get_name() == f"runner of {TIMER_ID}":  # kopf's name for a timer's task (daemons.py:111)
            task.cancel()


# Every change that kopf counts (spec, labels, annotations other than its own `tokenmill.io/` bookkeeping, which
# also hides tokenmill.io/retry-failed: the timer picks that up within RESYNC_SECONDS).
@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
async def on_change(name: str, namespace: str | None, uid: str, **_: Any) -> None:
    SCHEDULER.request(_key(namespace, name, uid))


# Runs for every phase, Failed included: deleting the Job of a failed run (what SamplesMissing and RunnerFailed
# advise) must start it again.
@kopf.timer(GROUP, VERSION, PLURAL, id=TIMER_ID, interval=RESYNC_SECONDS, initial_delay=RESYNC_SECONDS)
async def on_timer(name: str, namespace: str | None, uid: str, **_: Any) -> None:
    SCHEDULER.request(_key(namespace, name, uid))


@kopf.on.delete(GROUP, VERSION, PLURAL, optional=True)
async def on_delete(name: str, namespace: str | None, uid: str, **_: Any) -> None:
    """Stop passes and give the GPUs back now; garbage collection would remove the children only once kopf has
    dropped the finalizer. The data in storage is kept on purpose."""
    namespace = _namespaced(namespace, name)
    SCHEDULER.forget(uid)
    OUTPUTS.pop(uid, None)
    metrics.forget(name, namespace)
    try:
        await asyncio.to_thread(release, default_kube(), name, namespace)
    except Exception:  # never hold the finalizer for this: the garbage collector removes the children anyway
        logger.exception("could not delete the children of %s/%s; the garbage collector will", namespace, name)
