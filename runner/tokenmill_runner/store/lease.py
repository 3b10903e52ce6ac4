"""The output lease at the edge: taken, renewed, proven and given up with conditional writes (rules: `lease_rules.py`).

`lease.json` at the output's root names the owner, the holder and its run tokens. A writer takes it before it
cleans leftovers or commits anything:
- no lease: create it with If-None-Match: * (of two racing writers exactly one succeeds; the other gets a 412);
- a released lease, one shared with this owner (a DatasetGeneration's workers), --take-over, a holder proven gone
  (below), or one whose version stayed unchanged while this run watched it for the stale period: replace it with
  If-Match: <the version read>; a 412 means someone else changed it first, and it is read again;
- otherwise the run is refused, naming the holder.
A run that replaces the lease of a holder that may still be alive (stale while watched, --take-over) seals that
holder's run tokens before it returns (seals.py): a marker of theirs already past its fence then counts for nobody.
It renews with If-Match: <its own last version>; a 412 means the lease is lost, at once. The store must honour
conditional PutObject (S3, MinIO and moto do): it is probed once per store with writes that must be refused, and a
store that accepts them is refused unless the user opts in (`spec.output.allowUnconditionalWrites`).

A holder proves itself alive to processes on its own machine with an flock on a file named by its random token
under the cache folder: a rerun after a kill sees the file unlocked and takes the lease at once. Host names and
pids are never trusted (another machine can have the same name).
"""

from __future__ import annotations

import fcntl
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from .faults import points as fault_points
from .lease_rules import (
    LEASE,
    MAX_LEASE_BYTES,
    CleanRule,
    Lease,
    LeaseError,
    LeaseTimes,
    LeaseWatch,
    may_commit,
    refusal,
)
from .manifest import Owner
from .seals import seal_tokens
from .storage import PreconditionFailed, Storage, StorageError, TooLarge

__all__ = ["LEASE", "Acquired", "Lease", "LeaseHeld", "LeaseKeeper", "LeaseLost", "LeaseTimes", "LeaseUnsupported",
           "acquire", "lease_times", "process_holder", "read_lease", "read_versioned"]

logger = logging.getLogger(__name__)

STALE_ENV = "TOKENMILL_LEASE_STALE_SECONDS"  # tests shorten the stale period (and every period derived from it)
PROBE = "lease.probe"
ACQUIRE_ROUNDS = 64  # a DatasetGeneration's workers start together and each replaces the shared lease once


class LeaseHeld(RuntimeError):
    """Another live owner writes this output."""


class LeaseLost(RuntimeError):
    """This run can no longer prove it holds the output's lease: it commits nothing more."""


class LeaseUnsupported(RuntimeError):
    """The store ignores conditional writes: a lease on it cannot exclude a second writer."""


def lease_times() -> LeaseTimes:
    value = os.environ.get(STALE_ENV)
    if not value:
        return LeaseTimes()
    try:
        return LeaseTimes(stale_s=float(value))
    except ValueError:
        raise StorageError(f"{STALE_ENV}={value!r} is not a number of seconds") from None


def boottime() -> float:
    """The fencing clock: monotonic, and counting a suspended machine's sleep (CLOCK_MONOTONIC stops during a
    laptop's suspend: a woken writer would think its last renewal recent)."""
    clock = getattr(time, "CLOCK_BOOTTIME", None)
    return time.clock_gettime(clock) if clock is not None else time.monotonic()


def read_versioned(storage: Storage) -> tuple[Lease | None, str] | None:
    """The lease and its version; None when there is none. A lease.json that is not a lease (not JSON, missing
    fields) comes back as (None, version): free to replace. One over MAX_LEASE_BYTES raises LeaseError unread."""
    try:
        found = storage.get_versioned(LEASE, MAX_LEASE_BYTES)
    except TooLarge as error:
        raise LeaseError(f"{error}: not a lease tokenmill wrote; delete {storage.uri(LEASE)}") from None
    if found is None:
        return None
    data, version = found
    try:
        return Lease.decode(data), version
    except LeaseError as error:
        logger.warning("%s: %s; it is replaced", storage.uri(LEASE), error)
        return None, version


def read_lease(storage: Storage) -> Lease | None:
    """The output's lease, None when there is none, it was released or is not a lease (bounded: LeaseError past
    MAX_LEASE_BYTES)."""
    found = read_versioned(storage)
    if found is None or found[0] is None or found[0].released:
        return None
    return found[0]


# -- the store's support for conditional writes -----------------------------------------------------------------
_probed: dict[str, bool] = {}
_probe_lock = threading.Lock()


