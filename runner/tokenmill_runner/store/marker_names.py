"""Commit marker names, time first, so a reader lists only what is new. Pure.

A marker is `<dataset>/commits/<time>-<shard_id>.json`, `<time>` the UTC time its writer chose just before the PUT
(`20261129T120000.123456Z`, fixed width, so key order is time order, ties broken by shard id: the commit order the
report and the export use). A reader that has folded every marker up to some time lists with S3's `StartAfter`
from there, minus `OVERLAP`: a marker named at t is visible once its PUT finishes, which can be later than a marker
named after it (a slow or retried PUT, a writer's clock a little behind). `OVERLAP` covers the storage retry
budget of one PUT (600 s, storage.py) with room for clock skew; folds are idempotent and readers remember which
shards they folded, so the overlap costs a LIST page, not GETs. A PUT slower than that (a straggler) is caught by
the full listings readers also make (see docs/scale.md).

Markers written before the time prefix (`w003-<token>-<seq>.json`) are still read: their names sort after every
time-named marker, so an incremental listing always includes them, and their commit time is only in their body.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

TIME_FORMAT = "%Y%m%dT%H%M%S.%fZ"
TIME_CHARS = len("20261129T120000.123456Z")
OVERLAP = timedelta(minutes=15)
# A writer's clock may run ahead of the reader's by this much before its names stop moving the reader's horizon: a
# name far in the future would otherwise push the horizon past every correctly clocked writer's markers, and
# incremental listings would stop seeing them until the next full listing.
MAX_CLOCK_SKEW = timedelta(minutes=5)
SUFFIX = ".json"


def time_key(at: datetime) -> str:
    """The fixed-width, sortable form of a UTC time used in names."""
    return at.astimezone(UTC).strftime(TIME_FORMAT)


def parse_time_key(text: str) -> datetime:
    return datetime.strptime(text, TIME_FORMAT).replace(tzinfo=UTC)


def marker_name(at: datetime, shard_id: str) -> str:
    return f"{time_key(at)}-{shard_id}{SUFFIX}"


def is_marker_name(name: str) -> bool:
    """A committed marker's file name (not a temporary file of a write in progress, not another file)."""
    return name.endswith(SUFFIX)


def _has_time(name: str) -> bool:
    return len(name) > TIME_CHARS and name[TIME_CHARS] == "-" and name[TIME_CHARS - 1] == "Z" and name[:8].isdigit()


def split_marker_name(name: str) -> tuple[str | None, str]:
    """(time key or None for an old-style name, shard id) of a marker's file name."""
    if _has_time(name):
        return name[:TIME_CHARS], shard_id_of(name)
    return None, shard_id_of(name)


def shard_id_of(key: str) -> str:
    """The shard id a marker, data or error file belongs to (shard ids have no dots; what follows the first dot of
    the name is its extension and any temporary-file suffix)."""
    name = key.rsplit("/", 1)[-1]
    if _has_time(name):
        name = name[TIME_CHARS + 1:]
    return name.split(".", 1)[0]


def token_of(stem: str) -> str | None:
    """The run token an object's name carries (store/ownership.py): a shard id's (`w000-<token>-000001`), or a
    sample's state file or record's (`<sample key>-<token>`); None for a name without one (a state record written
    before the names carried tokens)."""
    parts = stem.split("-")
    if len(parts) == 3 and parts[0].startswith("w"):
        return parts[1] or None
    if len(parts) == 2 and parts[0] and parts[1]:
        return parts[1]
    return None


def worker_of(shard_id: str) -> int | None:
    """The worker index a shard id starts with (`w003-...`), or None."""
    head = shard_id.split("-", 1)[0]
    return int(head[1:]) if head.startswith("w") and head[1:].isdigit() else None


def horizon(newest: str, overlap: timedelta = OVERLAP) -> str:
    """The time key `overlap` before `newest`: where the next incremental listing starts."""
    return time_key(parse_time_key(newest) - overlap)
