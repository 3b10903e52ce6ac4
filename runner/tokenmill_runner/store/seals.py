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
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import orjson

from .bounded_get import get_bounded
from .checkpoints import INDEX
from .ledger import COMMITS, ERRORS, SHARDS
from .marker_names import is_marker_name, shard_id_of, token_of
from .storage import TMP_MARK, PreconditionFailed, Storage

logger = logging.getLogger(__name__)

SEALS = "seals"
SUFFIX = ".json"
# A seal names a token's records, each under 70 bytes: its shards' markers (88,000 prompts in shards of 64 are 1,375)
# and its samples' state markers (88,000 samples of both kinds are 176,000, 12 MB). Anyone who can write the output can
# write a seal, so nothing larger is read.
SEAL_BYTES = 64 * 1024 * 1024


class SealError(ValueError):
    """A seal file that is not one tokenmill wrote."""


def seal_key(dataset: str, token: str) -> str:
    return f"{dataset}/{SEALS}/{token}{SUFFIX}"


def encode_seal(token: str, names: Mapping[str, Iterable[str]], by: str, at: datetime) -> bytes:
    listed = {folder: sorted(stems) for folder, stems in sorted(names.items())}
    return orjson.dumps({"token": token, "names": listed, "shards": listed.get(COMMITS, []), "by": by,
                         "at": at.isoformat()})


def decode_seal(data: bytes, key: str) -> tuple[str, dict[str, frozenset[str]]]:
    try:
        raw = orjson.loads(data)
        # A seal written before seals named every folder lists its commit markers only.
        names = raw.get("names") if "names" in raw else {COMMITS: raw["shards"]}
        if not isinstance(names, dict) or not all(isinstance(stems, list) and all(isinstance(s, str) for s in stems)
                                                  for stems in names.values()):
            raise TypeError("names is not a map of folders to lists of names")
        return str(raw["token"]), {str(folder): frozenset(stems) for folder, stems in names.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise SealError(f"{key} is not a seal tokenmill wrote ({type(error).__name__}: {error}); a seal is only "
                        "ever created, so it was written by hand: put back the original or remove the output's "
                        "run token from it") from None


@dataclass(frozen=True)
class Seals:
    """A dataset's seals: per sealed run token, per folder, the names of its objects that count."""

    sealed: dict[str, dict[str, frozenset[str]]] = field(default_factory=dict)

    def counts(self, folder: str, stem: str) -> bool:
        """Whether a record named `stem` in `folder` counts: its token is not sealed, or its seal names it."""
        if not self.sealed:
            return True
        token = token_of(stem)
        kept = self.sealed.get(token) if token is not None else None
        return kept is None or stem in kept.get(folder, frozenset())


# Seals are only ever created, never replaced: each is read once per process and store.
_read: dict[str, tuple[str, dict[str, frozenset[str]]]] = {}
_read_lock = threading.Lock()


def read_seals(storage: Storage, dataset: str) -> Seals:
    """The dataset's seals (one listing of its seals folder; each seal read once per process)."""
    sealed: dict[str, dict[str, frozenset[str]]] = {}
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