def conditional_writes(storage: Storage) -> bool:
    """Whether the store refuses a conditional PutObject whose condition fails, probed once per store: a create over
    an existing object and a replace of a version that does not exist must both be refused."""
    with _probe_lock:
        if storage.root_uri in _probed:
            return _probed[storage.root_uri]
        probe = f"{PROBE}-{secrets.token_hex(8)}"  # its own: workers starting together probe side by side
        storage.put(probe, secrets.token_hex(8).encode())
        honoured = True
        for attempt in (lambda: storage.put_new(probe, b"must be refused"),
                        lambda: storage.put_replacing(probe, b"must be refused", '"0000000000"')):
            try:
                attempt()
                honoured = False
            except PreconditionFailed:
                pass
            except StorageError as error:  # e.g. 501 NotImplemented: the store does not know the header
                logger.warning("conditional write probe on %s: %s", storage.uri(probe), error)
                honoured = False
        storage.delete(probe)
        _probed[storage.root_uri] = honoured
        return honoured


class UnconditionalWrites:
    """The conditional writes done as read, compare, write, for a store that ignores the conditions (the user opted
    in): two writers that race within one read-write window can both believe they hold the lease."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage

    def put_new(self, key: str, data: bytes, budget_s: float | None = None) -> str:
        if self.storage.get_versioned(key, MAX_LEASE_BYTES) is not None:
            raise PreconditionFailed(f"{self.storage.uri(key)} already exists")
        return self._put(key, data, budget_s)

    def put_replacing(self, key: str, data: bytes, version: str, budget_s: float | None = None) -> str:
        current = self.storage.get_versioned(key, MAX_LEASE_BYTES)
        if current is None or current[1] != version:
            raise PreconditionFailed(f"{self.storage.uri(key)} changed")
        return self._put(key, data, budget_s)

    def _put(self, key: str, data: bytes, budget_s: float | None) -> str:
        self.storage.put(key, data, budget_s)
        found = self.storage.get_versioned(key, MAX_LEASE_BYTES)
        if found is None or found[0] != data:
            raise PreconditionFailed(f"{self.storage.uri(key)} was written by another writer at the same moment")
        return found[1]


def lease_writes(storage: Storage, allow_unconditional: bool) -> Storage | UnconditionalWrites:
    if conditional_writes(storage):
        return storage
    if not allow_unconditional:
        raise LeaseUnsupported(
            f"{storage.root_uri}: the store accepted a conditional write (If-None-Match / If-Match on PutObject) "
            "that must fail, so its lease cannot keep a second writer out. Use a store that honours them (AWS S3, "
            "MinIO), or set spec.output.allowUnconditionalWrites: true (or --allow-unconditional-writes) to run "
            "anyway, at the risk that two runs started at the same moment both write: samples committed twice and "
            "each deleting the other's unmarked shards")
    logger.warning("%s ignores conditional writes; running anyway (allowUnconditionalWrites): two runs started "
                   "at the same moment could both write this output", storage.root_uri)
    return UnconditionalWrites(storage)


# -- a holder's proof of life on its own machine ----------------------------------------------------------------
def _holders_folder() -> Path:
    return Path(os.environ.get("TOKENMILL_CACHE", Path.home() / ".cache" / "tokenmill")) / "lease-holders"


def process_holder() -> str:
    """This process as a holder: `host:pid:token` (the host and pid are for people; the token names its proof)."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(8)}"


def _proof_path(holder: str) -> Path | None:
    token = holder.rsplit(":", 1)[-1]
    return _holders_folder() / f"{token}.lock" if token.isalnum() and len(token) >= 16 else None


class HolderProof:
    """Held for the process's life: an flock on `<cache>/lease-holders/<token>.lock`. The file appears already
    locked (locked under a temporary name, then renamed), so an unlocked one means its process is gone."""

    def __init__(self, holder: str) -> None:
        self.path = _proof_path(holder)
        self._handle: IO[bytes] | None = None
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            handle = tmp.open("wb")
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.replace(tmp, self.path)
            self._handle = handle
        except OSError as error:  # no proof: another process of this machine then watches the lease instead
            logger.debug("no holder proof at %s: %s", self.path, error)

    def close(self) -> None:
        if self._handle is not None and self.path is not None:
            self.path.unlink(missing_ok=True)
            self._handle.close()
            self._handle = None


def holder_gone_here(holder: str) -> bool | None:
    """True: the holder was a process of this machine and is gone; False: it is alive here; None: not known here
    (another machine, or no proof)."""
    path = _proof_path(holder)
    if path is None:
        return None
    try:
        handle = path.open("rb")
    except OSError:
        return None
    with handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        except OSError:
            return None
        path.unlink(missing_ok=True)
        return True


# -- taking the lease -------------------------------------------------------------------------------------------
@dataclass
class Acquired:
    """A lease this run holds: the record and version it wrote, when (the fencing clock), and what the cleaners may
    delete."""

    lease: Lease
    version: str
    at: float
    clean: CleanRule
    writes: Any  # the storage the lease is written through (the store itself, or UnconditionalWrites)


