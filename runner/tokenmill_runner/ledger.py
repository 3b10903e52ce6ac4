"""The ledger: what a dataset's commit markers say is committed, and what a marker holds. Pure: no storage here.

A commit marker (`<dataset>/commits/<shard_id>.json`, written after the shard's data; `shards.py` writes and
reads them) lists each committed sample's id, source line, lengths and flags, and each failure recorded with the
shard: enough for resume, progress and the report without reading a shard. From a dataset's markers the ledger
tells which samples are done (`CommittedIndex`) and which lines' final outcome is a failure
(`effective_failures`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from .prompts import id_hash

MARKER_VERSION = 1
COMMITS, SHARDS, ERRORS = "commits", "shards", "errors"

# Per-sample columns copied into the commit marker (everything but the token ids).
MARKER_COLUMNS = ("sample_id", "line", "prompt_tokens", "completion_tokens", "finish_reason", "matched_stop",
                  "reasoning_end", "reasoning_end_token_id", "has_tool_call", "max_new_tokens", "latency_s")
ERROR_COLUMNS = ("line", "sample_id", "reason")


@dataclass
class ShardContent:
    """The rows and error records of one commit."""

    rows: list[dict[str, Any]]
    errors: list[dict[str, Any]]


def build_marker(dataset: str, shard_id: str, worker: int, content: ShardContent,
                 data_bytes: int) -> dict[str, Any]:
    return {
        "version": MARKER_VERSION,
        "dataset": dataset,
        "shard_id": shard_id,
        "worker": worker,
        "committed_at": datetime.now(UTC).isoformat(),
        "data": f"{SHARDS}/{shard_id}.parquet" if content.rows else None,
        "data_bytes": data_bytes,
        "errors": f"{ERRORS}/{shard_id}.jsonl" if content.errors else None,
        "samples": {name: [row.get(name) for row in content.rows] for name in MARKER_COLUMNS},
        "failed": {name: [error[name] for error in content.errors] for name in ERROR_COLUMNS},
    }


# Failures a later attempt can fix (the server misbehaved: repeated errors, corrupt or NaN answers, a release that
# corrupts output_ids); `--retry-failed` runs these lines again.
RETRYABLE_REASONS = frozenset({"retries_exhausted", "bad_response", "nan_output", "output_mismatch"})


def effective_failures(markers: Iterable[dict[str, Any]]) -> dict[int, str]:
    """{source line: reason} of samples whose final outcome is a failure: a later error of the same line replaces
    an earlier one, and a row for the line (a successful retry) clears it."""
    failed: dict[int, str] = {}
    generated: set[int] = set()
    for marker in markers:
        failed.update(zip(marker["failed"]["line"], marker["failed"]["reason"], strict=True))
        generated.update(marker["samples"]["line"])
    return {line: reason for line, reason in failed.items() if line not in generated}


@dataclass
class CommittedIndex:
    """What is already committed for one dataset: ids with a row, and source lines whose last outcome failed."""

    ids: set[int] = field(default_factory=set)
    rows: int = 0
    completion_tokens: int = 0
    failed: dict[int, str] = field(default_factory=dict)  # effective failures: {line: reason}

    def add_markers(self, markers: list[dict[str, Any]]) -> None:
        for marker in markers:
            samples = marker["samples"]
            self.ids.update(id_hash(sample_id) for sample_id in samples["sample_id"])
            self.rows += len(samples["sample_id"])
            self.completion_tokens += sum(samples["completion_tokens"])
        self.failed = effective_failures(markers)

    @property
    def errors(self) -> int:
        return len(self.failed)

    def is_done(self, line: int, sample_id: str | None, retry_failed: bool = False) -> bool:
        if sample_id is not None and id_hash(sample_id) in self.ids:
            return True
        reason = self.failed.get(line)
        return reason is not None and not (retry_failed and reason in RETRYABLE_REASONS)


def committed_index(markers: Iterable[dict[str, Any]]) -> CommittedIndex:
    index = CommittedIndex()
    index.add_markers(list(markers))
    return index
