"""The output lease's rules: its record, who may take it, when it is stale, when a holder may still commit. Pure.

Staleness is never judged from the record's times: they come from the holder's clock, which may be minutes off
the reader's, or in the future. An observer judges a lease stale only when its version (the store's ETag) stayed the
same while it watched for `stale_s` on its own monotonic clock. A holder renews every `renew_every_s`, and before
each commit marker proves it still holds the lease: its last proof is younger than `stale_s - margin_s`, and the
marker's write is given at most `marker_budget_s` (< `margin_s`), so every marker of a holder lands before anyone can
have seen its lease stale. A proof is dated by when its request was sent, never by when its answer came back: a
renewal that landed at once and answered late proves only the moment it was sent. `lease.py` is the edge that reads
and writes it.

A DatasetGeneration's workers share one record (`shared_with`): it carries the union of their run tokens (a joiner
and a renewer write the tokens they read plus their own, `joined`), so a run that takes the output from them knows
every token to seal. Its `tenure` is drawn when an owner takes the output and kept by every joiner and renewer: a
worker that reads its owner's record under another tenure knows the output was taken and handed back meanwhile.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta

import orjson

from .manifest import Owner
from .marker_names import token_of

LEASE = "lease.json"
# A lease is a few hundred bytes; anyone who can write the output can write lease.json, and every run and every
# operator pass reads it, so nothing larger is read.
MAX_LEASE_BYTES = 64 * 1024
STALE_AFTER_S = 120.0
# Run tokens a shared record keeps, the most recently written last: 256 workers restarted a few times fit, and the
# record stays a fraction of MAX_LEASE_BYTES (a token is 19 bytes in JSON). A live worker whose token fell off writes
# it back at its next renewal; a taker also seals every token it finds in the output's object names (seals.py).
MAX_TOKENS = 1024


@dataclass(frozen=True)
class LeaseTimes:
    """The lease's periods, all derived from the stale period (tests shorten it)."""

    stale_s: float = STALE_AFTER_S

    @property
    def renew_every_s(self) -> float:
        return self.stale_s / 6

    @property
    def margin_s(self) -> float:
        return self.stale_s / 4

    @property
    def marker_budget_s(self) -> float:
        """How long one marker write may retry: inside the margin, so it lands (or is given up) before stale."""
        return self.margin_s * 0.8

    @property
    def watch_poll_s(self) -> float:
        return min(5.0, max(0.1, self.stale_s / 20))

    @property
    def take_over_wait_s(self) -> float:
        """After --take-over from a live holder: the holder notices at its next renewal (at most two renewal
        periods, the renewal write included) and its last marker lands within the marker budget after that."""
        return min(self.stale_s, 2 * self.renew_every_s + self.marker_budget_s)

    @property
    def keep_unmarked_s(self) -> float:
        """Another run's unmarked files younger than this may still get their marker: cleaners keep them."""
        return self.stale_s + self.marker_budget_s


class LeaseError(ValueError):
    """lease.json is not a lease tokenmill wrote (too large, not JSON, missing fields)."""