def acquire(storage: Storage, owner: Owner, holder: str, token: str = "", take_over: bool = False,
            allow_unconditional: bool = False, times: LeaseTimes | None = None,
            clock: Callable[[], float] = boottime, sleep: Callable[[float], None] = time.sleep,
            wall: Callable[[], datetime] = lambda: datetime.now(UTC)) -> Acquired:
    """Take (or join) the lease; raises LeaseHeld naming the holder, LeaseUnsupported for a store without
    conditional writes (unless allowed)."""
    times = times or lease_times()
    writes = lease_writes(storage, allow_unconditional)
    for _ in range(ACQUIRE_ROUNDS):
        found = read_versioned(storage)
        now = wall()
        mine = Lease(owner, holder, now, now, (token,) if token else ())
        try:
            if found is None:
                version = writes.put_new(LEASE, mine.encode(times))
                return _acquired(storage, mine, version, clock(), frozenset(), times, writes)
            current, read = found
            finished: frozenset[str] = frozenset()
            wait = 0.0
            # Tokens whose holder may still be alive (or a taker that died sealing them left): sealed before this
            # run reads or commits anything, so a marker they land late counts for nobody (seals.py).
            sealing = set(current.sealing) if current is not None else set()
            if current is None or current.released:
                finished = frozenset(current.tokens) if current is not None else frozenset()
            elif current.shared_with(owner, holder):
                mine = Lease(owner, holder, current.since, now, mine.tokens)
            elif take_over:
                logger.warning("taking the output over from %s (--take-over)", current.describe())
                wait = times.take_over_wait_s
                sealing.update(current.tokens)
            elif (gone := holder_gone_here(current.holder)) is not None:
                if not gone:  # a live process of this machine holds its proof
                    raise LeaseHeld(refusal(current, owner, holder, 0.0, times=times) or "the output is held")
                logger.info("the lease's holder %s was a process of this machine and is gone: taking it",
                            current.holder)
                finished = frozenset(current.tokens)
            else:
                outcome = _watch(storage, current, read, owner, holder, times, clock, sleep)
                if outcome is None:
                    continue  # it changed into something else (released, gone): look again
                # Stale: its holder is fenced, but one paused between its last check and its marker's write may
                # still land that marker: its young files are kept (by age), not counted as finished, and its
                # token is sealed.
                sealing.update(current.tokens)
            mine = replace(mine, sealing=tuple(sorted(sealing)))
            version = writes.put_replacing(LEASE, mine.encode(times), read)
            at = clock()
            if wait:
                logger.warning("waiting %.0f s for the taken-over writer to notice and its last commits to land",
                               wait)
                sleep(wait)
            if sealing:
                seal_tokens(storage, writes, sealing, holder)
                mine = replace(mine, sealing=())  # sealed: the first renewal writes the record without them
            return _acquired(storage, mine, version, at, finished, times, writes)
        except PreconditionFailed:
            continue  # another writer changed the lease between the read and the write: read it again
    raise LeaseHeld(f"{storage.uri(LEASE)} kept changing while this run tried to take it: another writer is "
                    "taking the output at the same moment")


def _watch(storage: Storage, current: Lease, version: str, owner: Owner, holder: str, times: LeaseTimes,
           clock: Callable[[], float], sleep: Callable[[float], None]) -> bool | None:
    """Watch a lease another owner holds until it changes (its holder is alive: LeaseHeld) or stays unchanged for
    the stale period (True). None: it changed into something that may be free."""
    watch = LeaseWatch()
    watch.see(version, clock())
    logger.warning("%s is held by %s: watching it for up to %.0f s to tell whether its holder still renews it",
                   storage.uri(LEASE), current.describe(), times.stale_s)
    while True:
        found = read_versioned(storage)
        unchanged = watch.see(found[1] if found is not None else None, clock())
        if found is None or found[1] != version:
            if found is not None and found[0] is not None and not found[0].released \
                    and not found[0].shared_with(owner, holder):
                raise LeaseHeld(refusal(found[0], owner, holder, 0.0, times=times) or "the output is held")
            return None
        if refusal(current, owner, holder, unchanged, times=times) is None:
            logger.warning("%s was not renewed for %.0f s: its holder is gone; taking it", storage.uri(LEASE),
                           unchanged)
            return True
        sleep(min(times.watch_poll_s, times.stale_s - unchanged))


def _acquired(storage: Storage, lease: Lease, version: str, at: float, finished: frozenset[str],
              times: LeaseTimes, writes: Any) -> Acquired:
    try:
        store_now = storage.modified(LEASE)  # the store's clock, which the cleaners compare its objects' times to
    except StorageError as error:
        logger.warning("cannot read the time of %s (%s): only finished runs' leftovers are removed",
                       storage.uri(LEASE), error)
        store_now = None
    return Acquired(lease, version, at, CleanRule(finished, store_now, times.keep_unmarked_s), writes)


