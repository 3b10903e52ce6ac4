"""The ledger: what a dataset's commit markers say about each unit of work. Pure: no storage here.

A *slot* is one unit of work: (source line, sample index) of a dataset; a dataset with `samples: n` has n slots per
line. The layout follows the largest sample index seen (the spec's n, or a marker of a run with a larger n), so a
reader that does not know n (the report, the operator) still counts every slot once. Exactly once means per slot: every slot ends with exactly one committed final outcome,
a row or an error record, whatever is killed when.

A commit marker (`<dataset>/commits/<time>-<shard_id>.json`, written after the shard's data and errors; `shards.py`
writes and reads them) lists each committed sample's slot, id, lengths and flags, and each failure recorded with
the shard: enough for resume, progress and the report without reading a shard.

`DatasetLedger.fold(marker)` folds markers into a bit per slot (has a row) plus a byte per slot only in the pages
of 4096 slots where failures are (the code of the reason it failed; and, where a `--retry-failed` round failed,
the last round a slot failed in, so the next round draws new seeds), so memory grows by a bit per source line
(1.25 MB at 10 million), never by a Python object per sample. Folding is idempotent and does not depend on the
order of the markers:
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
from weakref import WeakSet

import numpy as np

from .bounds import LEDGER_BYTES, MAX_SLOTS, OverBound

MARKER_VERSION = 2  # 2: samples and failures carry `sample_index` (version 1 markers read as index 0)
COMMITS, SHARDS, ERRORS = "commits", "shards", "errors"
MAX_SAMPLES_PER_PROMPT = 64  # spec.datasets[].samples is at most this; a marker naming a higher index is refused

# Per-sample columns copied into the commit marker (everything but the token ids).
MARKER_COLUMNS = ("sample_id", "line", "sample_index", "prompt_tokens", "completion_tokens", "finish_reason",
                  "matched_stop", "reasoning_end", "reasoning_end_token_id", "has_tool_call", "max_new_tokens",
                  "latency_s", "turn_count", "stop_reason", "last_turn_tokens", "reasoning_turns", "cached_tokens",
                  "sent_prompt_tokens", "reasoning_disagreements")
# Multi-turn rows only (the conversation's turns, why it ended, its last turn's completion tokens, its turns with
# an end-of-reasoning token; the row's completion_tokens is the conversation's total): in a marker only when one of its rows is a conversation.
MULTI_TURN_COLUMNS = ("turn_count", "stop_reason", "last_turn_tokens", "reasoning_turns")
ERROR_COLUMNS = ("line", "sample_index", "sample_id", "reason", "retry_round")
# The `--retry-failed` round a failure happened in (seeds.py): in a marker only when one of its failures was in a
# retry round, so a later round knows which seeds were spent.
RETRY_COLUMNS = ("retry_round",)

# Server-side reasons: a later attempt can fix them (the server was down, overloaded, or answered something
# corrupt). A slot whose final outcome is one of these was *given up*: `tokenmill run` exits 3 while any remain, and
# `--retry-failed` (on a cluster: the retry annotation or spec.runner.retryFailed) runs those slots again. Every
# other reason is caused by the input itself (a bad row, a prompt too long, a 400 for that input): a data-quality
# finding for the report, final for the slot.
RETRYABLE_REASONS = frozenset({
    "retries_exhausted",  # every attempt failed on a server that was up (connection errors, 5xx, aborts)
    "bad_response",  # the server answered without the fields a /generate answer has
    "output_mismatch",  # output_ids disagree with completion_tokens (a server release bug; upgrade, then retry)
    "input_mismatch",  # the server echoed other prompt ids than were sent (a re-encoding proxy; fix it, then retry)
    "outage_timeout",  # the servers stayed unavailable past the outage budget for this sample
    "nan_output",  # SGLang replaced a NaN step with EOS ("NaN happened"), again on every attempt
    "replica_crash",  # the replica died with the request in flight, again and again (a prompt that crashes it)
})


class Slot(NamedTuple):
    line: int  # 1-based source line (JSONL) or row (Parquet)
    # sample index within the prompt (0..samples-1); it shadows tuple.index, which no slot is ever searched with
    index: int = 0  # type: ignore[assignment]


@dataclass(frozen=True)
class Completeness:
    """The slots of one layout (the lines of 1..lines the source yields, sample indices 0..samples-1) and their
    outcomes. Settled means every slot of the layout has a final outcome; outcomes outside it (an earlier, larger
    layout, or lines this worker does not own) are kept and counted apart, never as the layout's."""

    lines: int  # the highest line of the layout
    samples: int
    generated: int  # slots of the layout with a row
    failures: dict[str, int]  # slots of the layout whose final outcome is that failure
    missing_by_index: tuple[int, ...]  # per sample index: lines without an outcome
    outside: int  # outcomes of slots outside the layout
    skipped: int = 0  # lines of 1..lines that are not in the layout (blank lines of a JSONL source)

    @property
    def slots(self) -> int:
        return (self.lines - self.skipped) * self.samples

    @property
    def failed(self) -> int:
        return sum(self.failures.values())

    @property
    def missing(self) -> int:
        return sum(self.missing_by_index)

    @property
    def settled(self) -> bool:
        return self.missing == 0

    def describe_missing(self) -> str:
        """`21 of 40 lines lack sample 0, 19 lack sample 1`, for findings and messages."""
        parts = [f"{count} lack sample {index}" for index, count in enumerate(self.missing_by_index) if count]
        if not parts:
            return "every slot has an outcome"
        return (f"{self.missing} of {self.slots} slots have no outcome ({self.lines - self.skipped} lines: "
                + ", ".join(parts) + ")")


