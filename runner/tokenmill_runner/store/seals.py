"""Seals: what a taken-over writer wrote, made final, so a record it writes later counts for nobody.

A run that takes the output's lease from a holder that may still be alive (its lease stayed unchanged for the stale
period while watched, or `--take-over`) cannot stop a record PUT of that holder already past its fence: a process
paused by SIGSTOP or a frozen node between the fence and the write, a PUT held in a proxy. S3 checks a condition on
the object written and on no other, so no write of the taker can make that PUT fail. The readers refuse it instead:
before it reads any ledger or commits anything, the taker writes, per dataset folder and run token,

    <dataset>/seals/<token>.json     {"token", "names": {folder: [the token's object names listed then]},
                                      "shards": [its commit markers' shard ids], "by", "at"}

with If-None-Match: * (the first seal of a token wins; a second taker reads it). It seals every run token the lease
names and every one an object of the output carries in its name (store/ownership.py), except its own: sealing a
finished token is harmless, its seal names all it wrote. `markers.list_records`, which every reader of records goes
through (shard markers, state markers, failure records), then counts a sealed token's record only when its seal
names it: one that lands after the seal is ignored by the taker, the report, export and the operator alike, and its
work is the taker's to do. Records listed before the seal are in it, so no reader counts one that the seal drops.
"""

from __future__ import annotations

import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import numpy as np
import orjson

from .bounded_get import ObjectTooLarge, get_bounded
from .bounds import OverBound, check_values
from .checkpoints import INDEX
from .commit_index import shard_hash
from .ledger import COMMITS, ERRORS, SHARDS
from .marker_names import is_marker_name, shard_id_of, token_of
from .storage import TMP_MARK, PreconditionFailed, Storage

logger = logging.getLogger(__name__)

SEALS = "seals"
SUFFIX = ".json"
# A seal names one run token's records in one dataset, each under 70 bytes: its shards' markers (the run this product
# comes from committed 1,375 shards in all) and its samples' state markers and failure records (11,000 samples of a
# dataset, both kinds: 1.5 MB). 16 MiB is 240,000 records of one token in one dataset. Anyone who can write the
# output can write a seal, so nothing larger is read (64 MiB seals held for ever took the operator to 2.5 GB:
# security-f9665d2.md B7); each is parsed alone and held as 8-byte hashes.
SEAL_BYTES = 16 * 1024 * 1024
# A takeover seals each run token present in the output (one per worker, runner.parallelism up to 256, per Job and
# takeover) in each dataset; a dataset's seals folder holds at most this many, and this many bytes of them, before
# its listing is refused. Together they name every record of the dataset at most once.
MAX_SEALS = 4096
SEALS_BYTES = 256 * 1024 * 1024
# Parsed seals kept by a process (8 bytes per name), least recently used dropped first: the operator reads the
# seals of every resource it serves, and a resource's may be gone.
CACHE_BYTES = 16 * 1024 * 1024
_TOKEN = re.compile(r"[0-9A-Za-z]{1,64}")

Sealed = dict[str, np.ndarray]  # per folder, the sorted 64-bit hashes of the names it keeps


class SealError(OverBound):
    """A seal file that is not one tokenmill wrote, or a seals folder past its bounds."""


def seal_key(dataset: str, token: str) -> str:
    return f"{dataset}/{SEALS}/{token}{SUFFIX}"


def encode_seal(token: str, names: Mapping[str, Iterable[str]], by: str, at: datetime) -> bytes:
    listed = {folder: sorted(stems) for folder, stems in sorted(names.items())}
    return orjson.dumps({"token": token, "names": listed, "shards": listed.get(COMMITS, []), "by": by,
                         "at": at.isoformat()})


def _hashes(stems: list[str]) -> np.ndarray:
    return np.unique(np.fromiter((shard_hash(stem) for stem in stems), dtype=np.uint64, count=len(stems)))


