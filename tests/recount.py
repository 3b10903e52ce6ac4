"""An independent recount of a dataset's loss tokens from its committed shards' rows: what the token exports
supervise (every generated id of each generation, the loss mask's 1s), each slot once (its first commit), counted
with a plain Counter. Tests hold the per-shard counts (store/token_counts.py) and the report's coverage to it."""

from __future__ import annotations

from collections import Counter

from tokenmill_runner.export.units import units_from_row
from tokenmill_runner.store.shards import read_committed_rows
from tokenmill_runner.store.storage import Storage


def recount(storage: Storage, dataset: str, left_out_lines: set[int] = frozenset()) -> tuple[Counter[int], list[int]]:
    """(count per id, ids in the order a trainer counting record by record meets them: records in commit order,
    each record's distinct ids ascending, as `unique(return_counts=True)` gives them)."""
    counts: Counter[int] = Counter()
    order: dict[int, None] = {}
    seen: set[tuple[int, int]] = set()
    for row in read_committed_rows(storage, dataset):
        slot = (row["line"], row.get("sample_index") or 0)
        if slot in seen:
            continue
        seen.add(slot)
        if row["line"] in left_out_lines:
            continue
        for unit in units_from_row(row):
            ids = [tid for tid, mask in zip(unit.input_ids, unit.loss_mask, strict=True) if mask]
            counts.update(ids)
            order.update(dict.fromkeys(sorted(set(ids))))
    return counts, list(order)


def as_counter(frequencies) -> Counter[int]:
    """A TokenFrequencies as a Counter (ids with a count only)."""
    return Counter({int(tid): int(frequencies.counts[tid]) for tid in frequencies.counts.nonzero()[0]})
