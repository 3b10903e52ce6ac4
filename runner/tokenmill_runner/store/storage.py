"""Object storage at the edge: a local folder or an S3 prefix behind one small interface.

Keys are '/'-separated paths relative to the storage root. Every `put` is atomic (a reader sees the whole object
or nothing) and durable: local files are written to a temporary name, fsynced, renamed, and their folder fsynced;
S3 objects appear whole on completion. That atomicity is what the commit protocol in `shards.py` relies on.

S3 has bad minutes (5xx, slow answers, connections reset mid-body). Every S3 call is retried with backoff and
full jitter for as long as `StorageRetry.budget_s` of continuous failure allows; a body that breaks mid-read
resumes from the byte it reached (a Range GET pinned to the object's ETag) instead of starting over. Only past the
budget does an operation raise `StorageError`, naming the object and how long it failed: the run then stops and a
rerun resumes from what is committed. Answers that no retry fixes (a missing object, denied access, a missing
bucket) raise at once.
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import io
import logging
import os
import random
import re
import shutil
import stat
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cached_property, partial
from pathlib import Path
from typing import IO, Any, NoReturn, Protocol, TypeVar
from urllib.parse import quote

import numpy as np

from .credentials import ANONYMOUS_KEY, asks_anonymous, missing_keys

logger = logging.getLogger(__name__)

MULTIPART_THRESHOLD = 64 * 1024 * 1024
READ_BUFFER = 1024 * 1024
RESUME_GRANULE = 64 * 1024
TMP_MARK = ".tmp-"
COPY_CHUNK = 8 * 1024 * 1024
# Error codes that mean "no such object". A HEAD answer has no body, so botocore reports the HTTP status ("404")
# as the code; some S3-compatible stores name it.
MISSING_CODES = frozenset({"404", "NoSuchKey", "NotFound"})
# Error codes S3 and compatible stores answer when a retry later can succeed.
TRANSIENT_CODES = frozenset({"SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable", "Throttling",
                             "ThrottlingException", "RequestLimitExceeded", "OperationAborted", "503", "500"})
# botocore does not retry on its own: every S3 call goes through `S3Storage.call`, whose budget alone decides how
# long an operation keeps trying (and each retry is logged).
BOTOCORE_ATTEMPTS = 1
MAX_POOL_CONNECTIONS = 32
# A capped read up to this size is one GET read whole (a marker, a seal, a config); a larger cap (a checkpoint) reads
# through ResumableBody, which resumes a broken body from the byte it reached instead of starting over.
WHOLE_GET_BYTES = 16 * 1024 * 1024
ERROR_BODY_BYTES = 64 * 1024

T = TypeVar("T")


VERSIONED_READ_TRIES = 8

class StorageError(RuntimeError):
    """A storage operation failed; the message names the URI."""


class PreconditionFailed(StorageError):
    """A conditional write found the object not as required (S3's 412): it exists (put_new), or it changed or is
    gone (put_replacing). Nothing was written."""


class TooLarge(StorageError):
    """An object is larger than its reader allows; it was not read."""


class ChangedWhileRead(StorageError):
    """The object was replaced between the reads of one pinned read (its ETag no longer matched)."""


@dataclass(frozen=True)
class StorageRetry:
    """How long one S3 operation keeps retrying transient failures before the run stops with an error."""

    budget_s: float = 600.0
    base_delay_s: float = 0.5
    max_delay_s: float = 20.0

    def delay(self, attempt: int, rng: random.Random) -> float:
        # Full jitter: the commits and reads that failed together (a store restart) do not come back together.
        return rng.uniform(0, min(self.max_delay_s, self.base_delay_s * 2 ** (attempt - 1)))


class Storage(Protocol):
    root_uri: str

    # `budget_s` bounds this call's retries below the store's own budget (a commit marker must land, or be given
    # up, within the lease's fencing margin).
    def put(self, key: str, data: bytes, budget_s: float | None = None) -> None: ...
    # Conditional writes (the lease): create only when absent, replace only when the version is `version`; both
    # return the new version and raise PreconditionFailed when the condition does not hold.
    def put_new(self, key: str, data: bytes, budget_s: float | None = None) -> str: ...
    def put_replacing(self, key: str, data: bytes, version: str, budget_s: float | None = None) -> str: ...
    # The object and its version, None when missing; TooLarge past `limit` bytes, before reading the body.
    def get_versioned(self, key: str, limit: int) -> tuple[bytes, str] | None: ...
    def modified(self, key: str) -> datetime | None: ...  # the store's LastModified (local: mtime); None: missing
    def put_file(self, key: str, path: Path) -> None: ...  # atomic like put; the local file may be moved
    def get(self, key: str) -> bytes: ...
    # Keys under `prefix`, and only those sorting after `start_after` when given (S3's StartAfter: a reader of
    # time-named keys lists only what is new).
    def list(self, prefix: str = "", start_after: str | None = None) -> Iterator[str]: ...
    def list_sizes(self, prefix: str = "", start_after: str | None = None) -> Iterator[tuple[str, int]]: ...
    def identity(self, key: str) -> str: ...  # what changes when the object does (size, mtime or ETag)
    def folders(self, prefix: str = "") -> Iterator[str]: ...  # names of the folders right under prefix
    def delete(self, key: str) -> None: ...
    def exists(self, key: str) -> bool: ...  # False only for a missing object; raises when it cannot tell
    def open_read(self, key: str) -> IO[bytes]: ...
    # The whole object, or None when it is over `max_bytes` (refused by its size before its body where the store
    # says it, else after max_bytes + 1 bytes): the one read of a small object someone else wrote (bounded_get.py).
    def get_capped(self, key: str, max_bytes: int) -> bytes | None: ...
    def uri(self, key: str) -> str: ...


@dataclass(frozen=True)
class S3Location:
    bucket: str
    prefix: str  # "" or ends with "/"

    @classmethod
    def parse(cls, uri: str) -> S3Location:
        if not uri.startswith("s3://"):
            raise StorageError(f"{uri!r} is not an s3:// URI")
        bucket, _, prefix = uri[len("s3://"):].partition("/")
        if not bucket:
            raise StorageError(f"{uri!r} has no bucket name")
        prefix = prefix.strip("/")
        return cls(bucket, prefix + "/" if prefix else "")


def _process_umask() -> int:
    """The process's umask, read without changing it where Linux shows it (os.umask both sets and returns it, and
    another thread creating a file in between would get the wrong mode)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# The mode open() gives a new file (0666 less the umask): temporary files are created 0600, and a file renamed into
