"""The output lease at the edge: taken, renewed, proven and given up with conditional writes (rules: `lease_rules.py`).

`lease.json` at the output's root names the owner, the holder and its run tokens. A writer takes it before it
cleans leftovers or commits anything:
- no lease: create it with If-None-Match: * (of two racing writers exactly one succeeds; the other gets a 412);
- a released lease, one shared with this owner (a DatasetGeneration's workers), --take-over, a holder proven gone
  (below), or one whose version stayed unchanged while this run watched it for the stale period: replace it with
  If-Match: <the version read>; a 412 means someone else changed it first, and it is read again;
- otherwise the run is refused, naming the holder.
A run that replaces the lease of a holder that may still be alive (stale while watched, --take-over) seals every run
token of the output but its own before it returns (seals.py): a record of theirs already past its fence then counts
for nobody. A DatasetGeneration's workers share one record that lists all their tokens (lease_rules.Lease.joined).
It renews with If-Match: <its own last version>; a 412 means the lease is lost, at once, unless the record read back
is still its own owner's tenure (a sibling worker renewed it: see LeaseKeeper). The store must honour
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
import random
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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
from .ownership import Fence
from .seals import seal_tokens
from .storage import PreconditionFailed, Storage, StorageError, TooLarge, retry_from_env

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
    """A lease this run holds: the record and version it wrote, when it sent that write (the fencing clock), what
    the cleaners may delete, and its run token (every object it writes carries it: store/ownership.py)."""

    lease: Lease
    version: str
    at: float
    clean: CleanRule
    writes: Any  # the storage the lease is written through (the store itself, or UnconditionalWrites)
    token: str = ""


def _backoff(times: LeaseTimes, tries: int) -> float:
    """A random wait after a lost race for the lease (full jitter, doubling): a resource's workers that start or renew
    together spread out instead of meeting again at the same moment."""
    return random.uniform(0.0, min(times.renew_every_s / 4, 0.05 * 2 ** min(tries, 16)))


def acquire(storage: Storage, owner: Owner, holder: str, token: str = "", take_over: bool = False,
            allow_unconditional: bool = False, times: LeaseTimes | None = None,
            clock: Callable[[], float] = boottime, sleep: Callable[[float], None] = time.sleep,
            wall: Callable[[], datetime] = lambda: datetime.now(UTC)) -> Acquired:
    """Take (or join) the lease; raises LeaseHeld naming the holder, LeaseUnsupported for a store without
    conditional writes (unless allowed)."""
    times = times or lease_times()
    writes = lease_writes(storage, allow_unconditional)
    tenure = secrets.token_hex(8)  # this owner's tenure, should it take the output (a joiner keeps the record's)
    started, tries = clock(), 0
    # A resource's workers start together and each writes its token into the one record: up to 256 of them take
    # turns, so a joiner keeps trying for a stale period (and at least ACQUIRE_ROUNDS times), not a fixed count.
    while tries < ACQUIRE_ROUNDS or clock() - started < times.stale_s:
        tries += 1
        found = read_versioned(storage)
        now = wall()
        mine = Lease(owner, holder, now, now, (token,) if token else (), tenure=tenure)
        try:
            if found is None:
                sent = clock()
                version = writes.put_new(LEASE, mine.encode(times))
                return _acquired(storage, mine, version, sent, frozenset(), times, writes, token)
            current, read = found
            finished: frozenset[str] = frozenset()
            wait = 0.0
            # Tokens whose holder may still be alive (or a taker that died sealing them left): sealed before this
            # run reads or commits anything, so a record they land late counts for nobody (seals.py).
            sealing = set(current.sealing) if current is not None else set()
            taking = False
            if current is None or current.released:
                finished = frozenset(current.tokens) if current is not None else frozenset()
            elif current.shared_with(owner, holder):
                mine = current.joined(holder, token, now)  # every token read, its tenure, its seals still due
            elif take_over:
                logger.warning("taking the output over from %s (--take-over)", current.describe())
                wait, taking = times.take_over_wait_s, True
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
                # Stale: its holder is fenced, but one paused between its last check and its record's write may
                # still land that record: its young files are kept (by age), not counted as finished, and every
                # token is sealed.
                taking = True
                sealing.update(current.tokens)
            mine = replace(mine, sealing=tuple(sorted(sealing)))
            sent = clock()
            version = writes.put_replacing(LEASE, mine.encode(times), read)
            if wait:
                logger.warning("waiting %.0f s for the taken-over writer to notice and its last commits to land",
                               wait)
                sleep(wait)
            if sealing or taking:
                # Every token in the output but this run's own: a worker of the holder that the record no longer
                # lists (fallen off its token list, a record rebuilt by hand) is sealed by the names it wrote.
                seal_tokens(storage, writes, sealing, holder, all_but=token if taking else None)
                mine = replace(mine, sealing=())  # sealed: the first renewal writes the record without them
            return _acquired(storage, mine, version, sent, finished, times, writes, token)
        except PreconditionFailed:
            # Another writer changed the lease between the read and the write: read it again, after a random wait
            # when it is a worker of this very owner (they would otherwise keep colliding).
            if found is not None and found[0] is not None and found[0].shared_with(owner, holder):
                sleep(_backoff(times, tries))
            continue
    raise LeaseHeld(f"{storage.uri(LEASE)} kept changing while this run tried to take it for {times.stale_s:.0f} s: "
                    "another writer is taking the output at the same moment")


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
              times: LeaseTimes, writes: Any, token: str) -> Acquired:
    try:
        store_now = storage.modified(LEASE)  # the store's clock, which the cleaners compare its objects' times to
    except StorageError as error:
        logger.warning("cannot read the time of %s (%s): only finished runs' leftovers are removed",
                       storage.uri(LEASE), error)
        store_now = None
    return Acquired(lease, version, at, CleanRule(finished, store_now, times.keep_unmarked_s), writes, token)


# -- holding it -------------------------------------------------------------------------------------------------
class LeaseKeeper:
    """Renews a lease from a thread while the run lasts, and fences records: `writing()` around each record's write
    enters only while this run can prove it holds the lease (otherwise LeaseLost, and `lost` is set) and keeps the
    lease from being given up until the write ends.

    A proof is dated by when its request was sent. A renewal that wins its conditional write proves the lease at
    its sending. For a lease a DatasetGeneration's workers share, a renewal that loses its race to a sibling proves
    it too: the version it held was current at its last look (a write or a read, dated by its sending), so the newer
    one was written after that look, and a run that takes the output watches the newest version for the stale
    period first; the record read back, still this owner's tenure, says nobody has. A round therefore needs no
    retry storm: at most two conditional writes move the proof forward (the second only when the first lost its race
    right after this worker's own write), and a round that proves nothing is logged."""

    def __init__(self, storage: Storage, acquired: Acquired, times: LeaseTimes | None = None,
                 clock: Callable[[], float] = boottime, every_s: float | None = None) -> None:
        self.storage, self.acquired = storage, acquired
        self.lease, self.version = acquired.lease, acquired.version
        self.token = acquired.token
        self.times = times or lease_times()
        self.every_s = self.times.renew_every_s if every_s is None else every_s
        self.clock = clock
        self.lost = threading.Event()
        self.why = ""
        self._renewed_at = acquired.at  # the newest proof (the fencing clock, when its request was sent)
        self._look_at = acquired.at  # when this run last saw `self.version` current (its sending)
        self._changed = threading.Condition()
        self._renewing = threading.Lock()  # the renewal thread and confirm() take turns
        self._writing = 0  # records past their proof whose write has not ended
        self._closing = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lease-keeper", daemon=True)
        self._proof = HolderProof(self.lease.holder) if self.lease.owner.kind == "cli" else None
        self.rounds = self.missed = 0  # renewal rounds, and those that proved nothing (each logged)

    def __enter__(self) -> LeaseKeeper:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def clean_rule(self) -> CleanRule:
        return self.acquired.clean

    @property
    def commit_fence(self) -> Fence:
        """What this run's records are written under (store/ownership.py)."""
        return Fence(self.token, self.writing, self.times.marker_budget_s, retry_from_env().budget_s,
                     self.acquired.clean)

    def start(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop fencing and renewing; a process (not a Job's worker) gives the lease up, but only once no record's
        write is in flight: one that is still running when the margin has passed leaves the lease to go stale (a
        taker then seals this run's token), never released under a write that may still land."""
        if self._stop.is_set():
            return
        with self._changed:
            self._closing = True  # no proof from now on: a commit still to come is refused
            deadline = time.monotonic() + self.times.margin_s
            while self._writing and time.monotonic() < deadline:
                self._changed.wait(min(self.times.watch_poll_s, max(0.0, deadline - time.monotonic())))
            in_flight = self._writing
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        try:
            if in_flight:
                logger.warning("%d record writes of this run are still in flight: %s is left to go stale, not given up",
                               in_flight, self.storage.uri(LEASE))
            # A Job's workers share the lease and end at different times: it is left to go stale. A process
            # releases it: a released record (its tokens' leftovers are then free to clean at once).
            elif not self.lost.is_set() and self.lease.owner.kind == "cli":
                self.acquired.writes.put_replacing(LEASE, self.lease.given_up(datetime.now(UTC)).encode(self.times),
                                                   self.version, budget_s=self.times.renew_every_s)
        except PreconditionFailed:
            logger.warning("%s was taken by another writer before this run gave it up", self.storage.uri(LEASE))
        except Exception as error:  # noqa: BLE001 - a lease left behind goes stale; never fail the run's exit for it
            logger.warning("could not release %s: %s", self.storage.uri(LEASE), error)
        finally:
            if self._proof is not None:
                self._proof.close()

    def _next_round_s(self) -> float:
        # Jittered within the period: workers started together do not renew in lockstep, and a proof is never older
        # than two periods when a round begins.
        return self.every_s * random.uniform(0.5, 1.0)

    def _run(self) -> None:
        while not self._stop.wait(self._next_round_s()):
            self.rounds += 1
            try:
                moved = self.renew()
            except Exception as error:  # noqa: BLE001 - the next renewal tries again; the fence stops commits
                moved = False
                logger.warning("could not renew %s: %s", self.storage.uri(LEASE), error)
                if self.clock() - self._renewed_at >= self.times.stale_s:
                    self._lose(f"{self.storage.uri(LEASE)} could not be renewed for {self.times.stale_s:.0f} s "
                               f"(last error: {error}); another run may have taken the output over")
            if self.lost.is_set():
                return
            if not moved:
                self.missed += 1
                logger.warning("a renewal round of %s proved nothing: the lease was last proven %.1f s ago, and "
                               "commits stop past %.0f s", self.storage.uri(LEASE), self.clock() - self._renewed_at,
                               self.times.stale_s - self.times.margin_s)

    def renew(self) -> bool:
        """One renewal round; True when it moved the proof forward. Sets `lost` when another owner holds the lease."""
        with self._renewing:
            fault_points().before("lease", LEASE)
            before = self._renewed_at
            for _ in range(2):
                if self.lost.is_set():
                    return False
                sent = self.clock()
                lease = self.lease.joined(self.lease.holder, self.token, datetime.now(UTC))
                try:
                    version = self.acquired.writes.put_replacing(LEASE, lease.encode(self.times), self.version,
                                                                 budget_s=self.times.renew_every_s)
                except PreconditionFailed:
                    if not self._lost_race(lease, sent):
                        return False
                    if self._renewed_at > before:
                        return True
                    continue  # it proved only this worker's own last write: once more on the version just read
                self._proven(lease, version, sent, sent)
                return True
            return self._renewed_at > before

    def _lost_race(self, tried: Lease, sent: float) -> bool:
        """After a renewal's 412: read the lease back. Still this owner's tenure: the race proves the lease as of this
        run's previous look (True). Otherwise the lease is lost (False)."""
        looked = self.clock()
        found = read_versioned(self.storage)
        current = found[0] if found is not None else None
        if found is None or current is None or not self.lease.same_tenure(current):
            taker = current.describe() if current is not None else "nobody (it was deleted or replaced)"
            self._lose(f"the output's lease was taken over: {storage_uri(self.storage)} now names {taker}")
            return False
        if current.nonce == tried.nonce:  # this very write landed and its answer was lost (a retried PUT): it won
            self._proven(current, found[1], sent, looked)
            return True
        # Another worker of this owner (or this run's confirm) renewed it: renew on top of its record, tokens and all.
        self._proven(replace(current, holder=self.lease.holder), found[1], self._look_at, looked)
        return True

    def _proven(self, lease: Lease, version: str, proven_at: float, looked_at: float) -> None:
        with self._changed:
            self.lease, self.version, self._look_at = lease, version, looked_at
            self._renewed_at = max(self._renewed_at, proven_at)
            self._changed.notify_all()

    def confirm(self) -> None:
        """Prove once more, after this run's last record landed, that nobody took the output over: a conditional
        renewal of its own version (one that loses its race to a sibling worker proves it as well, the record read
        back still being this owner's tenure). Raises LeaseLost otherwise: what this run committed after a takeover
        counts for nobody, so it must not exit 0 or write a report."""
        if not self.lost.is_set():
            try:
                self.renew()
            except StorageError as error:
                self._lose(f"{self.storage.uri(LEASE)} could not be read or renewed to prove this run still holds it "
                           f"({error})")
        if self.lost.is_set():
            raise LeaseLost(self.why)

    def _lose(self, why: str) -> None:
        with self._changed:
            if not self.lost.is_set():
                self.why = why
                logger.error("%s: committing nothing more", why)
                self.lost.set()
            self._changed.notify_all()

    def prove(self) -> None:
        """Return only while this run can prove it holds the lease (the fencing rule, `lease_rules.may_commit`);
        waits for a late renewal up to the stale period, then raises LeaseLost."""
        with self._changed:
            self._prove_locked()

    @contextmanager
    def writing(self) -> Iterator[None]:
        """Around one record's write: proves the lease first, and holds `close()` from giving it up until the write
        has ended."""
        with self._changed:
            self._prove_locked()
            self._writing += 1
        try:
            yield
        finally:
            with self._changed:
                self._writing -= 1
                self._changed.notify_all()

    def _prove_locked(self) -> None:
        while True:
            if self.lost.is_set():
                raise LeaseLost(self.why)
            if self._closing:
                raise LeaseLost(f"this run is giving {self.storage.uri(LEASE)} up: it commits nothing more")
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