def decode_seal(data: bytes, key: str) -> tuple[str, Sealed]:
    """(token, per folder the sorted 64-bit hashes of the names it keeps) of a seal; every name must be of its
    token. A hash, not the name: 8 bytes a record; two names of one token collide with probability ~n^2/2^65."""
    try:
        check_values(data, SEAL_BYTES // 8, key)
        raw = orjson.loads(data)
        token = raw["token"]
        if not isinstance(token, str) or not _TOKEN.fullmatch(token):
            raise TypeError("token is not a run token")
        # A seal written before seals named every folder lists its commit markers only.
        names = raw.get("names") if "names" in raw else {COMMITS: raw["shards"]}
        if not isinstance(names, dict) or not all(
                isinstance(stems, list) and all(isinstance(s, str) and token_of(s) == token for s in stems)
                for stems in names.values()):
            raise TypeError(f"names is not a map of folders to lists of names of run token {token}")
        return token, {str(folder): _hashes(stems) for folder, stems in names.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise SealError(f"{key} is not a seal tokenmill wrote ({type(error).__name__}: {error}); a seal is only "
                        "ever created, so it was written by hand: put back the original or remove the output's "
                        "run token from it") from None


@dataclass(frozen=True)
class Seals:
    """A dataset's seals: per sealed run token, per folder, the (hashes of the) names of its objects that count."""

    sealed: dict[str, Sealed] = field(default_factory=dict)

    def counts(self, folder: str, stem: str) -> bool:
        """Whether a record named `stem` in `folder` counts: its token is not sealed, or its seal names it."""
        if not self.sealed:
            return True
        token = token_of(stem)
        kept = self.sealed.get(token) if token is not None else None
        if kept is None:
            return True
        hashes = kept.get(folder)
        if hashes is None:
            return False
        key = np.uint64(shard_hash(stem))
        at = int(np.searchsorted(hashes, key))
        return at < hashes.size and hashes[at] == key


def _held(seal: tuple[str, Sealed]) -> int:
    return sum(hashes.nbytes for hashes in seal[1].values())


class _SealCache:
    """Parsed seals by URI, at most CACHE_BYTES of them, least recently used dropped first. Seals are only ever
    created, never replaced; a seal removed and written again by hand is read again once it is dropped."""

    def __init__(self, max_bytes: int = CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self._held = 0
        self._seals: OrderedDict[str, tuple[str, Sealed]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, uri: str) -> tuple[str, Sealed] | None:
        with self._lock:
            found = self._seals.get(uri)
            if found is not None:
                self._seals.move_to_end(uri)
            return found

    def put(self, uri: str, seal: tuple[str, Sealed]) -> None:
        size = _held(seal)
        with self._lock:
            if uri in self._seals or size > self.max_bytes:
                return
            self._seals[uri] = seal
            self._held += size
            while self._held > self.max_bytes:
                _, dropped = self._seals.popitem(last=False)
                self._held -= _held(dropped)

    @property
    def held(self) -> int:
        return self._held


_cache = _SealCache()


def read_seals(storage: Storage, dataset: str) -> Seals:
    """The dataset's seals (one listing of its seals folder; each seal read once while it stays in the cache), the
    folder's count and bytes bounded before any is read."""
    folder = f"{dataset}/{SEALS}/"
    listed = [(key, size) for key, size in storage.list_sizes(folder) if key.endswith(SUFFIX)]  # not a seal's temp file
    if len(listed) > MAX_SEALS or sum(size for _, size in listed) > SEALS_BYTES:
        raise SealError(f"{storage.uri(folder)} holds {len(listed)} seals of {sum(size for _, size in listed)} "
                        f"bytes, past the {MAX_SEALS} seals and {SEALS_BYTES} bytes a dataset's seals may have (each "
                        "takeover writes one per run token it seals); seals this many were not written by tokenmill: "
                        "remove the ones it did not write")
    sealed: dict[str, Sealed] = {}
    for key, _ in listed:
        uri = storage.uri(key)
        known = _cache.get(uri)
        if known is None:
            try:
                known = decode_seal(get_bounded(storage, key, SEAL_BYTES), uri)
            except ObjectTooLarge as error:  # said as a seal's bound, with what to do
                raise SealError(f"{error}; a seal lists one run token's records: remove it") from None
            _cache.put(uri, known)
        sealed[known[0]] = known[1]
    return Seals(sealed)


# Folders of a dataset that hold no writer's objects: the seals themselves, and checkpoints (a reader's fold of
# counted markers, refolded when it counts a sealed-away one: index_store.refresh).
UNOWNED = frozenset({SEALS, INDEX})


def _owned_names(storage: Storage, dataset: str) -> dict[str, dict[str, set[str]]]:
    """Per run token, per folder, the names of the dataset's records that carry it (an empty set where the token
    has only other objects there, a shard's data or a sample's state file): one listing of each folder."""
    found: dict[str, dict[str, set[str]]] = {}
    for folder in sorted(set(storage.folders(f"{dataset}/")) - UNOWNED):
        for key in storage.list(f"{dataset}/{folder}/"):
            name = key.rsplit("/", 1)[-1]
            if TMP_MARK in name:
                continue
            stem = shard_id_of(name)
            token = token_of(stem)
            if token is not None:
                names = found.setdefault(token, {}).setdefault(folder, set())
                if is_marker_name(name):
                    names.add(stem)
    return found


def seal_tokens(storage: Storage, writes: Any, tokens: Iterable[str], by: str, now: datetime | None = None,
                all_but: str | None = None) -> int:
    """Seal `tokens` in every dataset folder of the output, and with `all_but` every other token an object of the
    output carries in its name except that one (the taker's own): each seal lists the token's objects present now.
    `writes` is what the lease is written through (its put_new is exclusive). Returns the seals this call wrote (a
    seal another taker wrote first is kept: it is the one every reader already applies)."""
    # A record lands only after the writer's other objects of it (a shard's data, a sample's state file) or after
    # its token is in the lease: a folder without commits, shards or errors is no dataset (a report's plots).
    datasets = [name for name in sorted(storage.folders(""))
                if {COMMITS, SHARDS, ERRORS} & set(storage.folders(f"{name}/"))]
    owned = {dataset: _owned_names(storage, dataset) for dataset in datasets}
    wanted = set(tokens)
    if all_but is not None:
        wanted |= {token for names in owned.values() for token in names}
        wanted.discard(all_but)
    written = 0
    for dataset in datasets:
        already = read_seals(storage, dataset).sealed
        for token in sorted(wanted - set(already)):
            names = owned[dataset].get(token, {})
            try:
                writes.put_new(seal_key(dataset, token), encode_seal(token, names, by, now or datetime.now(UTC)))
            except PreconditionFailed:
                continue
            written += 1
            logger.info("%s: sealed run token %s with its %d commits and %d other records: a record it writes "
                        "from now on counts for nobody", dataset, token, len(names.get(COMMITS, ())),
                        sum(len(stems) for folder, stems in names.items() if folder != COMMITS))
    return written
