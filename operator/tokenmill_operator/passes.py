"""One reconcile pass at a time per resource, run in worker threads; kopf's handlers only ask for one.

kopf runs one handler at a time per resource, deletion included, and waits for a timer that is still busy before it
lets a resource go (kopf 1.45.2 `_core/engines/daemons.py:stop_daemons`, 228-285: a timer that has not exited is
polled again only after `settings.background.cancellation_polling`, 60 s by default, `_cogs/configs/
configuration.py:613`). A pass can take long: thousands of markers to read after a restart, a slow S3, the report
to write. Run inside a handler, it held the finalizer, the StatefulSet (the GPUs) and the Job for about a minute
after `kubectl delete`. Here a handler returns at once; passes run in threads, never two for one resource at once
(requests that arrive meanwhile are folded into one more pass), and a deleted resource's pass stops at its next
step (`stopped()`).

The threads serve every tenant. A pass whose tenant's store or pods answer slowly holds its thread until its
deadline (observe/deadline.py), so threads are handed out fairly (`FairSlots`): round-robin across namespaces, and
never more than `per_namespace` at once to one namespace, so a slow or hostile tenant delays only its own passes
(security-f9665d2.md B3: four resources whose endpoint trickled held all four threads, and no other tenant's pass ran
for minutes).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

logger = logging.getLogger(__name__)

Key = tuple[str, str, str]  # namespace, name, uid
Stopped = Callable[[], bool]


WORKERS = 8
PER_NAMESPACE = 2


class FairSlots:
    """`workers` slots, given out round-robin across the namespaces that wait, at most `per_namespace` at once to
    one namespace (fewer than all of them, so one namespace never holds every slot)."""

    def __init__(self, workers: int = WORKERS, per_namespace: int = PER_NAMESPACE) -> None:
        self.workers = max(1, workers)
        self.per_namespace = max(1, min(per_namespace, self.workers - 1 or 1))
        self._free = self.workers
        self._running: Counter[str] = Counter()
        self._waiting: dict[str, deque[asyncio.Future[None]]] = {}  # in turn order: the next namespace first

    def running(self, namespace: str) -> int:
        return self._running[namespace]

    async def acquire(self, namespace: str) -> None:
        if self._free > 0 and self._running[namespace] < self.per_namespace and namespace not in self._waiting:
            self._take(namespace)
            return
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(namespace, deque()).append(granted)
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():  # granted as it was cancelled: hand it on
                self.release(namespace)
            else:
                queue = self._waiting.get(namespace)
                if queue is not None and granted in queue:
                    queue.remove(granted)
                    if not queue:
                        del self._waiting[namespace]
            raise

    def release(self, namespace: str) -> None:
        self._running[namespace] -= 1
        if self._running[namespace] <= 0:
            del self._running[namespace]
        self._free += 1
        self._dispatch()

    def _take(self, namespace: str) -> None:
        self._running[namespace] += 1
        self._free -= 1

    def _dispatch(self) -> None:
        while self._free > 0:
            namespace = next((ns for ns in self._waiting if self._running[ns] < self.per_namespace), None)
            if namespace is None:
                return
            queue = self._waiting.pop(namespace)
            granted = queue.popleft()
            if queue:
                self._waiting[namespace] = queue  # to the back of the turn order
            if granted.cancelled():
                continue
            self._take(namespace)
            granted.set_result(None)


class PassScheduler:
    def __init__(self, run: Callable[[Key, Stopped], Any], done: Callable[[Key, Any], None],
                 max_workers: int = WORKERS, per_namespace: int = PER_NAMESPACE) -> None:
        self._run, self._done = run, done
        self._slots = FairSlots(max_workers, per_namespace)
        self._executor = ThreadPoolExecutor(max_workers=self._slots.workers, thread_name_prefix="reconcile")
        self._running: dict[Key, asyncio.Task[None]] = {}
        self._again: set[Key] = set()
        self._deleted: set[str] = set()
        self._closed = False

    def request(self, key: Key) -> asyncio.Task[None] | None:
        """Ask for a pass; returns the task that will run it (None for a resource being deleted, or once the operator
        is stopping)."""
        if self._closed or key[2] in self._deleted:
            return None
        task = self._running.get(key)
        if task is not None:
            self._again.add(key)
            return task
        task = asyncio.get_running_loop().create_task(self._drive(key), name=f"reconcile {key[0]}/{key[1]}")
        self._running[key] = task
        return task

    def forget(self, uid: str) -> None:
        """The resource is being deleted: a running pass stops before its next change. (A pass asked for later
        reads the resource afresh, sees it deleted and does nothing.)"""
        if any(key[2] == uid for key in self._running):
            self._deleted.add(uid)

    def stopped(self, uid: str) -> Stopped:
        return lambda: uid in self._deleted

    async def _drive(self, key: Key) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                self._again.discard(key)
                context = contextvars.copy_context()
                await self._slots.acquire(key[0])
                try:
                    result = await loop.run_in_executor(self._executor, context.run, self._run, key,
                                                        self.stopped(key[2]))
                except Exception:  # `run` reports its own errors; this is the last line of defence
                    logger.exception("reconcile pass of %s/%s failed", key[0], key[1])
                else:
                    self._done(key, result)
                finally:
                    self._slots.release(key[0])
                if key not in self._again or key[2] in self._deleted:
                    return
        finally:
            self._running.pop(key, None)
            self._again.discard(key)
            self._deleted.discard(key[2])

    async def idle(self) -> None:
        """Wait until no pass is running (tests)."""
        while self._running:
            await asyncio.gather(*self._running.values(), return_exceptions=True)

    def shutdown(self) -> None:
        """The operator is stopping: no pass starts again, and the tasks waiting on running ones end now (kopf would
        give them 5 s; the passes' threads are left to the process's exit, main.py)."""
        self._closed = True
        self._deleted.update(key[2] for key in self._running)
        self._executor.shutdown(wait=False, cancel_futures=True)
        for task in self._running.values():
            task.cancel()