@dataclass(frozen=True)
class Lease:
    owner: Owner
    holder: str
    since: datetime
    renewed_at: datetime  # the holder's clock: shown to people, never compared
    tokens: tuple[str, ...] = ()  # the run tokens of the holder's shard names
    released: bool = False  # given up at a clean exit: free, and its tokens' unmarked files are leftovers
    nonce: str = field(default_factory=lambda: secrets.token_hex(8))  # every write distinct (local versions)
    # Run tokens of a taken-over holder that this holder seals before it commits (seals.py), kept in the record
    # until sealed: a taker that dies while sealing leaves them to the next one.
    sealing: tuple[str, ...] = ()
    tenure: str = ""  # drawn by the owner that took the output, kept by its joiners and renewers ("": older records)

    def encode(self, times: LeaseTimes | None = None) -> bytes:
        return orjson.dumps({"owner": self.owner.model_dump(exclude_none=True), "holder": self.holder,
                             "since": self.since.isoformat(), "renewed_at": self.renewed_at.isoformat(),
                             "stale_after_s": (times or LeaseTimes()).stale_s, "tokens": list(self.tokens),
                             "released": self.released, "nonce": self.nonce, "sealing": list(self.sealing),
                             "tenure": self.tenure})

    @classmethod
    def decode(cls, data: bytes) -> Lease:
        if len(data) > MAX_LEASE_BYTES:
            raise LeaseError(f"it is {len(data)} bytes, over the {MAX_LEASE_BYTES} a lease can be")
        try:
            raw = orjson.loads(data)
            tokens, sealing = raw.get("tokens") or [], raw.get("sealing") or []
            if not isinstance(tokens, list) or not isinstance(sealing, list):
                raise TypeError("tokens or sealing is not a list")
            return cls(Owner.model_validate(raw["owner"]), str(raw["holder"]), datetime.fromisoformat(raw["since"]),
                       datetime.fromisoformat(raw["renewed_at"]), tuple(str(token) for token in tokens),
                       bool(raw.get("released", False)), str(raw.get("nonce", "")),
                       tuple(str(token) for token in sealing), str(raw.get("tenure", "")))
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise LeaseError(f"it is not a lease ({type(error).__name__}: {error})") from None

    def renewed(self, now: datetime) -> Lease:
        return replace(self, renewed_at=now, nonce=secrets.token_hex(8))

    def given_up(self, now: datetime) -> Lease:
        return replace(self, renewed_at=now, released=True, nonce=secrets.token_hex(8))

    def joined(self, holder: str, token: str, now: datetime) -> Lease:
        """The record `holder` writes on top of this one of its own owner and tenure: every token read plus its own
        (moved last: the most recently written), at most MAX_TOKENS of them."""
        kept = tuple(known for known in self.tokens if known != token)
        tokens = (*kept, token) if token else kept
        return replace(self, holder=holder, renewed_at=now, tokens=tokens[-MAX_TOKENS:], released=False,
                       nonce=secrets.token_hex(8))

    def same_tenure(self, other: Lease) -> bool:
        """Whether `other` (a record read) is still this holder's lease: its owner's, not given up, and of the same
        tenure, and shared with this holder (a DatasetGeneration's worker, or this very process)."""
        return (not other.released and other.tenure == self.tenure
                and other.shared_with(self.owner, self.holder))

    def shared_with(self, owner: Owner, holder: str) -> bool:
        """Whether `holder` of `owner` may write alongside this lease's holder."""
        if self.owner != owner:
            return False
        return owner.kind == "DatasetGeneration" or self.holder == holder

    def describe(self) -> str:
        return (f"{self.owner.describe()} (holder {self.holder}) since {self.since.isoformat()}, last renewed at "
                f"{self.renewed_at.isoformat()} by its own clock")


@dataclass
class LeaseWatch:
    """What an observer saw of one output's lease: its version and since when (the observer's monotonic clock)."""

    version: str | None = None
    seen_since: float | None = None

    def see(self, version: str | None, now: float) -> float:
        """Record the version seen at `now`; how long it has stayed unchanged while watched."""
        if version != self.version or self.seen_since is None:
            self.version, self.seen_since = version, now
        return now - self.seen_since


def refusal(current: Lease | None, owner: Owner, holder: str, unchanged_s: float, take_over: bool = False,
            times: LeaseTimes | None = None) -> str | None:
    """Why `holder` of `owner` may not take the lease now, or None. `unchanged_s`: how long the observer has seen
    this version of the lease unchanged (0 on a first look): only that tells a gone holder from a live one."""
    times = times or LeaseTimes()
    if current is None or current.released or take_over or current.shared_with(owner, holder):
        return None
    if unchanged_s >= times.stale_s:
        return None
    return (f"the output is being written by {current.describe()}; two writers would commit samples twice and "
            f"delete each other's unmarked shards. Wait for it to finish, write to another output, or, if that "
            f"writer is gone, rerun: a lease not renewed for {times.stale_s:.0f} s while a run watches it is "
            "free (or pass --take-over)")


def may_commit(renewal_age_s: float, times: LeaseTimes) -> bool:
    """The fencing rule: a holder whose last successful renewal is this old may still write a marker."""
    return renewal_age_s <= times.stale_s - times.margin_s


@dataclass(frozen=True)
class CleanRule:
    """Which unmarked files a cleaner may delete: those of run tokens known to be finished (released, or of a
    holder proven gone), and any older than `keep_unmarked_s` by the store's own clock (`store_now` is the store's
    time of this run's lease write); a younger file of another run may still get its marker."""

    finished: frozenset[str]
    store_now: datetime | None
    keep_s: float

    def may_delete(self, stem: str, modified: datetime | None) -> bool:
        """Whether an unmarked object named `stem` (a shard id, a sample's state file) may be deleted."""
        if token_of(stem) in self.finished:
            return True
        if modified is None or self.store_now is None:
            return modified is None and self.store_now is not None  # gone already: nothing to keep
        return self.store_now - modified > timedelta(seconds=self.keep_s)