# -- holding it -------------------------------------------------------------------------------------------------
class LeaseKeeper:
    """Renews a lease from a thread while the run lasts, and fences commits: `fence()` before each marker write
    returns only while this run can prove it holds the lease; otherwise it raises LeaseLost (and `lost` is set)."""

    def __init__(self, storage: Storage, acquired: Acquired, times: LeaseTimes | None = None,
                 clock: Callable[[], float] = boottime, every_s: float | None = None) -> None:
        self.storage, self.acquired = storage, acquired
        self.lease, self.version = acquired.lease, acquired.version
        self.times = times or lease_times()
        self.every_s = self.times.renew_every_s if every_s is None else every_s
        self.clock = clock
        self.lost = threading.Event()
        self.why = ""
        self._renewed_at = acquired.at
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lease-keeper", daemon=True)
        self._proof = HolderProof(self.lease.holder) if self.lease.owner.kind == "cli" else None

    def __enter__(self) -> LeaseKeeper:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def clean_rule(self) -> CleanRule:
        return self.acquired.clean

    def start(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop renewing; a process (not a Job's worker) gives the lease up."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        try:
            # A Job's workers share the lease and end at different times: it is left to go stale. A process
            # releases it: a released record (its tokens' leftovers are then free to clean at once).
            if not self.lost.is_set() and self.lease.owner.kind == "cli":
                self.acquired.writes.put_replacing(LEASE, self.lease.given_up(datetime.now(UTC)).encode(self.times),
                                                   self.version, budget_s=self.times.renew_every_s)
        except PreconditionFailed:
            logger.warning("%s was taken by another writer before this run gave it up", self.storage.uri(LEASE))
        except Exception as error:  # noqa: BLE001 - a lease left behind goes stale; never fail the run's exit for it
            logger.warning("could not release %s: %s", self.storage.uri(LEASE), error)
        finally:
            if self._proof is not None:
                self._proof.close()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.renew()
            except Exception as error:  # noqa: BLE001 - the next renewal tries again; the fence stops commits
                logger.warning("could not renew %s: %s", self.storage.uri(LEASE), error)
                if self.clock() - self._renewed_at >= self.times.stale_s:
                    self._lose(f"{self.storage.uri(LEASE)} could not be renewed for {self.times.stale_s:.0f} s "
                               f"(last error: {error}); another run may have taken the output over")
            if self.lost.is_set():
                return

    def renew(self) -> None:
        fault_points().before("lease", LEASE)
        for _ in range(2):
            lease = self.lease.renewed(datetime.now(UTC))
            try:
                version = self.acquired.writes.put_replacing(LEASE, lease.encode(self.times), self.version,
                                                             budget_s=self.times.renew_every_s)
            except PreconditionFailed:
                found = read_versioned(self.storage)
                current = found[0] if found is not None else None
                if found is not None and current is not None and not current.released \
                        and current.shared_with(self.lease.owner, self.lease.holder):
                    self.version = found[1]  # another worker of this resource renewed it: renew on top of it
                    continue
                taker = current.describe() if current is not None else "nobody (it was deleted or replaced)"
                self._lose(f"the output's lease was taken over: {storage_uri(self.storage)} now names {taker}")
                return
            with self._changed:
                self.lease, self.version, self._renewed_at = lease, version, self.clock()
                self._changed.notify_all()
            return

    def _lose(self, why: str) -> None:
        with self._changed:
            if not self.lost.is_set():
                self.why = why
                logger.error("%s: committing nothing more", why)
                self.lost.set()
            self._changed.notify_all()

    def fence(self) -> None:
        """Return only while this run can prove it holds the lease (the fencing rule, `lease_rules.may_commit`);
        waits for a late renewal up to the stale period, then raises LeaseLost."""
        with self._changed:
            while True:
                if self.lost.is_set():
                    raise LeaseLost(self.why)
                age = self.clock() - self._renewed_at
                if may_commit(age, self.times):
                    return
                if age >= self.times.stale_s:
                    self.why = (f"the last renewal of {self.storage.uri(LEASE)} was {age:.0f} s ago, past its stale "
                                f"period of {self.times.stale_s:.0f} s (the process was paused or cut off from "
                                "the store): another run may hold the output now")
                    logger.error("%s: committing nothing more", self.why)
                    self.lost.set()
                    raise LeaseLost(self.why)
                self._changed.wait(min(self.times.watch_poll_s, self.times.stale_s - age))


def storage_uri(storage: Storage) -> str:
    return storage.uri(LEASE)
