"""What a reader takes from files someone else wrote, bounded by what it costs, not by what the file says. Pure.

An output prefix is written by whoever holds its credentials (a tenant's runner pods, a person with the keys), and
it is read by the shared operator, `tokenmill run` resuming, `report`, `inspect` and `export`. A count in one of its
files (a layout's rows, a marker's line, a seal's shard ids, a checkpoint's raw size) is checked here, against what
tokenmill can hold, before anything is sized from it: a 105-byte run.json that said `rows: 500000000` took the
operator to 5.9 GB (security-f9665d2.md B5). Every bound refuses with `OverBound`, whose message names the object,
the bound and what to do; docs/security.md lists them.
"""

from __future__ import annotations

import re

# A dataset's name is a folder of the output and a file name of the report: never a path (B10).
DATASET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")  # whole name (fullmatch): "$" lets "ok\n" through
# Datasets of one run: each is a folder, a ledger and a report section.
MAX_DATASETS = 64
# Slots (line x sample index) of one run's layouts together, and of any one ledger: a bit each in every reader's
# ledger (8 MiB at the bound), 6.7x the ten million prompts docs/scale.md measures, 760x the run this product
# comes from. A larger job is several runs.
MAX_SLOTS = 1 << 26
# Bytes the ledgers of one run may hold together: the row bits, plus a page of 4096 failure codes (and one of
# retry rounds) wherever a failure is. A run of MAX_SLOTS slots with a failure in every 4096 still fits
# (8 + 2 x 16 MiB); pages past this mean failures spread thinner than any run tokenmill writes.
LEDGER_BYTES = 64 * 1024 * 1024


class OverBound(ValueError):
    """An object refused by one of its reader's bounds before anything was sized from it."""


def check_name(name: object, where: str) -> str:
    """A dataset name read from a file, refused unless it is one a spec may give (never a path)."""
    if not isinstance(name, str) or not DATASET_NAME.fullmatch(name):
        raise OverBound(f"{where}: dataset name {name!r} is not one a spec may give ({DATASET_NAME.pattern}); the "
                        "file was not written by tokenmill: remove it or write the run to a new output")
    return name


def json_values(data: bytes) -> int:
    """An upper bound on the values a JSON document holds, counted on its bytes before it is parsed: every value
    after the first follows a ',' or opens a '[' or '{' (commas inside strings only raise the count)."""
    return data.count(b",") + data.count(b"[") + data.count(b"{") + 1


def check_values(data: bytes, max_values: int, where: str) -> None:
    """Refuse a JSON document that may hold more values than its reader builds: parsed, each costs a Python object
    of ~50-100 bytes (16 MiB of `{},` is 5.6 million dicts, 600 MB)."""
    count = json_values(data)
    if count > max_values:
        raise OverBound(f"{where}: may hold {count} JSON values, over the {max_values} its reader parses; it was "
                        "not parsed (tokenmill never writes one this dense): remove it or write to a new output")
