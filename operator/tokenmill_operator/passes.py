"""One reconcile pass at a time per resource, run in worker threads; kopf's handlers only ask for one.

kopf runs one handler at a time per resource, deletion included, and waits for a timer that is still busy before it
lets a resource go (kopf 1.45.2 `_core/engines/daemons.py:stop_daemons`, 228-285: a timer that has not exited is
polled again only after `settings.background.cancellation_polling`, 60 s by default, `_cogs/configs/
configuration.py:613`). A pass can take long: thousands of markers to read after a restart, a slow S3, the report
to write. Run inside a handler, it held the finalizer, the StatefulSet (the GPUs) and the Job for about a minute
after `kubectl delete`. Here a handler returns at once; passes run in threads, never two for one resource at once
(requests that arrive meanwhile are folded into one more pass), and a deleted resource's pass stops at its next
step (`stopped()`).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

logger = logging.getLogger(__name__)

Key = tuple[str, str, str]  # namespace, name, uid
Stopped = Callable[[], bool]


class PassScheduler:
    def __init__(self, run: Callable[[Key, Stopped], Any], done: Callable[[Key, Any], None],
                 max_workers: int = 4) -> None:
        self._run, self._done = run, done
        self._executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="reconcile")
        self._running: dict[Key, asyncio.Task[None]] = {}
        self._again: set[Key] = set()
        self._deleted: set[str] = set()

    def request(self, key: Key) -> asyncio.Task[None] | None:
        """Ask for a pass; returns the task that will run it (None for a resource being deleted)."""
        if key[2] in self._deleted:
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
                try:
                    result = await loop.run_in_executor(self._executor, context.run, self._run, key,
                                                        self.stopped(key[2]))
                except Exception:  # `run` reports its own errors; this is the last line of defence
                    logger.exception("reconcile pass of %s/%s failed", key[0], key[1])
                else:
                    self._done(key, result)
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
        self._deleted.update(key[2] for key in self._running)
        self._executor.shutdown(wait=False, cancel_futures=True)
