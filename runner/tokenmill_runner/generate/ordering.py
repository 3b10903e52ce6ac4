"""Longest-expected-first admission over the whole job, and input order when the length key proves weak. Pure.

A long-tailed job's makespan is set by its longest samples: one 10k-token request started in the last minutes
runs alone on an otherwise idle server. Sending the samples expected to run longest first lets the short ones fill
the batch around them until the end (DESIGN.md "Throughput: the tail decides the makespan").

The expectation (`expected_tokens`): the row's earlier answer's length (`source/length_key.py`), capped at the
dataset's maxNewTokens; without one, the dataset's typical output (its committed mean, else a share of its cap),
longer prompts a little ahead. Datasets are compared on that one scale, so a reasoning set's prompts go before a
function-calling set's.

The whole job, not a window: the counting pass recorded each line's length code (one byte a line), so the stream
knows every line's expectation before it reads one. It reads the sources in *passes*, each over the lines of some
codes, longest expected first (`plan_passes`): a pass of about a window's worth of slots, then two, four ... and
the rest; within and across passes a bounded window (`LongestFirst`) orders what was read. Memory stays flat: a
pass skips every line not its own before parsing it, and the codes are read back in line order like the source.
Which slots are generated, and how each is committed, does not change: only when a request is sent. Ties keep the
source's order (a sequence number breaks them), so a run and its resume send the same requests in the same order.

A key can be weak (earlier answers unrelated to the new ones, prompts whose length says nothing), and then
longest-first is no better than input order and, measured on the simulator, a few percent worse (docs/scale.md).
So the first requests sent are a *probe*: the first lines of each dataset in input order, whatever their key
(`probe_size` of them). When all have come back, `KeyCheck` compares the keys with the lengths the server drew
(the correlation of their logarithms, as bench_ordering.py defines the key's strength); under WEAK_KEY the rest of
the job goes in input order: the window releases what it holds in arrival order and one pass reads every line not
read yet.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from ..source.length_key import CHARS_PER_TOKEN, answer_tokens, earlier_answer_chars, prompt_class

Item = TypeVar("Item")

# Requests held for ordering, per unit of concurrency: 16 batches' worth lets the longest of the last stretch start
# early enough to finish with it (hack/bench/bench_ordering.py: makespan / lower bound by window size).
WINDOW_PER_SLOT = 16
MAX_WINDOW = 8192
# Passes over the sources: FLAT_PASSES of a window's worth of slots each (the window sorts each whole), then 2, 4 ...
# windows, the last taking the rest. Each pass reads the sources again (lines not its own are skipped unparsed).
# bench_ordering.py at rho 0.8: this keeps 98 % (10k samples, 64 slots) and 97 % (20k, 256) of what sorting the
# whole job gains; 1, 2, 4 windows and the rest kept 96 % and 70 %.
FLAT_PASSES = 4
MAX_PASSES = 8
PROMPT_CLASS_STEP = 0.05  # rows without an answer: each longer prompt class a little ahead of the shorter
# The probe: the first slots of the job in input order, whose lengths say whether the key predicts them.
PROBE_SHARE = 0.02
MIN_PROBE = 64
MAX_PROBE = 512
WEAK_KEY = 0.6  # corr(ln key, ln new length) under which the key is weak (bench_ordering.py: 0.5 gains nothing)


def expected_tokens(messages: list[dict[str, Any]], prompt_tokens: float, max_new_tokens: int,
                    typical: float) -> float:
    """The ordering key of a row: its earlier answer's length in tokens (at most the cap), else the dataset's
    `typical` output, longer prompts a little ahead."""
    chars = earlier_answer_chars(messages)
    if chars:
        tokens = chars / CHARS_PER_TOKEN
        return min(tokens, float(max_new_tokens)) if max_new_tokens else tokens
    return typical * (1.0 + PROMPT_CLASS_STEP * prompt_class(prompt_tokens))


def code_tokens(code: int, max_new_tokens: int, typical: float) -> float:
    """`expected_tokens` of the lines of one length code (source/length_key.py): the middle of its answers' range,
    or the typical output of its prompt class."""
    answer = answer_tokens(code)
    if answer is not None:
        return min(answer, float(max_new_tokens)) if max_new_tokens else answer
    return typical * (1.0 + PROMPT_CLASS_STEP * (code - 1))


def expected_output_tokens(messages: list[dict[str, Any]], prompt_tokens: int) -> float:
    """The earlier answer's length in tokens, else the prompt's class (0-3): the key as it was before the whole-job
    order (bench_ordering.py compares them)."""
    chars = earlier_answer_chars(messages)
    return chars / CHARS_PER_TOKEN if chars else float(prompt_class(prompt_tokens))


def window_size(concurrency: int) -> int:
    return max(1, min(WINDOW_PER_SLOT * concurrency, MAX_WINDOW))


def probe_size(slots: int) -> int:
    """Probe slots of a job of `slots` open slots (0: too small to be worth a verdict: the window orders it all)."""
    if slots < 4 * MIN_PROBE:
        return 0
    return max(MIN_PROBE, min(MAX_PROBE, int(slots * PROBE_SHARE)))


@dataclass(frozen=True)
class Cell:
    """The lines of one dataset with one length code: how many slots they hold and how long each is expected."""

    dataset: int
    code: int
    slots: int
    expected: float


def plan_passes(cells: Sequence[Cell], window: int, max_passes: int = MAX_PASSES) -> list[dict[int, frozenset[int]]]:
    """The passes over the sources, longest expected first: per pass, per dataset, the codes it reads. A pass closes
    once it holds `window` slots (the first FLAT_PASSES), then twice as many each; the last takes the rest. One pass
    (every code) when the job fits the window: the window orders it whole."""
    live = sorted((cell for cell in cells if cell.slots > 0), key=lambda cell: (-cell.expected, cell.dataset, cell.code))
    datasets = sorted({cell.dataset for cell in cells})
    every = frozenset(range(256))  # any byte a codes object holds, a foreign one's too: no line left unread
    passes: list[dict[int, frozenset[int]]] = []
    if sum(cell.slots for cell in live) > window and max_passes > 1:
        current: dict[int, set[int]] = {}
        held = 0
        for cell in live[:-1]:
            current.setdefault(cell.dataset, set()).add(cell.code)
            held += cell.slots
            if held >= window << max(0, len(passes) - FLAT_PASSES + 1):
                passes.append({dataset: frozenset(codes) for dataset, codes in current.items()})
                current, held = {}, 0
                if len(passes) == max_passes - 1:
                    break
    # The last pass reads every line no earlier pass read: the rest of the codes, and code 0 (rows that are no
    # request: bad rows get their error records there), so each line is read exactly once.
    claimed: dict[int, set[int]] = {}
    for earlier in passes:
        for dataset, codes in earlier.items():
            claimed.setdefault(dataset, set()).update(codes)
    passes.append({dataset: every - frozenset(claimed.get(dataset, ())) for dataset in datasets})
    return passes


@dataclass
class KeyCheck:
    """The probe's keys and the lengths the server drew for them; the verdict once every probe slot is back."""

    size: int = 0  # probe slots to send
    expected: dict[Hashable, float] = field(default_factory=dict)  # probe slots sent, not back yet
    pairs: list[tuple[float, float]] = field(default_factory=list)
    closed: bool = False  # every probe slot has been sent
    rho: float | None = None

    def sent(self, slot: Hashable, expected: float) -> None:
        self.expected[slot] = expected

    def back(self, slot: Hashable, tokens: int | None) -> None:
        """A slot's outcome: its completion tokens, or None (it failed: no length to compare)."""
        expected = self.expected.pop(slot, None)
        if expected is not None and tokens is not None:
            self.pairs.append((expected, float(tokens)))

    @property
    def weak(self) -> bool | None:
        """True when the key does not predict the lengths (corr(ln key, ln length) < WEAK_KEY, or a key that is
        the same for every probe slot), False when it does, None while the probe is out."""
        if not self.closed or self.expected:
            return None
        if self.rho is None:
            self.rho = log_correlation(self.pairs)
        return self.rho < WEAK_KEY