@dataclass
class ShardContent:
    """The rows and error records of one commit."""

    rows: list[dict[str, Any]]
    errors: list[dict[str, Any]]


def build_marker(dataset: str, shard_id: str, worker: int, content: ShardContent,
                 data_bytes: int, committed_at: datetime | None = None) -> dict[str, Any]:
    return {
        "version": MARKER_VERSION,
        "dataset": dataset,
        "shard_id": shard_id,
        "worker": worker,
        "committed_at": (committed_at or datetime.now(UTC)).isoformat(),
        "data": f"{SHARDS}/{shard_id}.parquet" if content.rows else None,
        "data_bytes": data_bytes,
        "errors": f"{ERRORS}/{shard_id}.jsonl" if content.errors else None,
        "samples": {name: [row.get(name, 0 if name == "sample_index" else None) for row in content.rows]
                    for name in MARKER_COLUMNS
                    if name not in MULTI_TURN_COLUMNS or any(row.get(name) is not None for row in content.rows)},
        "failed": {name: [error.get(name, 0 if name in ("sample_index", *RETRY_COLUMNS) else None)
                          for error in content.errors]
                   for name in ERROR_COLUMNS
                   if name not in RETRY_COLUMNS or any(error.get(name) for error in content.errors)},
    }


class MarkerError(ValueError):
    """A commit marker that cannot be folded; the message names the shard and the field."""


_EMPTY, _ROW = 0, 1  # outcome codes; failure reasons take 2..255 in the order a ledger first meets them
_MAX_REASONS = 254
_POPCOUNT = np.array([bin(byte).count("1") for byte in range(256)], dtype=np.uint8)
PAGE_BITS = 12  # failure codes live in pages of 4096 slots, allocated only where a failure is
_PAGE_BYTES = 1 << PAGE_BITS
# Slots unpacked at once by the questions over every slot (completeness, widening): a few hundred KiB whatever the
# layout's size, never a byte per slot of the whole layout. (At 1 << 20 a chunk's grids and their copies took ~8 MiB
# more at 10M slots than at 200k, where the layout is one small chunk: the report's peak followed the job's size.)
_CHUNK_SLOTS = 1 << 16


