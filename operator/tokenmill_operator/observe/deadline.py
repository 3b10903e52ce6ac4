"""Wall-clock deadlines on the operator's reads, enforced by closing the connection.

A per-recv timeout does not bound a read: an S3 endpoint or a /metrics server a tenant controls can answer one byte
every few seconds for months (security-f9665d2.md B3: four such resources held every reconcile thread). Here a read
runs inside a `deadline` scope; every socket connected while a scope is current (in its thread, or in a thread that
`carry` handed the scope to) is registered with it and with every scope around it, and when a scope's time is up a
watchdog thread shuts those sockets down. A read blocked in recv returns at once, whatever library holds the socket
(botocore's urllib3, http.client), and a connection opened after the deadline is refused before it is made.

Sockets are seen through Python's audit hooks (PEP 578): `socket.connect` for a new connection and `http.client.send`
for each request, also on a connection kept alive from an earlier read (botocore's urllib3 and http.client both send
through http.client): the one place every library's connection passes, without patching any of them. The hook is process-wide and permanent, so it does nothing unless a scope is
current. A socket is remembered by its file descriptor and inode (TLS wraps the socket object by detaching its
descriptor), and shut down only while that descriptor still names the same socket.
"""

from __future__ import annotations

import contextvars
import heapq
import itertools
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from tokenmill_runner.store.storage import ReadCutOff

logger = logging.getLogger(__name__)

T = TypeVar("T")


class DeadlineExceeded(ReadCutOff):
    """A read ran past its scope's deadline (or its pass's budget): its connections were closed. Not an OSError, and
    a ReadCutOff: neither a library nor the store's retry loop tries it again."""


