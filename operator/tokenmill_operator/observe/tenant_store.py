"""A tenant's store as the operator reaches it: every call under a read deadline (`deadline.py`: its connections
closed when the time is up), inside the pass's deadline, and every byte read counted against the pass's budget.

The endpoint is the tenant's (spec.output.endpoint): it may answer a byte every few seconds, or hold a listing
open, and the operator's threads serve every tenant (security-f9665d2.md B3). What the runner's readers do with the
bytes (caps per object, counts checked before anything is sized) is theirs; this bounds what a read may cost in
time, and what one pass may read in all.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import IO, Any, TypeVar

from tokenmill_runner.store.storage import Storage, StorageError

from . import deadline
from .deadline import DeadlineExceeded, Scope

T = TypeVar("T")

# One call to the store: a marker of 16 MiB at 1 MB/s, a page of a listing, a checkpoint of 64 MiB on a fast link.
READ_SECONDS = 30.0
# What one listed key costs against the pass's budget: its name and size, held while the listing is read.
LISTED_KEY_BYTES = 256


class ReadRefused(StorageError):
    """A read stopped by its deadline or the pass's budget: the pass reports it (ObservationFailed) and the next one
    tries again, from where the index got to."""


class TenantStorage:
    """`inner` (a Storage) with every call bounded; the pass is the one current when it was opened."""

    def __init__(self, inner: Storage, read_seconds: float = READ_SECONDS, pass_: Scope | None = None) -> None:
        self.inner = inner
        self.root_uri = inner.root_uri
        self.read_seconds = read_seconds
        self.pass_ = pass_ if pass_ is not None else deadline.current_pass()

    def _call(self, verb: str, key: str, operation: Callable[[], T]) -> T:
        try:
            with deadline.deadline(self.read_seconds, f"{verb} {self.inner.uri(key)}", self.pass_):
                return operation()
        except DeadlineExceeded as error:
            raise ReadRefused(str(error)) from error

    def _spend(self, count: int, key: str) -> None:
        if self.pass_ is None:
            return
        try:
            self.pass_.spend(count)
        except DeadlineExceeded as error:
            raise ReadRefused(f"{error} (at {self.inner.uri(key)})") from error

    # -- reads
    def get(self, key: str) -> bytes:
        data = self._call("read", key, lambda: self.inner.get(key))
        self._spend(len(data), key)
        return data

    def get_versioned(self, key: str, limit: int) -> tuple[bytes, str] | None:
        found = self._call("read", key, lambda: self.inner.get_versioned(key, limit))
        if found is not None:
            self._spend(len(found[0]), key)
        return found

    def get_capped(self, key: str, max_bytes: int) -> bytes | None:
        data = self._call("read", key, lambda: self.inner.get_capped(key, max_bytes))
        if data is not None:
            self._spend(len(data), key)
        return data

    def open_read(self, key: str) -> IO[bytes]:
        read = deadline.Read(self.read_seconds, f"read {self.inner.uri(key)}", self.pass_)
        try:
            with read.current():
                body = self.inner.open_read(key)
        except DeadlineExceeded as error:
            read.close()
            raise ReadRefused(str(error)) from error
        except BaseException:
            read.close()
            raise
        return _Body(body, read, self, key)  # type: ignore[return-value]  # an IO[bytes] by what it delegates

    def exists(self, key: str) -> bool:
        return self._call("look up", key, lambda: self.inner.exists(key))

    def modified(self, key: str) -> datetime | None:
        return self._call("look up", key, lambda: self.inner.modified(key))

    def identity(self, key: str) -> str:
        return self._call("look up", key, lambda: self.inner.identity(key))

    def list(self, prefix: str = "", start_after: str | None = None) -> Iterator[str]:
        return self._iterate(prefix, lambda: self.inner.list(prefix, start_after))

    def list_sizes(self, prefix: str = "", start_after: str | None = None) -> Iterator[tuple[str, int]]:
        return self._iterate(prefix, lambda: self.inner.list_sizes(prefix, start_after))

    def folders(self, prefix: str = "") -> Iterator[str]:
        return self._iterate(prefix, lambda: self.inner.folders(prefix))

    def _iterate(self, prefix: str, make: Callable[[], Iterator[T]]) -> Iterator[T]:
        """The listing, each step (a page fetched when one runs out) under its own read deadline, each key counted."""
        found: Iterator[T] | None = None
        while True:
            def step() -> tuple[bool, T | None]:
                nonlocal found
                if found is None:
                    found = make()
                try:
                    return True, next(found)
                except StopIteration:
                    return False, None
            more, item = self._call("list", prefix, step)
            if not more:
                return
            self._spend(LISTED_KEY_BYTES, prefix)
            yield item  # type: ignore[misc]  # an item of the listing whenever `more`

    # -- writes (checkpoints, the report): the same endpoint, the same deadline
    def put(self, key: str, data: bytes, budget_s: float | None = None) -> None:
        self._call("write", key, lambda: self.inner.put(key, data, budget_s))

    def put_new(self, key: str, data: bytes, budget_s: float | None = None) -> str:
        return self._call("write", key, lambda: self.inner.put_new(key, data, budget_s))

    def put_replacing(self, key: str, data: bytes, version: str, budget_s: float | None = None) -> str:
        return self._call("write", key, lambda: self.inner.put_replacing(key, data, version, budget_s))

    def put_file(self, key: str, path: Path) -> None:
        self._call("write", key, lambda: self.inner.put_file(key, path))

    def delete(self, key: str) -> None:
        self._call("delete", key, lambda: self.inner.delete(key))

    def uri(self, key: str) -> str:
        return self.inner.uri(key)

    def __getattr__(self, name: str) -> Any:  # what a particular store offers beyond the protocol
        return getattr(self.inner, name)


class _Body:
    """An object's body read under the deadline of the call that opened it; its bytes counted against the pass."""

    def __init__(self, body: IO[bytes], read: deadline.Read, store: TenantStorage, key: str) -> None:
        self._body, self._read, self._store, self._key = body, read, store, key

    def read(self, size: int = -1) -> bytes:
        try:
            with self._read.current():
                data = self._body.read(size)
        except DeadlineExceeded as error:
            raise ReadRefused(str(error)) from error
        self._store._spend(len(data), self._key)
        return data

    def readinto(self, buffer: Any) -> int:
        try:
            with self._read.current():
                count = self._body.readinto(buffer)  # type: ignore[attr-defined]
        except DeadlineExceeded as error:
            raise ReadRefused(str(error)) from error
        self._store._spend(count or 0, self._key)
        return int(count or 0)

    def close(self) -> None:
        try:
            self._body.close()
        finally:
            self._read.close()

    def __enter__(self) -> _Body:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.close()

    def __getattr__(self, name: str) -> Any:  # raw (its size), fileno, seekable, ...
        return getattr(self._body, name)
