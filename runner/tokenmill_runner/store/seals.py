"""Seals: what a taken-over writer committed, made final, so a marker it writes later counts for nobody.

A run that takes the output's lease from a holder that may still be alive (its lease stayed unchanged for the stale
period while watched, or `--take-over`) cannot stop a marker PUT of that holder already past its fence: a process
paused by SIGSTOP or a frozen node between the fence and the write, a PUT held in a proxy. S3 checks a condition on
the object written and on no other, so no write of the taker can make that PUT fail. The readers refuse it instead:
before it reads any ledger or commits anything, the taker writes, per dataset folder and old run token,

    <dataset>/seals/<token>.json     {"token", "shards": [the token's marker shard ids listed then], "by", "at"}

with If-None-Match: * (the first seal of a token wins; a second taker reads it). `markers.list_commits`, which every
reader of markers goes through, then counts a sealed token's marker only when its seal names it: one that lands
after the seal is ignored by the taker, the report, export and the operator alike, and its slots are the taker's to
generate. Markers listed before the seal are in it, so no reader counts a slot that the seal drops.
"""

from __future__ import annotations

import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import numpy as np
import orjson

from .bounded_get import ObjectTooLarge, get_bounded
from .bounds import OverBound, check_values
from .commit_index import shard_hash
from .ledger import COMMITS, ERRORS, SHARDS
from .marker_names import is_marker_name, shard_id_of, token_of
from .storage import PreconditionFailed, Storage

logger = logging.getLogger(__name__)

SEALS = "seals"
SUFFIX = ".json"
# A seal lists one run token's markers in one dataset, about 31 bytes each: 4 MiB is 135,000 shards of one worker's
# run (35 million samples at 256 a shard; the run this product comes from committed 1,375 shards in all). Anyone who
# can write the output can write a seal, so nothing larger is read (64 MiB seals held for ever took the operator
# to 2.5 GB: security-f9665d2.md B7).
SEAL_BYTES = 4 * 1024 * 1024
# A takeover seals each run token of the holder it replaces (at most runner.parallelism, 256) in each dataset; a
# dataset's seals folder holds at most this many, and this many bytes of them, before its listing is refused.
MAX_SEALS = 4096
SEALS_BYTES = 64 * 1024 * 1024
# Parsed seals kept by a process (8 bytes per shard id), least recently used dropped first: the operator reads the
# seals of every resource it serves, and a resource's may be gone.
CACHE_BYTES = 16 * 1024 * 1024
_TOKEN = re.compile(r"[0-9A-Za-z]{1,64}")


class SealError(OverBound):
    """A seal file that is not one tokenmill wrote, or a seals folder past its bounds."""


def seal_key(dataset: str, token: str) -> str:
    return f"{dataset}/{SEALS}/{token}{SUFFIX}"


def encode_seal(token: str, shards: Iterable[str], by: str, at: datetime) -> bytes:
    return orjson.dumps({"token": token, "shards": sorted(shards), "by": by, "at": at.isoformat()})


