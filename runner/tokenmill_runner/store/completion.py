"""One definition of done: what a run (or one worker's share of it) still lacks. Pure.

A run is *complete* when every slot of the current layout has a final outcome (the ledger's `completeness`) and every
artifact the spec asks for is present: for each kind of hidden states its layouts need (facts/hidden_states
.kinds_needed), one committed state file per committed sample, as long as the sample's tokens. Everything that says
whether a run is done asks `Completion`, built by whoever reads the facts (the runner for its own share after its
passes, the report and the operator for the whole output):

- `tokenmill run`'s exit code (generate/summary.exit_code), for the worker's share: a worker whose share is done
  exits 0 while others still work; it never judges the others' shares.
- the report's verdict (report/files.py: its hidden-state findings and `completion` in report.json);
- the operator's move to the next hidden-state pass, its `Succeeded`, and what its retry annotation runs again.

The verdict has three values, each with one remedy:
- `pending`: slots without an outcome, or committed samples without states and without a recorded failure: a plain
  rerun (a restarted pod, the next pass) does them.
- `given_up`: nothing is pending, but slots were given up for a server-side reason, or captures failed (recorded:
  what no retry fixed), or a state file is misaligned with its row: `--retry-failed` (the retry annotation) runs the
  retryable ones again.
- `complete`: everything is there.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import numpy as np

Verdict = Literal["pending", "given_up", "complete"]
EXAMPLES = 3  # misaligned samples named in a message


@dataclass(frozen=True)
class StateCoverage:
    """One kind of hidden states over the committed samples of a scope (a dataset, a worker's share, a run)."""

    kind: str
    samples: int  # committed samples that need these states
    captured: int  # with a state file as long as their tokens (or not read: its marker is listed)
    failed: int = 0  # without one, their capture recorded as failed
    misaligned: int = 0  # with one whose length differs from the sample's tokens
    uncounted: int = 0  # state files of samples the ledger does not count (e.g. a slot of an earlier layout)
    examples: tuple[str, ...] = ()  # the first misaligned samples, described
    state_bytes: int = 0  # the counted state files' bytes, and the tokens they hold (0 where only listed)
    state_tokens: int = 0
    dtypes: tuple[str, ...] = ()  # the dtypes they are stored in

    @property
    def missing(self) -> int:
        """Committed samples with neither states nor a recorded failure: a plain rerun of the pass captures them."""
        return max(0, self.samples - self.captured - self.failed - self.misaligned)

    @property
    def complete(self) -> bool:
        return self.captured >= self.samples

    @property
    def coverage(self) -> float | None:
        return self.captured / self.samples if self.samples else None

    def __add__(self, other: StateCoverage) -> StateCoverage:
        if other.kind != self.kind:
            raise ValueError(f"cannot add {other.kind} states to {self.kind} states")
        return StateCoverage(self.kind, self.samples + other.samples, self.captured + other.captured,
                             self.failed + other.failed, self.misaligned + other.misaligned,
                             self.uncounted + other.uncounted, (self.examples + other.examples)[:EXAMPLES],
                             self.state_bytes + other.state_bytes, self.state_tokens + other.state_tokens,
                             tuple(sorted(set(self.dtypes) | set(other.dtypes))))


# One committed state marker as a coverage reads it: (label, sample key, tokens, bytes, stored dtype); tokens None
# where the marker was listed, not read.
StateRecord = tuple[str, int, "int | None", int, str]


def coverage(kind: str, keys: np.ndarray, lengths: np.ndarray, states: Iterable[StateRecord],
             failed: np.ndarray) -> StateCoverage:
    """`keys`, `lengths`: every committed sample of the scope (sorted 64-bit keys, store/hidden_states.state_key)
    and its sequence length (prompt + output tokens; -1 where it cannot be told, a multi-turn conversation);
    `states`: each committed state marker, streamed; `failed`: the keys whose capture is recorded as failed. A sample
    with states counts as captured or misaligned whatever else is recorded for it (its first marker only). Memory: a
    byte per committed sample, whatever the states."""
    covered = np.zeros(keys.size, dtype=bool)
    misaligned = np.zeros(keys.size, dtype=bool)
    examples: list[str] = []
    uncounted = state_bytes = state_tokens = 0
    dtypes: set[str] = set()
    for label, key, tokens, size, dtype in states:
        at = int(np.searchsorted(keys, np.uint64(key)))
        if at >= keys.size or int(keys[at]) != key:
            uncounted += 1  # a sample the ledger does not count (a slot of an earlier layout, a duplicate)
            continue
        if covered[at]:
            continue
        covered[at] = True
        state_bytes += size
        state_tokens += tokens or 0
        if dtype:
            dtypes.add(dtype)
        length = int(lengths[at])
        if tokens is not None and length >= 0 and tokens != length:
            misaligned[at] = True
            if len(examples) < EXAMPLES:
                examples.append(f"{label}: {tokens} states for {length} tokens")
    recorded = np.isin(keys, failed) & ~covered
    return StateCoverage(kind, int(keys.size), int(covered.sum() - misaligned.sum()), int(recorded.sum()),
                         int(misaligned.sum()), uncounted, tuple(examples), state_bytes, state_tokens,
                         tuple(sorted(dtypes)))


@dataclass(frozen=True)
class Completion:
    """What a scope lacks: its slots without an outcome, its slots given up, and each kind of states it needs."""

    unsettled: int  # slots of the layout without a final outcome
    given_up: int = 0  # slots whose final outcome is a server-side failure (retryable)
    states: tuple[StateCoverage, ...] = ()  # one per kind the spec asks for

    @property
    def settled(self) -> bool:
        return self.unsettled == 0

    @property
    def states_missing(self) -> int:
        return sum(kind.missing for kind in self.states)

    @property
    def states_failed(self) -> int:
        return sum(kind.failed + kind.misaligned for kind in self.states)

    @property
    def verdict(self) -> Verdict:
        if self.unsettled or self.states_missing:
            return "pending"
        if self.given_up or self.states_failed:
            return "given_up"
        return "complete"

    @property
    def complete(self) -> bool:
        return self.verdict == "complete"

    @property
    def retryable(self) -> int:
        """What a retry (--retry-failed, the retry annotation) would run again: given-up slots, failed and missing
        captures."""
        return self.given_up + sum(kind.failed + kind.missing for kind in self.states)

    def kind(self, name: str) -> StateCoverage | None:
        return next((kind for kind in self.states if kind.kind == name), None)

    def kind_done(self, name: str) -> bool:
        """Every committed sample has this kind's states (a pass may move on to the next kind)."""
        found = self.kind(name)
        return self.settled and (found is None or found.complete)

    def pending_kinds(self) -> list[str]:
        """The kinds some committed sample still lacks, neither captured nor recorded as failed, in order."""
        return [kind.kind for kind in self.states if kind.missing]

    def describe(self) -> str:
        """One line: what is missing or given up (`every slot settled and every artifact present` when complete)."""
        parts = []
        if self.unsettled:
            parts.append(f"{self.unsettled} slots without an outcome")
        if self.given_up:
            parts.append(f"{self.given_up} slots given up")
        for kind in self.states:
            if kind.missing:
                parts.append(f"{kind.missing} of {kind.samples} samples without {kind.kind} states")
            if kind.failed:
                parts.append(f"{kind.failed} {kind.kind} captures failed")
            if kind.misaligned:
                parts.append(f"{kind.misaligned} {kind.kind} state files misaligned with their tokens "
                             f"(e.g. {kind.examples[0]})")
        return "; ".join(parts) or "every slot settled and every artifact present"


def combine(parts: Iterable[Completion]) -> Completion:
    """The completion of a whole made of parts (datasets): the counts added, kind by kind."""
    unsettled = given_up = 0
    kinds: dict[str, StateCoverage] = {}
    for part in parts:
        unsettled += part.unsettled
        given_up += part.given_up
        for kind in part.states:
            kinds[kind.kind] = kinds[kind.kind] + kind if kind.kind in kinds else kind
    return Completion(unsettled, given_up, tuple(kinds.values()))