# place keeps that, so a report on a shared file system would be readable by its writer alone. Every local write
# goes through `publish_mode`, so outputs are as readable as any file this user creates (0644 under umask 022).
FILE_MODE = 0o666 & ~_process_umask()


def publish_mode(target: int | Path) -> None:
    """Give a finished temporary file (an open descriptor or a path) the mode a new file of this process has."""
    if isinstance(target, int):
        os.fchmod(target, FILE_MODE)
    else:
        os.chmod(target, FILE_MODE)


def fsync_dir(folder: Path) -> None:
    """Make a rename or a new entry in `folder` durable: without it a power loss can forget the entry."""
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs(folder: Path) -> None:
    """mkdir -p, fsyncing the parent of every folder it creates."""
    missing = []
    current = folder
    while not current.exists():
        missing.append(current)
        current = current.parent
    folder.mkdir(parents=True, exist_ok=True)
    for created in reversed(missing):
        fsync_dir(created.parent)


def write_atomic(path: Path, data: bytes) -> None:
    """Write to a temporary name in the same folder, fsync, rename over `path`, fsync the folder."""
    make_dirs(path.parent)
    fd, tmp = tempfile.mkstemp(prefix=path.name + TMP_MARK, dir=path.parent)
    try:
        publish_mode(fd)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def local_version(data: bytes) -> str:
    """A local file's version: a hash of its content (writers that need to tell equal contents apart put a nonce
    in them, as the lease does)."""
    return hashlib.sha256(data).hexdigest()[:32]


# Held by a thread of this process while it holds a folder's flock. A process stopped whole (SIGSTOP: a frozen
# node, the test-only pause fault) while a thread holds the flock would keep every other writer of the folder waiting
# until it is resumed; the pause fault takes this lock first, so it never stops the process inside such a section.
FLOCK_SECTION = threading.Lock()


class _folder_lock:
    """An exclusive flock on a folder: the local store's conditional writes compare and replace under it."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.fd = -1

    def __enter__(self) -> None:
        FLOCK_SECTION.acquire()
        try:
            self.fd = os.open(self.folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except BaseException:
            if self.fd >= 0:
                os.close(self.fd)
            FLOCK_SECTION.release()
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
        finally:
            FLOCK_SECTION.release()


def read_capped(body: IO[bytes], size: int | None, max_bytes: int) -> bytes | None:
    """`body`'s bytes, or None past `max_bytes`: refused by its known `size` before a byte is read (a sparse 8 GiB
    file, an S3 object's Content-Length), else once max_bytes + 1 bytes arrived."""
    if size is not None and size > max_bytes:
        return None
    data = body.read(max_bytes + 1)
    return None if len(data) > max_bytes else data


def packed_names(names: Iterable[str], chunk: int = 4096) -> np.ndarray:
    """Names packed into one array of fixed-width UTF-8 bytes (surrogates passed through: byte order is code point
    order, so sorting it sorts them as Python does), `chunk` at a time: ~60 bytes a name rather than a str object
    each, and never a bytes object per name for them all. Unsorted; empty: a typed empty array."""
    parts: list[np.ndarray] = []
    pending: list[bytes] = []
    for name in names:
        pending.append(name.encode("utf-8", "surrogatepass"))
        if len(pending) >= chunk:
            parts.append(np.array(pending, dtype=np.bytes_))
            pending = []
    parts.append(np.array(pending, dtype=np.bytes_))
    return np.concatenate(parts) if len(parts) > 1 else parts[0]