class Scope:
    """One deadline: what it bounds, when it ends, the sockets opened under it, and its byte budget (a pass's)."""

    def __init__(self, seconds: float, what: str, parent: Scope | None = None, budget_bytes: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.what, self.parent, self.budget_bytes, self.clock = what, parent, budget_bytes, clock
        self.seconds = seconds
        self.ends = clock() + seconds  # an enclosing scope's deadline, if sooner, is its own to enforce
        self.spent = 0
        self.expired = False
        self._sockets: set[tuple[int, int]] = set()
        self._lock = threading.Lock()

    def chain(self) -> Iterator[Scope]:
        scope: Scope | None = self
        while scope is not None:
            yield scope
            scope = scope.parent

    def refusal(self) -> str | None:
        """Why nothing more may be read under this scope (its own deadline or budget, or an enclosing one's)."""
        for scope in self.chain():
            if scope.expired or scope.clock() >= scope.ends:
                return f"{scope.what}: past its deadline of {scope.seconds:g}s; its connections were closed"
            if scope.budget_bytes is not None and scope.spent > scope.budget_bytes:
                return f"{scope.what}: read {scope.spent} bytes, over its budget of {scope.budget_bytes}"
        return None

    def check(self) -> None:
        if (why := self.refusal()) is not None:
            raise DeadlineExceeded(why)

    def spend(self, count: int) -> None:
        """Count `count` bytes read against every budget around this scope; DeadlineExceeded once one is spent."""
        for scope in self.chain():
            if scope.budget_bytes is not None:
                with scope._lock:
                    scope.spent += count
        self.check()

    def register(self, sock: socket.socket) -> None:
        self.check()  # past the deadline: no new connection
        try:
            fd = sock.fileno()
            entry = (fd, os.fstat(fd).st_ino)
        except OSError:
            return
        for scope in self.chain():
            with scope._lock:
                scope._sockets.add(entry)

    def expire(self) -> None:
        """Shut down every socket opened under this scope (a blocked recv returns at once)."""
        with self._lock:
            self.expired = True
            sockets, self._sockets = self._sockets, set()
        for fd, inode in sockets:
            _shutdown(fd, inode)


def _shutdown(fd: int, inode: int) -> None:
    try:
        duplicate = os.dup(fd)
    except OSError:
        return  # closed since: nothing to do
    try:
        if os.fstat(duplicate).st_ino != inode:  # the number was reused by another file
            return
        sock = socket.socket(fileno=duplicate)
        duplicate = -1  # the socket object owns it now
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            sock.close()
    finally:
        if duplicate >= 0:
            os.close(duplicate)


class _Watchdog:
    """One daemon thread that expires scopes at their deadlines."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Scope]] = []
        self._live: set[int] = set()
        self._order = itertools.count()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None

    def watch(self, scope: Scope) -> int:
        with self._wake:
            ticket = next(self._order)
            heapq.heappush(self._heap, (scope.ends, ticket, scope))
            self._live.add(ticket)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="read-deadlines", daemon=True)
                self._thread.start()
            self._wake.notify()
        return ticket

    def forget(self, ticket: int) -> None:
        with self._wake:
            self._live.discard(ticket)

    def _run(self) -> None:
        while True:
            with self._wake:
                while self._heap and self._heap[0][1] not in self._live:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._wake.wait()
                    continue
                ends, ticket, scope = self._heap[0]
                delay = ends - scope.clock()
                if delay > 0:
                    self._wake.wait(delay)
                    continue
                heapq.heappop(self._heap)
                self._live.discard(ticket)
            logger.warning("%s: deadline reached, closing its connections", scope.what)
            scope.expire()


_WATCHDOG = _Watchdog()
# The read in progress (the audit hook registers sockets with it) and the pass it belongs to (the parent of every
# read scope opened in it). Kept apart: the pass's own calls to the API server (a trusted, shared connection pool)
# run under no read scope, so the pass's deadline never closes them.
_CURRENT: contextvars.ContextVar[Scope | None] = contextvars.ContextVar("tokenmill_read_scope", default=None)
_PASS: contextvars.ContextVar[Scope | None] = contextvars.ContextVar("tokenmill_pass_scope", default=None)
_installed = False
_install_lock = threading.Lock()


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event == "socket.connect":  # a new connection: refused past the deadline, else registered
        scope = _CURRENT.get()
        if scope is not None:
            scope.register(args[0])
    elif event == "http.client.send":  # a request on a kept-alive connection: registered with this read's scope
        scope = _CURRENT.get()
        if scope is not None and (sock := getattr(args[0], "sock", None)) is not None:
            scope.register(sock)


def install() -> None:
    """Add the audit hook (once per process; it cannot be removed, and does nothing outside a scope)."""
    global _installed
    with _install_lock:
        if not _installed:
            sys.addaudithook(_audit)
            _installed = True


def current_pass() -> Scope | None:
    return _PASS.get()


def _open(seconds: float, what: str, parent: Scope | None, budget_bytes: int | None = None) -> tuple[Scope, int]:
    install()
    scope = Scope(seconds, what, parent, budget_bytes)
    scope.check()
    return scope, _WATCHDOG.watch(scope)


@contextmanager
def pass_scope(seconds: float, what: str, budget_bytes: int | None = None) -> Iterator[Scope]:
    """One reconcile pass: every read opened in it (`deadline`) ends by the pass's deadline, and their bytes count
    against its budget. The pass's own code runs under no read scope."""
    scope, ticket = _open(seconds, what, None, budget_bytes)
    token = _PASS.set(scope)
    try:
        yield scope
    finally:
        _PASS.reset(token)
        _WATCHDOG.forget(ticket)


class Read:
    """One read's scope, watched until `close` (a stream stays under the deadline of the call that opened it)."""

    def __init__(self, seconds: float, what: str, parent: Scope | None) -> None:
        self.scope, self._ticket = _open(seconds, what, parent)

    @contextmanager
    def current(self) -> Iterator[Scope]:
        """Make the scope current: sockets connected or sent on are registered; an error raised once it expired is
        reported as the deadline it was (the library's own error for a closed connection says nothing of why)."""
        token = _CURRENT.set(self.scope)
        try:
            yield self.scope
        except DeadlineExceeded:
            raise
        except Exception as error:
            if (why := self.scope.refusal()) is not None:
                raise DeadlineExceeded(why) from error
            raise
        finally:
            _CURRENT.reset(token)

    def close(self) -> None:
        _WATCHDOG.forget(self._ticket)


@contextmanager
def deadline(seconds: float, what: str, parent: Scope | None = None) -> Iterator[Scope]:
    """Run one read under a deadline of `seconds`, never later than `parent` (the current pass unless given)."""
    read = Read(seconds, what, parent if parent is not None else _PASS.get())
    try:
        with read.current() as scope:
            yield scope
    finally:
        read.close()


def carry(function: Callable[..., T]) -> Callable[..., T]:
    """`function` to be run in another thread (a pool's) within the caller's pass and read: sockets it opens are
    registered with the caller's deadlines."""
    read, pass_ = _CURRENT.get(), _PASS.get()

    def run(*args: Any, **kwargs: Any) -> T:
        tokens = _CURRENT.set(read), _PASS.set(pass_)
        try:
            return function(*args, **kwargs)
        finally:
            _PASS.reset(tokens[1])
            _CURRENT.reset(tokens[0])

    return run
