"""Longest-expected-first admission. Pure.

A long-tailed job's makespan is set by its longest samples: one 10k-token request started in the last minutes
runs alone on an otherwise idle server. Sending the samples expected to run longest first lets the short ones fill
the batch around them until the end (DESIGN.md "Throughput: the tail decides the makespan").

The expectation: a source row usually carries an earlier answer, the assistant turn(s) being regenerated; their
length predicts the new one (the same task, the same kind of answer). Without one, the prompt's length stands in:
a coarse class, since a long prompt (a document, a code base) asks for a longer answer more often than a short one.

The order is kept within a bounded window, so memory stays flat whatever the source's size: the producer fills
a heap of up to `window` tokenized requests and hands the longest expected one to the workers whenever the heap is
full, then the rest longest first at the end. Which slots are generated, and how each is committed, does not
change: only when a request is sent. Ties keep the source's order (a sequence number breaks them), so a run and
its resume send the same requests in the same order.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

Item = TypeVar("Item")

# The answer's characters per token, only to put answers and prompt classes on one scale: the order needs a
# monotone estimate, not an exact count.
CHARS_PER_TOKEN = 4.0
# Prompt length classes (tokens) for rows without an earlier answer, and the output each class stands for: the
# order among them is what matters, and every class ranks below a row whose earlier answer is known to be long.
PROMPT_CLASSES = (256, 1024, 4096)
# Requests held for ordering, per unit of concurrency: 16 batches' worth lets the longest of the last stretch start
# early enough to finish with it (hack/bench/bench_ordering.py: makespan / lower bound by window size).
WINDOW_PER_SLOT = 16
MAX_WINDOW = 8192


def _text_length(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):  # multi-part content: the text parts
        return sum(len(part.get("text") or "") for part in content if isinstance(part, dict))
    return 0


def earlier_answer_chars(messages: list[dict[str, Any]]) -> int:
    """Characters of the row's assistant turns: content, reasoning and tool-call arguments."""
    total = 0
    for message in messages:
        if message.get("role") != "assistant":
            continue
        total += _text_length(message.get("content")) + _text_length(message.get("reasoning_content"))
        for call in message.get("tool_calls") or ():
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict):
                total += len(str(function.get("arguments") or ""))
    return total


def expected_output_tokens(messages: list[dict[str, Any]], prompt_tokens: int) -> float:
    """The ordering key: the earlier answer's length in tokens, else the prompt's class (0, 1, 2 or 3 tokens: below
    any row with an earlier answer of at least 4 tokens, ordered among themselves)."""
    chars = earlier_answer_chars(messages)
    if chars:
        return chars / CHARS_PER_TOKEN
    return float(sum(prompt_tokens >= bound for bound in PROMPT_CLASSES))


def window_size(concurrency: int) -> int:
    return max(1, min(WINDOW_PER_SLOT * concurrency, MAX_WINDOW))


@dataclass
class LongestFirst(Generic[Item]):
    """A bounded window that releases the item with the longest expected output first; ties in arrival order."""

    window: int
    _heap: list[tuple[float, int, Item]] = field(default_factory=list)
    _sequence: int = 0

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, item: Item, expected: float) -> Item | None:
        """Add an item; when the window is full, the longest expected one is released."""
        heapq.heappush(self._heap, (-expected, self._sequence, item))
        self._sequence += 1
        if len(self._heap) > self.window:
            return heapq.heappop(self._heap)[2]
        return None

    def drain(self) -> Iterator[Item]:
        """The rest, longest expected first."""
        while self._heap:
            yield heapq.heappop(self._heap)[2]