class LocalStorage:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).resolve()
        self.root_uri = str(self.root)

    def _path(self, key: str) -> Path:
        """The file of `key`, refused unless it lies inside the root: keys come from files someone else wrote too (a
        dataset name in run.json made `tokenmill report` write `report/../../../escape/pwned.png`), and a symlink
        inside the output may point anywhere."""
        path = self.root / key
        if key.startswith("/") or ".." in key.split("/") or not path.resolve().is_relative_to(self.root):
            raise StorageError(f"{key!r} is not a key inside {self.root_uri} (a '..' segment, an absolute path or a "
                               "symlink out of it); tokenmill never names one: the file naming it was not written by "
                               "tokenmill")
        return path

    def _open_regular(self, key: str) -> IO[bytes]:
        """The file of `key` opened for reading, refused unless it is a regular file: a FIFO never ends and a
        device (a symlink to /dev/zero) is any size."""
        try:  # O_NONBLOCK: opening a FIFO would wait for a writer (it means nothing to a regular file)
            fd = os.open(self._path(key), os.O_RDONLY | os.O_NONBLOCK)
        except FileNotFoundError:
            raise StorageError(f"{self.uri(key)} does not exist") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise StorageError(f"{self.uri(key)} is not a regular file; tokenmill writes only regular files: remove it")
        return os.fdopen(fd, "rb")

    def put(self, key: str, data: bytes, budget_s: float | None = None) -> None:
        write_atomic(self._path(key), data)

    def put_new(self, key: str, data: bytes, budget_s: float | None = None) -> str:
        """Exclusive create: the whole file is written under a temporary name and linked into place, which fails
        when the name exists (a reader never sees a partial file, and of two creators exactly one wins)."""
        path = self._path(key)
        make_dirs(path.parent)
        fd, tmp = tempfile.mkstemp(prefix=path.name + TMP_MARK, dir=path.parent)
        try:
            publish_mode(fd)
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise PreconditionFailed(f"{self.uri(key)} already exists") from None
        finally:
            Path(tmp).unlink(missing_ok=True)
        fsync_dir(path.parent)
        return local_version(data)

    def put_replacing(self, key: str, data: bytes, version: str, budget_s: float | None = None) -> str:
        """Replace the file only if its content is still `version`: the compare and the rename happen under an
        exclusive lock on the folder, which every conditional writer of this store takes."""
        path = self._path(key)
        make_dirs(path.parent)
        with _folder_lock(path.parent):
            try:
                current = path.read_bytes()
            except FileNotFoundError:
                raise PreconditionFailed(f"{self.uri(key)} is gone") from None
            if local_version(current) != version:
                raise PreconditionFailed(f"{self.uri(key)} changed")
            write_atomic(path, data)
        return local_version(data)

    def get_versioned(self, key: str, limit: int) -> tuple[bytes, str] | None:
        if not self._path(key).exists():
            return None
        try:
            with self._open_regular(key) as handle:
                size = os.fstat(handle.fileno()).st_size
                if size > limit:
                    raise TooLarge(f"{self.uri(key)} is {size} bytes, over the {limit} this reader reads")
                data = handle.read(limit + 1)
        except StorageError:
            if not self._path(key).exists():  # removed since
                return None
            raise
        if len(data) > limit:
            raise TooLarge(f"{self.uri(key)} is over the {limit} bytes this reader reads")
        return data, local_version(data)

    def modified(self, key: str) -> datetime | None:
        try:
            return datetime.fromtimestamp(self._path(key).stat().st_mtime, UTC)
        except FileNotFoundError:
            return None

    def put_file(self, key: str, path: Path) -> None:
        """Move (or, across file systems, copy) a finished local file into place, atomically."""
        target = self._path(key)
        make_dirs(target.parent)
        try:
            with open(path, "rb") as source:
                os.fsync(source.fileno())
                publish_mode(source.fileno())
            os.replace(path, target)
            fsync_dir(target.parent)
            return
        except OSError:
            pass  # another file system: copy to a temporary name beside the target, then rename
        fd, tmp = tempfile.mkstemp(prefix=target.name + TMP_MARK, dir=target.parent)
        try:
            publish_mode(fd)
            with os.fdopen(fd, "wb") as handle, open(path, "rb") as source:
                shutil.copyfileobj(source, handle, COPY_CHUNK)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        fsync_dir(target.parent)

    def get(self, key: str) -> bytes:
        with self._open_regular(key) as handle:
            return handle.read()

    def open_read(self, key: str) -> IO[bytes]:
        return self._open_regular(key)

    def get_capped(self, key: str, max_bytes: int) -> bytes | None:
        with self.open_read(key) as body:
            return read_capped(body, os.fstat(body.fileno()).st_size, max_bytes)

    def list(self, prefix: str = "", start_after: str | None = None) -> Iterator[str]:
        for key, _ in self._walk(prefix, start_after):
            yield key

    def list_sizes(self, prefix: str = "", start_after: str | None = None) -> Iterator[tuple[str, int]]:
        for key, path in self._walk(prefix, start_after):
            try:
                yield key, os.stat(path).st_size
            except FileNotFoundError:  # removed since the listing (a temporary file renamed)
                continue

    def _walk(self, prefix: str, start_after: str | None) -> Iterator[tuple[str, str]]:
        """(key, path) of every file whose key starts with `prefix` and sorts after `start_after`, in key order as S3
        lists them. Like S3's StartAfter, a listing after a horizon costs the names after it: a folder's entries
        are filtered by name before anything is sorted or stat'ed, and a subfolder wholly before the horizon is not
        entered (every key in folder `d` starts with `d/`)."""
        base = self._path(prefix)
        # A prefix that does not end a folder's name also names its siblings ("d/commits" lists "d/commits-old").
        folder = base if base.is_dir() and (prefix == "" or prefix.endswith("/")) else base.parent
        # A missing root must list nothing, not its parent folder.
        if not folder.is_dir() or not folder.is_relative_to(self.root):
            return
        relative = folder.relative_to(self.root).as_posix()
        yield from self._walk_folder(str(folder), "" if relative == "." else relative + "/", prefix, start_after)

    def _walk_folder(self, folder: str, at: str, prefix: str, start_after: str | None) -> Iterator[tuple[str, str]]:
        # The names are sorted packed (`packed_names`), not as a (key, path) per entry: a commits folder of 39,000
        # markers would hold ~13 MiB of those for the whole listing, and a reader's memory would follow the output.
        try:
            scanned = os.scandir(folder)
        except FileNotFoundError:  # removed since its parent was listed
            return

        def kept() -> Iterator[str]:
            for entry in scanned:
                key = at + entry.name
                try:
                    is_folder = entry.is_dir(follow_symlinks=False)
                except OSError:
                    continue
                if is_folder:
                    key += "/"  # its keys, all of which start so, sort together right here
                    if start_after is not None and key <= start_after and not start_after.startswith(key):
                        continue
                    if not (key.startswith(prefix) or prefix.startswith(key)):
                        continue
                elif (start_after is not None and key <= start_after) or not key.startswith(prefix):
                    continue
                elif not entry.is_file():  # a socket, a dangling link
                    continue
                yield entry.name + "/" if is_folder else entry.name

        with scanned:
            names = np.sort(packed_names(kept()))
        for packed in names:  # NUL never ends a file name: the fixed width's padding strips nothing of one
            name = bytes(packed).decode("utf-8", "surrogatepass")
            if name.endswith("/"):  # a folder (a file's name has no "/")
                yield from self._walk_folder(os.path.join(folder, name[:-1]), at + name, prefix, start_after)
            else:
                yield at + name, os.path.join(folder, name)

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def folders(self, prefix: str = "") -> Iterator[str]:
        folder = self._path(prefix)
        if folder.is_dir() and folder.is_relative_to(self.root):
            yield from sorted(entry.name for entry in os.scandir(folder) if entry.is_dir())

    def identity(self, key: str) -> str:
        try:
            stat = self._path(key).stat()
        except FileNotFoundError:
            raise StorageError(f"{self.uri(key)} does not exist") from None
        return f"size={stat.st_size} mtime_ns={stat.st_mtime_ns} inode={stat.st_ino}"

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def uri(self, key: str) -> str:
        return str(self.root / key)