class LedgerBudget:
    """The bytes the ledgers of one run may hold together (the row bits and the failure pages), checked before each
    allocation: whoever writes the output's markers and run.json sets how much a reader allocates only up to this
    (`bounds.LEDGER_BYTES`). A reader following several datasets of one output (the operator, the report) hands
    them one budget; a ledger dropped stops counting (a weak set, so nothing has to give bytes back)."""

    def __init__(self, max_bytes: int = LEDGER_BYTES) -> None:
        self.max_bytes = max_bytes
        self._ledgers: WeakSet[DatasetLedger] = WeakSet()

    def join(self, ledger: DatasetLedger) -> None:
        self._ledgers.add(ledger)

    @property
    def held(self) -> int:
        return sum(ledger.nbytes for ledger in list(self._ledgers))

    def admit(self, more: int, what: str) -> None:
        if more > 0 and self.held + more > self.max_bytes:
            raise OverBound(f"{what} needs {more} bytes more than the {self.held} the run's ledgers hold, past the "
                            f"{self.max_bytes} bytes a reader gives one run's ledgers: its markers or run.json name "
                            "more slots or failures spread thinner than any run tokenmill writes; write a job this "
                            "large as several runs, or the output was not written by tokenmill")


class DatasetLedger:
    """One dataset's committed outcomes: a bit per slot for "has a row", and the failure reason's code (a byte) only
    in pages of slots where failures are. Build it with the dataset's row count when known (it grows when a marker
    names a line beyond it, e.g. a JSONL source with blank lines), then `fold` markers."""

    def __init__(self, name: str = "", rows: int = 0, samples_per_prompt: int = 1,
                 budget: LedgerBudget | None = None) -> None:
        if not 1 <= samples_per_prompt <= MAX_SAMPLES_PER_PROMPT:
            raise ValueError(f"samples_per_prompt must be 1..{MAX_SAMPLES_PER_PROMPT}, got {samples_per_prompt}")
        self.name = name
        self.samples_per_prompt = samples_per_prompt
        self.budget = budget or LedgerBudget()
        self._size = 0  # slots the bitmap covers
        self._rows = np.zeros(0, dtype=np.uint8)  # bit i: slot i has a row
        self._pages: dict[int, np.ndarray] = {}  # page -> failure code per slot (0: none), see PAGE_BITS
        # page -> the last --retry-failed round a slot failed in (0: none), only where a retry round failed
        self._rounds: dict[int, np.ndarray] = {}
        self._failures = np.zeros(256, dtype=np.int64)  # slots whose final outcome is each failure code
        self._reasons: list[str] = ["", ""]  # code -> reason; codes 0 and 1 are "nothing" and "row"
        self._codes: dict[str, int] = {}
        self._retryable = np.zeros(256, dtype=bool)
        self.completed = 0  # slots with a row
        self.completion_tokens = 0
        self.truncated = 0  # rows that stopped at max_new_tokens (finish_reason "length")
        self.budget.join(self)
        self._grow(max(rows, 0) * samples_per_prompt, exact=True)

    # -- folding -------------------------------------------------------------------------------------------
    def fold(self, marker: dict[str, Any]) -> np.ndarray:
        """Fold one commit marker in (version 1 or 2). Idempotent: folding a marker again changes nothing.
        Returns the positions, in the marker's `samples`, of the rows that counted (the first row of each slot that
        had none): what a reader that aggregates per row (the report) adds, so it counts each slot once too."""
        samples, failed = marker.get("samples"), marker.get("failed")
        if not isinstance(samples, dict) or not isinstance(failed, dict):
            raise MarkerError(f"{self._where(marker)}: no 'samples'/'failed' tables")
        taken = self._fold_rows(marker, samples)
        self._fold_failures(marker, failed)
        return taken

    def fold_all(self, markers: Iterable[dict[str, Any]]) -> DatasetLedger:
        for marker in markers:
            self.fold(marker)
        return self

    def _fold_rows(self, marker: dict[str, Any], samples: dict[str, list[Any]]) -> np.ndarray:
        lines = samples.get("line") or []
        if not lines:
            return np.empty(0, dtype=np.int64)
        positions = self._positions(marker, "samples", lines, samples.get("sample_index"))
        unique, first = np.unique(positions, return_index=True)
        new = ~self._has_row(unique)
        if not new.any():
            return np.empty(0, dtype=np.int64)
        taken = np.sort(first[new])
        tokens = np.asarray(samples.get("completion_tokens") or [0] * len(lines), dtype=np.int64)
        finish = samples.get("finish_reason") or [None] * len(lines)
        self.completed += int(new.sum())
        self.completion_tokens += int(tokens[taken].sum())
        self.truncated += sum(1 for i in taken.tolist() if finish[i] == "length")
        fresh = unique[new]
        np.bitwise_or.at(self._rows, fresh >> 3, (1 << (fresh & 7)).astype(np.uint8))
        if self._pages:
            self._clear_failures(fresh)
        return taken

    def _clear_failures(self, positions: np.ndarray) -> None:
        """A row clears an earlier failure of its slot (a retry that succeeded)."""
        for page in np.unique(positions >> PAGE_BITS).tolist():
            codes = self._pages.get(page)
            if codes is None:
                continue
            offsets = positions[(positions >> PAGE_BITS) == page] & ((1 << PAGE_BITS) - 1)
            cleared = codes[offsets]
            np.subtract.at(self._failures, cleared[cleared > _ROW], 1)
            codes[offsets] = _EMPTY

    def _fold_failures(self, marker: dict[str, Any], failed: dict[str, list[Any]]) -> None:
        lines = failed.get("line") or []
        if not lines:
            return
        positions = self._positions(marker, "failed", lines, failed.get("sample_index"))
        reasons = failed.get("reason") or []
        if len(reasons) != len(lines):
            raise MarkerError(f"{self._where(marker)}: failed.reason has {len(reasons)} entries for {len(lines)} lines")
        has_row = self._has_row(positions).tolist()
        rounds = failed.get("retry_round") or [0] * len(lines)
        if len(rounds) != len(lines):
            raise MarkerError(f"{self._where(marker)}: failed.retry_round has {len(rounds)} entries for {len(lines)} "
                              "lines")
        for position, reason, row, retry_round in zip(positions.tolist(), reasons, has_row, rounds, strict=True):
            code = self._code(str(reason))
            if row:
                continue
            self._note_round(position, int(retry_round or 0))
            page = self._page(self._pages, position, "failures")
            offset = position & ((1 << PAGE_BITS) - 1)
            current = int(page[offset])
            if current > _ROW and not self._retryable[current] and self._retryable[code]:
                continue
            if current > _ROW:
                self._failures[current] -= 1
            page[offset] = code
            self._failures[code] += 1

    def _note_round(self, position: int, retry_round: int) -> None:
        """Keep the highest retry round the slot failed in (idempotent and order-free, as folding must be)."""
        if retry_round <= 0:
            return
        page = self._page(self._rounds, position, "retry rounds")
        offset = position & ((1 << PAGE_BITS) - 1)
        page[offset] = max(int(page[offset]), min(retry_round, 255))

    def _page(self, pages: dict[int, np.ndarray], position: int, what: str) -> np.ndarray:
        """The page of `pages` holding `position`, allocated (within the budget) when it is the page's first."""
        page = pages.get(position >> PAGE_BITS)
        if page is None:
            self.budget.admit(_PAGE_BYTES, f"{self.name}: a page of {what}")
            page = pages[position >> PAGE_BITS] = np.zeros(_PAGE_BYTES, dtype=np.uint8)
        return page

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
        if line.min() < 1 or index.min() < 0 or index.max() >= MAX_SAMPLES_PER_PROMPT:
            raise MarkerError(f"{self._where(marker)}: {table} names a line below 1 or a sample index outside "
                              f"0..{MAX_SAMPLES_PER_PROMPT - 1}")
        # Checked before anything is sized from it: one 140-byte marker naming line 3*10^8 took a reader to 659 MB.
        width = max(self.samples_per_prompt, int(index.max()) + 1)
        if int(line.max()) > MAX_SLOTS // width:
            raise OverBound(f"{self._where(marker)}: {table} names line {int(line.max())}, past the "
                            f"{MAX_SLOTS // width} lines of {width} samples a dataset may have ({MAX_SLOTS} slots); "
                            "tokenmill never wrote it: remove the marker, or write a job this large as several runs")
        if index.max() >= self.samples_per_prompt:
            self.widen(int(index.max()) + 1)
        positions = (line - 1) * self.samples_per_prompt + index
        self._grow(int(positions.max()) + 1)
        return positions

    def widen(self, samples_per_prompt: int) -> None:
        """Lay the slots out for more samples per prompt: a dataset's `samples` was raised, or a marker of an earlier
        run with more samples is folded (its extra samples stay counted). Never narrows: committed slots are kept."""
        old = self.samples_per_prompt
        if samples_per_prompt <= old:
            return
        if samples_per_prompt > MAX_SAMPLES_PER_PROMPT:
            raise ValueError(f"{self.name}: at most {MAX_SAMPLES_PER_PROMPT} samples per prompt, not "
                             f"{samples_per_prompt}")
        prompts = -(-self._size // old)
        self._check_slots(prompts * samples_per_prompt, f"{samples_per_prompt} samples of {prompts} lines")
        size = prompts * samples_per_prompt
        self.budget.admit(-(-size // 8) - self._rows.nbytes, f"{self.name}: {samples_per_prompt} samples per line")
        wide = np.zeros(-(-size // 8), dtype=np.uint8)
        step = _chunk_lines(samples_per_prompt)
        for first in range(0, prompts, step):  # a chunk of lines at a time: never a byte per slot of the whole
            stop = min(prompts, first + step)
            grid = np.zeros((stop - first, samples_per_prompt), dtype=bool)
            grid[:, :old] = self._row_grid(first, stop)
            packed = np.packbits(grid.reshape(-1), bitorder="little")
            at = first * samples_per_prompt // 8  # `step` is a multiple of 8: chunks start on a byte
            wide[at:at + packed.size] |= packed
        def moved(pages: dict[int, np.ndarray]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
            for page in sorted(pages):  # page by page: never an array of every failure at once
                offsets = np.flatnonzero(pages[page])
                positions = (page << PAGE_BITS) + offsets
                yield (positions // old) * samples_per_prompt + positions % old, pages[page][offsets]

        targets = sum(len({int(p) for positions, _ in moved(pages) for p in np.unique(positions >> PAGE_BITS)})
                      for pages in (self._pages, self._rounds))
        self.budget.admit(_PAGE_BYTES * (targets - len(self._pages) - len(self._rounds)),
                          f"{self.name}: the failures laid out for {samples_per_prompt} samples per line")
        relaid: list[dict[int, np.ndarray]] = [{}, {}]
        for pages, into in zip((self._pages, self._rounds), relaid, strict=True):
            for positions, values in moved(pages):
                for position, value in zip(positions.tolist(), values.tolist(), strict=True):
                    target = into.get(position >> PAGE_BITS)
                    if target is None:
                        target = into[position >> PAGE_BITS] = np.zeros(_PAGE_BYTES, dtype=np.uint8)
                    target[position & (_PAGE_BYTES - 1)] = value
        self.samples_per_prompt, self._size, self._rows = samples_per_prompt, size, wide
        self._pages, self._rounds = relaid

    def reserve(self, slots: int) -> None:
        """Make room for `slots` slots up front (a source's row count), so folding does not grow the bitmap."""
        self._grow(slots, exact=True)

    def _check_slots(self, slots: int, what: str) -> None:
        if slots > MAX_SLOTS:
            raise OverBound(f"{self.name}: {what} are {slots} slots, over the {MAX_SLOTS} a dataset may have (a bit "
                            "each in every reader's ledger); write a job this large as several runs")

    def _grow(self, size: int, exact: bool = False) -> None:
        if size > self._size:
            self._check_slots(size, "the slots named")
            size = size if exact else min(max(size, 2 * self._size), MAX_SLOTS)
            self.budget.admit(-(-size // 8) - self._rows.nbytes, f"{self.name}: a row bitmap of {size} slots")
            grown = np.zeros(-(-size // 8), dtype=np.uint8)
            grown[:self._rows.size] = self._rows
            self._size, self._rows = size, grown

    def _row_grid(self, first: int, stop: int) -> np.ndarray:
        """Whether each slot of lines first+1..stop has a row: a (stop - first, samples_per_prompt) bool grid,
        False past what the bitmap covers."""
        width = self.samples_per_prompt
        start, end = first * width, stop * width
        rows = np.zeros(end - start, dtype=bool)
        have = min(end, self._size)
        if have > start:
            low = start >> 3
            bits = np.unpackbits(self._rows[low:-(-have // 8)], bitorder="little")
            rows[:have - start] = bits[start - (low << 3):have - (low << 3)].astype(bool)
        return rows.reshape(stop - first, width)

    def _code_grid(self, first: int, stop: int) -> np.ndarray:
        """The failure code of each slot of lines first+1..stop (0: none), a (stop - first, samples_per_prompt)
        grid filled from the pages that overlap it."""
        width = self.samples_per_prompt
        start, end = first * width, stop * width
        codes = np.zeros(end - start, dtype=np.uint8)
        if self._pages and end > start:
            for page in range(start >> PAGE_BITS, ((end - 1) >> PAGE_BITS) + 1):
                values = self._pages.get(page)
                if values is None:
                    continue
                base = page << PAGE_BITS
                low, high = max(start, base), min(end, base + _PAGE_BYTES)
                codes[low - start:high - start] = values[low - base:high - base]
        return codes.reshape(stop - first, width)

    def _has_row(self, positions: np.ndarray) -> np.ndarray:
        inside = positions < self._size
        bits = np.zeros(positions.shape, dtype=bool)
        at = positions[inside]
        bits[inside] = ((self._rows[at >> 3] >> (at & 7).astype(np.uint8)) & 1).astype(bool)
        return bits

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
        if slot.index >= self.samples_per_prompt:
            return _EMPTY  # no marker named a sample this far: nothing committed for it
        position = (slot.line - 1) * self.samples_per_prompt + slot.index
        if not 0 <= position < self._size:
            return _EMPTY
        if (self._rows[position >> 3] >> (position & 7)) & 1:
            return _ROW
        page = self._pages.get(position >> PAGE_BITS)
        return _EMPTY if page is None else int(page[position & ((1 << PAGE_BITS) - 1)])

    def has_rows(self, line: int, samples: int) -> bool:
        """Whether sample indices 0..samples-1 of the line all have a row: the common settled line, answered from
        the bitmap alone (a resume asks it for every line it skips)."""
        if samples > self.samples_per_prompt:
            return False
        start = (line - 1) * self.samples_per_prompt
        if start < 0 or start + samples > self._size:
            return False
        rows = self._rows
        return all((rows[position >> 3] >> (position & 7)) & 1 for position in range(start, start + samples))

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

    def retry_round(self, slot: Slot) -> int:
        """The last `--retry-failed` round the slot failed in (0: it failed only in the run that first tried it)."""
        if slot.index >= self.samples_per_prompt:
            return 0
        position = (slot.line - 1) * self.samples_per_prompt + slot.index
        page = self._rounds.get(position >> PAGE_BITS)
        return 0 if page is None or position < 0 else int(page[position & ((1 << PAGE_BITS) - 1)])

    def final_failures(self) -> dict[str, int]:
        """{reason: slots whose final outcome is that failure}, by reason name."""
        return dict(sorted((self._reasons[code], int(self._failures[code])) for code in range(2, len(self._reasons))
                           if self._failures[code]))

    def given_up(self) -> dict[str, int]:
        """The final failures with a server-side (retryable) reason."""
        return {reason: n for reason, n in self.final_failures().items() if reason in RETRYABLE_REASONS}

    @property
    def failed(self) -> int:
        return int(self._failures[2:].sum())

    @property
    def settled(self) -> int:
        """Slots with a final outcome (a row or a failure)."""
        return self.completed + self.failed

    def failed_slots(self) -> Iterator[tuple[Slot, str]]:
        """(slot, reason) of every slot whose final outcome is a failure, in slot order."""
        for page in sorted(self._pages):
            codes = self._pages[page]
            for offset in np.flatnonzero(codes > _ROW).tolist():
                line, index = divmod((page << PAGE_BITS) + offset, self.samples_per_prompt)
                yield Slot(line + 1, index), self._reasons[int(codes[offset])]

    def _failure_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(slot positions, failure codes) of every final failure, in slot order."""
        return _paged_values(self._pages, above=_ROW)

    def rows_beyond(self, samples: int) -> int:
        """Rows of sample indices `samples` and up: what a run with more samples per prompt committed."""
        if samples >= self.samples_per_prompt:
            return 0
        prompts, step = -(-self._size // self.samples_per_prompt), _chunk_lines(self.samples_per_prompt)
        return sum(int(self._row_grid(first, min(prompts, first + step))[:, samples:].sum(dtype=np.int64))
                   for first in range(0, prompts, step))

    def completeness(self, lines: int, samples: int, within: np.ndarray | None = None) -> Completeness:
        """Which slots of the layout have a final outcome: what "settled" means for a run, for the report, the
        operator and `tokenmill run` alike. The layout is the lines of 1..`lines` that `within` keeps, x sample
        indices 0..`samples`-1: a JSONL source's blank lines yield no row, so they are no slot
        (`manifest.DatasetLayout.within_bits`); a worker's layout is the lines it owns. `within` is a bool per line,
        or (dtype uint8) a bit per line, little-endian, line 1 first (the padding of its last byte is part of it:
        `manifest.decode_bits`); lines past its end are kept; None keeps every line. Counted a chunk of lines at a time, from the bits: memory does not follow `lines`."""
        lines = max(lines, 0)
        held = min(lines, -(-self._size // self.samples_per_prompt))  # lines the ledger knows anything of
        shared = min(samples, self.samples_per_prompt)  # sample indices that can have an outcome
        settled = np.zeros(samples, dtype=np.int64)
        codes_inside = np.zeros(256, dtype=np.int64)
        generated, kept = 0, (lines if within is None else 0)
        step = _chunk_lines(self.samples_per_prompt)
        for first in range(0, lines if within is not None else held, step):
            stop = min(lines, first + step)
            keep = _keep(within, first, stop)
            if within is not None:
                kept += int(keep.sum(dtype=np.int64))
            if first >= held:
                continue
            known = min(stop, held) - first
            rows = self._row_grid(first, first + known)[keep[:known], :shared]
            codes = self._code_grid(first, first + known)[keep[:known], :shared]
            generated += int(rows.sum(dtype=np.int64))
            settled[:shared] += (rows | (codes > _ROW)).sum(axis=0, dtype=np.int64)
            codes_inside += np.bincount(codes[codes > _ROW], minlength=256)
        failures = {self._reasons[code]: int(count) for code, count in enumerate(codes_inside.tolist()) if count}
        missing = tuple(int(kept - settled[i]) for i in range(samples))
        outside = self.completed - generated + self.failed - int(codes_inside.sum())
        return Completeness(lines, samples, generated, dict(sorted(failures.items())), missing, outside,
                            lines - kept)

    @property
    def nbytes(self) -> int:
        """Memory held by the per-slot state (the bitmap and the failure pages): what the budget counts."""
        return self._rows.nbytes + _PAGE_BYTES * (len(self._pages) + len(self._rounds))

    # -- checkpoints ---------------------------------------------------------------------------------------
    def state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """Everything the ledger knows, as a JSON-able header and arrays (`checkpoints.py` writes them)."""
        positions, codes = self._failure_arrays()
        header = {"name": self.name, "samples_per_prompt": self.samples_per_prompt, "slots": self._size,
                  "reasons": self._reasons[2:], "completed": self.completed,
                  "completion_tokens": self.completion_tokens, "truncated": self.truncated}
        round_positions, rounds = _paged_values(self._rounds)
        return header, {"rows": self._rows[:-(-self._size // 8)], "failed_positions": positions, "failed_codes": codes,
                        "round_positions": round_positions, "rounds": rounds}

    @classmethod
    def from_state(cls, header: dict[str, Any], arrays: dict[str, np.ndarray],
                   budget: LedgerBudget | None = None) -> DatasetLedger:
        """The ledger `state` described; raises ValueError when the parts disagree (OverBound past the bounds)."""
        ledger = cls(str(header["name"]), 0, int(header["samples_per_prompt"]), budget)
        size = int(header["slots"])
        rows = arrays["rows"]
        if rows.dtype != np.uint8 or rows.size != -(-size // 8):
            raise ValueError(f"row bitmap of {rows.size} bytes for {size} slots")
        ledger._grow(size, exact=True)
        ledger._rows[:] = rows
        for reason in header["reasons"]:
            ledger._code(str(reason))
        positions, codes = arrays["failed_positions"], arrays["failed_codes"]
        if positions.shape != codes.shape or (codes.size and (codes.min() < 2 or codes.max() >= len(ledger._reasons))):
            raise ValueError("failure positions and codes disagree")
        if positions.size and (positions.min() < 0 or positions.max() >= size or ledger._has_row(positions).any()):
            raise ValueError("a failure names a slot outside the ledger or one with a row")
        for position, code in zip(positions.tolist(), codes.tolist(), strict=True):
            ledger._page(ledger._pages, position, "failures")[position & (_PAGE_BYTES - 1)] = code
        np.add.at(ledger._failures, codes.astype(np.int64), 1)
        # Checkpoints written before retry rounds were recorded have none: every slot then failed in round 0.
        empty = np.empty(0, np.int64)
        round_positions = arrays.get("round_positions", empty)
        if round_positions.size and (round_positions.min() < 0 or round_positions.max() >= size):
            raise ValueError("a retry round names a slot outside the ledger")
        for position, retry_round in zip(round_positions.tolist(),
                                         arrays.get("rounds", empty).tolist(), strict=True):
            ledger._note_round(int(position), int(retry_round))
        ledger.completed = int(header["completed"])
        ledger.completion_tokens = int(header["completion_tokens"])
        ledger.truncated = int(header["truncated"])
        if ledger.completed != int(_POPCOUNT[ledger._rows].sum(dtype=np.int64)):
            raise ValueError(f"{ledger.completed} rows counted but the bitmap has another number")
        return ledger


def _chunk_lines(width: int) -> int:
    """Lines per chunk of the questions over every slot: about _CHUNK_SLOTS slots, a multiple of 8 lines (a chunk
    of a bit-per-line mask starts on a byte)."""
    return max(8, _CHUNK_SLOTS // width // 8 * 8)


def _keep(within: np.ndarray | None, first: int, stop: int) -> np.ndarray:
    """Whether each line of first+1..stop is in the layout (`DatasetLedger.completeness`'s `within`)."""
    keep = np.ones(stop - first, dtype=bool)
    if within is None:
        return keep
    if within.dtype == np.uint8:
        bits = np.unpackbits(within[first >> 3:-(-stop // 8)], bitorder="little").astype(bool)
        part = bits[(first & 7):(first & 7) + stop - first]
    else:
        part = within[first:stop]
    keep[:part.size] = part
    return keep


def _paged_values(pages: dict[int, np.ndarray], above: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(slot positions, values) of every value over `above` in a map of pages, in slot order."""
    positions, values = [np.empty(0, np.int64)], [np.empty(0, np.uint8)]
    for page in sorted(pages):
        offsets = np.flatnonzero(pages[page] > above)
        positions.append((page << PAGE_BITS) + offsets)
        values.append(pages[page][offsets])
    return np.concatenate(positions).astype(np.int64), np.concatenate(values)


def effective_failures(markers: Iterable[dict[str, Any]]) -> dict[Slot, str]:
    """{slot: reason} of the slots whose final outcome is a failure (see `DatasetLedger` for the rules)."""
    return dict(DatasetLedger().fold_all(markers).failed_slots())
