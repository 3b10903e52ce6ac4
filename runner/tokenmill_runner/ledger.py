"""The ledger: what a dataset's commit markers say about each unit of work. Pure: no storage here.

A *slot* is one unit of work: (source line, sample index) of a dataset; the index is 0 until a dataset asks for
several samples per prompt. Exactly once means per slot: every slot ends with exactly one committed final outcome,
a row or an error record, whatever is killed when.

A commit marker (`<dataset>/commits/<shard_id>.json`, written after the shard's data and errors; `shards.py`
writes and reads them) lists each committed sample's slot, id, lengths and flags, and each failure recorded with
the shard: enough for resume, progress and the report without reading a shard.

`DatasetLedger.fold(marker)` folds markers into one byte per slot (nothing, a row, or the code of the reason it
failed), so memory grows by a byte per source line, never by a Python object per sample. Folding is idempotent
and does not depend on the order of the markers:
- a row wins over any failure of its slot (a retried slot that then succeeded), and a slot counts once however
  many markers name it (the first row's tokens count);
- a failure never replaces a row; between two failures of one slot, one not retryable wins (nothing runs a slot
  again after such a failure, so it came last); otherwise the one folded last does (both are retryable then, and
  the slot is given up either way).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, NamedTuple

import numpy as np

MARKER_VERSION = 2  # 2: samples and failures carry `sample_index` (version 1 markers read as index 0)
COMMITS, SHARDS, ERRORS = "commits", "shards", "errors"

# Per-sample columns copied into the commit marker (everything but the token ids).
MARKER_COLUMNS = ("sample_id", "line", "sample_index", "prompt_tokens", "completion_tokens", "finish_reason",
                  "matched_stop", "reasoning_end", "reasoning_end_token_id", "has_tool_call", "max_new_tokens",
                  "latency_s")
ERROR_COLUMNS = ("line", "sample_index", "sample_id", "reason")

# Server-side reasons: a later attempt can fix them (the server was down, overloaded, or answered something
# corrupt). A slot whose final outcome is one of these was *given up*: `tokenmill run` exits 3 while any remain, and
# `--retry-failed` (on a cluster: the retry annotation or spec.runner.retryFailed) runs those slots again. Every
# other reason is caused by the input itself (a bad row, a prompt too long, a 400 for that input): a data-quality
# finding for the report, final for the slot.
RETRYABLE_REASONS = frozenset({
    "retries_exhausted",  # every attempt failed on a server that was up (connection errors, 5xx, aborts)
    "bad_response",  # the server answered without the fields a /generate answer has
    "output_mismatch",  # output_ids disagree with completion_tokens (a server release bug; upgrade, then retry)
    "outage_timeout",  # the servers stayed unavailable past the outage budget for this sample
    "nan_output",  # SGLang replaced a NaN step with EOS ("NaN happened"), again on every attempt
})


class Slot(NamedTuple):
    line: int  # 1-based source line (JSONL) or row (Parquet)
    index: int = 0  # sample index within the prompt (0 until several samples per prompt exist)


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
        "samples": {name: [row.get(name, 0 if name == "sample_index" else None) for row in content.rows]
                    for name in MARKER_COLUMNS},
        "failed": {name: [error.get(name, 0 if name == "sample_index" else None) for error in content.errors]
                   for name in ERROR_COLUMNS},
    }


class MarkerError(ValueError):
    """A commit marker that cannot be folded; the message names the shard and the field."""


_EMPTY, _ROW = 0, 1  # outcome codes; failure reasons take 2..255 in the order a ledger first meets them
_MAX_REASONS = 254


class DatasetLedger:
    """One dataset's committed outcomes, one byte per slot. Build it with the dataset's row count when known (it
    grows when a marker names a line beyond it, e.g. a JSONL source with blank lines), then `fold` markers."""

    def __init__(self, name: str = "", rows: int = 0, samples_per_prompt: int = 1) -> None:
        if samples_per_prompt < 1:
            raise ValueError(f"samples_per_prompt must be at least 1, got {samples_per_prompt}")
        self.name = name
        self.samples_per_prompt = samples_per_prompt
        self._outcome = np.zeros(max(rows, 0) * samples_per_prompt, dtype=np.uint8)
        self._reasons: list[str] = ["", ""]  # code -> reason; codes 0 and 1 are "nothing" and "row"
        self._codes: dict[str, int] = {}
        self._retryable = np.zeros(256, dtype=bool)
        self._by_code: np.ndarray | None = None  # cached counts per outcome code; None after a change
        self.completed = 0  # slots with a row
        self.completion_tokens = 0
        self.truncated = 0  # rows that stopped at max_new_tokens (finish_reason "length")

    # -- folding -------------------------------------------------------------------------------------------
    def fold(self, marker: dict[str, Any]) -> None:
        """Fold one commit marker in (version 1 or 2). Idempotent: folding a marker again changes nothing."""
        samples, failed = marker.get("samples"), marker.get("failed")
        if not isinstance(samples, dict) or not isinstance(failed, dict):
            raise MarkerError(f"{self._where(marker)}: no 'samples'/'failed' tables")
        self._fold_rows(marker, samples)
        self._fold_failures(marker, failed)

    def fold_all(self, markers: Iterable[dict[str, Any]]) -> DatasetLedger:
        for marker in markers:
            self.fold(marker)
        return self

    def _fold_rows(self, marker: dict[str, Any], samples: dict[str, list[Any]]) -> None:
        lines = samples.get("line") or []
        if not lines:
            return
        positions = self._positions(marker, "samples", lines, samples.get("sample_index"))
        unique, first = np.unique(positions, return_index=True)
        new = self._outcome[unique] != _ROW
        if not new.any():
            return
        taken = first[new]
        tokens = np.asarray(samples.get("completion_tokens") or [0] * len(lines), dtype=np.int64)
        finish = samples.get("finish_reason") or [None] * len(lines)
        self.completed += int(new.sum())
        self.completion_tokens += int(tokens[taken].sum())
        self.truncated += sum(1 for i in taken.tolist() if finish[i] == "length")
        self._outcome[unique[new]] = _ROW
        self._by_code = None

    def _fold_failures(self, marker: dict[str, Any], failed: dict[str, list[Any]]) -> None:
        lines = failed.get("line") or []
        if not lines:
            return
        positions = self._positions(marker, "failed", lines, failed.get("sample_index"))
        reasons = failed.get("reason") or []
        if len(reasons) != len(lines):
            raise MarkerError(f"{self._where(marker)}: failed.reason has {len(reasons)} entries for {len(lines)} lines")
        for position, reason in zip(positions.tolist(), reasons, strict=True):
            code = self._code(str(reason))
            current = int(self._outcome[position])
            if current == _ROW or (current > _ROW and not self._retryable[current] and self._retryable[code]):
                continue
            self._outcome[position] = code
        self._by_code = None

    def _positions(self, marker: dict[str, Any], table: str, lines: Sequence[Any],
                   indices: Sequence[Any] | None) -> np.ndarray:
        try:
            line = np.asarray(lines, dtype=np.int64)
            index = np.zeros_like(line) if indices is None else np.asarray(indices, dtype=np.int64)
        except (TypeError, ValueError) as error:
            raise MarkerError(f"{self._where(marker)}: {table}.line/sample_index are not integers ({error})") from None
        if index.shape != line.shape:
            raise MarkerError(f"{self._where(marker)}: {table}.sample_index has {index.size} entries for "
                              f"{line.size} lines")
        if line.min() < 1 or index.min() < 0 or index.max() >= self.samples_per_prompt:
            raise MarkerError(f"{self._where(marker)}: {table} names a line below 1 or a sample index outside "
                              f"0..{self.samples_per_prompt - 1}")
        positions = (line - 1) * self.samples_per_prompt + index
        self._grow(int(positions.max()) + 1)
        return positions

    def _grow(self, size: int) -> None:
        if size > self._outcome.size:
            grown = np.zeros(max(size, 2 * self._outcome.size), dtype=np.uint8)
            grown[:self._outcome.size] = self._outcome
            self._outcome = grown

    def _code(self, reason: str) -> int:
        code = self._codes.get(reason)
        if code is None:
            if len(self._codes) >= _MAX_REASONS:
                raise MarkerError(f"{self.name}: more than {_MAX_REASONS} distinct failure reasons")
            code = len(self._reasons)
            self._reasons.append(reason)
            self._codes[reason] = code
            self._retryable[code] = reason in RETRYABLE_REASONS
        return code

    def _where(self, marker: dict[str, Any]) -> str:
        return f"commit marker {self.name}/{COMMITS}/{marker.get('shard_id', '?')}.json"

    # -- questions -----------------------------------------------------------------------------------------
    def _slot_code(self, slot: Slot) -> int:
        position = (slot.line - 1) * self.samples_per_prompt + slot.index
        return int(self._outcome[position]) if 0 <= position < self._outcome.size else _EMPTY

    def outcome(self, slot: Slot) -> str | None:
        """"row", the reason of the slot's final failure, or None when nothing is committed for it."""
        code = self._slot_code(slot)
        return None if code == _EMPTY else "row" if code == _ROW else self._reasons[code]

    def is_done(self, slot: Slot, retry_failed: bool = False) -> bool:
        """Whether a run skips the slot: it has a row, or a final failure (a retryable one unless retrying)."""
        code = self._slot_code(slot)
        return code == _ROW or (code > _ROW and not (retry_failed and self._retryable[code]))

    def is_given_up(self, slot: Slot) -> bool:
        code = self._slot_code(slot)
        return code > _ROW and bool(self._retryable[code])

    def _counts(self) -> np.ndarray:
        if self._by_code is None:
            self._by_code = np.bincount(self._outcome, minlength=256)
        return self._by_code

    def final_failures(self) -> dict[str, int]:
        """{reason: slots whose final outcome is that failure}, by reason name."""
        counts = self._counts()
        return dict(sorted((self._reasons[code], int(counts[code])) for code in range(2, len(self._reasons))
                           if counts[code]))

    def given_up(self) -> dict[str, int]:
        """The final failures with a server-side (retryable) reason."""
        return {reason: n for reason, n in self.final_failures().items() if reason in RETRYABLE_REASONS}

    @property
    def failed(self) -> int:
        return int(self._counts()[2:].sum())

    @property
    def settled(self) -> int:
        """Slots with a final outcome (a row or a failure)."""
        return self.completed + self.failed

    def failed_slots(self) -> Iterator[tuple[Slot, str]]:
        """(slot, reason) of every slot whose final outcome is a failure, in slot order."""
        for position in np.flatnonzero(self._outcome > _ROW).tolist():
            line, index = divmod(position, self.samples_per_prompt)
            yield Slot(line + 1, index), self._reasons[int(self._outcome[position])]


def effective_failures(markers: Iterable[dict[str, Any]]) -> dict[Slot, str]:
    """{slot: reason} of the slots whose final outcome is a failure (see `DatasetLedger` for the rules)."""
    return dict(DatasetLedger().fold_all(markers).failed_slots())
