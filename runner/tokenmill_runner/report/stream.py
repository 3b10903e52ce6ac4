"""What the report needs of a dataset's committed samples, accumulated marker by marker. Pure.

The markers are folded in commit order (`markers.markers_in_commit_order`), each through the dataset's ledger, so a
slot named by two markers counts once (its first row), as everywhere else. Memory follows the range of the values,
not their number (`histograms.py`): token lengths in exact integer histograms (every figure of the report is
exact, whatever the size), latencies exact up to `histograms.EXACT_LIMIT` samples and within
`histograms.RELATIVE_ERROR` above, the first `DRIFT_FIRST_N` completions in commit order for the order-drift test,
and at most `SCATTER_POINTS` (reasoning, answer) pairs for the plot (every pair below that, a uniform sample
above, chosen by slot so it does not depend on the reading order). Per-turn or per-sample-index additions belong in their own accumulator next to this one.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..stats.histograms import FloatSketch, IntHistogram
from ..store.ledger import Completeness, DatasetLedger

DRIFT_FIRST_N = 100
DANGLING_NAMED = 10  # dangling files named in the report (all are counted)
SCATTER_POINTS = 20_000
SAMPLE_COLUMNS = ("sample_id", "line", "prompt_tokens", "completion_tokens", "finish_reason", "matched_stop",
                  "reasoning_end", "reasoning_end_token_id", "has_tool_call", "max_new_tokens", "latency_s")


# Multi-turn rows (mode all-turns) only: turns, why the conversation ended, its last turn's completion tokens and
# how many of its turns hold an end-of-reasoning token
# (`completion_tokens` is the conversation's total; the reasoning, finish and cap columns are the last turn's).
EXTRA_COLUMNS = ("sample_index", "turn_count", "stop_reason", "last_turn_tokens", "reasoning_turns")
# SGLang's accounting (markers written before them read as nulls and are left out of these figures): prompt tokens
# found in the prefix cache, prompt tokens sent (a conversation's over all its turns), and the generations whose
# meta_info.reasoning_tokens disagrees with the recorded reasoning end.
SERVER_COLUMNS = ("cached_tokens", "sent_prompt_tokens", "reasoning_disagreements")


def _last_turn(s: dict[str, list[Any]]) -> np.ndarray:
    """Completion tokens of the generation the per-sample columns describe (the last turn of a conversation)."""
    return _ints([total if last is None else last
                  for total, last in zip(s["completion_tokens"], s["last_turn_tokens"], strict=True)])


def _column(samples: dict[str, list[Any]], name: str, count: int) -> list[Any]:
    # Markers written before a column existed (reasoning_end_token_id) read as nulls.
    return samples.get(name) or [None] * count


def _ints(values: list[Any]) -> np.ndarray:
    return np.asarray([0 if v is None else v for v in values], dtype=np.int64)


def _priorities(slots: np.ndarray) -> np.ndarray:
    """A pseudo-random number per slot (splitmix64's finalizer): the same slot always gets the same one."""
    z = slots.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class ReasoningPoints:
    """(reasoning, answer) pairs for the scatter plot: every pair up to `limit`, then a uniform sample of `limit`
    of them: the pairs whose slots have the smallest pseudo-random priorities (bottom-k sampling), so the picture
    does not depend on the order markers are read in. Memory: fixed arrays of 2 x limit entries."""

    def __init__(self, limit: int = SCATTER_POINTS) -> None:
        self.limit = limit
        self.seen = 0
        self._used = 0
        self._priority = np.empty(0, dtype=np.uint64)
        self._pairs = np.empty((0, 2), dtype=np.int64)
        self._threshold: int | None = None  # the limit-th smallest priority kept, once more than limit were seen

    def add(self, slots: np.ndarray, reasoning: np.ndarray, answer: np.ndarray) -> None:
        if self._priority.size == 0:
            self._priority = np.empty(2 * self.limit, dtype=np.uint64)
            self._pairs = np.empty((2 * self.limit, 2), dtype=np.int64)
        self.seen += int(slots.size)
        priority = _priorities(slots)
        for start in range(0, priority.size, self.limit):
            self._append(priority[start:start + self.limit], reasoning[start:start + self.limit],
                         answer[start:start + self.limit])

    def _append(self, priority: np.ndarray, reasoning: np.ndarray, answer: np.ndarray) -> None:
        if self._threshold is not None:
            keep = priority < np.uint64(self._threshold)
            priority, reasoning, answer = priority[keep], reasoning[keep], answer[keep]
        if self._used + priority.size > self._priority.size:
            self._shrink()
        end = self._used + priority.size
        self._priority[self._used:end] = priority
        self._pairs[self._used:end, 0], self._pairs[self._used:end, 1] = reasoning, answer
        self._used = end

    def _shrink(self) -> None:
        if self._used <= self.limit:
            return
        order = np.argpartition(self._priority[:self._used], self.limit - 1)[:self.limit]
        self._priority[:self.limit], self._pairs[:self.limit] = self._priority[order], self._pairs[order]
        self._used = self.limit
        self._threshold = int(self._priority[:self.limit].max())

    @property
    def reasoning(self) -> np.ndarray:
        self._shrink()
        return self._pairs[:self._used, 0].copy()

    @property
    def answer(self) -> np.ndarray:
        self._shrink()
        return self._pairs[:self._used, 1].copy()

    @property
    def sampled(self) -> bool:
        return self.seen > self.limit


@dataclass
class DatasetSamples:
    """A dataset's committed samples as the report sees them, accumulated from its markers in commit order."""

    name: str
    lines: int | None = None  # source lines of the current layout (run.json), when known: completeness is checked
    per_prompt: int = 1  # samples per prompt of the current layout (spec.datasets[].samples)
    # a bit (or bool) per line of 1..lines: a slot's line (None: every one; blank lines not); DatasetLedger.completeness
    within: np.ndarray | None = None
    no_layout: str | None = None  # why completeness cannot be judged although samples are committed (no run.json)
    ledger: DatasetLedger | None = None
    duplicate_rows: int = 0  # rows of slots that already had one: committed twice (two writers)
    dangling: list[str] = field(default_factory=list)  # the first DANGLING_NAMED files markers name that are gone
    dangling_markers: int = 0  # markers that name a file that does not exist
    completions: IntHistogram = field(default_factory=IntHistogram)
    first_completions: list[int] = field(default_factory=list)  # the first DRIFT_FIRST_N, in commit order
    prompts: IntHistogram = field(default_factory=IntHistogram)
    budgets: IntHistogram = field(default_factory=IntHistogram)  # prompt tokens + max_new_tokens
    reasoning: IntHistogram = field(default_factory=IntHistogram)  # tokens before the end-of-reasoning token
    answers: IntHistogram = field(default_factory=IntHistogram)  # tokens after it, the closing stop token excluded
    points: ReasoningPoints = field(default_factory=ReasoningPoints)
    latency: FloatSketch = field(default_factory=FloatSketch)
    finish_reasons: Counter[str] = field(default_factory=Counter)
    stop_tokens: Counter[int] = field(default_factory=Counter)
    end_tokens: Counter[int | None] = field(default_factory=Counter)  # per sample with reasoning: the token that ended it
    truncated_while_reasoning: int = 0
    at_cap: int = 0
    caps: set[int] = field(default_factory=set)
    tool_calls: int = 0
    errors: Counter[str] = field(default_factory=Counter)  # final failures by reason (retried ones excluded)
    turns: IntHistogram = field(default_factory=IntHistogram)  # assistant turns per conversation (mode all-turns)
    stop_reasons: Counter[str] = field(default_factory=Counter)  # why each conversation ended
    earlier_turns: int = 0  # generations of conversations before their last turn (which the sample columns describe)
    earlier_reasoning: int = 0  # of those, the ones whose output holds an end-of-reasoning token
    cache_rows: int = 0  # samples whose marker records cached_tokens
    cached_tokens: int = 0  # prompt tokens SGLang found in its prefix cache, over those samples' requests
    sent_tokens: int = 0  # prompt tokens sent, over the same requests
    reasoning_disagreements: int = 0  # generations whose reasoning_tokens (SGLang's) disagrees with reasoning_end

    def __post_init__(self) -> None:
        if self.ledger is None:
            self.ledger = DatasetLedger(self.name, self.lines or 0, self.per_prompt)

    @property
    def samples(self) -> int:
        return self.completions.count

    def completeness(self) -> Completeness | None:
        """The current layout's slots and their outcomes (None when run.json gives no layout)."""
        if self.lines is None or self.ledger is None:
            return None
        return self.ledger.completeness(self.lines, self.per_prompt, self.within)

    def add_markers(self, markers: list[dict[str, Any]]) -> None:
        for marker in markers:
            self.add_marker(marker)

    def check_files(self, marker: dict[str, Any], missing: list[str]) -> None:
        """Note a marker whose files (`shards.missing_files`) are gone: its samples are counted, not exportable."""
        if not missing:
            return
        self.dangling_markers += 1
        room = DANGLING_NAMED - len(self.dangling)
        self.dangling.extend(f"{self.name}/{name}" for name in missing[:max(room, 0)])

    def add_marker(self, marker: dict[str, Any]) -> np.ndarray:
        """Fold a marker in; returns the positions of its rows that counted (their slot's first row)."""
        assert self.ledger is not None
        taken = self.ledger.fold(marker)
        self.errors = Counter(self.ledger.final_failures())
        samples = marker["samples"]
        count = len(samples.get("line") or [])
        self.duplicate_rows += count - int(taken.size)
        if not taken.size:
            return taken
        if taken.size == count:  # every row is new (the usual case): no copy
            columns = {name: _column(samples, name, count) for name in (*SAMPLE_COLUMNS, *EXTRA_COLUMNS,
                                                                        *SERVER_COLUMNS)}
        else:
            columns = {name: [values[i] for i in taken.tolist()]
                       for name in (*SAMPLE_COLUMNS, *EXTRA_COLUMNS, *SERVER_COLUMNS)
                       for values in [_column(samples, name, count)]}
        self._add_server_accounting(columns)
        self._add_conversations(columns)
        self._add_lengths(columns)
        self._add_reasoning(columns)
        self._add_counts(columns)
        self.latency.add([math.nan if v is None else v for v in columns["latency_s"]])
        return taken

    def _add_server_accounting(self, s: dict[str, list[Any]]) -> None:
        for cached, sent, prompt, disagreements in zip(s["cached_tokens"], s["sent_prompt_tokens"],
                                                        s["prompt_tokens"], s["reasoning_disagreements"], strict=True):
            self.reasoning_disagreements += disagreements or 0
            if cached is None:
                continue
            self.cache_rows += 1
            self.cached_tokens += cached
            self.sent_tokens += prompt if sent is None else sent

    def _add_conversations(self, s: dict[str, list[Any]]) -> None:
        turns = [n for n in s["turn_count"] if n is not None]
        if turns:
            self.turns.add(np.asarray(turns, dtype=np.int64))
            self.stop_reasons.update(r for r in s["stop_reason"] if r is not None)
            self.earlier_turns += sum(turns) - len(turns)
            self.earlier_reasoning += sum(
                (with_end or 0) - (end is not None)
                for with_end, end, count in zip(s["reasoning_turns"], s["reasoning_end"], s["turn_count"], strict=True)
                if count is not None)

    @property
    def generations(self) -> int:
        """Answers generated: a sample each, plus the earlier turns of conversations (what truncation and
        reasoning shares are of: a turn is one generation, as in the exports)."""
        return self.samples + self.earlier_turns

    @property
    def with_reasoning(self) -> int:
        return self.reasoning.count + self.earlier_reasoning

    def _add_lengths(self, s: dict[str, list[Any]]) -> None:
        done, prompt, caps = _ints(s["completion_tokens"]), _ints(s["prompt_tokens"]), _ints(s["max_new_tokens"])
        last = _last_turn(s)
        room = DRIFT_FIRST_N - len(self.first_completions)
        if room > 0:
            self.first_completions.extend(done[:room].tolist())
        self.completions.add(done)
        self.prompts.add(prompt)
        self.budgets.add(prompt + caps)
        self.caps.update(int(cap) for cap in np.unique(caps[caps > 0]).tolist())
        self.at_cap += int(((caps > 0) & (last >= caps)).sum())

    def _add_reasoning(self, s: dict[str, list[Any]]) -> None:
        end = np.asarray([-1 if v is None else v for v in s["reasoning_end"]], dtype=np.int64)
        has = end >= 0
        done = _last_turn(s)
        stop = np.asarray([f == "stop" for f in s["finish_reason"]], dtype=bool)
        length = np.asarray([f == "length" for f in s["finish_reason"]], dtype=bool)
        matched = np.asarray([m is not None for m in s["matched_stop"]], dtype=bool)
        self.truncated_while_reasoning += int((~has & length).sum())
        if not has.any():
            return
        reasoning = end[has]
        answer = (done - end - 1 - (stop & matched))[has]
        self.end_tokens.update(t for t, h in zip(s["reasoning_end_token_id"], has.tolist(), strict=True) if h)
        self.reasoning.add(reasoning)
        self.answers.add(answer)
        slots = _ints(s["line"]) * 1024 + _ints(s["sample_index"])
        self.points.add(slots[has], reasoning, answer)

    def _add_counts(self, s: dict[str, list[Any]]) -> None:
        self.finish_reasons.update(s["finish_reason"])
        self.stop_tokens.update(m for m in s["matched_stop"] if m is not None)
        self.tool_calls += sum(1 for flag in s["has_tool_call"] if flag)

    def merge(self, other: DatasetSamples) -> None:
        """Add another dataset's samples (for the overall figures; commit order across datasets is not kept)."""
        for mine, theirs in ((self.completions, other.completions), (self.prompts, other.prompts),
                             (self.budgets, other.budgets), (self.reasoning, other.reasoning),
                             (self.answers, other.answers)):
            mine.merge(theirs)
        self.latency.merge(other.latency)
        self.finish_reasons.update(other.finish_reasons)
        self.stop_tokens.update(other.stop_tokens)
        self.end_tokens.update(other.end_tokens)
        self.errors.update(other.errors)
        self.truncated_while_reasoning += other.truncated_while_reasoning
        self.at_cap += other.at_cap
        self.caps |= other.caps
        self.tool_calls += other.tool_calls
        self.duplicate_rows += other.duplicate_rows
        self.dangling_markers += other.dangling_markers
        self.turns.merge(other.turns)
        self.earlier_turns += other.earlier_turns
        self.earlier_reasoning += other.earlier_reasoning
        self.cache_rows += other.cache_rows
        self.cached_tokens += other.cached_tokens
        self.sent_tokens += other.sent_tokens
        self.reasoning_disagreements += other.reasoning_disagreements
        self.stop_reasons.update(other.stop_reasons)