class S3Storage:
    def __init__(self, uri: str, endpoint: str | None = None, region: str | None = None,
                 credentials: Mapping[str, str] | None = None, retry: StorageRetry | None = None) -> None:
        self.location = S3Location.parse(uri)
        self.root_uri = f"s3://{self.location.bucket}/{self.location.prefix}"
        self.retry = retry or StorageRetry()
        self._client = s3_client(endpoint, region, credentials)
        self._rng = random.Random()
        # The client's own signer (its credentials, their refresh, UNSIGNED) and connection pool (TLS, proxies,
        # timeouts): `get_capped` sends through them without botocore's per-call pipeline. Read here so that a
        # botocore without them fails every S3 use at once, not a read later.
        self._signer = self._client._request_signer
        self._http = self._client._endpoint.http_session

    def _key(self, key: str) -> str:
        return self.location.prefix + key

    def call(self, action: str, key: str, operation: Callable[[], T], budget_s: float | None = None) -> T:
        """Run one S3 operation, retrying transient failures for up to the retry budget (or `budget_s`, when
        smaller)."""
        started = time.monotonic()
        attempt = 0
        budget = self.retry.budget_s if budget_s is None else min(budget_s, self.retry.budget_s)
        while True:
            try:
                return operation()
            except Exception as error:  # botocore raises many unrelated types
                if not is_transient(error):
                    raise
                attempt += 1
                self._wait(action, key, error, attempt, started, budget)

    def _wait(self, action: str, key: str, error: Exception, attempt: int, started: float,
              budget_s: float | None = None) -> None:
        budget = self.retry.budget_s if budget_s is None else budget_s
        failing = time.monotonic() - started
        if failing >= budget:
            raise StorageError(
                f"cannot {action} {self.uri(key)}: still failing after {failing:.0f}s and {attempt} attempt(s) "
                f"(last: {type(error).__name__}: {error}); the store is unavailable: nothing was lost, rerun to "
                "resume from what is committed"
            ) from error
        delay = min(self.retry.delay(attempt, self._rng), budget - failing)
        logger.warning("%s %s failed (%s: %s); retry %d in %.1fs", action, self.uri(key), type(error).__name__,
                       error, attempt, delay)
        time.sleep(delay)

    def put(self, key: str, data: bytes, budget_s: float | None = None) -> None:
        try:
            self.call("write", key, lambda: self._put_once(key, data), budget_s)
        except StorageError:
            raise
        except Exception as error:
            raise StorageError(f"cannot write {self.uri(key)}: {error}") from error

    def put_new(self, key: str, data: bytes, budget_s: float | None = None) -> str:
        """PutObject with If-None-Match: *: a 412 (the object exists) raises PreconditionFailed."""
        return self._put_conditional(key, data, {"IfNoneMatch": "*"}, budget_s)

    def put_replacing(self, key: str, data: bytes, version: str, budget_s: float | None = None) -> str:
        """PutObject with If-Match: <ETag>: a 412 (another version) or a 404 (gone) raises PreconditionFailed."""
        return self._put_conditional(key, data, {"IfMatch": version}, budget_s)

    def _put_conditional(self, key: str, data: bytes, condition: dict[str, str], budget_s: float | None) -> str:
        attempts = 0

        def once() -> dict[str, Any]:
            nonlocal attempts
            attempts += 1
            return self._client.put_object(Bucket=self.location.bucket, Key=self._key(key), Body=data, **condition)

        try:
            return str(self.call("write", key, once, budget_s)["ETag"])
        except StorageError:
            raise
        except Exception as error:
            if _error_code(error) in ("PreconditionFailed", "ConditionalRequestConflict") or _is_missing(error):
                if attempts > 1:  # an earlier attempt may have landed and its answer been lost: is it ours?
                    current = self.get_versioned(key, len(data))
                    if current is not None and current[0] == data:
                        return current[1]
                raise PreconditionFailed(f"{self.uri(key)}: the conditional write was refused "
                                         f"({_error_code(error)})") from None
            raise StorageError(f"cannot write {self.uri(key)}: {error}") from error

    def get_versioned(self, key: str, limit: int) -> tuple[bytes, str] | None:
        # A small object others replace often (the lease, renewed by every worker of a run): one GET, whose body and
        # ETag are one version however often it is replaced (a HEAD first raced the renewals: under 24 workers its
        # version was gone by the GET eight times in a row). A resume mid-body is pinned to that ETag; a new version
        # then is read again, never reported as a failure.
        for _ in range(VERSIONED_READ_TRIES - 1):
            try:
                return self._get_versioned_once(key, limit)
            except ChangedWhileRead:
                continue
        return self._get_versioned_once(key, limit)

    def _head(self, key: str) -> dict[str, Any] | None:
        """HeadObject's answer; None for a missing object."""
        try:
            return self.call("look up", key, lambda: self._client.head_object(Bucket=self.location.bucket,
                                                                              Key=self._key(key)))
        except StorageError:
            raise
        except Exception as error:
            if _is_missing(error):
                return None
            raise StorageError(f"cannot look up {self.uri(key)}: {error}") from error

    def _get_versioned_once(self, key: str, limit: int) -> tuple[bytes, str] | None:
        try:
            response = self.get_object(key)
        except StorageError as error:
            if "does not exist" in str(error):
                return None
            raise
        size = int(response.get("ContentLength", 0))
        with io.BufferedReader(ResumableBody(self, key, response), buffer_size=READ_BUFFER) as body:
            if size > limit:  # refused from the answer's head: its body is closed unread
                raise TooLarge(f"{self.uri(key)} is {size} bytes, over the {limit} this reader reads")
            data = body.read(limit + 1)
        if len(data) > limit:
            raise TooLarge(f"{self.uri(key)} is over the {limit} bytes this reader reads")
        return data, str(response.get("ETag"))

    def modified(self, key: str) -> datetime | None:
        head = self._head(key)
        if head is None:
            return None
        modified = head.get("LastModified")
        return modified if isinstance(modified, datetime) else None

    def _put_once(self, key: str, data: bytes) -> None:
        if len(data) <= MULTIPART_THRESHOLD:
            # One request: S3 stores the object whole or not at all, so a retry after a reset is harmless.
            self._client.put_object(Bucket=self.location.bucket, Key=self._key(key), Body=data)
            return
        from boto3.s3.transfer import TransferConfig

        config = TransferConfig(multipart_threshold=MULTIPART_THRESHOLD, multipart_chunksize=MULTIPART_THRESHOLD)
        self._client.upload_fileobj(io.BytesIO(data), self.location.bucket, self._key(key), Config=config)

    def put_file(self, key: str, path: Path) -> None:
        """Upload a local file (multipart above MULTIPART_THRESHOLD); the object appears whole on completion."""
        from boto3.s3.transfer import TransferConfig

        config = TransferConfig(multipart_threshold=MULTIPART_THRESHOLD, multipart_chunksize=MULTIPART_THRESHOLD)
        try:
            self.call("write", key, lambda: self._client.upload_file(str(path), self.location.bucket, self._key(key),
                                                                     Config=config))
        except StorageError:
            raise
        except Exception as error:  # botocore raises many unrelated types
            raise StorageError(f"cannot write {self.uri(key)}: {error}") from error

    def get(self, key: str) -> bytes:
        with self.open_read(key) as body:
            return body.read()

    def open_read(self, key: str) -> IO[bytes]:
        """A buffered reader over the object that survives broken connections: it resumes where it stopped."""
        return io.BufferedReader(ResumableBody(self, key), buffer_size=READ_BUFFER)

    def get_object(self, key: str, offset: int = 0, etag: str | None = None) -> dict[str, Any]:
        """GetObject from `offset`, pinned to `etag` when given (a changed object fails instead of mixing)."""
        arguments: dict[str, Any] = {"Bucket": self.location.bucket, "Key": self._key(key)}
        if offset:
            arguments["Range"] = f"bytes={offset}-"
        if etag:
            arguments["IfMatch"] = etag
        try:
            return self.call("read", key, lambda: self._client.get_object(**arguments))
        except StorageError:
            raise
        except Exception as error:
            self._raise_read_error(key, error)

    def _raise_read_error(self, key: str, error: Exception) -> NoReturn:
        if _is_missing(error):
            raise StorageError(f"{self.uri(key)} does not exist") from None
        if _error_code(error) == "PreconditionFailed":
            raise ChangedWhileRead(f"{self.uri(key)} changed while it was being read; rerun to read it again") \
                from error
        raise StorageError(f"cannot read {self.uri(key)}: {error}") from error

    def get_capped(self, key: str, max_bytes: int) -> bytes | None:
        if max_bytes > WHOLE_GET_BYTES:
            with self.open_read(key) as body:
                return read_capped(body, body.raw.size, max_bytes)  # type: ignore[attr-defined]  # a ResumableBody
        try:
            return self.call("read", key, lambda: self._get_whole(key, max_bytes))
        except StorageError:
            raise
        except Exception as error:
            self._raise_read_error(key, error)

    @cached_property
    def _bucket_url(self) -> str:
        # The bucket's URL as the client's endpoint rules make it (region, FIPS, dual-stack, a custom endpoint):
        # building a URL costs no request.
        url = self._client.generate_presigned_url("get_object", Params={"Bucket": self.location.bucket, "Key": "k"})
        return url.split("?", 1)[0].removesuffix("/k")

    def _get_whole(self, key: str, max_bytes: int) -> bytes | None:
        """One signed GET read whole, or None past `max_bytes`. The operator's steady pass is hundreds of these (a
        marker of a few KB each): botocore's per-call pipeline (events, serialising, parsing every header, a
        timestamp through dateutil) took about 40 % of each call's CPU (hack/bench/bench_s3_reads.py), so it is
        sent here through the same signer and connection pool, and only its status, length, body and checksum read.
        Errors come back as botocore's (a ClientError with S3's code), so `call` retries and classifies them alike."""
        from botocore.awsrequest import AWSRequest
        from botocore.exceptions import IncompleteReadError

        request = AWSRequest(method="GET", url=f"{self._bucket_url}/{quote(self._key(key), safe='/~')}",
                             headers={"x-amz-checksum-mode": "ENABLED"})
        self._signer.sign("GetObject", request)
        prepared = request.prepare()
        prepared.stream_output = True  # the body is read here, capped, not by the pool
        response = self._http.send(prepared)
        raw, whole = response.raw, False
        try:
            if response.status_code >= 300:
                raise s3_error(response.status_code, raw.read(ERROR_BODY_BYTES))
            length = response.headers.get("content-length")
            size = int(length) if length is not None else None
            data = read_capped(raw, size, max_bytes)
            if data is None:
                return None
            if size is not None and len(data) != size:
                raise IncompleteReadError(actual_bytes=len(data), expected_bytes=size)
            check_checksum(response.headers, data, self.uri(key))
            whole = True
            return data
        finally:
            if whole:
                raw.release_conn()  # read to its end: the connection serves the next request
            else:
                raw.close()  # a body left unread: the connection cannot be reused

    def list(self, prefix: str = "", start_after: str | None = None) -> Iterator[str]:
        for key, _ in self.list_sizes(prefix, start_after):
            yield key

    def list_sizes(self, prefix: str = "", start_after: str | None = None) -> Iterator[tuple[str, int]]:
        arguments: dict[str, Any] = {"Bucket": self.location.bucket, "Prefix": self._key(prefix)}
        if start_after is not None:
            arguments["StartAfter"] = self._key(start_after)
        for page in self._pages(prefix, arguments):
            for item in page.get("Contents", []):
                yield item["Key"][len(self.location.prefix):], int(item.get("Size", 0))

    def _pages(self, prefix: str, arguments: dict[str, Any]) -> Iterator[dict[str, Any]]:
        # Page by page, each page retried on its own: a failure in the middle never repeats or skips keys.
        while True:
            try:
                # partial copies the arguments now: the loop sets the next page's token in them afterwards
                page = self.call("list", prefix, partial(self._client.list_objects_v2, **arguments))
            except StorageError:
                raise
            except Exception as error:
                raise StorageError(f"cannot list {self.uri(prefix)}: {error}") from error
            yield page
            if not page.get("IsTruncated"):
                return
            arguments["ContinuationToken"] = page["NextContinuationToken"]

    def delete(self, key: str) -> None:
        try:
            self.call("delete", key, lambda: self._client.delete_object(Bucket=self.location.bucket,
                                                                        Key=self._key(key)))
        except StorageError:
            raise
        except Exception as error:
            raise StorageError(f"cannot delete {self.uri(key)}: {error}") from error

    def folders(self, prefix: str = "") -> Iterator[str]:
        """The common prefixes under `prefix` (S3's Delimiter listing), without the trailing '/'."""
        arguments: dict[str, Any] = {"Bucket": self.location.bucket, "Prefix": self._key(prefix), "Delimiter": "/"}
        for page in self._pages(prefix, arguments):
            for item in page.get("CommonPrefixes", []):
                yield item["Prefix"][len(self._key(prefix)):].rstrip("/")

    def identity(self, key: str) -> str:
        """The object's ETag, size and modification time (HEAD), so a cached answer about it can be checked."""
        try:
            head = self.call("look up", key, lambda: self._client.head_object(Bucket=self.location.bucket,
                                                                              Key=self._key(key)))
        except StorageError:
            raise
        except Exception as error:  # botocore raises many unrelated types
            if _is_missing(error):
                raise StorageError(f"{self.uri(key)} does not exist") from None
            raise StorageError(f"cannot look up {self.uri(key)}: {error}") from error
        modified = head.get("LastModified")
        return (f"etag={head.get('ETag')} size={head.get('ContentLength')} "
                f"modified={modified.isoformat() if hasattr(modified, 'isoformat') else modified}")

    def exists(self, key: str) -> bool:
        """Whether the object is there. Only "not found" answers no: any other failure (an unreachable endpoint past
        the retry budget, denied access, a missing bucket) raises StorageError, so a store that cannot be read
        never looks empty."""
        try:
            self.call("look up", key, lambda: self._client.head_object(Bucket=self.location.bucket,
                                                                       Key=self._key(key)))
            return True
        except StorageError:
            raise
        except Exception as error:  # botocore raises many unrelated types
            if not _is_missing(error):
                raise StorageError(f"cannot tell whether {self.uri(key)} exists: {error}") from error
        self._check_bucket()
        return False

    def _check_bucket(self) -> None:
        # An object HEAD in a bucket that does not exist is a bare 404 as well: ask the bucket before saying no.
        try:
            self.call("look up bucket of", "", lambda: self._client.head_bucket(Bucket=self.location.bucket))
        except StorageError:
            raise
        except Exception as error:
            if _is_missing(error):
                raise StorageError(f"bucket {self.location.bucket!r} of {self.root_uri} does not exist") from error
            raise StorageError(f"cannot read bucket {self.location.bucket!r} of {self.root_uri}: {error}") from error

    def uri(self, key: str) -> str:
        return f"s3://{self.location.bucket}/{self._key(key)}"