def log_correlation(pairs: Sequence[tuple[float, float]]) -> float:
    """Pearson's correlation of ln(1 + key) and ln(1 + length); 0 when either does not vary (or too few pairs)."""
    if len(pairs) < 3:
        return 0.0
    xs = [math.log1p(max(x, 0.0)) for x, _ in pairs]
    ys = [math.log1p(max(y, 0.0)) for _, y in pairs]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    if sxx <= 1e-12 or syy <= 1e-12:
        return 0.0
    return sxy / math.sqrt(sxx * syy)


@dataclass
class LongestFirst(Generic[Item]):
    """A bounded window that releases the item with the longest expected output first; ties in arrival order.
    `in_arrival_order()` turns it into a FIFO for the rest of its life (the key proved weak)."""

    window: int
    _heap: list[tuple[float, int, Item]] = field(default_factory=list)
    _sequence: int = 0
    _fifo: bool = False

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, item: Item, expected: float) -> Item | None:
        """Add an item; when the window is full, the longest expected one is released."""
        heapq.heappush(self._heap, (0.0 if self._fifo else -expected, self._sequence, item))
        self._sequence += 1
        if len(self._heap) > self.window:
            return heapq.heappop(self._heap)[2]
        return None

    def pop(self) -> Item:
        """The next item the window would release (longest expected first, or in arrival order)."""
        return heapq.heappop(self._heap)[2]

    def in_arrival_order(self) -> None:
        if not self._fifo:
            self._fifo = True
            self._heap = [(0.0, sequence, item) for _, sequence, item in self._heap]
            heapq.heapify(self._heap)

    def drain(self) -> Iterator[Item]:
        """The rest, longest expected first."""
        while self._heap:
            yield heapq.heappop(self._heap)[2]


@dataclass
class ReadProgress:
    """What the passes have read of one dataset's source, so each line is read once: the probe's lines (every line
    up to `probe_end`), the codes of the finished passes, and the current pass's codes up to `position`."""

    probe_end: int = 0
    done: set[int] = field(default_factory=set)
    current: frozenset[int] = frozenset()
    position: int = 0

    def begin(self, codes: frozenset[int]) -> None:
        self.current, self.position = codes, self.probe_end

    def end(self) -> None:
        self.done |= self.current
        self.current = frozenset()

    def in_pass(self, line: int, code: int) -> bool:
        return line > self.probe_end and code in self.current

    def unread(self, line: int, code: int) -> bool:
        """Not read by the probe, a finished pass, or the current pass so far (the fallback's one pass reads it)."""
        return line > self.probe_end and code not in self.done and (code not in self.current or line > self.position)
