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
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import orjson

from .bounded_get import get_bounded
from .ledger import COMMITS, ERRORS, SHARDS
from .marker_names import is_marker_name, shard_id_of, token_of
from .storage import PreconditionFailed, Storage

logger = logging.getLogger(__name__)

SEALS = "seals"
SUFFIX = ".json"
# A shard id is about 32 bytes; a million shards of one run in one dataset is far past any real run (88,000 prompts
# in shards of 64 are 1,375). Anyone who can write the output can write a seal, so nothing larger is read.
SEAL_BYTES = 64 * 1024 * 1024


class SealError(ValueError):
    """A seal file that is not one tokenmill wrote."""


def seal_key(dataset: str, token: str) -> str:
    return f"{dataset}/{SEALS}/{token}{SUFFIX}"


def encode_seal(token: str, shards: Iterable[str], by: str, at: datetime) -> bytes:
    return orjson.dumps({"token": token, "shards": sorted(shards), "by": by, "at": at.isoformat()})


def decode_seal(data: bytes, key: str) -> tuple[str, frozenset[str]]:
    try:
        raw = orjson.loads(data)
        shards = raw["shards"]
        if not isinstance(shards, list) or not all(isinstance(shard, str) for shard in shards):
            raise TypeError("shards is not a list of shard ids")
        return str(raw["token"]), frozenset(shards)
    except (ValueError, KeyError, TypeError) as error:
        raise SealError(f"{key} is not a seal tokenmill wrote ({type(error).__name__}: {error}); a seal is only "
                        "ever created, so it was written by hand: put back the original or remove the output's "
                        "run token from it") from None


@dataclass(frozen=True)
class Seals:
    """A dataset's seals: per sealed run token, the shard ids of its markers that count."""

    sealed: dict[str, frozenset[str]] = field(default_factory=dict)

    def counts(self, shard_id: str) -> bool:
        """Whether a marker of this shard counts: its token is not sealed, or its seal names it."""
        if not self.sealed:
            return True
        token = token_of(shard_id)
        kept = self.sealed.get(token) if token is not None else None
        return kept is None or shard_id in kept


# Seals are only ever created, never replaced: each is read once per process and store.
_read: dict[str, tuple[str, frozenset[str]]] = {}
_read_lock = threading.Lock()


def read_seals(storage: Storage, dataset: str) -> Seals:
    """The dataset's seals (one listing of its seals folder; each seal read once per process)."""
    sealed: dict[str, frozenset[str]] = {}
    for key in storage.list(f"{dataset}/{SEALS}/"):
        if not key.endswith(SUFFIX):
            continue  # a temporary file of a seal being written
        uri = storage.uri(key)
        with _read_lock:
            known = _read.get(uri)
        if known is None:
            known = decode_seal(get_bounded(storage, key, SEAL_BYTES), uri)
            with _read_lock:
                _read[uri] = known
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