class ResumableBody(io.RawIOBase):
    """An S3 object's body read as a stream; when the connection breaks mid-body (a reset, a truncated answer), it
    reopens the object from the byte it reached, pinned to the ETag of the first answer. Failures are retried for
    up to the storage's retry budget, counted from the last byte that arrived."""

    def __init__(self, storage: S3Storage, key: str, response: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.storage = storage
        self.key = key
        self.offset = 0
        self.resumes = 0
        response = response if response is not None else storage.get_object(key)
        self.size = int(response.get("ContentLength", 0))
        self.etag = response.get("ETag")
        self._body = response["Body"]
        self._failing_since: float | None = None
        self._attempt = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        while True:
            if self.offset >= self.size:
                return 0
            try:
                # Small reads: what arrived before a break is kept (a read that fails returns nothing).
                chunk = self._body.read(min(len(view), self.size - self.offset, RESUME_GRANULE))
            except Exception as error:  # botocore and urllib3 raise many unrelated types
                if not is_transient(error):
                    raise StorageError(f"cannot read {self.storage.uri(self.key)}: {error}") from error
                self._resume(error)
                continue
            if not chunk:  # the server closed before Content-Length bytes arrived
                self._resume(ConnectionError(f"body ended at byte {self.offset} of {self.size}"))
                continue
            view[:len(chunk)] = chunk
            self.offset += len(chunk)
            self._failing_since, self._attempt = None, 0
            return len(chunk)

    def _resume(self, error: Exception) -> None:
        if self._failing_since is None:
            self._failing_since = time.monotonic()
        self._attempt += 1
        self.storage._wait(f"read (at byte {self.offset} of {self.size})", self.key, error, self._attempt,
                           self._failing_since)
        self._close_body()
        self.resumes += 1
        response = self.storage.get_object(self.key, self.offset, self.etag)
        self._body = response["Body"]

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.offset

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        """Move to a byte of the object: the body is reopened there with a ranged GET pinned to the first answer's
        ETag (a planner's look at parts of a large source, a Parquet footer), never read through."""
        target = {io.SEEK_SET: offset, io.SEEK_CUR: self.offset + offset, io.SEEK_END: self.size + offset}[whence]
        target = max(0, target)
        if target != self.offset:
            self._close_body()
            self.offset = target
            if target < self.size:
                self._body = self.storage.get_object(self.key, target, self.etag)["Body"]
        return self.offset

    def _close_body(self) -> None:
        try:
            self._body.close()
        except Exception:  # noqa: BLE001 - a broken connection may fail to close; it is dropped either way
            pass

    def close(self) -> None:
        if not self.closed:
            self._close_body()
        super().close()


def s3_error(status: int, body: bytes) -> Exception:
    """botocore's ClientError for an S3 error answer (its XML's Code, or the status where it has no body), so that
    one classification (`is_transient`, `_is_missing`) serves both ways a GET is sent."""
    from botocore.exceptions import ClientError

    code = re.search(rb"<Code>([^<]{1,128})</Code>", body)
    message = re.search(rb"<Message>([^<]{0,512})</Message>", body)
    return ClientError({"Error": {"Code": code[1].decode(errors="replace") if code else str(status),
                                  "Message": message[1].decode(errors="replace") if message else ""},
                        "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")


CHECKSUMS: tuple[tuple[str, Callable[[bytes], bytes]], ...] = (
    ("x-amz-checksum-crc32", lambda data: zlib.crc32(data).to_bytes(4, "big")),
    ("x-amz-checksum-sha256", lambda data: hashlib.sha256(data).digest()),
    ("x-amz-checksum-sha1", lambda data: hashlib.sha1(data).digest()),  # noqa: S324 - S3's checksum, not security
)


def check_checksum(headers: Mapping[str, str], data: bytes, uri: str) -> None:
    """The object's checksum as S3 stored it (asked for with x-amz-checksum-mode), checked as botocore checks a
    GetObject's: the first one this side can compute. A multipart object's composite checksum ("...-N") is over
    its parts, not its bytes, and is not checked (neither does botocore)."""
    for header, compute in CHECKSUMS:
        expected = headers.get(header)
        if expected is None or "-" in expected:
            continue
        if base64.b64encode(compute(data)).decode() != expected:
            raise StorageError(f"{uri}: the body read does not match its {header.removeprefix('x-amz-checksum-')} "
                               f"checksum {expected}; it was corrupted on its way or in the store")
        return


def _error_code(error: BaseException) -> str | None:
    response = getattr(error, "response", None)  # botocore's ClientError carries the parsed answer
    if not isinstance(response, dict):
        return None
    code = (response.get("Error") or {}).get("Code")
    return None if code is None else str(code)


def _status(error: BaseException) -> int | None:
    response = getattr(error, "response", None)
    if not isinstance(response, dict):
        return None
    status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    return int(status) if isinstance(status, int) else None


def _is_missing(error: Exception) -> bool:
    return _error_code(error) in MISSING_CODES


class ReadCutOff(Exception):
    """An operation its caller stopped on purpose (the operator closes the connections of a read past its deadline):
    not a failure of the store, so never retried. botocore wraps it (HTTPClientError); `cut_off` finds it."""


def cut_off(error: BaseException | None) -> bool:
    """Whether `error` is, or was caused by, a ReadCutOff (through chained exceptions and botocore's wrapping)."""
    for _ in range(8):
        if error is None:
            return False
        if isinstance(error, ReadCutOff):
            return True
        wrapped = getattr(error, "kwargs", None)
        inner = wrapped.get("error") if isinstance(wrapped, dict) else None
        error = inner if isinstance(inner, BaseException) else (error.__cause__ or error.__context__)
    return False


def is_transient(error: BaseException) -> bool:
    """Whether a later attempt of the same S3 operation can succeed: connection errors, resets and timeouts,
    truncated bodies, 5xx and throttling. Not: a missing object, denied access, TLS certificate errors, an operation
    its caller cut off."""
    from botocore import exceptions as boto
    from urllib3 import exceptions as urllib3

    if cut_off(error):
        return False
    if isinstance(error, boto.SSLError | urllib3.SSLError):
        return False
    if isinstance(error, boto.HTTPClientError | boto.ConnectionError | boto.IncompleteReadError):
        return True
    if isinstance(error, urllib3.ProtocolError | urllib3.TimeoutError | urllib3.IncompleteRead):
        return True
    if isinstance(error, ConnectionError | TimeoutError):  # the builtins (resets, broken pipes)
        return True
    code, status = _error_code(error), _status(error)
    return (code is not None and code in TRANSIENT_CODES) or (status is not None and (status >= 500 or status == 429))


def s3_client(endpoint: str | None = None, region: str | None = None,
              credentials: Mapping[str, str] | None = None):  # -> botocore client
    """An S3 client. Without `credentials`, boto3's default chain (the environment, a profile, IRSA, the instance
    profile): the runner's own pod, or `tokenmill` on a workstation. With them (a tenant's Secret, read by the
    operator), only those keys, or unsigned requests when they say TOKENMILL_S3_ANONYMOUS=true: keys missing are a
    StorageError, never the chain, which in the operator is the operator's own identity."""
    import boto3
    from botocore import UNSIGNED
    from botocore.config import Config

    anonymous = asks_anonymous(os.environ if credentials is None else credentials)
    if credentials is not None and (missing := missing_keys(credentials)):
        raise StorageError(f"the S3 credentials lack {', '.join(missing)} (and do not set {ANONYMOUS_KEY}=true): "
                           "refusing to fall back to the default credential chain")
    keys = {} if anonymous or credentials is None else credentials
    # Path-style addressing works with every S3-compatible store; virtual-host style needs DNS per bucket.
    # Readers fetch markers 16 at a time (index_store.READ_THREADS) and commits run in parallel: botocore's default
    # pool of 10 connections would drop and reopen connections on every burst.
    config = Config(s3={"addressing_style": "path"}, retries={"max_attempts": BOTOCORE_ATTEMPTS, "mode": "standard"},
                    connect_timeout=10, read_timeout=60, max_pool_connections=MAX_POOL_CONNECTIONS,
                    # UNSIGNED also keeps botocore from resolving any credentials (botocore session.create_client)
                    **({"signature_version": UNSIGNED} if anonymous else {}))
    return boto3.client(
        "s3",
        endpoint_url=endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"),
        region_name=region or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1",
        config=config,
        aws_access_key_id=keys.get("AWS_ACCESS_KEY_ID"),
        aws_secret_access_key=keys.get("AWS_SECRET_ACCESS_KEY"),
        aws_session_token=keys.get("AWS_SESSION_TOKEN") or None,
    )


def open_storage(uri: str, endpoint: str | None = None, region: str | None = None,
                 credentials: Mapping[str, str] | None = None, retry: StorageRetry | None = None) -> Storage:
    if uri.startswith("s3://"):
        return S3Storage(uri, endpoint, region, credentials, retry or retry_from_env())
    if uri.startswith("file://"):
        uri = uri[len("file://"):]
    return LocalStorage(uri)


STORAGE_RETRY_ENV = "TOKENMILL_STORAGE_RETRY_SECONDS"


def retry_from_env() -> StorageRetry:
    """The retry budget, from $TOKENMILL_STORAGE_RETRY_SECONDS when set (tests shorten it; default 600 s)."""
    value = os.environ.get(STORAGE_RETRY_ENV)
    if not value:
        return StorageRetry()
    try:
        budget = float(value)
    except ValueError:
        raise StorageError(f"{STORAGE_RETRY_ENV}={value!r} is not a number of seconds") from None
    return StorageRetry(budget_s=budget)


def split_uri(uri: str) -> tuple[str, str]:
    """Split a file URI into (parent URI, name) so a single object can be read through `open_storage`."""
    stripped = uri.rstrip("/")
    parent, _, name = stripped.rpartition("/")
    return parent or ".", name
