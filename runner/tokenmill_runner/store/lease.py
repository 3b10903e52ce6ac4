"""The output lease: one owner writes an output at a time.

`lease.json` at the output's root names the owner (`manifest.Owner`), the holder (one process, or one runner Job
whose workers share it), since when it is held and when it was last renewed. A writer takes the lease before it
cleans leftovers or commits anything, and renews it every `RENEW_EVERY_S` while it runs. Another owner is refused
(exit 2, naming the holder and since when) unless the lease is stale (not renewed for `STALE_AFTER_S`: its holder
is gone) or `--take-over` is given. Workers of one DatasetGeneration share the lease across its Jobs (the operator
runs one Job at a time and deletes the old one's pods first); two `tokenmill run` processes never share one.

Taking a lease is a write followed by a read-back after `SETTLE_S`: of two writers that race, the one whose write
landed last keeps it and the other is refused. Nothing but a lease holder deletes files in an output, so a cleaner
never removes a shard that another live owner has written and not yet marked.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

import orjson

from .manifest import Owner

if TYPE_CHECKING:
    from .storage import Storage

logger = logging.getLogger(__name__)

LEASE = "lease.json"
STALE_AFTER_S = 120.0
RENEW_EVERY_S = 30.0
SETTLE_S = float(os.environ.get("TOKENMILL_LEASE_SETTLE_SECONDS", "1.0"))  # tests of many short runs lower it


class LeaseHeld(RuntimeError):
    """Another live owner writes this output."""


@dataclass(frozen=True)
class Lease:
    owner: Owner
    holder: str
    since: datetime
    renewed_at: datetime

    def encode(self) -> bytes:
        return orjson.dumps({"owner": self.owner.model_dump(exclude_none=True), "holder": self.holder,
                             "since": self.since.isoformat(), "renewed_at": self.renewed_at.isoformat(),
                             "stale_after_s": STALE_AFTER_S})

    @classmethod
    def decode(cls, data: bytes) -> Lease:
        raw = orjson.loads(data)
        return cls(Owner.model_validate(raw["owner"]), str(raw["holder"]), datetime.fromisoformat(raw["since"]),
                   datetime.fromisoformat(raw["renewed_at"]))

    def stale(self, now: datetime) -> bool:
        return now - self.renewed_at > timedelta(seconds=STALE_AFTER_S)

    def shared_with(self, owner: Owner, holder: str) -> bool:
        """Whether `holder` of `owner` may write alongside this lease's holder."""
        if self.owner != owner:
            return False
        return owner.kind == "DatasetGeneration" or self.holder == holder

    def describe(self, now: datetime) -> str:
        age = (now - self.renewed_at).total_seconds()
        return (f"{self.owner.describe()} (holder {self.holder}) since {self.since.isoformat()}, renewed {age:.0f} s "
                f"ago")


def refusal(current: Lease | None, owner: Owner, holder: str, now: datetime, take_over: bool,
            holder_alive: bool = True) -> str | None:
    """Why `holder` of `owner` may not take the lease now, or None. Pure. `holder_alive` False: the holder is a
    process of this machine that no longer exists (killed), so its lease is free at once."""
    if current is None or take_over or not holder_alive or current.stale(now) or current.shared_with(owner, holder):
        return None
    return (f"the output is being written by {current.describe(now)}; two writers would commit samples twice and "
            f"delete each other's unmarked shards. Wait for it to finish, write to another output, or, if that "
            f"writer is gone, wait {STALE_AFTER_S:.0f} s after its last renewal or pass --take-over")


def read_lease(storage: Storage) -> Lease | None:
    """The output's lease, or None when there is none (or it cannot be read: it is then free to take)."""
    if not storage.exists(LEASE):
        return None
    try:
        return Lease.decode(storage.get(LEASE))
    except (ValueError, KeyError, TypeError) as error:
        logger.warning("%s is unreadable (%s); taking it", storage.uri(LEASE), error)
        return None


def acquire(storage: Storage, owner: Owner, holder: str, take_over: bool = False,
            clock: Callable[[], datetime] = lambda: datetime.now(UTC), settle_s: float | None = None) -> Lease:
    """Take (or join) the lease; raises LeaseHeld naming the holder."""
    current = read_lease(storage)
    now = clock()
    why = refusal(current, owner, holder, now, take_over, current is None or process_alive(current.holder))
    if why:
        raise LeaseHeld(why)
    if take_over and current is not None and not current.stale(now) and not current.shared_with(owner, holder):
        logger.warning("taking the output over from %s (--take-over)", current.describe(now))
    since = current.since if current is not None and current.shared_with(owner, holder) else now
    lease = Lease(owner, holder, since, now)
    storage.put(LEASE, lease.encode())
    time.sleep(SETTLE_S if settle_s is None else settle_s)
    landed = read_lease(storage)
    if landed is not None and not landed.shared_with(owner, holder):
        raise LeaseHeld(f"another writer took the output at the same moment: {landed.describe(clock())}")
    return lease


def process_holder() -> str:
    """This process as a holder: `host:pid:token` (the token tells a reused pid apart)."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


def process_alive(holder: str) -> bool:
    """False only for a holder that was a process of this machine and is gone (a killed `tokenmill run`); a holder
    elsewhere (another machine, a pod) cannot be checked and counts as alive until its lease goes stale."""
    host, _, rest = holder.partition(":")
    pid = rest.partition(":")[0]
    if host != socket.gethostname() or not pid.isdigit():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return True


def release(storage: Storage, lease: Lease) -> None:
    """Give the lease up at a clean exit, unless another holder has it by now."""
    current = read_lease(storage)
    if current is not None and current.holder == lease.holder:
        storage.delete(LEASE)


class LeaseKeeper:
    """Renews a lease from a thread while the run lasts (tokenizer loading and the source scan happen before the
    event loop runs, and may take minutes). `lost` is set when another owner took the output over: the run must
    commit nothing more."""

    def __init__(self, storage: Storage, lease: Lease, every_s: float = RENEW_EVERY_S) -> None:
        self.storage, self.lease, self.every_s = storage, lease, every_s
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lease-keeper", daemon=True)

    def __enter__(self) -> LeaseKeeper:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

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
        # A Job's workers share the lease and end at different times: it is left to go stale. A process releases it.
        if self.lost.is_set() or self.lease.owner.kind != "cli":
            return
        try:
            release(self.storage, self.lease)
        except Exception as error:  # noqa: BLE001 - a lease left behind goes stale; never fail the run's exit for it
            logger.warning("could not release %s: %s", self.storage.uri(LEASE), error)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.renew()
            except Exception as error:  # noqa: BLE001 - the next renewal tries again; the run goes on
                logger.warning("could not renew %s: %s", self.storage.uri(LEASE), error)
            if self.lost.is_set():
                return

    def renew(self) -> None:
        current = read_lease(self.storage)
        if current is not None and not current.shared_with(self.lease.owner, self.lease.holder):
            logger.error("the output was taken over by %s: committing nothing more",
                         current.describe(datetime.now(UTC)))
            self.lost.set()
            return
        self.lease = Lease(self.lease.owner, self.lease.holder, self.lease.since, datetime.now(UTC))
        self.storage.put(LEASE, self.lease.encode())