def decode_seal(data: bytes, key: str) -> tuple[str, np.ndarray]:
    """(token, the sorted 64-bit hashes of the shard ids it keeps) of a seal; every shard id must be of its token."""
    try:
        check_values(data, SEAL_BYTES // 8, key)
        raw = orjson.loads(data)
        token, shards = raw["token"], raw["shards"]
        if not isinstance(token, str) or not _TOKEN.fullmatch(token):
            raise TypeError("token is not a run token")
        if not isinstance(shards, list) or not all(isinstance(shard, str) and token_of(shard) == token
                                                   for shard in shards):
            raise TypeError(f"shards is not a list of shard ids of run token {token}")
        hashes = np.unique(np.fromiter((shard_hash(shard) for shard in shards), dtype=np.uint64, count=len(shards)))
        return token, hashes
    except (ValueError, KeyError, TypeError) as error:
        raise SealError(f"{key} is not a seal tokenmill wrote ({type(error).__name__}: {error}); a seal is only "
                        "ever created, so it was written by hand: put back the original or remove the output's "
                        "run token from it") from None


@dataclass(frozen=True)
class Seals:
    """A dataset's seals: per sealed run token, the (sorted 64-bit hashes of the) shard ids of its markers that
    count. A hash, not the id: 8 bytes a shard; two ids of one token collide with probability ~n^2/2^65."""

    sealed: dict[str, np.ndarray] = field(default_factory=dict)

    def counts(self, shard_id: str) -> bool:
        """Whether a marker of this shard counts: its token is not sealed, or its seal names it."""
        if not self.sealed:
            return True
        token = token_of(shard_id)
        kept = self.sealed.get(token) if token is not None else None
        if kept is None:
            return True
        key = np.uint64(shard_hash(shard_id))
        at = int(np.searchsorted(kept, key))
        return at < kept.size and kept[at] == key


class _SealCache:
    """Parsed seals by URI, at most CACHE_BYTES of them, least recently used dropped first. Seals are only ever
    created, never replaced; a seal removed and written again by hand is read again once it is dropped."""

    def __init__(self, max_bytes: int = CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self._held = 0
        self._seals: OrderedDict[str, tuple[str, np.ndarray]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, uri: str) -> tuple[str, np.ndarray] | None:
        with self._lock:
            found = self._seals.get(uri)
            if found is not None:
                self._seals.move_to_end(uri)
            return found

    def put(self, uri: str, seal: tuple[str, np.ndarray]) -> None:
        with self._lock:
            if uri in self._seals or seal[1].nbytes > self.max_bytes:
                return
            self._seals[uri] = seal
            self._held += seal[1].nbytes
            while self._held > self.max_bytes:
                _, dropped = self._seals.popitem(last=False)
                self._held -= dropped[1].nbytes

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
    sealed: dict[str, np.ndarray] = {}
    for key, _ in listed:
        uri = storage.uri(key)
        known = _cache.get(uri)
        if known is None:
            try:
                known = decode_seal(get_bounded(storage, key, SEAL_BYTES), uri)
            except ObjectTooLarge as error:  # said as a seal's bound, with what to do
                raise SealError(f"{error}; a seal lists one run token's shard ids: remove it") from None
            _cache.put(uri, known)
        sealed[known[0]] = known[1]
    return Seals(sealed)


def seal_tokens(storage: Storage, writes: Any, tokens: Iterable[str], by: str,
                now: datetime | None = None) -> int:
    """Seal `tokens` in every dataset folder of the output: each seal lists the token's markers present now.
    `writes` is what the lease is written through (its put_new is exclusive). Returns the seals this call wrote
    (a seal another taker wrote first is kept: it is the one every reader already applies)."""
    wanted = sorted(set(tokens))
    if not wanted:
        return 0
    written = 0
    for dataset in sorted(storage.folders("")):
        # A marker lands only after its shard's files (PUT before the fence): a folder without them is no
        # dataset a sealed writer can commit to (a report's plots, an export).
        if not {COMMITS, SHARDS, ERRORS} & set(storage.folders(f"{dataset}/")):
            continue
        prefix = f"{dataset}/{COMMITS}/"
        present: dict[str, set[str]] = {token: set() for token in wanted}
        for key in storage.list(prefix):
            name = key[len(prefix):]
            if "/" in name or not is_marker_name(name):
                continue
            shard_id = shard_id_of(name)
            token = token_of(shard_id)
            if token in present:
                present[token].add(shard_id)
        for token in wanted:
            try:
                writes.put_new(seal_key(dataset, token), encode_seal(token, present[token], by,
                                                                     now or datetime.now(UTC)))
            except PreconditionFailed:
                continue
            written += 1
            logger.info("%s: sealed run token %s with its %d commits: a marker it writes from now on counts for "
                        "nobody", dataset, token, len(present[token]))
    return written
